"""The monitor's keys for a loop of your own: what `AccumulationMonitor` logs, for the Fabric front ends.

A Fabric loop has no callbacks, so each Fabric front end holds a `StepLog`: it adds every step's report to the run's
summary and, at logging steps, builds the contract's row (`lightning_accum.keys`) with the window loss and the peak
over ranks, and the rates since the last logging step. No Trainer.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from lightning_accum import keys
from lightning_accum.core.engine import Ranks
from lightning_accum.core.step_report import StepReport
from lightning_accum.memory.backends import MemoryBackend
from lightning_accum.monitor.rows import event_metrics, rank_metrics, schedule_metrics, step_metrics, to_gib
from lightning_accum.monitor.summary import FitSummary


class StepLog:
    """Every step's report into the summary; at every ``every``-th step, the contract's row (one rank collective).

    Args:
        backend: the device's memory backend (its peak is read and reset at each logging step).
        ranks: the ranks whose window loss is summed and whose peak is maxed (every rank calls `add` alike).
        every: log every this many optimizer steps.
    """

    def __init__(self, backend: MemoryBackend, ranks: Ranks, every: int) -> None:
        self.backend, self.ranks, self.every = backend, ranks, every
        self.summary = FitSummary()
        self._clock = time.perf_counter()

    def add(self, report: StepReport, step: int) -> dict[str, float] | None:
        """Add optimizer ``step``'s report (counted from 0); its row where ``step`` is a logging step, else None."""
        self.summary.add(report)
        if step % self.every != 0:
            return None
        return self._row(report, steps=self.every if step > 0 else 1)

    def _row(self, report: StepReport, steps: int) -> dict[str, float]:
        """The contract's keys for one step: its batch figures, the window loss and peak memory over ranks, speed."""
        loss = torch.stack([_float64(report.loss_sum), _float64(report.loss_items)])
        peak = torch.tensor([self.backend.peak_bytes()], dtype=torch.int64)
        if self.ranks.sum is not None and self.ranks.max is not None:
            loss, peak = self.ranks.sum(loss), self.ranks.max(peak)
        capacity = self.backend.capacity_bytes()
        now = time.perf_counter()
        seconds, self._clock = now - self._clock, now
        metrics = {
            **step_metrics(report),
            **rank_metrics(report),
            **event_metrics(report.events),
            **schedule_metrics(report),
        }
        metrics[keys.WINDOW_LOSS] = float(loss[0] / loss[1]) if loss[1] > 0 else float("nan")
        metrics[keys.PEAK_GIB] = to_gib(int(peak[0]))
        metrics[keys.CAPACITY_GIB] = to_gib(capacity)
        metrics[keys.PEAK_FRACTION] = int(peak[0]) / capacity if capacity else 0.0
        if seconds > 0:
            metrics[keys.SAMPLES_PER_SEC] = report.effective_batch_size * steps / seconds
            metrics[keys.ITEMS_PER_SEC] = float(report.items) * steps / seconds
        self.backend.reset_peak()
        return metrics


def _float64(value: Any) -> torch.Tensor:
    return torch.as_tensor(value, dtype=torch.float64).reshape(()).detach().cpu()
