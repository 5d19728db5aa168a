"""One optimizer step of split mode: every micro-batch's forward and backward, retried after an OOM, on every rank.

`SplitStepRunner` is the closure `lightning_accum.AutoMicroBatching` gives Lightning's automatic optimization. For
each attempt at a step it cuts the step batch at the planner's size, runs the micro-batches with their exact weights
(`lightning_accum.core.engine.AccumulationEngine`), and lets the ranks agree on the outcome with exactly one small
all-reduce (`SplitStepRunner.agree`): at the end of the attempt, or, where the last backward syncs
(`lightning_accum.split.sync.SyncPolicy.syncs_in_last_backward`), after the last forward and before that backward.
A rank that fails earlier goes straight to that agreement; the others meet it there.

=============================  ====================================================================================
outcome of an attempt          what every rank does
=============================  ====================================================================================
`Fault.NONE` everywhere        the sync policy finishes the step (the deferred all-reduce), and ``self.log`` calls
                               are replayed once
`Fault.OOM` on some rank       discard the attempt, shrink the planner alike on every rank, re-run the same batch
`Fault.OTHER` on some rank     that rank re-raises its error; every other rank raises "Another rank failed"
a fault in the synced backward no retry is possible (the others are in the collective): a clear error
=============================  ====================================================================================
"""

from __future__ import annotations

import time
from collections.abc import Callable
from enum import IntEnum
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor

from lightning_accum import _compat
from lightning_accum._util.distributed import HasRanks, max_across_ranks
from lightning_accum.core.engine import AccumulationEngine
from lightning_accum.core.step_report import LossSum
from lightning_accum.memory.backends import MemoryBackend
from lightning_accum.memory.oom import OOMInjector, describe_error, is_oom_error, release_memory
from lightning_accum.sequences import PaddedSequences
from lightning_accum.sequences.balancing import StepCost
from lightning_accum.sequences.token_cut import TokenCut, TokenStats, check_items_kept
from lightning_accum.split.planner import MicroBatchPlanner
from lightning_accum.split.step_figures import AgreedFigures
from lightning_accum.split.step_logs import StepLogCombiner
from lightning_accum.split.sync import SyncPolicy


class StepHost(HasRanks, Protocol):
    """What the runner reads of its framework: the `Trainer`, or Fabric's (`lightning_accum._compat.fabric_host`)."""

    @property
    def global_rank(self) -> int: ...

    @property
    def global_step(self) -> int: ...

    @property
    def lightning_module(self) -> Any: ...  # the module whose parameters the step trains


class Fault(IntEnum):
    """What went wrong in an attempt on one rank; the agreement takes the worst over ranks."""

    NONE = 0
    OOM = 1
    OTHER = 2


class Agreement(NamedTuple):
    """What every rank learns from one agreement."""

    fault: Fault  # the worst over all ranks
    micro_batch_size: int  # the largest any rank ran (samples, or a token budget), which every rank's planner is told
    step_batch_size: int  # the largest step over ranks in the planner's unit (samples, or tokens), likewise
    longest: int  # the longest sequence over ranks (by tokens; 0 by samples), likewise
    used: list[bool] | None  # per parameter, whether any rank produced a gradient (`SyncPolicy.carries_used_flags`)
    faults: list[Fault]  # each rank's own fault, by rank: which ranks ran out of memory, or failed otherwise


class _AgreementFailed(RuntimeError):
    """The small all-reduce through which the ranks agree on an attempt failed: a peer is gone."""


class _PeerFault(Exception):
    """This rank finished its forwards, but the agreement before the synced backward reported a fault elsewhere."""

    def __init__(self, agreed: Agreement) -> None:
        super().__init__(agreed.fault)
        self.agreed = agreed


class SplitStepRunner:
    """Runs split mode's steps for one ``fit``: built at the start of training, called by Lightning as the closure.

    Args:
        trainer: the Trainer (or Fabric's stand-in for it, `lightning_accum._compat.fabric_host.FabricHost`).
        engine: the owner's accumulation engine (batch hooks, counting, weights).
        sequences: where the batch's sequences are, to cut by tokens (`lightning_accum.sequences`); ``None`` cuts by
            samples.
        planner: chooses the micro-batch size; told the agreed figures after an OOM.
        policy: how gradients are held back and synced (`lightning_accum.split.sync`).
        logs: combines the ``self.log`` calls of a step's micro-batches.
        backend: the device's memory backend (its peak is reset for a retry).
        on_oom: called on every rank after the planner shrank for an OOM (counts it, reports the planner's events),
            with the agreed size, the OOM's detail (the ranks that ran out of memory, and this rank's own error) and
            whether this rank ran out of memory.
        fault_injector: raises simulated OOMs at chosen points, for tests.
    """

    def __init__(
        self,
        trainer: StepHost,
        engine: AccumulationEngine,
        planner: MicroBatchPlanner,
        policy: SyncPolicy,
        logs: StepLogCombiner,
        backend: MemoryBackend,
        on_oom: Callable[[int, str, bool], None],
        fault_injector: OOMInjector | None = None,
        sequences: PaddedSequences | None = None,
    ) -> None:
        self.trainer, self.engine, self.planner, self.policy = trainer, engine, planner, policy
        self.logs, self.backend, self.on_oom, self.fault_injector = logs, backend, on_oom, fault_injector
        self.sequences = sequences
        self.size = 0  # this rank's micro-batch size in the current attempt, in the planner's unit
        self.step_batch_size = 0  # this rank's step batch, in samples
        self.step_size = 0  # ... in the planner's unit (samples, or the tokens of the step in one piece)
        self.cut: TokenCut | None = None  # the step batch by tokens, read once per step
        self.tokens: TokenStats | None = None  # what the step's micro-batches computed, by tokens
        self.largest_samples = 0  # samples in the attempt's largest micro-batch
        self.window_loss = LossSum()  # this rank's loss over the step's items
        self.gradient_allreduces = 0  # collectives the policy issued after the steps, for tests and benchmarks
        self._agreed: Agreement | None = None  # this attempt's agreement before the synced backward, once made
        self.passes = 0  # micro-batches the current attempt cut
        self.price = StepCost()  # how a step is priced by tokens: the balanced sampler's, where one deals the steps
        self.wait_seconds = 0.0  # this rank's time in the last agreement: waiting for the slowest rank to arrive
        self.compute_seconds = 0.0  # this rank's time from the start of the attempt to that agreement: its compute
        self._attempt_started = time.perf_counter()

    def __call__(self, context: _compat.SplitStepContext) -> Any:
        """The closure of one optimizer step; returns what Lightning's automatic optimization expects."""
        trainer = self.trainer
        self.cut = self.tokens = None
        with self.policy.step():
            while True:
                outcome, agreed, detail = self._agreed_attempt(context)
                if agreed.fault == Fault.NONE:
                    break
                self._recover(context, detail, agreed)
        loss, extra = outcome
        params = [p for p in trainer.lightning_module.parameters() if p.requires_grad]
        self.gradient_allreduces += self.policy.after_step(params, agreed.used)
        with _compat.hook_context(trainer.lightning_module, "training_step"):  # where the user called `self.log`
            self.logs.replay(batch_size=self.step_batch_size)
        return context.make_result(loss, extra)

    def step_cost(self) -> int:
        """What this rank's step cost, the figure the ranks' balance compares (`step_figures.RankBalance`).

        By tokens, the padded tokens its micro-batches computed plus a pass's fixed cost for each, priced as the
        `lightning_accum.sequences.BalancedBatchSampler` that deals the step prices a rank's share (``price``: its
        measured pass cost and quadratic term; else the default `lightning_accum.sequences.StepCost`); by samples,
        its samples (a sample costs the same on every rank when nothing is trimmed).
        """
        if self.tokens is None:
            return self.step_batch_size
        price = self.price
        if price.quadratic is None or self.cut is None:
            return round(self.tokens.padded + price.pass_cost_tokens * self.passes)
        return round(StepCost(self.size, price.pass_cost_tokens, price.quadratic).of(self.cut.lengths))

    def summed_figures(self) -> tuple[int, ...]:
        """This rank's figures to sum over ranks with the window's counts.

        Its step cost, then `token_sums`, then its compute in microseconds (`compute_seconds`).
        """
        return (self.step_cost(), *self.token_sums(), round(self.compute_seconds * 1e6))

    def token_sums(self) -> tuple[int, ...]:
        """The step's padded and real tokens (by tokens) to sum over ranks with the window's counts; else none."""
        return () if self.tokens is None else (self.tokens.padded, self.tokens.real)

    def agreed_figures(self, alloc_retries: int) -> AgreedFigures:
        """After the step, on every rank: its figures, the largest over ranks (one small all-reduce).

        The planner is set to the agreed step batch and longest sequence, so that its next decision is every rank's.
        """
        longest = self.cut.longest if self.cut is not None else 0
        local = [self.backend.peak_bytes(), alloc_retries, self.size, self.step_size, longest, self.largest_samples]
        local += [self.step_cost(), round(self.wait_seconds * 1e6), round(self.compute_seconds * 1e6)]
        # The largest micro-batch any rank ran goes with the largest peak: every planner is told the same.
        try:
            agreed = max_across_ranks(self.trainer, torch.tensor(local, dtype=torch.int64))
        except Exception as err:
            raise _AgreementFailed(
                f"The ranks' agreement on this step's attempt (step {self.trainer.global_step}, its figures after the"
                f" optimizer step) failed: {describe_error(err)}. Another rank most likely stopped (its process"
                " exited or crashed) while this one waited for it; that rank's traceback says why."
            ) from err
        figures = AgreedFigures(*map(int, agreed.tolist()))
        self.planner.unit.set_longest(figures.longest)
        self.planner.set_step_batch_size(figures.step_size)
        return figures

    def agree(self, fault: Fault) -> Agreement:
        """The worst fault, and the largest micro-batch and step batch over all ranks: one small all-reduce.

        Every call at the same point of the protocol sends as many values on every rank, whatever the fault: one per
        rank among them, where only this rank's own slot holds its fault, so that every rank learns whose it was.
        """
        trainer = self.trainer
        params = trainer.lightning_module.parameters() if self.policy.carries_used_flags else ()
        flags = [int(p.grad is not None) for p in params if p.requires_grad]
        longest = self.cut.longest if self.cut is not None else 0
        world, rank = trainer.world_size, trainer.global_rank
        if world <= 1:
            return Agreement(fault, self.size, self.step_size, longest, None, [fault])
        by_rank = [int(fault) if r == rank else 0 for r in range(world)]
        local = [int(fault), self.size, self.step_size, longest, *by_rank, *flags]
        tensor = torch.tensor(local, dtype=torch.int64, device=trainer.strategy.root_device)
        _finish_device_work(tensor)  # so that the wait timed below is for the others, not for this rank's own kernels
        start = time.perf_counter()
        self.compute_seconds = start - self._attempt_started  # what the ranks' wait at the sync comes from
        try:
            values = [int(v) for v in agreement_max(trainer, tensor).tolist()]
            self.wait_seconds = time.perf_counter() - start
        except Exception as err:
            raise _AgreementFailed(
                f"The ranks' agreement on this step's attempt (step {trainer.global_step}, micro-batch size"
                f" {self.size}) failed: {describe_error(err)}. Another rank most likely stopped (its process exited"
                " or crashed) while this one waited for it; that rank's traceback says why."
            ) from err
        faults = [Fault(v) for v in values[4 : 4 + world]]
        used = [bool(v) for v in values[4 + world :]] if self.policy.carries_used_flags else None
        return Agreement(Fault(values[0]), values[1], values[2], values[3], used, faults)

    def _agreed_attempt(self, context: _compat.SplitStepContext) -> tuple[Any, Agreement, str]:
        """One attempt at the step, and what all ranks agreed on: ``(outcome, agreement, OOM detail)``.

        An error that is not an OOM is re-raised on this rank after the agreement, and becomes an error on the others.
        """
        fault, detail, outcome = Fault.NONE, "", None
        agreed: Agreement | None = None
        self._agreed = None
        self._attempt_started = time.perf_counter()
        try:
            # Lightning's hook bookkeeping doesn't unwind on exceptions; this context does.
            with _compat.hook_context(self.trainer.lightning_module):
                # Inside the agreement: an empty step batch (or a left-padded one) on one rank stops every rank, it
                # never hangs one.
                self._read_step(context)
                self.size = self.planner.size_for(self.step_size)
                outcome = self._attempt(context)
        except _PeerFault as peer:
            agreed = peer.agreed  # this rank was fine; the agreement before the synced backward said otherwise
        except _AgreementFailed:
            raise  # the ranks can no longer talk: another collective would fail too, or wait for the timeout
        except Exception as err:  # classified below
            if self._agreed is not None:
                raise  # inside the synced backward: the other ranks are in the collective, not in an agreement
            if not is_oom_error(err):
                self.agree(Fault.OTHER)
                raise
            fault, detail = Fault.OOM, describe_error(err)
        if agreed is None:
            agreed = self._agreed if self._agreed is not None else self.agree(fault)
        if agreed.fault == Fault.OTHER:
            failed = _ranks_text([r for r, f in enumerate(agreed.faults) if f == Fault.OTHER])
            raise RuntimeError(
                "Another rank failed with an error that is not an out-of-memory error; this rank stops too."
                f" See the traceback of {failed}."
            )
        return outcome, agreed, detail

    def _recover(self, context: _compat.SplitStepContext, detail: str, agreed: Agreement) -> None:
        """Shrink (on every rank alike) and make the retry start from a clean slate.

        The planner is told the largest micro-batch and step batch of any rank: ranks whose step batches differ run
        different sizes, and planners told their own would shrink differently (4 -> 2 here, 3 -> 1 there).
        """
        self.planner.set_step_batch_size(agreed.step_batch_size)
        self.planner.unit.set_longest(agreed.longest)
        self.planner.on_oom(agreed.micro_batch_size, self.trainer.global_step)  # raises at the minimum, everywhere
        self.on_oom(agreed.micro_batch_size, *_oom_detail(agreed.faults, self.trainer.global_rank, detail))
        # The failed attempt's graph died with its frame. Every rank starts the retry alike: no gradients, no cached
        # blocks, and a peak that measures the retry alone (the failed attempt's peak, credited to the smaller size,
        # would make the planner shrink a second time).
        self.policy.discard(context.zero_grad)
        release_memory()
        self.backend.reset_peak()

    def _attempt(self, context: _compat.SplitStepContext) -> tuple[Tensor, dict[str, Any]]:
        engine, policy = self.engine, self.policy
        self.logs.clear()
        policy.discard(context.zero_grad)
        if self.cut is not None:
            micro_batches = self.cut.split(context.batch, self.size)
            self.tokens = self.cut.stats(self.size)
        else:
            micro_batches = engine.hooks.split(context.batch, self.size)
        counts = [engine.items(micro.batch, micro.size) for micro in micro_batches]
        self.passes = len(micro_batches)
        if self.cut is not None and engine.count_items is not None:
            # Before any backward: a trim that cut scored positions (labels on padding) stops the step, on every rank
            # through the agreement.
            check_items_kept(engine.items(context.batch, self.step_batch_size), counts, engine.count_items)
        empty = _is_zero(counts)  # one host read per attempt, none when the counts are ints
        self.largest_samples = max((micro.size for micro in micro_batches), default=0)
        # Ranks whose step batches differ run different numbers of micro-batches: no `k` is shared, so the weights
        # come from a divisor every rank knows alike (the previous step's items per rank).
        engine.open_window(None)
        self.window_loss = window_loss = LossSum()
        extra: dict[str, Any] = {}
        last = len(micro_batches) - 1
        for index, (micro_batch, n_samples) in enumerate(micro_batches):
            weight = engine.add(counts[index], n_samples)
            synced = policy.syncs_in_last_backward and index == last
            # Every forward runs with the sync held back, so an attempt abandoned before the synced backward leaves
            # DDP's reducer as it found it; so does every backward but the synced one (FSDP2: none reduce-scatters).
            with policy.hold_back():
                loss, extra = self._forward(context, micro_batch, index, counts[index])
                # An empty micro-batch has weight 0, but its loss may be a mean over no items (NaN), and 0 * NaN is
                # NaN in every gradient: its backward is skipped instead.
                if context.backward is not None and not synced and not empty[index]:
                    context.backward(loss * weight)
            if synced:
                self._synced_backward(context, loss * weight, empty[index])
            if not empty[index]:
                window_loss.add(loss, counts[index], engine.loss_reduction)
            del loss
        mean = torch.as_tensor(window_loss.total) / torch.as_tensor(window_loss.items).clamp(min=1)
        return mean, extra

    def _forward(
        self, context: _compat.SplitStepContext, micro_batch: Any, index: int, n_items: Any
    ) -> tuple[Tensor, dict[str, Any]]:
        injector = self.fault_injector
        if injector is not None:  # tests' faults; the Trainer's counters are read only for them
            rank, step = self.trainer.global_rank, self.trainer.global_step
            injector.check(rank=rank, step=step, micro_batch=index, phase="forward", micro_batch_size=self.size)
        with self.logs.capture(n_items):
            loss, extra = context.training_step(micro_batch)
        if loss is None:
            raise RuntimeError(
                "`training_step` returned None for a micro-batch. Under `AutoMicroBatching` every micro-batch must"
                " return its loss."
            )
        if injector is not None:
            injector.arm_backward(loss, rank=rank, step=step, micro_batch=index, micro_batch_size=self.size)
        return loss, extra

    def _synced_backward(self, context: _compat.SplitStepContext, loss: Tensor, empty: bool) -> None:
        """Agree that every rank finished its forwards, then run the backward that syncs."""
        trainer = self.trainer
        self.policy.check_last_micro_batch(trainer.global_step, trainer.global_rank, loss, context.backward is not None)
        agreed = self.agree(Fault.NONE)
        if agreed.fault != Fault.NONE:
            raise _PeerFault(agreed)
        self._agreed = agreed  # from here on, a fault on one rank cannot be retried: the others are in the sync
        if context.backward is None:
            return  # Lightning skips the backward on every rank alike; DDP's reducer must then stay unprepared
        try:
            self.policy.synced_backward(context.backward, loss, empty, trainer.lightning_module.parameters())
        except Exception as err:
            raise self.policy.synced_backward_error(err, self.size, trainer.global_step) from err

    def _read_step(self, context: _compat.SplitStepContext) -> None:
        """The step batch's size in samples and in the planner's unit; by tokens, its cut (once per step)."""
        if self.sequences is None:
            self.step_batch_size = self.step_size = _step_batch_size(context, self.engine)
            return
        if self.cut is None:
            self.step_batch_size = _step_batch_size(context, self.engine)
            self.cut = self.sequences.cut(context.batch, self.engine.hooks)
        self.step_size = self.cut.tokens
        self.planner.unit.set_longest(self.cut.longest)


def _finish_device_work(tensor: Tensor) -> None:
    """Wait for the device's queued work, once per attempt: the agreement's host read would wait for it anyway."""
    if tensor.device.type != "cpu":
        getattr(torch, tensor.device.type).synchronize()  # torch.cuda, torch.xpu, torch.mps


def agreement_max(trainer: StepHost, tensor: Tensor) -> Tensor:
    """The agreement's one collective: the element-wise maximum over ranks (tests break the agreement here)."""
    return max_across_ranks(trainer, tensor)


def _step_batch_size(context: _compat.SplitStepContext, engine: AccumulationEngine) -> int:
    size = engine.hooks.batch_size(context.batch)
    if size < 1:
        raise ValueError(
            f"`AutoMicroBatching` got a step batch with 0 samples (batch_idx={context.batch_idx}): there is nothing to"
            " split into micro-batches or to step on. Every batch the training dataloader yields must hold at least"
            " one sample. Check the batch sampler (one that yields an empty list of indices) and the collate_fn (one"
            " that filters out every sample of a batch), and skip such batches in the dataloader; if only the short"
            " last batch can end up empty, `DataLoader(drop_last=True)` drops it."
        )
    return size


def _oom_detail(faults: list[Fault], rank: int, error: str) -> tuple[str, bool]:
    """What every rank says of an OOM: which ranks ran out of memory, and this rank's own error; and whether it did.

    Examples:
        >>> _oom_detail([Fault.NONE, Fault.OOM], 0, "")
        ('on rank 1', False)
        >>> _oom_detail([Fault.NONE, Fault.OOM], 1, "CUDA out of memory")
        ('on rank 1: CUDA out of memory', True)
        >>> _oom_detail([Fault.OOM, Fault.OOM, Fault.NONE], 1, "CUDA out of memory")
        ('on ranks 0 and 1; rank 1: CUDA out of memory', True)
        >>> _oom_detail([Fault.OOM], 0, "CUDA out of memory")  # one device: no rank to name
        ('CUDA out of memory', True)
    """
    if len(faults) <= 1:
        return error, True
    ranks = [r for r, fault in enumerate(faults) if fault == Fault.OOM]
    here = rank in ranks
    if not here:
        return f"on {_ranks_text(ranks)}", False
    return (f"on rank {rank}: {error}" if ranks == [rank] else f"on {_ranks_text(ranks)}; rank {rank}: {error}"), True


def _ranks_text(ranks: list[int], shown: int = 8) -> str:
    """``rank 1``, ``ranks 0 and 3``, ``ranks 0, 2 and 5``; past ``shown`` ranks, the first ones and how many.

    Examples:
        >>> _ranks_text(list(range(12)))
        '12 ranks (0, 1, 2, 3, 4, 5, 6, 7, ...)'
    """
    if not ranks:
        return "another rank"
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if len(ranks) > shown:
        return f"{len(ranks)} ranks ({', '.join(map(str, ranks[:shown]))}, ...)"
    return f"ranks {', '.join(map(str, ranks[:-1]))} and {ranks[-1]}"


def _is_zero(counts: list[Any]) -> list[bool]:
    """Which micro-batches hold no items: one host read for the whole attempt, none when the counts are ints."""
    tensors = [c for c in counts if isinstance(c, Tensor)]
    if not tensors:
        return [c == 0 for c in counts]
    device = tensors[0].device
    flags = torch.stack([torch.as_tensor(c, device=device).reshape(()) == 0 for c in counts])
    return [bool(flag) for flag in flags.tolist()]
