"""Split mode under DDP: torch's reducer driven by hand, its buffer broadcast, and the process group it reduces over.

Upstream:

- ``torch/nn/parallel/distributed.py`` (torch 2.1 to 2.13, read on 2.13): ``DistributedDataParallel.reducer``
  (``prepare_for_forward``, ``_rebuild_buckets``, ``prepare_for_backward``), ``require_forward_param_sync``,
  ``find_unused_parameters``, ``static_graph``, ``will_sync_module_buffers``, ``_sync_buffers`` and
  ``process_group``; what ``_pre_forward`` and ``_post_forward`` do with them is what this module does by hand;
- ``lightning/pytorch/strategies/ddp.py`` and ``strategies/model_parallel.py`` (lightning 2.2 to 2.6):
  ``DDPStrategy._timeout`` and ``ModelParallelStrategy._timeout``, passed to ``init_process_group`` in
  ``setup_distributed``.

``tests/compat/test_ddp.py`` fails if torch or Lightning renames or changes any of these.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from torch import Tensor
from torch.nn.parallel import DistributedDataParallel


def prepare_ddp_backward(model: DistributedDataParallel, loss: Tensor) -> None:
    """Arm DDP's reducer for a backward whose forward ran under ``no_sync``, as DDP's own forward would have.

    The end of ``DistributedDataParallel.forward`` (``_post_forward`` in ``torch/nn/parallel/distributed.py``) does
    this when gradients are to be synced; Lightning does the same for manual optimization
    (``lightning.pytorch.overrides.distributed.prepare_for_backward``). Arming it only after every rank agreed that
    its forwards succeeded means that an attempt abandoned because of another rank's fault never leaves the reducer
    expecting a backward: the retry's first micro-batch would otherwise start an all-reduce on this rank alone.
    """
    model.require_forward_param_sync = True
    reducer = model.reducer
    reducer.prepare_for_forward()  # counts the iteration, as the synced forward would have
    reducer._rebuild_buckets()  # Lightning: avoids "INTERNAL ASSERT FAILED" with `find_unused_parameters=False`
    reducer.prepare_for_backward([loss] if model.find_unused_parameters and not model.static_graph else [])


def broadcast_ddp_buffers(strategy: Any) -> None:
    """Do DDP's buffer broadcast (batch-norm statistics, from rank 0) at the start of the step, not in a forward.

    DDP broadcasts buffers at the start of a forward when ``require_forward_param_sync`` is set (after a synced
    backward), and clears the flag at the end of a forward under ``no_sync``. Inside an attempt that collective is a
    trap: a rank that fails before its first forward leaves the others alone in the broadcast, and a rank whose
    forward raised keeps the flag and alone broadcasts again at the retry. Here, before anything can fail, every rank
    is at the same point; with the flag cleared, no forward of the step broadcasts.
    """
    model = getattr(strategy, "model", None)
    if not isinstance(model, DistributedDataParallel) or getattr(strategy, "world_size", 1) <= 1:
        return
    if model.will_sync_module_buffers():
        model._sync_buffers()
    model.require_forward_param_sync = False


def mark_ddp_synced(strategy: Any) -> None:
    """Leave DDP as its own synced backward would: due to broadcast its buffers at the next step's start.

    A forward with gradients to sync sets ``require_forward_param_sync`` (``_post_forward``), and the next forward
    broadcasts the buffers when it finds it set. Split mode's deferred sync all-reduces the gradients itself after
    forwards that all ran under ``no_sync``, so nothing sets it: without this, `broadcast_ddp_buffers` broadcast at
    step 0 only, and the ranks' batch-norm statistics went their own ways from step 1 on.
    """
    model = getattr(strategy, "model", None)
    if isinstance(model, DistributedDataParallel):
        model.require_forward_param_sync = True


def rebuild_ddp_buckets(strategy: Any) -> None:
    """Let DDP rebuild its gradient buckets now, at the start of a step, if it is due to: never inside an attempt.

    DDP rebuilds its buckets once, in the first forward after the first iteration that synced
    (``DistributedDataParallel._pre_forward`` calls ``reducer._rebuild_buckets()``), and the rebuild broadcasts the
    bucket order from rank 0. In split mode a rank that fails before that forward (an OOM before its first
    micro-batch) would leave the others alone in the broadcast. Called here on every rank at the same point, before
    anything can fail, it returns ``False`` in every later forward. Every rank recorded the same synced backward, so
    every rank rebuilds (and broadcasts) alike, or none does.
    """
    model = getattr(strategy, "model", None)
    if not isinstance(model, DistributedDataParallel) or getattr(strategy, "world_size", 1) <= 1:
        return
    model.reducer._rebuild_buckets()


def ddp_process_group(strategy: Any) -> Any:
    """The process group DDP reduces gradients over (the default group when the strategy doesn't say)."""
    return getattr(getattr(strategy, "model", None), "process_group", None)


def process_group_timeout(strategy: Any) -> timedelta | None:
    """The timeout the strategy gives its process group (``DDPStrategy(timeout=)``, ``ModelParallelStrategy``'s)."""
    timeout = getattr(strategy, "_timeout", None)
    return timeout if isinstance(timeout, timedelta) else None
