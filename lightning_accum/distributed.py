"""Small collectives over Lightning's strategy. Each is a no-op at world size 1, and every rank must call them in
the same order."""

from __future__ import annotations

from collections.abc import Callable

import lightning.pytorch as pl
from torch import Tensor


def sum_across_ranks_fn(trainer: pl.Trainer) -> Callable[[Tensor], Tensor] | None:
    """A function that sums a small tensor over all ranks, or ``None`` on a single process."""
    if trainer.world_size <= 1:
        return None
    strategy = trainer.strategy

    def _sum(tensor: Tensor) -> Tensor:
        # NCCL needs the tensor on the rank's device; gloo is happy either way.
        return strategy.reduce(tensor.to(strategy.root_device), reduce_op="sum").to(tensor.device)

    return _sum


def max_across_ranks(trainer: pl.Trainer, tensor: Tensor) -> Tensor:
    """Element-wise maximum over all ranks (the tensor itself on a single process)."""
    if trainer.world_size <= 1:
        return tensor
    strategy = trainer.strategy
    return strategy.reduce(tensor.to(strategy.root_device), reduce_op="max").to(tensor.device)
