"""``AccumulationMonitor``: batch, memory, recovery and throughput figures at every optimizer step, to every logger.

Glue only: the totals live in `lightning_accum.monitor.totals` and what is logged, shown and warned about is
built in `lightning_accum.monitor.metrics`, both Trainer-free; this callback reads the Trainer and runs the collectives.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_accum import _compat, keys
from lightning_accum._util.cli_types import Decay, PositiveInt
from lightning_accum._util.validation import check_bool, check_int
from lightning_accum.batches import resolve_batch_hooks
from lightning_accum.callbacks._owner import AccumulationOwner, find_owner
from lightning_accum.core.engine import Ranks
from lightning_accum.core.noise_scale import NoiseScaleEstimator
from lightning_accum.integrations.wandb import define_metrics, record_config, record_event_counts
from lightning_accum.monitor.metrics import (
    NOISE_SCALE_NEEDS_AN_OWNER,
    AccumulationMetrics,
    check_key_prefix,
    check_logging_interval,
    late_reader_warnings,
    progress_bar_batch,
    run_config,
)
from lightning_accum.monitor.rows import every_step_keys
from lightning_accum.monitor.totals import LightningWindows


class AccumulationMonitor(Callback):
    """Logs what accumulation did at every optimizer step (or every ``logging_interval`` steps) to every logger.

    The figures are global: counts summed over ranks, memory the largest peak of any rank. They come from the callback
    that owns accumulation (``AccumulationScheduler`` or ``AutoMicroBatching``), or are counted from the batches when
    there is none (plain ``Trainer(accumulate_grad_batches=k)``). Every logger in ``trainer.loggers`` gets them on rank
    zero, on Lightning's own step axis: the step ``self.log`` and ``LearningRateMonitor`` use (the first step is 0).
    They also reach ``trainer.callback_metrics`` for ``ModelCheckpoint`` and ``EarlyStopping``: at a logging step,
    what the loggers got; at the other steps, what needs no collective and no host read (the batch figures, and on one
    process the window loss so far: `lightning_accum.monitor.rows.every_step_keys`). Memory and throughput are
    figures of a logging interval; a ``ModelCheckpoint`` that would read one between logging steps is warned about.
    With a ``WandbLogger``, the keys are defined against ``trainer/global_step`` and the settings go into the run config
    under ``lightning_accum``. The device is synchronized at logging steps only (memory, the window loss, a few small
    all-reduces), never per micro-batch.

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
        ``perf/train_seconds``              s            every logging step: the run's training time,
                                                         validation excluded (carried by a checkpoint)
        ``memory/alloc_retries``            count        every logging step, CUDA/XPU only, cumulative
        ``memory/rank{r}/peak_gib``         GiB          with ``per_rank_memory=True``: each rank's peak
        ``accum/gradient_noise_scale``      items        with ``gradient_noise_scale=True`` (also
                                                         ``accum/grad_sq_norm``, ``accum/grad_trace_cov``,
                                                         ``accum/noise_scale_skipped``)
        ``accum/micro_batch_tokens``        tokens       split by tokens, every logging step: the token
                                                         budget of the last step (max over ranks)
        ``accum/padding_fraction``          fraction     split by tokens, every logging step: the last
                                                         step's positions computed that held no real
                                                         token, all ranks
        ``accum/rank_imbalance``            ratio        split mode on several ranks, every logging step: the
                                                         last step's slowest rank's cost over the mean rank's
        ``perf/sync_wait_seconds``          s            split mode on several ranks, every logging step: the
                                                         longest any rank waited at the last step's sync
        ``accum/price_error``               ratio        dealt by a ``BalancedBatchSampler`` on several ranks,
                                                         every logging step: the slowest rank's measured
                                                         compute over the mean's, over the priced imbalance
        ``events/*``                        size after   at the logging step that follows the event
                                                         (samples; split by tokens, the token budget);
                                                         after fit, in ``callback_metrics``: the count
        ==================================  ===========  ==================================================

    Args:
        logging_interval: log every this many optimizer steps; ``None`` (the default) follows
            ``Trainer(log_every_n_steps)``, as Lightning's own monitors do. Throughput, peak memory and the window
            loss cover the whole interval; batch figures describe its last step.
        gradient_noise_scale: also log the gradient noise scale (needs an accumulation owner): ``B_simple =
            tr(Σ)/|G|²`` in items (McCandlish et al. 2018), ``|G|²``, ``tr(Σ)`` and the estimates left out as NaN or
            inf. Unbiased estimates from each window's first micro-batch and whole window (at least two micro-batches),
            smoothed over windows; where the schedule follows the noise scale
            (`lightning_accum.schedules.AdaptiveBatchSize`), the schedule's own average, which decides ``k``.
        noise_scale_beta: the moving average's decay per window, in ``[0, 1)``.
        noise_scale_interval: measure the windows whose optimizer step (from 0) is a multiple of this, so that a
            resumed run measures the windows an uninterrupted one does. Each measurement then
            weighs as much as the ``n`` windows it stands for, so the average covers the same span of training; the
            estimate stays unbiased, and its cost (two gradient norms per measured window) falls ``n``-fold.
        progress_bar: show the micro-batch size (``mb``), ``k``, the window loss (``window_loss``: the loss optimized,
            all ranks, where a module's own logged loss is one micro-batch's on rank 0) and the peak memory as a
            fraction of the budget
            (``mem/budget``; ``mem/capacity``, of the capacity, without a budget; updated at logging steps) in
            Lightning's progress bar; split by tokens, also the token budget (``mb_tokens``) and the padding (``pad``).
        summary: where the output is not a terminal (a file: no progress bar to watch), print a status line (step,
            throughput, peak memory) at a logging step once a minute at most; at the end of ``fit``, print one line
            (steps, effective batch, the micro-batch range and where it settled, or by tokens the token budget's and
            the mean padding, OOMs recovered and their steps, the peak against the budget, throughput) and log its
            figures to every logger's hyperparameters under ``lightning_accum_summary``.
        key_prefix: put in front of every logged key (the dashboard and the report read unprefixed keys).
        per_rank_memory: also log each rank's own peak, ``memory/rank{r}/peak_gib``.

    Raises:
        TypeError: ``logging_interval`` or ``noise_scale_interval`` is not an int, ``key_prefix`` not a str, a flag
            not a bool, or ``noise_scale_beta`` not a number.
        ValueError: ``logging_interval < 1``, ``noise_scale_interval < 1`` or ``noise_scale_beta`` outside ``[0, 1)``.
        RuntimeError: when training starts, ``gradient_noise_scale=True`` without an accumulation owner.

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
        self.logging_interval = check_logging_interval(logging_interval)
        self.gradient_noise_scale = check_bool(gradient_noise_scale, "gradient_noise_scale")
        self.noise_scale = NoiseScaleEstimator(noise_scale_beta)  # checks the beta
        self.noise_scale_interval = check_int(
            noise_scale_interval, "noise_scale_interval", 1, hint="It measures every that many windows; 1 is every."
        )
        self.progress_bar = check_bool(progress_bar, "progress_bar")
        self.summary = check_bool(summary, "summary")
        self.key_prefix = check_key_prefix(key_prefix)
        self.per_rank_memory = check_bool(per_rank_memory, "per_rank_memory")
        self._metrics = AccumulationMetrics(key_prefix, self.noise_scale, log_noise_scale=gradient_noise_scale)
        self._owner: AccumulationOwner | None = None
        self._hooks = resolve_batch_hooks(None)
        self._windows = LightningWindows()  # the reports of plain Lightning accumulation, when no owner publishes
        self._status_lines = False

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._metrics.setup(trainer.strategy.root_device)
            self._hooks = resolve_batch_hooks(pl_module)  # counts samples when no callback owns accumulation

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._owner = owner = find_owner(trainer.callbacks)  # type: ignore[attr-defined]  # undeclared on Lightning's Trainer
        noise_in_use = None
        if self.gradient_noise_scale:
            if owner is None:
                raise RuntimeError(NOISE_SCALE_NEEDS_AN_OWNER)
            owner.measure_noise_scale(every=self.noise_scale_interval)
            noise_in_use = owner.noise_scale_in_use()  # where a schedule follows it, its average: it decides k
        has_owner, noise = owner is not None, self.gradient_noise_scale
        tokens = owner is not None and owner.splits_by_tokens  # the token keys are logged
        wanted = every_step_keys(has_owner=has_owner, world_size=trainer.world_size, noise_scale=noise, tokens=tokens)
        self._warn_late_readers(trainer, wanted)
        self._windows = LightningWindows(trainer.global_step)
        self._status_lines = self.summary and not sys.stderr.isatty()
        # Here, not at fit start: the owner resolves its memory budget (part of its settings) in its on_train_start,
        # which runs before ours because the owner moves itself to the front of the callbacks.
        ranks = owner is not None and owner.splits_steps and trainer.world_size > 1  # the ranks' balance is logged
        self._setup_wandb(trainer, tokens=tokens, ranks=ranks)
        last = owner.last_step_report if owner is not None else None
        self._metrics.start(
            wanted, has_owner=has_owner, noise_in_use=noise_in_use, last_report=last, first_step=trainer.global_step
        )

    @property
    def _event_keys(self) -> tuple[str, ...]:
        return tuple(self.key_prefix + key for key in keys.EVENT_KEYS)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._metrics.stop()
        if self._metrics.fit.steps == 0:
            return
        # After `fit`, each event key holds how many such events the fit had, in `callback_metrics` as in the W&B
        # run summary (during it, the size after the event, at the logging step of the event only).
        counts = self._metrics.fit.event_counts
        _compat.set_callback_metrics(
            trainer, {self.key_prefix + key: float(counts.get(key, 0)) for key in keys.EVENT_KEYS}
        )
        for run in self._wandb_runs(trainer):  # each event key's run summary: how many such events the run had
            record_event_counts(run, counts, self.key_prefix)
        if not self.summary:
            return
        summary = self._metrics.finish(self._ranks(trainer))
        rank_zero_info(summary.text())
        if trainer.is_global_zero:  # as run-level values (W&B config, hparams.yaml), not as one more metric row
            for logger in trainer.loggers:
                logger.log_hyperparams({"lightning_accum_summary": summary.as_dict()})

    def _warn_late_readers(self, trainer: pl.Trainer, every_step: tuple[str, ...]) -> None:
        """Warn about each ``ModelCheckpoint`` that reads a key between the logging steps, where it is not refreshed."""
        readers = [
            (cb.monitor, *_compat.checkpoint_step_schedule(cb))
            for cb in trainer.callbacks  # type: ignore[attr-defined]  # undeclared on Lightning's Trainer
            if isinstance(cb, ModelCheckpoint) and isinstance(cb.monitor, str)
        ]
        every = self._logging_every(trainer)
        warnings = late_reader_warnings(readers, key_prefix=self.key_prefix, every_step=every_step, logging_every=every)
        for warning in warnings:
            rank_zero_warn(warning)

    def _wandb_runs(self, trainer: pl.Trainer) -> list[Any]:
        """The W&B runs of the Trainer's loggers, on rank zero (none on the others)."""
        loggers = trainer.loggers if trainer.is_global_zero else []
        return [logger.experiment for logger in loggers if isinstance(logger, WandbLogger)]

    def _setup_wandb(self, trainer: pl.Trainer, *, tokens: bool, ranks: bool) -> None:
        runs = self._wandb_runs(trainer)
        owner = self._owner.settings() if runs and self._owner is not None else None
        world_size, k, logging_every = trainer.world_size, trainer.accumulate_grad_batches, self._logging_every(trainer)
        settings = run_config(owner, accumulate_grad_batches=k, world_size=world_size, logging_every=logging_every)
        for run in runs:
            define_metrics(run, self.key_prefix, tokens=tokens, ranks=ranks)
            record_config(run, settings)

    # Validation inside fit is not training throughput.
    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == TrainerFn.FITTING:
            self._metrics.clock.pause()

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._metrics.clock.resume()

    # Every micro-batch: host-side counting only, unless a step ended.
    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        owner = self._owner
        if owner is not None:
            report = owner.last_step_report
        else:  # counted from the batches; Lightning divided the loss by `k`
            divisor = _compat.lightning_loss_divisor(trainer)
            report = self._windows.step_report(self._hooks.batch_size(batch), outputs, divisor, trainer.global_step)
        step = _compat.logging_step(trainer)  # this step's, on the run's axis (a resumed fit goes on counting)
        if report is None or not self._metrics.add(report, owner.noise_windows if owner is not None else 0, step=step):
            return  # still inside the window
        if self.progress_bar:  # what Lightning's TQDM and Rich bars show next to the loss
            _compat.set_progress_bar_metrics(trainer, progress_bar_batch(report))
        interval = self._logging_every(trainer)
        if interval > 0 and (step + 1) % interval == 0:
            self._log(trainer, step)
        else:  # what ModelCheckpoint and EarlyStopping can read at this step, with no collective and no host read
            # An event key holds its value at the logging step of its event only: none is left from an earlier one.
            _compat.set_callback_metrics(trainer, self._metrics.between_logging_steps(), drop=self._event_keys)

    def _logging_every(self, trainer: pl.Trainer) -> int:
        return self.logging_interval if self.logging_interval is not None else trainer.log_every_n_steps  # type: ignore[attr-defined]  # undeclared on Lightning's Trainer

    def _log(self, trainer: pl.Trainer, step: int) -> None:
        """A logging step: every rank runs it, in the same order (it holds collectives)."""
        strategy = trainer.strategy
        gather = (lambda t: strategy.all_gather(t.to(strategy.root_device))) if self.per_rank_memory else None
        allocator = strategy.root_device.type != "cpu"
        metrics = self._metrics.logging_step(self._ranks(trainer), gather, allocator=allocator)
        if self.progress_bar:
            _compat.set_progress_bar_metrics(trainer, {**self._metrics.loss_bar, **self._metrics.memory_bar})
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)
            # Output to a file (nohup, a batch job): no progress bar to watch, so a line now and then.
            line = self._metrics.status_line(step, time.monotonic()) if self._status_lines else None
            if line is not None:
                rank_zero_info(line)
        # Into `trainer.callback_metrics` (every rank holds the same global figures) for ModelCheckpoint and
        # EarlyStopping; the loggers were served above, at this step. The event keys of events not in this interval
        # go: left there, `events/oom_recovered: 1.0` (the size after an OOM long ago) would read as "one OOM".
        _compat.set_callback_metrics(trainer, metrics, drop=self._event_keys)
        self._metrics.new_interval()

    def _ranks(self, trainer: pl.Trainer) -> Ranks:
        self._metrics.ensure_memory(trainer.strategy.root_device)
        return Ranks.of(trainer)

    @override
    def state_dict(self) -> dict[str, Any]:
        # The run's training time goes on after a resume, as its step does. The noise-scale estimate is a moving
        # average over windows: a resumed run continues it.
        state: dict[str, Any] = {"train_seconds": self._metrics.train_seconds()}
        if self.gradient_noise_scale:
            state["noise_scale"] = self.noise_scale.state_dict()
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.noise_scale.load_state_dict(state_dict.get("noise_scale", {}))
        self._metrics.run_seconds = float(state_dict.get("train_seconds", 0.0))  # older checkpoints: none
