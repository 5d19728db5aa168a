"""Accumulation schedules: how many micro-batches make one optimizer step, as a function of training progress.

Everything here is pure: no Trainer, no device. A schedule is asked for ``k`` once per window, at the window's
first micro-batch, with the progress made so far. The callbacks decide *when* to ask; this module only answers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol, get_args, runtime_checkable

from lightning_accum._util.cli_types import (
    Decay,
    GrowthFactor,
    Milestones,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    SeveralMicroBatches,
)
from lightning_accum._util.validation import K_HINT, check_bool, check_choice, check_int, check_milestones, check_number
from lightning_accum.core.batch_choice import (
    COST_START_WINDOWS,
    ClampNote,
    Objective,
    ScheduleFigures,
    StartPhase,
    StepCostAverage,
    aimed_choice,
    allowed_range,
    check_objective,
    cost_start,
    goodput_choice,
    optimal_accumulation_steps,
    statistical_efficiency,
)
from lightning_accum.core.learning_rate import AdaptiveLRScaling, LearningRateRule, LRScaling, check_lr_scaling
from lightning_accum.core.noise_scale import NoiseScaleEstimator

ScheduleUnit = Literal["epoch", "step", "sample"]
Rounding = Literal["error", "floor", "ceil", "nearest"]
_UNITS = get_args(ScheduleUnit)
_ROUNDINGS = get_args(Rounding)


@dataclass(frozen=True)
class Progress:
    """Where training stands when a window starts.

    Attributes:
        epoch: the current epoch, from 0.
        optimizer_steps: optimizer steps taken so far (``trainer.global_step``).
        consumed_samples: samples consumed so far, summed over all ranks.
        micro_batch_size: samples in the window's first micro-batch on this rank.
        world_size: number of data-parallel ranks.
    """

    epoch: int = 0
    optimizer_steps: int = 0
    consumed_samples: int = 0
    micro_batch_size: int = 1
    world_size: int = 1

    def value(self, unit: ScheduleUnit) -> int:
        """The progress counter that ``unit`` names."""
        if unit == "epoch":
            return self.epoch
        if unit == "step":
            return self.optimizer_steps
        return self.consumed_samples


@runtime_checkable
class AccumulationSchedule(Protocol):
    """Anything that maps training progress to accumulation steps ``k`` (an int >= 1)."""

    def accumulation_steps(self, progress: Progress) -> int:
        """Accumulation steps for a window that starts at ``progress``."""
        ...


@runtime_checkable
class AdaptiveSchedule(AccumulationSchedule, Protocol):
    """A schedule that follows the measured gradient noise scale (`AdaptiveBatchSize`).

    Every front end that runs one (`lightning_accum.AccumulationScheduler`, `lightning_accum.ManualAccumulation`)
    measures the noise scale in every window, calls `observe` after each optimizer step, and applies `lr_factor`
    when ``k`` changes at a window boundary.
    """

    estimator: NoiseScaleEstimator
    """The noise-scale average that decides ``k`` (the monitor logs it)."""

    def observe(self, items: float, micro_batches: int, world_size: int, noise: tuple[float, float] | None) -> None:
        """Take one optimizer step's figures: global items, this rank's micro-batches, the noise estimates."""
        ...

    def lr_factor(self, before: int, after: int) -> float:
        """What the learning rate is multiplied by when ``k`` goes from ``before`` to ``after``."""
        ...


class ConstantSchedule:
    """The same ``k`` for the whole run.

    Examples:
        >>> ConstantSchedule(4).accumulation_steps(Progress(epoch=3))
        4
    """

    def __init__(self, accumulation_steps: PositiveInt) -> None:
        self.k = check_int(accumulation_steps, "accumulation_steps", 1, hint=K_HINT)

    def accumulation_steps(self, progress: Progress) -> int:
        return self.k

    def __repr__(self) -> str:
        return f"ConstantSchedule({self.k})"


class StepwiseSchedule:
    """``k`` changes at given points: ``{0: 1, 5: 4}`` means k=1 from 0 and k=4 from 5 on.

    The keys are read as epochs, optimizer steps or consumed samples (all ranks), as ``unit`` says. A key of 0 is
    implied with ``k=1`` when the mapping starts later.

    Args:
        milestones: a mapping from a progress value to the ``k`` that holds from there on.
        unit: what the keys count: ``"epoch"``, ``"step"`` (optimizer steps) or ``"sample"`` (consumed samples).
        lr_scaling: when ``k`` changes, multiply every param group's learning rate (and the LR schedulers' base
            rates) by ``k_new / k_old`` (``"linear"``) or its square root (``"sqrt"``); ``None`` leaves it alone.

    Raises:
        TypeError: a key or a value is not an int, or ``milestones`` is not a mapping.
        ValueError: a key is negative, the keys are not in increasing order, a value is < 1, or ``unit`` or
            ``lr_scaling`` is unknown.

    Examples:
        >>> schedule = StepwiseSchedule({0: 1, 100: 2, 200: 4}, unit="step")
        >>> [schedule.accumulation_steps(Progress(optimizer_steps=s)) for s in (0, 99, 100, 250)]
        [1, 1, 2, 4]
    """

    def __init__(
        self, milestones: Milestones, unit: ScheduleUnit = "epoch", *, lr_scaling: LRScaling | None = None
    ) -> None:
        self.unit: ScheduleUnit = check_choice(unit, "unit", _UNITS)
        self.lr_scaling: LRScaling | None = check_lr_scaling(lr_scaling)
        keys = check_milestones(milestones, unit)
        # Copy: never keep a reference to what the user passed.
        self.milestones: dict[int, int] = {0: 1} if keys[0] != 0 else {}
        self.milestones.update({int(k): int(v) for k, v in milestones.items()})

    def accumulation_steps(self, progress: Progress) -> int:
        now = progress.value(self.unit)
        return self.milestones[max(start for start in self.milestones if start <= now)]  # 0 is always a key

    def __repr__(self) -> str:
        scaling = "" if self.lr_scaling is None else f", lr_scaling={self.lr_scaling!r}"
        return f"StepwiseSchedule({self.milestones!r}, unit={self.unit!r}{scaling})"


class BatchSizeRamp:
    """A Megatron-style warm-up of the global batch size, translated into ``k`` for the current micro-batch.

    The global batch starts at ``start`` and grows by ``increment`` every ``ramp_samples / n_increments`` consumed
    samples until it reaches ``target``, where ``n_increments = (target - start) / increment``. The number of
    accumulation steps is ``k = global_batch / (micro_batch_size * world_size)``.

    When that division is not exact, ``rounding`` decides: ``"error"`` (the default) raises, ``"floor"``,
    ``"ceil"`` or ``"nearest"`` round ``k`` (never below 1) so the effective batch is the multiple of
    ``micro_batch_size * world_size`` below, above or nearest to the requested one.

    Args:
        start: global batch size (samples, all ranks) at the beginning.
        target: global batch size after the ramp.
        increment: how much the global batch grows at each increase.
        ramp_samples: consumed samples (all ranks) over which the ramp runs.
        rounding: what to do when a global batch is not a multiple of ``micro_batch_size * world_size``.
        lr_scaling: when ``k`` changes, multiply every param group's learning rate (and the LR schedulers' base
            rates) by ``k_new / k_old`` (``"linear"``) or its square root (``"sqrt"``); ``None`` leaves it alone.

    Raises:
        TypeError: an argument is not an int.
        ValueError: a size is < 1, ``target < start``, ``target - start`` is not a multiple of ``increment``,
            ``ramp_samples < 0``, or ``rounding`` or ``lr_scaling`` is unknown.

    Examples:
        >>> ramp = BatchSizeRamp(start=32, target=128, increment=32, ramp_samples=3000)
        >>> ramp.global_batch_size(0), ramp.global_batch_size(1000), ramp.global_batch_size(5000)
        (32, 64, 128)
        >>> ramp.accumulation_steps(Progress(consumed_samples=1000, micro_batch_size=8, world_size=2))
        4
    """

    unit: ScheduleUnit = "sample"

    def __init__(
        self,
        start: PositiveInt,
        target: PositiveInt,
        increment: PositiveInt,
        ramp_samples: NonNegativeInt,
        rounding: Rounding = "error",
        *,
        lr_scaling: LRScaling | None = None,
    ) -> None:
        for name, value in (("start", start), ("target", target), ("increment", increment)):
            check_int(value, name, 1, hint="It counts samples in a global batch.")
        check_int(ramp_samples, "ramp_samples", 0, hint="It counts consumed samples, all ranks together.")
        if target < start:
            raise ValueError(f"`target` ({target}) must be >= `start` ({start}); a ramp only grows the batch.")
        if (target - start) % increment:
            raise ValueError(
                f"`target - start` ({target} - {start} = {target - start}) must be a multiple of `increment`"
                f" ({increment}). Choose an increment that divides {target - start}."
            )
        self.rounding: Rounding = check_choice(rounding, "rounding", _ROUNDINGS)
        self.lr_scaling: LRScaling | None = check_lr_scaling(lr_scaling)
        self.start, self.target, self.increment, self.ramp_samples = start, target, increment, ramp_samples

    def global_batch_size(self, consumed_samples: int) -> int:
        """The requested global batch size once ``consumed_samples`` have been consumed."""
        n_increments = (self.target - self.start) // self.increment
        if n_increments == 0 or consumed_samples >= self.ramp_samples:
            return self.target
        samples_per_increment = self.ramp_samples / n_increments
        done = int(consumed_samples // samples_per_increment)
        return min(self.target, self.start + done * self.increment)

    def accumulation_steps(self, progress: Progress) -> int:
        global_batch = self.global_batch_size(progress.consumed_samples)
        per_micro_step = progress.micro_batch_size * progress.world_size
        return k_for_global_batch(global_batch, per_micro_step, self.rounding)

    def __repr__(self) -> str:
        return (
            f"BatchSizeRamp(start={self.start}, target={self.target}, increment={self.increment},"
            f" ramp_samples={self.ramp_samples}, rounding={self.rounding!r}"
            + ("" if self.lr_scaling is None else f", lr_scaling={self.lr_scaling!r}")
            + ")"
        )


# `AdaptiveBatchSize`'s plain attributes that a checkpoint carries, saved under their names without the "_".
_ADAPTIVE_STATE: tuple[str, ...] = ("_k", "_changed_at", "_items_per_micro_batch", "_noise_scale", "target", "reason")
_ADAPTIVE_STATE += ("_phase", "_world_size")


class AdaptiveBatchSize:
    """``k`` from the measured gradient noise scale and, by default, the measured cost of a step.

    The gradient noise scale ``B_noise = tr(Σ)/|G|²`` (McCandlish et al., 2018) says what a larger batch costs in
    samples: an item in a global batch of ``B`` items makes ``1 / (1 + B / B_noise)`` of the progress it makes in a
    very small one. It is measured in every window (`lightning_accum.core.noise_scale`), and ``k`` decided after each
    optimizer step by ``objective`` (docs/noise-scale.md):

    * ``"goodput"`` (the default): the ``k`` of the largest items per second times statistical efficiency (Pollux,
      OSDI 2021), from the measured time of a micro-batch and of the step's fixed part: a global batch near
      ``B* = sqrt(B_noise · s / c)`` (`lightning_accum.core.batch_choice`), moving for a predicted gain of
      ``min_gain`` or more. First, after 4 timed windows, it takes the ``k`` whose micro-batches take as long as the
      step's fixed part (at least half the best goodput whatever the noise scale; not bound by ``max_growth``), which
      the first decision with the noise scale may take back down.
    * ``"noise_scale"``: ``k = factor · B_noise / (items per micro-batch · world size)``, moving only when the target
      is ``hysteresis`` away from ``k``.

    ``k`` stays in ``[min_accumulation_steps, max_accumulation_steps]`` and changes at window boundaries, by at most
    ``max_growth``, ``warmup_windows`` windows after the last change, only upwards unless ``allow_decrease``. Every
    rank decides alike, and the change's log line says why. While the smoothed ``|G|²`` is not positive the last
    valid noise scale is held; where the target stays out of bounds for 100 windows, one log line names the setting
    that holds ``k``. The state round-trips through checkpoints: a resumed run with ``"noise_scale"`` takes the
    uninterrupted run's path; with ``"goodput"`` it goes on from the saved timings (the clock is the run's own).

    Args:
        min_accumulation_steps: the first and smallest ``k`` (held while the step is timed or the noise scale warms up).
        max_accumulation_steps: the largest ``k``.
        objective: ``"goodput"`` or ``"noise_scale"`` (above); by default goodput, or noise_scale with a ``factor``.
        factor: ``objective="noise_scale"`` only: the target global batch as a multiple of the noise scale (1.0).
        min_gain: ``objective="goodput"`` only: the smallest predicted gain in goodput that moves ``k``.
        warmup_windows: windows measured before ``k`` may change, and between two changes.
        hysteresis: ``objective="noise_scale"``: how far (relative to ``k``) the target must move before ``k`` follows.
        allow_decrease: let ``k`` go down (by default it never does).
        max_growth: the largest factor by which one change multiplies (or divides) ``k``; ``None`` lets ``k`` jump
            straight to its target.
        lr_scaling: when ``k`` changes, multiply every param group's learning rate (and its schedulers' base rates)
            by ``k_new / k_old`` (``"linear"``) or its square root (``"sqrt"``), or keep it at AdaScale's gain ratio
            at the noise scale over the minimum's batch (``"gain"``, for SGD) or that ratio's square root
            (``"sqrt_gain"``, the default, for Adam: `lightning_accum.core.learning_rate`); ``None``: left alone.
        beta: the noise-scale moving average's decay per window.

    Raises:
        TypeError: an argument has the wrong type.
        ValueError: an argument out of its range (``min_accumulation_steps < 2``, ``max < min``, ``factor <= 0``,
            ``max_growth <= 1``, ``beta`` outside ``[0, 1)``, ...), an unknown ``objective`` or ``lr_scaling``, or
            ``factor`` given with ``objective="goodput"``.

    Examples:
        >>> schedule = AdaptiveBatchSize(2, 16, objective="noise_scale", warmup_windows=1)
        >>> schedule.accumulation_steps(Progress())
        2
        >>> schedule.observe(items=64.0, micro_batches=2, world_size=1, noise=(1.0, 160.0))  # B_noise = 160 items
        >>> schedule.accumulation_steps(Progress())  # 160 items / 32 items per micro-batch is 5; at most 2 x 2
        4
    """

    unit: ScheduleUnit = "step"

    def __init__(
        self,
        min_accumulation_steps: SeveralMicroBatches = 2,
        max_accumulation_steps: PositiveInt = 64,
        *,
        objective: Objective | None = None,
        factor: PositiveFloat | None = None,
        min_gain: NonNegativeFloat = 0.05,
        warmup_windows: NonNegativeInt = 20,
        hysteresis: NonNegativeFloat = 0.25,
        allow_decrease: bool = False,
        max_growth: GrowthFactor | None = 2.0,
        lr_scaling: AdaptiveLRScaling | None = "sqrt_gain",
        beta: Decay = 0.99,
    ) -> None:
        never = "A window of one micro-batch has one batch size, so the noise scale is never measured and k would"
        never += " stay 1 for good. Use 2 (the default) or more."
        self.min_k = check_int(min_accumulation_steps, "min_accumulation_steps", 2, hint=never)
        self.max_k = check_int(max_accumulation_steps, "max_accumulation_steps", minimum=self.min_k)
        self.objective, self.factor = check_objective(objective, factor)
        self.min_gain = check_number(min_gain, "min_gain", minimum=0.0, hint="0.05 moves k for a 5% predicted gain.")
        self.warmup_windows = check_int(warmup_windows, "warmup_windows", minimum=0)
        self.hysteresis = check_number(hysteresis, "hysteresis", minimum=0.0)
        self.allow_decrease = check_bool(allow_decrease, "allow_decrease")
        jump, growth = "Or None to let k jump to its target.", max_growth
        growth = None if growth is None else check_number(growth, "max_growth", 1.0, min_inclusive=False, hint=jump)
        self.max_growth: float | None = growth
        self.lr_scaling: AdaptiveLRScaling | None = check_lr_scaling(lr_scaling, noise_scale=True)
        self._lr = LearningRateRule(self.lr_scaling, self.min_k)
        self.estimator = NoiseScaleEstimator(beta)
        self.step_cost = StepCostAverage()
        self._k = self.min_k
        # goodput: "timing" (until a k from the step's cost alone), "guessed" (the noise scale may undo it), "noise"
        self._phase: StartPhase = "timing" if self.objective == "goodput" else "noise"
        self._changed_at = 0  # the estimator's window count at the last change of k
        self._items_per_micro_batch: float | None = None  # per rank, smoothed
        self._noise_scale: float | None = None  # the last valid (finite, positive) smoothed noise scale, held
        self.target: float | None = None  # the k aimed at after the last window, before clamping and rounding
        self.reason = ""  # why k changed last, for the change's log line
        self._clamp = ClampNote()
        self._world_size = 1  # the last window's

    @property
    def wants_step_cost(self) -> bool:
        """Whether the front end must time the steps (`observe_cost`): the goodput objective weighs them."""
        return self.objective == "goodput"

    def accumulation_steps(self, progress: Progress) -> int:
        """The ``k`` decided after the last step (the schedule only changes its mind in `observe`)."""
        return self._k

    def observe_cost(self, micro_seconds: float, micro_batches: float, overhead_seconds: float, steps: float) -> None:
        """Take one window's timings, summed over ranks (`lightning_accum.core.batch_choice.StepClock.take`)."""
        self.step_cost.add(micro_seconds, micro_batches, overhead_seconds, steps)

    def observe(self, items: float, micro_batches: int, world_size: int, noise: tuple[float, float] | None) -> None:
        """Take one optimizer step's figures (global items, this rank's micro-batches, the noise estimates)."""
        if noise is not None:
            self.estimator.add_estimates(*noise)
        if micro_batches > 0 and items > 0:
            now, before = items / (micro_batches * world_size), self._items_per_micro_batch
            self._items_per_micro_batch = now if before is None else 0.9 * before + 0.1 * now
        self._world_size = world_size
        self._k = self._decide(world_size)

    def _decide(self, world_size: int) -> int:
        estimate = self.estimator.value()
        if math.isfinite(estimate.gradient_noise_scale) and estimate.gradient_noise_scale > 0:
            self._noise_scale = estimate.gradient_noise_scale
        noise, n, cost = self._noise_scale, self._items_per_micro_batch, self.step_cost.value()
        if self._phase == "timing":
            if cost is None or self.step_cost.windows < COST_START_WINDOWS:
                return self._k
            k, self.reason = cost_start(self._k, self.min_k, self.max_k, cost)
            self._phase = "guessed" if k != self._k else "noise"
            return k
        if noise is None or not n or (self.objective == "goodput" and cost is None):
            return self._k
        weighed = cost if self.objective == "goodput" else None  # the step's cost, where the objective weighs it
        aimed = self.factor * noise / (n * world_size)
        self.target = aimed if weighed is None else optimal_accumulation_steps(weighed, n, world_size, noise)
        self._clamp.add(self.target, self.min_k, self.max_k)  # logs once where the bounds hold k for long
        if estimate.windows - self._changed_at < max(1, self.warmup_windows):
            return self._k
        decrease = self.allow_decrease or self._phase == "guessed"
        low, high = allowed_range(self._k, self.min_k, self.max_k, self.max_growth, decrease)
        self._phase = "noise"
        if weighed is not None:
            k, why = goodput_choice(self._k, low, high, weighed, n, world_size, noise, self.min_gain)
        else:
            k = aimed_choice(self._k, low, high, self.target, self.hysteresis)
            why = f"noise scale {noise:.4g} items x {self.factor:g} / {n:.4g} items a micro-batch: k {self.target:.3g}"
        if k != self._k:
            self._changed_at, self.reason = estimate.windows, why
        return k

    def figures(self) -> ScheduleFigures:
        """The unclamped target and, with the goodput objective, what it weighs."""
        cost, noise, n = self.step_cost.value(), self._noise_scale, self._items_per_micro_batch
        if self.objective != "goodput" or cost is None or noise is None or not n:
            return ScheduleFigures(self.target)
        # The efficiency of the global batch the next windows run.
        batch = self._k * n * self._world_size
        return ScheduleFigures(self.target, statistical_efficiency(batch, noise), cost.overhead_seconds)

    def lr_factor(self, before: int, after: int) -> float:
        """What the learning rate is multiplied by when ``k`` goes from ``before`` to ``after``."""
        return self._lr.factor(before, after, self._noise_steps())

    def _noise_steps(self) -> float | None:
        """The held noise scale in micro-steps (all ranks), where known."""
        noise, n = self._noise_scale, self._items_per_micro_batch
        return None if noise is None or not n else noise / (n * self._world_size)

    def state_dict(self) -> dict[str, Any]:
        state = {name.lstrip("_"): getattr(self, name) for name in _ADAPTIVE_STATE}
        parts: dict[str, Any] = {"estimator": self.estimator, "clamp": self._clamp, "step_cost": self.step_cost}
        return state | {key: part.state_dict() for key, part in parts.items()} | {"lr": self._lr.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._k = int(state.get("k", self.min_k))
        for name in _ADAPTIVE_STATE[1:]:
            setattr(self, name, state.get(name.lstrip("_"), getattr(self, name)))
        self.estimator.load_state_dict(state.get("estimator", {}))
        self._clamp.load_state_dict(state.get("clamp", {}))
        self.step_cost.load_state_dict(state.get("step_cost", {}))
        self._lr.load_state_dict(state.get("lr", {}), self._k, self._noise_steps())
        if self.objective != "goodput" or ("phase" not in state and self._k != self.min_k):
            self._phase = "noise"  # no start to wait for: another objective, or saved past it before it existed

    def __repr__(self) -> str:
        chosen = f"factor={self.factor}" if self.objective == "noise_scale" else f"min_gain={self.min_gain}"
        return (
            f"AdaptiveBatchSize({self.min_k}, {self.max_k}, objective={self.objective!r}, {chosen},"
            f" warmup_windows={self.warmup_windows}, hysteresis={self.hysteresis},"
            f" allow_decrease={self.allow_decrease}, max_growth={self.max_growth}, lr_scaling={self.lr_scaling!r},"
            f" beta={self.estimator.beta})"
        )


def k_for_global_batch(global_batch: int, samples_per_micro_step: int, rounding: Rounding = "error") -> int:
    """Accumulation steps that make ``global_batch`` from micro-steps of ``samples_per_micro_step`` samples.

    Examples:
        >>> k_for_global_batch(96, 16), k_for_global_batch(100, 16, "floor"), k_for_global_batch(100, 16, "ceil")
        (6, 6, 7)
    """
    if samples_per_micro_step < 1:
        raise ValueError(f"`micro_batch_size * world_size` must be >= 1, got {samples_per_micro_step}.")
    exact = global_batch / samples_per_micro_step
    if global_batch % samples_per_micro_step == 0:
        return max(1, global_batch // samples_per_micro_step)
    if rounding == "error":
        raise ValueError(
            f"The global batch size {global_batch} is not a multiple of micro_batch_size * world_size"
            f" = {samples_per_micro_step}. Pick sizes that divide, or pass `rounding='floor'`, 'ceil' or 'nearest'"
            " to the schedule to round the number of accumulation steps."
        )
    if rounding == "floor":
        return max(1, math.floor(exact))
    if rounding == "ceil":
        return max(1, math.ceil(exact))
    return max(1, round(exact))


def as_schedule(schedule: Any, unit: ScheduleUnit = "epoch") -> AccumulationSchedule | None:
    """Turn what a user passes as ``schedule`` into a schedule object (``None`` stays ``None``).

    Examples:
        >>> as_schedule(2)
        ConstantSchedule(2)
        >>> as_schedule({0: 1, 3: 4}, unit="step")
        StepwiseSchedule({0: 1, 3: 4}, unit='step')
    """
    check_choice(unit, "unit", _UNITS)
    if schedule is None:
        return None
    if isinstance(schedule, bool):
        raise TypeError(f"`schedule` must be an int, a mapping, a schedule object or None, got {schedule!r}.")
    if isinstance(schedule, int):
        check_int(schedule, "schedule", 1, hint=K_HINT)
        return ConstantSchedule(schedule)
    if isinstance(schedule, Mapping):
        return StepwiseSchedule(schedule, unit=unit)
    if isinstance(schedule, AccumulationSchedule):
        return schedule
    raise TypeError(
        f"`schedule` must be an int, a {{{unit}: k}} mapping, an object with an `accumulation_steps(progress)`"
        f" method, or None, got {schedule!r} of type {type(schedule).__name__}."
    )
