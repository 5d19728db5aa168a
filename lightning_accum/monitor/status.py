"""A one-line status every so often, for runs whose output is a file: no progress bar redraws there. Pure.

A run under ``nohup`` or a batch scheduler writes its output to a file, where Lightning's progress bar shows nothing
useful (or nothing at all); hours can pass without a line. The monitor then prints one line per `STATUS_EVERY_S`
seconds at most, at a logging step: the step, the throughput and the peak memory of the last logging interval.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from torch import Tensor

from lightning_accum import keys

STATUS_EVERY_S = 60.0
"""Seconds between two status lines, at most one per logging step: about the pace of a person checking a log."""


class StatusLine:
    """Says when a status line is due, and what it says.

    Examples:
        >>> status = StatusLine(every_s=60.0)
        >>> metrics = {keys.SAMPLES_PER_SEC: 5.2, keys.ITEMS_PER_SEC: 1400.0, keys.PEAK_GIB: 0.48}
        >>> metrics.update({keys.PEAK_FRACTION: 0.02, keys.BUDGET_FRACTION: 0.0207})
        >>> status.line(10, metrics, now=100.0)
        'lightning_accum: step 10, 5.2 samples/s, 1,400 items/s, peak memory 492 MiB (97% of the budget)'
        >>> status.line(11, metrics, now=130.0) is None  # 30 s later: not yet
        True
    """

    def __init__(self, every_s: float = STATUS_EVERY_S) -> None:
        self.every_s = every_s
        self._last: float | None = None

    def line(self, step: int, metrics: Mapping[str, float | Tensor], *, now: float) -> str | None:
        """The line for ``step`` when one is due at ``now`` (seconds, monotonic), else ``None``."""
        if self._last is not None and now - self._last < self.every_s:
            return None
        self._last = now
        return status_text(step, metrics)


def status_text(step: int, metrics: Mapping[str, float | Tensor]) -> str:
    """``lightning_accum: step S, N samples/s, N items/s, peak memory X (P% of the budget)``, from what was logged."""
    parts = [f"lightning_accum: step {step}"]
    samples, items = _value(metrics, keys.SAMPLES_PER_SEC), _value(metrics, keys.ITEMS_PER_SEC)
    if samples is not None:
        parts.append(f"{samples:,.1f} samples/s")
    if items is not None and items != samples:
        parts.append(f"{items:,.0f} items/s")
    peak = _value(metrics, keys.PEAK_GIB)
    if peak is not None:
        size = f"{peak * 1024:.3g} MiB" if peak < 1 else f"{peak:.3g} GiB"
        fraction, budget = _value(metrics, keys.PEAK_FRACTION), _value(metrics, keys.BUDGET_FRACTION)
        if fraction is not None and budget is not None and 0 < budget < 1:
            size += f" ({fraction / budget:.0%} of the budget)"
        elif fraction is not None:
            size += f" ({fraction:.0%} of the capacity)"
        parts.append(f"peak memory {size}")
    return ", ".join(parts)


def _value(metrics: Mapping[str, float | Tensor], key: str) -> float | None:
    value = metrics.get(key)
    if value is None:
        return None
    number = float(value)
    return number if math.isfinite(number) else None
