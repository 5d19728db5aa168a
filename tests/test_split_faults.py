"""Split mode under faults: what an OOM retry measures, OOMs without a message, and ``gradient_sync="overlap"`` on 2
ranks (gloo) with an error on one rank before, at and inside the synced backward.

Every DDP case ends without a hang (the test's timeout is the hang detector): recovered exactly where the docs say
the fault is recoverable, and stopped on every rank with a clear error where it is not.
"""

from __future__ import annotations

import copy
import os
import time
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from lightning_accum import AutoMicroBatching
from lightning_accum.memory.oom import OOMFault, OOMInjector, oom_error
from tests.callbacks.test_auto_micro_batching import SplitTokenModel
from tests.helpers import (
    FP32,
    TokenDataset,
    assert_grads_close,
    count_tokens,
    make_trainer,
    raised_in,
    rank_error_written,
    replay_reference,
    token_loss,
)
from tests.test_ddp import ddp_trainer, load_ranks
from tests.test_ddp_split import SaveSplitFigures, faulted_callback

# ---- issue 9, item 8: the peak after an OOM retry is the retry's own -------------------------------------------------


class FakeBackend:
    """A device whose peak is whatever the test says was allocated since the last reset (deterministic)."""

    name = "fake"

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.peak = 0

    def allocate(self, nbytes: int) -> None:
        self.peak = max(self.peak, nbytes)

    def reset_peak(self) -> None:
        self.peak = 0

    def peak_bytes(self) -> int:
        return self.peak

    def peak_reserved_bytes(self) -> int | None:
        return None

    def capacity_bytes(self) -> int:
        return self.capacity

    def alloc_retries(self) -> int:
        return 0

    def current_bytes(self) -> int:
        return 0


PER_SAMPLE = 2**20  # bytes a sample costs on the fake device


class SpikeThenOOM(SplitTokenModel):
    """A micro-batch takes ``PER_SAMPLE`` bytes per sample; at step 1 the first attempt fills the device, then OOMs."""

    def __init__(self, backend: FakeBackend) -> None:
        super().__init__(lr=0.05)
        self.backend = backend
        self.failed = False

    def training_step(self, batch, batch_idx):
        self.backend.allocate(len(batch["x"]) * PER_SAMPLE)
        if self.global_step == 1 and not self.failed:
            self.failed = True
            self.backend.allocate(self.backend.capacity)  # what a real OOM leaves in the peak counter
            raise oom_error("cuda")
        return super().training_step(batch, batch_idx)


def test_one_oom_causes_exactly_one_shrink(tmp_path, monkeypatch):
    backend = FakeBackend(capacity=64 * PER_SAMPLE)
    monkeypatch.setattr("lightning_accum.split.session.backend_for", lambda device: backend)
    callback = AutoMicroBatching(8, max_memory=10 * PER_SAMPLE, count_items=count_tokens)
    peaks: list[tuple[int, int]] = []
    on_step = callback.planner.on_step

    def record(size, peak_bytes, step, alloc_retries_delta=0):
        peaks.append((size, peak_bytes))
        return on_step(size, peak_bytes, step, alloc_retries_delta)

    callback.planner.on_step = record
    dataset = TokenDataset(64)
    model = SpikeThenOOM(backend)
    initial = copy.deepcopy(model)
    make_trainer(tmp_path, [callback]).fit(model, DataLoader(dataset, batch_size=16))

    events = [(e.kind, e.step, e.before, e.after) for e in callback.events]
    assert events == [("oom_recovered", 1, 8, 4)]  # one OOM, one shrink: the retry's peak fits the budget
    assert peaks == [(8, 8 * PER_SAMPLE), (4, 4 * PER_SAMPLE), (4, 4 * PER_SAMPLE), (4, 4 * PER_SAMPLE)]
    expected = replay_reference(initial, dataset, model.step_indices, token_loss, lr=0.05)
    assert_grads_close(model.step_grads, expected, **FP32)


# ---- issue 9, item 14: an OOM with an empty message ------------------------------------------------------------------


class RaiseOnce(SplitTokenModel):
    """Raises ``error`` in ``training_step`` once, at a chosen step, rank and micro-batch ("first" or "last")."""

    def __init__(self, error: str, step: int, rank: int | None = None, where: str = "first") -> None:
        super().__init__(lr=0.05)
        self.error, self.fail_step, self.fail_rank, self.where = error, step, rank, where
        self.raised = False
        self.sizes: list[int] = []

    def training_step(self, batch, batch_idx):
        self.maybe_raise(batch)
        return super().training_step(batch, batch_idx)

    def maybe_raise(self, batch: dict[str, torch.Tensor]) -> None:
        index = batch["index"].tolist()
        at = index[0] == self._window_indices[0] if self.where == "first" else index[-1] == self._window_indices[-1]
        rank_matches = self.fail_rank is None or self.fail_rank == self.global_rank
        # Only above size 2, so that the retry (in halves) goes through.
        if at and rank_matches and self.global_step == self.fail_step and not self.raised and len(index) > 2:
            self.raised = True
            raise make_error(self.error)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        callback = next(cb for cb in self.trainer.callbacks if isinstance(cb, AutoMicroBatching))
        self.sizes.append(callback.last_step_report.micro_batch_size)


def make_error(name: str) -> BaseException:
    # Built by name so that a model holding the choice pickles for ddp_spawn.
    return {
        "memory_error": MemoryError(),  # what `bytearray` raises when an allocation fails: no message at all
        "torch_oom": torch.OutOfMemoryError(),
        "value_error": ValueError("boom: a bug in training_step"),
    }[name]


@pytest.mark.parametrize("error", ["memory_error", "torch_oom"])
def test_an_oom_without_a_message_is_recovered(tmp_path, error):
    callback = AutoMicroBatching(4, count_items=count_tokens)
    dataset = TokenDataset(48)
    model = RaiseOnce(error, step=1)
    initial = copy.deepcopy(model)
    make_trainer(tmp_path, [callback]).fit(model, DataLoader(dataset, batch_size=16))
    assert callback.oom_retries == 1
    assert model.sizes == [4, 2, 2]
    expected = replay_reference(initial, dataset, model.step_indices, token_loss, lr=0.05)
    assert_grads_close(model.step_grads, expected, **FP32)


# ---- issue 9, item 15: an exception in fit leaves nothing patched ----------------------------------------------------


def fit_until_the_error(tmp_path: Any) -> tuple[AutoMicroBatching, TokenDataset, RaiseOnce, RaiseOnce, pl.Trainer]:
    """A split-mode fit that raises ``ValueError("boom")`` at step 2: the callback, data, model, its initial copy
    and the trainer, to fit again."""
    callback = AutoMicroBatching(4, count_items=count_tokens)
    dataset = TokenDataset(64)
    model = RaiseOnce("value_error", step=2)
    initial = copy.deepcopy(model)
    trainer = make_trainer(tmp_path, [callback])
    with pytest.raises(ValueError, match="boom"):
        trainer.fit(model, DataLoader(dataset, batch_size=16))
    return callback, dataset, model, initial, trainer


def test_the_same_trainer_fits_again_exactly_after_an_exception(tmp_path):
    _, dataset, model, initial, trainer = fit_until_the_error(tmp_path)
    assert trainer.global_step == 2
    assert "_make_closure" not in vars(trainer.fit_loop.epoch_loop.automatic_optimization)  # undone on the exception

    trainer.fit(model, DataLoader(dataset, batch_size=16))
    assert trainer.global_step > 2
    assert trainer.accumulate_grad_batches == 1
    expected = replay_reference(initial, dataset, model.step_indices, token_loss, lr=0.05)
    assert_grads_close(model.step_grads, expected, **FP32)


def test_a_fit_without_the_callback_after_an_exception_is_plain_lightning(tmp_path):
    # Left patched, the loop would still split the batch, and without the callback's rescale the gradient was off.
    callback, dataset, model, initial, trainer = fit_until_the_error(tmp_path)
    trainer.callbacks.remove(callback)
    model.micro_batch_sizes.clear()
    trainer.fit(model, DataLoader(dataset, batch_size=16))
    assert set(model.micro_batch_sizes) == {16}
    expected = replay_reference(initial, dataset, model.step_indices, token_loss, lr=0.05)
    assert_grads_close(model.step_grads, expected, **FP32)


# ---- issue 9, item 13: gradient_sync="overlap" on 2 ranks ------------------------------------------------------------

STEP_BATCH = 16  # per rank
MICRO = 4  # micro-batch 0 is the first, 3 the last (whose backward DDP syncs in overlap mode)


class OverlapModel(RaiseOnce):
    """Sequential per-rank shards (rank r sees samples r, r+2, ...), so a test can place an empty micro-batch.

    The error that ends a rank's step is written to ``error{rank}.txt`` in ``out_dir`` (`rank_error_written`).
    """

    def __init__(self, dataset: TokenDataset, out_dir: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.dataset = dataset
        self.out_dir = out_dir

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        with rank_error_written(self.out_dir, self.global_rank):
            super().optimizer_step(*args, **kwargs)

    def training_step(self, batch, batch_idx):
        self.maybe_raise(batch)
        # The usual masked mean without a clamp: NaN for a micro-batch with no loss-bearing token.
        per_token = (self.layer(batch["x"]).squeeze(-1) - batch["y"]) ** 2
        return (per_token * batch["mask"]).sum() / batch["mask"].sum()

    def train_dataloader(self) -> DataLoader:
        sampler = DistributedSampler(self.dataset, shuffle=False)  # built in the worker, where the rank is known
        return DataLoader(self.dataset, batch_size=STEP_BATCH, sampler=sampler)


class SaveFigures(SaveSplitFigures):
    """Saves what each rank did, with the callback's events."""

    def callback_figures(self, callback: AutoMicroBatching) -> dict[str, Any]:
        return {"events": [(e.kind, e.step, e.before, e.after) for e in callback.events]}


def overlap_dataset(steps: int, empty_last_on_rank0_at: int | None = None) -> TokenDataset:
    n = 2 * STEP_BATCH * steps
    lengths = [1 + i % 8 for i in range(n)]
    if empty_last_on_rank0_at is not None:
        # Rank 0 holds the even samples: its step batch s is 2 * (16 s + j) for j < 16; the last micro-batch j >= 12.
        for j in range(STEP_BATCH - MICRO, STEP_BATCH):
            lengths[2 * (STEP_BATCH * empty_last_on_rank0_at + j)] = 0
    return TokenDataset(n, seed=1, lengths=lengths)


def fit_overlap(tmp_path: Any, model: OverlapModel, callback: AutoMicroBatching) -> pl.Trainer:
    trainer = ddp_trainer(tmp_path, [callback, SaveFigures(str(tmp_path))], use_distributed_sampler=False)
    trainer.fit(model)
    return trainer


def read_errors(tmp_path: Any) -> dict[int, str]:
    errors = {}
    for rank in range(2):
        path = os.path.join(tmp_path, f"error{rank}.txt")
        if os.path.exists(path):
            with open(path) as f:
                errors[rank] = f.read()
    return errors


@pytest.mark.ddp
@pytest.mark.timeout(120)
def test_overlap_recovers_ooms_on_one_rank_before_the_synced_backward(tmp_path):
    # Step 0: OOM on rank 1 in the first forward. Step 1: rank 0's last micro-batch has no loss-bearing token (its
    # NaN loss must not reach the synced gradient). Step 2: OOM on rank 0 in the last forward. Step 4: a bare
    # `MemoryError()` on rank 1 inside the last micro-batch's `training_step`. Step 6: OOM on rank 0 in a backward
    # DDP doesn't sync. Each faulted step re-runs in halves on both ranks, and the size grows back to 4 by the next.
    steps = 8
    faults = [
        OOMFault(step=0, micro_batch=0, phase="forward", rank=1),
        OOMFault(step=2, micro_batch=MICRO - 1, phase="forward", rank=0),
        OOMFault(step=6, micro_batch=1, phase="backward", rank=0),
    ]
    dataset = overlap_dataset(steps, empty_last_on_rank0_at=1)
    model = OverlapModel(dataset, str(tmp_path), error="memory_error", step=4, rank=1, where="last")
    initial = copy.deepcopy(model)
    callback = faulted_callback(MICRO, faults, gradient_sync="overlap")
    fit_overlap(tmp_path, model, callback)

    assert read_errors(tmp_path) == {}
    ranks = load_ranks(tmp_path)
    fired = sorted(ranks[0]["fired"] + ranks[1]["fired"])
    assert fired == [(0, 2, MICRO - 1, "forward"), (0, 6, 1, "backward"), (1, 0, 0, "forward")]
    assert [r["oom_retries"] for r in ranks] == [4, 4]
    # Every fault struck at size 4 (micro-batch 3 was the last) and was retried at 2, on both ranks alike.
    oom_events = [("oom_recovered", step, MICRO, MICRO // 2) for step in (0, 2, 4, 6)]
    assert [e for e in ranks[0]["events"] if e[0] == "oom_recovered"] == oom_events
    assert ranks[0]["events"] == ranks[1]["events"]
    assert ranks[0]["sizes"] == ranks[1]["sizes"]
    # One DDP all-reduce per optimizer step: an abandoned attempt never leaves DDP's reducer armed.
    assert [r["allreduces"] for r in ranks] == [steps, steps]
    windows = [a + b for a, b in zip(ranks[0]["step_indices"], ranks[1]["step_indices"], strict=True)]
    expected = replay_reference(initial, dataset, windows, token_loss, lr=0.05)
    assert_grads_close(ranks[0]["step_grads"], ranks[1]["step_grads"], rtol=0, atol=0)
    assert_grads_close(ranks[0]["step_grads"], expected, **FP32)


@pytest.mark.ddp
@pytest.mark.timeout(120)
def test_overlap_stops_every_rank_on_an_error_in_the_last_forward(tmp_path):
    model = OverlapModel(overlap_dataset(3), str(tmp_path), error="value_error", step=1, rank=1, where="last")
    callback = AutoMicroBatching(MICRO, count_items=count_tokens, gradient_sync="overlap")
    with pytest.raises(Exception, match=r"boom: a bug in training_step|Another rank failed"):
        fit_overlap(tmp_path, model, callback)
    errors = read_errors(tmp_path)
    assert errors[1] == "ValueError: boom: a bug in training_step"
    assert errors[0].startswith("RuntimeError: Another rank failed with an error that is not an out-of-memory error")


@pytest.mark.ddp
@pytest.mark.timeout(120)
def test_overlap_oom_inside_the_synced_backward_is_a_clear_error_not_a_hang(tmp_path):
    # Not recoverable: rank 1 is already inside DDP's all-reduce. Rank 0 must say so at once, without another
    # collective, and both ranks must end in bounded time.
    model = OverlapModel(overlap_dataset(3), str(tmp_path), error="value_error", step=99)
    injector = OOMInjector(OOMFault(step=1, micro_batch=MICRO - 1, phase="backward", rank=0))
    callback = AutoMicroBatching(MICRO, count_items=count_tokens, gradient_sync="overlap", fault_injector=injector)
    start = time.monotonic()
    with pytest.raises(Exception, match="inside the synced backward"):
        fit_overlap(tmp_path, model, callback)
    assert time.monotonic() - start < 90
    errors = read_errors(tmp_path)
    assert errors[0].startswith("RuntimeError: Out of memory inside the synced backward of the last micro-batch")
    # Rank 1 learnt of it from its collective and says what happened, or was stopped by the launcher first. Where
    # rank 1 still waited in the agreement before its backward when rank 0 exited (rank 0 had already passed it), that
    # agreement fails; no second collective follows it. Where the launcher's SIGTERM came first, Lightning's handler
    # (`_SignalConnector._sigterm_notifier_fn`, Lightning >= 2.5) broadcasts from rank 0, which is gone: that
    # broadcast's gloo error ends rank 1 wherever it was, and says nothing of ours.
    if 1 in errors:
        stopped_by_the_launcher = "_sigterm_notifier_fn" in raised_in(str(tmp_path), 1)
        said_why = "synced backward" in errors[1] or "agreement on this step's attempt" in errors[1]
        assert said_why or stopped_by_the_launcher, (errors[1], raised_in(str(tmp_path), 1))


class BreakTheAgreement(pl.Callback):
    """On one rank, makes the agreement's all-reduce fail at one step, as it does when a peer's process is gone.

    Counts the agreement calls this rank makes after that failure in ``after{rank}.txt``: there must be none.
    """

    def __init__(self, out_dir: str, step: int, rank: int) -> None:
        self.out_dir, self.step, self.rank = out_dir, step, rank

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_rank != self.rank:
            return
        import lightning_accum.split.step as split_step

        real, failed = split_step.agreement_max, []

        def max_across_ranks(trainer_: pl.Trainer, tensor: torch.Tensor) -> torch.Tensor:
            # The agreement's own collective (`split_step.agreement_max`); the figures after a step gather apart.
            if failed or trainer_.global_step == self.step:
                failed.append(True)
                with open(os.path.join(self.out_dir, f"after{trainer_.global_rank}.txt"), "w") as f:
                    f.write(str(len(failed) - 1))
                raise RuntimeError("Connection closed by peer (simulated)")
            return real(trainer_, tensor)

        split_step.agreement_max = max_across_ranks


@pytest.mark.ddp
@pytest.mark.timeout(120)
@pytest.mark.parametrize("gradient_sync", ["deferred", "overlap"])
def test_a_failed_agreement_stops_the_rank_without_another_collective(tmp_path, gradient_sync):
    # A collective that failed because a peer is gone must not be followed by another one (the "an error elsewhere"
    # agreement): with gloo it fails again with the transport's bare message, with NCCL it can wait for the timeout.
    model = OverlapModel(overlap_dataset(3), str(tmp_path), error="value_error", step=99)
    callback = AutoMicroBatching(MICRO, count_items=count_tokens, gradient_sync=gradient_sync)
    breaker = BreakTheAgreement(str(tmp_path), step=1, rank=1)
    trainer = ddp_trainer(tmp_path, [callback, breaker], use_distributed_sampler=False)
    with pytest.raises(Exception, match=r"agreement on this step's attempt|closed by peer"):
        trainer.fit(model)
    errors = read_errors(tmp_path)
    assert errors[1].startswith("_AgreementFailed: The ranks' agreement on this step's attempt (step 1"), errors[1]
    assert "Connection closed by peer (simulated)" in errors[1]
    with open(os.path.join(tmp_path, "after1.txt")) as f:
        assert f.read() == "0"  # no collective after the failed one


class BatchNormModel(RaiseOnce):
    """Has buffers, which DDP broadcasts from rank 0: a collective that must not end up inside a failed attempt."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.norm = torch.nn.BatchNorm1d(5)

    def training_step(self, batch, batch_idx):
        batch = {**batch, "x": self.norm(batch["x"].transpose(1, 2)).transpose(1, 2)}
        return super().training_step(batch, batch_idx)


@pytest.mark.ddp
@pytest.mark.timeout(120)
def test_overlap_with_buffers_recovers_ooms_before_and_inside_the_first_forward(tmp_path):
    # Step 1: a `MemoryError()` on rank 1 inside its first forward, after DDP's buffer broadcast would have run.
    # Step 3: an OOM on rank 0 before its first forward, where the other rank would be waiting in that broadcast.
    model = BatchNormModel(error="memory_error", step=1, rank=1, where="first")
    injector = OOMInjector(OOMFault(step=3, micro_batch=0, phase="forward", rank=0))
    callback = AutoMicroBatching(MICRO, count_items=count_tokens, gradient_sync="overlap", fault_injector=injector)
    trainer = ddp_trainer(tmp_path, [callback, SaveFigures(str(tmp_path))])
    trainer.fit(model, DataLoader(TokenDataset(2 * STEP_BATCH * 5, seed=1), batch_size=STEP_BATCH))
    ranks = load_ranks(tmp_path)
    assert [r["oom_retries"] for r in ranks] == [2, 2]
    assert ranks[0]["fired"] == [(0, 3, 0, "forward")]
    assert ranks[0]["sizes"] == ranks[1]["sizes"]
    assert [r["optimizer_steps"] for r in ranks] == [5, 5]
    assert [r["allreduces"] for r in ranks] == [5, 5]


class RecordsBuffers(BatchNormModel):
    """Records the batch-norm statistics that each step's first micro-batch starts from."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.step_buffers: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        if len(self.step_buffers) == self.global_step:
            self.step_buffers.append(self.norm.running_mean.detach().clone())
        return super().training_step(batch, batch_idx)


class SaveBuffers(SaveFigures):
    def on_train_end(self, trainer: pl.Trainer, pl_module: RecordsBuffers) -> None:
        super().on_train_end(trainer, pl_module)
        path = os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt")
        figures = torch.load(path, weights_only=False)
        torch.save({**figures, "step_buffers": pl_module.step_buffers}, path)


@pytest.mark.ddp
@pytest.mark.timeout(120)
@pytest.mark.parametrize("gradient_sync", ["deferred", "overlap"])
def test_every_step_starts_from_rank_zeros_buffers_as_under_plain_ddp(tmp_path, gradient_sync):
    # DDP broadcasts its buffers (batch-norm statistics) from rank 0 at the start of every step. Deferred mode did so
    # at step 0 only: its all-reduce never set the flag a synced backward sets, so from step 1 on each rank's
    # statistics went their own way (the ranks see different samples).
    model = RecordsBuffers(error="value_error", step=99)
    callback = AutoMicroBatching(MICRO, count_items=count_tokens, gradient_sync=gradient_sync)
    trainer = ddp_trainer(tmp_path, [callback, SaveBuffers(str(tmp_path))])
    trainer.fit(model, DataLoader(TokenDataset(2 * STEP_BATCH * 3, seed=1), batch_size=STEP_BATCH))
    ranks = load_ranks(tmp_path)
    assert [len(r["step_buffers"]) for r in ranks] == [3, 3]
    for step, (rank0, rank1) in enumerate(zip(ranks[0]["step_buffers"], ranks[1]["step_buffers"], strict=True)):
        torch.testing.assert_close(rank1, rank0, rtol=0, atol=0, msg=f"step {step}")
    assert not torch.equal(ranks[0]["step_buffers"][0], ranks[0]["step_buffers"][2])  # the statistics did move


@pytest.mark.ddp
@pytest.mark.timeout(120)
def test_overlap_recovers_an_oom_before_the_first_forward_of_the_step_after_the_first_sync(tmp_path):
    # DDP rebuilds its gradient buckets once, in the first forward after the first synced backward (step 1's), and
    # the rebuild broadcasts the bucket order from rank 0. An OOM on rank 1 before that forward left rank 0 alone in
    # the broadcast while rank 1 waited in the agreement: a hang. The rebuild now happens at the start of the step.
    model = OverlapModel(overlap_dataset(3), str(tmp_path), error="value_error", step=99)
    initial = copy.deepcopy(model)
    injector = OOMInjector(OOMFault(step=1, micro_batch=0, phase="forward", rank=1))
    callback = AutoMicroBatching(MICRO, count_items=count_tokens, gradient_sync="overlap", fault_injector=injector)
    start = time.monotonic()
    fit_overlap(tmp_path, model, callback)
    assert time.monotonic() - start < 100
    ranks = load_ranks(tmp_path)
    assert ranks[1]["fired"] == [(1, 1, 0, "forward")] and [r["oom_retries"] for r in ranks] == [1, 1]
    assert [r["allreduces"] for r in ranks] == [3, 3]
    windows = [a + b for a, b in zip(ranks[0]["step_indices"], ranks[1]["step_indices"], strict=True)]
    expected = replay_reference(initial, overlap_dataset(3), windows, token_loss, lr=0.05)
    assert_grads_close(ranks[0]["step_grads"], ranks[1]["step_grads"], rtol=0, atol=0)
    assert_grads_close(ranks[0]["step_grads"], expected, **FP32)
