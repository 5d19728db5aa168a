"""The `Trainer` callbacks, unchanged, under Ray Train's Lightning integration, against plain Lightning DDP.

What a Ray Train user writes (`TorchTrainer` with 2 CPU workers; inside, a `Trainer` with `RayDDPStrategy`,
`RayLightningEnvironment`, `prepare_trainer` and `RayTrainReportCallback`) runs the same steps as Lightning's own
`ddp_spawn` on 2 CPU processes, bit for bit: window mode, split mode with an OOM injected on one worker, and split
mode resumed from the checkpoint Ray's report callback saved. The metrics that callback reports carry the
monitor's `accum/*` keys (docs/scaling-out.md, "Ray Train", says which).

The same holds with `BalancedBatchSampler` in the DataLoader (ranks dealt by cost, with unequal sample counts). One
local Ray cluster for the module, four `TorchTrainer` runs in all (Ray starts slowly); the cluster is shut down
whatever happens, so a failing test leaves no Ray process behind.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

import tests.helpers as h
from lightning_accum import AccumulationMonitor, AccumulationScheduler, AutoMicroBatching
from lightning_accum.memory.oom import OOMFault, OOMInjector
from lightning_accum.sequences import BalancedBatchSampler

ray = pytest.importorskip("ray", reason="needs Ray Train: pip install 'lightning-accum[ray]'")
pytest.importorskip("ray.train.lightning", reason="needs Ray Train: pip install 'lightning-accum[ray]'")

pytestmark = [pytest.mark.ddp, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[1]
LR = 0.05
SAMPLES = 48  # 24 per rank
WINDOW = {"batch_size": 4, "k": 3}  # 6 micro-batches per rank per epoch: 2 steps of 3
SPLIT = {"batch_size": 8, "micro": 3}  # 3 steps per rank per epoch, each in micro-batches of 3, 3 and 2
# An OOM in the backward of worker 1's second micro-batch of step 1: both workers re-run step 1 smaller, then grow.
FAULTS = [OOMFault(step=1, micro_batch=1, phase="backward", rank=1)]


class SaveRun(pl.Callback):
    """Saves each rank's step gradients and samples, its final parameters and what the owner did."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_train_end(self, trainer: pl.Trainer, pl_module: h.TokenModel) -> None:
        owner = next((cb for cb in trainer.callbacks if isinstance(cb, AutoMicroBatching)), None)
        figures = {
            "step_grads": pl_module.step_grads,
            "step_indices": pl_module.step_indices,
            "params": {n: p.detach().clone() for n, p in pl_module.named_parameters()},
            "oom_retries": owner.oom_retries if owner is not None else 0,
            "global_step": trainer.global_step,
        }
        torch.save(figures, os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt"))


def skewed_data() -> h.TokenDataset:
    """A long sequence in four (8 tokens), the rest 1 to 3: a deal by tokens gives the workers unequal counts."""
    return h.TokenDataset(SAMPLES, seed=1, lengths=[8 if i % 4 == 0 else 1 + i % 3 for i in range(SAMPLES)])


def balanced_sampler() -> BalancedBatchSampler:
    """Each step's 12 samples dealt to the 2 workers by their tokens (the ranks come from Lightning's sampler)."""
    return BalancedBatchSampler([int(m.sum()) for m in skewed_data().mask], 12, seed=3)


def accumulation(mode: str) -> pl.Callback:
    if mode == "window":
        return AccumulationScheduler(WINDOW["k"], count_items=h.count_tokens)
    if mode == "balanced":
        return AutoMicroBatching(SPLIT["micro"], pin_micro_batch_size=True, count_items=h.count_tokens)
    return AutoMicroBatching(
        SPLIT["micro"],
        pin_micro_batch_size=True,
        oom_cooldown=1,
        grow_patience=1,
        count_items=h.count_tokens,
        fault_injector=OOMInjector(FAULTS),
    )


def model_and_data(mode: str) -> tuple[h.TokenModel, DataLoader]:
    model = h.TokenModel(lr=LR)
    model.split_mode = mode in ("split", "balanced")
    if mode == "balanced":  # as a user builds it: Lightning puts its DistributedSampler in, for the ranks
        return model, DataLoader(skewed_data(), batch_sampler=balanced_sampler())
    batch_size = WINDOW["batch_size"] if mode == "window" else SPLIT["batch_size"]
    return model, DataLoader(h.TokenDataset(SAMPLES, seed=1), batch_size=batch_size)


def ray_train_loop(config: dict[str, Any]) -> None:
    """What runs on each Ray worker: the Ray Train Lightning recipe of docs/scaling-out.md, with our callbacks."""
    import ray.train
    from ray.train.lightning import RayDDPStrategy, RayLightningEnvironment, RayTrainReportCallback, prepare_trainer

    model, loader = model_and_data(config["mode"])
    trainer = pl.Trainer(
        **h.quiet_trainer_kwargs(),
        accelerator="cpu",
        devices="auto",
        strategy=RayDDPStrategy(),
        plugins=[RayLightningEnvironment()],
        callbacks=[
            accumulation(config["mode"]),
            AccumulationMonitor(),
            SaveRun(config["out_dir"]),
            RayTrainReportCallback(),
        ],
        max_epochs=config["max_epochs"],
        num_sanity_val_steps=0,
        log_every_n_steps=1,
        default_root_dir=config["out_dir"],
    )
    trainer = prepare_trainer(trainer)
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        trainer.fit(model, loader)
    else:
        with checkpoint.as_directory() as folder:
            trainer.fit(model, loader, ckpt_path=os.path.join(folder, RayTrainReportCallback.CHECKPOINT_NAME))


@pytest.fixture(scope="module")
def ray_cluster() -> Any:
    """A local Ray cluster for this module (4 logical CPUs: 2 workers and Ray's own actors), shut down after."""
    ray.init(
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        # The workers import this module by name, and count threads as this process does.
        runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}},
    )
    try:
        yield
    finally:
        ray.shutdown()


def ray_fit(tmp_path: Path, mode: str, max_epochs: int) -> tuple[Any, list[dict[str, Any]]]:
    """A `TorchTrainer` run named after ``mode``: a second run of the same name resumes from the first's checkpoint.

    That is Ray Train's own way to go on after a stop (`resume_from_checkpoint=` is deprecated in Ray Train 2):
    `ray.train.get_checkpoint()` gives the run's latest reported checkpoint.
    """
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    out_dir = tmp_path / f"ray-{mode}-{max_epochs}"
    out_dir.mkdir()
    trainer = TorchTrainer(
        ray_train_loop,
        train_loop_config={"mode": mode, "max_epochs": max_epochs, "out_dir": str(out_dir)},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        run_config=RunConfig(storage_path=str(tmp_path / "ray_results"), name=mode),
    )
    result = trainer.fit()
    return result, load_ranks(out_dir)


def plain_fit(tmp_path: Path, mode: str, max_epochs: int) -> list[dict[str, Any]]:
    """The same run under Lightning's own DDP: `ddp_spawn`, 2 CPU processes, gloo."""
    out_dir = tmp_path / f"plain-{mode}"
    out_dir.mkdir()
    model, loader = model_and_data(mode)
    trainer = h.make_trainer(
        out_dir,
        [accumulation(mode), AccumulationMonitor(), SaveRun(str(out_dir))],
        strategy=h.ddp_strategy(start_method="spawn"),  # Ray runs threads in this process: no fork
        devices=2,
        max_epochs=max_epochs,
    )
    trainer.fit(model, loader)
    return load_ranks(out_dir)


def load_ranks(out_dir: Path) -> list[dict[str, Any]]:
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(2)]


def max_abs_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def test_window_mode_under_ray_train_is_bit_identical_to_plain_ddp_and_reports_the_accum_keys(tmp_path, ray_cluster):
    result, ray_ranks = ray_fit(tmp_path, "window", max_epochs=2)
    plain = plain_fit(tmp_path, "window", max_epochs=2)

    assert [r["global_step"] for r in ray_ranks] == [4, 4]  # 2 windows of 3 micro-batches per epoch
    for ray_rank, plain_rank in zip(ray_ranks, plain, strict=True):
        assert ray_rank["step_indices"] == plain_rank["step_indices"]  # the same samples on the same rank
        assert max_abs_difference(ray_rank["params"], plain_rank["params"]) == 0.0
        h.assert_grads_close(ray_rank["step_grads"], plain_rank["step_grads"], rtol=0, atol=0)
    # And exact: each step's gradient is the token mean over both workers' window (float32 summation order).
    initial, _ = model_and_data("window")
    dataset = h.TokenDataset(SAMPLES, seed=1)
    windows = [a + b for a, b in zip(ray_ranks[0]["step_indices"], ray_ranks[1]["step_indices"], strict=True)]
    h.assert_grads_close(
        ray_ranks[0]["step_grads"], h.replay_reference(initial, dataset, windows, h.token_loss, lr=LR), **h.FP32
    )

    # What `RayTrainReportCallback` reports at each epoch end: `trainer.callback_metrics`, so the monitor's keys at
    # their last logged value, with Ray's `epoch` and `step`.
    metrics = result.metrics
    assert metrics["epoch"] == 1 and metrics["step"] == 4
    assert metrics["accum/accumulation_steps"] == WINDOW["k"]
    assert metrics["accum/micro_batch_size"] == WINDOW["batch_size"]
    assert metrics["accum/effective_batch_size"] == WINDOW["batch_size"] * WINDOW["k"] * 2
    last = windows[-1]
    assert metrics["accum/items_per_step"] == int(dataset.mask[last].sum())
    assert result.checkpoint is not None


def test_split_mode_with_an_oom_and_a_resume_through_rays_checkpoint_is_bit_identical_to_plain_ddp(
    tmp_path, ray_cluster
):
    # Epoch 0 under Ray (the OOM strikes at step 1), then a second `TorchTrainer` of the same run name, which resumes
    # from the checkpoint Ray's report callback saved at the end of it; against one uninterrupted plain-DDP run of 2
    # epochs with the same fault.
    first, first_ranks = ray_fit(tmp_path, "split", max_epochs=1)
    assert first.checkpoint is not None
    assert first.metrics["accum/oom_retries"] == 1
    resumed, resumed_ranks = ray_fit(tmp_path, "split", max_epochs=2)  # the same name: it resumes
    plain = plain_fit(tmp_path, "split", max_epochs=2)

    assert resumed.metrics["epoch"] == 1
    steps = SAMPLES // 2 // SPLIT["batch_size"]
    assert [r["global_step"] for r in first_ranks] == [steps, steps]
    assert [r["global_step"] for r in resumed_ranks] == [2 * steps, 2 * steps]
    assert [r["oom_retries"] for r in first_ranks] == [1, 1]  # the fault struck on worker 1; both re-ran the step
    assert [r["oom_retries"] for r in plain] == [1, 1]
    for rank in range(2):
        # The resumed run's model recorded only epoch 1's steps; together with epoch 0's, the uninterrupted run.
        ray_steps = first_ranks[rank]["step_grads"] + resumed_ranks[rank]["step_grads"]
        ray_indices = first_ranks[rank]["step_indices"] + resumed_ranks[rank]["step_indices"]
        assert ray_indices == plain[rank]["step_indices"]
        h.assert_grads_close(ray_steps, plain[rank]["step_grads"], rtol=0, atol=0)
        assert max_abs_difference(resumed_ranks[rank]["params"], plain[rank]["params"]) == 0.0
    initial, _ = model_and_data("split")
    windows = [a + b for a, b in zip(plain[0]["step_indices"], plain[1]["step_indices"], strict=True)]
    reference = h.replay_reference(initial, h.TokenDataset(SAMPLES, seed=1), windows, h.token_loss, lr=LR)
    h.assert_grads_close(plain[0]["step_grads"], reference, **h.FP32)


def test_ranks_dealt_by_cost_under_ray_train_are_bit_identical_to_plain_ddp_and_exact(tmp_path, ray_cluster):
    # `BalancedBatchSampler` in the user's DataLoader, nothing else changed: under Ray's strategy Lightning rebuilds it
    # with its DistributedSampler, from which it takes the workers' world size and rank, as under plain DDP.
    _, ray_ranks = ray_fit(tmp_path, "balanced", max_epochs=2)
    plain = plain_fit(tmp_path, "balanced", max_epochs=2)

    sampler = balanced_sampler()
    global_batches = sampler.global_batches(0) + sampler.global_batches(1)
    shares = list(zip(ray_ranks[0]["step_indices"], ray_ranks[1]["step_indices"], strict=True))
    assert [sorted(a + b) for a, b in shares] == [sorted(batch) for batch in global_batches]  # none lost or twice
    assert any(len(a) != len(b) for a, b in shares)  # dealt by tokens, not by count
    for ray_rank, plain_rank in zip(ray_ranks, plain, strict=True):
        assert ray_rank["step_indices"] == plain_rank["step_indices"]
        assert max_abs_difference(ray_rank["params"], plain_rank["params"]) == 0.0
        h.assert_grads_close(ray_rank["step_grads"], plain_rank["step_grads"], rtol=0, atol=0)
    initial, _ = model_and_data("balanced")
    windows = [a + b for a, b in shares]
    reference = h.replay_reference(initial, skewed_data(), windows, h.token_loss, lr=LR)
    h.assert_grads_close(ray_ranks[0]["step_grads"], reference, **h.FP32)
