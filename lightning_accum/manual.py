"""``ManualAccumulation``: exact accumulation and one gradient sync per step under manual optimization."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities import rank_zero_deprecation
from torch import Tensor
from torch.optim import Optimizer

from lightning_accum import _compat
from lightning_accum._util.log import log_info
from lightning_accum.core.engine import AccumulationEngine, HoldsEngine, Ranks, WindowPlan
from lightning_accum.core.hand_window import HandWindow
from lightning_accum.core.normalization import ItemCounter, LossReduction, WindowTotals
from lightning_accum.core.step_report import AccumulationEvent
from lightning_accum.schedules import AccumulationSchedule, as_schedule


class ManualAccumulation(HoldsEngine):
    """Exact gradient accumulation for ``automatic_optimization = False``.

    Lightning refuses ``accumulate_grad_batches`` under manual optimization, and a hand-written loop all-reduces the
    gradients at every micro-batch. Call `backward` instead of ``self.manual_backward``: it weights the loss so
    that the window's gradient is the exact mean over all its items on all ranks, skips DDP's gradient sync on every
    micro-batch but the window's last, and returns ``True`` when the gradients are complete and the optimizer should
    step. The epoch's last batch always completes a window.

    With `lightning_accum.schedules.AdaptiveBatchSize` it measures the gradient noise scale in every window, as
    `lightning_accum.AccumulationScheduler` does (also under DDP and FSDP2), feeds it to the schedule after each
    complete window, and applies the schedule's learning-rate rule to its optimizer when ``k`` changes. Each change
    is logged and kept in ``events``.

    Args:
        schedule: ``k`` as an int, a ``{epoch: k}`` mapping, or a schedule object (as for
            `lightning_accum.AccumulationScheduler`), e.g. `lightning_accum.schedules.AdaptiveBatchSize`.
        count_items: counts the items of a micro-batch (default: its samples).
        loss_reduction: whether the loss passed in is the ``"mean"`` or the ``"sum"`` over the micro-batch's items.
        accumulation_steps: the former name of ``schedule`` (deprecated).

    Raises:
        TypeError, ValueError: as for `lightning_accum.AccumulationScheduler`'s ``schedule``.

    Examples:
        >>> import torch
        >>> from lightning.pytorch import LightningModule
        >>> class Model(LightningModule):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.automatic_optimization = False
        ...         self.layer = torch.nn.Linear(4, 1)
        ...         self.accumulation = ManualAccumulation(4)
        ...
        ...     def training_step(self, batch, batch_idx):
        ...         x, y = batch
        ...         loss = torch.nn.functional.mse_loss(self.layer(x), y)
        ...         optimizer = self.optimizers()
        ...         if self.accumulation.backward(self, loss, batch):
        ...             optimizer.step()
        ...             optimizer.zero_grad()
        ...
        ...     def configure_optimizers(self):
        ...         return torch.optim.SGD(self.parameters(), lr=0.1)
    """

    def __init__(
        self,
        schedule: int | Mapping[int, int] | AccumulationSchedule = 1,
        *,
        count_items: ItemCounter | str | None = None,
        loss_reduction: LossReduction = "mean",
        accumulation_steps: int | Mapping[int, int] | AccumulationSchedule | None = None,
    ) -> None:
        if accumulation_steps is not None:
            # The 0.1 name; `schedule` is what `AccumulationScheduler` calls the same thing.
            rank_zero_deprecation(
                "`ManualAccumulation(accumulation_steps=...)` is now `schedule=`; the old name goes in 0.3."
            )
            schedule = accumulation_steps
        self.engine = AccumulationEngine(count_items, loss_reduction, as_schedule(schedule, "epoch"))
        self.last_window: WindowTotals | None = None
        self.last_noise: tuple[float, float] | None = None  # the last window's (|G|², tr Σ), where measured
        self.optimizer_steps = 0  # complete windows: the step count that picks the measured windows
        self.events: list[AccumulationEvent] = []  # every change of k
        self.window = HandWindow(self.engine, "ManualAccumulation.backward")
        self._epoch = -1
        self._window_optimizer: weakref.ref[Optimizer] | None = None  # what the open window accumulates for
        self._hooks_resolved = False
        if self.engine.schedule.adaptive is not None:
            self.engine.noise.request()  # k follows the measured noise scale

    @property
    def schedule(self) -> AccumulationSchedule:
        return self.engine.schedule.schedule

    def backward(
        self,
        module: pl.LightningModule,
        loss: Tensor,
        batch: Any,
        *args: Any,
        optimizer: Optimizer | LightningOptimizer | None = None,
        **kwargs: Any,
    ) -> bool:
        """Back-propagate one micro-batch's ``loss`` with its exact weight; ``True`` when the optimizer should step.

        Args:
            module: the LightningModule whose ``training_step`` calls this.
            loss: the micro-batch's loss (its mean or sum over items, as ``loss_reduction`` says).
            batch: the micro-batch, for counting its items and samples.
            optimizer: the optimizer this helper accumulates for. Only its parameters are rescaled at the end of the
                window, so that one helper per optimizer (a GAN's generator and discriminator) never touches the
                other's gradients. Required when the module has more than one optimizer.
            *args: passed to ``module.manual_backward``.
            **kwargs: passed to ``module.manual_backward``.

        Raises:
            ValueError: the module has several optimizers and ``optimizer`` is not given, or the schedule returned
                something other than an int >= 1.
        """
        trainer, engine, optimizer = module.trainer, self.engine, _optimizer_of(module, optimizer)
        if not self._hooks_resolved:
            engine.resolve_hooks(module)  # the module's `batch_size_of` method, if it has one
            self._hooks_resolved = True
        window = self.window
        self._enter(trainer, optimizer, batch)
        window_complete = window.closes(_compat.is_last_training_batch(trainer))
        with contextlib.ExitStack() as no_sync:
            if not window_complete:
                # DDP's `no_sync` (through the strategy) and FSDP2's held-back reduce-scatter, which Lightning's
                # `block_backward_sync` does not cover.
                if hasattr(trainer.strategy, "block_backward_sync"):
                    no_sync.enter_context(trainer.strategy.block_backward_sync())
                if isinstance(trainer.strategy, ModelParallelStrategy):  # spares other strategies a module walk
                    no_sync.enter_context(_compat.no_fsdp2_gradient_sync(trainer.strategy.model))
            module.manual_backward(window.weigh(loss), *args, **kwargs)
        window.leave()
        if not window_complete:
            # The window's first micro-batch, not yet synced: the noise scale's small batch.
            window.after_backward(
                self.optimizer_steps,
                lambda: _compat.unsynced_gradients(module, _parameters(optimizer)),  # read only where measured
                _compat.gradient_scale(trainer),
            )
            return False
        closed = window.close(self.optimizer_steps, _parameters(optimizer), Ranks.of(trainer))
        self.last_window, self.last_noise = closed.totals, closed.noise
        self.optimizer_steps += 1
        self._window_optimizer = None
        return True

    def _enter(self, trainer: pl.Trainer, optimizer: Optimizer, batch: Any) -> None:
        """The micro-batch enters the window, opening one unless it continues the open one (the same fit and epoch)."""
        # A window left open by a fit that stopped part-way (an exception, an interrupt) is not continued: every fit
        # builds its optimizers anew, and Lightning zeroed the gradients when the new fit began.
        stale = self._window_optimizer is None or self._window_optimizer() is not optimizer
        if stale or trainer.current_epoch != self._epoch:
            self.window.abandon()
        plan = self.window.enter(batch, epoch=trainer.current_epoch, step=trainer.global_step, ranks=Ranks.of(trainer))
        if plan is not None:
            self._opened(trainer, optimizer, plan)

    def _opened(self, trainer: pl.Trainer, optimizer: Optimizer, plan: WindowPlan) -> None:
        """A window opened at this micro-batch: remember for whom, and apply a change of ``k``."""
        self._epoch = trainer.current_epoch
        self._window_optimizer = weakref.ref(optimizer)
        if plan.change is not None:
            # The schedule's learning-rate rule, applied to this helper's optimizer (and its schedulers) only.
            schedulers = [c.scheduler for c in trainer.lr_scheduler_configs if c.scheduler.optimizer is optimizer]
            plan.scale_learning_rates([optimizer], schedulers)
            self.events.append(plan.change)
            log_info(plan.change.message())

    def state_dict(self) -> dict[str, Any]:
        return {**self.engine.state_dict(), "optimizer_steps": self.optimizer_steps}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.engine.load_state_dict(state)
        self.optimizer_steps = int(state.get("optimizer_steps", 0))
        self.window.abandon()

    def __getstate__(self) -> dict[str, Any]:
        # An open window belongs to this process's fit (and a weak reference can't be pickled, e.g. by `ddp_spawn`).
        state = {**self.__dict__, "_window_optimizer": None}
        state["window"] = HandWindow(self.engine, self.window.name)
        return state


def _optimizer_of(module: pl.LightningModule, optimizer: Optimizer | LightningOptimizer | None) -> Optimizer:
    """The optimizer one helper accumulates for: the one named, else the module's only one."""
    if optimizer is None:
        optimizers = module.optimizers(use_pl_optimizer=False)
        if isinstance(optimizers, list):
            if len(optimizers) != 1:
                raise ValueError(
                    f"`ManualAccumulation.backward` needs `optimizer=`: this LightningModule has {len(optimizers)}"
                    " optimizers, and a helper must rescale only the gradients of the one it accumulates for. Use one"
                    " helper per optimizer, e.g. `self.d_accumulation.backward(self, d_loss, batch, optimizer=d_opt)`."
                )
            optimizers = optimizers[0]
        optimizer = optimizers
    if isinstance(optimizer, LightningOptimizer):
        optimizer = optimizer.optimizer
    return optimizer


def _parameters(optimizer: Optimizer) -> list[Tensor]:
    """The parameters whose gradients one helper owns: its optimizer's."""
    return [p for group in optimizer.param_groups for p in group["params"]]
