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
from lightning_accum._util.log import log_info
from lightning_accum._util.validation import K_HINT, check_bool, check_choice, check_int, check_milestones, check_number
from lightning_accum.core.learning_rate import LRScaling, check_lr_scaling, lr_factor
from lightning_accum.core.noise_scale import NoiseScaleEstimator

ScheduleUnit = Literal["epoch", "step", "sample"]
Rounding = Literal["error", "floor", "ceil", "nearest"]
_UNITS = get_args(ScheduleUnit)
CLAMP_NOTE_WINDOWS = 100
"""Windows in a row whose target lies outside ``[min, max]`` before `AdaptiveBatchSize` says which setting holds k."""
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


@dataclass(frozen=True)
class ScheduleFigures:
    """What a schedule aims at after a window, for the monitor (`lightning_accum.keys.SCHEDULE_KEYS`).

    Attributes:
        target_accumulation_steps: the ``k`` aimed at (an adaptive schedule's, before clamping); ``None``: unknown.
        statistical_efficiency: progress per item at the current global batch, ``1 / (1 + B / B_noise)``.
        step_overhead_seconds: the measured fixed part of an optimizer step.
    """

    target_accumulation_steps: float | None = None
    statistical_efficiency: float | None = None
    step_overhead_seconds: float | None = None


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
        k = 1
        for start, value in self.milestones.items():
            if start > now:
                break
            k = value
        return k

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


class AdaptiveBatchSize:
    """``k`` from the measured gradient noise scale: a global batch of about ``factor`` times ``B_noise`` items.

    The gradient noise scale ``B_simple = tr(Σ)/|G|²`` (McCandlish et al., 2018) predicts the critical batch size:
    below it, a larger batch buys almost proportionally faster progress per step; above it, little. It usually grows
    as the loss falls. This schedule measures it in every window (at the cost of two gradient norms, see
    `lightning_accum.core.noise_scale`) and, after each optimizer step, aims ``k`` at
    ``factor · B_noise / (items per micro-batch · world size)``, clamped to ``[min_accumulation_steps,
    max_accumulation_steps]``. A change lands at the next window boundary, moves ``k`` by at most ``max_growth``,
    and waits ``warmup_windows`` windows after the last one: a single window's estimate of ``|G|²`` can be near zero
    or negative (the difference of two noisy norms), and the noise scale it gives is then huge.

    It needs windows of at least two micro-batches to measure anything, so ``min_accumulation_steps`` must be at least
    2: at ``k = 1`` nothing is ever measured and ``k`` would stay 1 for good. It defaults to 2, so that ``k`` can
    move where the noise scale is small (on the char LM example it is 20 to 30 sequences: a minimum of 4 micro-batches
    of 8 held ``k`` above it for a whole run). Windows of 2 compare batch sizes only 2x apart, and early on the
    smoothed ``|G|²`` can come out negative (on the char LM, 44 of 256 single windows did): while it is not positive,
    the schedule holds the last valid noise scale, and ``max_growth`` bounds what one wild window does. A window whose
    estimate is not finite (its gradient overflowed) is left out of the average and counted (``estimator.skipped``).
    Where the target stays below the minimum or above the maximum for `CLAMP_NOTE_WINDOWS` windows in a row, one log
    line names the setting that holds ``k``, and the target.

    Use it with `lightning_accum.AccumulationScheduler` or, under manual optimization,
    `lightning_accum.ManualAccumulation`; the estimate and ``k`` round-trip through checkpoints.

    Args:
        min_accumulation_steps: ``k`` while the estimate warms up, and the smallest ``k``.
        max_accumulation_steps: the largest ``k``.
        factor: the target global batch as a multiple of the noise scale.
        warmup_windows: windows measured before ``k`` may change, and between two changes.
        hysteresis: how far (relative to the current ``k``) the target must move before ``k`` follows.
        allow_decrease: let ``k`` go down when the noise scale falls (by default it never does).
        max_growth: the largest factor by which one change multiplies (or divides) ``k``; ``None`` lets ``k`` jump
            straight to its target.
        lr_scaling: when ``k`` changes, multiply the learning rate of every param group by ``k_new / k_old``
            (``"linear"``) or its square root (``"sqrt"``); ``None`` leaves it alone.
        beta: the noise-scale moving average's decay per window.

    Raises:
        TypeError: an argument has the wrong type.
        ValueError: ``min_accumulation_steps < 2``, ``max < min``, ``factor <= 0``, ``hysteresis < 0``,
            ``max_growth <= 1``, an unknown ``lr_scaling``, or ``beta`` outside ``[0, 1)``.

    Examples:
        >>> schedule = AdaptiveBatchSize(min_accumulation_steps=2, max_accumulation_steps=16, warmup_windows=1)
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
        factor: PositiveFloat = 1.0,
        warmup_windows: NonNegativeInt = 50,
        hysteresis: NonNegativeFloat = 0.25,
        allow_decrease: bool = False,
        max_growth: GrowthFactor | None = 2.0,
        lr_scaling: LRScaling | None = None,
        beta: Decay = 0.99,
    ) -> None:
        self.min_k = check_int(
            min_accumulation_steps,
            "min_accumulation_steps",
            minimum=2,
            hint="A window of one micro-batch has one batch size, so the noise scale is never measured and k would"
            " stay 1 for good. Use 2 (the default) or more.",
        )
        self.max_k = check_int(max_accumulation_steps, "max_accumulation_steps", minimum=self.min_k)
        self.factor = check_number(factor, "factor", minimum=0.0, min_inclusive=False)
        self.warmup_windows = check_int(warmup_windows, "warmup_windows", minimum=0)
        self.hysteresis = check_number(hysteresis, "hysteresis", minimum=0.0)
        self.allow_decrease = check_bool(allow_decrease, "allow_decrease")
        if max_growth is not None:
            max_growth = check_number(
                max_growth, "max_growth", 1.0, min_inclusive=False, hint="Or None to let k jump to its target."
            )
        self.max_growth: float | None = max_growth
        self.lr_scaling: LRScaling | None = check_lr_scaling(lr_scaling)
        self.estimator = NoiseScaleEstimator(beta)
        self._k = self.min_k
        self._changed_at = 0  # the estimator's window count at the last change of k
        self._items_per_micro_batch: float | None = None  # per rank, smoothed
        self._noise_scale: float | None = None  # the last valid (finite, positive) smoothed noise scale, held
        self.target: float | None = None  # the k aimed at after the last window, before clamping and rounding
        self._clamped = 0  # windows in a row whose target lay outside [min, max]
        self._clamp_noted = False  # the log line that names the setting holding k is said once

    def accumulation_steps(self, progress: Progress) -> int:
        """The ``k`` decided after the last step (the schedule only changes its mind in `observe`)."""
        return self._k

    def observe(self, items: float, micro_batches: int, world_size: int, noise: tuple[float, float] | None) -> None:
        """Take one optimizer step's figures (global items, this rank's micro-batches, the noise estimates)."""
        if noise is not None:
            self.estimator.add_estimates(*noise)
        if micro_batches > 0 and items > 0:
            per_micro_batch = items / (micro_batches * world_size)
            previous = self._items_per_micro_batch
            self._items_per_micro_batch = (
                per_micro_batch if previous is None else 0.9 * previous + 0.1 * per_micro_batch
            )
        self._k = self._decide(world_size)

    def _decide(self, world_size: int) -> int:
        estimate = self.estimator.value()
        if math.isfinite(estimate.gradient_noise_scale) and estimate.gradient_noise_scale > 0:
            self._noise_scale = estimate.gradient_noise_scale
        if self._noise_scale is None or not self._items_per_micro_batch:
            return self._k
        target = self.factor * self._noise_scale / (self._items_per_micro_batch * world_size)
        self.target = target
        self._note_clamp(target)
        if estimate.windows - self._changed_at < max(1, self.warmup_windows):
            return self._k
        k = min(self.max_k, max(self.min_k, round(target)))
        if not self.allow_decrease:
            k = max(k, self._k)
        if self.max_growth is not None:
            k = min(k, math.floor(self._k * self.max_growth))
            k = max(k, math.ceil(self._k / self.max_growth))
        if abs(k - self._k) <= self.hysteresis * self._k:
            return self._k
        self._changed_at = estimate.windows
        return k

    def _note_clamp(self, target: float) -> None:
        """Count the windows whose target lies outside the bounds; after `CLAMP_NOTE_WINDOWS`, say so once."""
        below, above = round(target) < self.min_k, round(target) > self.max_k
        self._clamped = self._clamped + 1 if below or above else 0
        if self._clamped < CLAMP_NOTE_WINDOWS or self._clamp_noted:
            return
        self._clamp_noted = True
        setting, bound, fix = (
            ("min_accumulation_steps", self.min_k, "lower it")
            if below
            else ("max_accumulation_steps", self.max_k, "raise it")
        )
        log_info(
            f"lightning_accum: AdaptiveBatchSize's target k has stayed {'below' if below else 'above'} `{setting}`"
            f" ({bound}) for {self._clamped} windows (target {target:.3g}); `{setting}` holds k at {bound}: {fix}"
            " to let k follow the target."
        )

    def figures(self) -> ScheduleFigures:
        """The unclamped target after the last window, for the monitor."""
        return ScheduleFigures(self.target)

    def lr_factor(self, before: int, after: int) -> float:
        """What the learning rate is multiplied by when ``k`` goes from ``before`` to ``after``."""
        return lr_factor(self.lr_scaling, before, after)

    def state_dict(self) -> dict[str, Any]:
        return {
            "k": self._k,
            "changed_at": self._changed_at,
            "items_per_micro_batch": self._items_per_micro_batch,
            "estimator": self.estimator.state_dict(),
            "noise_scale": self._noise_scale,
            "target": self.target,
            "clamped": self._clamped,
            "clamp_noted": self._clamp_noted,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._k = int(state.get("k", self.min_k))
        self._changed_at = int(state.get("changed_at", 0))
        self._items_per_micro_batch = state.get("items_per_micro_batch")
        self.estimator.load_state_dict(state.get("estimator", {}))
        self._noise_scale = state.get("noise_scale")
        self.target = state.get("target")
        self._clamped = int(state.get("clamped", 0))
        self._clamp_noted = bool(state.get("clamp_noted", False))

    def __repr__(self) -> str:
        return (
            f"AdaptiveBatchSize({self.min_k}, {self.max_k}, factor={self.factor}, warmup_windows={self.warmup_windows},"
            f" hysteresis={self.hysteresis}, allow_decrease={self.allow_decrease}, max_growth={self.max_growth},"
            f" lr_scaling={self.lr_scaling!r},"
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
