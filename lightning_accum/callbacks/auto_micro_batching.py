"""``AutoMicroBatching``: split each step batch into micro-batches that fit, and never lose a step to an OOM.

The callback is the Lightning glue over split mode's one session (`lightning_accum.split.session.SplitSession`, which
`lightning_accum.fabric.FabricMicroBatching` holds too): it checks what the Trainer sets up, installs the session's step
runner as Lightning's closure, turns Lightning's batch and optimizer hooks into the session's calls, and publishes
what each step did.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from torch.optim import Optimizer
from typing_extensions import override

from lightning_accum import _compat
from lightning_accum._util.cli_types import (
    ImportPath,
    MemorySize,
    MicroBatchSize,
    NonNegativeInt,
    OpenUnitInterval,
    PositiveInt,
)
from lightning_accum.batches import BatchSizeFn, SplitBatchFn
from lightning_accum.callbacks._owner import AccumulationOwner
from lightning_accum.callbacks._split_checks import (
    ACCUMULATE_GRAD_BATCHES_CHANGED,
    GRADIENT_ACCUMULATION_SCHEDULER,
    refuse_what_split_mode_cannot_run,
    warn_about_batch_norm,
    warn_about_overlap_waits,
)
from lightning_accum.core.normalization import ItemCounter, LossReduction
from lightning_accum.memory.oom import OOMInjector
from lightning_accum.sequences import PaddedSequences
from lightning_accum.split.planner import PlannerSettings
from lightning_accum.split.session import SplitSession
from lightning_accum.split.sync import GradientSync, trainer_sync_kind

__all__ = ["AutoMicroBatching"]


class AutoMicroBatching(AccumulationOwner):
    """Split mode: cut each step batch into the largest micro-batches that fit, and recover from OOMs in place.

    The dataloader yields each device's whole step batch. For every optimizer step, the batch is split into
    micro-batches of size ``b``; the unchanged ``training_step`` runs once per micro-batch (with the step's
    ``batch_idx``) and the gradients are combined into the exact mean over all items of the step on all ranks, as in
    `lightning_accum.AccumulationScheduler`. ``b`` adapts to memory, so ``k = ceil(B / b)`` does too, while
    the effective batch size stays the dataloader's.

    * **Cold start without an OOM.** With ``micro_batch_size="auto"``, the first step is traced on fake tensors at
      two micro-batch sizes (nothing is allocated), and the run starts at the largest size predicted to fit
      (`lightning_accum.split.preflight`). Where tracing fails, it starts from the whole step batch as before.
    * **OOM recovery.** An out-of-memory error in any forward or backward discards the attempt, shrinks ``b`` and
      re-runs the same step batch on every rank (one small all-reduce): no sample is lost or counted twice.
    * **Before memory runs out, and growing back.** A step whose peak passes the budget (or whose allocator retries
      keep rising) makes the next use a smaller ``b``, predicted from a model of the measured peaks (linear in ``b``;
      by tokens, ``fixed + T (a + c L)``); ``b``
      grows back after ``grow_patience`` steps under a low watermark, never to a size that ran out of memory within
      ``oom_cooldown`` steps (`lightning_accum.split.planner`; the settings: `lightning_accum.split.planner.settings`).
    * **DDP and FSDP2** (`lightning_accum.split.sync`). Under DDP the gradients are summed across ranks once, after
      every rank finished its micro-batches (``gradient_sync="deferred"``, the default): an OOM in any forward or
      backward can never leave a rank waiting in DDP's all-reduce. ``"overlap"`` lets DDP sync in the last micro-batch's
      backward, after the ranks agreed on every forward: faster, but an OOM *inside that backward* cannot be retried
      (that rank raises, and the others stop when it exits or at the process group's timeout). FSDP2
      (``ModelParallelStrategy`` with ``fully_shard``, data-parallel only) gathers the parameters once per step and
      reduce-scatters in the last backward, as ``"overlap"`` does. Ranks whose step batches differ run different numbers
      of micro-batches.
    * **By tokens** (``sequences=PaddedSequences(...)``): each step batch is ordered by sequence length and cut
      into micro-batches of at most ``micro_batch_tokens`` padded tokens (a sequence longer than that alone), cut
      where the step computes the fewest padded tokens, each trimmed to its longest sequence
      (`lightning_accum.sequences`); the planner chooses the token budget as it chooses ``b``.
    * **Empty micro-batches.** A micro-batch whose ``count_items`` is 0 contributes nothing: its backward is skipped,
      so a mean over no items (``0 / 0 = NaN``) reaches neither the gradient nor the window loss nor ``self.log``.
    * **Batch norm** normalizes each micro-batch over its own samples, so a model with batch-norm layers gets a
      different (not exact) update; a warning says so at setup.

    ``self.log`` calls are combined into one value per step (`lightning_accum.split.step_logs`); other outputs of
    ``training_step`` than the loss are the last micro-batch's.

    Args:
        micro_batch_size: ``"auto"`` starts where the pre-flight trace predicts the step fits (see ``preflight``;
            without it, from the whole step batch); an int starts there and still shrinks on OOM.
        max_memory: the peak-memory budget: a fraction of the device's capacity in (0, 1], a number of bytes, or a
            size such as ``"8GiB"``. ``None`` means 0.9 of capacity.
        sequences: where the batch's right-padded sequences are (`lightning_accum.sequences.PaddedSequences`), to
            split by padded tokens instead of samples. ``None`` splits by samples.
        micro_batch_tokens: with ``sequences``, the token budget as ``micro_batch_size`` is otherwise: ``"auto"``,
            or an int (padded tokens per micro-batch) to start from.
        min_micro_batch_size: never split finer than this many samples; an OOM at this size raises an error with the
            memory figures. Not with ``sequences``: the floor is then the step's longest sequence alone.
        count_items: counts the items of a micro-batch (default: its samples).
        loss_reduction: whether ``training_step`` returns the ``"mean"`` or the ``"sum"`` over its items.
        pin_micro_batch_size: keep an int ``micro_batch_size`` fixed except to survive an OOM.
        low_watermark: fraction of the budget under which the planner may grow ``b``.
        grow_patience: steps under the low watermark before growing.
        oom_cooldown: steps before a size that ran out of memory is tried again.
        predictive: predict sizes from the fitted memory model instead of halving and doubling.
        gradient_sync: ``"deferred"`` (OOM-safe under DDP) or ``"overlap"`` (faster, not OOM-safe in the last
            backward). ``None`` (the default) means ``"deferred"``, and ``"overlap"`` under FSDP2.
        split_batch: ``split_batch(batch, micro_batch_size)`` returns the micro-batches (or its import path), for a
            batch the built-in rules (`lightning_accum.batches`) can't cut. Default: a method of the module.
        batch_size_of: ``batch_size_of(batch) -> int`` counts a batch's samples (or its import path). Default: a
            method of the module, else the built-in rules.
        fault_injector: raises simulated OOMs at chosen points, for testing recovery.
        preflight: with ``micro_batch_size="auto"`` and ``predictive=True``, trace the first step on fake tensors
            and start at the largest size predicted to fit, keeping 10% of the free memory for what the trace can't
            see. ``False`` starts from the whole step batch and halves on each OOM. A resumed run keeps its size.

    Raises:
        TypeError: an argument has the wrong type.
        ValueError: ``max_memory`` outside (0, 1] as a fraction or < 1 as bytes, ``micro_batch_size`` < 1, an
            unknown ``loss_reduction`` or ``gradient_sync``, ``Trainer(accumulate_grad_batches != 1)`` (also when
            something sets ``trainer.accumulate_grad_batches`` during training), a step batch with 0 samples, or
            ``gradient_sync="deferred"`` under ``ModelParallelStrategy``.
        RuntimeError: manual optimization, a strategy other than single-device, DDP or ``ModelParallelStrategy``
            with FSDP2 and no tensor parallelism (DeepSpeed, FSDP1's ``FSDPStrategy``), ``ModelParallelStrategy``
            without ``fully_shard``, another accumulation callback (or Lightning's
            ``GradientAccumulationScheduler``) in the same Trainer, an error on another rank, a failed agreement
            between ranks (a peer is gone), an error inside the synced backward (``gradient_sync="overlap"`` and
            FSDP2), or, under FSDP2, a last micro-batch without items on some rank.

    Examples:
        >>> from lightning.pytorch import Trainer
        >>> trainer = Trainer(callbacks=[AutoMicroBatching(max_memory=0.8)], logger=False, enable_progress_bar=False)
    """

    def __init__(
        self,
        micro_batch_size: MicroBatchSize = PlannerSettings.micro_batch_size,
        *,
        max_memory: MemorySize | None = None,
        sequences: PaddedSequences | None = None,
        micro_batch_tokens: MicroBatchSize = "auto",
        min_micro_batch_size: PositiveInt = PlannerSettings.min_micro_batch_size,
        count_items: ItemCounter | ImportPath | None = None,
        loss_reduction: LossReduction = "mean",
        pin_micro_batch_size: bool = PlannerSettings.pin_micro_batch_size,
        low_watermark: OpenUnitInterval = PlannerSettings.low_watermark,
        grow_patience: PositiveInt = PlannerSettings.grow_patience,
        oom_cooldown: NonNegativeInt = PlannerSettings.oom_cooldown,
        predictive: bool = PlannerSettings.predictive,
        gradient_sync: GradientSync | None = None,
        split_batch: SplitBatchFn | ImportPath | None = None,
        batch_size_of: BatchSizeFn | ImportPath | None = None,
        fault_injector: OOMInjector | None = None,
        preflight: bool = True,
    ) -> None:
        super().__init__(count_items, loss_reduction)
        self._split_batch, self._batch_size_of = split_batch, batch_size_of  # at setup, these win over module methods
        self.engine.resolve_hooks(None, split_batch=split_batch, batch_size_of=batch_size_of)  # checks them now
        self.session = SplitSession(
            self.engine,
            self._record,
            self._count_oom,
            micro_batch_size=micro_batch_size,
            micro_batch_tokens=micro_batch_tokens,
            sequences=sequences,
            split_batch=split_batch,
            max_memory=max_memory,
            gradient_sync=gradient_sync,
            preflight=preflight,
            fault_injector=fault_injector,
            min_micro_batch_size=min_micro_batch_size,
            pin_micro_batch_size=pin_micro_batch_size,
            low_watermark=low_watermark,
            grow_patience=grow_patience,
            oom_cooldown=oom_cooldown,
            predictive=predictive,
        )
        self.planner = self.session.planner
        self.sequences = self.session.sequences
        self.splits_by_tokens = self.sequences is not None
        self.splits_steps = True
        self._closed: Any = None

    @property
    def gradient_sync(self) -> GradientSync:
        return self.session.gradient_sync

    @property
    def max_memory(self) -> float | int:
        """The budget as a fraction of capacity or a number of bytes (``max_memory`` checked)."""
        return self.session.max_memory

    @property
    def preflight(self) -> bool:
        return self.session.preflight

    @property
    def fault_injector(self) -> OOMInjector | None:
        return self.session.fault_injector

    @property
    def preflight_result(self) -> Any:
        """What the cold start's trace found on this rank (`lightning_accum.split.preflight.Preflight`), or None."""
        return self.session.preflight_result

    @property
    def gradient_allreduces(self) -> int:
        """Collectives the deferred gradient sync issued in the last fit, for tests and benchmarks."""
        runner = self.session.runner
        return runner.gradient_allreduces if runner is not None else 0

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        refuse_what_split_mode_cannot_run(trainer, pl_module)
        gradient_sync = self.session.resolve(trainer_sync_kind(trainer.strategy, trainer.world_size))
        if any(isinstance(cb, GradientAccumulationScheduler) for cb in trainer.callbacks):  # type: ignore[attr-defined]  # undeclared on Lightning's Trainer
            raise RuntimeError(GRADIENT_ACCUMULATION_SCHEDULER)
        warn_about_batch_norm(pl_module)
        warn_about_overlap_waits(trainer, gradient_sync)
        self.engine.resolve_hooks(pl_module, split_batch=self._split_batch, batch_size_of=self._batch_size_of)
        self._claim(trainer)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.session.watch_loaders(trainer.train_dataloader, trainer.world_size)
        strategy = trainer.strategy
        runner = self.session.start(trainer, strategy, trainer_sync_kind(strategy, trainer.world_size), pl_module)
        self._install(_compat.install_split_closure(trainer, runner))

    @override
    def settings(self) -> dict[str, Any]:
        return {**self.session.settings(), **super().settings(), "split_batch": self._hooks.split_batch_source}

    @override
    def _restore(self, trainer: pl.Trainer) -> None:
        # Also after an exception: a second `fit` of the same Trainer must find no half-finished step behind.
        super()._restore(trainer)
        self.session.clear()

    # ----------------------------------------------------------------------------------------------------------
    # one optimizer step (its micro-batches run in the session's `lightning_accum.split.step.SplitStepRunner`)
    # ----------------------------------------------------------------------------------------------------------
    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if trainer.accumulate_grad_batches != 1:
            # Set after `setup` (by a callback such as `GradientAccumulationScheduler`, or by hand): Lightning would
            # skip optimizer steps, and split mode would silently drop step batches.
            raise ValueError(ACCUMULATE_GRAD_BATCHES_CHANGED.format(trainer=trainer))
        self.session.begin_step(batch, pl_module, trainer.optimizers, trainer.precision)

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        self._closed = self.session.close_window(trainer.global_step, params)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        closed, self._closed = self._closed, None
        figures = self.session.end_step(trainer.global_step, closed)
        if closed is not None and figures is not None:  # else Lightning skipped the step (`training_step` gave None)
            loss = self.session.window_loss
            self._publish_step("split", figures.micro_batch_size, closed, loss, **figures.report)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), **self.session.state_dict()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.session.load_state_dict(state_dict)
