"""Split mode under real DDP (2 CPU processes, gloo): OOMs injected on one rank at every position never hang, never
mismatch collectives, and never leak a gradient from an aborted attempt."""

from __future__ import annotations

import copy
import itertools
import os
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils.data import DataLoader

from lightning_accum import AutoMicroBatching
from lightning_accum.memory.oom import OOMFault, OOMInjector
from tests.helpers import TokenDataset, TokenModel, assert_grads_close, count_tokens, replay_reference, token_loss
from tests.test_ddp import CountAllReduces, ddp_trainer, load_ranks

pytestmark = [pytest.mark.ddp, pytest.mark.timeout(300)]

STEP_BATCH = 16  # per rank
MICRO = 4  # micro-batches 0 (first), 1 (middle) and 3 (last)
CASES = list(itertools.product([0, 1], [0, 1, 3], ["forward", "backward"]))  # rank x micro-batch x phase


class SplitModel(TokenModel):
    def __init__(self) -> None:
        super().__init__(lr=0.05)
        self.split_mode = True
        self.sizes: list[int] = []

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        callback = next(cb for cb in self.trainer.callbacks if isinstance(cb, AutoMicroBatching))
        self.sizes.append(callback.last_step_report.micro_batch_size)


class SaveSplitFigures(CountAllReduces):
    """Adds what the `AutoMicroBatching` callback did on each rank to the figures `CountAllReduces` saves."""

    def callback_figures(self, callback: AutoMicroBatching) -> dict[str, Any]:
        return {"gradient_allreduces": callback.gradient_allreduces}

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        callback = next(cb for cb in trainer.callbacks if isinstance(cb, AutoMicroBatching))
        super().on_train_end(trainer, pl_module)
        path = os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt")
        figures = torch.load(path, weights_only=False)
        figures.update(
            sizes=pl_module.sizes,
            oom_retries=callback.oom_retries,
            fired=callback.fault_injector.fired if callback.fault_injector else [],
            **self.callback_figures(callback),
        )
        torch.save(figures, path)


def faulted_callback(micro_batch_size: int, faults: list[OOMFault], **kwargs: Any) -> AutoMicroBatching:
    """Split mode at a pinned micro-batch size that shrinks for one step after each injected fault, then grows back."""
    return AutoMicroBatching(
        micro_batch_size,
        pin_micro_batch_size=True,
        oom_cooldown=1,
        grow_patience=1,
        count_items=count_tokens,
        fault_injector=OOMInjector(faults),
        **kwargs,
    )


def run(tmp_path: Any, callback: AutoMicroBatching, steps: int) -> tuple[list[dict[str, Any]], list[Any]]:
    dataset = TokenDataset(2 * STEP_BATCH * steps, seed=1)
    model = SplitModel()
    initial = copy.deepcopy(model)
    trainer = ddp_trainer(tmp_path, [callback, SaveSplitFigures(str(tmp_path))])
    trainer.fit(model, DataLoader(dataset, batch_size=STEP_BATCH))
    ranks = load_ranks(tmp_path)
    windows = [a + b for a, b in zip(ranks[0]["step_indices"], ranks[1]["step_indices"], strict=False)]
    expected = replay_reference(initial, dataset, windows, token_loss, lr=0.05)
    return ranks, expected


def test_oom_on_one_rank_at_every_position_is_recovered_exactly(tmp_path):
    # One fault every other step, so the size grows back to MICRO before the next fault: (rank 0 | rank 1) x
    # (first | middle | last micro-batch) x (forward | backward).
    faults = [
        OOMFault(step=2 * i, micro_batch=mb, phase=phase, rank=rank, when_size_above=MICRO // 2)
        for i, (rank, mb, phase) in enumerate(CASES)
    ]
    callback = faulted_callback(MICRO, faults)
    steps = 2 * len(CASES)
    ranks, expected = run(tmp_path, callback, steps)

    fired = sorted(ranks[0]["fired"] + ranks[1]["fired"], key=lambda f: f[1])
    assert [(rank, mb, phase) for rank, _, mb, phase in fired] == CASES
    assert [r["oom_retries"] for r in ranks] == [len(CASES)] * 2
    assert ranks[0]["sizes"] == ranks[1]["sizes"]  # every step, the same micro-batch size on both ranks
    assert ranks[0]["sizes"][::2] == [MICRO // 2] * len(CASES)  # each faulted step was re-run in halves
    assert ranks[0]["optimizer_steps"] == steps
    assert_grads_close(ranks[0]["step_grads"], ranks[1]["step_grads"], rtol=0, atol=0)
    assert_grads_close(ranks[0]["step_grads"], expected, rtol=1e-5, atol=1e-6)
    # Deferred sync: DDP never all-reduced (no_sync throughout); one flattened gradient all-reduce per step.
    assert [r["allreduces"] for r in ranks] == [0, 0]
    assert [r["gradient_allreduces"] for r in ranks] == [steps, steps]


def test_overlap_mode_lets_ddp_sync_the_last_backward_once_per_step(tmp_path):
    callback = AutoMicroBatching(MICRO, count_items=count_tokens, gradient_sync="overlap")
    ranks, expected = run(tmp_path, callback, steps=3)
    assert [r["allreduces"] for r in ranks] == [3, 3]
    assert [r["gradient_allreduces"] for r in ranks] == [0, 0]
    assert_grads_close(ranks[0]["step_grads"], expected, rtol=1e-5, atol=1e-6)


# ---- issue 12, item 3: the pre-flight's start is agreed by every rank ------------------------------------------------


class SkewedTraceModel(SplitModel):
    """Its trace on fake tensors (never the real step) differs by rank: 3 GiB more per sample on ``heavy_rank``, and
    no trace at all on ``failing_rank``."""

    def __init__(self, heavy_rank: int, failing_rank: int | None) -> None:
        super().__init__()
        self.heavy_rank, self.failing_rank = heavy_rank, failing_rank

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if not is_fake(loss):
            return loss
        rank = torch.distributed.get_rank()  # the traced copy has no Trainer, so its `global_rank` reads 0
        if rank == self.failing_rank:
            raise RuntimeError("this op has no fake implementation")
        if rank == self.heavy_rank:
            ballast = torch.empty(len(batch["x"]), 3 * 2**30 // 4)  # a fake tensor: nothing is allocated
            loss = loss + 0 * ballast.sum()
        return loss


class SavePreflight(SaveSplitFigures):
    def callback_figures(self, callback: AutoMicroBatching) -> dict[str, Any]:
        found = callback.preflight_result
        return {"traced": found is not None and found.peak_model is not None}


@pytest.mark.parametrize(("heavy_rank", "failing_rank"), [(1, None), (0, 1)], ids=["smallest-wins", "one-fails"])
def test_every_rank_starts_where_the_preflight_of_every_rank_allows(tmp_path, heavy_rank, failing_rank):
    # smallest-wins: rank 1 predicts a smaller start than rank 0, and both ranks take it. one-fails: rank 0 predicts a
    # smaller start, but rank 1 cannot trace, so every rank starts from the whole step batch. Unagreed, the ranks would
    # split their step batches differently.
    dataset = TokenDataset(2 * STEP_BATCH * 2, seed=1)
    model = SkewedTraceModel(heavy_rank, failing_rank)
    initial = copy.deepcopy(model)
    callback = AutoMicroBatching(count_items=count_tokens)
    trainer = ddp_trainer(tmp_path, [callback, SavePreflight(str(tmp_path))])
    trainer.fit(model, DataLoader(dataset, batch_size=STEP_BATCH))
    ranks = load_ranks(tmp_path)
    assert [r["traced"] for r in ranks] == [True, failing_rank is None]
    assert ranks[0]["sizes"] == ranks[1]["sizes"]
    if failing_rank is None:
        assert ranks[0]["sizes"][0] < STEP_BATCH  # rank 0 alone would have started at the whole step batch
    else:
        assert ranks[0]["sizes"][0] == STEP_BATCH  # rank 0 alone would have started smaller
    assert [r["oom_retries"] for r in ranks] == [0, 0]
    windows = [a + b for a, b in zip(ranks[0]["step_indices"], ranks[1]["step_indices"], strict=True)]
    expected = replay_reference(initial, dataset, windows, token_loss, lr=0.05)
    assert_grads_close(ranks[0]["step_grads"], expected, rtol=1e-5, atol=1e-6)
