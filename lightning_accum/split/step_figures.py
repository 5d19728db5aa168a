"""What one split-mode step measured and ran, over every rank: the figures the front ends report. Pure.

`AgreedFigures` is what the step's agreement after the optimizer step gives every rank (the largest over ranks);
`published_figures` turns them, and the figures summed over ranks with the window's counts, into the report's: the
samples per micro-batch, the token figures and the ranks' balance (`RankBalance`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class AgreedFigures(NamedTuple):
    """What a step measured and ran, the largest over ranks: what every rank's planner is told after the step."""

    peak: int  # bytes
    alloc_retries: int  # the allocator's, during the step
    size: int  # the micro-batch size (samples, or the token budget)
    step_size: int  # the step batch in the planner's unit
    longest: int  # the longest sequence (by tokens; 0 by samples)
    largest_samples: int  # samples in the largest micro-batch
    cost: int  # the step's cost on the slowest rank (`SplitStepRunner.step_cost`)
    wait_us: int  # the longest any rank waited in the step's agreement, in microseconds
    compute_us: int = 0  # the longest any rank computed before it, in microseconds (`SplitStepRunner.compute_seconds`)


class RankBalance(NamedTuple):
    """How unequal the ranks' steps were: the monitor's ``accum/rank_imbalance`` and ``perf/sync_wait_seconds``."""

    imbalance: float  # the slowest rank's step cost over the mean rank's: 1.0 when every rank's step costs the same
    sync_wait_seconds: float  # the longest any rank waited in the step's agreement for the others to arrive
    compute_imbalance: float | None = None  # the slowest rank's measured compute over the mean rank's

    @classmethod
    def of(cls, figures: AgreedFigures, cost_sum: float, world_size: int, compute_sum: float = 0) -> RankBalance | None:
        """From the step's agreed figures and its cost (and compute) summed over ranks; ``None`` on one rank.

        Examples:
            >>> figures = AgreedFigures(0, 0, 4, 16, 0, 4, cost=120, wait_us=2500, compute_us=3000)
            >>> RankBalance.of(figures, cost_sum=200, world_size=2, compute_sum=5000)
            RankBalance(imbalance=1.2, sync_wait_seconds=0.0025, compute_imbalance=1.2)
        """
        if world_size <= 1:
            return None
        mean, computed = cost_sum / world_size, compute_sum / world_size
        compute_imbalance = figures.compute_us / computed if computed > 0 else None
        return cls(figures.cost / mean if mean > 0 else 1.0, figures.wait_us / 1e6, compute_imbalance)

    @property
    def price_error(self) -> float | None:
        """The measured compute's imbalance over the priced one: 1.0 where the price foresees the ranks' compute.

        Where the price says the ranks are equal (``imbalance`` near 1.0), it is how far the slowest rank's measured
        compute stands over the mean's. ``None`` where no compute was measured.

        Example:
            >>> round(RankBalance(1.01, 0.0, compute_imbalance=1.0605).price_error, 6)
            1.05
        """
        if self.compute_imbalance is None or self.imbalance <= 0:
            return None
        return self.compute_imbalance / self.imbalance


def published_figures(
    figures: AgreedFigures, summed: Sequence[float], by_tokens: bool, world_size: int
) -> tuple[int, tuple[int, float] | None, RankBalance | None]:
    """A step's samples per micro-batch, its token figures and the ranks' balance, as the front ends report them.

    ``summed`` is `SplitStepRunner.summed_figures` summed over ranks (the window's ``totals.extra``): the step cost,
    then by tokens the padded and real tokens, then the compute in microseconds. By tokens, the token figures are the
    budget and the share of the step's padded token positions that held no real token, all ranks, and the samples are
    the largest micro-batch's.

    Examples:
        >>> figures = AgreedFigures(0, 0, 96, 400, 40, 3, cost=300, wait_us=0, compute_us=60)
        >>> published_figures(figures, (500, 400, 300, 100), by_tokens=True, world_size=2)
        (3, (96, 0.25), RankBalance(imbalance=1.2, sync_wait_seconds=0.0, compute_imbalance=1.2))
    """
    cost = summed[0] if summed else 0
    compute = summed[-1] if len(summed) > 1 else 0
    padded, real = (*summed[1:-1], 0, 0)[:2]
    balance = RankBalance.of(figures, cost, world_size, compute)
    if not by_tokens:
        return figures.size, None, balance
    return figures.largest_samples, (figures.size, (1.0 - real / padded) if padded > 0 else 0.0), balance
