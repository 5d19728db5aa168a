"""How an adaptive schedule chooses ``k``: the goodput objective, the range a change may reach, the note. Pure.

The goodput objective picks the ``k`` that trains fastest on the user's clock (no Trainer, no device here).
A larger batch buys fewer optimizer steps, not fewer samples. McCandlish et al. (2018) put the progress an item
makes in a global batch of ``B`` items, relative to a very small batch, at the **statistical efficiency**
``E(B) = 1 / (1 + B / B_noise)`` (``B_noise`` the gradient noise scale). On the clock, a step of ``k`` micro-batches
of ``n`` items on each of ``W`` ranks costs ``T(k) = k·c_mb + s``: ``c_mb`` a micro-batch's forward and backward,
``s`` the step's fixed part (the gradient sync, the optimizer step, ``zero_grad``, the launch overhead). Pollux
(Qiao et al., OSDI 2021) maximises the **goodput**, items per second times statistical efficiency:

    G(k) = k·n·W / (k·c_mb + s) · 1 / (1 + k·n·W / B_noise)

Its maximum over a continuous ``k`` is at ``k* = sqrt(s · B_noise / (n·W·c_mb))``, i.e. a global batch
``B* = sqrt(B_noise · s / c)`` with ``c = c_mb / (n·W)`` the time per item: the step's fixed part is all that a
larger ``k`` saves, and the noise scale says what it costs in samples. `choose_accumulation_steps` picks the whole
``k`` in the allowed range with the largest goodput, and moves only for a predicted gain of at least ``min_gain``.

`lightning_accum.core.step_clock` measures ``c_mb`` and ``s`` in the training process (the host's times on the CPU,
events on the device's stream on a GPU, where the host runs ahead of the device), and `StepCostAverage` smooths them;
a front end passes the sums on, with the window's counts, in the all-reduce the window runs anyway, so every rank
decides from the same figures and no collective is added.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

from lightning_accum._util.log import log_info
from lightning_accum._util.validation import check_choice, check_number

Objective = Literal["goodput", "noise_scale"]
StartPhase = Literal["timing", "guessed", "noise"]
"""Where an adaptive schedule's goodput start stands: timing the step, on a ``k`` the cost alone chose, past both."""
COST_START_WINDOWS = 4
"""Timed windows before the goodput objective takes its first ``k`` from the step's cost alone."""
CLAMP_NOTE_WINDOWS = 100
"""Windows in a row whose target lies outside ``[min, max]`` before `AdaptiveBatchSize` says which setting holds k."""


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


@dataclass(frozen=True)
class StepCost:
    """What a step costs on the clock.

    Attributes:
        micro_batch_seconds: one micro-batch's forward and backward (and its data), on one rank.
        overhead_seconds: the step's fixed part: the sync, the optimizer step, ``zero_grad``.
    """

    micro_batch_seconds: float
    overhead_seconds: float


def statistical_efficiency(batch: float, noise_scale: float) -> float:
    """The progress per item in a global batch of ``batch`` items, relative to a very small batch.

    Examples:
        >>> statistical_efficiency(batch=64, noise_scale=64)
        0.5
    """
    return 1.0 / (1.0 + batch / noise_scale)


def goodput(k: int, cost: StepCost, items_per_micro_batch: float, world_size: int, noise_scale: float) -> float:
    """Items per second times their statistical efficiency at ``k`` micro-batches per step and rank.

    Examples:
        One micro-batch of 8 items costs 1 s and the step's fixed part 3 s; the noise scale is 32 items:

        >>> cost = StepCost(micro_batch_seconds=1.0, overhead_seconds=3.0)
        >>> [round(goodput(k, cost, 8, 1, 32.0), 3) for k in (1, 2, 4)]
        [1.6, 2.133, 2.286]
    """
    batch = k * items_per_micro_batch * world_size
    seconds = k * cost.micro_batch_seconds + cost.overhead_seconds
    return batch / seconds * statistical_efficiency(batch, noise_scale)


def optimal_accumulation_steps(
    cost: StepCost, items_per_micro_batch: float, world_size: int, noise_scale: float
) -> float:
    """The continuous ``k*`` of the largest goodput: ``sqrt(s · B_noise / (n · W · c_mb))``.

    Examples:
        >>> optimal_accumulation_steps(StepCost(1.0, 3.0), items_per_micro_batch=8, world_size=1, noise_scale=32.0)
        3.4641016151377544
    """
    per_step = items_per_micro_batch * world_size * cost.micro_batch_seconds
    if per_step <= 0:
        return math.inf
    return math.sqrt(max(cost.overhead_seconds, 0.0) * noise_scale / per_step)


def balanced_accumulation_steps(cost: StepCost) -> int:
    """The ``k`` whose micro-batches take as long as the step's fixed part: ``round(s / c_mb)``, at least 1.

    Before the noise scale is known it is the safest ``k``: write ``x = k·c_mb / s`` and ``r = s / (c·B_noise)``;
    the goodput is proportional to ``x / ((1 + x)(1 + r·x))``, whose best is at ``x = 1/sqrt(r)``. At ``x = 1`` it is
    ``(1 + sqrt(r))² / (2(1 + r))`` of the best, never under one half, whatever ``B_noise`` is; any other ``x`` can
    fall lower (towards ``x / (1 + x)`` for a huge noise scale, ``1 / (1 + x)`` for a tiny one). A whole ``k`` puts
    ``x`` within ``c_mb / 2s`` of 1: at ``s / c_mb = 6.4``, ``k = 6``, ``x = 0.94``, at least 0.48 of the best.

    Examples:
        >>> balanced_accumulation_steps(StepCost(micro_batch_seconds=0.005, overhead_seconds=0.03))
        6
        >>> balanced_accumulation_steps(StepCost(micro_batch_seconds=0.02, overhead_seconds=0.004))  # a cheap step
        1
    """
    if cost.micro_batch_seconds <= 0:
        return 1
    return max(1, round(cost.overhead_seconds / cost.micro_batch_seconds))


def cost_start(current: int, minimum: int, maximum: int, cost: StepCost) -> tuple[int, str]:
    """The goodput objective's first ``k`` (`balanced_accumulation_steps` in bounds, never below ``current``), and why.

    Examples:
        >>> cost_start(2, 2, 64, StepCost(micro_batch_seconds=0.005, overhead_seconds=0.03))[0]
        6
    """
    k = min(maximum, max(minimum, current, balanced_accumulation_steps(cost)))
    why = (
        f"goodput, before the noise scale is known: step overhead {cost.overhead_seconds * 1e3:.3g} ms,"
        f" {cost.micro_batch_seconds * 1e3:.3g} ms per micro-batch: k {k} spends as long on micro-batches as on the"
        " step's fixed part, at least half the best goodput whatever the noise scale"
    )
    return k, why if k != current else ""


@dataclass(frozen=True)
class GoodputChoice:
    """What `choose_accumulation_steps` decided.

    Attributes:
        k: the ``k`` to run: the best in range, or the current one where the gain is too small.
        best: the whole ``k`` in range with the largest goodput.
        gain: the predicted goodput of ``best`` over the current ``k``, minus 1 (0.12: 12% faster).
    """

    k: int
    best: int
    gain: float


def choose_accumulation_steps(
    current: int,
    low: int,
    high: int,
    cost: StepCost,
    items_per_micro_batch: float,
    world_size: int,
    noise_scale: float,
    min_gain: float = 0.05,
) -> GoodputChoice:
    """The whole ``k`` in ``[low, high]`` of the largest goodput; ``current`` unless that gains ``min_gain`` or more.

    Examples:
        >>> cost = StepCost(micro_batch_seconds=1.0, overhead_seconds=3.0)
        >>> choice = choose_accumulation_steps(1, 1, 16, cost, 8, 1, noise_scale=32.0)
        >>> choice.k, round(choice.gain, 3)  # k* = 3.46: 3 and 4 tie, 43% above k = 1
        (3, 0.429)
        >>> choose_accumulation_steps(4, 1, 16, cost, 8, 1, noise_scale=32.0).k  # no gain over 4: it stays
        4
    """

    def rate(k: int) -> float:
        return goodput(k, cost, items_per_micro_batch, world_size, noise_scale)

    best = max(range(low, high + 1), key=rate)
    gain = rate(best) / rate(current) - 1.0
    return GoodputChoice(best if gain >= min_gain else current, best, gain)


def goodput_choice(
    current: int,
    low: int,
    high: int,
    cost: StepCost,
    items_per_micro_batch: float,
    world_size: int,
    noise_scale: float,
    min_gain: float,
) -> tuple[int, str]:
    """`choose_accumulation_steps`'s ``k``, and why, for the change's log line."""
    n = items_per_micro_batch
    choice = choose_accumulation_steps(current, low, high, cost, n, world_size, noise_scale, min_gain)
    best = optimal_accumulation_steps(cost, n, world_size, noise_scale)
    why = (
        f"goodput: noise scale {noise_scale:.4g} items, {cost.micro_batch_seconds * 1e3:.3g} ms per micro-batch of"
        f" {n:.4g} items, step overhead {cost.overhead_seconds * 1e3:.3g} ms: best k {best:.3g}, k {choice.best}"
        f" predicted {choice.gain:+.0%} faster than k {current}"
    )
    return choice.k, why


def aimed_choice(current: int, low: int, high: int, target: float, hysteresis: float) -> int:
    """``objective="noise_scale"``'s ``k``: ``target`` rounded into ``[low, high]``, unless within ``hysteresis``.

    Examples:
        >>> aimed_choice(4, 2, 8, target=4.9, hysteresis=0.25), aimed_choice(4, 2, 8, target=11.0, hysteresis=0.25)
        (4, 8)
    """
    k = min(high, max(low, round(target)))
    return current if abs(k - current) <= hysteresis * current else k


def check_objective(objective: Any, factor: Any) -> tuple[Objective, float]:
    """``(objective, factor)`` of `lightning_accum.schedules.AdaptiveBatchSize`; only ``"noise_scale"`` takes a factor.

    ``objective=None`` (the default) is ``"goodput"``, or ``"noise_scale"`` where a ``factor`` is given: a setting
    written before the goodput objective (``AdaptiveBatchSize(factor=2.0)``, in code or YAML) keeps meaning what it
    meant.

    Raises:
        ValueError: an unknown ``objective``, ``factor <= 0``, or ``factor`` given with ``objective="goodput"``.

    Examples:
        >>> check_objective("noise_scale", None), check_objective(None, None), check_objective(None, 2.0)
        (('noise_scale', 1.0), ('goodput', 1.0), ('noise_scale', 2.0))
    """
    if objective is None:
        objective = "goodput" if factor is None else "noise_scale"
    chosen: Objective = check_choice(
        objective, "objective", get_args(Objective), hint="'goodput' (the default) weighs the measured step cost."
    )
    if factor is not None and chosen == "goodput":
        raise ValueError(
            f"`factor` ({factor!r}) applies to `objective='noise_scale'` only: the goodput objective picks the batch"
            " from the measured step cost. Pass `objective='noise_scale'` to aim at factor x the noise scale, or"
            " leave `factor` out."
        )
    return chosen, check_number(1.0 if factor is None else factor, "factor", minimum=0.0, min_inclusive=False)


class StepCostAverage:
    """The measured ``StepCost``, smoothed over windows (an exponential average, each part on its own).

    The average is debiased as Adam's moments are: the first windows weigh alike, instead of the first one standing
    for all the windows before it (a first window slowed by warm-up would hold the average for tens of windows).
    A window whose figure is more than ``outlier`` times the average (a validation run or a checkpoint between two
    micro-batches) is clipped to that, so one pause does not move ``k``.

    Examples:
        >>> average = StepCostAverage(beta=0.5)
        >>> average.add(4.0, 4, 2.0, 1)  # micro-batches of 1 s, a step of 2 s
        >>> average.add(6.0, 4, 4.0, 1)
        >>> average.value()
        StepCost(micro_batch_seconds=1.3333333333333333, overhead_seconds=3.3333333333333335)
    """

    def __init__(self, beta: float = 0.9, outlier: float = 4.0, settle: int = 5) -> None:
        self.beta, self.outlier, self.settle = beta, outlier, settle
        self._micro: float | None = None
        self._overhead: float | None = None
        self._weights = [0.0, 0.0]  # of each average: 1 - beta ** (its windows)
        self._windows = 0

    def add(self, micro_seconds: float, micro_batches: float, overhead_seconds: float, steps: float) -> None:
        """Add the sums of one window (over ranks): the figures are their means."""
        if micro_batches > 0:
            self._micro = self._mix(self._micro, micro_seconds / micro_batches, 0)
        if steps > 0:
            self._overhead = self._mix(self._overhead, overhead_seconds / steps, 1)
        self._windows += 1

    def _mix(self, average: float | None, value: float, part: int) -> float:
        if self._windows >= self.settle and average is not None and average > 0:
            value = min(value, self.outlier * average)
        kept = self.beta * self._weights[part]
        self._weights[part] = kept + (1.0 - self.beta)
        return (kept * (average or 0.0) + (1.0 - self.beta) * value) / self._weights[part]

    @property
    def windows(self) -> int:
        """The windows added so far."""
        return self._windows

    def value(self) -> StepCost | None:
        """The smoothed cost, or ``None`` before both parts were measured."""
        if self._micro is None or self._overhead is None:
            return None
        return StepCost(self._micro, self._overhead)

    def state_dict(self) -> dict[str, Any]:
        return {"micro": self._micro, "overhead": self._overhead, "windows": self._windows, "weights": self._weights}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._micro, self._overhead = state.get("micro"), state.get("overhead")
        self._windows = int(state.get("windows", 0))
        self._weights = [float(w) for w in state.get("weights", (1.0, 1.0))]  # saved before: settled averages


def allowed_range(
    current: int, minimum: int, maximum: int, max_growth: float | None, allow_decrease: bool
) -> tuple[int, int]:
    """The ``k`` one change may reach from ``current``: in bounds, by ``max_growth`` at most, up unless allowed.

    Examples:
        >>> allowed_range(4, 2, 64, max_growth=2.0, allow_decrease=False), allowed_range(4, 2, 64, None, True)
        ((4, 8), (2, 64))
    """
    low, high = (minimum if allow_decrease else max(minimum, current)), maximum
    if max_growth is not None:
        low = max(low, math.ceil(current / max_growth))
        high = min(high, math.floor(current * max_growth))
    return min(low, current), max(high, current)


class ClampNote:
    """Counts the windows in a row whose target lies outside ``[minimum, maximum]``; after ``windows``, one line.

    Examples:
        >>> note = ClampNote(windows=2)  # it logs the line it returns (on rank 0)
        >>> note.add(1.2, 2, 64), note.add(1.3, 2, 64), note.add(1.3, 2, 64)  # doctest: +ELLIPSIS
        (None, 'target k has stayed below `min_accumulation_steps` (2) for 2 windows (target 1.3); ...', None)
    """

    def __init__(self, windows: int = CLAMP_NOTE_WINDOWS) -> None:
        self.windows = windows
        self.count = 0  # windows in a row with the target out of bounds
        self.said = False  # the line is said once

    def add(self, target: float, minimum: int, maximum: int) -> str | None:
        """Count one window's target; the first time the count reaches ``windows``, log the line and return it."""
        below, above = round(target) < minimum, round(target) > maximum
        self.count = self.count + 1 if below or above else 0
        if self.count < self.windows or self.said:
            return None
        self.said = True
        setting, bound, fix = ("min", minimum, "lower it") if below else ("max", maximum, "raise it")
        line = (
            f"target k has stayed {'below' if below else 'above'} `{setting}_accumulation_steps` ({bound}) for"
            f" {self.count} windows (target {target:.3g}); `{setting}_accumulation_steps` holds k at {bound}: {fix}"
            " to let k follow the target."
        )
        log_info(f"lightning_accum: AdaptiveBatchSize's {line}")
        return line

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count, "said": self.said}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.count, self.said = int(state.get("count", 0)), bool(state.get("said", False))
