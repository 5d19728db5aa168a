"""Split mode under real FSDP2 on CPU: ``ModelParallelStrategy`` with ``fully_shard``, 2 processes, gloo.

Every micro-batch but the last accumulates unsharded gradients without a reduce-scatter; the ranks agree after the
last forward and the last backward reduce-scatters once per FSDP unit. The runs reuse `tests.test_fsdp2`'s harness
(the model, the collective counter, the torchrun-style launch).
"""

from __future__ import annotations

import os
import time
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import FSDPStrategy
from torch.utils.data import DataLoader, DistributedSampler

import tests.helpers as h
from lightning_accum import AutoMicroBatching, _compat
from lightning_accum.memory.oom import OOMFault
from tests.test_ddp_split import faulted_callback
from tests.test_fsdp2 import (
    FSDP_UNITS,
    LR,
    WORLD_SIZE,
    ShardedTokenModel,
    _free_port,
    _SaveRun,
    reduce_scatters,
    start_worker,
)

pytestmark = [pytest.mark.ddp, pytest.mark.timeout(180)]

STEP_BATCH = 16  # per rank
MICRO = 4  # micro-batches 0 to 3; the last one's backward reduce-scatters


class SplitShardedModel(ShardedTokenModel):
    """Also records, at each optimizer step, the micro-batch size and anything FSDP2 still holds back."""

    def __init__(self) -> None:
        super().__init__()
        self.split_mode = True
        self.sizes: list[int] = []
        self.unsynced: list[list[str]] = []

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        # Sync back on, and no unsharded gradient left over from an unsynced (or abandoned) micro-batch.
        self.unsynced.append(_compat.fsdp2_unsynced_state(self))
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        callback = next(cb for cb in self.trainer.callbacks if isinstance(cb, AutoMicroBatching))
        self.sizes.append(callback.last_step_report.micro_batch_size)


class _SaveSplitRun(_SaveRun):
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        callback = next(cb for cb in trainer.callbacks if isinstance(cb, AutoMicroBatching))
        path = os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt")
        figures = torch.load(path, weights_only=False)
        figures.update(
            sizes=pl_module.sizes,
            unsynced=pl_module.unsynced,
            oom_retries=callback.oom_retries,
            events=[(e.kind, e.step, e.before, e.after) for e in callback.events],
            fired=callback.fault_injector.fired if callback.fault_injector else [],
            gradient_sync=callback.gradient_sync,
        )
        torch.save(figures, path)


def split_dataset(steps: int, empty: tuple[int, int] | None = None) -> h.TokenDataset:
    """The training set; optionally, ``empty = (s, first)``: from sample ``first`` on, rank 0's step batch ``s`` holds
    no loss-bearing token.

    The worker then shards it with a sequential `DistributedSampler` (Lightning's own would shuffle), which gives rank
    r the samples r, r + 2, ...: rank 0's step batch s is samples 2 (16 s + j), j < 16, its last micro-batch j >= 12.
    """
    n = WORLD_SIZE * STEP_BATCH * steps
    if empty is None:
        return h.TokenDataset(n, seed=1)
    step, first = empty
    lengths = [1 + i % 8 for i in range(n)]
    for j in range(first, STEP_BATCH):
        lengths[WORLD_SIZE * (STEP_BATCH * step + j)] = 0
    return h.TokenDataset(n, seed=1, lengths=lengths)


def _worker(
    rank: int, port: int, out_dir: str, steps: int, faults: list[OOMFault], empty: tuple[int, int] | None = None
) -> None:
    counter, strategy = start_worker(rank, port)
    callback = faulted_callback(MICRO, faults)
    sequential = empty is not None  # where each sample lands must be known
    trainer = h.make_trainer(
        out_dir,
        [callback, _SaveSplitRun(out_dir, counter)],
        strategy=strategy,
        devices=WORLD_SIZE,
        use_distributed_sampler=not sequential,
    )
    dataset = split_dataset(steps, empty)
    sampler = DistributedSampler(dataset, WORLD_SIZE, rank, shuffle=False) if sequential else None
    try:
        # The launcher reports only the first process that failed: each one says how it ended.
        with h.rank_error_written(out_dir, rank):
            trainer.fit(SplitShardedModel(), DataLoader(dataset, batch_size=STEP_BATCH, sampler=sampler))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_split(
    out_dir: Any, steps: int, faults: list[OOMFault], empty: tuple[int, int] | None = None
) -> list[dict[str, Any]]:
    args = (_free_port(), str(out_dir), steps, faults, empty)
    h.start_ranks(_worker, args, WORLD_SIZE)
    return load_split(out_dir)


def load_split(out_dir: Any) -> list[dict[str, Any]]:
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(WORLD_SIZE)]


# ---- the cases that end without an error share one launch of the ranks ----------------------------------------------
# Starting 2 ranks costs several seconds on a loaded 2-core machine: the runs that end normally run one after the other
# in one `start_ranks` call, each with a process group of its own and its own output folder; each test checks its own.

SHARED = {
    "exact": (3, [], None),
    # Step 0: OOM on rank 1 in micro-batch 1's forward. Step 2: in micro-batch 2's backward, after micro-batches 0
    # and 1 accumulated unsharded gradients that the retry must not count twice.
    "oom": (
        4,
        [
            OOMFault(step=0, micro_batch=1, phase="forward", rank=1, when_size_above=MICRO // 2),
            OOMFault(step=2, micro_batch=2, phase="backward", rank=1, when_size_above=MICRO // 2),
        ],
        None,
    ),
    # Rank 0's micro-batches from sample `first` on hold no loss-bearing token at step 1.
    "last-micro-batch": (3, [], (1, STEP_BATCH - MICRO)),
    # Every micro-batch of rank 0's step 1 holds no item, also in the retry at micro-batches of 2.
    "whole-step": (3, [OOMFault(step=1, micro_batch=1, phase="forward", rank=0, when_size_above=2)], (1, 0)),
}
"""Each case: steps, faults, empty (as `run_split` takes them)."""


def _shared_worker(rank: int, ports: list[int], out_dir: str) -> None:
    for (name, (steps, faults, empty)), port in zip(SHARED.items(), ports, strict=True):
        _worker(rank, port, os.path.join(out_dir, name), steps, faults, empty)


@pytest.fixture(scope="module")
def shared_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, BaseException | None]:
    """The `SHARED` cases, run once for the module: their folder, and the error that stopped the ranks (or None)."""
    out_dir = tmp_path_factory.mktemp("fsdp2-split")
    for name in SHARED:
        (out_dir / name).mkdir()
    try:
        h.start_ranks(_shared_worker, ([_free_port() for _ in SHARED], str(out_dir)), WORLD_SIZE)
    except Exception as error:  # each test whose case did not finish fails with it
        return out_dir, error
    return out_dir, None


def shared_split(shared_runs: tuple[Any, BaseException | None], name: str) -> list[dict[str, Any]]:
    """What each rank saved in the shared case ``name``; the ranks' error where that case did not finish."""
    out_dir, error = shared_runs
    if error is not None and not all((out_dir / name / f"rank{r}.pt").exists() for r in range(WORLD_SIZE)):
        raise RuntimeError(f"the shared ranks stopped before case {name!r} finished") from error
    return load_split(out_dir / name)


def check_exact(ranks: list[dict[str, Any]], steps: int, empty: tuple[int, int] | None = None) -> None:
    assert all(r["sharded"] for r in ranks), "the parameters must be FSDP2 DTensors for this test to bite"
    assert [r["optimizer_steps"] for r in ranks] == [steps] * WORLD_SIZE
    assert [r["gradient_sync"] for r in ranks] == ["overlap"] * WORLD_SIZE
    dataset = split_dataset(steps, empty)
    tokens = [[sum(int(dataset.mask[i].sum()) for i in step) for step in r["step_indices"]] for r in ranks]
    assert all(a != b for a, b in zip(*tokens, strict=True)), "the ranks must hold different token counts"
    windows = [a + b for a, b in zip(ranks[0]["step_indices"], ranks[1]["step_indices"], strict=True)]
    assert all(len(w) == WORLD_SIZE * STEP_BATCH for w in windows)
    h.assert_grads_close(ranks[0]["step_grads"], ranks[1]["step_grads"], rtol=0, atol=0)
    expected = h.replay_reference(SplitShardedModel(), dataset, windows, h.token_loss, lr=LR)
    h.assert_grads_close(ranks[0]["step_grads"], expected, **h.FP32)
    # One reduce-scatter per FSDP unit per optimizer step: no unsynced or abandoned micro-batch reduce-scatters.
    assert [reduce_scatters(r) for r in ranks] == [FSDP_UNITS * steps] * WORLD_SIZE
    assert [r["unsynced"] for r in ranks] == [[[]] * steps] * WORLD_SIZE


@pytest.mark.timeout(300)  # the first test to use `shared_runs` runs every shared case
def test_split_mode_under_fsdp2_is_exact_with_one_reduce_scatter_per_step(shared_runs):
    steps = 3
    assert SHARED["exact"] == (steps, [], None)
    ranks = shared_split(shared_runs, "exact")
    check_exact(ranks, steps)
    assert [r["sizes"] for r in ranks] == [[MICRO] * steps] * WORLD_SIZE
    assert [r["oom_retries"] for r in ranks] == [0, 0]


@pytest.mark.timeout(300)  # the first test to use `shared_runs` runs every shared case
def test_oom_on_one_rank_in_a_forward_or_an_unsynced_backward_is_retried_on_both(shared_runs):
    # Step 0: OOM on rank 1 in micro-batch 1's forward. Step 2: in micro-batch 2's backward, after micro-batches 0
    # and 1 accumulated unsharded gradients that the retry must not count twice.
    steps = 4
    faults = [
        OOMFault(step=0, micro_batch=1, phase="forward", rank=1, when_size_above=MICRO // 2),
        OOMFault(step=2, micro_batch=2, phase="backward", rank=1, when_size_above=MICRO // 2),
    ]
    assert SHARED["oom"] == (steps, faults, None)
    ranks = shared_split(shared_runs, "oom")
    assert ranks[0]["fired"] == []
    assert ranks[1]["fired"] == [(1, 0, 1, "forward"), (1, 2, 2, "backward")]
    assert [r["oom_retries"] for r in ranks] == [2, 2]
    oom_events = [("oom_recovered", step, MICRO, MICRO // 2) for step in (0, 2)]
    assert [e for e in ranks[0]["events"] if e[0] == "oom_recovered"] == oom_events
    assert ranks[0]["events"] == ranks[1]["events"]
    assert ranks[0]["sizes"] == ranks[1]["sizes"]
    assert ranks[0]["sizes"][::2] == [MICRO // 2] * 2  # each faulted step re-ran in halves
    check_exact(ranks, steps)


def test_oom_inside_the_reduce_scattering_backward_is_a_clear_error_not_a_hang(tmp_path):
    faults = [OOMFault(step=1, micro_batch=MICRO - 1, phase="backward", rank=0)]
    start = time.monotonic()
    # The launcher re-raises the first failure it sees: rank 0's error, or rank 1's lost connection to it.
    with pytest.raises(Exception, match=r"inside the synced backward|Connection closed by peer"):
        run_split(tmp_path, steps=3, faults=faults)
    assert time.monotonic() - start < 60
    with open(os.path.join(tmp_path, "error0.txt")) as f:
        error = f.read()
    assert error.startswith("RuntimeError: Out of memory inside the synced backward of the last micro-batch (FSDP2,")
    assert "FSDP2's reduce-scatter" in error
    # Rank 1 learnt of it from its reduce-scatter (inside its backward, or where FSDP2 waits on it later, in the next
    # collective), or the launcher stopped it first.
    path = os.path.join(tmp_path, "error1.txt")
    if os.path.exists(path):
        with open(path) as f:
            error = f.read()
        assert "synced backward" in error or "Connection closed by peer" in error, error


@pytest.mark.timeout(300)  # the first test to use `shared_runs` runs every shared case
@pytest.mark.parametrize(
    ("first", "faults"),
    [
        pytest.param(STEP_BATCH - MICRO, [], id="last-micro-batch"),
        # Every micro-batch of rank 0's step 1 holds no item, also in the retry at micro-batches of 2.
        pytest.param(0, [OOMFault(step=1, micro_batch=1, phase="forward", rank=0, when_size_above=2)], id="whole-step"),
    ],
)
def test_micro_batches_without_items_on_one_rank_are_exact(shared_runs, request, first, faults):
    # Rank 0's micro-batches from sample `first` on hold no loss-bearing token at step 1. Its last backward still
    # joins the reduce-scatter, with exactly zero gradient; the earlier empty ones run no backward.
    steps, empty = 3, (1, first)
    case = request.node.callspec.id
    assert SHARED[case] == (steps, faults, empty)
    ranks = shared_split(shared_runs, case)
    assert [r["oom_retries"] for r in ranks] == [len(faults)] * WORLD_SIZE
    check_exact(ranks, steps, empty)


def test_deferred_sync_is_refused_under_fsdp2(tmp_path):
    callback = AutoMicroBatching(MICRO, gradient_sync="deferred")
    strategy = h.fsdp2_strategy(WORLD_SIZE)
    with pytest.raises(ValueError, match=r"`gradient_sync='deferred'` is not available under `ModelParallelStrategy`"):
        callback.setup(_WithStrategy(h.make_trainer(tmp_path), strategy), SplitShardedModel(), "fit")


def test_fsdp1_is_refused_with_a_pointer_to_fsdp2(tmp_path):
    # `FSDPStrategy` needs CUDA to be part of a Trainer; `setup` only looks at the strategy's type.
    fsdp1 = FSDPStrategy.__new__(FSDPStrategy)
    with pytest.raises(RuntimeError, match=r"`FSDPStrategy` \(FSDP1.*ModelParallelStrategy.*fully_shard"):
        AutoMicroBatching(MICRO).setup(_WithStrategy(h.make_trainer(tmp_path), fsdp1), SplitShardedModel(), "fit")


class _WithStrategy:
    """A Trainer as ``setup`` sees it, with another strategy."""

    def __init__(self, trainer: pl.Trainer, strategy: Any) -> None:
        self._trainer = trainer
        self.strategy = strategy

    def __getattr__(self, name: str) -> Any:
        return getattr(self._trainer, name)
