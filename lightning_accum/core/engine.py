"""The one accumulation core that every front end holds. No Trainer: a front end hands in batches, counts and ranks.

A front end turns its framework's hooks into calls on `AccumulationEngine`, in this order, once per window:

1. `AccumulationEngine.plan_window` (window mode and manual optimization: the schedule's ``k``) or
   `AccumulationEngine.open_window` with ``None`` (split mode: ranks may run different numbers of micro-batches);
2. for each micro-batch, `AccumulationEngine.count` and `AccumulationEngine.add` (its loss weight), and after the
   first micro-batch's backward `AccumulationEngine.capture_first_gradient` (the gradient noise scale's small batch);
3. at the optimizer step, `AccumulationEngine.close_window`: the exact window mean, the noise scale, the consumed
   samples and items, and what an adaptive schedule learns from them (with the goodput objective, the step's timings,
   taken at each `AccumulationEngine.add` and summed over ranks in the window's all-reduce).

The front ends are `lightning_accum.AccumulationScheduler` (Lightning's own loop decides the windows),
`lightning_accum.AutoMicroBatching` (split mode: the callback cuts each step batch) and
`lightning_accum.ManualAccumulation` (manual optimization). They differ only in how they reach these calls, so they
validate, count, weigh, schedule and checkpoint alike. Why ``k`` changed at step 40 is `ScheduleDriver`'s to say.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_accum._util.distributed import HasRanks, max_across_ranks, sum_across_ranks_fn
from lightning_accum.batches import BatchHooks, BatchSizeFn, SplitBatchFn, resolve_batch_hooks
from lightning_accum.core.batch_choice import ScheduleFigures
from lightning_accum.core.learning_rate import lr_factor, scale_learning_rates
from lightning_accum.core.noise_scale import NoiseScaleEstimator, WindowNoiseMeter
from lightning_accum.core.normalization import (
    ItemCounter,
    LossReduction,
    WindowNormalizer,
    WindowTotals,
    check_loss_reduction,
    count_items,
)
from lightning_accum.core.step_clock import DeviceStepClock, StepClock, clock_for
from lightning_accum.core.step_report import AccumulationEvent, LossSum, Mode, StepReport
from lightning_accum.items import resolve_counter
from lightning_accum.schedules import AccumulationSchedule, AdaptiveSchedule, ConstantSchedule, Progress

STATE_VERSION = 2
"""Version 2: the engine's own state. Version 1 (the owners' flat state) still loads."""


@dataclass(frozen=True)
class Ranks:
    """How a window's figures cross ranks: the world size, and small collectives (``None`` on a single process).

    Attributes:
        world_size: data-parallel ranks.
        sum: sums a small tensor over all ranks.
        max: the element-wise maximum of a small tensor over all ranks.
    """

    world_size: int = 1
    sum: Callable[[Tensor], Tensor] | None = None
    max: Callable[[Tensor], Tensor] | None = None

    @classmethod
    def of(cls, host: HasRanks) -> Ranks:
        """A ``Trainer``'s ranks and their small collectives (a Fabric host's too)."""
        if host.world_size <= 1:
            return cls()
        return cls(host.world_size, sum_across_ranks_fn(host), lambda t: max_across_ranks(host, t))


@runtime_checkable
class StatefulSchedule(Protocol):
    """A schedule with state that must survive a resume (`lightning_accum.schedules.AdaptiveBatchSize`)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


@runtime_checkable
class KeyedSchedule(Protocol):
    """A schedule whose keys count a unit of progress (``"epoch"``, ``"step"`` or ``"sample"``)."""

    unit: str


@dataclass(frozen=True)
class WindowPlan:
    """What `ScheduleDriver.plan` decided for a window: its ``k``, and the change it is, if any."""

    k: int
    change: AccumulationEvent | None = None
    lr_factor: float = 1.0

    def scale_learning_rates(self, optimizers: Iterable[Optimizer], schedulers: Iterable[Any] = ()) -> None:
        """Apply the schedule's ``lr_scaling`` for this change of ``k`` to the front end's optimizers and schedulers.

        Every front end calls this with what it owns (the ``Trainer``: all of them), so the rule is applied alike.
        """
        scale_learning_rates(optimizers, schedulers, self.lr_factor)


class ScheduleDriver:
    """Asks the schedule for ``k`` at each window's start, checks the answer, and notices a change.

    An adaptive schedule (`lightning_accum.schedules.AdaptiveSchedule`) also learns from every closed window
    (`observe`) and says what a change of ``k`` does to the learning rate. Every rank asks with the same progress
    (global counts, and a micro-batch size agreed at the first window), so every rank gets the same ``k``.

    Args:
        schedule: the schedule; ``None`` until the front end adopts one (e.g. ``Trainer(accumulate_grad_batches)``).

    Examples:
        >>> from lightning_accum.schedules import StepwiseSchedule
        >>> driver = ScheduleDriver(StepwiseSchedule({0: 1, 2: 4}, unit="step"))
        >>> [driver.plan(Progress(optimizer_steps=s), step=s).k for s in range(4)]
        [1, 1, 4, 4]
    """

    def __init__(self, schedule: AccumulationSchedule | None) -> None:
        self.schedule: AccumulationSchedule = schedule or ConstantSchedule(1)
        # Protocol checks cost tens of microseconds: done once here, not at every window.
        self.adaptive: AdaptiveSchedule | None = schedule if isinstance(schedule, AdaptiveSchedule) else None
        self._stateful: StatefulSchedule | None = schedule if isinstance(schedule, StatefulSchedule) else None
        self.times_steps = bool(getattr(self.adaptive, "wants_step_cost", False))  # the goodput objective
        self.k = 1
        self.k_known = False  # False until the first window of a run: its k is the start, not a change
        self.micro_batch_size = 0  # agreed across ranks at the first window; feeds sample-keyed schedules

    def adopt(self, schedule: AccumulationSchedule) -> None:
        """Use ``schedule`` (one the front end made, e.g. from ``Trainer(accumulate_grad_batches)``)."""
        self.schedule = schedule
        self.adaptive = schedule if isinstance(schedule, AdaptiveSchedule) else None
        self._stateful = schedule if isinstance(schedule, StatefulSchedule) else None
        self.times_steps = bool(getattr(self.adaptive, "wants_step_cost", False))

    @property
    def unit(self) -> str | None:
        """What the schedule's keys count (a ramp counts samples), or ``None`` when ``k`` never changes."""
        return self.schedule.unit if isinstance(self.schedule, KeyedSchedule) else None

    @property
    def noise_scale(self) -> NoiseScaleEstimator | None:
        """The noise-scale average that decides ``k``, where the schedule follows one."""
        return self.adaptive.estimator if self.adaptive is not None else None

    def agree_micro_batch_size(self, n_samples: int, ranks: Ranks) -> None:
        """At the first window: the largest micro-batch over ranks, so that sample-keyed schedules agree on ``k``."""
        if self.micro_batch_size:
            return
        local = torch.tensor([n_samples], dtype=torch.int64)
        self.micro_batch_size = int((ranks.max(local) if ranks.max is not None else local).item())

    def plan(self, progress: Progress, step: int) -> WindowPlan:
        """The ``k`` of a window that starts at ``progress`` (optimizer ``step``), and the change it makes.

        Raises:
            ValueError: the schedule returned something other than an int >= 1.
        """
        k = self.schedule.accumulation_steps(progress)
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"The schedule {self.schedule!r} returned k={k!r}; it must return an int >= 1.")
        plan = WindowPlan(k)
        if self.k_known and k != self.k:
            factor = self._lr_factor(self.k, k)
            why = getattr(self.adaptive, "reason", "")  # an adaptive schedule says why it moved
            reason = f"epoch {progress.epoch}" + (f"; {why}" if why else "")
            reason += f"; learning rate x{factor:.4g}" if factor != 1.0 else ""
            plan = WindowPlan(k, AccumulationEvent("schedule_change", step, self.k, k, reason), factor)
        self.k, self.k_known = k, True
        return plan

    def _lr_factor(self, before: int, after: int) -> float:
        """The learning-rate factor of a change of ``k``: an adaptive schedule's own, else its ``lr_scaling``'s."""
        if self.adaptive is not None:
            return self.adaptive.lr_factor(before, after)
        return lr_factor(getattr(self.schedule, "lr_scaling", None), before, after)

    def observe(self, totals: WindowTotals, micro_batches: int, world_size: int, noise: Any) -> None:
        """Let an adaptive schedule see a closed window (global figures, so every rank's schedule decides alike)."""
        if self.adaptive is not None:
            self.adaptive.observe(totals.items, micro_batches, world_size, noise)

    def observe_cost(self, timings: Sequence[float]) -> None:
        """Let the schedule see a window's step timings, summed over ranks (`StepClock.take`)."""
        if self.adaptive is not None and self.times_steps:
            self.adaptive.observe_cost(*timings)  # type: ignore[attr-defined]  # `wants_step_cost` says it has it

    def figures(self) -> ScheduleFigures:
        """What the schedule aims at: an adaptive schedule's own figures, a fixed one's ``k`` (never a short tail's).

        Nothing before the first planned window: split mode plans none (memory sets its ``k``).
        """
        if not self.k_known:
            return ScheduleFigures()
        own = getattr(self.adaptive, "figures", None)
        if own is not None:
            figures: ScheduleFigures = own()
            return figures
        return ScheduleFigures(float(self.k))

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"micro_batch_size": self.micro_batch_size}
        if self.k_known:
            state["accumulation_steps"] = self.k
        if self._stateful is not None:
            state["schedule"] = self._stateful.state_dict()  # e.g. the noise-scale estimate
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.k = int(state.get("accumulation_steps", 1))
        self.k_known = "accumulation_steps" in state
        self.micro_batch_size = int(state.get("micro_batch_size", 0))
        if "schedule" in state and self._stateful is not None:
            self._stateful.load_state_dict(state["schedule"])


class HoldsEngine:
    """The engine's figures under the names the front ends have always shown them by (read-only views)."""

    engine: AccumulationEngine

    @property
    def count_items(self) -> ItemCounter | None:
        return self.engine.count_items

    @property
    def loss_reduction(self) -> LossReduction:
        return self.engine.loss_reduction

    @property
    def normalizer(self) -> WindowNormalizer:
        return self.engine.normalizer

    @property
    def consumed_samples(self) -> int:
        """Samples consumed since the start of training, all ranks (restored on resume)."""
        return self.engine.consumed_samples


@dataclass(frozen=True)
class ClosedWindow:
    """What `AccumulationEngine.close_window` found: the window's global totals and its noise-scale estimates."""

    totals: WindowTotals
    micro_batches: int  # this rank's
    noise: tuple[float, float] | None = None
    consumed_items: float = 0.0  # all ranks, since the start of training, this window included
    schedule: ScheduleFigures = field(default_factory=ScheduleFigures)

    def report(
        self,
        mode: Mode,
        micro_batch_size: int,
        loss: LossSum,
        *,
        consumed_samples: int,
        oom_retries: int,
        events: tuple[AccumulationEvent, ...],
        **figures: Any,
    ) -> StepReport:
        """The report of this window's optimizer step, for every front end (the ``Trainer``'s, Fabric's).

        ``figures``: the `StepReport` fields only some steps have (peaks, the budget, the token figures, ...).
        """
        return StepReport(
            mode=mode,
            micro_batch_size=micro_batch_size,
            accumulation_steps=self.micro_batches,  # this step's, not the plan: a tail is short
            effective_batch_size=self.totals.samples,
            items=self.totals.items,
            consumed_samples=consumed_samples,
            oom_retries=oom_retries,
            loss_sum=loss.total,
            loss_items=loss.items,
            events=events,
            noise=self.noise,
            consumed_items=self.consumed_items,
            target_accumulation_steps=self.schedule.target_accumulation_steps,
            statistical_efficiency=self.schedule.statistical_efficiency,
            step_overhead_seconds=self.schedule.step_overhead_seconds,
            **figures,
        )


class AccumulationEngine:
    """Counting, weighting and closing windows, the schedule and the gradient noise scale, with one versioned state.

    Args:
        count_items: counts the items of a micro-batch (default: its samples); see
            `lightning_accum.core.normalization.count_items`.
        loss_reduction: whether a micro-batch's loss is the ``"mean"`` or the ``"sum"`` over its items.
        schedule: ``k`` as a schedule object, for the front ends that follow one (``None``: ``k`` = 1).

    Raises:
        TypeError: ``count_items`` is neither callable, an import path nor ``None``.
        ValueError: an unknown ``loss_reduction``.

    Examples:
        Two micro-batches of 3 and 1 samples whose mean losses are accumulated give the mean over all 4 samples:

        >>> engine = AccumulationEngine(None, "mean")
        >>> w = torch.zeros(1, requires_grad=True)
        >>> _ = engine.open_window(None)
        >>> for x in (torch.tensor([1.0, 2.0, 3.0]), torch.tensor([6.0])):
        ...     items, samples = engine.count(x)
        ...     ((w * x).mean() * engine.add(items, samples)).backward()
        >>> engine.close_window(step=0, parameters=[w]).totals.samples, w.grad
        (4, tensor([3.]))
    """

    def __init__(
        self, count_items: ItemCounter | str | None, loss_reduction: LossReduction, schedule: Any = None
    ) -> None:
        self.count_items = resolve_counter(count_items)
        self.loss_reduction: LossReduction = check_loss_reduction(loss_reduction)
        self.normalizer = WindowNormalizer(self.loss_reduction)
        self.schedule = ScheduleDriver(schedule)
        self.noise = WindowNoiseMeter()
        self.hooks: BatchHooks = resolve_batch_hooks(None)
        self.consumed_samples = 0  # all ranks, since the start of training (restored on resume)
        self.consumed_items = 0.0  # the same, in items (tokens with a token counter)
        # The step's timings, for a schedule that weighs them (the goodput objective): the host's until the first window
        # closes, then the clock of the parameters' device (`clock_for`: a GPU's own timeline).
        self.clock: StepClock | DeviceStepClock = StepClock()
        self._clock_device: torch.device | None = None
        self._clock_epoch: int | None = None

    def resolve_hooks(
        self,
        module: object | None,
        *,
        split_batch: SplitBatchFn | str | None = None,
        batch_size_of: BatchSizeFn | str | None = None,
    ) -> None:
        """Count and cut batches with the user's hooks: an argument, else a method of ``module``, else the rules."""
        self.hooks = resolve_batch_hooks(module, split_batch=split_batch, batch_size_of=batch_size_of)

    # ---- one window ------------------------------------------------------------------------------------------

    def plan_window(self, *, epoch: int, step: int, n_samples: int, ranks: Ranks = Ranks()) -> WindowPlan:
        """Open a window of the schedule's ``k`` (window mode, manual optimization); see `ScheduleDriver.plan`.

        Args:
            epoch: the current epoch.
            step: optimizer steps taken so far (the same on every rank).
            n_samples: samples in the window's first micro-batch on this rank (agreed over ranks at the first window).
            ranks: the ranks and their collectives; every rank calls this alike at the first window.
        """
        driver = self.schedule
        if epoch != self._clock_epoch:  # the time across an epoch's end (validation, a new loader) is no step's
            self.clock.restart()
            self._clock_epoch = epoch
        driver.agree_micro_batch_size(n_samples, ranks)
        progress = Progress(epoch, step, self.consumed_samples, driver.micro_batch_size, ranks.world_size)
        plan = driver.plan(progress, step)
        self.open_window(plan.k)
        return plan

    def open_window(self, k: int | None) -> None:
        """Open a window of ``k`` micro-batches on every rank, or ``None`` when ranks may run different numbers."""
        self.normalizer.start_window(k)

    def count(self, batch: Any) -> tuple[int | float | Tensor, int]:
        """A micro-batch's ``(items, samples)``: ``count_items`` (default: samples) and the batch hooks' size."""
        samples = self.hooks.batch_size(batch)
        return self.items(batch, samples), samples

    def items(self, batch: Any, n_samples: int) -> int | float | Tensor:
        """The items of a micro-batch of ``n_samples`` samples (already known, e.g. from the split)."""
        return n_samples if self.count_items is None else count_items(batch, self.count_items)

    def add(self, n_items: int | float | Tensor, n_samples: int) -> float | Tensor:
        """Record a micro-batch; the weight its loss must be multiplied by before its backward."""
        weight = self.normalizer.add_micro_batch(n_items, n_samples)
        if self.schedule.times_steps:
            self.clock.tick(first=self.normalizer.micro_batches == 1)
        return weight

    def wants_noise(self, step: int) -> bool:
        """Whether the window of optimizer ``step`` measures the gradient noise scale."""
        return self.noise.wants(step)

    def capture_first_gradient(self, step: int, gradients: list[Tensor], loss_scale: float = 1.0) -> None:
        """After the window's first micro-batch's backward, before any other: the noise scale's small batch."""
        normalizer = self.normalizer
        self.noise.capture(
            step, normalizer.windows_started, gradients, normalizer.first_items, normalizer.divisor, loss_scale
        )

    def close_window(
        self,
        step: int,
        parameters: list[Tensor],
        ranks: Ranks = Ranks(),
        averaged_over: int | None = None,
        measure_noise: bool = True,
        extra: Sequence[float] = (),
    ) -> ClosedWindow:
        """Rescale the window's gradients to the exact mean, measure the noise scale, and count the samples.

        Args:
            step: the optimizer step the window belongs to (counted from 0, the same on every rank).
            parameters: the parameters whose gradients this window accumulated.
            ranks: the ranks and their collectives; every rank must call this alike.
            averaged_over: the ranks whose gradients were averaged (DDP's mean); 1 when they were summed instead.
                Default: every rank.
            measure_noise: ``False`` where no rank holds its own first micro-batch's gradient (a sync after every
                micro-batch): the same on every rank.
            extra: more figures of this rank to sum over ranks with the window's counts (``totals.extra``), in the
                same all-reduce.
        """
        normalizer = self.normalizer
        world = ranks.world_size if averaged_over is None else averaged_over
        # The step's timings ride, summed over ranks, in the all-reduce of the window's counts: no collective of theirs.
        timings = self.clock.take() if self.schedule.times_steps else ()
        totals = normalizer.finish_window(
            parameters, ranks.sum, world, ranks=ranks.world_size, extra=(*extra, *timings)
        )
        if timings:
            self.schedule.observe_cost(totals.extra[len(extra) :])
            totals = dataclasses.replace(totals, extra=totals.extra[: len(extra)])
            self._clock_on(parameters)
        noise = None
        if measure_noise:
            noise = self.noise.measure(
                step,
                normalizer.windows_started,
                [p.grad for p in parameters if p.grad is not None],
                items=totals.items,
                micro_batches=normalizer.micro_batches,
                world_size=ranks.world_size,
                sum_across_ranks=ranks.sum,
            )
        self.consumed_samples += totals.samples
        self.consumed_items += totals.items
        self.schedule.observe(totals, normalizer.micro_batches, ranks.world_size, noise)
        return ClosedWindow(totals, normalizer.micro_batches, noise, self.consumed_items, self.schedule.figures())

    def _clock_on(self, parameters: list[Tensor]) -> None:
        # From the second window on, time the micro-batches where they run (a GPU's stream, not the host's clock).
        device = _device_of(parameters)
        if device is not None and device != self._clock_device:
            self._clock_device, self.clock = device, clock_for(device)

    # ---- checkpointing ----------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "consumed_samples": self.consumed_samples,
            "consumed_items": self.consumed_items,
            "normalizer": self.normalizer.state_dict(),
            "noise_meter": self.noise.state_dict(),
            **self.schedule.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from `state_dict`, or from a version-1 owner's flat state (the same keys); missing keys default."""
        self.consumed_samples = int(state.get("consumed_samples", 0))
        # A checkpoint from before items were counted: its samples are the best count there is.
        self.consumed_items = float(state.get("consumed_items", self.consumed_samples))
        self.clock.restart()  # the time up to the resumed run's first micro-batch is no step's
        self.normalizer.load_state_dict(state.get("normalizer", {}))
        self.noise.load_state_dict(state.get("noise_meter", {}))
        self.schedule.load_state_dict(state)


def _device_of(parameters: Sequence[Tensor]) -> torch.device | None:
    """The device of the first parameter (where the micro-batches run), or ``None`` for none."""
    return parameters[0].device if parameters else None
