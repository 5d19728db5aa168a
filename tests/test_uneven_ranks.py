"""Split mode on 2 DDP ranks (gloo) whose step batches differ in size, and parameters that some or no rank uses.

Uneven iterable shards, length-bucketing samplers and the last batch of an epoch give ranks different step batches,
so they run different numbers of micro-batches (and sizes) in one optimizer step. The update must still be the exact
mean over every item of the step on both ranks, and identical on both (issue 18, items 1 and 2).
"""

from __future__ import annotations

import copy
import os
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.data import DataLoader, Sampler

import tests.helpers as h
from lightning_accum import AutoMicroBatching
from lightning_accum.memory.oom import OOMFault, OOMInjector
from tests.test_ddp import load_ranks
from tests.test_ddp_split import SaveSplitFigures, SplitModel

pytestmark = [pytest.mark.ddp, pytest.mark.timeout(300)]

LR = 0.05


class RankBatches(Sampler):
    """A batch sampler that gives each rank its own step batches: ``per_rank[r][s]`` are rank r's indices at step s."""

    def __init__(self, per_rank: list[list[list[int]]]) -> None:
        self.per_rank = per_rank

    def __iter__(self):
        rank = dist.get_rank() if dist.is_initialized() else 0
        return iter(self.per_rank[rank])

    def __len__(self) -> int:
        return len(self.per_rank[0])


def rank_batches(sizes: list[tuple[int, int]]) -> list[list[list[int]]]:
    """Consecutive indices: at step s, rank 0 takes the next ``sizes[s][0]`` samples, then rank 1 ``sizes[s][1]``."""
    per_rank: list[list[list[int]]] = [[], []]
    start = 0
    for step_sizes in sizes:
        for rank, size in enumerate(step_sizes):
            per_rank[rank].append(list(range(start, start + size)))
            start += size
    return per_rank


class SaveUneven(SaveSplitFigures):
    def callback_figures(self, callback: AutoMicroBatching) -> dict[str, Any]:
        return {
            "planner": callback.planner.state_dict(),
            "events": [(e.kind, e.step, e.after) for e in callback.events],
        }

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        path = os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt")
        figures = torch.load(path, weights_only=False)
        figures["params"] = {n: p.detach().clone() for n, p in pl_module.named_parameters()}
        figures["micro_batches"] = pl_module.micro_batches
        torch.save(figures, path)


class UnevenModel(SplitModel):
    """Records how many micro-batches each step ran on this rank."""

    def __init__(self) -> None:
        super().__init__()
        self.micro_batches: list[int] = []

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_end(outputs, batch, batch_idx)
        callback = next(cb for cb in self.trainer.callbacks if isinstance(cb, AutoMicroBatching))
        self.micro_batches.append(callback.last_step_report.accumulation_steps)


def run_uneven(
    tmp_path: Any, model: SplitModel, sizes: list[tuple[int, int]], callback: AutoMicroBatching, **strategy: Any
) -> list[dict[str, Any]]:
    dataset = h.TokenDataset(sum(map(sum, sizes)), seed=1)
    ddp = h.ddp_strategy(**strategy)
    callbacks = [callback, SaveUneven(str(tmp_path))]
    trainer = h.make_trainer(tmp_path, callbacks, strategy=ddp, devices=2, use_distributed_sampler=False)
    trainer.fit(model, DataLoader(dataset, batch_sampler=RankBatches(rank_batches(sizes))))
    return load_ranks(tmp_path)


def check_exact_and_identical(ranks: list[dict[str, Any]], initial: nn.Module, sizes, loss_fn=h.token_loss) -> None:
    dataset = h.TokenDataset(sum(map(sum, sizes)), seed=1)
    assert [[len(i) for i in r["step_indices"]] for r in ranks] == [list(s) for s in zip(*sizes, strict=True)]
    windows = [a + b for a, b in zip(ranks[0]["step_indices"], ranks[1]["step_indices"], strict=True)]
    expected = h.replay_reference(initial, dataset, windows, loss_fn, lr=LR)
    h.assert_grads_close(ranks[0]["step_grads"], expected, **h.FP32)
    h.assert_grads_close(ranks[0]["step_grads"], ranks[1]["step_grads"], rtol=0, atol=0)
    for name, value in ranks[0]["params"].items():
        torch.testing.assert_close(value, ranks[1]["params"][name], rtol=0, atol=0, msg=f"replicas differ: {name}")


@pytest.mark.parametrize("gradient_sync", ["deferred", "overlap"])
def test_ranks_with_different_step_batches_get_the_exact_and_identical_update(tmp_path, gradient_sync):
    # 8 and 4 samples at micro-batches of 4: rank 0 runs 2 micro-batches per step, rank 1 one.
    sizes = [(8, 4)] * 3
    model = UnevenModel()
    initial = copy.deepcopy(model)
    callback = AutoMicroBatching(4, pin_micro_batch_size=True, count_items=h.count_tokens, gradient_sync=gradient_sync)
    ranks = run_uneven(tmp_path, model, sizes, callback)
    assert [r["micro_batches"] for r in ranks] == [[2, 2, 2], [1, 1, 1]]
    check_exact_and_identical(ranks, initial, sizes)


@pytest.mark.parametrize("gradient_sync", ["deferred", "overlap"])
def test_an_oom_on_one_rank_with_uneven_step_batches_shrinks_every_planner_alike(tmp_path, gradient_sync):
    # 8 and 6 samples at micro-batches of at most 4: rank 0 runs 4 + 4, rank 1 3 + 3. An OOM on rank 1 at step 1
    # must shrink both planners from the largest size any rank ran (4 -> 2), not each from its own (4 -> 2, 3 -> 1).
    sizes = [(8, 6)] * 4
    model = UnevenModel()
    initial = copy.deepcopy(model)
    fault = OOMFault(step=1, micro_batch=1, phase="forward", rank=1)
    callback = AutoMicroBatching(
        4,
        pin_micro_batch_size=True,
        oom_cooldown=2,
        grow_patience=1,
        count_items=h.count_tokens,
        gradient_sync=gradient_sync,
        fault_injector=OOMInjector(fault),
    )
    ranks = run_uneven(tmp_path, model, sizes, callback)
    assert ranks[1]["fired"] and not ranks[0]["fired"]
    assert [r["oom_retries"] for r in ranks] == [1, 1]
    assert ranks[0]["planner"] == ranks[1]["planner"]
    assert ranks[0]["events"] == ranks[1]["events"]
    # The largest size on any rank: 2 after the OOM, 3 under the cool-down of size 4, then back to 4.
    assert ranks[0]["sizes"] == ranks[1]["sizes"] == [4, 2, 3, 4]
    assert [r["micro_batches"] for r in ranks] == [[2, 4, 3, 2], [2, 3, 2, 2]]
    check_exact_and_identical(ranks, initial, sizes)


# ---- parameters that some ranks, or no rank, use -------------------------------------------------------------------


class PartlyUsedModel(UnevenModel):
    """``side`` is used only by micro-batches that hold a flagged sample, ``head`` by none (an inference-only head).

    Trained with AdamW and weight decay, which moves every parameter that has a gradient, even a zero one.
    """

    def __init__(self, flagged: set[int]) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.side = nn.Linear(5, 1)
        self.head = nn.Linear(5, 3)
        self.flagged = sorted(flagged)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        self._record(batch)
        return partly_used_loss(self, batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.1)


def partly_used_loss(model: PartlyUsedModel, batch: dict[str, Tensor]) -> Tensor:
    prediction = model.layer(batch["x"]).squeeze(-1)
    flags = torch.isin(batch["index"], torch.tensor(model.flagged))
    if flags.any():  # `side` takes part only here; elsewhere it gets no gradient at all
        prediction = prediction + flags[:, None] * model.side(batch["x"]).squeeze(-1)
    per_token = (prediction - batch["y"]) ** 2 * batch["mask"]
    return per_token.sum() / batch["mask"].sum().clamp(min=1)


@pytest.mark.parametrize("gradient_sync", ["deferred", "overlap"])
def test_a_parameter_no_rank_used_keeps_no_gradient_and_one_some_ranks_used_is_exact(tmp_path, gradient_sync):
    # Samples 0 and 1 are flagged: only rank 0's first step batch uses `side`; no rank ever uses `head`.
    sizes = [(8, 4)] * 3
    model = PartlyUsedModel(flagged={0, 1})
    initial = copy.deepcopy(model)
    callback = AutoMicroBatching(4, pin_micro_batch_size=True, count_items=h.count_tokens, gradient_sync=gradient_sync)
    # DDP's own sync (overlap) needs to be told that some parameters go unused; the deferred sync needs nothing.
    ranks = run_uneven(tmp_path, model, sizes, callback, find_unused_parameters=gradient_sync == "overlap")
    for rank in ranks:
        assert all(step["head.weight"] is None and step["head.bias"] is None for step in rank["step_grads"])
        # As DDP does: untouched by AdamW's weight decay (deferred sync gave it a zero gradient: 1.05e-2 in 3 steps).
        torch.testing.assert_close(rank["params"]["head.weight"], initial.head.weight.detach(), rtol=0, atol=0)
    # `side` has a gradient on both ranks at step 0 (zeros from rank 1), exact against the full step batch.
    assert all(r["step_grads"][0]["side.weight"] is not None for r in ranks)
    grads = [{k: v for k, v in step.items() if not k.startswith("head")} for step in ranks[0]["step_grads"][:1]]
    dataset = h.TokenDataset(sum(map(sum, sizes)), seed=1)
    window = ranks[0]["step_indices"][0] + ranks[1]["step_indices"][0]
    batch = {k: torch.stack([dataset[i][k] for i in window]) for k in dataset[0]}
    reference = copy.deepcopy(initial)
    partly_used_loss(reference, batch).backward()
    expected = {n: p.grad for n, p in reference.named_parameters() if not n.startswith("head")}
    h.assert_grads_close(grads, [expected], **h.FP32)
    h.assert_grads_close(ranks[0]["step_grads"], ranks[1]["step_grads"], rtol=0, atol=0)
