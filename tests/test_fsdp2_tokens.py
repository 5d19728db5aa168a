"""Split mode by tokens under real FSDP2 (2 gloo processes), with step batches of different lengths and an OOM on one
rank (issue 21, item 3). The runs reuse `tests.test_fsdp2`'s torchrun-style launch."""

from __future__ import annotations

import copy
import logging
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

import tests.helpers as h
from lightning_accum import _compat
from lightning_accum.memory.oom import OOMFault
from tests.test_fsdp2 import WORLD_SIZE, _free_port, start_worker
from tests.test_token_split_ddp import LONG, SHORT, pinned_token_callback
from tests.test_uneven_ranks import RankBatches
from tests.token_models import SavedTokenRun, TinyCausalLM, TokenSequences, full_batch_reference, pad_right

pytestmark = [pytest.mark.ddp, pytest.mark.timeout(180)]

LR = 0.1
STEPS = 3


class ShardedCausalLM(TinyCausalLM):
    """Every submodule sharded by FSDP2; records the full gradient of each step and what FSDP2 still holds back."""

    def __init__(self) -> None:
        super().__init__(lr=LR)
        self.unsynced: list[list[str]] = []

    def configure_model(self) -> None:
        if self.device_mesh is None:
            return
        mesh = self.device_mesh["data_parallel"]
        for module in (self.embed, self.position, self.qkv, self.mix, self.head):
            fully_shard(module, mesh=mesh)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.unsynced.append(_compat.fsdp2_unsynced_state(self))
        self.step_grads.append(
            {
                n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad.clone()
                for n, p in self.named_parameters()
            }
        )
        self.step_indices.append(self._indices)


class _Messages(logging.Handler):
    """What `lightning_accum` logged in this process."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


MESSAGES = _Messages()


class _Save(SavedTokenRun):
    def record(self, pl_module: ShardedCausalLM) -> dict[str, Any]:
        sharded = all(isinstance(p, DTensor) for p in pl_module.parameters())
        return {"unsynced": pl_module.unsynced, "sharded": sharded, "log": MESSAGES.messages}


def _per_rank() -> list[list[list[int]]]:
    return [[list(range(16 * s + 8 * r, 16 * s + 8 * r + 8)) for s in range(STEPS)] for r in range(WORLD_SIZE)]


def _worker(rank: int, port: int, out_dir: str, faults: list[OOMFault]) -> None:
    _, strategy = start_worker(rank, port)
    logging.getLogger("lightning_accum").addHandler(MESSAGES)
    callback = pinned_token_callback(faults)
    trainer = h.make_trainer(
        out_dir, [callback, _Save(out_dir)], strategy=strategy, devices=WORLD_SIZE, use_distributed_sampler=False
    )
    dataset = TokenSequences((LONG + SHORT) * STEPS, seed=3)
    try:
        trainer.fit(
            ShardedCausalLM(), DataLoader(dataset, batch_sampler=RankBatches(_per_rank()), collate_fn=pad_right)
        )
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run(out_dir: Any, faults: list[OOMFault]) -> list[dict[str, Any]]:
    h.start_ranks(_worker, (_free_port(), str(out_dir), faults), WORLD_SIZE)
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(WORLD_SIZE)]


@pytest.fixture(scope="module")
def oom_on_rank_1(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """One run, for the tests below: at step 1, rank 1's first forward runs out of memory."""
    return run(tmp_path_factory.mktemp("oom"), [OOMFault(step=1, micro_batch=0, phase="forward", rank=1)])


def test_token_split_under_fsdp2_is_exact_with_uneven_lengths_and_an_oom_on_one_rank(oom_on_rank_1):
    ranks = oom_on_rank_1
    assert all(r["sharded"] for r in ranks)
    assert ranks[1]["fired"] and not ranks[0]["fired"] and [r["oom_retries"] for r in ranks] == [1, 1]
    assert len(ranks[0]["shapes"]) > len(ranks[1]["shapes"]) + 3  # long sequences: more micro-batches
    assert ranks[0]["planner"] == ranks[1]["planner"]
    assert [r["unsynced"] for r in ranks] == [[[]] * STEPS] * WORLD_SIZE
    dataset = TokenSequences((LONG + SHORT) * STEPS, seed=3)
    windows = [a + b for a, b in zip(ranks[0]["step_indices"], ranks[1]["step_indices"], strict=True)]
    expected = full_batch_reference(copy.deepcopy(ShardedCausalLM()), dataset, windows, lr=LR)
    h.assert_grads_close(ranks[0]["step_grads"], expected, rtol=1e-5, atol=1e-6)
    h.assert_grads_close(ranks[0]["step_grads"], ranks[1]["step_grads"], rtol=0, atol=0)


def test_every_rank_names_the_rank_that_ran_out_of_memory(oom_on_rank_1):
    # Rank 0 speaks for the run, and rank 1, which ran out of memory, says so too, with its own error.
    ooms = [[m for m in r["log"] if m.startswith("lightning_accum: OOM at")] for r in oom_on_rank_1]
    assert ooms[0] == ["lightning_accum: OOM at token budget 48 (on rank 1); retrying the step"], ooms
    assert len(ooms[1]) == 1 and ooms[1][0].startswith("lightning_accum: OOM at token budget 48 (on rank 1: "), ooms
    assert "can't allocate memory" in ooms[1][0] or "out of memory" in ooms[1][0], ooms
