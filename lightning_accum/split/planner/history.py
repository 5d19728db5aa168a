"""What past steps left for the micro-batch planner's next decision: `PlannerHistory`. Pure.

With the size limit and the memory model, it is what a checkpoint of `lightning_accum.split.planner.MicroBatchPlanner`
holds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

_T = TypeVar("_T")


@dataclass
class PlannerHistory:
    """What past steps left for the next decision: with the size limit and the memory model, what a checkpoint holds."""

    under: int = 0  # consecutive steps under the low watermark
    retry_streak: int = 0  # consecutive steps on which the allocator retried
    failed: dict[int, int] = field(default_factory=dict)  # size that failed -> first step it (or more) may run again
    last_peak: float | None = None  # the last step's peak and size, for the error at the smallest size
    last_size: int | None = None
    # (size, peak) where the current run of over-budget shrinks began: what the shrinks saved since is measured.
    shrink_start: tuple[int, float] | None = None
    # The size at which the planner said that even the smallest size is over the budget. Split by tokens the smallest
    # (the step's longest sequence) moves from step to step; the hold keeps the planner from shrinking, at the next
    # shorter step, below the floor it has just announced.
    held_at_floor: int | None = None
    # Recent steps that peaked under the budget, as (size, longest sequence, peak): a peak over the budget at a size
    # and length no larger than one of them, and within the swings of its peak, did not come from the micro-batch
    # (`PlannerHistory.fitted_within_noise`).
    fitted: list[tuple[int, int, float]] = field(default_factory=list)
    # How far the peak moved between consecutive steps of one size, the 16 most recent: the measure's own noise. The
    # step being decided on is not among them (`pending_swing`): its own jump is what is judged against them.
    swings: list[float] = field(default_factory=list)
    pending_swing: float | None = None

    def remember_step(self, size: int, peak: float) -> None:
        """The step ran ``size`` and peaked at ``peak``: its swing from the step before, if that had the same size."""
        if self.pending_swing is not None:
            self.swings = [*self.swings[-15:], self.pending_swing]
        same = self.last_size == size and self.last_peak is not None
        self.pending_swing = abs(peak - self.last_peak) if same and self.last_peak is not None else None
        self.last_peak, self.last_size = peak, size

    def remember_fit(self, size: int, length: int, peak: float) -> None:
        """A step of ``size`` at ``length`` peaked at ``peak``, under the budget; the 16 most recent are kept."""
        kept = [shape for shape in self.fitted if shape[:2] != (size, length)][-15:]
        self.fitted = [*kept, (size, length, peak)]

    def fitted_within_noise(self, size: int, length: int, peak: float) -> tuple[int, int, float] | None:
        """A remembered step as large as ``size`` at ``length`` that fitted, with ``peak`` within the noise of its.

        The noise is the largest swing between steps of one size. Such a peak over the budget did not come from the
        micro-batch. One further off did (a new phase of training that holds more: a shrink makes room for it).
        """
        noise = max(self.swings, default=0.0)
        return next(
            (s for s in reversed(self.fitted) if s[0] >= size and s[1] >= length and peak - s[2] <= noise), None
        )

    def cool_down(self, size: int, until: int) -> None:
        self.failed[size] = max(self.failed.get(size, 0), until)

    def cooling_down_from(self, step: int) -> int | None:
        for size in [s for s, until in self.failed.items() if until <= step]:
            del self.failed[size]  # expired; dropping it keeps the checkpoint small
        return min(self.failed) if self.failed else None

    def state_dict(self) -> dict[str, Any]:
        return {
            "under": self.under,
            "retry_streak": self.retry_streak,
            "failed": [[size, until] for size, until in sorted(self.failed.items())],
            "last_peak": self.last_peak,
            "last_size": self.last_size,
            "shrink_start": None if self.shrink_start is None else list(self.shrink_start),
            "held_at_floor": self.held_at_floor,
            "fitted": [list(shape) for shape in self.fitted],
            "swings": [*self.swings, *([] if self.pending_swing is None else [self.pending_swing])],
        }

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> PlannerHistory:
        """Missing keys keep their defaults, so older checkpoints still load (issue 19 added ``shrink_start``).

        ``held_at_floor`` came with issue 25, ``fitted`` and ``swings`` with issue 36.
        """
        shrink_start = state.get("shrink_start")
        return cls(
            under=int(state.get("under", 0)),
            retry_streak=int(state.get("retry_streak", 0)),
            failed={int(size): int(until) for size, until in state.get("failed", [])},
            last_peak=optional(float, state.get("last_peak")),
            last_size=optional(int, state.get("last_size")),
            shrink_start=None if shrink_start is None else (int(shrink_start[0]), float(shrink_start[1])),
            held_at_floor=optional(int, state.get("held_at_floor")),
            fitted=[(int(size), int(length), float(peak)) for size, length, peak in state.get("fitted", [])],
            swings=[float(swing) for swing in state.get("swings", [])],
        )


def optional(convert: Callable[[Any], _T], value: Any) -> _T | None:
    """``convert(value)``, or ``None`` for ``None``: a checkpoint's optional field."""
    return None if value is None else convert(value)
