"""The arithmetic behind `lightning_accum.AccumulationMonitor`: unit conversion, rates, the metric row and the totals.

Pure: no Trainer, no logger. The callback gathers raw counts (samples, items, bytes, seconds) and this
module turns them into the contract keys of `lightning_accum.keys`, so every figure can be checked by hand. It also
keeps what the monitor adds up between logging steps and over a fit (`IntervalTotals`, `LightningWindows`,
`FitSummary`, `TrainingClock`, `RankMemory`); `lightning_accum.monitor.metrics` builds what is logged from them.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric

from lightning_accum import keys
from lightning_accum.core.step_report import AccumulationEvent, EventKind, LossSum, StepReport
from lightning_accum.memory.backends import MemoryBackend
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

LOGGED_KEYS = frozenset((*keys.ALL_KEYS, *keys.NOISE_SCALE_KEYS, *keys.EVENT_KEYS, *keys.TOKEN_KEYS))
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


def mean_loss(loss: LossSum) -> Tensor | float:
    """The item-weighted mean of ``loss``, as a tensor on its device (no host read); ``nan`` without items.

    Examples:
        >>> mean_loss(LossSum())
        nan
        >>> total = LossSum()
        >>> total.add(torch.tensor(2.0), n_items=3, loss_reduction="mean")
        >>> mean_loss(total)
        tensor(2.)
    """
    total, items = loss.total, loss.items
    if isinstance(total, Tensor) or isinstance(items, Tensor):
        return total / items  # a tensor, and 0/0 is nan
    return total / items if items > 0 else math.nan


class WeightedMean(Metric):
    """The weighted mean of the values seen since the last reset, summed across processes by torchmetrics.

    ``update`` never reads a value back to the host (no NaN check), so it costs no device synchronization. It
    exists because ``torchmetrics.aggregation.MeanMetric(nan_strategy="disable")`` drops the weights (torchmetrics
    1.9 replaces them by ones when the NaN check is disabled), and the check itself would synchronize.

    Examples:
        >>> mean = WeightedMean()
        >>> mean.update(torch.tensor(1.0), torch.tensor(4.0))
        >>> mean.update(torch.tensor(4.0), torch.tensor(2.0))
        >>> mean.compute()
        tensor(2.)
    """

    full_state_update = False
    total: Tensor
    weight: Tensor

    def __init__(self) -> None:
        super().__init__()
        self.add_state("total", default=torch.tensor(0.0), dist_reduce_fx="sum")
        self.add_state("weight", default=torch.tensor(0.0), dist_reduce_fx="sum")

    def update(self, value: Tensor, weight: Tensor) -> None:
        """Add ``value`` with ``weight`` (both scalars, on the metric's device)."""
        self.total += value * weight
        self.weight += weight

    def compute(self) -> Tensor:
        """The weighted mean; ``nan`` when nothing with a positive weight was seen."""
        return self.total / self.weight


def window_loss(mean: WeightedMean, loss: LossSum) -> float:
    """The item-weighted mean of ``loss`` over all ranks (``nan`` when no rank saw a loss); resets ``mean``.

    Every rank must call it, also with nothing, so that ``compute()`` syncs the same way on all of them. It reads the
    result back to the host, so it also waits for the device.

    Examples:
        >>> total = LossSum()
        >>> total.add(torch.tensor(2.0), n_items=3, loss_reduction="mean")
        >>> window_loss(WeightedMean(), total)
        2.0
    """
    device = mean.device
    weight = torch.as_tensor(loss.items, dtype=torch.float32, device=device)
    total = torch.as_tensor(loss.total, dtype=torch.float32).to(device)
    mean.update(torch.where(weight > 0, total / weight.clamp(min=1e-30), torch.zeros_like(total)), weight)
    value = float(mean.compute())
    mean.reset()
    return value


class IntervalTotals:
    """What the steps of one logging interval add up to, from their `lightning_accum.core.step_report.StepReport`.

    Examples:
        >>> totals = IntervalTotals()
        >>> for loss in (2.0, 4.0):
        ...     totals.add(StepReport("window", 4, 2, 8, 8.0, 8, loss_sum=torch.tensor(loss * 8), loss_items=8))
        >>> totals.samples, totals.steps, float(totals.loss.total) / totals.loss.items
        (16, 2, 3.0)
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Start a new interval."""
        self.samples = 0
        self.items = 0.0
        self.steps = 0
        self.loss = LossSum()
        self.events: list[AccumulationEvent] = []
        self.peak_bytes = 0  # the largest peak an owner measured in the interval (split mode), all ranks
        self.last: StepReport | None = None

    def add(self, report: StepReport) -> None:
        """Count one optimizer step."""
        self.samples += report.effective_batch_size
        self.items += report.items
        self.steps += 1
        if report.loss_sum is not None and report.loss_items is not None:
            self.loss.total = self.loss.total + report.loss_sum
            self.loss.items = self.loss.items + report.loss_items
        self.events.extend(report.events)
        if report.peak_bytes is not None:
            self.peak_bytes = max(self.peak_bytes, report.peak_bytes)
        self.last = report


class LightningWindows:
    """Builds the step reports no owner publishes: plain ``Trainer(accumulate_grad_batches=k)``, counted from batches.

    Items are samples (there is no item counter), and the loss is Lightning's mean over each micro-batch.

    Examples:
        >>> windows = LightningWindows()
        >>> windows.add_micro_batch(4, torch.tensor(1.0))
        >>> windows.add_micro_batch(2, torch.tensor(4.0))
        >>> report = windows.finish()
        >>> report.effective_batch_size, report.accumulation_steps, float(report.loss_sum) / report.loss_items
        (6, 2, 2.0)
    """

    def __init__(self, global_step: int = 0) -> None:
        self.consumed_samples = 0
        self._global_step = global_step  # the Trainer's, when the last window stepped
        self._start()

    def _start(self) -> None:
        self._samples = 0
        self._micro_batches = 0
        self._first_size = 0
        self._loss = LossSum()

    def add_micro_batch(self, n_samples: int, mean_loss: Tensor | None) -> None:
        """Count a micro-batch of ``n_samples`` whose ``training_step`` returned ``mean_loss`` (``None``: skipped)."""
        if self._micro_batches == 0:
            self._first_size = n_samples
        self._samples += n_samples
        self._micro_batches += 1
        if mean_loss is not None:
            self._loss.add(mean_loss, n_samples, "mean")

    def step_report(self, n_samples: int, outputs: Any, loss_divisor: float, global_step: int) -> StepReport | None:
        """Count a micro-batch; the window's report if the Trainer's ``global_step`` moved on, else ``None``.

        Args:
            n_samples: the micro-batch's samples.
            outputs: what ``training_step`` returned: the loss, a dict with a ``"loss"``, or ``None`` (skipped).
            loss_divisor: what Lightning divided that loss by (``accumulate_grad_batches``), multiplied back.
            global_step: the Trainer's optimizer steps so far.

        Examples:
            >>> windows = LightningWindows(global_step=0)
            >>> windows.step_report(4, {"loss": torch.tensor(0.5)}, 2, global_step=0) is None  # inside the window
            True
            >>> report = windows.step_report(4, torch.tensor(1.5), 2, global_step=1)
            >>> report.effective_batch_size, float(report.loss_sum) / report.loss_items
            (8, 2.0)
        """
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        self.add_micro_batch(n_samples, loss.detach() * loss_divisor if isinstance(loss, Tensor) else None)
        if global_step == self._global_step:
            return None
        self._global_step = global_step
        return self.finish()

    def finish(self) -> StepReport:
        """The report of the window that just stepped, starting the next; its counts are this rank's only.

        Nothing is summed over ranks here, at every step: `globalize` does it once per logging step.
        """
        samples = self._samples
        self.consumed_samples += samples
        report = StepReport(
            mode="lightning",
            micro_batch_size=self._first_size,
            accumulation_steps=self._micro_batches,
            effective_batch_size=samples,
            items=float(samples),
            consumed_samples=self.consumed_samples,
            loss_sum=self._loss.total,
            loss_items=self._loss.items,
        )
        self._start()
        return report

    @staticmethod
    def globalize(
        interval: IntervalTotals, sum_across_ranks: Callable[[Tensor], Tensor] | None
    ) -> tuple[StepReport, float]:
        """The interval's last report and sample count summed over ranks (one small all-reduce under DDP)."""
        last = interval.last
        assert last is not None
        local = torch.tensor([float(last.effective_batch_size), float(interval.samples)], dtype=torch.float64)
        step_samples, interval_samples = (sum_across_ranks(local) if sum_across_ranks is not None else local).tolist()
        report = dataclasses.replace(last, effective_batch_size=int(step_samples), items=step_samples)
        return report, interval_samples


class FitSummary:
    """What a whole ``fit`` did, for the short summary printed (and logged) at its end.

    Examples:
        >>> summary = FitSummary()
        >>> for step, size in enumerate([8, 8, 4, 4]):
        ...     events = (AccumulationEvent("oom_recovered", step, 8, 4),) if step == 2 else ()
        ...     summary.add(StepReport("split", size, 16 // size, 16, 16.0, 16 * (step + 1), events=events))
        >>> summary.seconds = 2.0
        >>> for part in summary.text().split("; "):
        ...     print(part)
        lightning_accum: 4 optimizer steps, effective batch 16 samples
        micro-batch 4 to 8, settled at 4 from step 2
        1 OOM recovered (step 2)
        32 samples/s.

    Split by tokens, the micro-batch is its token budget (the samples it holds follow the sequences' lengths), and the
    padding is the mean over steps of each step's share of positions computed that held no real token.
    """

    def __init__(self, first_step: int = 0) -> None:
        self.first_step = first_step  # the run's step this fit started at (a resumed fit goes on counting)
        self.steps = 0
        self.effective_batch_sizes: set[int] = set()
        self.micro_batch_range: tuple[int, int] | None = None
        self.settled: tuple[int, int] | None = None  # (size, since step)
        self.token_range: tuple[int, int] | None = None  # split by tokens: the budget's
        self.token_settled: tuple[int, int] | None = None  # (budget, since step)
        self.padding: list[float] = []  # split by tokens: each step's padding fraction
        self.oom_steps: list[int] = []
        self.samples = 0
        self._step_samples: list[int] = []  # each step's effective batch size
        self.event_counts: dict[str, int] = {}  # events of the run by metric key
        self.seconds = 0.0
        self.peak_fraction: float | None = None  # the highest peak, as a fraction of `memory_limit`
        self.memory_limit = "budget"  # or "capacity", where no budget is set

    def add_peak(self, fraction: float, memory_limit: str) -> None:
        """A peak (of a logging interval, or of the steps after the last one) as a fraction of the budget or capacity.

        ``memory_limit`` says which: ``"budget"`` or ``"capacity"``.
        """
        self.peak_fraction = fraction if self.peak_fraction is None else max(self.peak_fraction, fraction)
        self.memory_limit = memory_limit

    def add_peak_bytes(self, peak_bytes: int, budget_bytes: float | None, capacity_bytes: int) -> float | None:
        """Count a peak against the budget (the capacity without one); returns that fraction, ``None`` if unknown.

        Examples:
            >>> summary = FitSummary()
            >>> summary.add_peak_bytes(3 * GIB, None, 4 * GIB), summary.memory_limit
            (0.75, 'capacity')
            >>> summary.add_peak_bytes(1, None, 0) is None  # no capacity known: nothing to divide by
            True
        """
        limit = budget_bytes if budget_bytes is not None else capacity_bytes
        if limit <= 0:
            return None
        fraction = peak_bytes / limit
        self.add_peak(fraction, "budget" if budget_bytes is not None else "capacity")
        return fraction

    def add(self, report: StepReport, step: int | None = None) -> None:
        """Count one optimizer step: ``step`` on the run's axis (by default, the next one after `first_step`)."""
        step = self.first_step + self.steps if step is None else step
        self.micro_batch_range, self.settled = _track(
            self.micro_batch_range, self.settled, report.micro_batch_size, step
        )
        if report.micro_batch_tokens is not None:
            self.token_range, self.token_settled = _track(
                self.token_range, self.token_settled, report.micro_batch_tokens, step
            )
            if report.padding_fraction is not None:
                self.padding.append(report.padding_fraction)
        self.effective_batch_sizes.add(report.effective_batch_size)
        self.oom_steps.extend(e.step for e in report.events if e.kind == "oom_recovered")
        for event in report.events:
            key = EVENT_KEY_BY_KIND[event.kind]
            self.event_counts[key] = self.event_counts.get(key, 0) + 1
        self.samples += report.effective_batch_size
        self._step_samples.append(report.effective_batch_size)
        self.steps += 1

    def sum_over_ranks(self, sum_across_ranks: Callable[[Tensor], Tensor]) -> None:
        """Make counts taken from this rank's batches only (plain Lightning under DDP) global: one all-reduce.

        Every rank must call it, with the same number of steps (ranks step together).
        """
        total = sum_across_ranks(torch.tensor(self._step_samples, dtype=torch.int64)).tolist()
        self._step_samples = [int(n) for n in total]
        self.effective_batch_sizes = set(self._step_samples)
        self.samples = sum(self._step_samples)

    def as_dict(self) -> dict[str, float]:
        """The numbers, for a logger."""
        figures: dict[str, float] = {"steps": self.steps, "samples": self.samples, "oom_recovered": len(self.oom_steps)}
        if self.token_settled is not None:
            figures["micro_batch_tokens_settled"] = self.token_settled[0]
        elif self.settled is not None:
            figures["micro_batch_size_settled"] = self.settled[0]
        if self.padding:
            figures["padding_fraction_mean"] = sum(self.padding) / len(self.padding)
        if self.seconds > 0:
            figures["samples_per_sec"] = self.samples / self.seconds
        if self.peak_fraction is not None:
            figures[f"peak_fraction_of_{self.memory_limit}"] = self.peak_fraction
        return figures

    def text(self) -> str:
        """One line a person reads at the end of ``fit``."""
        sizes = sorted(self.effective_batch_sizes)
        batch = f"{sizes[0]}" if len(sizes) == 1 else f"{sizes[0]} to {sizes[-1]}" if sizes else "?"
        resumed = f" (from step {self.first_step})" if self.first_step > 0 else ""
        parts = [f"lightning_accum: {self.steps} optimizer steps{resumed}, effective batch {batch} samples"]
        if self.token_range is not None and self.token_settled is not None:
            parts.extend(self._token_text())
        elif self.micro_batch_range is not None and self.settled is not None:
            low, high = self.micro_batch_range
            span = f"micro-batch {low}" if low == high else f"micro-batch {low} to {high}"
            parts.append(f"{span}, settled at {self.settled[0]} from step {self.settled[1]}")
        if self.oom_steps:
            plural = "s" if len(self.oom_steps) > 1 else ""
            steps = ", ".join(str(s) for s in self.oom_steps)
            parts.append(f"{len(self.oom_steps)} OOM{plural} recovered (step{plural} {steps})")
        if self.peak_fraction is not None:
            parts.append(f"peak memory {self.peak_fraction:.0%} of the {self.memory_limit}")
        if self.seconds > 0:
            parts.append(f"{self.samples / self.seconds:,.0f} samples/s")
        return "; ".join(parts) + "."

    def _token_text(self) -> list[str]:
        # The budget, where it settled if it moved, and the samples its micro-batches held; then the padding.
        assert self.token_range is not None and self.token_settled is not None and self.micro_batch_range is not None
        (low, high), (budget, since) = self.token_range, self.token_settled
        span = f"{low} tokens" if low == high else f"{low} to {high} tokens, settled at {budget} from step {since}"
        fewest, most = self.micro_batch_range
        samples = f"{most} samples" if fewest == most else f"{fewest} to {most} samples"
        parts = [f"micro-batch budget {span} ({samples})"]
        if self.padding:
            mean = sum(self.padding) / len(self.padding)
            parts.append(f"padding {mean:.0%} of the token positions computed (mean over steps)")
        return parts


def _track(
    span: tuple[int, int] | None, settled: tuple[int, int] | None, value: int, step: int
) -> tuple[tuple[int, int], tuple[int, int]]:
    """A size's range over a fit, and the value it holds with the step it has held it since, after ``step``."""
    if settled is None or settled[0] != value:
        settled = (value, step)
    low, high = span or (value, value)
    return (min(low, value), max(high, value)), settled


class TrainingClock:
    """Wall time of training with validation left out: since the start of ``fit``, and since the last logging step.

    Args:
        now: the clock to read, in seconds (`time.perf_counter` by default; a test passes its own).

    Examples:
        >>> ticks = iter([0.0, 3.0, 5.0, 9.0, 10.0])
        >>> clock = TrainingClock(now=lambda: next(ticks))  # starts at 0
        >>> clock.pause(); clock.resume()  # a validation from 3 s to 5 s
        >>> clock.interval_seconds(), clock.train_seconds()  # read at 9 s and at 10 s
        (7.0, 8.0)
    """

    def __init__(self, now: Callable[[], float] = time.perf_counter) -> None:
        self._clock = now
        self._paused_at: float | None = None
        self._stopped_at: float | None = None
        self.carried = 0.0
        self.start()

    def _now(self) -> float:
        return self._clock() if self._stopped_at is None else self._stopped_at

    def start(self, carried: float = 0.0) -> None:
        """Start counting a new ``fit``; ``carried`` is the training time of the run before it (a resumed run's)."""
        self._stopped_at = None
        self._paused_at = None
        self.carried = carried
        self._fit_start = self._interval_start = self._now()
        self._interval_paused = self._fit_paused = 0.0

    def stop(self) -> None:
        """The ``fit`` ended: the clock reads the time it ended at from now on."""
        if self._stopped_at is None:
            self._stopped_at = self._clock()

    def new_interval(self) -> None:
        """Start counting a new logging interval."""
        self._interval_paused = 0.0
        self._interval_start = self._now()

    def pause(self) -> None:
        """Validation starts: what follows is not training."""
        self._paused_at = self._now()

    def resume(self) -> None:
        """Validation ended (nothing happens without a `pause` before)."""
        if self._paused_at is not None:
            seconds = self._now() - self._paused_at
            self._interval_paused += seconds
            self._fit_paused += seconds
            self._paused_at = None

    def interval_seconds(self) -> float:
        """Training seconds since the last logging step (or the start)."""
        return self._now() - self._interval_start - self._interval_paused

    def fit_seconds(self) -> float:
        """Training seconds since the start of ``fit`` (a validation under way left out too)."""
        now = self._now()
        pausing = 0.0 if self._paused_at is None else now - self._paused_at
        return now - self._fit_start - self._fit_paused - pausing

    def train_seconds(self) -> float:
        """Training seconds of the run: `carried` from before this ``fit``, and `fit_seconds`."""
        return self.carried + self.fit_seconds()


@dataclass(frozen=True)
class MemoryReading:
    """A logging interval's memory figures, each the maximum over ranks."""

    peak_bytes: int
    peak_reserved_bytes: int | None  # CUDA only
    capacity_bytes: int


class RankMemory:
    """This rank's memory backend, read at logging steps; the figures of all ranks through the collectives passed in.

    Args:
        backend: the device's `lightning_accum.memory.backends.MemoryBackend`; its capacity is read once, here (on CPU
            that walks the cgroup files).

    Examples:
        >>> from lightning_accum.memory.backends import CPUBackend
        >>> memory = RankMemory(CPUBackend(capacity_bytes=8 * GIB))
        >>> reading = memory.read(owner_peak=0, max_across=lambda local: local)  # one process: this rank's figures
        >>> to_gib(reading.capacity_bytes), reading.peak_reserved_bytes, reading.peak_bytes == memory.last_peak > 0
        (8.0, None, True)
    """

    def __init__(self, backend: MemoryBackend) -> None:
        self.backend = backend
        self.capacity_bytes = backend.capacity_bytes()
        self.last_peak = 0  # this rank's, at the last read

    def read(self, owner_peak: int, max_across: Callable[[Tensor], Tensor] | None) -> MemoryReading:
        """The peaks since the last read (or ``owner_peak``, an owner's measurement, when higher); resets the peak.

        ``max_across`` takes the element-wise maximum over ranks (one small all-reduce; every rank calls it); ``None``
        on a single process.
        """
        reserved = self.backend.peak_reserved_bytes()
        self.last_peak = max(owner_peak, self.backend.peak_bytes())
        local = torch.tensor(
            [self.last_peak, -1 if reserved is None else reserved, self.capacity_bytes], dtype=torch.int64
        )
        peak, peak_reserved, capacity = (int(v) for v in (max_across(local) if max_across else local).tolist())
        self.backend.reset_peak()
        return MemoryReading(peak, None if peak_reserved < 0 else peak_reserved, capacity)

    def rank_metrics(
        self,
        max_across: Callable[[Tensor], Tensor] | None,
        gather: Callable[[Tensor], Tensor] | None,
        *,
        allocator: bool,
    ) -> dict[str, float]:
        """The allocator's retries (max over ranks, where ``allocator``) and, given ``gather``, each rank's last peak.

        ``gather`` stacks a tensor from every rank (one all-gather of one number each); call it after `read`.
        """
        local = torch.tensor([self.backend.alloc_retries(), self.last_peak], dtype=torch.float64)
        metrics: dict[str, float] = {}
        if allocator:
            retries = local[:1].clone()
            metrics[keys.ALLOC_RETRIES] = float((max_across(retries) if max_across else retries).item())
        if gather is not None:
            gathered = gather(local[1:]).reshape(-1).tolist()
            metrics.update({f"memory/rank{rank}/peak_gib": to_gib(peak) for rank, peak in enumerate(gathered)})
        return metrics
