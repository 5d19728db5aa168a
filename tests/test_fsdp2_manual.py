"""``ManualAccumulation`` under FSDP2 (``ModelParallelStrategy`` + ``fully_shard``, 2 CPU processes, gloo): exact, and
one reduce-scatter per FSDP unit per optimizer step, as in window mode."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

import tests.helpers as h
import tests.test_fsdp2 as fsdp2
from lightning_accum import ManualAccumulation

pytestmark = [pytest.mark.ddp, pytest.mark.timeout(180)]

K = 3


class ManualShardedModel(fsdp2.ShardedTokenModel):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.accumulation = ManualAccumulation(K, count_items=h.count_tokens)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._window_indices.extend(batch["index"].tolist())
        optimizer = self.optimizers()
        if self.accumulation.backward(self, h.token_loss(self, batch), batch):
            grads = {
                n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for n, p in self.named_parameters()
            }
            self.step_grads.append({n: g.detach().clone() for n, g in grads.items()})
            self.step_indices.append(self._window_indices)
            self._window_indices = []
            optimizer.step()
            optimizer.zero_grad()


def _worker(rank: int, port: int, out_dir: str) -> None:
    counter, strategy = fsdp2.start_worker(rank, port)
    trainer = h.make_trainer(out_dir, [fsdp2._SaveRun(out_dir, counter)], strategy=strategy, devices=fsdp2.WORLD_SIZE)
    trainer.fit(ManualShardedModel(), DataLoader(h.TokenDataset(24), batch_size=2))
    if dist.is_initialized():
        dist.destroy_process_group()


def test_manual_accumulation_under_fsdp2_reduce_scatters_once_per_step_and_is_exact(tmp_path: Any) -> None:
    # 24 sequences, 12 per rank, 2 per micro-batch: 6 micro-batches per rank, k=3, so 2 optimizer steps.
    h.start_ranks(_worker, (fsdp2._free_port(), str(tmp_path)), fsdp2.WORLD_SIZE)
    ranks = [torch.load(os.path.join(tmp_path, f"rank{r}.pt"), weights_only=False) for r in range(fsdp2.WORLD_SIZE)]
    assert all(r["sharded"] for r in ranks)
    assert [len(r["step_grads"]) for r in ranks] == [2, 2]
    # Without the held-back sync, every micro-batch reduce-scatters: 6 per FSDP unit instead of 2.
    assert [fsdp2.reduce_scatters(r) for r in ranks] == [fsdp2.FSDP_UNITS * 2] * fsdp2.WORLD_SIZE
    h.assert_grads_close(ranks[0]["step_grads"], ranks[1]["step_grads"], rtol=0, atol=0)
    windows = [a + b for a, b in zip(ranks[0]["step_indices"], ranks[1]["step_indices"], strict=True)]
    expected = h.replay_reference(fsdp2.ShardedTokenModel(), h.TokenDataset(24), windows, h.token_loss, lr=fsdp2.LR)
    h.assert_grads_close(ranks[0]["step_grads"], expected, **h.FP32)
