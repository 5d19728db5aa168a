"""What `lightning_accum.AccumulationMonitor` logs, shows and warns about, built from its totals. Pure: no Trainer.

The callback reads the Trainer (its loggers, strategy and callbacks), runs the collectives, and passes plain values
here: the totals of `lightning_accum.monitor.totals`, a `lightning_accum.core.step_report.StepReport`, a
``ModelCheckpoint``'s schedule. What comes back (metric dicts under the contract keys of `lightning_accum.keys`,
progress-bar text, the run config, a warning) can be checked by hand.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from lightning_accum import keys
from lightning_accum._util.validation import check_int_worded
from lightning_accum.core.engine import Ranks
from lightning_accum.core.noise_scale import NoiseScale, NoiseScaleEstimator
from lightning_accum.core.step_report import LossSum, StepReport
from lightning_accum.memory.backends import backend_for
from lightning_accum.memory.budget import budget_fraction
from lightning_accum.monitor.rows import (
    LOGGED_KEYS,
    StepFigures,
    event_metrics,
    rank_metrics,
    schedule_metrics,
    step_metrics,
    token_metrics,
)
from lightning_accum.monitor.status import StatusLine
from lightning_accum.monitor.summary import FitSummary
from lightning_accum.monitor.totals import IntervalTotals, LightningWindows, MemoryReading, RankMemory, TrainingClock
from lightning_accum.monitor.window_loss import WeightedMean, mean_loss, progress_bar_loss, window_loss

NOISE_SCALE_NEEDS_AN_OWNER = (
    "`AccumulationMonitor(gradient_noise_scale=True)` measures the noise scale from the exact window"
    " gradient, which `AccumulationScheduler` or `AutoMicroBatching` provides. Add one of them to the"
    " Trainer's callbacks (e.g. `AccumulationScheduler()` adopts `accumulate_grad_batches`)."
)
"""The error when the noise scale is asked for and no callback owns accumulation."""


def check_logging_interval(value: Any) -> int | None:
    """``value`` if it is a number of optimizer steps (an int >= 1) or ``None`` (follow ``log_every_n_steps``).

    Raises:
        TypeError: ``value`` is neither an int nor ``None`` (a bool is refused).
        ValueError: ``value < 1``.

    Examples:
        >>> check_logging_interval(0)
        Traceback (most recent call last):
            ...
        ValueError: `logging_interval` must be >= 1 (log every that many optimizer steps), got 0.
    """
    if value is None:
        return None
    return check_int_worded(
        value,
        1,
        type_error="`logging_interval` must be an int (optimizer steps) or None (follow `Trainer(log_every_n_steps)`)",
        value_error="`logging_interval` must be >= 1 (log every that many optimizer steps)",
    )


def check_key_prefix(value: Any) -> str:
    """``value`` if it is a str.

    Raises:
        TypeError: ``value`` is not a str.

    Examples:
        >>> check_key_prefix("run2/")
        'run2/'
    """
    if not isinstance(value, str):
        raise TypeError(f"`key_prefix` must be a str such as 'run2/', got {value!r} of type {type(value).__name__}.")
    return value


def noise_metrics(estimate: NoiseScale) -> dict[str, float]:
    """The noise-scale keys of a smoothed estimate; none before the first measured window.

    Examples:
        >>> noise_metrics(NoiseScale(grad_sq_norm=2.0, trace_cov=64.0, windows=3))["accum/gradient_noise_scale"]
        32.0
        >>> noise_metrics(NoiseScale(float("nan"), float("nan"), windows=0))
        {}
    """
    if estimate.windows == 0:
        return {}
    return {
        keys.GRADIENT_NOISE_SCALE: estimate.gradient_noise_scale,
        keys.GRAD_SQ_NORM: estimate.grad_sq_norm,
        keys.GRAD_TRACE_COV: estimate.trace_cov,
        keys.NOISE_SCALE_SKIPPED: estimate.skipped,
    }


def logging_metrics(
    last: StepReport,
    *,
    samples: float,
    items: float,
    window_loss: float,
    seconds: float,
    memory: MemoryReading,
    budget_bytes: int | None,
) -> dict[str, float]:
    """The figures of a logging step (`lightning_accum.monitor.rows.StepFigures`), every input global already.

    Args:
        last: the report of the interval's last optimizer step (the batch figures describe it).
        samples: the samples of the whole interval, all ranks.
        items: the items of the whole interval, all ranks.
        window_loss: the item-weighted mean loss of the interval, all ranks.
        seconds: the interval's training time.
        memory: the interval's peaks and the capacity, maximum over ranks.
        budget_bytes: the memory budget, ``None`` without one.

    Examples:
        >>> from lightning_accum.memory.budget import GIB
        >>> metrics = logging_metrics(
        ...     StepReport("window", 4, 2, 8, 8.0, 16), samples=16, items=16.0, window_loss=0.5, seconds=2.0,
        ...     memory=MemoryReading(2 * GIB, None, 8 * GIB), budget_bytes=4 * GIB,
        ... )
        >>> metrics["perf/samples_per_sec"], metrics["memory/peak_fraction"], metrics["memory/budget_fraction"]
        (8.0, 0.25, 0.5)
    """
    figures = StepFigures(
        effective_batch_size=last.effective_batch_size,
        micro_batch_size=last.micro_batch_size,
        accumulation_steps=last.accumulation_steps,
        items_per_step=last.items,
        oom_retries=last.oom_retries,
        window_loss=window_loss,
        peak_bytes=memory.peak_bytes,
        capacity_bytes=memory.capacity_bytes,
        peak_reserved_bytes=memory.peak_reserved_bytes,
        budget_fraction=budget_fraction(budget_bytes, memory.capacity_bytes),
        interval_samples=samples,
        interval_items=items,
        interval_seconds=seconds,
    )
    # Split by tokens, the last step's budget and padding; split on several ranks, how unequal they were.
    return {**figures.as_metrics(), **token_metrics(last), **rank_metrics(last), **schedule_metrics(last)}


class EveryStepMetrics:
    """What goes into ``trainer.callback_metrics`` between logging steps, for ``ModelCheckpoint`` and ``EarlyStopping``.

    The figures a logging step would log, where they need no collective and no host read (the keys of
    `lightning_accum.monitor.rows.every_step_keys`): host numbers, and the window loss as a tensor on its device.
    ``callback_metrics`` keeps what is put there through training (the Trainer empties it before, at the start of a
    run and around the sanity check), so the batch figures come back only when they change: rarely split by samples,
    at most steps split by tokens (the step's micro-batches follow its lengths).

    Args:
        wanted: the keys to publish, from `lightning_accum.monitor.rows.every_step_keys`.
        key_prefix: put in front of every key.

    Examples:
        >>> from lightning_accum.monitor.rows import every_step_keys
        >>> every = EveryStepMetrics(every_step_keys(has_owner=True, world_size=2, noise_scale=False))
        >>> report = StepReport("window", 4, 2, 8, 8.0, 8)
        >>> every.metrics(report, LossSum(), {})["accum/effective_batch_size"]
        8.0
        >>> every.metrics(report, LossSum(), {})  # nothing changed: nothing to put there again
        {}
    """

    def __init__(self, wanted: tuple[str, ...] = (), key_prefix: str = "") -> None:
        self.wanted = wanted
        self.key_prefix = key_prefix
        self._values: tuple[Any, ...] = ()  # the figures last published

    def metrics(self, last: StepReport | None, loss: LossSum, noise: dict[str, float]) -> dict[str, float | Tensor]:
        """What to publish after the optimizer step of ``last``, given the interval's ``loss`` so far and ``noise``."""
        if not self.wanted or last is None:
            return {}
        metrics: dict[str, float | Tensor] = {}
        figures = (last.effective_batch_size, last.micro_batch_size, last.accumulation_steps, last.items)
        values = (*figures, last.oom_retries, last.micro_batch_tokens, last.padding_fraction, *noise.values())
        if values != self._values:
            self._values = values
            batch = step_metrics(last) if keys.EFFECTIVE_BATCH_SIZE in self.wanted else {}
            metrics.update({self.key_prefix + key: value for key, value in {**batch, **noise}.items()})
        if keys.WINDOW_LOSS in self.wanted:
            metrics[self.key_prefix + keys.WINDOW_LOSS] = mean_loss(loss)
        return metrics


def progress_bar_batch(report: StepReport) -> dict[str, str]:
    """The micro-batch size and ``k`` for Lightning's progress bar; split by tokens, also the budget and the padding.

    As text: Rich's bar formats every number with 3 decimals (``mb: 4.000``). By tokens ``mb`` is the samples of the
    largest micro-batch, ``mb_tokens`` the token budget and ``pad`` the step's padding fraction, all ranks.

    Examples:
        >>> progress_bar_batch(StepReport("split", 4, 2, 8, 8.0, 8))
        {'mb': '4', 'k': '2'}
        >>> progress_bar_batch(StepReport("split", 9, 3, 16, 180.0, 16, micro_batch_tokens=96, padding_fraction=0.277))
        {'mb': '9', 'k': '3', 'mb_tokens': '96', 'pad': '0.28'}
    """
    shown = {"mb": str(report.micro_batch_size), "k": str(report.accumulation_steps)}
    if report.micro_batch_tokens is not None:
        shown["mb_tokens"] = str(report.micro_batch_tokens)
        if report.padding_fraction is not None:
            shown["pad"] = f"{report.padding_fraction:.2f}"
    return shown


def progress_bar_memory(fraction: float, *, has_budget: bool) -> dict[str, str]:
    """The peak as a fraction of the budget (of the capacity without one), labelled with which.

    As text, so that Rich and tqdm both draw two decimals.

    Examples:
        >>> progress_bar_memory(0.8125, has_budget=False)
        {'mem/capacity': '0.81'}
    """
    return {("mem/budget" if has_budget else "mem/capacity"): f"{fraction:.2f}"}


def run_config(
    owner_settings: dict[str, Any] | None, *, accumulate_grad_batches: int, world_size: int, logging_every: int
) -> dict[str, Any]:
    """The accumulation settings for the W&B run config: an owner's own, or plain Lightning's ``k``.

    Examples:
        >>> run_config(None, accumulate_grad_batches=4, world_size=2, logging_every=50)
        {'mode': 'lightning', 'accumulate_grad_batches': 4, 'world_size': 2, 'monitor_logging_interval': 50}
    """
    if owner_settings is not None:
        settings = dict(owner_settings)
    else:
        settings = {"mode": "lightning", "accumulate_grad_batches": accumulate_grad_batches}
    settings["world_size"] = world_size
    settings["monitor_logging_interval"] = logging_every
    return settings


def late_reader_warnings(
    readers: Iterable[tuple[str, int, bool]], *, key_prefix: str, every_step: tuple[str, ...], logging_every: int
) -> list[str]:
    """The warnings for ``ModelCheckpoint(monitor=...)`` callbacks that read a key between the steps that refresh it.

    Args:
        readers: each checkpoint's ``monitor``, ``every_n_train_steps`` (0: not by steps) and whether it also saves
            by training time.
        key_prefix: the monitor's ``key_prefix``.
        every_step: the keys refreshed at every optimizer step (`lightning_accum.monitor.rows.every_step_keys`).
        logging_every: the monitor's logging interval in optimizer steps (0: it never logs).

    Returns:
        One message per checkpoint that reads a logged key between logging steps; none for one that reads at logging
        steps only, or a key the monitor doesn't log.

    Examples:
        >>> readers = [("memory/peak_gib", 20, False), ("memory/peak_gib", 5, False), ("val/loss", 5, False)]
        >>> for warning in late_reader_warnings(readers, key_prefix="", every_step=(), logging_every=10):
        ...     print(warning)  # doctest: +ELLIPSIS
        `ModelCheckpoint(monitor='memory/peak_gib', every_n_train_steps=5)` reads its key more often than ...
    """
    if logging_every == 1:
        return []
    return [
        message
        for monitor, every, by_time in readers
        if (message := _late_reader_warning(monitor, key_prefix, every_step, logging_every, every, by_time))
    ]


def _late_reader_warning(
    monitor: str, key_prefix: str, every_step: tuple[str, ...], logging_every: int, every: int, by_time: bool
) -> str | None:
    if not monitor.startswith(key_prefix):
        return None
    key = monitor.removeprefix(key_prefix)
    if key in every_step or not (key in LOGGED_KEYS or key.startswith("memory/rank")):
        return None
    if (every < 1 or (logging_every > 0 and every % logging_every == 0)) and not by_time:
        return None
    when = f"every_n_train_steps={every}" if every >= 1 else "train_time_interval=..."
    logs = f"every {logging_every} optimizer steps" if logging_every > 0 else "never: `log_every_n_steps=0`"
    fix = "=1)`" if every <= 1 else f"=...)` to a divisor of {every}"
    return (
        f"`ModelCheckpoint(monitor={monitor!r}, {when})` reads its key more often than `AccumulationMonitor`"
        f" logs it ({logs}): {why_not_every_step(key)}, so between logging steps the checkpoint sees"
        f" the last logging step's value, or none before the first. Set `AccumulationMonitor(logging_interval"
        f"{fix}, or `every_n_train_steps` to a multiple of {max(logging_every, 1)}."
    )


def why_not_every_step(key: str) -> str:
    """Why the monitor refreshes ``key`` at logging steps only (for `late_reader_warnings`).

    Examples:
        >>> why_not_every_step("perf/samples_per_sec")
        '`perf/samples_per_sec` is a figure of a logging interval'
    """
    if key == keys.WINDOW_LOSS:
        return f"under DDP, `{key}` is summed over the ranks at logging steps only (one small all-reduce each)"
    if key in keys.BATCH_KEYS or key == keys.OOM_RETRIES:
        return f"without an accumulation owner under DDP, `{key}` is summed over the ranks at logging steps only"
    return f"`{key}` is a figure of a logging interval"


class AccumulationMetrics:
    """What `lightning_accum.AccumulationMonitor` counts and logs, Trainer-free: step reports in, metric dicts out.

    The callback passes every optimizer step's `lightning_accum.core.step_report.StepReport` to `add`, puts what
    `between_logging_steps` returns into ``trainer.callback_metrics`` at the other steps, and at a logging step
    calls `logging_step` on every rank, hands its metrics to the loggers, then calls `new_interval`. At the end of
    ``fit``, `finish` gives the `lightning_accum.monitor.summary.FitSummary`. The collectives come in as a
    `lightning_accum.core.engine.Ranks` (and a gather): on one process, ``Ranks()``.

    Args:
        key_prefix: put in front of every key.
        noise_scale: the average fed by the step reports' noise measurements (the monitor's own, which it saves).
        log_noise_scale: log the noise-scale keys.

    Examples:
        >>> from lightning_accum.monitor.rows import every_step_keys
        >>> metrics = AccumulationMetrics()
        >>> metrics.setup(torch.device("cpu"))
        >>> metrics.start(every_step_keys(has_owner=True, world_size=1, noise_scale=False), has_owner=True)
        >>> report = StepReport("window", 4, 2, 8, 8.0, 8, loss_sum=torch.tensor(4.0), loss_items=8)
        >>> metrics.add(report), metrics.add(report)  # each report counts once
        (True, False)
        >>> metrics.between_logging_steps()["accum/window_loss"]
        tensor(0.5000)
        >>> logged = metrics.logging_step(Ranks(), gather=None, allocator=False)
        >>> logged["accum/effective_batch_size"], logged["accum/window_loss"]
        (8.0, 0.5)
    """

    def __init__(
        self, key_prefix: str = "", noise_scale: NoiseScaleEstimator | None = None, *, log_noise_scale: bool = False
    ) -> None:
        self.key_prefix = key_prefix
        self.noise_scale = NoiseScaleEstimator() if noise_scale is None else noise_scale
        self.log_noise_scale = log_noise_scale
        self.noise_in_use: NoiseScaleEstimator | None = None  # a schedule's average that decides k, if any
        self.has_owner = False
        self.memory: RankMemory | None = None  # from `setup`, once the device is known
        self.loss = WeightedMean()  # syncs across ranks at logging steps
        self.clock = TrainingClock()
        self.interval = IntervalTotals()
        self.fit = FitSummary()
        self.every_step = EveryStepMetrics(key_prefix=key_prefix)
        self.memory_bar: dict[str, str] = {}  # the progress bar's memory figure, from the last logging step
        self.loss_bar: dict[str, str] = {}  # and its window loss
        self.status = StatusLine()  # a line now and then where the output is a file
        self._logged: dict[str, float] = {}  # the last logging step's metrics, unprefixed
        self.run_seconds = 0.0  # the run's training time when the last fit ended, or in the checkpoint loaded
        self._last_report: StepReport | None = None
        self._running = False

    def setup(self, device: torch.device) -> None:
        """Read memory (and keep the loss) on ``device``; its capacity is read once, here."""
        self.memory = RankMemory(backend_for(device))
        self.loss = self.loss.to(device)

    def ensure_memory(self, device: torch.device) -> None:
        """Read memory on ``device`` where `setup` never ran (a Trainer that skipped it): its capacity, once."""
        if self.memory is None:
            self.memory = RankMemory(backend_for(device))

    def start(
        self,
        every_step: tuple[str, ...],
        *,
        has_owner: bool,
        noise_in_use: NoiseScaleEstimator | None = None,
        last_report: StepReport | None = None,
        first_step: int = 0,
    ) -> None:
        """Start a ``fit``: the new interval, the memory peak and the clock.

        Args:
            every_step: the keys published between logging steps (`lightning_accum.monitor.rows.every_step_keys`).
            has_owner: a callback owns accumulation (its reports are global; otherwise they are this rank's).
            noise_in_use: the noise-scale average a schedule follows, logged instead of ``noise_scale``.
            last_report: the owner's report from before this ``fit`` (a second ``fit``), not counted again.
            first_step: the run's step the ``fit`` starts at (``trainer.global_step``): after 0, the run goes on, and
                so do its training time (`run_seconds`) and the summary's steps.
        """
        self.has_owner, self.noise_in_use, self._last_report = has_owner, noise_in_use, last_report
        self.every_step = EveryStepMetrics(every_step, self.key_prefix)  # the Trainer has just emptied them
        self.interval = IntervalTotals()
        self.loss.reset()
        if self.memory is not None:
            self.memory.backend.reset_peak()
        self.clock.start(carried=self.run_seconds if first_step > 0 else 0.0)
        self._running = True
        self.fit = FitSummary(first_step)

    def stop(self) -> None:
        """The ``fit`` ended: its training time is the run's, until the next ``fit`` goes on from it."""
        self.clock.stop()
        if self._running:
            self.run_seconds, self._running = self.clock.train_seconds(), False

    def train_seconds(self) -> float:
        """The run's training time so far (``perf/train_seconds``): what a checkpoint carries to a resumed run."""
        return self.clock.train_seconds() if self._running else self.run_seconds

    def add(self, report: StepReport, noise_windows: int = 0, step: int | None = None) -> bool:
        """Count an optimizer step's report, unless it is the one counted last (then ``False``).

        ``noise_windows`` says how many windows the report's noise measurement stands for; ``step`` is the
        optimizer step on the run's axis (the logging step), for the summary.
        """
        if report is self._last_report:
            return False
        self._last_report = report
        self.interval.add(report)
        self.fit.add(report, step)
        if report.noise is not None and self.noise_in_use is None and self.has_owner:
            # A measurement stands for the windows since the last one (an interval, or windows too short to measure),
            # counted by the owner from the optimizer steps, so a resumed run weighs them as an uninterrupted one.
            self.noise_scale.add_estimates(*report.noise, windows=max(1, noise_windows))
        return True

    def noise_metrics(self) -> dict[str, float]:
        """The noise-scale keys (unprefixed), where logged and measured."""
        if not self.log_noise_scale:
            return {}
        return noise_metrics((self.noise_in_use or self.noise_scale).value())

    def between_logging_steps(self) -> dict[str, float | Tensor]:
        """What to put into ``callback_metrics`` after a step that is not a logging step (see `EveryStepMetrics`)."""
        return self.every_step.metrics(self.interval.last, self.interval.loss, self.noise_metrics())

    def logging_step(
        self, ranks: Ranks, gather: Callable[[Tensor], Tensor] | None, *, allocator: bool
    ) -> dict[str, float]:
        """The metrics of a logging step, global; every rank calls it, in the same order (it holds collectives).

        Args:
            ranks: the small collectives (``Ranks()`` on one process).
            gather: stacks a tensor from every rank, for each rank's peak; ``None`` leaves those out.
            allocator: the device has a caching allocator whose retries are logged (CUDA, XPU).
        """
        interval, last = self.interval, self.interval.last
        assert last is not None and self.memory is not None, "a logging step follows a step, after setup"
        samples, items = float(interval.samples), interval.items
        if not self.has_owner:  # counted from this rank's batches: summed over ranks here, not at every step
            last, samples = LightningWindows.globalize(interval, ranks.sum)
            items = samples
        loss = window_loss(self.loss, interval.loss)  # syncs ranks and the device, so the clock below is honest
        seconds = self.clock.interval_seconds()
        memory = self.memory.read(interval.peak_bytes, ranks.max)
        budget = None if last.budget_bytes is None else int(last.budget_bytes)
        metrics = logging_metrics(
            last, samples=samples, items=items, window_loss=loss, seconds=seconds, memory=memory, budget_bytes=budget
        )
        metrics.update({**self.noise_metrics(), **event_metrics(interval.events)})
        metrics[keys.TRAIN_SECONDS] = self.clock.train_seconds()
        metrics.update(self.memory.rank_metrics(ranks.max, gather, allocator=allocator))
        fraction = self.fit.add_peak_bytes(memory.peak_bytes, budget, memory.capacity_bytes)
        self.memory_bar = {} if fraction is None else progress_bar_memory(fraction, has_budget=budget is not None)
        self.loss_bar = progress_bar_loss(loss)
        self._logged = metrics
        return {self.key_prefix + key: value for key, value in metrics.items()}

    def status_line(self, step: int, now: float) -> str | None:
        """One line on the last logging step (step, throughput, memory) where `STATUS_EVERY_S` have passed."""
        return self.status.line(step, self._logged, now=now)

    def new_interval(self) -> None:
        """Start the next logging interval (after the loggers had the last one's metrics)."""
        self.interval = IntervalTotals()
        self.clock.new_interval()

    def finish(self, ranks: Ranks) -> FitSummary:
        """The summary of the ``fit``, global; every rank calls it (it holds collectives)."""
        summary = self.fit
        summary.seconds = self.clock.fit_seconds()  # this fit's: its samples per second
        if self.interval.steps > 0:  # steps after the last logging step (the whole fit, if it was shorter)
            assert self.memory is not None, "set by the callback before the first step"
            # Every rank gets here with the same count (ranks step together): the maximum over ranks is safe.
            memory = self.memory.read(self.interval.peak_bytes, ranks.max)
            last = self.interval.last
            budget = None if last is None else last.budget_bytes
            summary.add_peak_bytes(memory.peak_bytes, budget, memory.capacity_bytes)
        if not self.has_owner and ranks.sum is not None:  # counted from this rank's batches
            summary.sum_over_ranks(ranks.sum)
        return summary
