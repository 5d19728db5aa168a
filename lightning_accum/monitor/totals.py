"""What the monitor adds up between logging steps and over a fit: intervals, windows, training time, memory. Pure.

`IntervalTotals`, `LightningWindows`, `TrainingClock` and `RankMemory`; `lightning_accum.monitor.summary.FitSummary`
sums a whole fit up, and `lightning_accum.monitor.metrics` builds what is logged from them.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_accum import keys
from lightning_accum.core.step_report import AccumulationEvent, LossSum, StepReport
from lightning_accum.memory.backends import MemoryBackend
from lightning_accum.monitor.rows import to_gib


@dataclass
class IntervalTotals:
    """What the steps of one logging interval add up to, from their `lightning_accum.core.step_report.StepReport`.

    A new interval starts from a new `IntervalTotals`.

    Examples:
        >>> totals = IntervalTotals()
        >>> for loss in (2.0, 4.0):
        ...     totals.add(StepReport("window", 4, 2, 8, 8.0, 8, loss_sum=torch.tensor(loss * 8), loss_items=8))
        >>> totals.samples, totals.steps, float(totals.loss.total) / totals.loss.items
        (16, 2, 3.0)
    """

    samples: int = 0
    items: float = 0.0
    steps: int = 0
    loss: LossSum = dataclasses.field(default_factory=LossSum)
    events: list[AccumulationEvent] = dataclasses.field(default_factory=list)
    peak_bytes: int = 0  # the largest peak an owner measured in the interval (split mode), all ranks
    last: StepReport | None = None

    def add(self, report: StepReport) -> None:
        """Count one optimizer step."""
        self.samples += report.effective_batch_size
        self.items += report.items
        self.steps += 1
        if report.loss_sum is not None and report.loss_items is not None:
            self.loss.total = self.loss.total + report.loss_sum
            self.loss.items = self.loss.items + report.loss_items
        self.events.extend(report.events)
        if report.peak_bytes is not None:
            self.peak_bytes = max(self.peak_bytes, report.peak_bytes)
        self.last = report


class LightningWindows:
    """Builds the step reports no owner publishes: plain ``Trainer(accumulate_grad_batches=k)``, counted from batches.

    Items are samples (there is no item counter), and the loss is Lightning's mean over each micro-batch.

    Examples:
        >>> windows = LightningWindows()
        >>> windows.add_micro_batch(4, torch.tensor(1.0))
        >>> windows.add_micro_batch(2, torch.tensor(4.0))
        >>> report = windows.finish()
        >>> report.effective_batch_size, report.accumulation_steps, float(report.loss_sum) / report.loss_items
        (6, 2, 2.0)
    """

    def __init__(self, global_step: int = 0) -> None:
        self.consumed_samples = 0
        self._global_step = global_step  # the Trainer's, when the last window stepped
        self._start()

    def _start(self) -> None:
        self._samples = 0
        self._micro_batches = 0
        self._first_size = 0
        self._loss = LossSum()

    def add_micro_batch(self, n_samples: int, mean_loss: Tensor | None) -> None:
        """Count a micro-batch of ``n_samples`` whose ``training_step`` returned ``mean_loss`` (``None``: skipped)."""
        if self._micro_batches == 0:
            self._first_size = n_samples
        self._samples += n_samples
        self._micro_batches += 1
        if mean_loss is not None:
            self._loss.add(mean_loss, n_samples, "mean")

    def step_report(self, n_samples: int, outputs: Any, loss_divisor: float, global_step: int) -> StepReport | None:
        """Count a micro-batch; the window's report if the Trainer's ``global_step`` moved on, else ``None``.

        Args:
            n_samples: the micro-batch's samples.
            outputs: what ``training_step`` returned: the loss, a dict with a ``"loss"``, or ``None`` (skipped).
            loss_divisor: what Lightning divided that loss by (``accumulate_grad_batches``), multiplied back.
            global_step: the Trainer's optimizer steps so far.

        Examples:
            >>> windows = LightningWindows(global_step=0)
            >>> windows.step_report(4, {"loss": torch.tensor(0.5)}, 2, global_step=0) is None  # inside the window
            True
            >>> report = windows.step_report(4, torch.tensor(1.5), 2, global_step=1)
            >>> report.effective_batch_size, float(report.loss_sum) / report.loss_items
            (8, 2.0)
        """
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        self.add_micro_batch(n_samples, loss.detach() * loss_divisor if isinstance(loss, Tensor) else None)
        if global_step == self._global_step:
            return None
        self._global_step = global_step
        return self.finish()

    def finish(self) -> StepReport:
        """The report of the window that just stepped, starting the next; its counts are this rank's only.

        Nothing is summed over ranks here, at every step: `globalize` does it once per logging step.
        """
        samples = self._samples
        self.consumed_samples += samples
        report = StepReport(
            mode="lightning",
            micro_batch_size=self._first_size,
            accumulation_steps=self._micro_batches,
            effective_batch_size=samples,
            items=float(samples),
            consumed_samples=self.consumed_samples,
            loss_sum=self._loss.total,
            loss_items=self._loss.items,
        )
        self._start()
        return report

    @staticmethod
    def globalize(
        interval: IntervalTotals, sum_across_ranks: Callable[[Tensor], Tensor] | None
    ) -> tuple[StepReport, float]:
        """The interval's last report and sample count summed over ranks (one small all-reduce under DDP)."""
        last = interval.last
        assert last is not None
        local = torch.tensor([float(last.effective_batch_size), float(interval.samples)], dtype=torch.float64)
        step_samples, interval_samples = (sum_across_ranks(local) if sum_across_ranks is not None else local).tolist()
        report = dataclasses.replace(last, effective_batch_size=int(step_samples), items=step_samples)
        return report, interval_samples


class TrainingClock:
    """Wall time of training with validation left out: since the start of ``fit``, and since the last logging step.

    Args:
        now: the clock to read, in seconds (`time.perf_counter` by default; a test passes its own).

    Examples:
        >>> ticks = iter([0.0, 3.0, 5.0, 9.0, 10.0])
        >>> clock = TrainingClock(now=lambda: next(ticks))  # starts at 0
        >>> clock.pause(); clock.resume()  # a validation from 3 s to 5 s
        >>> clock.interval_seconds(), clock.train_seconds()  # read at 9 s and at 10 s
        (7.0, 8.0)
    """

    def __init__(self, now: Callable[[], float] = time.perf_counter) -> None:
        self._clock = now
        self._paused_at: float | None = None
        self._stopped_at: float | None = None
        self.carried = 0.0
        self.start()

    def _now(self) -> float:
        return self._clock() if self._stopped_at is None else self._stopped_at

    def start(self, carried: float = 0.0) -> None:
        """Start counting a new ``fit``; ``carried`` is the training time of the run before it (a resumed run's)."""
        self._stopped_at = None
        self._paused_at = None
        self.carried = carried
        self._fit_start = self._interval_start = self._now()
        self._interval_paused = self._fit_paused = 0.0

    def stop(self) -> None:
        """The ``fit`` ended: the clock reads the time it ended at from now on."""
        if self._stopped_at is None:
            self._stopped_at = self._clock()

    def new_interval(self) -> None:
        """Start counting a new logging interval."""
        self._interval_paused = 0.0
        self._interval_start = self._now()

    def pause(self) -> None:
        """Validation starts: what follows is not training."""
        self._paused_at = self._now()

    def resume(self) -> None:
        """Validation ended (nothing happens without a `pause` before)."""
        if self._paused_at is not None:
            seconds = self._now() - self._paused_at
            self._interval_paused += seconds
            self._fit_paused += seconds
            self._paused_at = None

    def interval_seconds(self) -> float:
        """Training seconds since the last logging step (or the start)."""
        return self._now() - self._interval_start - self._interval_paused

    def fit_seconds(self) -> float:
        """Training seconds since the start of ``fit`` (a validation under way left out too)."""
        now = self._now()
        pausing = 0.0 if self._paused_at is None else now - self._paused_at
        return now - self._fit_start - self._fit_paused - pausing

    def train_seconds(self) -> float:
        """Training seconds of the run: `carried` from before this ``fit``, and `fit_seconds`."""
        return self.carried + self.fit_seconds()


@dataclass(frozen=True)
class MemoryReading:
    """A logging interval's memory figures, each the maximum over ranks."""

    peak_bytes: int
    peak_reserved_bytes: int | None  # CUDA only
    capacity_bytes: int


class RankMemory:
    """This rank's memory backend, read at logging steps; the figures of all ranks through the collectives passed in.

    Args:
        backend: the device's `lightning_accum.memory.backends.MemoryBackend`; its capacity is read once, here (on CPU
            that walks the cgroup files).

    Examples:
        >>> from lightning_accum.memory.backends import CPUBackend
        >>> from lightning_accum.memory.budget import GIB
        >>> memory = RankMemory(CPUBackend(capacity_bytes=8 * GIB))
        >>> reading = memory.read(owner_peak=0, max_across=lambda local: local)  # one process: this rank's figures
        >>> to_gib(reading.capacity_bytes), reading.peak_reserved_bytes, reading.peak_bytes == memory.last_peak > 0
        (8.0, None, True)
    """

    def __init__(self, backend: MemoryBackend) -> None:
        self.backend = backend
        self.capacity_bytes = backend.capacity_bytes()
        self.last_peak = 0  # this rank's, at the last read

    def read(self, owner_peak: int, max_across: Callable[[Tensor], Tensor] | None) -> MemoryReading:
        """The peaks since the last read (or ``owner_peak``, an owner's measurement, when higher); resets the peak.

        ``max_across`` takes the element-wise maximum over ranks (one small all-reduce; every rank calls it); ``None``
        on a single process.
        """
        reserved = self.backend.peak_reserved_bytes()
        self.last_peak = max(owner_peak, self.backend.peak_bytes())
        local = torch.tensor(
            [self.last_peak, -1 if reserved is None else reserved, self.capacity_bytes], dtype=torch.int64
        )
        peak, peak_reserved, capacity = (int(v) for v in (max_across(local) if max_across else local).tolist())
        self.backend.reset_peak()
        return MemoryReading(peak, None if peak_reserved < 0 else peak_reserved, capacity)

    def rank_metrics(
        self,
        max_across: Callable[[Tensor], Tensor] | None,
        gather: Callable[[Tensor], Tensor] | None,
        *,
        allocator: bool,
    ) -> dict[str, float]:
        """The allocator's retries (max over ranks, where ``allocator``) and, given ``gather``, each rank's last peak.

        ``gather`` stacks a tensor from every rank (one all-gather of one number each); call it after `read`.
        """
        local = torch.tensor([self.backend.alloc_retries(), self.last_peak], dtype=torch.float64)
        metrics: dict[str, float] = {}
        if allocator:
            retries = local[:1].clone()
            metrics[keys.ALLOC_RETRIES] = float((max_across(retries) if max_across else retries).item())
        if gather is not None:
            gathered = gather(local[1:]).reshape(-1).tolist()
            metrics.update({f"memory/rank{rank}/peak_gib": to_gib(peak) for rank, peak in enumerate(gathered)})
        return metrics
