"""``ManualAccumulation``: exact accumulation and one gradient sync per step under manual optimization."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities import rank_zero_deprecation
from torch import Tensor
from torch.optim import Optimizer

from lightning_accum import _compat
from lightning_accum.callbacks._owner import log_info
from lightning_accum.distributed import sum_across_ranks_fn
from lightning_accum.items import resolve_counter
from lightning_accum.noise_scale import WindowNoiseMeter
from lightning_accum.normalization import (
    ItemCounter,
    LossReduction,
    WindowNormalizer,
    WindowTotals,
    check_loss_reduction,
    count_items,
)
from lightning_accum.report import AccumulationEvent
from lightning_accum.schedules import (
    AccumulationSchedule,
    AdaptiveSchedule,
    ConstantSchedule,
    Progress,
    as_schedule,
    scale_learning_rates,
)
from lightning_accum.splitting import BatchHooks, resolve_batch_hooks


class ManualAccumulation:
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
        self.schedule: AccumulationSchedule = as_schedule(schedule, "epoch") or ConstantSchedule(1)
        self.count_items = resolve_counter(count_items)
        self.normalizer = WindowNormalizer(check_loss_reduction(loss_reduction))
        self.last_window: WindowTotals | None = None
        self.last_noise: tuple[float, float] | None = None  # the last window's (|G|², tr Σ), where measured
        self.consumed_samples = 0
        self.optimizer_steps = 0  # complete windows: the step count that picks the measured windows
        self.events: list[AccumulationEvent] = []  # every change of k
        self._k = 1
        self._k_known = False  # False until the first window: its k is the start, not a change
        self._position = -1  # -1: no window open
        self._epoch = -1
        self._hooks: BatchHooks | None = None
        self._noise_meter = WindowNoiseMeter()
        # Checked once: a protocol `isinstance` costs tens of microseconds, too much for every window.
        self._adaptive = self.schedule if isinstance(self.schedule, AdaptiveSchedule) else None
        if self._adaptive is not None:
            self._noise_meter.request()  # k follows the measured noise scale

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
            ValueError: the module has several optimizers and ``optimizer`` is not given.
        """
        trainer = module.trainer
        if self._hooks is None:
            self._hooks = resolve_batch_hooks(module)  # the module's `batch_size_of` method, if it has one
        n_samples = self._hooks.batch_size(batch)
        if self._position < 0 or trainer.current_epoch != self._epoch:
            self._start_window(trainer, _optimizer_of(module, optimizer), n_samples)
        n_items = n_samples if self.count_items is None else count_items(batch, self.count_items)
        weight = self.normalizer.add_micro_batch(n_items, n_samples)
        window_complete = self._position >= self._k - 1 or _compat.is_last_training_batch(trainer)
        with contextlib.ExitStack() as no_sync:
            if not window_complete:
                # DDP's `no_sync` (through the strategy) and FSDP2's held-back reduce-scatter, which Lightning's
                # `block_backward_sync` does not cover.
                if hasattr(trainer.strategy, "block_backward_sync"):
                    no_sync.enter_context(trainer.strategy.block_backward_sync())
                if isinstance(trainer.strategy, ModelParallelStrategy):  # spares other strategies a module walk
                    no_sync.enter_context(_compat.no_fsdp2_gradient_sync(trainer.strategy.model))
            module.manual_backward(loss * weight, *args, **kwargs)
        if not window_complete:
            if self._position == 0 and self._noise_meter.wants(self.optimizer_steps):
                self._capture_first_gradient(module, optimizer)
            self._position += 1
            return False
        self._finish_window(trainer, _optimizer_of(module, optimizer))
        return True

    def _capture_first_gradient(
        self, module: pl.LightningModule, optimizer: Optimizer | LightningOptimizer | None
    ) -> None:
        """The window's first micro-batch, not yet synced: the noise scale's small batch (see `WindowNoiseMeter`)."""
        normalizer = self.normalizer
        self._noise_meter.capture(
            self.optimizer_steps,
            normalizer.windows_started,
            _compat.unsynced_gradients(module, _parameters(_optimizer_of(module, optimizer))),
            normalizer.first_items,
            normalizer.divisor,
            _compat.gradient_scale(module.trainer),
        )

    def _finish_window(self, trainer: pl.Trainer, optimizer: Optimizer) -> None:
        """Make the window's gradient exact, measure its noise scale and let an adaptive schedule see both."""
        params, sum_fn = _parameters(optimizer), sum_across_ranks_fn(trainer)
        totals = self.normalizer.finish_window(params, sum_fn, trainer.world_size)
        self.last_window = totals
        self.last_noise = self._noise_meter.measure(
            self.optimizer_steps,
            self.normalizer.windows_started,
            [p.grad for p in params if p.grad is not None],
            items=totals.items,
            micro_batches=self.normalizer.micro_batches,
            world_size=trainer.world_size,
            sum_across_ranks=sum_fn,
        )
        if self._adaptive is not None:
            # Global figures (summed or averaged over ranks): every rank's schedule decides alike.
            self._adaptive.observe(totals.items, self.normalizer.micro_batches, trainer.world_size, self.last_noise)
        self.consumed_samples += totals.samples
        self.optimizer_steps += 1
        self._position = -1

    def _start_window(self, trainer: pl.Trainer, optimizer: Optimizer, n_samples: int) -> None:
        self._epoch = trainer.current_epoch
        self._position = 0
        progress = Progress(
            epoch=trainer.current_epoch,
            optimizer_steps=trainer.global_step,
            consumed_samples=self.consumed_samples,
            micro_batch_size=n_samples,
            world_size=trainer.world_size,
        )
        k = self.schedule.accumulation_steps(progress)
        if self._k_known and k != self._k:
            self._change_k(trainer, optimizer, k)
        self._k, self._k_known = k, True
        self.normalizer.start_window(self._k)

    def _change_k(self, trainer: pl.Trainer, optimizer: Optimizer, k: int) -> None:
        """Log a change of ``k`` and apply the schedule's learning-rate rule to this helper's optimizer."""
        reason = f"epoch {trainer.current_epoch}"
        factor = self._adaptive.lr_factor(self._k, k) if self._adaptive is not None else 1.0
        if factor != 1.0:
            schedulers = [c.scheduler for c in trainer.lr_scheduler_configs if c.scheduler.optimizer is optimizer]
            scale_learning_rates([optimizer], schedulers, factor)
            reason += f"; learning rate x{factor:.4g}"
        event = AccumulationEvent("schedule_change", trainer.global_step, self._k, k, reason)
        self.events.append(event)
        log_info(event.message())

    def state_dict(self) -> dict[str, Any]:
        state = {
            "consumed_samples": self.consumed_samples,
            "optimizer_steps": self.optimizer_steps,
            "normalizer": self.normalizer.state_dict(),
            "noise_meter": self._noise_meter.state_dict(),
        }
        if self._k_known:
            state["accumulation_steps"] = self._k
        if callable(getattr(self.schedule, "state_dict", None)):
            state["schedule"] = self.schedule.state_dict()  # e.g. the noise-scale estimate
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.consumed_samples = int(state.get("consumed_samples", 0))
        self.optimizer_steps = int(state.get("optimizer_steps", 0))
        self.normalizer.load_state_dict(state.get("normalizer", {}))
        self._noise_meter.load_state_dict(state.get("noise_meter", {}))
        self._k = int(state.get("accumulation_steps", 1))
        self._k_known = "accumulation_steps" in state
        self._position = -1
        if "schedule" in state and callable(getattr(self.schedule, "load_state_dict", None)):
            self.schedule.load_state_dict(state["schedule"])


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
