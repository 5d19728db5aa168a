"""`simulate`: run a `MicroBatchPlanner` against a synthetic device, to see how it settles. Pure: no device.

Tests and benchmarks use it to check the planner's decisions over hundreds of steps in milliseconds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from lightning_accum.split.planner.micro_batch_planner import MicroBatchPlanner, PlannerEvent


@dataclass
class SimulationResult:
    """What `simulate` saw: the size of each step, the steps that hit an OOM, the events, the budget out of reach.

    ``unreachable_steps`` are the steps after which the planner said the budget is out of reach
    (`MicroBatchPlanner.budget_unreachable`).
    """

    sizes: list[int] = field(default_factory=list)
    oom_steps: list[int] = field(default_factory=list)
    events: list[PlannerEvent] = field(default_factory=list)
    unreachable_steps: list[int] = field(default_factory=list)

    @property
    def ooms(self) -> int:
        return len(self.oom_steps)

    @property
    def final_size(self) -> int:
        return self.sizes[-1]

    @property
    def settled_at(self) -> int:
        """The first step from which the size never changed again."""
        step = len(self.sizes) - 1
        while step > 0 and self.sizes[step - 1] == self.sizes[-1]:
            step -= 1
        return step

    @property
    def ooms_to_settle(self) -> int:
        """OOMs up to and including `settled_at`."""
        return sum(1 for s in self.oom_steps if s <= self.settled_at)


def simulate(
    planner: MicroBatchPlanner,
    *,
    step_batch_size: int,
    steps: int,
    peak_bytes: Callable[[int, int], float],
    capacity_bytes: float,
    first_step: int = 0,
) -> SimulationResult:
    """Run ``planner`` against a synthetic device: ``peak_bytes(step, b)`` above ``capacity_bytes`` is an OOM.

    Each step asks for a size, retries it with the planner's answer while it would run out of memory (as split mode
    does), then reports the peak. Steps are numbered from ``first_step``, e.g. to continue after a resume.

    Examples:
        Peak ``2 + 0.25 b`` GiB on a 16 GiB device with a 14.4 GiB budget and a 256-sample step batch:

        >>> from lightning_accum.memory.budget import GIB
        >>> def run(predictive):
        ...     planner = MicroBatchPlanner(budget_bytes=14.4 * GIB, predictive=predictive)
        ...     return simulate(planner, step_batch_size=256, steps=400, capacity_bytes=16 * GIB,
        ...                     peak_bytes=lambda step, b: (2 + 0.25 * b) * GIB)
        >>> predictive, halving = run(True), run(False)
        >>> predictive.ooms, predictive.final_size, halving.ooms, halving.final_size
        (3, 43, 4, 32)
    """
    result = SimulationResult()
    for step in range(first_step, first_step + steps):
        size = planner.size_for(step_batch_size)
        while peak_bytes(step, size) > capacity_bytes:
            result.oom_steps.append(step)
            size = planner.on_oom(size, step)
        planner.on_step(size, peak_bytes(step, size), step)
        result.sizes.append(size)
        if planner.budget_unreachable is not None:
            result.unreachable_steps.append(step)
    result.events.extend(planner.take_events())
    return result
