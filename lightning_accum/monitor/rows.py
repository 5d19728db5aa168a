"""The metric row the monitor logs at a step: units, rates and the contract keys of `lightning_accum.keys`. Pure.

The callback gathers raw counts (samples, items, bytes, seconds) and these functions turn them into the contract
keys, so every figure can be checked by hand.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from lightning_accum import keys
from lightning_accum.core.step_report import AccumulationEvent, EventKind, StepReport
from lightning_accum.memory.budget import GIB

BUDGET_FRACTION = keys.BUDGET_FRACTION  # (kept here too: older imports name it from this module)

EVENT_KEY_BY_KIND: dict[EventKind, str] = {
    "schedule_change": keys.EVENT_SCHEDULE_CHANGE,
    "oom_recovered": keys.EVENT_OOM_RECOVERED,
    "shrink": keys.EVENT_SHRINK,
    "grow": keys.EVENT_GROW,
}
"""Which metric key records an `lightning_accum.core.step_report.AccumulationEvent` of each kind."""


def to_gib(n_bytes: float) -> float:
    """Bytes to GiB (`lightning_accum.memory.budget.GIB` bytes).

    Examples:
        >>> to_gib(3 * GIB)
        3.0
    """
    return float(n_bytes) / GIB


def peak_fraction(peak_bytes: float, capacity_bytes: float) -> float:
    """The peak as a fraction of the device's capacity; ``nan`` when the capacity is unknown (0).

    Examples:
        >>> peak_fraction(2 * GIB, 8 * GIB)
        0.25
    """
    if capacity_bytes <= 0:
        return math.nan
    return float(peak_bytes) / float(capacity_bytes)


def rate(count: float, seconds: float) -> float:
    """``count`` per second over an interval of ``seconds``; ``nan`` for an empty interval (nothing to divide by).

    Examples:
        >>> rate(96, 0.5)
        192.0
    """
    if seconds <= 0:
        return math.nan
    return float(count) / seconds


@dataclass(frozen=True)
class StepFigures:
    """Everything logged at one logging step, already global (summed or maxed over ranks).

    Attributes:
        effective_batch_size: samples in the last optimizer step, all ranks.
        micro_batch_size: samples per micro-batch on one rank.
        accumulation_steps: micro-batches per optimizer step on one rank.
        items_per_step: items (samples or tokens) in the last optimizer step, all ranks.
        oom_retries: OOMs recovered from since the start of training.
        window_loss: item-weighted mean loss over the logged windows, all ranks; ``None`` when unknown.
        peak_bytes: the largest peak of any rank within the logging interval.
        capacity_bytes: device capacity (of the rank that had the largest capacity).
        peak_reserved_bytes: the largest reserved peak of any rank (CUDA), or ``None``.
        budget_fraction: the memory budget as a fraction of capacity (1.0 when no budget was set).
        interval_samples: samples consumed in the logging interval, all ranks.
        interval_items: items consumed in the logging interval, all ranks.
        interval_seconds: wall time of the logging interval, validation excluded.
    """

    effective_batch_size: int
    micro_batch_size: int
    accumulation_steps: int
    items_per_step: float
    oom_retries: int
    window_loss: float | None
    peak_bytes: int
    capacity_bytes: int
    peak_reserved_bytes: int | None
    budget_fraction: float
    interval_samples: float
    interval_items: float
    interval_seconds: float

    def as_metrics(self) -> dict[str, float]:
        """The contract keys and their values.

        Examples:
            >>> figures = StepFigures(
            ...     effective_batch_size=32, micro_batch_size=4, accumulation_steps=4, items_per_step=32.0,
            ...     oom_retries=0, window_loss=0.5, peak_bytes=2 * GIB, capacity_bytes=8 * GIB,
            ...     peak_reserved_bytes=None,
            ...     budget_fraction=1.0, interval_samples=64, interval_items=64, interval_seconds=2.0,
            ... )
            >>> metrics = figures.as_metrics()
            >>> metrics["accum/effective_batch_size"], metrics["memory/peak_fraction"], metrics["perf/samples_per_sec"]
            (32.0, 0.25, 32.0)
            >>> "memory/peak_reserved_gib" in metrics  # CPU: no reserved pool
            False
        """
        metrics: dict[str, float] = {
            keys.EFFECTIVE_BATCH_SIZE: float(self.effective_batch_size),
            keys.MICRO_BATCH_SIZE: float(self.micro_batch_size),
            keys.ACCUMULATION_STEPS: float(self.accumulation_steps),
            keys.ITEMS_PER_STEP: float(self.items_per_step),
            keys.OOM_RETRIES: float(self.oom_retries),
            keys.PEAK_GIB: to_gib(self.peak_bytes),
            keys.CAPACITY_GIB: to_gib(self.capacity_bytes),
            keys.PEAK_FRACTION: peak_fraction(self.peak_bytes, self.capacity_bytes),
            BUDGET_FRACTION: float(self.budget_fraction),
            keys.SAMPLES_PER_SEC: rate(self.interval_samples, self.interval_seconds),
            keys.ITEMS_PER_SEC: rate(self.interval_items, self.interval_seconds),
        }
        if self.window_loss is not None:
            metrics[keys.WINDOW_LOSS] = float(self.window_loss)
        if self.peak_reserved_bytes is not None:
            metrics[keys.PEAK_RESERVED_GIB] = to_gib(self.peak_reserved_bytes)
        return metrics


def event_metrics(events: Iterable[AccumulationEvent]) -> dict[str, float]:
    """One metric per kind of event: the size after the change (the last one wins when a kind happened twice).

    Examples:
        >>> event_metrics([AccumulationEvent("shrink", step=3, before=16, after=8)])
        {'events/micro_batch_shrunk': 8.0}
    """
    return {EVENT_KEY_BY_KIND[event.kind]: float(event.after) for event in events}


STEP_KEYS = (*keys.BATCH_KEYS, keys.OOM_RETRIES)
"""The figures of one step's own `lightning_accum.core.step_report.StepReport`."""

LOGGED_KEYS = frozenset(
    (
        *keys.ALL_KEYS,
        *keys.NOISE_SCALE_KEYS,
        *keys.EVENT_KEYS,
        *keys.TOKEN_KEYS,
        *keys.RANK_KEYS,
        *keys.PRICE_KEYS,
        *keys.SCHEDULE_KEYS,
        *keys.GOODPUT_KEYS,
    )
)
"""Every key `lightning_accum.AccumulationMonitor` logs (besides ``memory/rank{r}/peak_gib``)."""


def every_step_keys(*, has_owner: bool, world_size: int, noise_scale: bool, tokens: bool = False) -> tuple[str, ...]:
    """The keys the monitor puts into ``trainer.callback_metrics`` at every optimizer step, not only at logging steps.

    Those it knows without a collective or a device sync: the step's batch figures where they are global already (an
    accumulation owner sums them over ranks; plain Lightning counts this rank's batches), the window loss so far on
    one process (under DDP each rank holds its own sum until a logging step adds them up), the noise-scale average
    (averaged over ranks where measured) and, where the owner splits by ``tokens``, the token budget and the padding
    (agreed over ranks in the owner's own step). Memory, throughput and events are figures of a logging interval.

    Examples:
        >>> every_step_keys(has_owner=True, world_size=2, noise_scale=False) == STEP_KEYS
        True
    """
    wanted: tuple[str, ...] = STEP_KEYS if has_owner or world_size == 1 else ()
    if world_size == 1:
        wanted += (keys.WINDOW_LOSS,)
    if noise_scale and has_owner:
        wanted += keys.NOISE_SCALE_KEYS
    if tokens and has_owner:
        wanted += keys.TOKEN_KEYS
    return wanted


def step_metrics(report: StepReport) -> dict[str, float]:
    """The batch figures of one step, as `StepFigures.as_metrics` logs them (and `token_metrics`, by tokens).

    Examples:
        >>> step_metrics(StepReport("window", 4, 2, 8, 8.0, 8))["accum/effective_batch_size"]
        8.0
    """
    return {
        keys.EFFECTIVE_BATCH_SIZE: float(report.effective_batch_size),
        keys.MICRO_BATCH_SIZE: float(report.micro_batch_size),
        keys.ACCUMULATION_STEPS: float(report.accumulation_steps),
        keys.ITEMS_PER_STEP: float(report.items),
        keys.OOM_RETRIES: float(report.oom_retries),
        **token_metrics(report),
    }


def token_metrics(report: StepReport) -> dict[str, float]:
    """The token budget and the padding of a step split by tokens; nothing for a step split by samples.

    Both come in the report, agreed over ranks by the owner: reading them costs no collective and no device sync.

    Examples:
        >>> token_metrics(StepReport("split", 6, 3, 16, 180.0, 16, micro_batch_tokens=96, padding_fraction=0.25))
        {'accum/micro_batch_tokens': 96.0, 'accum/padding_fraction': 0.25}
        >>> token_metrics(StepReport("split", 4, 2, 8, 8.0, 8))
        {}
    """
    if report.micro_batch_tokens is None:
        return {}
    metrics = {keys.MICRO_BATCH_TOKENS: float(report.micro_batch_tokens)}
    if report.padding_fraction is not None:
        metrics[keys.PADDING_FRACTION] = float(report.padding_fraction)
    return metrics


def rank_metrics(report: StepReport) -> dict[str, float]:
    """How unequal the ranks' steps were (split mode, more than one rank); nothing otherwise.

    Agreed over ranks in the owner's own step: reading them costs no collective. Logging steps log the last step's.

    Examples:
        >>> rank_metrics(StepReport("split", 6, 3, 16, 180.0, 16, rank_imbalance=1.25, sync_wait_seconds=0.5))
        {'accum/rank_imbalance': 1.25, 'perf/sync_wait_seconds': 0.5}
        >>> rank_metrics(StepReport("split", 4, 2, 8, 8.0, 8))
        {}
        >>> dealt = StepReport("split", 4, 2, 8, 8.0, 8, rank_imbalance=1.0, sync_wait_seconds=0.0, price_error=1.1)
        >>> rank_metrics(dealt)
        {'accum/rank_imbalance': 1.0, 'perf/sync_wait_seconds': 0.0, 'accum/price_error': 1.1}
    """
    if report.rank_imbalance is None or report.sync_wait_seconds is None:
        return {}
    metrics = {
        keys.RANK_IMBALANCE: float(report.rank_imbalance),
        keys.SYNC_WAIT_SECONDS: float(report.sync_wait_seconds),
    }
    if report.price_error is not None:  # a balanced sampler deals the ranks
        metrics[keys.PRICE_ERROR] = float(report.price_error)
    return metrics


def schedule_metrics(report: StepReport) -> dict[str, float]:
    """How far training has come and what the schedule aims at (`lightning_accum.keys.SCHEDULE_KEYS`, `GOODPUT_KEYS`).

    The counts come from an accumulation owner (summed over ranks); a step counted by the monitor alone (plain
    ``accumulate_grad_batches``, ``mode="lightning"``) has this rank's only, and logs none of them.

    Examples:
        >>> report = StepReport("window", 4, 2, 8, 8.0, 64, consumed_items=640.0, target_accumulation_steps=3.5)
        >>> schedule_metrics(report)
        {'accum/samples_seen': 64.0, 'accum/items_seen': 640.0, 'accum/target_accumulation_steps': 3.5}
        >>> schedule_metrics(StepReport("lightning", 4, 2, 8, 8.0, 64))
        {}
    """
    if report.mode == "lightning":
        return {}
    metrics = {keys.SAMPLES_SEEN: float(report.consumed_samples), keys.ITEMS_SEEN: float(report.consumed_items)}
    optional = (
        (keys.TARGET_ACCUMULATION_STEPS, report.target_accumulation_steps),
        (keys.STATISTICAL_EFFICIENCY, report.statistical_efficiency),
        (keys.STEP_OVERHEAD_SECONDS, report.step_overhead_seconds),
    )
    metrics.update({key: float(value) for key, value in optional if value is not None})
    return metrics
