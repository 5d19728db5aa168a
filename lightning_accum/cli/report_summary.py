"""The text summary of a run's report: one paragraph on what it did, from its logged series. Pure."""

from __future__ import annotations

import math

from lightning_accum import keys
from lightning_accum.integrations.wandb import (
    layout_keys,
)
from lightning_accum.monitor.rows import BUDGET_FRACTION

Series = dict[str, list[tuple[float, float]]]
"""key -> ``(step, value)`` points, in logging order."""


def memory_budgets(series: Series) -> list[float]:
    """The memory budget's fractions of the device, where one was set (1 and above: none)."""
    return [v for _, v in series.get(BUDGET_FRACTION, []) if v < 1]


def summarize(series: Series) -> str:
    """One paragraph on the run, for people and for logs.

    It says: the steps, the effective batch, the micro-batch range and where it settled (split by tokens: the token
    budget's, and the padding), how unequal the ranks were (split on several ranks), the OOMs recovered and at which
    steps, the peak memory against the budget, and the throughput.
    """
    parts = (
        _steps_text(series),
        _batch_text(series),
        _tokens_text(series),
        _balance_text(series),
        _oom_text(series),
        _memory_text(series),
        _speed_text(series),
    )
    return " ".join(part for part in parts if part)


def finite_values(series: Series, key: str) -> list[float]:
    """The finite values of ``key`` in ``series``, in logging order."""
    return [v for _, v in series.get(key, []) if math.isfinite(v)]


def _int(value: float) -> str:
    return f"{value:,.0f}" if float(value).is_integer() else f"{value:,.1f}"


def _plural(word: str, count: float) -> str:
    """``word``, with an ``s`` unless ``count`` is 1."""
    return word if count == 1 else f"{word}s"


def _steps_text(series: Series) -> str:
    steps = sorted({s for key in layout_keys() for s, _ in series.get(key, [])})
    if not steps:
        return "No lightning_accum metrics were logged."
    first, last = steps[0], steps[-1]
    logged = "" if len(steps) == last - first + 1 else f", logged at {len(steps)} of them"
    return f"{_int(last - first + 1)} optimizer steps (steps {_int(first)} to {_int(last)}{logged})."


def _batch_text(series: Series) -> str:
    texts = []
    effective = _changes(series.get(keys.EFFECTIVE_BATCH_SIZE, []))
    if len(effective) == 1:
        texts.append(f"Effective batch {_int(effective[0][1])} samples per step throughout")
    elif 1 < len(effective) <= 4:
        later = ", ".join(f"{_int(v)} from step {_int(s)}" for s, v in effective[1:])
        texts.append(f"Effective batch {_int(effective[0][1])} samples per step, {later}")
    elif effective:
        values = finite_values(series, keys.EFFECTIVE_BATCH_SIZE)
        texts.append(f"Effective batch {_int(min(values))} to {_int(max(values))} samples per step")
    micro = _changes(series.get(keys.MICRO_BATCH_SIZE, []))
    if micro and splits_by_tokens(series):  # the samples a micro-batch holds follow the lengths: they never settle
        values = finite_values(series, keys.MICRO_BATCH_SIZE)
        low, high = _int(min(values)), _int(max(values))
        texts.append(f"the largest micro-batch {low if low == high else f'{low} to {high}'} samples")
    elif micro:
        texts.append(_settled_text(series, keys.MICRO_BATCH_SIZE, "micro-batch", "samples"))
    k = finite_values(series, keys.ACCUMULATION_STEPS)
    if k:
        texts.append(f"k = {_int(k[-1])} at the end{_ranks(series)}")
    return "; ".join(texts) + "." if texts else ""


def _settled_text(series: Series, key: str, what: str, unit: str) -> str:
    """``what N unit throughout``, or ``what low to high unit, settled at N from step s``: a size over the run."""
    changes = _changes(series.get(key, []))
    if len(changes) == 1:
        return f"{what} {_int(changes[0][1])} {unit} throughout"
    values = finite_values(series, key)
    since, last = changes[-1]
    return f"{what} {_int(min(values))} to {_int(max(values))} {unit}, settled at {_int(last)} from step {_int(since)}"


def _changes(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    # The first point and every point whose value differs from the one before: where a quantity moved.
    return [p for i, p in enumerate(points) if i == 0 or p[1] != points[i - 1][1]]


def splits_by_tokens(series: Series) -> bool:
    """Whether the run split by tokens (it logged a token budget)."""
    return bool(series.get(keys.MICRO_BATCH_TOKENS))


def _tokens_text(series: Series) -> str:
    # Split by tokens: the token budget (and where it settled, if it moved) and the padding computed.
    budgets = _changes(series.get(keys.MICRO_BATCH_TOKENS, []))
    if not budgets:
        return ""
    text = _settled_text(series, keys.MICRO_BATCH_TOKENS, "Token budget", "padded tokens per micro-batch")
    padding = finite_values(series, keys.PADDING_FRACTION)
    if padding:
        text += f"; padding {_median(padding):.1%} of the token positions computed (median of the logged steps)"
    return text + "."


def _balance_text(series: Series) -> str:
    # Split on several ranks: how far the slowest rank's step was over the mean rank's, and the waits at the sync.
    imbalance = finite_values(series, keys.RANK_IMBALANCE)
    if not imbalance:
        return ""
    waits = finite_values(series, keys.SYNC_WAIT_SECONDS)
    text = f"Slowest rank's step {_median(imbalance):.2f}x the mean rank's (median of the logged steps"
    text += f", worst {max(imbalance):.2f}x)"
    if waits:
        text += f"; the longest wait at the sync {_median(waits) * 1000:.0f} ms a step (median)"
    return text + "."


def _ranks(series: Series) -> str:
    # The world size the last step implies (effective = micro-batch x k x ranks); said only when it is over 1. Not
    # by tokens: micro-batches then hold different numbers of samples, and ranks run different numbers of them.
    if splits_by_tokens(series):
        return ""
    last = [
        finite_values(series, key)[-1:]
        for key in (keys.EFFECTIVE_BATCH_SIZE, keys.MICRO_BATCH_SIZE, keys.ACCUMULATION_STEPS)
    ]
    if not all(last):
        return ""
    ranks = last[0][0] / (last[1][0] * last[2][0])
    return f" on {ranks:.0f} ranks" if ranks > 1 and ranks.is_integer() else ""


def _oom_text(series: Series) -> str:
    retries = finite_values(series, keys.OOM_RETRIES)
    steps = [s for s, _ in series.get(keys.EVENT_OOM_RECOVERED, [])]
    count = int(retries[-1]) if retries else len(steps)
    if not count and not steps:
        return "No OOMs." if retries else ""
    text = f"{count} {_plural('OOM', count)} recovered"
    if steps:
        text += f" (at {_plural('step', len(steps))} {', '.join(_int(s) for s in steps)})"
    return text + "."


def _memory_text(series: Series) -> str:
    peaks, fractions = finite_values(series, keys.PEAK_GIB), finite_values(series, keys.PEAK_FRACTION)
    if not peaks:
        return ""
    capacity = finite_values(series, keys.CAPACITY_GIB)
    of = f" ({max(fractions):.1%} of {capacity[-1]:.3g} GiB)" if fractions and capacity else ""
    text = f"Peak memory {size_text(max(peaks))}{of}"
    budgets = memory_budgets(series)
    if not budgets:
        return text + ", with no memory budget set."
    budget_at = dict(series.get(BUDGET_FRACTION, []))
    over = sum(1 for s, f in series.get(keys.PEAK_FRACTION, []) if f > budget_at.get(s, math.inf))
    where = f", over it at {over} logged {_plural('step', over)}" if over else ", within it"
    # In a size, as `max_memory` takes one, where the capacity says what the logged fraction is of.
    budget = f"{budgets[-1]:.1%} of the capacity"
    if capacity:
        budget = f"{size_text(budgets[-1] * capacity[-1])} ({budget})"
    return f"{text} against a budget of {budget}{where}."


def size_text(gib: float) -> str:
    """A size in GiB as a person reads it: in MiB below 1 GiB.

    Examples:
        >>> size_text(0.4883), size_text(23.54)
        ('500 MiB', '23.5 GiB')
    """
    return f"{gib * 1024:.3g} MiB" if gib < 1 else f"{gib:.3g} GiB"


def _speed_text(series: Series) -> str:
    samples, items = finite_values(series, keys.SAMPLES_PER_SEC), finite_values(series, keys.ITEMS_PER_SEC)
    if not samples:
        return ""
    text = f"Throughput {_median(samples):,.0f} samples/s (median of the logged intervals"
    if items and items != samples:
        text += f"; {_median(items):,.0f} items/s"
    # The end-of-fit line's figure is another one: every sample over the whole training time, first steps included.
    return text + "; the end-of-fit summary's samples/s is the whole fit's average, start-up included)."


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
