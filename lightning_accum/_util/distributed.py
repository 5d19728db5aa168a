"""Small collectives over Lightning's strategy.

Each is a no-op at world size 1, and every rank must call them in the same order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from torch import Tensor


class HasRanks(Protocol):
    """What the collectives read: Lightning's ``Trainer``, or Fabric's (`lightning_accum._compat.fabric_host`)."""

    @property
    def world_size(self) -> int: ...

    @property
    def strategy(self) -> Any: ...  # has ``root_device`` and ``reduce(tensor, reduce_op=...)``


def sum_across_ranks_fn(trainer: HasRanks) -> Callable[[Tensor], Tensor] | None:
    """A function that sums a small tensor over all ranks, or ``None`` on a single process."""
    if trainer.world_size <= 1:
        return None
    strategy = trainer.strategy

    def _sum(tensor: Tensor) -> Tensor:
        # NCCL needs the tensor on the rank's device; gloo is happy either way.
        summed: Tensor = strategy.reduce(tensor.to(strategy.root_device), reduce_op="sum").to(tensor.device)
        return summed

    return _sum


def max_across_ranks(trainer: HasRanks, tensor: Tensor) -> Tensor:
    """Element-wise maximum over all ranks (the tensor itself on a single process)."""
    if trainer.world_size <= 1:
        return tensor
    strategy = trainer.strategy
    maximum: Tensor = strategy.reduce(tensor.to(strategy.root_device), reduce_op="max").to(tensor.device)
    return maximum


def all_reduce_gradients(
    parameters: Sequence[Tensor],
    process_group: Any = None,
    used: list[bool] | None = None,
    bucket_bytes: int = 25 * 1024 * 1024,
) -> int:
    """Sum the ``.grad`` of ``parameters`` over all ranks in flattened buckets; returns the number of collectives.

    Every rank must pass the same parameters in the same order, and the same ``used``: for each parameter, whether
    any rank produced a gradient for it (agreed beforehand). As in DDP, a parameter that no rank used keeps
    ``grad=None``, so that the optimizer leaves it alone (weight decay included), and one that only other ranks used
    gets a zero gradient from this one. ``None`` means every parameter was used somewhere.

    Raises:
        ValueError: ``used`` does not hold one flag per parameter.
    """
    import torch
    import torch.distributed as dist

    if used is None:
        used = [True] * len(parameters)
    if len(used) != len(parameters):
        raise ValueError(f"`used` holds {len(used)} flags for {len(parameters)} parameters; pass one per parameter.")
    grads: list[Tensor] = []
    for p, anywhere in zip(parameters, used, strict=True):
        if anywhere:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
    calls = 0
    bucket: list[Tensor] = []
    size = 0

    def flush() -> None:
        nonlocal bucket, size, calls
        if not bucket:
            return
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=process_group)
        calls += 1
        offset = 0
        for g in bucket:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        bucket, size = [], 0

    for grad in sorted(grads, key=lambda g: (str(g.device), str(g.dtype))):
        if bucket and (grad.dtype != bucket[0].dtype or grad.device != bucket[0].device):
            flush()
        bucket.append(grad)
        size += grad.numel() * grad.element_size()
        if size >= bucket_bytes:
            flush()
    flush()
    return calls
