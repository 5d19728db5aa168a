"""``AccumulationMonitor``: batch, memory, recovery and throughput figures at every optimizer step, to every logger."""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor
from typing_extensions import override

from lightning_accum import _compat, keys
from lightning_accum._cli_types import Decay, PositiveInt
from lightning_accum._validation import check_bool, check_int
from lightning_accum.callbacks._owner import AccumulationOwner, find_owner
from lightning_accum.distributed import max_across_ranks, sum_across_ranks_fn
from lightning_accum.memory.backends import MemoryBackend, backend_for
from lightning_accum.memory.budget import budget_fraction
from lightning_accum.monitoring import (
    LOGGED_KEYS,
    FitSummary,
    IntervalTotals,
    LightningWindows,
    StepFigures,
    WeightedMean,
    event_metrics,
    every_step_keys,
    mean_loss,
    step_metrics,
    to_gib,
)
from lightning_accum.noise_scale import NoiseScaleEstimator
from lightning_accum.report import StepReport
from lightning_accum.splitting import resolve_batch_hooks


class AccumulationMonitor(Callback):
    """Logs what accumulation did at every optimizer step (or every ``logging_interval`` steps) to every logger.

    The figures are global: batch and item counts are summed over ranks, memory is the largest peak of any rank.
    They come from the callback that owns accumulation (``AccumulationScheduler`` or ``AutoMicroBatching``) when one
    is in the Trainer, and are counted from the batches otherwise (plain ``Trainer(accumulate_grad_batches=k)``).
    Metrics go to every logger in ``trainer.loggers`` on rank zero, on Lightning's own step axis: the step that
    ``self.log``, ``LearningRateMonitor`` and ``ThroughputMonitor`` use for the same optimizer step (the first step
    is 0). They also reach ``trainer.callback_metrics``, so
    ``ModelCheckpoint(monitor="accum/window_loss")`` and ``EarlyStopping`` can watch them: at a logging step, what the
    loggers got; at every other optimizer step, what needs no collective and no host read (the step's batch figures,
    and on one process the window loss since the previous logging step; see
    `lightning_accum.monitoring.every_step_keys`). Memory and throughput are figures of a logging interval and change
    at logging steps only; a ``ModelCheckpoint`` that reads one of them (or, under DDP, the window loss) between
    logging steps is warned about when training starts. With a ``WandbLogger``,
    the keys are also defined against ``trainer/global_step`` (memory peaks summarised by their maximum) and the
    accumulation settings are put into the run config under ``lightning_accum``.

    The device is only synchronized at logging steps (memory reads, the window loss, a few small all-reduces), never
    per micro-batch.

    Logged metrics:

        ==================================  ===========  ==================================================
        key                                 unit         when
        ==================================  ===========  ==================================================
        ``accum/effective_batch_size``      samples      every logging step: the last step, all ranks
        ``accum/micro_batch_size``          samples      every logging step: one micro-batch on one rank
        ``accum/accumulation_steps``        micro-bat.   every logging step: the last step, one rank
        ``accum/items_per_step``            items        every logging step: the last step, all ranks
        ``accum/oom_retries``               count        every logging step, cumulative since the start
        ``accum/window_loss``               loss         every logging step: item-weighted mean since the
                                                         previous logging step, all ranks
        ``memory/peak_gib``                 GiB          every logging step: peak since the previous one,
                                                         max over ranks (CUDA allocated, CPU resident set)
        ``memory/capacity_gib``             GiB          every logging step
        ``memory/peak_fraction``            fraction     every logging step: peak / capacity
        ``memory/budget_fraction``          fraction     every logging step: the memory budget / capacity
                                                         (1.0 without a budget)
        ``memory/peak_reserved_gib``        GiB          every logging step, CUDA only
        ``perf/samples_per_sec``            samples/s    every logging step, over the interval, all ranks
        ``perf/items_per_sec``              items/s      every logging step, over the interval, all ranks
        ``perf/train_seconds``              s            every logging step: since the start of fit,
                                                         validation excluded
        ``memory/alloc_retries``            count        every logging step, CUDA/XPU only, cumulative
        ``memory/rank{r}/peak_gib``         GiB          with ``per_rank_memory=True``: each rank's peak
        ``accum/gradient_noise_scale``      items        with ``gradient_noise_scale=True`` (also
                                                         ``accum/grad_sq_norm``, ``accum/grad_trace_cov``,
                                                         ``accum/noise_scale_skipped``)
        ``events/*``                        size after   at the logging step that follows the event
        ==================================  ===========  ==================================================

    With ``gradient_noise_scale=True`` it also logs ``accum/gradient_noise_scale`` (``B_simple = tr(Σ)/|G|²`` in
    items, McCandlish et al. 2018), ``accum/grad_sq_norm`` (``|G|²``), ``accum/grad_trace_cov`` (``tr(Σ)``) and
    ``accum/noise_scale_skipped`` (windows whose estimate was NaN or inf and left out of the average, cumulative):
    unbiased estimates from each window's first micro-batch and whole window, smoothed by a bias-corrected moving
    average over windows (``noise_scale_beta``). It needs windows of at least two micro-batches. Where the schedule
    follows the noise scale (`lightning_accum.schedules.AdaptiveBatchSize`), the schedule's own average is logged
    instead: the one that decides ``k``.

    Args:
        logging_interval: log every this many optimizer steps; ``None`` (the default) follows
            ``Trainer(log_every_n_steps)``, as Lightning's own monitors do. Throughput, peak memory and the window
            loss cover the whole interval; batch figures describe its last step.
        gradient_noise_scale: also estimate and log the gradient noise scale (needs an accumulation owner).
        noise_scale_beta: the moving average's decay per window, in ``[0, 1)``.
        noise_scale_interval: measure the windows whose optimizer step (from 0) is a multiple of this, so that a
            resumed run measures the windows an uninterrupted one does. Each measurement then
            weighs as much as the ``n`` windows it stands for, so the average covers the same span of training; the
            estimate stays unbiased, and its cost (two gradient norms per measured window) falls ``n``-fold.
        progress_bar: show the micro-batch size (``mb``), ``k`` and the peak memory as a fraction of the budget
            (``mem/budget``; ``mem/capacity``, of the capacity, without a budget; updated at logging steps) in
            Lightning's progress bar.
        key_prefix: put in front of every logged key (the dashboard and the report read unprefixed keys).
        per_rank_memory: also log each rank's own peak, ``memory/rank{r}/peak_gib``.
        summary: at the end of ``fit``, print one line (steps, effective batch, the micro-batch range and where it
            settled, OOMs recovered and their steps, the peak against the budget, throughput) and log its figures to
            every logger's hyperparameters under ``lightning_accum_summary``.

    Raises:
        TypeError: ``logging_interval`` is not an int.
        ValueError: ``logging_interval < 1``.

    Examples:
        >>> from lightning.pytorch import Trainer
        >>> from lightning_accum import AccumulationScheduler
        >>> monitor = AccumulationMonitor(logging_interval=10)
        >>> trainer = Trainer(callbacks=[AccumulationScheduler(4), monitor], enable_progress_bar=False)
    """

    def __init__(
        self,
        logging_interval: PositiveInt | None = None,
        *,
        gradient_noise_scale: bool = False,
        noise_scale_beta: Decay = 0.99,
        noise_scale_interval: PositiveInt = 1,
        progress_bar: bool = True,
        summary: bool = True,
        key_prefix: str = "",
        per_rank_memory: bool = False,
    ) -> None:
        bad_type = isinstance(logging_interval, bool) or not isinstance(logging_interval, int)
        if logging_interval is not None and bad_type:
            raise TypeError(
                f"`logging_interval` must be an int (optimizer steps) or None (follow `Trainer(log_every_n_steps)`),"
                f" got {logging_interval!r} of type {type(logging_interval).__name__}."
            )
        if logging_interval is not None and logging_interval < 1:
            raise ValueError(
                f"`logging_interval` must be >= 1 (log every that many optimizer steps), got {logging_interval}."
            )
        self.logging_interval = logging_interval
        self.gradient_noise_scale = check_bool(gradient_noise_scale, "gradient_noise_scale")
        self.noise_scale = NoiseScaleEstimator(noise_scale_beta)  # checks the beta
        self.noise_scale_interval = check_int(
            noise_scale_interval, "noise_scale_interval", 1, hint="It measures every that many windows; 1 is every."
        )
        self.progress_bar = check_bool(progress_bar, "progress_bar")
        self.summary = check_bool(summary, "summary")
        if not isinstance(key_prefix, str):
            raise TypeError(
                f"`key_prefix` must be a str such as 'run2/', got {key_prefix!r} of type {type(key_prefix).__name__}."
            )
        self.key_prefix = key_prefix
        self.per_rank_memory = check_bool(per_rank_memory, "per_rank_memory")
        self._fit_summary = FitSummary()
        self._fit_start = time.perf_counter()
        self._validation_seconds = 0.0
        self._last_peak = 0
        self._backend: MemoryBackend | None = None
        self._capacity_bytes = 0
        self._owner: AccumulationOwner | None = None
        self._loss = WeightedMean()  # syncs across ranks at logging steps
        self._hooks = resolve_batch_hooks(None)
        self._interval = IntervalTotals()
        self._windows = LightningWindows()  # the reports of plain Lightning accumulation, when no owner publishes
        self._last_report: StepReport | None = None
        self._last_global_step = 0
        self._interval_start = time.perf_counter()
        self._excluded_seconds = 0.0
        self._validation_start: float | None = None
        self._noise_in_use: NoiseScaleEstimator | None = None  # a schedule's average that decides k, if any
        self._every_step: tuple[str, ...] = ()  # the keys put into `callback_metrics` between logging steps too
        self._step_values: tuple[Any, ...] = ()  # the batch figures last put there

    # ----------------------------------------------------------------------------------------------------------
    # setup
    # ----------------------------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._backend = backend_for(trainer.strategy.root_device)
        self._capacity_bytes = self._backend.capacity_bytes()  # read once: on CPU it walks the cgroup files
        self._loss = self._loss.to(trainer.strategy.root_device)
        self._hooks = resolve_batch_hooks(pl_module)  # counts samples when no callback owns accumulation

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._owner = find_owner(trainer.callbacks)
        self._noise_in_use = None
        if self.gradient_noise_scale:
            if self._owner is None:
                raise RuntimeError(
                    "`AccumulationMonitor(gradient_noise_scale=True)` measures the noise scale from the exact window"
                    " gradient, which `AccumulationScheduler` or `AutoMicroBatching` provides. Add one of them to the"
                    " Trainer's callbacks (e.g. `AccumulationScheduler()` adopts `accumulate_grad_batches`)."
                )
            self._owner.measure_noise_scale(every=self.noise_scale_interval)
            # Where a schedule follows the noise scale, its own average is the one worth seeing: it decides k.
            self._noise_in_use = self._owner.noise_scale_in_use()
        self._every_step = every_step_keys(
            has_owner=self._owner is not None, world_size=trainer.world_size, noise_scale=self.gradient_noise_scale
        )
        self._warn_late_readers(trainer)
        self._step_values = ()  # the Trainer has just emptied `callback_metrics`
        self._interval.reset()
        self._windows = LightningWindows()
        self._last_report = self._owner.last_step_report if self._owner is not None else None
        self._last_global_step = trainer.global_step
        self._loss.reset()
        # Here, not at fit start: the owner resolves its memory budget (part of its settings) in its on_train_start,
        # which runs before ours because the owner moves itself to the front of the callbacks.
        self._setup_wandb(trainer)
        if self._backend is not None:
            self._backend.reset_peak()
        self._interval_start = self._fit_start = time.perf_counter()
        self._excluded_seconds = self._validation_seconds = 0.0
        self._fit_summary = FitSummary()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._fit_summary.steps == 0:
            return
        self._wandb_event_counts(trainer)
        if not self.summary:
            return
        self._fit_summary.seconds = time.perf_counter() - self._fit_start - self._validation_seconds
        if self._interval.steps > 0:  # steps after the last logging step (the whole fit, if it was shorter)
            # Every rank gets here with the same count (ranks step together): the maximum over ranks is safe.
            peak, _, capacity = self._memory(trainer, self._interval.peak_bytes)
            last = self._interval.last
            self._summarize_peak(peak, None if last is None else last.budget_bytes, capacity)
        if self._owner is None and trainer.world_size > 1:  # counted from this rank's batches: every rank calls this
            self._fit_summary.sum_over_ranks(sum_across_ranks_fn(trainer))
        rank_zero_info(self._fit_summary.text())
        if trainer.is_global_zero:  # as run-level values (W&B config, hparams.yaml), not as one more metric row
            for logger in trainer.loggers:
                logger.log_hyperparams({"lightning_accum_summary": self._fit_summary.as_dict()})

    def _setup_wandb(self, trainer: pl.Trainer) -> None:
        if trainer.is_global_zero and any(isinstance(lg, WandbLogger) for lg in trainer.loggers):
            from lightning_accum.integrations.wandb import define_metrics, record_config

            settings = self._settings(trainer)
            for logger in trainer.loggers:
                if isinstance(logger, WandbLogger):
                    define_metrics(logger.experiment, self.key_prefix)
                    record_config(logger.experiment, settings)

    def _wandb_event_counts(self, trainer: pl.Trainer) -> None:
        """Each event key's W&B run summary: how many such events the run had."""
        if trainer.is_global_zero and any(isinstance(lg, WandbLogger) for lg in trainer.loggers):
            from lightning_accum.integrations.wandb import record_event_counts

            for logger in trainer.loggers:
                if isinstance(logger, WandbLogger):
                    record_event_counts(logger.experiment, self._fit_summary.event_counts, self.key_prefix)

    def _settings(self, trainer: pl.Trainer) -> dict[str, Any]:
        if self._owner is not None:
            settings = self._owner.settings()
        else:
            settings = {"mode": "lightning", "accumulate_grad_batches": trainer.accumulate_grad_batches}
        settings["world_size"] = trainer.world_size
        settings["monitor_logging_interval"] = self.logging_interval or trainer.log_every_n_steps
        return settings

    # Validation inside fit is not training throughput.
    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == TrainerFn.FITTING:
            self._validation_start = time.perf_counter()

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._validation_start is not None:
            seconds = time.perf_counter() - self._validation_start
            self._excluded_seconds += seconds
            self._validation_seconds += seconds
            self._validation_start = None

    # ----------------------------------------------------------------------------------------------------------
    # every micro-batch: host-side counting only, unless a step ended
    # ----------------------------------------------------------------------------------------------------------
    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        report = self._step_report(trainer, outputs, batch)
        if report is None:
            return  # still inside the window
        self._interval.add(report)
        self._fit_summary.add(report)
        if self.progress_bar:  # what Lightning's TQDM and Rich bars show next to the loss
            # As text: Rich's bar formats every number with 3 decimals ("mb: 4.000").
            bar = {"mb": str(report.micro_batch_size), "k": str(report.accumulation_steps)}
            _compat.set_progress_bar_metrics(trainer, bar)
        if report.noise is not None and self._noise_in_use is None and self._owner is not None:
            # A measurement stands for the windows since the last one (an interval, or windows too short to measure),
            # counted by the owner from the optimizer steps, so a resumed run weighs them as an uninterrupted one.
            self.noise_scale.add_estimates(*report.noise, windows=max(1, self._owner.noise_windows))
        step = _compat.logging_step(trainer)
        interval = self._logging_every(trainer)
        if interval > 0 and (step + 1) % interval == 0:
            self._log(trainer, step)
        else:
            self._publish_step(trainer)

    def _logging_every(self, trainer: pl.Trainer) -> int:
        return self.logging_interval if self.logging_interval is not None else trainer.log_every_n_steps

    def _publish_step(self, trainer: pl.Trainer) -> None:
        """Between logging steps, what a callback (``ModelCheckpoint``, ``EarlyStopping``) can read at this step.

        The figures a logging step here would log, where they need no collective and no host read (see
        `lightning_accum.monitoring.every_step_keys`): host numbers, and the window loss as a tensor on its device.
        """
        wanted, last = self._every_step, self._interval.last
        if not wanted or last is None:
            return
        metrics: dict[str, float | Tensor] = {}
        # `callback_metrics` keeps what is put there through training (the Trainer empties it before, at the start of
        # a run and around the sanity check): batch figures go in again only when they change, which is rare.
        figures = (last.effective_batch_size, last.micro_batch_size, last.accumulation_steps, last.items)
        values = (*figures, last.oom_retries, *(self._noise_metrics().values() if self.gradient_noise_scale else ()))
        if values != self._step_values:
            self._step_values = values
            batch = step_metrics(last) if keys.EFFECTIVE_BATCH_SIZE in wanted else {}
            noise = self._noise_metrics() if self.gradient_noise_scale else {}
            metrics.update({self.key_prefix + key: value for key, value in {**batch, **noise}.items()})
        if keys.WINDOW_LOSS in wanted:
            metrics[self.key_prefix + keys.WINDOW_LOSS] = mean_loss(self._interval.loss)
        if metrics:
            _compat.set_callback_metrics(trainer, metrics)

    def _warn_late_readers(self, trainer: pl.Trainer) -> None:
        """Warn about a ``ModelCheckpoint`` that reads a key between the logging steps, where it is not refreshed."""
        interval = self._logging_every(trainer)
        if interval == 1:
            return
        for callback in trainer.callbacks:
            monitor = getattr(callback, "monitor", None)
            if not isinstance(callback, ModelCheckpoint) or not isinstance(monitor, str):
                continue
            key = monitor.removeprefix(self.key_prefix) if monitor.startswith(self.key_prefix) else None
            if key is None or key in self._every_step or not (key in LOGGED_KEYS or key.startswith("memory/rank")):
                continue
            every, by_time = _compat.checkpoint_step_schedule(callback)
            if (every < 1 or (interval > 0 and every % interval == 0)) and not by_time:
                continue
            when = f"every_n_train_steps={every}" if every >= 1 else "train_time_interval=..."
            logs = f"every {interval} optimizer steps" if interval > 0 else "never: `log_every_n_steps=0`"
            fix = "=1)`" if every <= 1 else f"=...)` to a divisor of {every}"
            rank_zero_warn(
                f"`ModelCheckpoint(monitor={monitor!r}, {when})` reads its key more often than `AccumulationMonitor`"
                f" logs it ({logs}): {self._why_not_every_step(key)}, so between logging steps the checkpoint sees"
                f" the last logging step's value, or none before the first. Set `AccumulationMonitor(logging_interval"
                f"{fix}, or `every_n_train_steps` to a multiple of {max(interval, 1)}."
            )

    def _why_not_every_step(self, key: str) -> str:
        if key == keys.WINDOW_LOSS:
            return f"under DDP, `{key}` is summed over the ranks at logging steps only (one small all-reduce each)"
        if key in keys.BATCH_KEYS or key == keys.OOM_RETRIES:
            return f"without an accumulation owner under DDP, `{key}` is summed over the ranks at logging steps only"
        return f"`{key}` is a figure of a logging interval"

    def _step_report(self, trainer: pl.Trainer, outputs: Any, batch: Any) -> StepReport | None:
        """The report of the optimizer step that just ended, or ``None`` inside a window."""
        if self._owner is not None:
            report = self._owner.last_step_report
            if report is None or report is self._last_report:
                return None
            self._last_report = report
            return report
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        mean_loss = loss.detach() * _compat.lightning_loss_divisor(trainer) if isinstance(loss, Tensor) else None
        self._windows.add_micro_batch(self._hooks.batch_size(batch), mean_loss)
        if trainer.global_step == self._last_global_step:
            return None
        self._last_global_step = trainer.global_step
        return self._windows.finish()

    # ----------------------------------------------------------------------------------------------------------
    # logging steps: the only place that synchronizes
    # ----------------------------------------------------------------------------------------------------------
    def _log(self, trainer: pl.Trainer, step: int) -> None:
        # Every rank runs this block in the same order: it holds collectives.
        interval, last = self._interval, self._interval.last
        assert last is not None
        interval_samples, interval_items = float(interval.samples), interval.items
        if self._owner is None:  # counted from this rank's batches: summed over ranks here, not at every step
            last, interval_samples = LightningWindows.globalize(interval, sum_across_ranks_fn(trainer))
            interval_items = interval_samples
        window_loss = self._window_loss(interval)  # syncs ranks and the device, so the clock below is honest
        seconds = time.perf_counter() - self._interval_start - self._excluded_seconds
        peak, peak_reserved, capacity = self._memory(trainer, interval.peak_bytes)
        budget = None if last.budget_bytes is None else int(last.budget_bytes)
        figures = StepFigures(
            effective_batch_size=last.effective_batch_size,
            micro_batch_size=last.micro_batch_size,
            accumulation_steps=last.accumulation_steps,
            items_per_step=last.items,
            oom_retries=last.oom_retries,
            window_loss=window_loss,
            peak_bytes=peak,
            capacity_bytes=capacity,
            peak_reserved_bytes=peak_reserved,
            budget_fraction=budget_fraction(budget, capacity),
            interval_samples=interval_samples,
            interval_items=interval_items,
            interval_seconds=seconds,
        )
        metrics = {**figures.as_metrics(), **self._noise_metrics(), **event_metrics(interval.events)}
        metrics.update(self._extra_metrics(trainer))
        metrics = {self.key_prefix + key: value for key, value in metrics.items()}
        self._show_memory(trainer, peak, budget, capacity)
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)
        # Into `trainer.callback_metrics` (every rank holds the same global figures) for ModelCheckpoint and
        # EarlyStopping; the loggers were served above, at this step.
        _compat.set_callback_metrics(trainer, metrics)
        interval.reset()
        self._excluded_seconds = 0.0
        self._interval_start = time.perf_counter()

    def _extra_metrics(self, trainer: pl.Trainer) -> dict[str, float]:
        """Wall-clock training time, the allocator's retries (CUDA/XPU) and, opt-in, each rank's peak."""
        assert self._backend is not None
        metrics = {keys.TRAIN_SECONDS: time.perf_counter() - self._fit_start - self._validation_seconds}
        local = torch.tensor([self._backend.alloc_retries(), self._last_peak], dtype=torch.float64)
        if trainer.strategy.root_device.type != "cpu":
            metrics[keys.ALLOC_RETRIES] = float(max_across_ranks(trainer, local[:1].clone()).item())
        if self.per_rank_memory:  # one gather of one number per rank, at logging steps only
            gathered = trainer.strategy.all_gather(local[1:].to(trainer.strategy.root_device)).reshape(-1).tolist()
            metrics.update({f"memory/rank{rank}/peak_gib": to_gib(peak) for rank, peak in enumerate(gathered)})
        return metrics

    def _show_memory(self, trainer: pl.Trainer, peak: int, budget: float | None, capacity: int) -> None:
        """The peak as a fraction of the budget (of the capacity without one): in the summary and the progress bar."""
        fraction = self._summarize_peak(peak, budget, capacity)
        if self.progress_bar and fraction is not None:
            # The label says what it is a fraction of; as text, so that Rich and tqdm both draw two decimals.
            label = "mem/budget" if budget is not None else "mem/capacity"
            _compat.set_progress_bar_metrics(trainer, {label: f"{fraction:.2f}"})

    def _summarize_peak(self, peak: int, budget: float | None, capacity: int) -> float | None:
        """Count ``peak`` into the end-of-fit summary; returns it as a fraction of the budget (or capacity)."""
        limit = budget if budget is not None else capacity
        if limit <= 0:
            return None
        fraction = peak / limit
        self._fit_summary.add_peak(fraction, "budget" if budget is not None else "capacity")
        return fraction

    def _noise_metrics(self) -> dict[str, float]:
        estimate = (self._noise_in_use or self.noise_scale).value()
        if not self.gradient_noise_scale or estimate.windows == 0:
            return {}
        return {
            keys.GRADIENT_NOISE_SCALE: estimate.gradient_noise_scale,
            keys.GRAD_SQ_NORM: estimate.grad_sq_norm,
            keys.GRAD_TRACE_COV: estimate.trace_cov,
            keys.NOISE_SCALE_SKIPPED: estimate.skipped,
        }

    @override
    def state_dict(self) -> dict[str, Any]:
        # The noise-scale estimate is a moving average over windows: a resumed run continues it.
        return {"noise_scale": self.noise_scale.state_dict()} if self.gradient_noise_scale else {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.noise_scale.load_state_dict(state_dict.get("noise_scale", {}))

    def _window_loss(self, interval: IntervalTotals) -> float:
        """The item-weighted mean loss of the interval over all ranks (``nan`` when no loss was seen)."""
        device = self._loss.device
        weight = torch.as_tensor(interval.loss.items, dtype=torch.float32, device=device)
        total = torch.as_tensor(interval.loss.total, dtype=torch.float32).to(device)
        # Every rank updates, also with nothing, so that compute() syncs the same way on all of them.
        self._loss.update(torch.where(weight > 0, total / weight.clamp(min=1e-30), torch.zeros_like(total)), weight)
        window_loss = float(self._loss.compute())
        self._loss.reset()
        return window_loss

    def _memory(self, trainer: pl.Trainer, owner_peak: int) -> tuple[int, int | None, int]:
        """The interval's peak, reserved peak and capacity, each the maximum over ranks; resets the peak."""
        if self._backend is None:  # a Trainer that skipped `setup`; read the capacity once all the same
            self._backend = backend_for(trainer.strategy.root_device)
            self._capacity_bytes = self._backend.capacity_bytes()
        backend = self._backend
        reserved = backend.peak_reserved_bytes()
        self._last_peak = max(owner_peak, backend.peak_bytes())  # this rank's, for per-rank memory
        local = torch.tensor(
            [self._last_peak, -1 if reserved is None else reserved, self._capacity_bytes],
            dtype=torch.int64,
        )
        peak, peak_reserved, capacity = (int(v) for v in max_across_ranks(trainer, local).tolist())
        backend.reset_peak()
        return peak, None if peak_reserved < 0 else peak_reserved, capacity
