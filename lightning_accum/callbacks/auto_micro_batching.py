"""``AutoMicroBatching``: split each step batch into micro-batches that fit, and never lose a step to an OOM."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import timedelta
from typing import Any, Literal, NamedTuple

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy, SingleDeviceStrategy
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from lightning_accum import _compat
from lightning_accum._cli_types import (
    ImportPath,
    MemorySize,
    MicroBatchSize,
    NonNegativeInt,
    OpenUnitInterval,
    PositiveInt,
)
from lightning_accum._validation import check_bool, check_choice
from lightning_accum.callbacks._owner import AccumulationOwner, log_info
from lightning_accum.distributed import all_reduce_gradients, max_across_ranks, sum_across_ranks_fn
from lightning_accum.memory.backends import MemoryBackend, backend_for, free_bytes
from lightning_accum.memory.budget import GIB, budget_bytes, check_max_memory, over_capacity_warning
from lightning_accum.memory.oom import (
    OOMInjector,
    describe_error,
    is_oom_error,
    release_cached_memory,
    release_memory,
)
from lightning_accum.normalization import (
    ItemCounter,
    LossReduction,
    WindowTotals,
    count_items,
)
from lightning_accum.planner import MicroBatchPlanner
from lightning_accum.probe.preflight import Preflight, fallback_warning, preflight
from lightning_accum.report import AccumulationEvent, LossSum
from lightning_accum.splitting import BatchHooks, BatchSizeFn, SplitBatchFn, resolve_batch_hooks
from lightning_accum.step_logs import StepLogCombiner

GradientSync = Literal["deferred", "overlap"]
_GRADIENT_SYNCS = {
    "deferred": "one all-reduce after every rank's last backward",
    "overlap": "DDP's, in the last backward",
}
_NO_FAULT, _OOM, _OTHER_ERROR = 0, 1, 2


class AutoMicroBatching(AccumulationOwner):
    """Split mode: cut each step batch into the largest micro-batches that fit, and recover from OOMs in place.

    The dataloader yields each device's whole step batch. For every optimizer step, the batch is split into
    micro-batches of size ``b``; the unchanged ``training_step`` runs once per micro-batch (with the step's
    ``batch_idx``) and the gradients are combined into the exact mean over all items of the step on all ranks, as in
    `lightning_accum.AccumulationScheduler`. ``b`` adapts to memory, so ``k = ceil(B / b)`` does too, while
    the effective batch size stays the dataloader's.

    * **Cold start without an OOM.** With ``micro_batch_size="auto"``, the first step is traced on fake tensors at
      two micro-batch sizes (nothing is allocated), and the run starts at the largest size predicted to fit
      (`lightning_accum.probe.preflight`). Where tracing fails, it starts from the whole step batch as before.
    * **OOM recovery.** An out-of-memory error in any micro-batch's forward or backward discards the attempt's
      gradients, frees memory, shrinks ``b`` and re-runs the same step batch: no sample is lost or counted twice.
      Every rank learns of the OOM through one small all-reduce and retries together.
    * **Before memory runs out.** When a step's peak passes the budget (or CUDA's allocator retries keep rising),
      the next step uses a smaller ``b``; a linear model ``peak(b) = fixed + per_sample * b`` fitted to the measured
      peaks predicts the largest ``b`` that fits.
    * **Growing back.** When the peak stays under a low watermark for ``grow_patience`` steps, ``b`` grows, never to
      a size that ran out of memory within the last ``oom_cooldown`` steps.
    * **DDP.** Gradients are accumulated locally and summed across ranks once, after every rank has finished its
      micro-batches (``gradient_sync="deferred"``, the default): an OOM anywhere can then never leave a rank waiting
      in DDP's all-reduce. ``"overlap"`` lets DDP overlap the all-reduce with the last micro-batch's backward; it is
      faster, and an OOM up to the last micro-batch's forward is still retried on every rank, but an OOM *inside
      that last backward* on one rank is not recoverable: that rank raises at once and the others stop when it
      exits, or at the process group's timeout.
    * **FSDP2** (``ModelParallelStrategy`` with ``fully_shard`` in ``configure_model``, data-parallel only). The
      parameters are all-gathered once per step and stay unsharded through it, so no forward or backward waits in an
      all-gather for a rank that failed. Every micro-batch but the last accumulates unsharded gradients without a
      reduce-scatter; the ranks agree after the last forward, and the last backward reduce-scatters once per FSDP
      unit, as ``"overlap"`` does under DDP: an OOM up to that point is retried on every rank, one inside the last
      backward stops every rank with an error. ``gradient_sync`` defaults to this; ``"deferred"`` is refused.
    * **Empty micro-batches.** A micro-batch whose ``count_items`` is 0 contributes nothing: its backward is skipped,
      so a mean over no items (``0 / 0 = NaN``) reaches neither the gradient nor the window loss nor ``self.log``.
    * **Batch norm** normalizes each micro-batch over its own samples, so a model with batch-norm layers gets a
      different (not exact) update; a warning says so at setup.

    ``self.log`` calls in ``training_step`` are combined into one value per step (see `lightning_accum.step_logs`).
    ``training_step`` outputs other than the loss are those of the last micro-batch.

    Args:
        micro_batch_size: ``"auto"`` starts where the pre-flight trace predicts the step fits (see ``preflight``;
            without it, from the whole step batch); an int starts there and still shrinks on OOM.
        max_memory: the peak-memory budget: a fraction of the device's capacity in (0, 1], a number of bytes, or a
            size such as ``"8GiB"``. ``None`` means 0.9 of capacity.
        min_micro_batch_size: never split finer than this; an OOM at this size raises an error with the memory
            figures.
        count_items: counts the items of a micro-batch (default: its samples).
        loss_reduction: whether ``training_step`` returns the ``"mean"`` or the ``"sum"`` over its items.
        pin_micro_batch_size: keep an int ``micro_batch_size`` fixed except to survive an OOM.
        low_watermark: fraction of the budget under which the planner may grow ``b``.
        grow_patience: steps under the low watermark before growing.
        oom_cooldown: steps before a size that ran out of memory is tried again.
        predictive: predict sizes from the fitted memory model instead of halving and doubling.
        gradient_sync: ``"deferred"`` (OOM-safe under DDP) or ``"overlap"`` (faster, not OOM-safe in the last
            backward). ``None`` (the default) means ``"deferred"``, and ``"overlap"`` under FSDP2.
        split_batch: cuts a step batch the built-in rules can't: ``split_batch(batch, micro_batch_size)`` returns a
            list of micro-batches of at most ``micro_batch_size`` samples that add up to the step batch (or an import
            path to such a function). Default: a ``split_batch`` method of the LightningModule, else the built-in
            rules (`lightning_accum.splitting`).
        batch_size_of: counts the samples of a batch, ``batch_size_of(batch) -> int`` (or an import path). Default:
            a ``batch_size_of`` method of the LightningModule, else the built-in rules.
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
        micro_batch_size: MicroBatchSize = "auto",
        *,
        max_memory: MemorySize | None = None,
        min_micro_batch_size: PositiveInt = 1,
        count_items: ItemCounter | ImportPath | None = None,
        loss_reduction: LossReduction = "mean",
        pin_micro_batch_size: bool = False,
        low_watermark: OpenUnitInterval = 0.7,
        grow_patience: PositiveInt = 20,
        oom_cooldown: NonNegativeInt = 200,
        predictive: bool = True,
        gradient_sync: GradientSync | None = None,
        split_batch: SplitBatchFn | ImportPath | None = None,
        batch_size_of: BatchSizeFn | ImportPath | None = None,
        fault_injector: OOMInjector | None = None,
        preflight: bool = True,
    ) -> None:
        super().__init__(count_items, loss_reduction)
        self._max_memory_given = max_memory  # as the user wrote it, for the run config
        self.max_memory = check_max_memory(max_memory)
        if gradient_sync is not None:
            check_choice(gradient_sync, "gradient_sync", _GRADIENT_SYNCS, hint="None picks the strategy's default.")
        self._gradient_sync_given = gradient_sync
        self.gradient_sync: GradientSync = gradient_sync or "deferred"  # resolved against the strategy at setup
        self.fault_injector = fault_injector
        self.preflight = check_bool(preflight, "preflight")
        self.preflight_result: Preflight | None = None  # what the cold start's trace found (this rank's)
        # Resolved against the LightningModule at setup: an argument wins over a method of the module.
        self._hook_arguments = {"split_batch": split_batch, "batch_size_of": batch_size_of}
        self._hooks = resolve_batch_hooks(None, **self._hook_arguments)  # checks the arguments now
        # The planner validates the sizes and thresholds; the budget is set once the device is known.
        self.planner = MicroBatchPlanner(
            micro_batch_size,
            min_micro_batch_size=min_micro_batch_size,
            low_watermark=low_watermark,
            grow_patience=grow_patience,
            oom_cooldown=oom_cooldown,
            predictive=predictive,
            pin_micro_batch_size=pin_micro_batch_size,
        )
        self.gradient_allreduces = 0  # collectives issued by the deferred gradient sync, for tests and benchmarks

        self._trainer: pl.Trainer | None = None
        self._backend: MemoryBackend | None = None
        self._size = 0  # micro-batch size of the current step
        self._retries_at_start = 0
        self._warned_unreachable = False
        self._size_shrunk = False
        self._grads_summed = False  # deferred sync done: buffers hold the sum over ranks, not DDP's mean
        self._logs: StepLogCombiner | None = None
        self._capacity_bytes = 0
        self._step_batch_size = 0
        self._window_loss = LossSum()
        self._totals: WindowTotals | None = None
        self._agreed: _Agreed | None = None  # overlap mode: this attempt's agreement, before the synced backward
        self._cold = False  # the first step of a run that has not chosen a size yet
        self._fsdp2 = False  # `ModelParallelStrategy` with `fully_shard`: FSDP2 reduce-scatters the last backward

    # ----------------------------------------------------------------------------------------------------------
    # setup and teardown
    # ----------------------------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if not pl_module.automatic_optimization:
            raise RuntimeError(
                "`AutoMicroBatching` needs automatic optimization, but this LightningModule sets"
                " `automatic_optimization = False`. Under manual optimization, split the batch yourself and use"
                " `lightning_accum.ManualAccumulation`."
            )
        if trainer.accumulate_grad_batches != 1:
            raise ValueError(
                f"`Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches})` cannot be combined with"
                " `AutoMicroBatching`: in split mode each dataloader batch is one optimizer step. Remove"
                " `accumulate_grad_batches` and make the dataloader yield the whole per-device step batch."
            )
        strategy = trainer.strategy
        if isinstance(strategy, FSDPStrategy):
            raise RuntimeError(
                "`AutoMicroBatching` does not support `FSDPStrategy` (FSDP1, CUDA-only in Lightning). Use"
                " `ModelParallelStrategy` and call `torch.distributed.fsdp.fully_shard` in `configure_model` (FSDP2),"
                " which split mode supports, or keep `FSDPStrategy` with `AccumulationScheduler` (window mode)."
            )
        if isinstance(strategy, ModelParallelStrategy):
            self._check_model_parallel(strategy)
        elif not isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)) or strategy.handles_gradient_accumulation:
            raise RuntimeError(
                f"`AutoMicroBatching` supports single-device, DDP and `ModelParallelStrategy` (FSDP2) strategies, got"
                f" {type(strategy).__name__}. Use the strategy's own accumulation with DeepSpeed."
            )
        else:
            self.gradient_sync = self._gradient_sync_given or "deferred"
        if any(isinstance(cb, GradientAccumulationScheduler) for cb in trainer.callbacks):
            raise RuntimeError(
                "Lightning's `GradientAccumulationScheduler` cannot be combined with `AutoMicroBatching`: it sets"
                " `trainer.accumulate_grad_batches` at each epoch start, and in split mode each dataloader batch is one"
                " optimizer step. Remove `GradientAccumulationScheduler`; to grow the effective batch size, make the"
                " dataloader yield larger step batches (`AutoMicroBatching` splits them to fit memory), or use"
                " `AccumulationScheduler` (window mode) instead of `AutoMicroBatching`."
            )
        _warn_about_batch_norm(pl_module)
        warning = overlap_wait_warning(
            self.gradient_sync,
            trainer.world_size,
            getattr(strategy, "process_group_backend", None),
            _compat.process_group_timeout(strategy),
        )
        if warning:
            rank_zero_warn(warning)
        self._hooks = resolve_batch_hooks(pl_module, **self._hook_arguments)
        self._claim(trainer)

    def _check_model_parallel(self, strategy: ModelParallelStrategy) -> None:
        if self._gradient_sync_given == "deferred":
            raise ValueError(
                "`gradient_sync='deferred'` is not available under `ModelParallelStrategy` (FSDP2): FSDP2"
                " reduce-scatters inside the last micro-batch's backward, which runs only after every rank agreed that"
                " all its forwards succeeded (an OOM before it is retried on every rank). Leave `gradient_sync` unset"
                " (or pass 'overlap'); see docs/scaling-out.md, split mode."
            )
        tensor_parallel = strategy.device_mesh["tensor_parallel"].size()
        if tensor_parallel > 1:
            raise RuntimeError(
                f"`AutoMicroBatching` supports `ModelParallelStrategy` for data parallelism only (FSDP2), got"
                f" `tensor_parallel_size={tensor_parallel}`. Set `tensor_parallel_size=1`, or use"
                " `AccumulationScheduler` (window mode)."
            )
        self.gradient_sync = "overlap"

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._trainer = trainer
        self._backend = backend_for(trainer.strategy.root_device)
        capacity = self._backend.capacity_bytes()
        budget = budget_bytes(self.max_memory, capacity)
        warning = over_capacity_warning(self._max_memory_given, budget, capacity, self._backend.name)
        if warning:
            rank_zero_warn(warning)
        self.planner.budget_bytes = budget
        self._logs = StepLogCombiner(pl_module)
        self._capacity_bytes = capacity
        self._install(_compat.install_split_closure(trainer, self._run_step))
        self._fsdp2 = isinstance(trainer.strategy, ModelParallelStrategy)
        if self._fsdp2 and trainer.world_size > 1 and not _compat.fsdp2_modules(trainer.strategy.model):
            raise RuntimeError(
                "`AutoMicroBatching` under `ModelParallelStrategy` needs FSDP2: call"
                " `torch.distributed.fsdp.fully_shard` on the model (or its layers) in `configure_model`, with the"
                ' `self.device_mesh["data_parallel"]` mesh. Without it nothing synchronizes the gradients across ranks.'
            )
        planner = self.planner
        self._cold = (
            self.preflight
            and planner.predictive
            and planner.micro_batch_size_setting == "auto"
            and planner.micro_batch_size is None  # not resumed with a size already chosen
        )
        log_info(
            f"lightning_accum: split mode, memory budget {budget / GIB:.2f} GiB of {capacity / GIB:.2f} GiB"
            f" ({self._backend.name})"
        )

    @override
    def settings(self) -> dict[str, Any]:
        planner = self.planner
        budget = planner.budget_bytes
        return {
            "mode": "split",
            "micro_batch_size": planner.micro_batch_size_setting,
            "max_memory": self._max_memory_given,
            "budget_bytes": None if budget is None else int(budget),  # resolved at the start of training
            "memory_capacity_bytes": self._capacity_bytes,
            "min_micro_batch_size": planner.min_micro_batch_size,
            **super().settings(),
            "pin_micro_batch_size": planner.pin_micro_batch_size,
            "low_watermark": planner.low_watermark,
            "grow_patience": planner.grow_patience,
            "oom_cooldown": planner.oom_cooldown,
            "predictive": planner.predictive,
            "gradient_sync": self.gradient_sync,
            "split_batch": self._hooks.split_batch_source,
            "preflight": self.preflight,
        }

    @override
    def _restore(self, trainer: pl.Trainer) -> None:
        # Also after an exception: a second `fit` of the same Trainer must find no half-finished step behind.
        super()._restore(trainer)
        self._grads_summed = False
        self._size_shrunk = False
        if self._logs is not None:
            self._logs.clear()

    # ----------------------------------------------------------------------------------------------------------
    # one optimizer step
    # ----------------------------------------------------------------------------------------------------------
    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        assert self._backend is not None
        if trainer.accumulate_grad_batches != 1:
            # Set after `setup` (by a callback such as `GradientAccumulationScheduler`, or by hand): Lightning would
            # skip optimizer steps, and split mode would silently drop step batches.
            raise ValueError(
                f"`trainer.accumulate_grad_batches` became {trainer.accumulate_grad_batches} at epoch"
                f" {trainer.current_epoch}, but `AutoMicroBatching` needs 1: in split mode each dataloader batch is one"
                " optimizer step. Remove whatever sets it (e.g. a `GradientAccumulationScheduler`), and make the"
                " dataloader yield larger step batches to grow the effective batch size."
            )
        if self._size_shrunk:
            # Memory freed by the larger size stays cached (CUDA) or resident (CPU heap) and would inflate the peak
            # measured at the new size; release it once, not every step (re-faulting pages costs throughput). A grow
            # has nothing to release: the larger step reuses what the smaller one held.
            release_cached_memory()
            self._size_shrunk = False
        if self._cold:
            self._cold = False
            self._start_from_preflight(trainer, pl_module, batch)
        self._backend.reset_peak()
        self._retries_at_start = self._backend.alloc_retries()

    def _start_from_preflight(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> None:
        """Trace the first step on fake tensors and start at the largest size predicted to fit, on every rank alike.

        Every rank calls one small all-reduce here, whatever its trace found (an error included): the smallest
        prediction wins, and a failed trace on any rank means every rank starts from the whole step batch, as
        without a pre-flight.
        """
        try:
            start, why = self._predicted_start(trainer, pl_module, batch)
        except Exception as err:  # e.g. a batch the hooks can't count: the first step's own checks will say so
            start, why = None, f"{type(err).__name__}: {describe_error(err)}"
        # Max over ranks of (failed, -start): any failure falls back everywhere, else the smallest start wins.
        local = torch.tensor([int(start is None), -(start or 0)], dtype=torch.int64)
        failed, negative_start = (int(v) for v in max_across_ranks(trainer, local).tolist())
        if failed:
            rank_zero_warn(fallback_warning(why if start is None else None))
            return
        self.planner.start_from(-negative_start)
        found = self.preflight_result
        assert found is not None
        small, large = sorted(found.peaks)
        step_batch_size = self._hooks.batch_size(batch)
        log_info(
            f"lightning_accum: pre-flight traced micro-batches of {small} and {large} on fake tensors in"
            f" {found.seconds:.2f} s; starting at micro-batch size {self.planner.size_for(step_batch_size)}"
            f" of {step_batch_size}"
        )

    def _predicted_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any
    ) -> tuple[int | None, str]:
        """This rank's predicted starting size (``None``: no prediction), and why there is none."""
        assert self._backend is not None
        budget = self.planner.budget_bytes
        step_batch_size = self._hooks.batch_size(batch)
        small, large = max(1, step_batch_size // 4), max(1, step_batch_size // 2)
        if small == large or budget is None:
            return None, f"a step batch of {step_batch_size} is too small to trace at two sizes"
        found = preflight(
            pl_module,
            batch,
            (small, large),
            optimizers=trainer.optimizers,
            precision=trainer.precision,
            hooks=self._hooks,
        )
        self.preflight_result = found
        if found.peak_model is None:
            return None, str(found.reason)
        start = found.starting_micro_batch_size(
            budget, step_batch_size, self._backend.current_bytes(), free_bytes(self._backend)
        )
        # Predicted not to fit at all: begin where an OOM would end up.
        return (self.planner.min_micro_batch_size if start is None else start), ""

    def _run_step(self, context: _compat.SplitStepContext) -> Any:
        """The closure of one optimizer step: every micro-batch's forward and backward, retried after an OOM.

        Every rank agrees on the outcome of each attempt with exactly one small all-reduce: at its end
        (``"deferred"``), or after the last forward and before DDP's synced backward (``"overlap"`` under DDP). A rank
        that fails earlier goes straight to that agreement; the others meet it there.
        """
        trainer = self._trainer
        assert trainer is not None and self._logs is not None
        _compat.broadcast_ddp_buffers(trainer.strategy)
        # FSDP2 all-gathers in every forward and backward: a rank that failed in one would leave the others waiting
        # there. Gathered once here, before anything can fail, the only collectives left are the agreement and the
        # last backward's reduce-scatter.
        unsharded = (
            _compat.fsdp2_unsharded_for_step(trainer.strategy.model) if self._fsdp2 else contextlib.nullcontext()
        )
        with unsharded:
            while True:
                outcome, agreed, detail = self._agreed_attempt(trainer, context)
                if agreed.fault == _NO_FAULT:
                    break
                self._recover_from_oom(trainer, context, detail, agreed)
        loss, extra = outcome
        if self._defers_sync(trainer):
            group = _compat.ddp_process_group(trainer.strategy)
            self.gradient_allreduces += all_reduce_gradients(self._gradient_params(trainer), group, agreed.used)
            self._grads_summed = True
        with _compat.hook_context(trainer.lightning_module, "training_step"):  # where the user called `self.log`
            self._logs.replay(batch_size=self._step_batch_size)
        return context.make_result(loss, extra)

    def _agreed_attempt(self, trainer: pl.Trainer, context: _compat.SplitStepContext) -> tuple[Any, _Agreed, str]:
        """One attempt at the step, and what all ranks agreed on: ``(outcome, agreement, OOM detail)``.

        An error that is not an OOM is re-raised on this rank after the agreement, and becomes an error on the others.
        """
        fault, detail, outcome = _NO_FAULT, "", None
        agreed: _Agreed | None = None
        self._agreed = None
        try:
            # Lightning's hook bookkeeping doesn't unwind on exceptions; this context does.
            with _compat.hook_context(trainer.lightning_module):
                # Inside the agreement: an empty step batch on one rank stops every rank, it never hangs one.
                self._step_batch_size = _step_batch_size(context, self._hooks)
                self._size = self.planner.size_for(self._step_batch_size)
                outcome = self._attempt(trainer, context, self._size)
        except _PeerFault as peer:
            agreed = peer.agreed  # this rank was fine; the agreement before the synced backward said otherwise
        except _AgreementFailed:
            raise  # the ranks can no longer talk: another collective would fail too, or wait for the timeout
        except Exception as err:  # classified below
            if self._agreed is not None:
                raise  # inside the synced backward: the other ranks are in DDP's all-reduce, not in an agreement
            if not is_oom_error(err):
                self._agree(trainer, _OTHER_ERROR)
                raise
            fault, detail = _OOM, describe_error(err)
        if agreed is None:
            agreed = self._agreed if self._agreed is not None else self._agree(trainer, fault)
        if agreed.fault == _OTHER_ERROR:
            raise RuntimeError(
                "Another rank failed with an error that is not an out-of-memory error; this rank stops too."
                " See that rank's traceback."
            )
        return outcome, agreed, detail or "on another rank"

    def _recover_from_oom(
        self, trainer: pl.Trainer, context: _compat.SplitStepContext, detail: str, agreed: _Agreed
    ) -> None:
        """Shrink (on every rank alike) and make the retry start from a clean slate.

        The planner is told the largest micro-batch and step batch of any rank: ranks whose step batches differ run
        different sizes, and planners told their own would shrink differently (4 -> 2 here, 3 -> 1 there).
        """
        assert self._backend is not None
        self.planner.set_step_batch_size(agreed.step_batch_size)
        self.planner.on_oom(agreed.micro_batch_size, trainer.global_step)  # raises at the minimum size, on every rank
        self.oom_retries += 1
        log_info(f"lightning_accum: OOM at micro-batch size {agreed.micro_batch_size} ({detail}); retrying the step")
        self._take_planner_events(trainer)
        # The failed attempt's graph died with its frame. Every rank starts the retry alike: no gradients, no cached
        # blocks, and a peak that measures the retry alone (the failed attempt's peak, credited to the smaller size,
        # would make the planner shrink a second time).
        self._zero_grad(trainer, context)
        release_memory()
        self._backend.reset_peak()

    def _zero_grad(self, trainer: pl.Trainer, context: _compat.SplitStepContext) -> None:
        context.zero_grad()
        if self._fsdp2:
            # FSDP2 keeps the unsynced micro-batches' gradients unsharded, where `zero_grad` doesn't reach.
            _compat.discard_fsdp2_unsharded_grads(trainer.strategy.model)

    def _attempt(
        self, trainer: pl.Trainer, context: _compat.SplitStepContext, size: int
    ) -> tuple[Tensor, dict[str, Any]]:
        assert self._logs is not None
        self._logs.clear()
        self._zero_grad(trainer, context)
        micro_batches = self._hooks.split(context.batch, size)
        counter = self.count_items
        counts = [micro.size if counter is None else count_items(micro.batch, counter) for micro in micro_batches]
        empty = _is_zero(counts)  # one host read per attempt, none when the counts are ints
        # Ranks whose step batches differ run different numbers of micro-batches: no `k` is shared, so the weights
        # come from a divisor every rank knows alike (the previous step's items per rank).
        self.normalizer.start_window(None)
        window_loss = LossSum()
        extra: dict[str, Any] = {}
        rank, step = trainer.global_rank, trainer.global_step
        synced_last = self.gradient_sync == "overlap" and trainer.world_size > 1
        for index, (micro_batch, n_samples) in enumerate(micro_batches):
            n_items = counts[index]
            weight = self.normalizer.add_micro_batch(n_items, n_samples)
            synced = synced_last and index == len(micro_batches) - 1
            # Every forward runs without DDP's sync, so an attempt abandoned before the synced backward leaves DDP's
            # reducer as it found it; so does every backward but the synced one (FSDP2: none of them reduce-scatters).
            with self._sync_blocked(trainer, blocked=True):
                if self.fault_injector is not None:
                    self.fault_injector.check(
                        rank=rank, step=step, micro_batch=index, phase="forward", micro_batch_size=size
                    )
                with self._logs.capture(n_items):
                    loss, extra = context.training_step(micro_batch)
                if loss is None:
                    raise RuntimeError(
                        "`training_step` returned None for a micro-batch. Under `AutoMicroBatching` every micro-batch"
                        " must return its loss."
                    )
                if self.fault_injector is not None:
                    self.fault_injector.arm_backward(
                        loss, rank=rank, step=step, micro_batch=index, micro_batch_size=size
                    )
                # An empty micro-batch has weight 0, but its loss may be a mean over no items (NaN), and 0 * NaN is
                # NaN in every gradient: skip its backward instead.
                if context.backward is not None and not synced and not empty[index]:
                    context.backward(loss * weight)
            if synced:
                self._synced_backward(trainer, context, loss * weight, empty[index])
            if not empty[index]:
                window_loss.add(loss, n_items, self.loss_reduction)
            del loss
        self._window_loss = window_loss
        mean = torch.as_tensor(window_loss.total) / torch.as_tensor(window_loss.items).clamp(min=1)
        return mean, extra

    def _synced_backward(
        self, trainer: pl.Trainer, context: _compat.SplitStepContext, loss: Tensor, empty: bool
    ) -> None:
        """Overlap mode (and FSDP2): agree that every rank finished its forwards, then run the backward that syncs."""
        if empty and self._fsdp2 and context.backward is not None:
            # Before the agreement, which then stops every rank: a zero loss over the sharded parameters would skip
            # FSDP2's hooks, and this rank would miss the reduce-scatter the others wait in.
            raise RuntimeError(
                f"The last micro-batch of step {trainer.global_step} holds no items on rank {trainer.global_rank},"
                " which `AutoMicroBatching` cannot back-propagate under FSDP2 (its loss is a mean over nothing)."
                " Make every step batch hold items in its last samples, or use a `count_items` that counts samples."
            )
        agreed = self._agree(trainer, _NO_FAULT)
        if agreed.fault != _NO_FAULT:
            raise _PeerFault(agreed)
        self._agreed = agreed  # from here on, a fault on one rank cannot be retried: the others are in the all-reduce
        if context.backward is None:
            return  # Lightning skips the backward on every rank alike; DDP's reducer must then stay unprepared
        if empty:
            # DDP's all-reduce needs this rank's gradients; zero, not NaN, and reaching every parameter.
            loss = torch.stack([(p * 0).sum() for p in trainer.lightning_module.parameters() if p.requires_grad]).sum()
        model = trainer.strategy.model
        if isinstance(model, DistributedDataParallel):
            _compat.prepare_ddp_backward(model, loss)
        try:
            context.backward(loss)
        except Exception as err:
            mode = "FSDP2" if self._fsdp2 else "`gradient_sync='overlap'`"
            if is_oom_error(err):
                remedy = (
                    "Leave more memory headroom (a lower `max_memory` or `micro_batch_size`): under FSDP2 the last"
                    " backward always syncs."
                    if self._fsdp2
                    else "Use `gradient_sync='deferred'` (the default), which recovers from an OOM in any forward or"
                    " backward, or leave more memory headroom (a lower `max_memory` or `micro_batch_size`)."
                )
                collective = "FSDP2's reduce-scatter" if self._fsdp2 else "DDP's all-reduce"
                raise RuntimeError(
                    f"Out of memory inside the synced backward of the last micro-batch ({mode}, micro-batch size"
                    f" {self._size}, step {trainer.global_step}: {describe_error(err)}). The other ranks are already"
                    f" exchanging gradients in {collective}, so this step cannot be retried; they stop when this"
                    f" process exits, or at the process group's timeout. {remedy}"
                ) from err
            raise RuntimeError(
                f"{type(err).__name__} inside the synced backward of the last micro-batch ({mode}):"
                f" {describe_error(err)}. If another rank failed inside its synced backward (an out-of-memory error),"
                " this is how the failure reaches this rank: see that rank's traceback."
            ) from err

    def _agree(self, trainer: pl.Trainer, fault: int) -> _Agreed:
        """The worst fault and the largest micro-batch size over all ranks (one small all-reduce per attempt).

        Under the deferred sync (whose agreement ends the attempt, after every backward) it also carries, per
        parameter, whether this rank produced a gradient: the gradient all-reduce then leaves a parameter that no rank
        used without a gradient, as DDP does. Every call at the same point of the protocol sends as many values on
        every rank, whatever the fault.
        """
        flags = self._gradient_params(trainer) if self._defers_sync(trainer) else []
        local = [fault, self._size, self._step_batch_size, *(int(p.grad is not None) for p in flags)]
        if trainer.world_size <= 1:
            return _Agreed(fault, self._size, self._step_batch_size, None)
        tensor = torch.tensor(local, dtype=torch.int64, device=trainer.strategy.root_device)
        try:
            values = [int(v) for v in max_across_ranks(trainer, tensor).tolist()]
        except Exception as err:
            raise _AgreementFailed(
                f"The ranks' agreement on this step's attempt (step {trainer.global_step}, micro-batch size"
                f" {self._size}) failed: {describe_error(err)}. Another rank most likely stopped (its process exited"
                " or crashed) while this one waited for it; that rank's traceback says why."
            ) from err
        return _Agreed(values[0], values[1], values[2], [bool(v) for v in values[3:]] if flags else None)

    def _defers_sync(self, trainer: pl.Trainer) -> bool:
        """Whether this run sums the gradients itself after the last backward (the same answer on every rank)."""
        return self.gradient_sync == "deferred" and trainer.world_size > 1

    @staticmethod
    def _gradient_params(trainer: pl.Trainer) -> list[Tensor]:
        return [p for p in trainer.lightning_module.parameters() if p.requires_grad]

    @contextlib.contextmanager
    def _sync_blocked(self, trainer: pl.Trainer, blocked: bool) -> Iterator[None]:
        strategy = trainer.strategy
        with contextlib.ExitStack() as stack:
            if blocked and trainer.world_size > 1:
                if hasattr(strategy, "block_backward_sync"):
                    stack.enter_context(strategy.block_backward_sync())
                if self._fsdp2:
                    # Lightning's `block_backward_sync` only blocks models with a `no_sync`, which FSDP2 modules lack.
                    stack.enter_context(_compat.no_fsdp2_gradient_sync(strategy.model))
            yield

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        # Deferred sync summed the buffers over ranks; DDP's own sync averaged them.
        world_size = 1 if self._grads_summed else trainer.world_size
        self._totals = self.normalizer.finish_window(
            params, sum_across_ranks_fn(trainer), world_size, ranks=trainer.world_size
        )
        self._measure_noise(trainer, params, self._totals)
        self._grads_summed = False
        self.consumed_samples += self._totals.samples

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        assert self._backend is not None
        retries = self._backend.alloc_retries() - self._retries_at_start
        local = [self._backend.peak_bytes(), retries, self._size, self._step_batch_size]
        # The largest micro-batch any rank ran goes with the largest peak: every planner is told the same.
        agreed = max_across_ranks(trainer, torch.tensor(local, dtype=torch.int64)).tolist()
        peak, retries, size, step_batch_size = (int(v) for v in agreed)
        self.planner.set_step_batch_size(step_batch_size)
        planned = self.planner.on_step(size, peak_bytes=peak, step=trainer.global_step, alloc_retries_delta=retries)
        self._size_shrunk = planned < size
        self._warn_if_budget_unreachable()
        if self._totals is not None:
            totals, self._totals = self._totals, None
            self._publish_step("split", size, totals, self._window_loss, peak, self.planner.budget_bytes)
        # A shrink or grow decided now applies from the next step on: it is reported with that step, where the
        # logged micro-batch size changes (an OOM's events belong to the step that recovered, reported above).
        self._take_planner_events(trainer)

    def _warn_if_budget_unreachable(self) -> None:
        # The planner says when shrinking cannot meet the budget (at the smallest size, or shrinks that did not lower
        # the peak); once per fit is enough.
        if self.planner.budget_unreachable is not None and not self._warned_unreachable:
            self._warned_unreachable = True
            rank_zero_warn(self.planner.budget_unreachable)

    def _take_planner_events(self, trainer: pl.Trainer) -> None:
        for event in self.planner.take_events():
            self._record(AccumulationEvent(event.kind, event.step, event.before, event.after, event.reason))

    # ----------------------------------------------------------------------------------------------------------
    # checkpointing
    # ----------------------------------------------------------------------------------------------------------
    @override
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "planner": self.planner.state_dict()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.planner.load_state_dict(state_dict.get("planner", {}))


class _AgreementFailed(RuntimeError):
    """The small all-reduce through which the ranks agree on an attempt failed: a peer is gone."""


class _Agreed(NamedTuple):
    """What every rank learns from one agreement."""

    fault: int  # the worst over all ranks
    micro_batch_size: int  # the largest any rank ran, which every rank's planner is told
    step_batch_size: int  # the largest over ranks, likewise
    used: list[bool] | None  # deferred sync: per parameter, whether any rank produced a gradient


class _PeerFault(Exception):
    """This rank finished its forwards, but the agreement before the synced backward reported a fault elsewhere."""

    def __init__(self, agreed: _Agreed) -> None:
        super().__init__(agreed.fault)
        self.agreed = agreed


def _step_batch_size(context: _compat.SplitStepContext, hooks: BatchHooks) -> int:
    size = hooks.batch_size(context.batch)
    if size < 1:
        raise ValueError(
            f"`AutoMicroBatching` got a step batch with 0 samples (batch_idx={context.batch_idx}): there is nothing to"
            " split into micro-batches or to step on. Every batch the training dataloader yields must hold at least"
            " one sample. Check the batch sampler (one that yields an empty list of indices) and the collate_fn (one"
            " that filters out every sample of a batch), and skip such batches in the dataloader; if only the short"
            " last batch can end up empty, `DataLoader(drop_last=True)` drops it."
        )
    return size


def _is_zero(counts: list[int | Tensor]) -> list[bool]:
    """Which micro-batches hold no items: one host read for the whole attempt, none when the counts are ints."""
    tensors = [c for c in counts if isinstance(c, Tensor)]
    if not tensors:
        return [c == 0 for c in counts]
    device = tensors[0].device
    flags = torch.stack([torch.as_tensor(c, device=device).reshape(()) == 0 for c in counts])
    return [bool(flag) for flag in flags.tolist()]


def _warn_about_batch_norm(pl_module: pl.LightningModule) -> None:
    layers = [
        f"{name}: {type(module).__name__}"
        for name, module in pl_module.named_modules()
        if isinstance(module, _BatchNorm)
    ]
    if not layers:
        return
    shown = ", ".join(layers[:3]) + (f" and {len(layers) - 3} more" if len(layers) > 3 else "")
    rank_zero_warn(
        f"The LightningModule has batch-norm layers ({shown}). `AutoMicroBatching` runs the step batch in"
        " micro-batches, and batch norm normalizes each micro-batch over its own samples, so the update is not the"
        " full-batch update (the one part of split mode that is not exact) and the running statistics differ too."
        " Use GroupNorm or LayerNorm, or keep the step batch in one piece with"
        " `AutoMicroBatching(<step batch size>, pin_micro_batch_size=True)` if it fits (it is still split after an"
        " OOM)."
    )


OVERLAP_WAIT_LIMIT = timedelta(minutes=10)
"""Longer than this, a rank left waiting by an OOM inside the synced backward is worth a warning."""


def overlap_wait_warning(
    gradient_sync: str, world_size: int, backend: str | None, timeout: timedelta | None
) -> str | None:
    """The warning for a run whose ranks could wait out a long NCCL timeout after an OOM in the synced backward.

    With ``gradient_sync="overlap"`` (and under FSDP2) an OOM inside the last backward on one rank cannot be retried:
    that rank stops, and the others learn of it when their all-reduce fails. gloo notices the closed connection at
    once; NCCL may not notice a dead peer and waits for the process group's timeout (30 minutes in Lightning).

    Examples:
        >>> overlap_wait_warning("overlap", 8, "nccl", timedelta(minutes=5)) is None
        True
        >>> overlap_wait_warning("overlap", 8, "nccl", timedelta(minutes=30))[:58]
        "With `gradient_sync='overlap'`, an OOM inside the last mic"
    """
    if gradient_sync != "overlap" or world_size < 2 or backend != "nccl" or timeout is None:
        return None
    if timeout <= OVERLAP_WAIT_LIMIT:
        return None
    return (
        f"With `gradient_sync='overlap'`, an OOM inside the last micro-batch's backward on one rank cannot be retried,"
        f" and NCCL may leave the other ranks waiting in its all-reduce until the process group's timeout"
        f" ({timeout}). Bound the wait with e.g. `DDPStrategy(timeout=timedelta(minutes=5))` (or"
        f" `ModelParallelStrategy(timeout=...)`), above the slowest collective of your run, or use"
        f" `gradient_sync='deferred'` under DDP, which retries an OOM anywhere in the step."
    )
