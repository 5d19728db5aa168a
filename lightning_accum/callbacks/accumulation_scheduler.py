"""``AccumulationScheduler``: exact, schedulable gradient accumulation in Lightning's own loop (window mode)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_accum import _compat
from lightning_accum._util.cli_types import ImportPath, Milestones, PositiveInt
from lightning_accum._util.log import log_info
from lightning_accum.callbacks._owner import AccumulationOwner
from lightning_accum.callbacks._window_checks import SAMPLE_COUNT_WITH_IGNORED_LABELS, holds_ignored_labels
from lightning_accum.core.engine import ClosedWindow, Ranks
from lightning_accum.core.normalization import ItemCounter, LossReduction
from lightning_accum.core.step_report import LossSum
from lightning_accum.core.stepping import count_optimizer_steps
from lightning_accum.schedules import (
    AccumulationSchedule,
    ConstantSchedule,
    ScheduleUnit,
    as_schedule,
)
from lightning_accum.sequences.loaders import weigh_shares


class AccumulationScheduler(AccumulationOwner):
    """Exact gradient accumulation with a schedule for ``k``, in Lightning's own training loop.

    The dataloader yields micro-batches; this callback decides how many make one optimizer step and makes every
    step's gradient equal to the gradient of the mean loss over all items of the window on all ranks. That holds for
    the short last window of an epoch, for micro-batches of uneven size, for token losses (``count_items``) and under
    DDP and FSDP2 (``ModelParallelStrategy`` with ``fully_shard``), where gradients are all-reduced or reduce-scattered
    once per optimizer step. Gradient clipping sees the exact gradient.

    A change of ``k`` takes effect at the next window boundary, also mid-epoch, and is logged. Windows never cross an
    epoch boundary. ``trainer.estimated_stepping_batches`` counts the optimizer steps the schedule really takes
    (short tail windows and changes of ``k`` included), so LR schedules sized from it in ``configure_optimizers``
    end where training ends.

    Args:
        schedule: ``k`` as an int; a ``{key: k}`` mapping whose keys ``unit`` reads; a schedule object with an
            ``accumulation_steps(progress)`` method (e.g. `lightning_accum.schedules.BatchSizeRamp`); or
            ``None`` to adopt ``Trainer(accumulate_grad_batches)``.
        unit: what mapping keys count: ``"epoch"``, ``"step"`` (optimizer steps) or ``"sample"`` (consumed samples,
            all ranks).
        count_items: counts what the loss averages over in a micro-batch, e.g.
            ``lambda b: (b["labels"] != -100).sum()``. Default: the number of samples.
        loss_reduction: whether ``training_step`` returns the ``"mean"`` or the ``"sum"`` of the loss over the items
            of its micro-batch.
        sync_every_micro_batch: all-reduce (or reduce-scatter) gradients after every micro-batch instead of once per
            step. It costs communication and, under FSDP, saves memory: with the default, every rank holds the
            unsharded gradients of the whole model through the window, since the sync is deferred to its last
            micro-batch.

    Raises:
        TypeError: ``schedule`` or one of its keys or values has the wrong type, or ``sync_every_micro_batch`` is
            not a bool.
        ValueError: ``k < 1``, schedule keys negative or not increasing, an unknown ``unit`` or ``loss_reduction``,
            or ``schedule`` given together with ``Trainer(accumulate_grad_batches > 1)``.
        RuntimeError: manual optimization (use `lightning_accum.ManualAccumulation`), a strategy that
            accumulates by itself (DeepSpeed), Lightning's ``GradientAccumulationScheduler`` in the same Trainer, or
            `lightning_accum.schedules.AdaptiveBatchSize` with ``sync_every_micro_batch=True`` on several ranks
            (the noise scale it follows needs each rank's own first micro-batch).

    A window whose micro-batches hold no items at all (everything masked) has no mean: its optimizer step is skipped
    (every gradient is set to ``None``, so the optimizer leaves the parameters and their state alone).

    Examples:
        >>> from lightning.pytorch import Trainer
        >>> scheduler = AccumulationScheduler({0: 2, 100: 4}, unit="step")
        >>> trainer = Trainer(callbacks=[scheduler], logger=False, enable_progress_bar=False)
    """

    def __init__(
        self,
        schedule: PositiveInt | Milestones | AccumulationSchedule | None = None,
        *,
        unit: ScheduleUnit = "epoch",
        count_items: ItemCounter | ImportPath | None = None,
        loss_reduction: LossReduction = "mean",
        sync_every_micro_batch: bool = False,
    ) -> None:
        self.schedule = as_schedule(schedule, unit)  # as given; `None` adopts the Trainer's at setup
        super().__init__(count_items, loss_reduction, self.schedule)
        self.unit: ScheduleUnit = unit
        if not isinstance(sync_every_micro_batch, bool):
            raise TypeError(
                f"`sync_every_micro_batch` must be a bool, got {sync_every_micro_batch!r} of type"
                f" {type(sync_every_micro_batch).__name__}. Pass True to sync gradients after every micro-batch,"
                " False (the default) to sync once per optimizer step."
            )
        self.sync_every_micro_batch = sync_every_micro_batch

        self._position = 0  # index of the current micro-batch within its window
        self._new_window = True
        self._stepped = False
        self._pending_counts: tuple[int | float | Tensor, int] = (0, 0)
        self._window_loss = LossSum()  # this rank's loss over the window's items, for the step report
        self._closed: ClosedWindow | None = None
        self._trainer_k = 1  # what the Trainer was configured with, restored at teardown
        self._trainer: pl.Trainer | None = None
        self._labels_checked = False  # `SAMPLE_COUNT_WITH_IGNORED_LABELS`: the first batch's labels, once per callback

    @property
    def _active_schedule(self) -> AccumulationSchedule:
        """The schedule in use: the one given, or the Trainer's ``accumulate_grad_batches`` adopted at setup."""
        return self.engine.schedule.schedule

    @property
    def _k(self) -> int:
        return self.engine.schedule.k

    @override
    def _syncs_first_micro_batch(self, trainer: pl.Trainer) -> bool:
        return self.sync_every_micro_batch and trainer.world_size > 1

    # ----------------------------------------------------------------------------------------------------------
    # setup and teardown
    # ----------------------------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._trainer_k = trainer.accumulate_grad_batches
        self._trainer = trainer
        self._validate(trainer, pl_module)
        if self.schedule is None:
            self.engine.schedule.adopt(ConstantSchedule(trainer.accumulate_grad_batches))
        if self.engine.schedule.adaptive is not None:
            self.measure_noise_scale()  # k follows the measured noise scale
        self.engine.resolve_hooks(pl_module)  # the module's `batch_size_of` method, if it has one
        self._claim(trainer)
        # LR schedules sized from `estimated_stepping_batches` in `configure_optimizers` (which runs after this hook)
        # must see the steps this schedule really takes, not Lightning's k=1 estimate.
        self._install(_compat.override_estimated_stepping_batches(trainer, self._estimate_optimizer_steps))

    @override
    def settings(self) -> dict[str, Any]:
        return {
            "mode": "window",
            "schedule": repr(self._active_schedule),
            # What the schedule's keys count (a ramp counts samples whatever `unit` says); None: k never changes.
            "unit": self.engine.schedule.unit,
            **super().settings(),
            "sync_every_micro_batch": self.sync_every_micro_batch,
        }

    def _validate(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not pl_module.automatic_optimization:
            raise RuntimeError(
                "`AccumulationScheduler` works with automatic optimization, but this LightningModule sets"
                " `automatic_optimization = False`. Under manual optimization use `lightning_accum.ManualAccumulation`"
                " inside `training_step` instead."
            )
        if trainer.strategy.handles_gradient_accumulation or "deepspeed" in type(trainer.strategy).__name__.lower():
            name = type(trainer.strategy).__name__
            # Lightning writes `accumulate_grad_batches` into DeepSpeed's config as `gradient_accumulation_steps` and
            # refuses that key in a user's config (`DeepSpeedStrategy._format_batch_size_and_grad_accum_config`).
            raise RuntimeError(
                f"`AccumulationScheduler` cannot run with {name}: that strategy accumulates gradients by itself"
                f" (`Trainer(strategy={name}(...))`). Remove the callback and set `Trainer(accumulate_grad_batches=k)`,"
                " which Lightning hands to the strategy (DeepSpeed's `gradient_accumulation_steps`; leave that key out"
                " of the DeepSpeed config). For exact token-weighted windows, shard with `ModelParallelStrategy` and"
                " `fully_shard` (FSDP2) instead, which this callback supports."
            )
        if any(isinstance(cb, GradientAccumulationScheduler) for cb in trainer.callbacks):  # type: ignore[attr-defined]  # undeclared on Lightning's Trainer
            raise RuntimeError(
                "`AccumulationScheduler` and Lightning's `GradientAccumulationScheduler` both want to own `k`."
                " Remove `GradientAccumulationScheduler` and pass its `scheduling` dict as `schedule=`."
            )
        if self.engine.schedule.adaptive is not None and self._syncs_first_micro_batch(trainer):
            raise RuntimeError(
                f"`AccumulationScheduler({self.schedule!r}, sync_every_micro_batch=True)` on {trainer.world_size}"
                " ranks would never adapt k: the noise scale is measured from each rank's own first micro-batch, and"
                " syncing every micro-batch averages it over the ranks before it can be read. Remove"
                " `sync_every_micro_batch=True`, or use a fixed schedule."
            )
        if self.schedule is not None and trainer.accumulate_grad_batches != 1:
            raise ValueError(
                f"`Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches})` is set together with"
                f" `AccumulationScheduler(schedule={self.schedule!r})`. Set k in one place: remove"
                " `accumulate_grad_batches` from the Trainer, or pass `schedule=None` to adopt it."
            )

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._install(
            _compat.install_window_control(
                trainer,
                window_complete=lambda: self._position >= self._k - 1,
                window_start=lambda: self._position == 0,
            )
        )
        if self.sync_every_micro_batch:
            self._install(_compat.disable_backward_sync_blocking(trainer.strategy))
        else:
            # Lightning blocks DDP's and FSDP1's sync on all micro-batches but a window's last; FSDP2's needs this.
            self._install(_compat.block_fsdp2_backward_sync(trainer.strategy))
        self._new_window = True
        # Every rank's loss is weighed by its count: a `BalancedBatchSampler`'s unequal shares give the exact update.
        weigh_shares(trainer.train_dataloader, "AccumulationScheduler")

    def _estimate_optimizer_steps(self, batches_per_epoch: int) -> int:
        trainer = self._trainer
        assert trainer is not None
        loader = trainer.train_dataloader
        micro_batch_size = getattr(loader, "batch_size", None) or self.engine.schedule.micro_batch_size or 1
        sampler = getattr(loader, "sampler", None)
        samples_per_epoch = batches_per_epoch * micro_batch_size
        if sampler is not None and hasattr(sampler, "__len__"):
            samples_per_epoch = min(len(sampler), samples_per_epoch)  # the last micro-batch may be short
        return count_optimizer_steps(
            self._active_schedule,
            batches_per_epoch=batches_per_epoch,
            max_epochs=trainer.max_epochs or 1,
            max_steps=trainer.max_steps,
            micro_batch_size=micro_batch_size,
            samples_per_epoch=samples_per_epoch,
            world_size=trainer.world_size,
        )

    @override
    def _restore(self, trainer: pl.Trainer) -> None:
        super()._restore(trainer)
        trainer.accumulate_grad_batches = self._trainer_k
        self._trainer = None

    # ----------------------------------------------------------------------------------------------------------
    # the window
    # ----------------------------------------------------------------------------------------------------------
    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._new_window = True  # windows never cross an epoch boundary
        weigh_shares(trainer.train_dataloader, "AccumulationScheduler")  # a loader reloaded this epoch too

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        # Counted now, added at backward time: a micro-batch whose `training_step` returns None has no backward and
        # no items.
        n_items, n_samples = self.engine.count(batch)
        if not self._labels_checked:
            self._labels_checked = True
            self._warn_about_the_sample_count(batch)
        if self._new_window or self._stepped:
            self._start_window(trainer, n_samples)
        else:
            self._position += 1
        self._stepped = False
        self._pending_counts = (n_items, n_samples)

    def _warn_about_the_sample_count(self, batch: Any) -> None:
        """Warn where samples are counted for a mean loss over labels that ignore tokens (rank 0's first batch)."""
        if self.count_items is None and self.loss_reduction == "mean" and holds_ignored_labels(batch):
            rank_zero_warn(SAMPLE_COUNT_WITH_IGNORED_LABELS)

    def _start_window(self, trainer: pl.Trainer, n_samples: int) -> None:
        self._new_window = False
        self._position = 0
        self._window_loss = LossSum()
        plan = self.engine.plan_window(
            epoch=trainer.current_epoch, step=trainer.global_step, n_samples=n_samples, ranks=Ranks.of(trainer)
        )
        if plan.change is not None:
            # The schedule's learning-rate rule for a change of k (`AdaptiveBatchSize(lr_scaling=...)`).
            schedulers = [c.scheduler for c in trainer.lr_scheduler_configs]
            plan.scale_learning_rates(trainer.optimizers, schedulers)
            self._record(plan.change)
        trainer.accumulate_grad_batches = plan.k

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        weight = self.engine.add(*self._pending_counts)
        # Lightning divided the loss by k; replace that by the window weight.
        multiplier = weight * _compat.lightning_loss_divisor(trainer)
        if not (isinstance(multiplier, float) and multiplier == 1.0):
            loss.register_hook(lambda grad: grad * multiplier)

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        self._closed = self._close_window(trainer, optimizer)
        self._stepped = True
        if self._closed.totals.items <= 0:
            log_info(f"lightning_accum: window at step {trainer.global_step} has no items; optimizer step skipped")

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, Tensor):  # None: `training_step` skipped this micro-batch
            # Lightning hands on the loss divided by k; the window loss wants the user's own value.
            self._window_loss.add(
                loss, self._pending_counts[0], self.loss_reduction, scale=_compat.lightning_loss_divisor(trainer)
            )
        if not self._stepped or self._closed is None:
            return
        closed, self._closed = self._closed, None
        self._publish_step("window", self.engine.schedule.micro_batch_size, closed, self._window_loss)

    # ----------------------------------------------------------------------------------------------------------
    # checkpointing
    # ----------------------------------------------------------------------------------------------------------
    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._new_window = True
