"""Real DDP on CPU: 2 processes, gloo. Exactness across ranks with different item counts, and gradient all-reduces
counted with a DDP comm hook."""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.data import DataLoader

import tests.helpers as h
from lightning_accum import AccumulationScheduler, ManualAccumulation

pytestmark = [pytest.mark.ddp, pytest.mark.timeout(240)]


class CountAllReduces(pl.Callback):
    """Counts DDP gradient bucket all-reduces and saves what each rank saw to ``out_dir/rank{r}.pt``."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.allreduces = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # No annotations: DDP checks them against real types, and this module uses postponed annotations.
        def hook(state, bucket):
            self.allreduces += 1
            return default_hooks.allreduce_hook(None, bucket)

        trainer.strategy.model.register_comm_hook(None, hook)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        torch.save(
            {
                "allreduces": self.allreduces,
                "optimizer_steps": trainer.global_step,
                "step_grads": getattr(pl_module, "step_grads", []),
                "step_indices": getattr(pl_module, "step_indices", []),
                "step_lrs": getattr(pl_module, "step_lrs", []),
                "items_per_step": [],
            },
            os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt"),
        )


def ddp_trainer(
    tmp_path: Any, callbacks: Sequence[pl.Callback], start_method: str = h.START_METHOD, **kwargs: Any
) -> pl.Trainer:
    strategy = h.ddp_strategy(start_method=start_method)
    return h.make_trainer(tmp_path, callbacks, strategy=strategy, devices=2, **kwargs)


def load_ranks(out_dir: Any) -> list[dict[str, Any]]:
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(2)]


# `ddp_spawn` pickles the callbacks into fresh processes, as users' `strategy="ddp_spawn"` does: one case keeps it.
@pytest.mark.parametrize("start_method", [h.START_METHOD, "spawn"])
def test_window_mode_is_exact_across_ranks_with_one_allreduce_per_step(tmp_path, start_method):
    # 30 sequences with random token counts: 15 per rank, micro-batches of 4, so 4 micro-batches per rank per epoch
    # and k=3 gives a full window and a 1-batch tail. Ranks hold different token counts in every window.
    dataset = h.TokenDataset(30)
    model = h.TokenModel(lr=0.05)
    initial = copy.deepcopy(model)
    scheduler = AccumulationScheduler(3, count_items=h.count_tokens)
    trainer = ddp_trainer(tmp_path, [scheduler, CountAllReduces(str(tmp_path))], start_method, max_epochs=2)
    trainer.fit(model, DataLoader(dataset, batch_size=4))

    ranks = load_ranks(tmp_path)
    steps = ranks[0]["optimizer_steps"]
    assert steps == 4
    assert [r["allreduces"] for r in ranks] == [steps, steps]  # one bucket (a tiny model) per optimizer step
    # Same gradient on both ranks, equal to the token mean over the union of what both ranks saw.
    h.assert_grads_close(ranks[0]["step_grads"], ranks[1]["step_grads"], rtol=0, atol=0)
    windows = [a + b for a, b in zip(ranks[0]["step_indices"], ranks[1]["step_indices"], strict=False)]
    tokens = [
        [int(dataset.mask[i].sum()) for i in idx] for idx in (ranks[0]["step_indices"][0], ranks[1]["step_indices"][0])
    ]
    assert sum(tokens[0]) != sum(tokens[1]), "the ranks must hold different token counts for this test to bite"
    expected = h.replay_reference(initial, dataset, windows, h.token_loss, lr=0.05)
    h.assert_grads_close(ranks[0]["step_grads"], expected, rtol=1e-5, atol=1e-6)


class ManualModel(h.TokenModel):
    """Manual optimization, with the helper or with Lightning's documented recipe (backward on every micro-batch)."""

    def __init__(self, use_helper: bool, k: int = 4) -> None:
        super().__init__(lr=0.05)
        self.automatic_optimization = False
        self.use_helper = use_helper
        self.k = k
        self.accumulation = ManualAccumulation(k, count_items=h.count_tokens)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._window_indices.extend(batch["index"].tolist())
        optimizer = self.optimizers()
        loss = h.token_loss(self, batch)
        if self.use_helper:
            ready = self.accumulation.backward(self, loss, batch)
        else:
            self.manual_backward(loss / self.k)
            ready = (batch_idx + 1) % self.k == 0
        if ready:
            self.step_grads.append({n: p.grad.detach().clone() for n, p in self.named_parameters()})
            self.step_indices.append(self._window_indices)
            self._window_indices = []
            optimizer.step()
            optimizer.zero_grad()


@pytest.mark.parametrize(("use_helper", "expected_allreduces"), [(False, 16), (True, 4)])
def test_manual_optimization_helper_syncs_once_per_step_and_is_exact(tmp_path, use_helper, expected_allreduces):
    # 64 sequences, 2 per micro-batch: 16 micro-batches per rank, k=4, so 4 optimizer steps.
    dataset = h.TokenDataset(64)
    model = ManualModel(use_helper)
    initial = copy.deepcopy(model)
    trainer = ddp_trainer(tmp_path, [CountAllReduces(str(tmp_path))])
    trainer.fit(model, DataLoader(dataset, batch_size=2))

    ranks = load_ranks(tmp_path)
    assert [len(r["step_grads"]) for r in ranks] == [4, 4]
    assert [r["allreduces"] for r in ranks] == [expected_allreduces] * 2
    if use_helper:
        windows = [a + b for a, b in zip(ranks[0]["step_indices"], ranks[1]["step_indices"], strict=False)]
        expected = h.replay_reference(initial, dataset, windows, h.token_loss, lr=0.05)
        h.assert_grads_close(ranks[0]["step_grads"], expected, rtol=1e-5, atol=1e-6)


def test_sync_every_micro_batch_trades_communication_for_memory_and_stays_exact(tmp_path):
    # The FSDP memory choice, measured on DDP: every micro-batch is all-reduced (k per step), the result is the same.
    dataset = h.TokenDataset(30)
    model = h.TokenModel(lr=0.05)
    initial = copy.deepcopy(model)
    scheduler = AccumulationScheduler(3, count_items=h.count_tokens, sync_every_micro_batch=True)
    trainer = ddp_trainer(tmp_path, [scheduler, CountAllReduces(str(tmp_path))], max_epochs=1)
    trainer.fit(model, DataLoader(dataset, batch_size=4))

    ranks = load_ranks(tmp_path)
    assert ranks[0]["optimizer_steps"] == 2  # windows of 3 and 1 micro-batches
    assert [r["allreduces"] for r in ranks] == [4, 4]  # one per micro-batch
    windows = [a + b for a, b in zip(ranks[0]["step_indices"], ranks[1]["step_indices"], strict=True)]
    expected = h.replay_reference(initial, dataset, windows, h.token_loss, lr=0.05)
    h.assert_grads_close(ranks[0]["step_grads"], expected, rtol=1e-5, atol=1e-6)
