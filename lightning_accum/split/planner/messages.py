"""What the micro-batch planner says when shrinking cannot help: the budget out of reach, and OOM at the floor.

Pure: the sentences and the error `lightning_accum.split.planner.MicroBatchPlanner` gives, from its figures.
"""

from __future__ import annotations

from lightning_accum.memory.sizes import format_size, format_sizes
from lightning_accum.split.planner.history import PlannerHistory
from lightning_accum.split.planner.settings import PlannerSettings
from lightning_accum.split.planner.units import PeakModel, Samples, Tokens

FIX_FIXED_MEMORY = (
    " Raise `max_memory`, or lower the fixed memory (a smaller model or optimizer state, a sharded strategy)."
)
"""The fix every budget-out-of-reach message ends with."""


class MicroBatchOOMError(RuntimeError):
    """An out-of-memory error at the smallest micro-batch size allowed: shrinking further cannot fix it.

    Attributes:
        micro_batch_size: the size that ran out of memory.
        step: the optimizer step.
        budget_bytes: the planner's memory budget (``None`` when it has none).
        last_peak_bytes: the last peak measured on a completed step, if any.
        fixed_bytes: the memory model's estimate of memory that doesn't depend on ``b`` (``None`` before a fit).
        per_sample_bytes: the memory model's estimate of memory per sample (``None`` before a fit).
    """

    def __init__(
        self,
        message: str,
        *,
        micro_batch_size: int,
        step: int,
        budget_bytes: float | None,
        last_peak_bytes: float | None,
        fixed_bytes: float | None,
        per_sample_bytes: float | None,
    ) -> None:
        super().__init__(message)
        self.micro_batch_size = micro_batch_size
        self.step = step
        self.budget_bytes = budget_bytes
        self.last_peak_bytes = last_peak_bytes
        self.fixed_bytes = fixed_bytes
        self.per_sample_bytes = per_sample_bytes


def why_not_shrink(
    size: int, peak: float, budget: float, unit: Samples, settings: PlannerSettings, history: PlannerHistory
) -> str | None:
    """Why a peak over the budget is no reason to shrink ``size``, or ``None``: shrink.

    As large a step fitted, and the peak is within the measure's noise of its (the peak moves by more than the
    micro-batch moves it); or the smallest size was said to be
    over the budget already; or the shrinks so far hardly lowered the peak (`out_of_reach`, which may hold the floor).
    """
    fitted = None if settings.pin_micro_batch_size else history.fitted_within_noise(size, unit.length(), peak)
    if fitted is not None:
        return noisy_peak(size, peak, budget, unit, fitted)
    if history.held_at_floor is not None:
        return at_floor(history.held_at_floor, peak, budget, unit)
    why = out_of_reach(size, peak, budget, unit, settings, history.shrink_start)
    if why is not None and size <= unit.floor(settings):
        history.held_at_floor = size
    return why


def out_of_reach(
    size: int,
    peak: float,
    budget: float,
    unit: Samples,
    settings: PlannerSettings,
    shrink_start: tuple[int, float] | None,
) -> str | None:
    """Why shrinking cannot meet the budget: at the smallest size, or after shrinks that hardly lowered the peak.

    ``shrink_start`` is the (size, peak) where the current run of over-budget shrinks began.
    """
    smallest_size = unit.floor(settings)
    if size <= smallest_size:
        return at_floor(size, peak, budget, unit)
    if settings.pin_micro_batch_size or shrink_start is None:
        return None
    start, start_peak = shrink_start
    if 8 * start < 9 * size:
        # Shrinks take an eighth off at least (`_bounded_shrink`): after one, the peak says what the micro-batch
        # costs. Where it hardly moved (the CPU's resident set, mostly the process), shrinking further buys nothing.
        return None
    per_sample = max(0.0, (start_peak - peak) / (start - size))
    smallest = peak - per_sample * (size - smallest_size)
    if smallest <= budget:
        return None
    texts = format_sizes(peak, budget, start_peak, smallest)
    return (
        f"The step's peak memory ({texts[0]}) is over the budget ({texts[1]}), and shrinking the micro-batch does"
        f" not bring it down: from {start} to {size} {unit.counts} the peak went from {texts[2]} to {texts[0]}. At"
        f" that rate even the smallest {unit.noun} ({smallest_size}) would peak at {texts[3]}:"
        " the memory that does not depend on the micro-batch is over the budget by itself. The planner keeps"
        f" {unit.noun} {size} rather than shrink for nothing (an out-of-memory error still shrinks it)."
        + FIX_FIXED_MEMORY
    )


def noisy_peak(size: int, peak: float, budget: float, unit: Samples, fitted: tuple[int, int, float]) -> str:
    """Why the planner holds ``size`` over the budget: a step at least as large, ``fitted``, peaked under it."""
    fitted_size, _, fitted_peak = fitted
    texts = format_sizes(peak, budget, fitted_peak)
    return (
        f"The step's peak memory ({texts[0]}) is over the budget ({texts[1]}) at {unit.noun} {size}, but a step of"
        f" {fitted_size} {unit.counts} at least as long peaked at {texts[2]}: the peak moves from step to step by more"
        f" than the micro-batch moves it (on the CPU the process's resident set: the interpreter, libraries, heap"
        f" pages and loggers). The planner keeps {unit.noun} {size} rather than shrink for nothing (an out-of-memory"
        " error still shrinks it). Leave more room between `max_memory` and what the process holds at rest, or"
        " accept peaks this close to the budget."
    )


def at_floor(size: int, peak: float, budget: float, unit: Samples) -> str:
    """Why shrinking cannot meet the budget at the smallest size, ``size`` (the planner then holds it)."""
    peak_text, budget_text = format_sizes(peak, budget)
    return (
        f"The step's peak memory ({peak_text}) is over the budget ({budget_text}) even at the smallest"
        f" {unit.noun} ({size}): most of the memory does not depend on the micro-batch, so shrinking cannot meet"
        f" the budget. The planner keeps {unit.noun} {size} {unit.counts} (an out-of-memory error still shrinks it)."
        + FIX_FIXED_MEMORY
    )


def out_of_memory_error(
    size: int,
    step: int,
    unit: Samples,
    settings: PlannerSettings,
    budget: float | None,
    last: tuple[float | None, int | None],
    model: PeakModel,
) -> MicroBatchOOMError:
    """The error for an OOM at ``min_size``, with every figure the planner has; ``last`` is the last (peak, size)."""
    last_peak, last_size = last
    figures = [f"budget {format_size(budget)}" if budget is not None else "no budget set"]
    if last_peak is not None:
        figures.append(f"last measured peak {format_size(last_peak)} at size {last_size}")
    if model.fitted():
        figures.append(
            f"memory model: {format_size(model.fixed_bytes or 0.0)} fixed"
            f" + {format_size(model.per_sample_bytes or 0.0)} per {unit.counts[:-1]}"
        )
    if isinstance(unit, Tokens):
        floor = (
            f"the step's longest sequence has {unit.floor(settings)} tokens and runs in a micro-batch of its own, so"
            " shrinking the token budget cannot help it"
        )
        fix = " or shorter sequences (`max_length` when tokenizing)."
    else:
        floor = f"`min_micro_batch_size` is {settings.min_micro_batch_size}, so the planner cannot shrink further"
        fix = " or `min_micro_batch_size`."
    return MicroBatchOOMError(
        f"Out of memory at {unit.noun} {size} at step {step}, and {floor} ({'; '.join(figures)}). Lower the"
        f" memory per {unit.counts[:-1]} (mixed precision, activation checkpointing), the fixed memory (a sharded"
        " strategy, a smaller optimizer state)," + fix,
        micro_batch_size=size,
        step=step,
        budget_bytes=budget,
        last_peak_bytes=last_peak,
        fixed_bytes=model.fixed_bytes,
        per_sample_bytes=model.per_sample_bytes,
    )
