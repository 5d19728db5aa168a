"""The Fabric front ends on one process: exact against a full-batch pass, the core's errors, state, logging, litgpt."""

from __future__ import annotations

import copy
import csv

import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.loggers import CSVLogger

from lightning_accum import FabricAccumulation, FabricMicroBatching, keys
from lightning_accum.memory.oom import OOMFault, OOMInjector
from lightning_accum.schedules import as_schedule
from lightning_accum.sequences import PaddedSequences
from tests.helpers import TokenDataset, count_tokens

DATA = TokenDataset(20, seq_len=8, dim=5, seed=3)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(5, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


def loss_fn(model, batch):
    per_token = (model(batch["x"]).squeeze(-1) - batch["y"]) ** 2
    return (per_token * batch["mask"]).sum() / batch["mask"].sum().clamp(min=1)


def batch_of(indices):
    return {k: torch.stack([DATA[i][k] for i in indices]) for k in ("x", "y", "mask")}


def setup(logger=None):
    fabric = Fabric(accelerator="cpu", devices=1, loggers=logger)
    net = Net()
    reference = copy.deepcopy(net)
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    return fabric, model, optimizer, reference


def reference_grad(reference, indices):
    reference.zero_grad()
    loss_fn(reference, batch_of(indices)).backward()
    grads = [p.grad.clone() for p in reference.parameters()]
    with torch.no_grad():
        for p in reference.parameters():
            p -= 0.1 * p.grad
    return grads


LOADER = [list(range(i, min(i + 3, 20))) for i in range(0, 20, 3)]  # 7 micro-batches, the last of 2 samples


def window_loop(acc, model, optimizer, reference, loader=LOADER, stop_after=None):
    window: list[int] = []
    for indices in acc.batches(loader):
        with acc.micro_batch(batch_of(indices)):
            acc.backward(loss_fn(model, batch_of(indices)))
        window += indices
        if acc.should_step:
            for p, r in zip(model.module.parameters(), reference_grad(reference, window), strict=True):
                torch.testing.assert_close(p.grad, r, rtol=1e-5, atol=1e-6)
            optimizer.step()
            optimizer.zero_grad()
            window = []
            if stop_after is not None and acc.optimizer_steps == stop_after:
                return


@pytest.mark.parametrize("schedule", [3, {0: 2, 2: 3}])
def test_window_mode_is_the_full_window_token_mean_tail_included(schedule):
    fabric, model, optimizer, reference = setup()
    acc = FabricAccumulation(fabric, model, optimizer, schedule, unit="step", count_items=count_tokens)
    window_loop(acc, model, optimizer, reference)
    window_loop(acc, model, optimizer, reference)  # a second epoch with the same object
    assert acc.consumed_samples == 40 and acc.epoch == 2


@pytest.mark.parametrize("bad", [0, -1])
def test_a_bad_k_raises_the_cores_error(bad):
    with pytest.raises(ValueError) as core:
        as_schedule(bad, "epoch")
    fabric, model, optimizer, _ = setup()
    with pytest.raises(ValueError, match="`schedule`") as ours:
        FabricAccumulation(fabric, model, optimizer, bad)
    assert str(ours.value) == str(core.value)


def test_a_module_not_set_up_is_refused():
    fabric = Fabric(accelerator="cpu", devices=1)
    with pytest.raises(TypeError, match=r"^`model` must be the module `fabric\.setup` returned"):
        FabricAccumulation(fabric, Net(), None, 2)


def test_an_optimizer_over_other_parameters_is_refused():
    # Before: an optimizer made before `fully_shard` replaced the parameters ran, and split mode's first step died in
    # `torch._foreach_mul_` ("Tensor list must have at least one tensor"); window mode weighed nothing.
    fabric = Fabric(accelerator="cpu", devices=1)
    model = fabric.setup_module(Net())
    optimizer = fabric.setup_optimizers(torch.optim.SGD(Net().parameters(), lr=0.1))
    for front_end in (FabricAccumulation, FabricMicroBatching):
        with pytest.raises(ValueError, match=r"^`optimizer` holds parameters that are not `model`'s.*setup_module"):
            front_end(fabric, model, optimizer)


def test_state_resumes_mid_epoch_through_fabric_save_and_load(tmp_path):
    fabric, model, optimizer, reference = setup()
    acc = FabricAccumulation(fabric, model, optimizer, {0: 2, 1: 3}, unit="step", count_items=count_tokens)
    window_loop(acc, model, optimizer, reference, stop_after=2)  # 5 of 7 micro-batches run
    assert acc.batch_in_epoch == 5
    saved = acc.state_dict()
    fabric.save(tmp_path / "ckpt", {"model": model, "optimizer": optimizer, "acc": acc})
    with pytest.raises(RuntimeError, match="inside a window"):
        with acc.micro_batch(batch_of([0])):
            acc.backward(loss_fn(model, batch_of([0])))
            acc.state_dict()
    fabric2, model2, optimizer2, _ = setup()
    acc2 = FabricAccumulation(fabric2, model2, optimizer2, {0: 2, 1: 3}, unit="step", count_items=count_tokens)
    fabric2.load(tmp_path / "ckpt", {"model": model2, "optimizer": optimizer2, "acc": acc2})
    assert acc2.state_dict() == saved
    window_loop(acc2, model2, optimizer2, reference)  # the rest of the epoch: the reference continues exactly
    assert acc2.optimizer_steps == 3 and acc2.consumed_samples == 20


def test_split_mode_recovers_from_an_oom_and_splits_by_tokens_exactly():
    fabric, model, optimizer, reference = setup()
    injector = OOMInjector(OOMFault(step=0, micro_batch=1, phase="backward"))
    acc = FabricMicroBatching(
        fabric, model, optimizer, sequences=PaddedSequences(mask="mask"), micro_batch_tokens=24,
        count_items=count_tokens, fault_injector=injector,
    )  # fmt: skip
    for step in range(2):
        indices = list(range(step * 10, step * 10 + 10))
        acc.step(batch_of(indices), loss_fn)
        for p, r in zip(model.module.parameters(), reference_grad(reference, indices), strict=True):
            torch.testing.assert_close(p.grad, r, rtol=1e-5, atol=1e-6)
        optimizer.step()
    assert acc.oom_retries == 1 and injector.fired
    assert acc.last_step_report.micro_batch_tokens is not None


def test_the_monitors_keys_reach_fabrics_loggers(tmp_path):
    fabric, model, optimizer, reference = setup(CSVLogger(tmp_path, name="run"))
    acc = FabricAccumulation(fabric, model, optimizer, 2, count_items=count_tokens, log_every_n_steps=1)
    window_loop(acc, model, optimizer, reference)
    fabric.logger.finalize("success")
    rows = list(csv.DictReader(open(next(tmp_path.rglob("metrics.csv")))))
    assert len(rows) == acc.optimizer_steps == 4
    assert {*keys.BATCH_KEYS, keys.WINDOW_LOSS, keys.PEAK_GIB} <= set(rows[0])
    assert [float(r[keys.EFFECTIVE_BATCH_SIZE]) for r in rows] == [6, 6, 6, 2]
    assert "4 optimizer steps" in acc.summary_text()


def test_the_litgpt_recipe_measures_litgpts_error_and_ours():
    pytest.importorskip("litgpt")
    from examples.litgpt_finetune.finetune import main

    result = main(devices=1, steps=2)
    assert result["ours_error"] < 1e-5 < 0.05 < result["litgpt_error"]
    assert result["throughput"]["lightning_accum"]["padding"] < result["throughput"]["litgpt"]["padding"]
    ours, theirs = result["throughput"]["lightning_accum"], result["throughput"]["litgpt"]
    assert 0 < ours["activations_mib"] <= ours["peak_mib"] <= theirs["peak_mib"]  # measured, not argued
