"""Split mode by tokens when a rank's micro-batch holds no items, under real FSDP2 and DDP (2 gloo processes).

Split by tokens, each step batch is sorted longest first, so its shortest sequences land in its last micro-batch.
With `CountTokens("labels", shift=1)` a 1-token sequence bears no loss token: a last micro-batch of such sequences
holds no items. Under FSDP2 that rank must still join the last backward's reduce-scatter, with exactly zero gradient
(issue 25, item 1). The models' loss is a hand-written masked mean, so that a micro-batch without items has a NaN loss
and, through its backward, NaN gradients (`F.cross_entropy`'s own mean gives zeros for ignored targets). The runs
reuse `tests.test_fsdp2`'s torchrun-style launch and `tests.test_fsdp2_tokens`'s sharded causal LM.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.nn import functional as F
from torch.utils.data import DataLoader

import tests.helpers as h
from tests.test_ddp import load_ranks
from tests.test_fsdp2 import WORLD_SIZE, _free_port, start_worker
from tests.test_fsdp2_tokens import LR, ShardedCausalLM, _Save
from tests.test_token_split_ddp import LONG, SHORT, SaveTokenRun, pinned_token_callback
from tests.test_uneven_ranks import RankBatches
from tests.token_models import VOCAB, TinyCausalLM, TokenSequences, full_batch_reference, pad_right

pytestmark = [pytest.mark.ddp, pytest.mark.timeout(300)]

PER_RANK = 8  # samples in each rank's step batch
ONES = [1] * PER_RANK  # 1-token sequences: no loss-bearing token after the shift
# Per step, each rank's lengths; a negative one is a prompt-only sequence (all its labels -100, as when an SFT sample's
# response is truncated away), whose micro-batch has positions but no loss token, and a NaN masked mean. At 48 tokens:
# step 0, rank 1's whole step is one micro-batch of 1-token sequences (its first forward included); step 1, rank 0's
# last micro-batch is [1, 1, 1, 1]; step 2, rank 0's is four prompt-only sequences of 3; step 3, rank 1's whole step
# is prompt-only, in 4 micro-batches ([6, 5], [4, 4], [3, 3], [2, 2]).
STEPS = [
    (LONG, ONES),
    ([30, 22, 17, 12, 1, 1, 1, 1], SHORT),
    ([30, 22, 17, 12, -3, -3, -3, -3], SHORT),
    (SHORT, [-n for n in SHORT]),
]


def _lengths() -> list[int]:
    return [n for step in STEPS for rank in step for n in rank]


def _per_rank() -> list[list[list[int]]]:
    return [
        [list(range((s * WORLD_SIZE + r) * PER_RANK, (s * WORLD_SIZE + r + 1) * PER_RANK)) for s in range(len(STEPS))]
        for r in range(WORLD_SIZE)
    ]


def _dataset() -> TokenSequences:
    return TokenSequences([abs(n) for n in _lengths()], seed=3)


def pad_right_prompts(samples: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """`pad_right`, with no label on the prompt-only sequences."""
    batch = pad_right(samples)
    prompt_only = torch.tensor([_lengths()[i] < 0 for i in batch["index"].tolist()])
    batch["labels"] = batch["labels"].masked_fill(prompt_only[:, None], -100)
    return batch


def masked_mean(model: TinyCausalLM, batch: dict[str, Tensor]) -> Tensor:
    """The shifted token mean as often written by hand: over no loss token it is 0 / 0, and so is its backward."""
    logits = model(batch["input_ids"], batch["attention_mask"])[:, :-1]
    labels = batch["labels"][:, 1:]
    mask = labels != -100
    per_token = F.cross_entropy(logits.reshape(-1, VOCAB), labels.clamp(min=0).reshape(-1), reduction="none")
    return (per_token * mask.reshape(-1)).sum() / mask.sum()


class MaskedMeanCausalLM(TinyCausalLM):
    loss = masked_mean


class ShardedMaskedMeanCausalLM(ShardedCausalLM):
    loss = masked_mean


class _SaveSharded(_Save):
    def record(self, pl_module: ShardedCausalLM) -> dict[str, Any]:
        params = {
            n: p.full_tensor() if isinstance(p, DTensor) else p.detach().clone()
            for n, p in pl_module.named_parameters()
        }
        return super().record(pl_module) | {"params": params}


def _fsdp2_worker(rank: int, port: int, out_dir: str) -> None:
    _, strategy = start_worker(rank, port)
    trainer = h.make_trainer(
        out_dir,
        [pinned_token_callback([]), _SaveSharded(out_dir)],
        strategy=strategy,
        devices=WORLD_SIZE,
        use_distributed_sampler=False,
    )
    dataset = _dataset()
    try:
        trainer.fit(
            ShardedMaskedMeanCausalLM(),
            DataLoader(dataset, batch_sampler=RankBatches(_per_rank()), collate_fn=pad_right_prompts),
        )
    except BaseException as err:
        # The launcher reports only the first process that failed: each one says how it ended.
        with open(os.path.join(out_dir, f"error{rank}.txt"), "w") as f:
            f.write(f"{type(err).__name__}: {err}")
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _check(ranks: list[dict[str, Any]]) -> None:
    dataset = _dataset()
    assert [r["step_indices"] for r in ranks] == _per_rank()
    # What makes the test bite: the empty micro-batches are the ones described above.
    shapes = [r["shapes"] for r in ranks]
    assert shapes[1][0] == (PER_RANK, 1), "rank 1's step 0 must be one micro-batch of 1-token sequences"
    assert (4, 1) in shapes[0], "rank 0's step 1 must end in a micro-batch of 1-token sequences"
    assert (4, 3) in shapes[0], "rank 0's step 2 must end in a micro-batch of prompt-only sequences"
    assert shapes[1][-4:] == [(2, 6), (2, 4), (2, 3), (2, 2)], "rank 1's step 3 must be 4 prompt-only micro-batches"
    windows = [a + b for a, b in zip(ranks[0]["step_indices"], ranks[1]["step_indices"], strict=True)]
    initial = copy.deepcopy(MaskedMeanCausalLM(lr=LR))
    expected = full_batch_reference(initial, dataset, windows, lr=LR, collate=pad_right_prompts)
    h.assert_grads_close(ranks[0]["step_grads"], expected, rtol=1e-5, atol=1e-6)
    h.assert_grads_close(ranks[0]["step_grads"], ranks[1]["step_grads"], rtol=0, atol=0)
    for name, value in ranks[0]["params"].items():
        assert torch.isfinite(value).all(), name
        torch.testing.assert_close(value, ranks[1]["params"][name], rtol=0, atol=0, msg=f"replicas differ: {name}")


def test_fsdp2_steps_exactly_over_micro_batches_that_hold_no_items(tmp_path):
    h.start_ranks(_fsdp2_worker, (_free_port(), str(tmp_path)), WORLD_SIZE)
    ranks = [torch.load(os.path.join(tmp_path, f"rank{r}.pt"), weights_only=False) for r in range(WORLD_SIZE)]
    assert all(r["sharded"] for r in ranks), "the parameters must be FSDP2 DTensors for this test to bite"
    assert [r["unsynced"] for r in ranks] == [[[]] * len(STEPS)] * WORLD_SIZE
    _check(ranks)


@pytest.mark.parametrize("gradient_sync", ["deferred", "overlap"])
def test_ddp_steps_exactly_over_the_same_micro_batches(tmp_path, gradient_sync):
    callback = pinned_token_callback([], gradient_sync=gradient_sync)
    ddp = h.ddp_strategy()
    trainer = h.make_trainer(
        tmp_path, [callback, SaveTokenRun(str(tmp_path))], strategy=ddp, devices=2, use_distributed_sampler=False
    )
    dataset = _dataset()
    loader = DataLoader(dataset, batch_sampler=RankBatches(_per_rank()), collate_fn=pad_right_prompts)
    trainer.fit(MaskedMeanCausalLM(lr=LR), loader)
    _check(load_ranks(tmp_path))
