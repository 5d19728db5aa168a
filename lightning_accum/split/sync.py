"""How split mode holds back and syncs the gradients of one step: one policy per strategy and ``gradient_sync``.

A split-mode step runs every micro-batch's forward and backward on each rank, and the gradients must cross ranks
once. Each policy says how to hold the sync back, where it happens, and how to discard a failed attempt:

=====================  ===========================================  ==============================================
policy                 the sync                                     an attempt abandoned after an OOM
=====================  ===========================================  ==============================================
`SingleDevice`         none                                         zero the gradients
`DDPDeferred`          one bucketed all-reduce after the ranks      zero the gradients (DDP never armed)
                       agreed that every backward succeeded
`DDPOverlap`           DDP's own, in the last backward, armed only  zero the gradients (DDP not yet armed)
                       after the ranks agreed on every forward
`FSDP2`                FSDP2's reduce-scatter, in the last          zero the gradients and FSDP2's unsharded ones
                       backward, after the same agreement
=====================  ===========================================  ==============================================

`trainer_sync_kind` (or Fabric's `lightning_accum._compat.fabric_host.sync_kind`) refuses what split mode cannot
run, `resolve_gradient_sync` checks ``gradient_sync`` against it, and `sync_policy` picks the policy. No policy issues a
collective that another rank could be left waiting in: the only ones are the agreement, the buffer broadcast or
FSDP2's all-gather at the start of the step (before anything can fail), and the sync.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.pytorch.strategies import (
    DDPStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
    ParallelStrategy,
    SingleDeviceStrategy,
)
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

from lightning_accum import _compat
from lightning_accum._compat.fsdp2 import fsdp2_unsharded_params
from lightning_accum._util.distributed import all_reduce_gradients
from lightning_accum.memory.oom import describe_error, is_oom_error

GradientSync = Literal["deferred", "overlap"]
GRADIENT_SYNCS = {
    "deferred": "one all-reduce after every rank's last backward",
    "overlap": "DDP's, in the last backward",
}


class SyncPolicy:
    """Single device, the base of every policy: nothing to hold back, nothing to sync.

    Attributes:
        syncs_in_last_backward: the last micro-batch's backward syncs, so the ranks agree on the attempt after the
            last forward, before it; otherwise they agree at the end of the attempt.
        carries_used_flags: the agreement at the end of an attempt carries, per parameter, whether the rank produced
            a gradient (the deferred sync then leaves a parameter that no rank used without one).
        sums_gradients: `after_step` summed the gradients over ranks, where DDP would have averaged them.
    """

    name = "single device"
    syncs_in_last_backward = False
    carries_used_flags = False
    sums_gradients = False

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy

    def step(self) -> contextlib.AbstractContextManager[None]:
        """Around the whole step, every attempt included: what must happen before anything can fail."""
        return contextlib.nullcontext()

    def hold_back(self) -> contextlib.AbstractContextManager[None]:
        """Around every forward, and every backward that must not sync."""
        return contextlib.nullcontext()

    def check_last_micro_batch(self, step: int, rank: int, loss: Tensor, backward: bool) -> None:
        """Before the agreement that precedes the synced backward: refuse what would leave a rank out of the sync."""

    def synced_backward(self, backward: Callable[[Tensor], None], loss: Tensor, empty: bool, params: Any) -> None:
        """The last micro-batch's backward, which syncs (only where `syncs_in_last_backward`)."""
        backward(loss)

    def after_step(self, params: Sequence[Tensor], used: list[bool] | None) -> int:
        """After every rank's last backward succeeded: sync what is left; returns the collectives issued."""
        return 0

    def discard(self, zero_grad: Callable[[], None]) -> None:
        """Drop a failed attempt's gradients, wherever this strategy keeps them."""
        zero_grad()

    def synced_backward_error(self, err: BaseException, size: int, step: int) -> RuntimeError:
        """The error for a fault inside the synced backward, which no rank can retry."""
        raise NotImplementedError


class DDPDeferred(SyncPolicy):
    """DDP with the sync held back on every micro-batch and done here, once, after every rank's last backward."""

    strategy: DDPStrategy
    name = "`gradient_sync='deferred'`"
    carries_used_flags = True
    sums_gradients = True

    def step(self) -> contextlib.AbstractContextManager[None]:
        _compat.broadcast_ddp_buffers(self.strategy)
        return contextlib.nullcontext()

    def hold_back(self) -> contextlib.AbstractContextManager[None]:
        return self.strategy.block_backward_sync()

    def after_step(self, params: Sequence[Tensor], used: list[bool] | None) -> int:
        allreduces = all_reduce_gradients(params, _compat.ddp_process_group(self.strategy), used)
        _compat.mark_ddp_synced(self.strategy)
        return allreduces


class DDPOverlap(SyncPolicy):
    """DDP's own sync in the last micro-batch's backward, overlapping communication with computation."""

    strategy: ParallelStrategy  # DDP, or ModelParallelStrategy (FSDP2)
    name = "`gradient_sync='overlap'`"
    syncs_in_last_backward = True
    collective = "DDP's all-reduce"
    remedy = (
        "Use `gradient_sync='deferred'` (the default), which recovers from an OOM in any forward or backward, or"
        " leave more memory headroom (a lower `max_memory` or `micro_batch_size`)."
    )

    def step(self) -> contextlib.AbstractContextManager[None]:
        # DDP's two collectives that a forward may issue (the buffer broadcast, the one-time rebuild of its gradient
        # buckets after the first synced step), on every rank here, before anything can fail.
        _compat.broadcast_ddp_buffers(self.strategy)
        _compat.rebuild_ddp_buckets(self.strategy)
        return contextlib.nullcontext()

    def hold_back(self) -> contextlib.AbstractContextManager[None]:
        return self.strategy.block_backward_sync()

    def synced_backward(self, backward: Callable[[Tensor], None], loss: Tensor, empty: bool, params: Any) -> None:
        if empty:
            # DDP's all-reduce needs this rank's gradients; zero, not NaN, and reaching every parameter.
            loss = torch.stack([(p * 0).sum() for p in params if p.requires_grad]).sum()
        model = self.strategy.model
        if isinstance(model, DistributedDataParallel):
            _compat.prepare_ddp_backward(model, loss)
        backward(loss)

    def synced_backward_error(self, err: BaseException, size: int, step: int) -> RuntimeError:
        if is_oom_error(err):
            return RuntimeError(
                f"Out of memory inside the synced backward of the last micro-batch ({self.name}, micro-batch size"
                f" {size}, step {step}: {describe_error(err)}). The other ranks are already exchanging gradients in"
                f" {self.collective}, so this step cannot be retried; they stop when this process exits, or at the"
                f" process group's timeout. {self.remedy}"
            )
        return RuntimeError(
            f"{type(err).__name__} inside the synced backward of the last micro-batch ({self.name}):"
            f" {describe_error(err)}. If another rank failed inside its synced backward (an out-of-memory error),"
            " this is how the failure reaches this rank: see that rank's traceback."
        )


class FSDP2(DDPOverlap):
    """FSDP2: parameters gathered once per step, gradients unsharded until the last backward reduce-scatters them.

    On one rank nothing is held back, and every backward reduce-scatters (with itself) as FSDP2 does.
    """

    name = "FSDP2"
    collective = "FSDP2's reduce-scatter"
    remedy = (
        "Leave more memory headroom (a lower `max_memory` or `micro_batch_size`): under FSDP2 the last backward"
        " always syncs."
    )

    def __init__(self, strategy: Any, world_size: int) -> None:
        super().__init__(strategy)
        self.syncs_in_last_backward = world_size > 1
        self._modules: list[Any] | None = None  # the FSDP2 modules, found at the first micro-batch (sharded by then)

    def step(self) -> contextlib.AbstractContextManager[None]:
        # FSDP2 all-gathers in every forward and backward: a rank that failed in one would leave the others waiting
        # there. Gathered once, before anything can fail, the only collectives left are the agreement and the last
        # backward's reduce-scatter.
        return _compat.fsdp2_unsharded_for_step(self.strategy.model)

    @contextlib.contextmanager
    def hold_back(self) -> Iterator[None]:
        if not self.syncs_in_last_backward:
            yield
            return
        # Lightning's `block_backward_sync` only blocks models with a `no_sync`, which FSDP2 modules lack.
        model = self.strategy.model
        if self._modules is None:
            self._modules = _compat.fsdp2_modules(model)
        with self.strategy.block_backward_sync(), _compat.no_fsdp2_gradient_sync(model, self._modules):
            yield

    def check_last_micro_batch(self, step: int, rank: int, loss: Tensor, backward: bool) -> None:
        if backward and not loss.requires_grad:
            # Its backward would raise on this rank alone, and the others would wait in the reduce-scatter; raised
            # before the agreement, which then stops every rank.
            raise RuntimeError(
                f"The loss of the last micro-batch of step {step} on rank {rank} does not require grad, so its"
                " backward cannot join FSDP2's reduce-scatter. Return a loss computed by the model in"
                " `training_step` (also for a micro-batch without items: `AutoMicroBatching` weights it by 0)."
            )

    def synced_backward(self, backward: Callable[[Tensor], None], loss: Tensor, empty: bool, params: Any) -> None:
        if not empty:
            backward(loss)
            return
        # A micro-batch without items contributes nothing, but its loss is a mean over nothing (NaN), NaN * 0 is NaN,
        # and even a zero upstream gradient through a mean's backward is 0 / 0. Its backward still runs through the
        # forward's graph, so that FSDP2's hooks fire and this rank joins the reduce-scatter the others wait in, and
        # every parameter's gradient from it is replaced by zeros before autograd adds it to the gradient held back.
        with _zero_gradients([*params, *fsdp2_unsharded_params(self.strategy.model)]):
            backward(loss)

    def discard(self, zero_grad: Callable[[], None]) -> None:
        zero_grad()
        # FSDP2 keeps the unsynced micro-batches' gradients unsharded, where `zero_grad` doesn't reach.
        _compat.discard_fsdp2_unsharded_grads(self.strategy.model)


@contextlib.contextmanager
def _zero_gradients(params: Sequence[Tensor]) -> Iterator[None]:
    """Inside the block, a backward adds zeros to each of ``params``' gradients, whatever autograd computed for it."""
    handles, seen = [], set()
    for p in params:
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            handles.append(p.register_hook(torch.zeros_like))  # a leaf's hook runs before the gradient is accumulated
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


SyncKind = Literal["single", "ddp", "fsdp2"]
"""How split mode syncs under a strategy: not at all (one rank), DDP's all-reduce, or FSDP2's reduce-scatter."""


def trainer_sync_kind(strategy: Any, world_size: int) -> SyncKind:
    """How split mode syncs under a ``Trainer``'s ``strategy`` (Fabric's: `lightning_accum._compat.fabric_host`).

    Raises:
        RuntimeError: a strategy split mode does not support (FSDP1, DeepSpeed).
    """
    if isinstance(strategy, FSDPStrategy):
        raise RuntimeError(
            "`AutoMicroBatching` does not support `FSDPStrategy` (FSDP1, CUDA-only in Lightning). Use"
            " `ModelParallelStrategy` and call `torch.distributed.fsdp.fully_shard` in `configure_model` (FSDP2),"
            " which split mode supports, or keep `FSDPStrategy` with `AccumulationScheduler` (window mode)."
        )
    if isinstance(strategy, ModelParallelStrategy):
        return "fsdp2"  # data parallelism only: `sync_policy` checks the mesh once the processes are up
    if not isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)) or strategy.handles_gradient_accumulation:
        raise RuntimeError(
            f"`AutoMicroBatching` supports single-device, DDP and `ModelParallelStrategy` (FSDP2) strategies, got"
            f" {type(strategy).__name__}. Use the strategy's own accumulation with DeepSpeed."
        )
    return "ddp" if world_size > 1 else "single"


def resolve_gradient_sync(kind: SyncKind, given: GradientSync | None) -> GradientSync:
    """The ``gradient_sync`` split mode runs under a strategy of ``kind`` (``given``, or the kind's default).

    Raises:
        ValueError: ``gradient_sync="deferred"`` under FSDP2.
    """
    if kind != "fsdp2":
        return given or "deferred"
    if given == "deferred":
        raise ValueError(
            "`gradient_sync='deferred'` is not available under `ModelParallelStrategy` (FSDP2): FSDP2"
            " reduce-scatters inside the last micro-batch's backward, which runs only after every rank agreed that"
            " all its forwards succeeded (an OOM before it is retried on every rank). Leave `gradient_sync` unset"
            " (or pass 'overlap'); see docs/scaling-out.md, split mode."
        )
    return "overlap"


def sync_policy(kind: SyncKind, strategy: Any, world_size: int, gradient_sync: GradientSync) -> SyncPolicy:
    """The policy for a split-mode run of ``kind`` on ``strategy`` (a Trainer's, or Fabric's view of its own).

    Raises:
        RuntimeError: ``ModelParallelStrategy`` with tensor parallelism, or on several ranks without any
            ``fully_shard``-ed module.
    """
    if kind == "fsdp2":
        mesh = getattr(strategy, "device_mesh", None)  # a Trainer's; Fabric's `sync_kind` checked its own
        tensor_parallel = mesh["tensor_parallel"].size() if mesh is not None else 1
        if tensor_parallel > 1:
            raise RuntimeError(
                f"Split mode supports `ModelParallelStrategy` for data parallelism only (FSDP2), got"
                f" `tensor_parallel_size={tensor_parallel}`. Set `tensor_parallel_size=1`, or use"
                " `AccumulationScheduler` (window mode)."
            )
        if world_size > 1 and not _compat.fsdp2_modules(strategy.model):
            raise RuntimeError(
                "Split mode under `ModelParallelStrategy` needs FSDP2: call `torch.distributed.fsdp.fully_shard` on"
                " the model (or its layers), in `configure_model` under a Trainer (with the"
                ' `self.device_mesh["data_parallel"]` mesh) or in the `parallelize_fn` under Fabric. Without it'
                " nothing synchronizes the gradients across ranks."
            )
        return FSDP2(strategy, world_size)
    if kind == "single" or world_size <= 1:
        return SyncPolicy(strategy)
    return DDPDeferred(strategy) if gradient_sync == "deferred" else DDPOverlap(strategy)


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
        f" `gradient_sync='deferred'` under DDP, which retries an OOM in any forward or backward of the step."
    )
