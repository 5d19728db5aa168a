"""``AccumulationMonitor``: batch, memory, recovery and throughput figures at every optimizer step, to every logger."""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from typing_extensions import override

from lightning_accum import _compat
from lightning_accum.distributed import max_across_ranks, sum_across_ranks_fn
from lightning_accum.memory.backends import MemoryBackend, backend_for
from lightning_accum.monitoring import StepFigures, WeightedMean, budget_fraction, event_metrics
from lightning_accum.normalization import count_items
from lightning_accum.splitting import resolve_batch_hooks
from lightning_accum.state import AccumulationState, find_state


class AccumulationMonitor(Callback):
    """Logs what accumulation did at every optimizer step (or every ``logging_interval`` steps) to every logger.

    The figures are global: batch and item counts are summed over ranks, memory is the largest peak of any rank.
    They come from the callback that owns accumulation (``AccumulationScheduler`` or ``AutoMicroBatching``) when one
    is in the Trainer, and are counted from the batches otherwise (plain ``Trainer(accumulate_grad_batches=k)``).
    Metrics go to every logger in ``trainer.loggers`` on rank zero, on Lightning's own step axis: the step that
    ``self.log``, ``LearningRateMonitor`` and ``ThroughputMonitor`` use for the same optimizer step (the first step
    is 0). They also reach ``trainer.callback_metrics`` (through ``self.log(..., logger=False)``), so
    ``ModelCheckpoint(monitor="accum/window_loss")`` and ``EarlyStopping`` can watch them. With a ``WandbLogger``,
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
        ``events/*``                        size after   at the logging step that follows the event
        ==================================  ===========  ==================================================

    Args:
        logging_interval: log every this many optimizer steps; ``None`` (the default) follows
            ``Trainer(log_every_n_steps)``, as Lightning's own monitors do. Throughput, peak memory and the window
            loss cover the whole interval; batch figures describe its last step.

    Raises:
        TypeError: ``logging_interval`` is not an int.
        ValueError: ``logging_interval < 1``.

    Examples:
        >>> from lightning.pytorch import Trainer
        >>> from lightning_accum import AccumulationScheduler
        >>> monitor = AccumulationMonitor(logging_interval=10)
        >>> trainer = Trainer(callbacks=[AccumulationScheduler(4), monitor], enable_progress_bar=False)
    """

    def __init__(self, logging_interval: int | None = None) -> None:
        if logging_interval is not None and (
            isinstance(logging_interval, bool) or not isinstance(logging_interval, int)
        ):
            raise TypeError(
                f"`logging_interval` must be an int (optimizer steps) or None (follow `Trainer(log_every_n_steps)`),"
                f" got {logging_interval!r} of type {type(logging_interval).__name__}."
            )
        if logging_interval is not None and logging_interval < 1:
            raise ValueError(
                f"`logging_interval` must be >= 1 (log every that many optimizer steps), got {logging_interval}."
            )
        self.logging_interval = logging_interval
        self._backend: MemoryBackend | None = None
        self._capacity_bytes = 0
        self._owner: Any = None
        self._loss = WeightedMean()  # syncs across ranks at logging steps
        self._hooks = resolve_batch_hooks(None)
        self._reset_fit_counters()

    def _reset_fit_counters(self) -> None:
        self._last_step = 0
        # The window loss, summed over items since the last logging step on this rank. Plain tensors, not a metric
        # update per micro-batch: a torchmetrics update costs tens of microseconds, and a tiny step not much more.
        self._loss_sum: Tensor | None = None
        self._loss_weight: Tensor | float = 0.0
        # Counted from the batches, for when no callback owns accumulation (all local to this rank).
        self._window_samples = 0
        self._window_micro_batches = 0
        self._window_first_size = 0
        self._last_window = (0, 0, 0)  # (samples, micro-batches, first micro-batch size) of the last step
        self._interval_local_samples = 0
        # Taken from the owner's state, already global.
        self._interval_samples = 0.0
        self._interval_items = 0.0
        self._interval_start = time.perf_counter()
        self._interval_peak = 0  # this rank's peak over the steps of the interval, where an owner resets the peak
        self._excluded_seconds = 0.0
        self._validation_start: float | None = None

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
        self._loss.reset()
        self._hooks = resolve_batch_hooks(pl_module)  # counts samples when no callback owns accumulation

    def _setup_wandb(self, trainer: pl.Trainer) -> None:
        if trainer.is_global_zero and any(isinstance(lg, WandbLogger) for lg in trainer.loggers):
            from lightning_accum.integrations.wandb import define_metrics, record_config

            settings = self._settings(trainer)
            for logger in trainer.loggers:
                if isinstance(logger, WandbLogger):
                    define_metrics(logger.experiment)
                    record_config(logger.experiment, settings)

    def _settings(self, trainer: pl.Trainer) -> dict[str, Any]:
        state = find_state(trainer.callbacks)
        if state is not None:
            settings = dict(state.settings)  # a copy: the owner's dict is not ours to change
        else:
            settings = {"mode": "lightning", "accumulate_grad_batches": trainer.accumulate_grad_batches}
        settings["world_size"] = trainer.world_size
        settings["monitor_logging_interval"] = self.logging_interval or trainer.log_every_n_steps
        return settings

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._reset_fit_counters()
        self._last_step = trainer.global_step
        self._owner = _find_owner(trainer)
        # Here, not at fit start: AutoMicroBatching resolves its memory budget (its settings) in its on_train_start,
        # which runs before ours because the owner moves itself to the front of the callbacks.
        self._setup_wandb(trainer)
        self._loss.reset()
        if self._backend is not None:
            self._backend.reset_peak()
        self._interval_start = time.perf_counter()

    # Validation inside fit is not training throughput.
    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == TrainerFn.FITTING:
            self._validation_start = time.perf_counter()

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._validation_start is not None:
            self._excluded_seconds += time.perf_counter() - self._validation_start
            self._validation_start = None

    # ----------------------------------------------------------------------------------------------------------
    # every micro-batch: host-side counting only
    # ----------------------------------------------------------------------------------------------------------
    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        owner = self._owner
        state = owner.accumulation_state if owner is not None else None
        if state is None:
            n_samples = self._hooks.batch_size(batch)
            if self._window_micro_batches == 0:
                self._window_first_size = n_samples
            self._window_samples += n_samples
            self._window_micro_batches += 1
            self._interval_local_samples += n_samples
        if not _provides_window_loss(state):
            self._update_loss_from_outputs(trainer, owner, outputs, batch)

        if trainer.global_step == self._last_step:
            return  # still inside the window
        self._last_step = trainer.global_step
        if state is None:
            self._last_window = (self._window_samples, self._window_micro_batches, self._window_first_size)
            self._window_samples = self._window_micro_batches = 0
        else:
            self._interval_samples += state.samples_per_step
            self._interval_items += state.items_per_step
            if state.mode == "split" and self._backend is not None:
                # AutoMicroBatching resets the (process-wide) peak at every step batch to plan the next one, so the
                # interval's peak is the maximum of the per-step peaks, read before that reset.
                self._interval_peak = max(self._interval_peak, self._backend.peak_bytes())
            if _provides_window_loss(state):
                self._add_loss(state.window_loss_sum, state.window_items)
        step = _compat.logging_step(trainer)
        interval = self.logging_interval if self.logging_interval is not None else trainer.log_every_n_steps
        if interval > 0 and (step + 1) % interval == 0:
            self._log(trainer, pl_module, state, step)

    def _update_loss_from_outputs(self, trainer: pl.Trainer, owner: Any, outputs: Any, batch: Any) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if not isinstance(loss, Tensor):
            return  # training_step skipped this micro-batch
        counted = owner.accumulation_state.micro_batch_items if owner is not None else None
        if counted is not None:
            n_items = counted
        else:
            counter = getattr(owner, "count_items", None)
            n_items = self._hooks.batch_size(batch) if counter is None else count_items(batch, counter)
        # Lightning divided the training_step loss by `accumulate_grad_batches` before handing it on; undo that.
        k = trainer.accumulate_grad_batches
        # (Split mode never gets here: its owner provides the window loss, see `_provides_window_loss`.)
        if getattr(owner, "loss_reduction", "mean") == "sum":
            self._add_loss(loss.detach() * k, n_items)
        elif isinstance(n_items, Tensor):
            self._add_loss(loss.detach() * k * n_items, n_items)
        elif n_items > 0:  # an empty micro-batch has a NaN mean and nothing to add
            self._add_loss(loss.detach() * (k * n_items), n_items)

    def _add_loss(self, total: Tensor | float, n_items: Tensor | float) -> None:
        """Add the summed loss ``total`` over ``n_items`` items, without reading anything back from the device."""
        total = torch.as_tensor(total, dtype=torch.float32).detach()
        if isinstance(n_items, Tensor):
            n_items = n_items.to(device=total.device, dtype=torch.float32)
            total = torch.where(n_items > 0, total, torch.zeros_like(total))  # no NaN from an empty micro-batch
        if self._loss_sum is None:
            self._loss_sum = total.clone()
        else:
            self._loss_sum += total.to(self._loss_sum.device)
        self._loss_weight = self._loss_weight + n_items

    # ----------------------------------------------------------------------------------------------------------
    # logging steps: the only place that synchronizes
    # ----------------------------------------------------------------------------------------------------------
    def _log(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, state: AccumulationState | None, step: int
    ) -> None:
        # Every rank runs this block in the same order: it holds collectives.
        device = self._loss.device
        weight = torch.as_tensor(self._loss_weight, dtype=torch.float32, device=device)
        total = self._loss_sum.to(device) if self._loss_sum is not None else torch.zeros((), device=device)
        # Every rank updates, also with nothing, so that compute() syncs the same way on all of them.
        self._loss.update(torch.where(weight > 0, total / weight.clamp(min=1e-30), torch.zeros_like(total)), weight)
        window_loss = float(self._loss.compute())  # syncs ranks and the device, so the clock below is honest
        self._loss.reset()
        self._loss_sum, self._loss_weight = None, 0.0
        now = time.perf_counter()

        if state is None:
            samples, micro_batches, first_size = self._last_window
            local = torch.tensor([samples, self._interval_local_samples], dtype=torch.float64)
            sum_fn = sum_across_ranks_fn(trainer)
            step_samples, interval_samples = (sum_fn(local) if sum_fn is not None else local).tolist()
            figures_batch: dict[str, Any] = {
                "samples_per_step": int(step_samples),
                "micro_batch_size": first_size,
                "accumulation_steps": micro_batches,
                "items_per_step": step_samples,  # without an owner there is no item counter: items are samples
                "oom_retries": 0,
            }
            interval_items = interval_samples
        else:
            figures_batch = {
                "samples_per_step": state.samples_per_step,
                "micro_batch_size": state.micro_batch_size,
                "accumulation_steps": state.accumulation_steps,
                "items_per_step": state.items_per_step,
                "oom_retries": state.oom_retries,
            }
            interval_samples, interval_items = self._interval_samples, self._interval_items

        if self._backend is None:  # a Trainer that skipped `setup`; read the capacity once all the same
            self._backend = backend_for(trainer.strategy.root_device)
            self._capacity_bytes = self._backend.capacity_bytes()
        backend = self._backend
        reserved = backend.peak_reserved_bytes()
        local_memory = torch.tensor(
            [
                max(self._interval_peak, backend.peak_bytes()),
                -1 if reserved is None else reserved,
                self._capacity_bytes,
            ],
            dtype=torch.int64,
        )
        peak, peak_reserved, capacity = max_across_ranks(trainer, local_memory).tolist()
        backend.reset_peak()
        events = state.take_events() if state is not None else []

        figures = StepFigures(
            **figures_batch,
            window_loss=window_loss,
            peak_bytes=peak,
            capacity_bytes=capacity,
            peak_reserved_bytes=None if peak_reserved < 0 else peak_reserved,
            budget_fraction=_budget_fraction(state, capacity),
            interval_samples=interval_samples,
            interval_items=interval_items,
            interval_seconds=now - self._interval_start - self._excluded_seconds,
        )
        metrics = {**figures.as_metrics(), **event_metrics(events)}
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)
        # Into `trainer.callback_metrics` (every rank holds the same global figures) for ModelCheckpoint and
        # EarlyStopping; the loggers were served above, at this step, so Lightning must not log them again.
        pl_module.log_dict(
            {key: float(value) for key, value in figures.as_metrics().items()},
            logger=False,
            on_step=True,
            on_epoch=False,
            batch_size=1,
        )

        self._interval_local_samples = 0
        self._interval_peak = 0
        self._interval_samples = self._interval_items = 0.0
        self._excluded_seconds = 0.0
        self._interval_start = time.perf_counter()

    # ----------------------------------------------------------------------------------------------------------
    # checkpointing
    # ----------------------------------------------------------------------------------------------------------
    @override
    def state_dict(self) -> dict[str, Any]:
        # Every figure is per interval and restarts with the run, so only the settings are saved.
        return {"version": 1, "logging_interval": self.logging_interval}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # The constructor argument wins over the checkpoint: a resumed run may log at a new interval on purpose.
        return None


def _find_owner(trainer: pl.Trainer) -> Any | None:
    """The callback that owns accumulation (it exposes an `AccumulationState`), if any."""
    for callback in trainer.callbacks:
        if isinstance(getattr(callback, "accumulation_state", None), AccumulationState):
            return callback
    return None


def _provides_window_loss(state: AccumulationState | None) -> bool:
    # Split mode runs its micro-batches inside one Lightning batch, so only the owner knows their losses.
    return state is not None and state.window_loss_sum is not None


def _budget_fraction(state: AccumulationState | None, capacity_bytes: int) -> float:
    # AutoMicroBatching records its budget resolved to bytes; `max_memory` (a fraction or bytes) is the user's form.
    settings = state.settings if state is not None else {}
    budget_bytes = settings.get("max_memory_bytes")
    if isinstance(budget_bytes, (int, float)) and not isinstance(budget_bytes, bool):
        return budget_fraction(int(budget_bytes), capacity_bytes)
    max_memory = settings.get("max_memory")
    if isinstance(max_memory, bool) or not isinstance(max_memory, (int, float)):
        max_memory = None
    return budget_fraction(max_memory, capacity_bytes)
