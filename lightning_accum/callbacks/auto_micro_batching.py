"""``AutoMicroBatching``: split each step batch into micro-batches that fit, and never lose a step to an OOM.

The callback is the Lightning glue: it checks the setup, builds a `lightning_accum.split.step.SplitStepRunner` (one
step's micro-batches, OOM retries and the ranks' agreement) with the strategy's
`lightning_accum.split.sync.SyncPolicy`, asks `lightning_accum.split.planner.MicroBatchPlanner` for the size, and
publishes what each step did.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.utilities import rank_zero_warn
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
from lightning_accum._util.validation import check_bool, check_choice
from lightning_accum.batches import BatchSizeFn, SplitBatchFn
from lightning_accum.callbacks._owner import AccumulationOwner, log, log_info
from lightning_accum.callbacks._split_checks import (
    ACCUMULATE_GRAD_BATCHES_CHANGED,
    GRADIENT_ACCUMULATION_SCHEDULER,
    SAMPLE_COUNT_BY_TOKENS,
    refuse_ranks_that_deal_apart,
    refuse_what_split_mode_cannot_run,
    warn_about_batch_norm,
    warn_about_overlap_waits,
)
from lightning_accum.core.engine import ClosedWindow
from lightning_accum.core.normalization import ItemCounter, LossReduction
from lightning_accum.core.step_report import AccumulationEvent
from lightning_accum.memory.backends import MemoryBackend, backend_for
from lightning_accum.memory.budget import budget_bytes, check_max_memory, over_capacity_warning
from lightning_accum.memory.oom import OOMInjector, release_cached_memory
from lightning_accum.memory.sizes import format_size
from lightning_accum.sequences import PaddedSequences
from lightning_accum.split.cold_start import PreflightStart
from lightning_accum.split.planner import MicroBatchPlanner, PlannerEvent
from lightning_accum.split.planner.settings import PlannerSettings
from lightning_accum.split.planner.units import Tokens
from lightning_accum.split.preflight import Preflight
from lightning_accum.split.step import SplitStepRunner, published_figures
from lightning_accum.split.step_logs import StepLogCombiner
from lightning_accum.split.sync import (
    GRADIENT_SYNCS,
    GradientSync,
    overlap_wait_warning,
    resolve_gradient_sync,
    sync_policy,
)

__all__ = ["AutoMicroBatching", "GradientSync", "PreflightStart", "overlap_wait_warning"]


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
        self._max_memory_given = max_memory  # as the user wrote it, for the run config
        self.max_memory = check_max_memory(max_memory)
        if gradient_sync is not None:
            check_choice(gradient_sync, "gradient_sync", GRADIENT_SYNCS, hint="None picks the strategy's default.")
        self._gradient_sync_given = gradient_sync
        self.gradient_sync: GradientSync = gradient_sync or "deferred"  # resolved against the strategy at setup
        self.fault_injector = fault_injector
        self.preflight = check_bool(preflight, "preflight")
        self.preflight_result: Preflight | None = None  # what the cold start's trace found (this rank's)
        self._split_batch, self._batch_size_of = split_batch, batch_size_of  # at setup, these win over module methods
        self.engine.resolve_hooks(None, split_batch=split_batch, batch_size_of=batch_size_of)  # checks them now
        self.sequences = check_sequences(
            sequences, micro_batch_size, micro_batch_tokens, split_batch, min_micro_batch_size
        )
        self.splits_by_tokens = self.sequences is not None
        self.splits_steps = True
        # The settings validate the sizes and thresholds; the budget is set once the device is known.
        settings = PlannerSettings(
            micro_batch_tokens if sequences is not None else micro_batch_size,
            min_micro_batch_size=min_micro_batch_size,
            pin_micro_batch_size=pin_micro_batch_size,
            low_watermark=low_watermark,
            grow_patience=grow_patience,
            oom_cooldown=oom_cooldown,
            predictive=predictive,
        )
        self.planner = MicroBatchPlanner(settings, unit=Tokens() if sequences is not None else None)
        self._runner: SplitStepRunner | None = None  # one per fit, built at the start of training
        self._backend: MemoryBackend | None = None
        self._retries_at_start = 0
        self._size_shrunk = False
        self._decided: list[PlannerEvent] = []  # the last step's shrink or grow, logged when the next step starts
        self._warned_sample_count = False  # `SAMPLE_COUNT_BY_TOKENS`, once per callback
        self._capacity_bytes = 0
        self._closed: ClosedWindow | None = None
        self._cold = False  # the first step of a run that has not chosen a size yet

    @property
    def gradient_allreduces(self) -> int:
        """Collectives the deferred gradient sync issued in the last fit, for tests and benchmarks."""
        return self._runner.gradient_allreduces if self._runner is not None else 0

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        refuse_what_split_mode_cannot_run(trainer, pl_module)
        strategy = trainer.strategy
        self.gradient_sync = resolve_gradient_sync(strategy, self._gradient_sync_given)
        if any(isinstance(cb, GradientAccumulationScheduler) for cb in trainer.callbacks):  # type: ignore[attr-defined]  # undeclared on Lightning's Trainer
            raise RuntimeError(GRADIENT_ACCUMULATION_SCHEDULER)
        warn_about_batch_norm(pl_module)
        if not self._warned_sample_count:
            self._warned_sample_count = _warn_about_the_sample_count(self)
        warn_about_overlap_waits(trainer, self.gradient_sync)
        self.engine.resolve_hooks(pl_module, split_batch=self._split_batch, batch_size_of=self._batch_size_of)
        self._claim(trainer)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        refuse_ranks_that_deal_apart(trainer.train_dataloader, trainer.world_size)
        self._backend = backend = backend_for(trainer.strategy.root_device)
        budget, capacity = _memory_budget(self.max_memory, self._max_memory_given, backend)
        self.planner.budget_bytes = budget
        self._capacity_bytes = capacity
        policy = sync_policy(trainer.strategy, trainer.world_size, self.gradient_sync)
        self._runner = SplitStepRunner(
            trainer,
            self.engine,
            self.planner,
            policy,
            StepLogCombiner(pl_module),
            backend,
            on_oom=self._recovered_from_oom,
            fault_injector=self.fault_injector,
            sequences=self.sequences,
        )
        self._install(_compat.install_split_closure(trainer, self._runner))
        planner = self.planner
        # "auto", not resumed with a size already chosen: the first step is traced.
        self._cold = self.preflight and planner.predictive and planner.micro_batch_size_setting == "auto"
        self._cold = self._cold and planner.micro_batch_size is None
        log_info(
            f"lightning_accum: split mode, memory budget {format_size(budget)} of {format_size(capacity)}"
            f" ({backend.name})"
        )

    @override
    def settings(self) -> dict[str, Any]:
        budget = self.planner.budget_bytes
        # The settings this callback takes (the planner's `refit_tolerance` is not one of its arguments).
        planner = {k: v for k, v in self.planner.settings.run_config().items() if k != "refit_tolerance"}
        return {
            "mode": "split",
            **planner,
            "max_memory": self._max_memory_given,
            "budget_bytes": None if budget is None else int(budget),  # resolved at the start of training
            "memory_capacity_bytes": self._capacity_bytes,
            **super().settings(),
            "gradient_sync": self.gradient_sync,
            "split_batch": self._hooks.split_batch_source,
            "preflight": self.preflight,
            **({"sequences": repr(self.sequences)} if self.sequences is not None else {}),
        }

    @override
    def _restore(self, trainer: pl.Trainer) -> None:
        # Also after an exception: a second `fit` of the same Trainer must find no half-finished step behind.
        super()._restore(trainer)
        self._size_shrunk = False
        if self._runner is not None:
            self._runner.logs.clear()

    # ----------------------------------------------------------------------------------------------------------
    # one optimizer step (its micro-batches run in `lightning_accum.split.step.SplitStepRunner`)
    # ----------------------------------------------------------------------------------------------------------
    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        assert self._backend is not None
        decided, self._decided = self._decided, []
        self._take_planner_events(decided)  # the last step's shrink or grow: this step runs with it
        if trainer.accumulate_grad_batches != 1:
            # Set after `setup` (by a callback such as `GradientAccumulationScheduler`, or by hand): Lightning would
            # skip optimizer steps, and split mode would silently drop step batches.
            raise ValueError(ACCUMULATE_GRAD_BATCHES_CHANGED.format(trainer=trainer))
        if self._size_shrunk:
            _release_what_the_larger_size_held()
            self._size_shrunk = False
        if self._cold:
            self._cold = False
            cold = PreflightStart(trainer, pl_module, batch, self.planner, self._hooks, self._backend, self.sequences)
            self.preflight_result = cold.run()
        self._backend.reset_peak()
        self._retries_at_start = self._backend.alloc_retries()

    def _recovered_from_oom(self, size: int, detail: str, here: bool) -> None:
        self.oom_retries += 1
        message = f"lightning_accum: OOM at {self.planner.unit.noun} {size} ({detail}); retrying the step"
        # Rank 0 speaks for every rank; a rank that ran out of memory also says so, with its own error.
        (log.info if here else log_info)(message)
        self._take_planner_events()

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        runner = self._runner
        assert runner is not None
        # The deferred sync summed the buffers over ranks; DDP's own sync averaged them. By tokens, the padded and
        # real tokens are summed over ranks in the same all-reduce as the window's counts.
        averaged_over = 1 if runner.policy.sums_gradients else None
        self._closed = self._close_window(trainer, optimizer, averaged_over, runner.summed_figures())

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        backend, runner = self._backend, self._runner
        assert backend is not None and runner is not None
        figures = runner.agreed_figures(backend.alloc_retries() - self._retries_at_start)
        planned = self.planner.on_step(figures.size, figures.peak, trainer.global_step, figures.alloc_retries)
        self._size_shrunk = planned < figures.size
        if (unreachable := self.planner.unreachable_warning()) is not None:  # shrinking cannot meet the budget
            rank_zero_warn(unreachable)  # said once
        if self._closed is not None:
            closed, self._closed = self._closed, None
            by_tokens, world = self.sequences is not None, trainer.world_size
            samples, tokens, ranks = published_figures(figures, closed.totals.extra, by_tokens, world)
            budget = self.planner.budget_bytes
            self._publish_step("split", samples, closed, runner.window_loss, figures.peak, budget, tokens, ranks)
        # A shrink or grow decided now applies from the next step on: it is logged and reported when that step
        # starts, where the logged micro-batch size changes, and never for a step that does not run (after the last
        # one). An OOM's events belong to the step that recovered, reported above.
        self._decided = self.planner.take_events()

    def _take_planner_events(self, events: list[PlannerEvent] | None = None) -> None:
        for event in self.planner.take_events() if events is None else events:
            self._record(AccumulationEvent(event.kind, event.step, event.before, event.after, event.reason, event.unit))

    @override
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "planner": self.planner.state_dict()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.planner.load_state_dict(state_dict.get("planner", {}))


def check_sequences(
    sequences: PaddedSequences | None,
    micro_batch_size: Any,
    micro_batch_tokens: Any,
    split_batch: Any,
    min_micro_batch_size: Any = PlannerSettings.min_micro_batch_size,
) -> PaddedSequences | None:
    """``sequences``, checked against the arguments that go with it (split mode by tokens, or by samples).

    Raises:
        TypeError: ``sequences`` is not a `PaddedSequences`.
        ValueError: ``micro_batch_tokens`` without ``sequences``, or ``micro_batch_size``, ``split_batch`` or a
            ``min_micro_batch_size`` with it.
    """
    if sequences is None:
        if micro_batch_tokens != "auto":
            raise ValueError(
                f"`micro_batch_tokens={micro_batch_tokens!r}` needs `sequences=`: the token budget sizes micro-batches"
                " of padded sequences. Pass e.g. `sequences=PaddedSequences(mask='attention_mask')`, or set"
                " `micro_batch_size` to split by samples."
            )
        return None
    if not isinstance(sequences, PaddedSequences):
        raise TypeError(
            f"`sequences` must be a `lightning_accum.sequences.PaddedSequences` or None, got {sequences!r} of type"
            f" {type(sequences).__name__}."
        )
    if micro_batch_size != "auto":
        raise ValueError(
            f"`micro_batch_size={micro_batch_size!r}` does not apply with `sequences=`: micro-batches are sized by"
            f" padded tokens. Pass `micro_batch_tokens={micro_batch_size!r} * <tokens per sample>` instead."
        )
    if split_batch is not None:
        raise ValueError(
            "`split_batch` does not apply with `sequences=`: the step batch is cut by tokens (sorted by length,"
            " trimmed). Remove one of them."
        )
    if min_micro_batch_size != PlannerSettings.min_micro_batch_size:
        raise ValueError(
            f"`min_micro_batch_size={min_micro_batch_size!r}` does not apply with `sequences=`: split by tokens, the"
            " smallest micro-batch is the step's longest sequence alone (the token budget cannot go below it)."
            " Remove `min_micro_batch_size`."
        )
    return sequences


# Split by tokens, micro-batches hold very different numbers of tokens: weighting each micro-batch's token mean by its
# samples is the "mean of means" this package exists to fix, and it is silent (1.2x off on the run).


def _memory_budget(max_memory: Any, as_given: Any, backend: MemoryBackend) -> tuple[int, int]:
    """The planner's memory budget and the device's capacity, in bytes; warns where ``max_memory`` is over it."""
    capacity = backend.capacity_bytes()
    budget = budget_bytes(max_memory, capacity)
    warning = over_capacity_warning(as_given, budget, capacity, backend.name)
    if warning:
        rank_zero_warn(warning)
    return budget, capacity


def _release_what_the_larger_size_held() -> None:
    """After a shrink: release what the larger size left behind, once (re-faulting pages every step costs throughput).

    Memory freed by the larger size stays cached (CUDA) or resident (CPU heap) and would inflate the peak measured at
    the new size. A grow has nothing to release: the larger step reuses what the smaller one held.
    """
    release_cached_memory()


def _warn_about_the_sample_count(callback: AutoMicroBatching) -> bool:
    """Warn where split by tokens counts samples for a mean loss (`SAMPLE_COUNT_BY_TOKENS`); whether it warned."""
    if callback.sequences is None or callback.count_items is not None or callback.loss_reduction != "mean":
        return False
    rank_zero_warn(SAMPLE_COUNT_BY_TOKENS.format(sequences=callback.sequences))
    return True
