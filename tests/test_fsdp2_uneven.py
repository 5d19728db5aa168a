"""Split mode under real FSDP2 (2 gloo processes) when the ranks' step batches differ, and with an unused module.

Rank 0 gets step batches of 16 and rank 1 of 10: at micro-batches of 4 they run 4 and 3 micro-batches, and each
rank's last backward reduce-scatters. The update must be the exact mean over every item of the step, on both ranks
(issue 18, items 1 and 2, under FSDP2). The runs reuse `tests.test_fsdp2`'s torchrun-style launch.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

import tests.helpers as h
from lightning_accum.memory.oom import OOMFault
from tests.test_ddp_split import faulted_callback
from tests.test_fsdp2 import LR, WORLD_SIZE, _free_port, start_worker
from tests.test_fsdp2_split import SplitShardedModel, _SaveSplitRun
from tests.test_uneven_ranks import RankBatches, rank_batches

pytestmark = [pytest.mark.ddp, pytest.mark.timeout(180)]

SIZES = [(16, 10)] * 3
MICRO = 4


class UnusedHeadModel(SplitShardedModel):
    """A sharded head that no forward uses (inference only), trained with AdamW and weight decay."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.head = nn.Linear(5, 3)

    def configure_model(self) -> None:
        super().configure_model()
        if self.device_mesh is not None:
            fully_shard(self.head, mesh=self.device_mesh["data_parallel"])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.1)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.step_grads.append(
            {n: None if p.grad is None else p.grad.full_tensor() for n, p in self.named_parameters()}
        )
        self.step_indices.append(self._window_indices)
        self.unsynced.append([])


class _SaveParams(_SaveSplitRun):
    def on_train_end(self, trainer, pl_module) -> None:
        super().on_train_end(trainer, pl_module)
        path = os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt")
        figures = torch.load(path, weights_only=False)
        figures["params"] = {
            n: p.full_tensor() if isinstance(p, DTensor) else p.detach().clone()
            for n, p in pl_module.named_parameters()
        }
        torch.save(figures, path)


def _worker(rank: int, port: int, out_dir: str, faults: list[OOMFault], unused_head: bool) -> None:
    counter, strategy = start_worker(rank, port)
    trainer = h.make_trainer(
        out_dir,
        [faulted_callback(MICRO, faults), _SaveParams(out_dir, counter)],
        strategy=strategy,
        devices=WORLD_SIZE,
        use_distributed_sampler=False,
    )
    dataset = h.TokenDataset(sum(map(sum, SIZES)), seed=1)
    model = UnusedHeadModel() if unused_head else SplitShardedModel()
    try:
        trainer.fit(model, DataLoader(dataset, batch_sampler=RankBatches(rank_batches(SIZES))))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run(out_dir: Any, faults: list[OOMFault], unused_head: bool = False) -> list[dict[str, Any]]:
    h.start_ranks(_worker, (_free_port(), str(out_dir), faults, unused_head), WORLD_SIZE)
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(WORLD_SIZE)]


def test_uneven_step_batches_under_fsdp2_are_exact_also_after_an_oom_on_one_rank(tmp_path):
    # An OOM on rank 1 (the short step batch) at step 1: both ranks re-run the step at micro-batches of 2.
    faults = [OOMFault(step=1, micro_batch=1, phase="forward", rank=1, when_size_above=MICRO // 2)]
    ranks = run(tmp_path, faults)
    assert all(r["sharded"] for r in ranks)
    assert [[len(i) for i in r["step_indices"]] for r in ranks] == [[16] * 3, [10] * 3]
    assert ranks[1]["fired"] == [(1, 1, 1, "forward")]
    assert ranks[0]["sizes"] == ranks[1]["sizes"] == [MICRO, MICRO // 2, MICRO]
    assert ranks[0]["events"] == ranks[1]["events"]
    dataset = h.TokenDataset(sum(map(sum, SIZES)), seed=1)
    windows = [a + b for a, b in zip(ranks[0]["step_indices"], ranks[1]["step_indices"], strict=True)]
    expected = h.replay_reference(SplitShardedModel(), dataset, windows, h.token_loss, lr=LR)
    h.assert_grads_close(ranks[0]["step_grads"], expected, **h.FP32)
    h.assert_grads_close(ranks[0]["step_grads"], ranks[1]["step_grads"], rtol=0, atol=0)
    assert [r["unsynced"] for r in ranks] == [[[]] * 3] * WORLD_SIZE


def test_a_sharded_module_no_rank_uses_keeps_its_parameters(tmp_path):
    initial = UnusedHeadModel()
    ranks = run(tmp_path, faults=[], unused_head=True)
    for rank in ranks:
        torch.testing.assert_close(rank["params"]["head.weight"], initial.head.weight.detach(), rtol=0, atol=0)
        torch.testing.assert_close(rank["params"]["head.bias"], initial.head.bias.detach(), rtol=0, atol=0)
        assert all(step["head.weight"] is None for step in rank["step_grads"])
    torch.testing.assert_close(ranks[0]["params"]["layer.0.weight"], ranks[1]["params"]["layer.0.weight"])
