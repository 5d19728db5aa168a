"""Accumulation schedules: how many micro-batches make one optimizer step, as a function of training progress.

Everything here is pure: no Trainer, no device. A schedule is asked for ``k`` once per window, at the window's
first micro-batch, with the progress made so far. The callbacks decide *when* to ask; this module only answers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol, get_args, runtime_checkable

from torch.optim import Optimizer

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
from lightning_accum.core.noise_scale import NoiseScaleEstimator

ScheduleUnit = Literal["epoch", "step", "sample"]
Rounding = Literal["error", "floor", "ceil", "nearest"]
LRScaling = Literal["linear", "sqrt"]
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

    Raises:
        TypeError: a key or a value is not an int, or ``milestones`` is not a mapping.
        ValueError: a key is negative, the keys are not in increasing order, a value is < 1, or ``unit`` is unknown.

    Examples:
        >>> schedule = StepwiseSchedule({0: 1, 100: 2, 200: 4}, unit="step")
        >>> [schedule.accumulation_steps(Progress(optimizer_steps=s)) for s in (0, 99, 100, 250)]
        [1, 1, 2, 4]
    """

    def __init__(self, milestones: Milestones, unit: ScheduleUnit = "epoch") -> None:
        self.unit: ScheduleUnit = check_choice(unit, "unit", _UNITS)
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
        return f"StepwiseSchedule({self.milestones!r}, unit={self.unit!r})"


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

    Raises:
        TypeError: an argument is not an int.
        ValueError: a size is < 1, ``target < start``, ``target - start`` is not a multiple of ``increment``,
            ``ramp_samples < 0``, or ``rounding`` is unknown.

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
            f" ramp_samples={self.ramp_samples}, rounding={self.rounding!r})"
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
    2: at ``k = 1`` nothing is ever measured and ``k`` would stay 1 for good. The two batch sizes it compares (one
    micro-batch, the whole window) should differ by more than 2x: on the char LM example, windows of 2 gave a
    negative or undefined ``|G|²`` in 44 of 256 windows, windows of 4 and 8 in none. So ``min_accumulation_steps``
    defaults to 4. A window whose estimate is not finite (its gradient overflowed) is left out of the average and
    counted (``estimator.skipped``).

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
        min_accumulation_steps: SeveralMicroBatches = 4,
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
            " stay 1 for good. Use 2 or more; the default, 4, measures cleanly.",
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
        if lr_scaling is not None:
            check_choice(lr_scaling, "lr_scaling", ("linear", "sqrt"), hint="Or None to leave the learning rate alone.")
        self.lr_scaling: LRScaling | None = lr_scaling
        self.estimator = NoiseScaleEstimator(beta)
        self._k = self.min_k
        self._changed_at = 0  # the estimator's window count at the last change of k
        self._items_per_micro_batch: float | None = None  # per rank, smoothed

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
        noise_scale = estimate.gradient_noise_scale
        if estimate.windows - self._changed_at < max(1, self.warmup_windows) or not self._items_per_micro_batch:
            return self._k
        if not math.isfinite(noise_scale) or noise_scale <= 0:
            return self._k
        target = self.factor * noise_scale / (self._items_per_micro_batch * world_size)
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

    def lr_factor(self, before: int, after: int) -> float:
        """What the learning rate is multiplied by when ``k`` goes from ``before`` to ``after``."""
        if self.lr_scaling is None or before == after:
            return 1.0
        ratio = after / before
        return ratio if self.lr_scaling == "linear" else math.sqrt(ratio)

    def state_dict(self) -> dict[str, Any]:
        return {
            "k": self._k,
            "changed_at": self._changed_at,
            "items_per_micro_batch": self._items_per_micro_batch,
            "estimator": self.estimator.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._k = int(state.get("k", self.min_k))
        self._changed_at = int(state.get("changed_at", 0))
        self._items_per_micro_batch = state.get("items_per_micro_batch")
        self.estimator.load_state_dict(state.get("estimator", {}))

    def __repr__(self) -> str:
        return (
            f"AdaptiveBatchSize({self.min_k}, {self.max_k}, factor={self.factor}, warmup_windows={self.warmup_windows},"
            f" hysteresis={self.hysteresis}, allow_decrease={self.allow_decrease}, max_growth={self.max_growth},"
            f" lr_scaling={self.lr_scaling!r},"
            f" beta={self.estimator.beta})"
        )


def scale_learning_rates(optimizers: Iterable[Optimizer], schedulers: Iterable[Any], factor: float) -> None:
    """Multiply every param group's learning rate in ``optimizers`` by ``factor``, and their schedulers' base rates.

    A scheduler recomputes the rate from its base rates, so those follow too (``schedulers`` holds the LR schedulers
    of those optimizers; others are the caller's to leave out).
    """
    if factor == 1.0:
        return
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["lr"] *= factor
    for scheduler in schedulers:
        if hasattr(scheduler, "base_lrs"):
            scheduler.base_lrs = [lr * factor for lr in scheduler.base_lrs]


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
