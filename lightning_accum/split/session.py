"""Split mode, once for every front end: the planner, the budget, the sync policy, the step runner, the cold start.

`lightning_accum.AutoMicroBatching` (the ``Trainer``) and `lightning_accum.fabric.FabricMicroBatching` (a Fabric loop)
are glue over a `SplitSession`: each turns its framework's hooks into the same calls, once per step batch,

1. `SplitSession.begin_step` (the planner's last decision reported, memory released after a shrink, the cold start
   on the first step, the peak reset);
2. the step itself, `SplitSession.runner` (`lightning_accum.split.step.SplitStepRunner`), as Lightning's closure or
   called by the Fabric front end;
3. `SplitSession.close_window` at the optimizer step (the exact gradient over every rank);
4. `SplitSession.end_step` (the figures agreed over ranks, the planner's next size, what the step report shows).

A split-mode fix lands here once, for the ``Trainer`` and Fabric alike. Why the micro-batch shrank is
`lightning_accum.split.planner.MicroBatchPlanner`'s to say.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from lightning_accum._util.log import log, log_info
from lightning_accum._util.validation import check_bool, check_choice, check_int
from lightning_accum.core.engine import AccumulationEngine, ClosedWindow, Ranks
from lightning_accum.core.step_report import AccumulationEvent, LossSum
from lightning_accum.memory.backends import MemoryBackend, backend_for
from lightning_accum.memory.budget import budget_bytes, check_max_memory, over_capacity_warning
from lightning_accum.memory.oom import OOMInjector, release_cached_memory
from lightning_accum.memory.sizes import format_size
from lightning_accum.sequences import PaddedSequences
from lightning_accum.sequences.balanced_sampler import ranks_deal_apart
from lightning_accum.sequences.balancing import StepCost
from lightning_accum.sequences.loaders import balanced_samplers, check_loader_lengths, unpinned_budget, weigh_shares
from lightning_accum.split.cold_start import PreflightStart
from lightning_accum.split.planner import MicroBatchPlanner, PlannerEvent, PlannerSettings, Tokens
from lightning_accum.split.preflight import Preflight
from lightning_accum.split.step import SplitStepRunner, StepHost
from lightning_accum.split.step_figures import published_figures
from lightning_accum.split.step_logs import StepLogCombiner
from lightning_accum.split.sync import (
    GRADIENT_SYNCS,
    GradientSync,
    SyncKind,
    resolve_gradient_sync,
    sync_policy,
)

SAMPLE_COUNT_BY_TOKENS = (
    "`count_items` is None (the default: each micro-batch counts its samples) with `sequences={sequences!r}`."
    " Split by tokens, micro-batches hold very different numbers of tokens, so a loss that averages over tokens gets"
    " an update that is not the full batch's. Count the loss-bearing tokens:"
    ' `count_items=CountTokens("labels", shift=1)` (`from lightning_accum.items import CountTokens`; `shift=1` for a'
    " model that shifts its labels inside, as Hugging Face causal LMs do, `shift=0` for labels already shifted), in"
    " a LightningCLI config `count_items: {{class_path: lightning_accum.items.CountTokens, init_args: {{key: labels,"
    " shift: 1}}}}`. If the loss is a mean over samples, pass `count_items=CountSamples()` to say so."
)

_TOKENS_HINT = "It is the most padded tokens (samples x longest sequence) a micro-batch may hold, e.g. 4096."


class StepFigures(NamedTuple):
    """What a split step's report shows beside the window's totals (`lightning_accum.core.step_report.StepReport`)."""

    micro_batch_size: int  # samples in a micro-batch (by tokens: the largest micro-batch's)
    report: dict[str, Any]  # the report's split-mode fields: peak, budget, token figures, the ranks' balance


class SplitSession:
    """Split mode for one front end: the planner, the budget, the sync policy, the step runner and the cold start.

    Built with the front end (its arguments checked there and then); `start` completes it once the device, the
    strategy and the ranks are known. The arguments mean what `lightning_accum.AutoMicroBatching`'s do.

    Args:
        engine: the front end's accumulation engine (counting, weights, the window's close).
        record: takes each event (a shrink, a grow, an OOM recovered) for the front end's step reports.
        on_oom: told of each OOM recovered (the front end counts them in its state).
        planner_settings: the planner's other settings (`lightning_accum.split.planner.PlannerSettings`).

    Raises:
        TypeError, ValueError: an argument that is not valid on its own (each message names it).
    """

    def __init__(
        self,
        engine: AccumulationEngine,
        record: Callable[[AccumulationEvent], None],
        on_oom: Callable[[], None],
        *,
        micro_batch_size: Any = PlannerSettings.micro_batch_size,
        micro_batch_tokens: Any = "auto",
        sequences: PaddedSequences | None = None,
        split_batch: Any = None,
        max_memory: Any = None,
        gradient_sync: GradientSync | None = None,
        preflight: bool = True,
        fault_injector: OOMInjector | None = None,
        **planner_settings: Any,
    ) -> None:
        self.engine, self.record, self.on_oom, self.fault_injector = engine, record, on_oom, fault_injector
        min_size = planner_settings.get("min_micro_batch_size", PlannerSettings.min_micro_batch_size)
        self.sequences = check_sequences(sequences, micro_batch_size, micro_batch_tokens, split_batch, min_size)
        size = micro_batch_tokens if sequences is not None else micro_batch_size
        if sequences is not None and micro_batch_tokens != "auto":  # the planner's settings would name its own size
            check_int(micro_batch_tokens, "micro_batch_tokens", 1, alternative='"auto"', hint=_TOKENS_HINT)
        settings = PlannerSettings(size, **planner_settings)
        self.planner = MicroBatchPlanner(settings, unit=Tokens() if sequences is not None else None)
        self.max_memory_given = max_memory  # as the user wrote it, for the run config
        self.max_memory = check_max_memory(max_memory)
        if gradient_sync is not None:
            check_choice(gradient_sync, "gradient_sync", GRADIENT_SYNCS, hint="None picks the strategy's default.")
        self.gradient_sync_given = gradient_sync
        self.gradient_sync: GradientSync = gradient_sync or "deferred"  # resolved against the strategy
        self.preflight = check_bool(preflight, "preflight")
        self.preflight_result: Preflight | None = None  # what the cold start's trace found (this rank's)
        self.capacity_bytes = 0
        self.runner: SplitStepRunner | None = None  # one per run, built by `start`
        self._host: StepHost | None = None
        self._backend: MemoryBackend | None = None
        self._decided: list[PlannerEvent] = []  # the last step's shrink or grow, reported when the next step starts
        self._shrunk = False
        self._retries_at_start = 0
        self._cold = False
        self._warned_sample_count = False
        self._price: StepCost | None = None  # the balanced sampler's, where one deals the steps
        self._budget_given = (micro_batch_tokens, settings.pin_micro_batch_size)  # to check the sampler's against
        self._dealt = False  # whether a `BalancedBatchSampler` deals the ranks (by a price the compute can belie)

    # ---- the run ----------------------------------------------------------------------------------------------

    def resolve(self, kind: SyncKind) -> GradientSync:
        """Check ``gradient_sync`` against the strategy's kind; warn once where by tokens counts samples."""
        self.gradient_sync = resolve_gradient_sync(kind, self.gradient_sync_given)
        if not self._warned_sample_count:
            self._warned_sample_count = _warn_about_the_sample_count(self.sequences, self.engine)
        return self.gradient_sync

    def start(self, host: StepHost, strategy: Any, kind: SyncKind, module: Any = None) -> SplitStepRunner:
        """Complete the session for a run on ``host``: the budget, the sync policy and the step runner.

        ``module``: the LightningModule whose ``self.log`` calls a step combines (``None`` in a Fabric loop).
        """
        self.resolve(kind)
        backend = backend_for(strategy.root_device)
        logs = StepLogCombiner(module if module is not None else pl.LightningModule())
        self._host, self._backend = host, backend
        capacity = self.capacity_bytes = backend.capacity_bytes()
        budget = budget_bytes(self.max_memory, capacity)
        warning = over_capacity_warning(self.max_memory_given, budget, capacity, backend.name)
        if warning:
            rank_zero_warn(warning)
        self.planner.set_budget(budget)
        policy = sync_policy(kind, strategy, host.world_size, self.gradient_sync)
        self.runner = SplitStepRunner(
            host,
            self.engine,
            self.planner,
            policy,
            logs,
            backend,
            on_oom=self._recovered_from_oom,
            fault_injector=self.fault_injector,
            sequences=self.sequences,
        )
        if self._price is not None:
            self.runner.price = self._price
        planner = self.planner
        # "auto", not resumed with a size already chosen: the first step is traced.
        self._cold = self.preflight and planner.settings.predictive and planner.settings.micro_batch_size == "auto"
        self._cold = self._cold and planner.micro_batch_size is None
        log_info(
            f"lightning_accum: split mode, memory budget {format_size(budget)} of {format_size(capacity)}"
            f" ({backend.name})"
        )
        return self.runner

    def watch_loaders(self, loaders: Any, world_size: int) -> None:
        """Check the run's loaders before any step (every rank alike), and price steps as their sampler deals them.

        A `BalancedBatchSampler` that deals by a measured pass cost (or a quadratic term) has the ranks' balance
        (``accum/rank_imbalance``) priced by the same figures. One that prices at a token budget split mode may not
        cut at (``"auto"``, or not pinned) is warned about (`lightning_accum.sequences.loaders.unpinned_budget`). See
        `refuse_ranks_that_deal_apart`.
        """
        refuse_ranks_that_deal_apart(loaders, world_size)
        samplers = balanced_samplers(loaders)
        if samplers:
            self._price, self._dealt = samplers[0].step_cost, True
            if self.runner is not None:
                self.runner.price = self._price
            if self.sequences is not None and (warning := unpinned_budget(samplers, *self._budget_given)):
                rank_zero_warn(warning)

    # ---- one step ---------------------------------------------------------------------------------------------

    def begin_step(self, batch: Any, module: Any, optimizers: Sequence[Any], precision: Any = "32-true") -> None:
        """Before a step batch runs: report the last decision, release after a shrink, trace a cold start."""
        host, backend = self._host, self._backend
        assert host is not None and backend is not None, "`SplitSession.start` comes first"
        decided, self._decided = self._decided, []
        self._report(decided)  # the last step's shrink or grow: this step runs with it
        if self._shrunk:
            # What the larger size left cached (CUDA) or resident (CPU heap) would inflate the peak measured at the
            # new size; a grow has nothing to release: the larger step reuses what the smaller one held.
            release_cached_memory()
            self._shrunk = False
        if self._cold:
            self._cold = False
            cold = PreflightStart(
                host, module, batch, self.planner, self.engine.hooks, backend, optimizers, precision, self.sequences
            )
            self.preflight_result = cold.run()
        backend.reset_peak()
        self._retries_at_start = backend.alloc_retries()

    def close_window(self, step: int, parameters: Sequence[Tensor]) -> ClosedWindow:
        """At the optimizer step: the window's exact gradient over every rank, with the step's summed figures."""
        runner, host = self.runner, self._host
        assert runner is not None and host is not None
        # The deferred sync summed the buffers over ranks; DDP's own sync averaged them. By tokens, the padded and
        # real tokens are summed over ranks in the same all-reduce as the window's counts.
        averaged_over = 1 if runner.policy.sums_gradients else None
        extra = runner.summed_figures()
        return self.engine.close_window(step, list(parameters), Ranks.of(host), averaged_over, extra=extra)

    @property
    def window_loss(self) -> LossSum:
        """This rank's loss over the last step's items (`lightning_accum.core.step_report.LossSum`)."""
        assert self.runner is not None
        return self.runner.window_loss

    def end_step(self, step: int, closed: ClosedWindow | None) -> StepFigures | None:
        """After the step, on every rank: the agreed figures, the planner's next size, and the report's figures.

        ``closed``: the window `close_window` closed, or ``None`` where the optimizer step was skipped (every rank
        alike): the figures are still agreed and the planner still told, and there is nothing to report.
        """
        runner, backend, host = self.runner, self._backend, self._host
        assert runner is not None and backend is not None and host is not None
        figures = runner.agreed_figures(backend.alloc_retries() - self._retries_at_start)
        planned = self.planner.on_step(figures.size, figures.peak, step, figures.alloc_retries)
        self._shrunk = planned < figures.size
        if (unreachable := self.planner.unreachable_warning()) is not None:  # shrinking cannot meet the budget
            rank_zero_warn(unreachable)  # said once
        # A shrink or grow decided now applies from the next step on: it is reported when that step starts, and never
        # for a step that does not run. An OOM's events belong to the step that recovered (`_recovered_from_oom`).
        self._decided = self.planner.take_events()
        if closed is None:
            return None
        by_tokens = self.sequences is not None
        samples, tokens, balance = published_figures(figures, closed.totals.extra, by_tokens, host.world_size)
        report = {
            "peak_bytes": figures.peak,
            "budget_bytes": self.planner.budget_bytes,
            "micro_batch_tokens": None if tokens is None else tokens[0],
            "padding_fraction": None if tokens is None else tokens[1],
            "rank_imbalance": None if balance is None else balance.imbalance,
            "sync_wait_seconds": None if balance is None else balance.sync_wait_seconds,
            # Where a balanced sampler deals the ranks by a price: how far the measured compute strays from it.
            "price_error": None if balance is None or not self._dealt else balance.price_error,
        }
        return StepFigures(samples, report)

    def _recovered_from_oom(self, size: int, detail: str, here: bool) -> None:
        self.on_oom()
        message = f"lightning_accum: OOM at {self.planner.unit.noun} {size} ({detail}); retrying the step"
        # Rank 0 speaks for every rank; a rank that ran out of memory also says so, with its own error.
        (log.info if here else log_info)(message)
        self._report(self.planner.take_events())

    def _report(self, events: list[PlannerEvent]) -> None:
        for event in events:
            self.record(AccumulationEvent(event.kind, event.step, event.before, event.after, event.reason, event.unit))

    def clear(self) -> None:
        """After a run stopped (an exception included): no half-finished step behind for the next one."""
        self._shrunk = False
        if self.runner is not None:
            self.runner.logs.clear()

    # ---- settings and state -----------------------------------------------------------------------------------

    def settings(self) -> dict[str, Any]:
        """The session's settings as the user gave them, for a run's config."""
        budget = self.planner.budget_bytes
        # The settings the front ends take (the planner's `refit_tolerance` is not one of their arguments).
        planner = {k: v for k, v in self.planner.settings.run_config().items() if k != "refit_tolerance"}
        return {
            "mode": "split",
            **planner,
            "max_memory": self.max_memory_given,
            "budget_bytes": None if budget is None else int(budget),  # resolved at the start of training
            "memory_capacity_bytes": self.capacity_bytes,
            "gradient_sync": self.gradient_sync,
            "preflight": self.preflight,
            **({"sequences": repr(self.sequences)} if self.sequences is not None else {}),
        }

    def state_dict(self) -> dict[str, Any]:
        return {"planner": self.planner.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.planner.load_state_dict(state.get("planner", {}))


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


def refuse_ranks_that_deal_apart(loaders: Any, world_size: int) -> None:
    """Raise on every rank where the ranks' `BalancedBatchSampler`s in ``loaders`` would deal by different settings.

    Each rank computes every step's deal from its own sampler: a rank with other lengths or another step cost deals
    otherwise, and samples are lost or trained on twice, silently. Every rank takes part (an empty list where it has
    no such sampler), so no rank waits on another, and every rank reads the same gathered settings, so all raise alike.
    Every rank must call it at the same point (a collective). ``loaders``: a DataLoader (Fabric's too), or a list or
    dict of them.
    """
    check_loader_lengths(loaders)  # every rank holds the same lengths, or this refuses them all
    weigh_shares(loaders, "split mode")  # it weighs each rank's loss by its count: the sampler need not warn
    if world_size < 2 or not (dist.is_available() and dist.is_initialized()):
        return
    mine = [sampler.deal_settings() for sampler in balanced_samplers(loaders)]
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    message = ranks_deal_apart(every)
    if message:
        raise RuntimeError(message)


def _warn_about_the_sample_count(sequences: PaddedSequences | None, engine: AccumulationEngine) -> bool:
    """Warn where split by tokens counts samples for a mean loss (`SAMPLE_COUNT_BY_TOKENS`); whether it warned."""
    if sequences is None or engine.count_items is not None or engine.loss_reduction != "mean":
        return False
    rank_zero_warn(SAMPLE_COUNT_BY_TOKENS.format(sequences=sequences))
    return True


__all__ = ["SplitSession", "StepFigures", "check_sequences", "refuse_ranks_that_deal_apart"]
