"""Split mode by tokens on 2 DDP ranks (gloo) whose step batches hold different lengths (issue 21, item 3).

The ranks' step batches hold sequences of different lengths, so they run different numbers of micro-batches at the
same token budget. The update must be the exact token mean over both ranks' step batches, identical on both ranks,
with the gradient sync deferred or overlapped, and after an OOM on one rank.
"""

from __future__ import annotations

import copy
import functools
import os
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

import tests.helpers as h
from lightning_accum import AutoMicroBatching
from lightning_accum.items import CountTokens
from lightning_accum.memory.oom import OOMFault, OOMInjector
from lightning_accum.sequences import PaddedSequences
from tests.test_ddp import load_ranks
from tests.test_uneven_ranks import RankBatches
from tests.token_models import SavedTokenRun, TinyCausalLM, TokenSequences, full_batch_reference, pad_right

pytestmark = [pytest.mark.ddp, pytest.mark.timeout(300)]

LR = 0.1
BUDGET = 48
# Rank 0's step batches hold long sequences and rank 1's short ones: at 48 tokens, rank 0 runs 4 to 6 micro-batches
# and rank 1 one or two.
LONG = [30, 22, 17, 12, 9, 8, 5, 3]
SHORT = [6, 5, 4, 4, 3, 3, 2, 2]


def pinned_token_callback(faults: list[OOMFault], **kwargs: Any) -> AutoMicroBatching:
    """Split by tokens at `BUDGET`, pinned (an OOM still shrinks it for a step), with ``faults`` injected."""
    return AutoMicroBatching(
        sequences=PaddedSequences(),
        micro_batch_tokens=BUDGET,
        pin_micro_batch_size=True,
        oom_cooldown=1,
        grow_patience=1,
        count_items=CountTokens("labels", shift=1),
        fault_injector=OOMInjector(faults),
        **kwargs,
    )


class SaveTokenRun(SavedTokenRun):
    def record(self, pl_module: TinyCausalLM) -> dict[str, Any]:
        return {"params": {n: p.detach().clone() for n, p in pl_module.named_parameters()}}


def run(tmp_path: Any, gradient_sync: str, faults: list[OOMFault], steps: int = 3) -> tuple[list[dict], Any]:
    lengths = (LONG + SHORT) * steps
    dataset = TokenSequences(lengths, seed=3)
    per_rank = [
        [list(range(16 * s, 16 * s + 8)) for s in range(steps)],
        [list(range(16 * s + 8, 16 * s + 16)) for s in range(steps)],
    ]
    model = TinyCausalLM(lr=LR)
    initial = copy.deepcopy(model)
    callback = pinned_token_callback(faults, gradient_sync=gradient_sync)
    ddp = h.ddp_strategy()
    trainer = h.make_trainer(
        tmp_path, [callback, SaveTokenRun(str(tmp_path))], strategy=ddp, devices=2, use_distributed_sampler=False
    )
    trainer.fit(model, DataLoader(dataset, batch_sampler=RankBatches(per_rank), collate_fn=pad_right))
    ranks = load_ranks(tmp_path)
    windows = [a + b for a, b in zip(ranks[0]["step_indices"], ranks[1]["step_indices"], strict=True)]
    return ranks, full_batch_reference(initial, dataset, windows, lr=LR)


def check(ranks: list[dict], expected: list[dict]) -> None:
    h.assert_grads_close(ranks[0]["step_grads"], expected, rtol=1e-5, atol=1e-6)
    h.assert_grads_close(ranks[0]["step_grads"], ranks[1]["step_grads"], rtol=0, atol=0)
    for name, value in ranks[0]["params"].items():
        torch.testing.assert_close(value, ranks[1]["params"][name], rtol=0, atol=0, msg=f"replicas differ: {name}")
    assert ranks[0]["planner"] == ranks[1]["planner"]


@pytest.mark.parametrize("gradient_sync", ["deferred", "overlap"])
def test_ranks_with_different_lengths_run_different_numbers_of_micro_batches_exactly(tmp_path, gradient_sync):
    ranks, expected = run(tmp_path, gradient_sync, faults=[])
    counts = [len(r["shapes"]) for r in ranks]
    assert counts[0] > counts[1] + 3  # long sequences need more micro-batches at the same budget
    assert all(b * n <= BUDGET or b == 1 for r in ranks for b, n in r["shapes"])
    check(ranks, expected)
    report = ranks[0]["reports"]
    assert report.micro_batch_tokens == BUDGET and report.effective_batch_size == 16


@pytest.mark.parametrize("gradient_sync", ["deferred", "overlap"])
def test_an_oom_on_the_rank_with_short_sequences_is_retried_on_both_exactly(tmp_path, gradient_sync):
    # At step 1, rank 1's first micro-batch runs out of memory: both ranks re-run the step at a smaller budget.
    faults = [OOMFault(step=1, micro_batch=0, phase="forward", rank=1, when_size_above=BUDGET // 2)]
    ranks, expected = run(tmp_path, gradient_sync, faults)
    assert ranks[1]["fired"] and not ranks[0]["fired"]
    assert [r["oom_retries"] for r in ranks] == [1, 1]
    check(ranks, expected)


def pad_scoring_padding(samples: list[dict[str, Any]], on: frozenset[int]) -> dict[str, Any]:
    """`pad_right`, with ``labels = input_ids`` (no -100: the loss scores padding) in step batches holding ``on``."""
    batch = pad_right(samples)
    if on & set(batch["index"].tolist()):
        batch["labels"] = batch["input_ids"].clone()
    return batch


class RecordsErrors(TinyCausalLM):
    """Writes the error that ends this rank's step to ``error{rank}.txt`` (``ddp_spawn`` reports only the first)."""

    def __init__(self, out_dir: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.out_dir = out_dir

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        with h.rank_error_written(self.out_dir, self.global_rank):
            super().optimizer_step(*args, **kwargs)


@pytest.mark.parametrize("ranks_scoring_padding", [(0, 1), (1,)])
def test_labels_that_score_padding_stop_every_rank_before_any_update(tmp_path, ranks_scoring_padding):
    # labels = input_ids with no -100 on one or both ranks: the trim dropped the padding's terms silently. Now each
    # such rank stops with the message, before any backward; the other rank stops with it through the agreement.
    dataset = TokenSequences(LONG + SHORT, seed=3)
    per_rank = [[list(range(0, 8))], [list(range(8, 16))]]
    on = frozenset(i for r in ranks_scoring_padding for i in per_rank[r][0])
    model = RecordsErrors(str(tmp_path), lr=LR)
    callback = pinned_token_callback([])
    ddp = h.ddp_strategy()
    trainer = h.make_trainer(tmp_path, [callback], strategy=ddp, devices=2, use_distributed_sampler=False)
    loader = DataLoader(
        dataset, batch_sampler=RankBatches(per_rank), collate_fn=functools.partial(pad_scoring_padding, on=on)
    )
    with pytest.raises(Exception, match=r"counts \d+ items in the step batch|Another rank failed"):
        trainer.fit(model, loader)
    errors = {}
    for rank in range(2):
        with open(os.path.join(tmp_path, f"error{rank}.txt")) as f:
            errors[rank] = f.read()
    for rank in range(2):
        if rank in ranks_scoring_padding:
            assert errors[rank].startswith("ValueError: `count_items` (CountTokens(key='labels', ignore_index=-100,")
            assert "labels[attention_mask == 0] = -100" in errors[rank]
        else:
            assert errors[rank].startswith("RuntimeError: Another rank failed with an error that is not an out-of")
