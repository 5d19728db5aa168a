"""Choosing the micro-batch size in split mode: shrink before memory runs out, recover from OOMs, grow back.

Pure: no Trainer, no device. The split-mode callback measures, agrees the measurements across ranks (so that every
rank feeds the same numbers), and asks `MicroBatchPlanner` for the next size; every answer is a deterministic
function of those inputs, so all ranks reach the same decision without another collective.

The dataloader yields a per-device step batch of ``B`` samples; the planner picks ``b <= B`` and the step runs
``k = ceil(B / b)`` micro-batches. The effective batch never changes because of memory: only ``b`` and ``k`` do.

How sizes are chosen:

* **Balanced micro-batches.** For a largest-fitting size ``b_fit`` the planner keeps ``k = ceil(B / b_fit)`` and
  then evens out the micro-batches: ``b = ceil(B / k) <= b_fit``. This never adds a pass and lowers the peak:
  ``B = 100`` with ``b_fit = 40`` runs 34 + 34 + 32, not 40 + 40 + 20. Sizes that divide ``B`` exactly are not
  required; a prime ``B`` would otherwise force ``b = 1``.
* **Predict, don't probe.** Each step's peak is fed to a `lightning_accum.memory.model.LinearPeakModel` (split by
  tokens, a `lightning_accum.memory.model.SequencePeakModel`, through the unit, `lightning_accum.split.planner.units`).
  Once it has two sizes it answers "the largest ``b`` whose predicted peak fits the budget" directly. With a single
  measurement, growing by ``b * budget / peak`` is still safe, because a fixed part >= 0 makes the peak grow
  less than proportionally. When a measurement is far off the model (a new phase of training: longer sequences),
  the model is discarded and rebuilt from fresh measurements. An OOM at a size the model said fits halves the size
  and keeps the model: the next measurement decides (a passing spike or fragmentation leaves it right, and the
  failed size waits out its cool-down).
* **Plain halving** (``predictive=False``) halves on every OOM or over-budget step (until shrinking stops helping,
  below) and doubles to grow back, like Composer, which never grows back at all.
* **Hysteresis.** The planner shrinks as soon as the peak exceeds the budget (or the allocator had to retry on two
  consecutive steps), but grows only after ``grow_patience`` consecutive steps under the low watermark, and never to
  a size that failed (OOM, over budget, allocator retries) within the last ``oom_cooldown`` steps. The watermark is
  ``low_watermark * budget`` until the model is fitted; then it applies to the part of the budget the micro-batch
  can use, ``fixed + low_watermark * (budget - fixed)``, so a large fixed part (parameters and optimizer state, or a
  process's resident set on CPU) does not stop the micro-batch from ever growing back.
* **No shrinking for nothing.** Once over-budget shrinks have cut the micro-batch to half the size where they began
  or less, the peaks at both ends say what a sample costs. If, at that rate, even ``min_micro_batch_size`` would peak
  over the budget, the memory that does not depend on ``b`` is over it by itself (on CPU, resident memory that a
  smaller micro-batch does not give back): the planner keeps the size and says so once (`budget_unreachable`)
  instead of shrinking to the minimum for nothing. An OOM still shrinks; a peak under the budget, a grow or a new
  phase of the model ends the hold, and a fall of the fixed memory (memory freed) lets the shrinking go on. At the
  smallest size itself (split by tokens: the step's longest sequence, which moves from step to step) the planner
  says so once and holds that size until a peak under the budget, a grow or an OOM: a later step with shorter
  sequences does not shrink it below the floor just announced.

The settings (``grow_patience``, ``oom_cooldown``, ...) and their defaults are `PlannerSettings`
(`lightning_accum.split.planner.settings`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, Generic, Literal, NamedTuple, TypeVar, overload

from lightning_accum._util.validation import check_int, check_number
from lightning_accum.memory.sizes import format_size, format_sizes
from lightning_accum.split.planner.history import PlannerHistory, optional
from lightning_accum.split.planner.messages import out_of_memory_error, why_not_shrink
from lightning_accum.split.planner.settings import PlannerSettings
from lightning_accum.split.planner.units import PeakModel, Samples

PlannerEventKind = Literal["oom_recovered", "shrink", "grow"]
_STATE_VERSION = 1
_T = TypeVar("_T")


class PlannerEvent(NamedTuple):
    """A change of the micro-batch size; the callback turns it into an ``AccumulationEvent``."""

    step: int
    kind: PlannerEventKind
    before: int
    after: int
    reason: str
    unit: Literal["samples", "tokens"] = "samples"  # what ``before`` and ``after`` count (the planner's unit)


class _FromSettings(Generic[_T]):
    """A read-only planner attribute that reads one `PlannerSettings` field: ``planner.grow_patience``."""

    def __init__(self, read: Callable[[PlannerSettings], _T]) -> None:
        self._read = read
        self._name = ""

    def __set_name__(self, owner: type[MicroBatchPlanner], name: str) -> None:
        self._name = name

    @overload
    def __get__(self, planner: None, owner: type[MicroBatchPlanner]) -> _FromSettings[_T]: ...
    @overload
    def __get__(self, planner: MicroBatchPlanner, owner: type[MicroBatchPlanner]) -> _T: ...
    def __get__(self, planner: MicroBatchPlanner | None, owner: type[MicroBatchPlanner]) -> _T | _FromSettings[_T]:
        return self if planner is None else self._read(planner.settings)

    def __set__(self, planner: MicroBatchPlanner, value: object) -> None:
        # Without this, the assignment would make an instance attribute that the planner never reads.
        raise AttributeError(
            f"`MicroBatchPlanner.{self._name}` reads `planner.settings`, which is frozen. Build the planner with the"
            " setting you want, or replace them all: `planner.settings = dataclasses.replace(planner.settings, ...)`."
        )


class MicroBatchPlanner:
    """Decides the micro-batch size ``b`` for split mode from measured peaks and OOMs (see the module docstring).

    ``planner.settings`` holds the `PlannerSettings`; each one also reads as an attribute (``planner.grow_patience``,
    and ``planner.micro_batch_size_setting`` for the setting, since ``planner.micro_batch_size`` is the size in use).

    Args:
        settings: a `PlannerSettings`, or its ``micro_batch_size`` with the other settings as keywords (``None``:
            the default ``micro_batch_size``).
        budget_bytes: the peak memory to stay under. ``None`` disables the budget-driven decisions (shrinking on
            an over-budget peak, growing back, predicting), leaving OOM recovery and allocator-retry shrinking.
            `AutoMicroBatching` sets it once the device is known.
        **keywords: the other `PlannerSettings` fields, such as ``grow_patience=1``, when ``settings`` is not a
            `PlannerSettings`.

    Raises:
        TypeError: a setting has the wrong type or is unknown, or keywords come with a `PlannerSettings`.
        ValueError: ``budget_bytes`` is not a finite number > 0, or a setting is out of range (`PlannerSettings`).

    Examples:
        A 64-sample step batch on a device whose peak is ``1 GiB + 0.1 GiB * b``, with a 3 GiB budget:

        >>> from lightning_accum.memory.budget import GIB
        >>> planner = MicroBatchPlanner("auto", budget_bytes=3 * GIB, grow_patience=1)
        >>> planner.size_for(64)  # starts from the whole batch
        64
        >>> planner.on_oom(64, step=0)  # nothing measured yet: halve
        32
        >>> planner.on_oom(32, step=0)
        16
        >>> planner.on_step(16, peak_bytes=1 * GIB + 16 * GIB // 10, step=0)  # 2.6 GiB: fits, not under 70%
        16
        >>> planner.on_step(16, peak_bytes=1 * GIB + 16 * GIB // 10, step=1)
        16
        >>> [(e.kind, e.before, e.after) for e in planner.take_events()]
        [('oom_recovered', 64, 32), ('oom_recovered', 32, 16)]
    """

    def __init__(
        self,
        settings: PlannerSettings | int | Literal["auto"] | None = None,
        *,
        budget_bytes: float | None = None,
        unit: Samples | None = None,
        **keywords: Any,
    ) -> None:
        self.settings = _settings_from(settings, keywords)
        self.unit = unit or Samples()  # what a size counts (`lightning_accum.split.planner.units`)
        self.budget_bytes: float | None = None
        if budget_bytes is not None:
            self.set_budget(budget_bytes)
        self.model = self.unit.new_model()
        self.events: list[PlannerEvent] = []
        self._limit: int | None = None  # the largest size believed to fit; the size used is balanced below it
        self._step_batch_size: int | None = None
        self._history = PlannerHistory()
        self.budget_unreachable: str | None = None
        """After `on_step`: why shrinking cannot bring the peak under the budget, or ``None``."""
        self._said_unreachable = False

    # The settings as attributes, where the callback, the monitor and the CLI read them: `PlannerSettings` has them.
    micro_batch_size_setting = _FromSettings(lambda settings: settings.micro_batch_size)
    min_micro_batch_size = _FromSettings(lambda settings: settings.min_micro_batch_size)
    pin_micro_batch_size = _FromSettings(lambda settings: settings.pin_micro_batch_size)
    low_watermark = _FromSettings(lambda settings: settings.low_watermark)
    grow_patience = _FromSettings(lambda settings: settings.grow_patience)
    oom_cooldown = _FromSettings(lambda settings: settings.oom_cooldown)
    predictive = _FromSettings(lambda settings: settings.predictive)

    # ---- queries ------------------------------------------------------------------------------------------------

    @property
    def micro_batch_size(self) -> int | None:
        """The size for the last step batch size seen, or ``None`` before `size_for` was called."""
        if self._limit is None:
            return None
        return self.unit.balance(self._limit, self._step_batch_size, self.settings)

    def size_for(self, step_batch_size: int) -> int:
        """The micro-batch size for a step batch of ``step_batch_size`` samples.

        Raises:
            TypeError: if ``step_batch_size`` is not an int.
            ValueError: if ``step_batch_size < 1``.
        """
        self._step_batch_size = check_int(step_batch_size, "step_batch_size", 1)
        if self._limit is None:
            self._limit = self._initial_limit(step_batch_size)
        return self.unit.balance(self._limit, step_batch_size, self.settings)

    def set_budget(self, budget_bytes: float) -> None:
        """The peak memory to stay under, once the device is known (a front end's run starts on it).

        Raises:
            ValueError: ``budget_bytes`` is not a finite number > 0.
        """
        self.budget_bytes = check_number(budget_bytes, "budget_bytes", 0, min_inclusive=False, kind="number of bytes")

    def start_from(self, size: int) -> None:
        """Start an ``"auto"`` run at ``size`` instead of the whole step batch, e.g. a pre-flight's prediction.

        A no-op once a size has been chosen (a step ran, or a checkpoint was restored): a prediction made before any
        step never overrides a measurement.

        Raises:
            TypeError: if ``size`` is not an int.
            ValueError: if ``size < 1``.
        """
        size = check_int(size, "size", 1)
        if self._limit is None:
            self._limit = max(self.unit.floor(self.settings), size)

    def set_step_batch_size(self, step_batch_size: int) -> None:
        """The step batch size that the next `on_step` or `on_oom` balances its answer for.

        `size_for` sets it to the step batch it sizes. Ranks whose step batches differ in size (uneven shards, the
        last batch of an epoch) set it to the largest over ranks before each decision, so that every rank's planner
        decides alike and stays alike.

        Raises:
            TypeError: if ``step_batch_size`` is not an int.
            ValueError: if ``step_batch_size < 1``.
        """
        self._step_batch_size = check_int(step_batch_size, "step_batch_size", 1)

    def cooling_down_from(self, step: int) -> int | None:
        """The smallest size that failed recently: it and every larger size are off limits at ``step``."""
        return self._history.cooling_down_from(step)

    def unreachable_warning(self) -> str | None:
        """`budget_unreachable` the first time it is set, then ``None``: what to warn about, once per planner."""
        if self.budget_unreachable is None or self._said_unreachable:
            return None
        self._said_unreachable = True
        return self.budget_unreachable

    def take_events(self) -> list[PlannerEvent]:
        """Return the decisions recorded since the last call and forget them."""
        events, self.events = self.events, []
        return events

    # ---- decisions ----------------------------------------------------------------------------------------------

    def on_oom(self, size: int, step: int) -> int:
        """A micro-batch of ``size`` ran out of memory at ``step``: return the smaller size to retry the step with.

        Raises:
            MicroBatchOOMError: if ``size`` is already at ``min_micro_batch_size``.
        """
        size = check_int(size, "size", 1)
        step = check_int(step, "step", 0)
        if size <= self.unit.floor(self.settings):
            last = (self._history.last_peak, self._history.last_size)
            raise out_of_memory_error(size, step, self.unit, self.settings, self.budget_bytes, last, self.model)
        target, reason = size // 2, f"OOM at {size}: halved"
        if self.settings.predictive and self.budget_bytes is not None and self.model.fitted():
            target, reason = _after_oom(size, self.budget_bytes, self.model)
        return self._change("oom_recovered", size, target, step, reason)

    def on_step(self, size: int, peak_bytes: float, step: int, alloc_retries_delta: int = 0) -> int:
        """A step ran micro-batches of ``size`` with a peak of ``peak_bytes``: return the size for the next step.

        Args:
            size: the micro-batch size the step ran with (its largest micro-batch).
            peak_bytes: the step's peak memory, the maximum over ranks.
            step: the optimizer step.
            alloc_retries_delta: allocator retries during the step (CUDA ``num_alloc_retries``), summed over ranks.
        """
        size = check_int(size, "size", 1)
        step = check_int(step, "step", 0)
        peak = check_number(peak_bytes, "peak_bytes", 0, kind="number of bytes")
        retries = check_int(alloc_retries_delta, "alloc_retries_delta", 0)
        if self._limit is None:
            self._limit = size
        self._observe(size, peak)
        history = self._history
        history.remember_step(size, peak)
        history.retry_streak = history.retry_streak + 1 if retries > 0 else 0
        budget = self.budget_bytes
        settings = self.settings
        can_shrink = not settings.pin_micro_batch_size and size > self.unit.floor(settings)

        self.budget_unreachable = None
        if budget is not None and peak > budget:
            shrunk = self._over_budget(size, peak, budget, step, can_shrink)
            if shrunk is not None:
                return shrunk
        elif budget is not None:
            # Under the budget; the first shrink's (size, peak) stays until a grow or refit, so a peak back over it at a
            # smaller size says what the shrinks bought, where a noisy measure (the CPU's RSS) dips under and over it.
            history.held_at_floor = None
            history.remember_fit(size, self.unit.length(), peak)
        if history.retry_streak >= 2 and can_shrink:
            if settings.predictive and budget is not None and self.model.fitted():
                # Retries mean fragmentation more than size; aim for the low watermark to leave the allocator room.
                target = _fit_below(self.model, settings.low_watermark * budget, size)
            else:
                target = size // 2
            return self._change("shrink", size, target, step, "allocator retried on 2 consecutive steps")

        if budget is None or peak >= _low_mark(self.model, self.settings.low_watermark, budget):
            history.under = 0
            return self._current(size)
        history.under += 1
        if history.under < settings.grow_patience:
            return self._current(size)
        history.under = 0
        cap = self._step_batch_size or size
        if settings.pin_micro_batch_size and isinstance(settings.micro_batch_size, int):
            cap = min(cap, settings.micro_batch_size)
        ceiling = self.cooling_down_from(step)
        allowed = cap if ceiling is None else min(cap, ceiling - 1)
        grown = _grow_target(size, peak, budget, allowed, cap, settings.predictive, self.model)
        if grown is None or grown <= self._limit:
            return self._current(size)
        texts = format_sizes(peak, _low_mark(self.model, self.settings.low_watermark, budget))
        reason = f"peak {texts[0]} < low watermark {texts[1]} for {settings.grow_patience} steps"
        return self._change("grow", size, grown, step, reason)

    # ---- internals ----------------------------------------------------------------------------------------------

    def _initial_limit(self, step_batch_size: int) -> int:
        settings = self.settings
        if isinstance(settings.micro_batch_size, int):
            return settings.micro_batch_size
        if settings.predictive and self.budget_bytes is not None and self.model.fitted():
            fit = self.model.largest_fitting(self.budget_bytes, step_batch_size)
            return max(self.unit.floor(settings), fit or 1)
        return step_batch_size

    def _current(self, size: int) -> int:
        if self._step_batch_size is None:
            return size
        return self.unit.balance(self._limit or size, self._step_batch_size, self.settings)

    def _observe(self, size: int, peak: float) -> None:
        if self.model.fitted():
            predicted = self.model.predict(size)
            if abs(predicted - peak) > self.settings.refit_tolerance * max(peak, 1.0):
                # Measurements from an earlier phase of training would bend the new fit; start over.
                self.model = self.unit.new_model(self.model.max_sizes)
                self._history.shrink_start = None
                self._history.fitted = []
        self.model.observe(size, peak)

    def _over_budget(self, size: int, peak: float, budget: float, step: int, can_shrink: bool) -> int | None:
        """A peak over the budget: the size shrunk to, or ``None`` where shrinking cannot help (then it says why)."""
        history = self._history
        self.budget_unreachable = why_not_shrink(size, peak, budget, self.unit, self.settings, history)
        if not can_shrink or self.budget_unreachable is not None:
            return None
        if history.shrink_start is None:
            history.shrink_start = (size, peak)
        target = _bounded_shrink(
            size, _shrink_target(size, peak, budget, self.settings.predictive, self.model), self.unit.least_shrink(size)
        )
        return self._change("shrink", size, target, step, "peak {} > budget {}".format(*format_sizes(peak, budget)))

    def _change(self, kind: PlannerEventKind, size: int, target: int, step: int, reason: str) -> int:
        before = self._current(size) if kind == "grow" else size
        self._history.held_at_floor = None  # a grow or an OOM: the memory is not what the hold was decided on
        if kind == "grow":
            self._limit = target
            self._history.shrink_start = None
        else:
            target = max(self.unit.floor(self.settings), min(target, size - 1))
            if self.settings.oom_cooldown > 0:
                self._history.cool_down(size, until=step + self.settings.oom_cooldown)
            self._limit = target
            self._history.under = self._history.retry_streak = 0
        after = self._current(target)
        if after != before or kind != "grow":
            self.events.append(PlannerEvent(step, kind, size, after, reason, self.unit.counts))
        return after

    # ---- checkpointing ------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": _STATE_VERSION,
            "limit": self._limit,
            "step_batch_size": self._step_batch_size,
            **self._history.state_dict(),
            "model": self.model.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from `state_dict`; missing keys keep their defaults so older checkpoints still load."""
        self._limit = optional(int, state.get("limit"))
        self._step_batch_size = optional(int, state.get("step_batch_size"))
        self._history = PlannerHistory.from_state_dict(state)
        self.model = self.unit.new_model()
        if "model" in state:
            self.model.load_state_dict(state["model"])

    def __repr__(self) -> str:
        return (
            f"MicroBatchPlanner(micro_batch_size={self.settings.micro_batch_size!r}, size={self.micro_batch_size},"
            f" predictive={self.settings.predictive}, budget_bytes={self.budget_bytes})"
        )


def _settings_from(
    settings: PlannerSettings | int | Literal["auto"] | None, keywords: dict[str, Any]
) -> PlannerSettings:
    """The planner's settings from what its constructor was given: a `PlannerSettings`, or the settings one by one."""
    if not isinstance(settings, PlannerSettings):
        return PlannerSettings(**keywords) if settings is None else PlannerSettings(settings, **keywords)
    if keywords:
        raise TypeError(
            f"`MicroBatchPlanner` takes a `PlannerSettings` or the settings as keywords, got both (also"
            f" {', '.join(f'`{name}`' for name in sorted(keywords))}). Pass `dataclasses.replace(settings, ...)`"
            " to change some of them."
        )
    return settings


def _low_mark(model: PeakModel, low_watermark: float, budget: float) -> float:
    """The peak under which the planner counts a step toward growing back (see the module docstring)."""
    fixed = model.fixed_bytes if model.fitted() else None
    if fixed is None or not 0 <= fixed < budget:
        return low_watermark * budget
    return fixed + low_watermark * (budget - fixed)


def _shrink_target(size: int, peak: float, budget: float, predictive: bool, model: PeakModel) -> int:
    """The size to shrink to from ``size`` after a peak over the budget."""
    if not predictive:
        return size // 2
    if model.fitted():
        return _fit_below(model, budget, size)
    # With one measurement, proportional scaling under-shrinks when there is fixed memory: never shrink less than
    # halving would.
    return min(size // 2, math.floor(size * budget / peak))


def _bounded_shrink(size: int, target: int, least: int) -> int:
    """``target`` kept between half of ``size`` and ``least`` below it: a shrink that buys what it costs.

    A fit over noisy peaks (the CPU's resident set moves by tens of MiB from step to step) can put the largest size
    that fits one token under ``size`` (a shrink that buys nothing, followed by another), or far below it (a fixed
    part mistaken for most of the peak: 1423 -> 268 tokens in a user's run). A shrink of at least ``least``
    (`lightning_accum.split.planner.units.Samples.least_shrink`) tells at the next step whether shrinking lowers the
    peak (`lightning_accum.split.planner.messages.out_of_reach` stops it where it does not); at most half keeps a
    wrong fit from costing most of the throughput at once. An OOM is not bounded: it halves, or goes to the fit.
    """
    return max(size // 2, min(target, size - least))


def _grow_target(
    size: int, peak: float, budget: float, allowed: int, cap: int, predictive: bool, model: PeakModel
) -> int | None:
    """The size to grow to from ``size`` (at most ``allowed``, below any size cooling down), or ``None``: stay."""
    if allowed <= size:
        return None
    if not predictive:
        doubled = min(2 * size, cap)
        # Probing one below a failed size would creep up on it one OOM at a time; wait for the cool-down.
        return None if doubled > allowed else doubled
    if model.fitted():
        return model.largest_fitting(budget, allowed)
    if peak <= 0:
        return min(2 * size, allowed)
    return min(allowed, math.floor(size * budget / peak))


def _fit_below(model: PeakModel, budget: float, size: int) -> int:
    """The largest size under ``size`` that the fitted ``model`` predicts to fit ``budget``, else half of ``size``.

    No size predicted to fit means the fixed part alone passes the budget. Jumping to the minimum would then cost most
    of the throughput for little memory (and on CPU the "fixed" part is often resident memory that freed tensors left
    behind): halve, as without a model. If the halving does not lower the measured peak enough, `_out_of_reach`
    stops the shrinking there.
    """
    fit = model.largest_fitting(budget, size - 1)
    return size // 2 if fit is None else fit


def _after_oom(size: int, budget: float, model: PeakModel) -> tuple[int, str]:
    """The size to retry with after an OOM at ``size``, and why, as the fitted ``model`` sees it."""
    predicted = model.predict(size)
    if predicted > budget:
        return _fit_below(
            model, budget, size
        ), f"OOM at {size}: largest predicted to fit the budget {format_size(budget)}"
    # The model said `size` fits: halve. The model stays: if the run changed (longer sequences), the next measured
    # peak disagrees with it and starts a new one (`MicroBatchPlanner._observe`); if the OOM was fragmentation or a
    # passing spike, it still knows which sizes fit, and the failed size waits out its cool-down. (A model thrown
    # away here left one measured size, and with large fixed memory the micro-batch never grew back.)
    return size // 2, "OOM at {}, predicted {} <= budget {}: halved".format(size, *format_sizes(predicted, budget))
