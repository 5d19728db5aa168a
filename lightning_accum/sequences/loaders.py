"""The balanced samplers inside a user's DataLoaders: found, checked against their datasets, told who weighs them.

``loaders`` is a DataLoader (Fabric's too), or a list or dict of them, as Lightning and Fabric hand them over. Pure.
"""

from __future__ import annotations

from typing import Any

from lightning_accum.sequences.balanced_sampler import BalancedBatchSampler, check_lengths_match


def balanced_samplers(loaders: Any) -> list[BalancedBatchSampler]:
    """The `BalancedBatchSampler` of every DataLoader in ``loaders`` (one, or a list or dict of them)."""
    return [sampler for _, sampler in _loaders_with_samplers(loaders)]


def check_loader_lengths(loaders: Any) -> None:
    """Raise where a DataLoader's `BalancedBatchSampler` holds other than one length for each sample of its dataset.

    ``loaders``: a DataLoader (Fabric's too), or a list or dict of them. Where a loader knows its dataset, the front
    ends call it before training; the message names both counts (`lightning_accum.sequences.balanced_sampler
    .check_lengths_match`). Pure: every rank holds the same lengths (or is refused), so every rank raises alike.
    """
    for loader, sampler in _loaders_with_samplers(loaders):
        dataset = getattr(loader, "dataset", None)
        if dataset is not None:
            check_lengths_match(sampler, dataset)


def weigh_shares(loaders: Any, front_end: str) -> None:
    """Tell each `BalancedBatchSampler` in ``loaders`` that ``front_end`` weighs every rank's loss by its count.

    A sampler on several ranks that no front end weighs warns that the update is the ranks' mean of means (plain
    DDP). Call it at the start of training, before the loader's second batch is drawn.
    """
    for sampler in balanced_samplers(loaders):
        sampler.weighed_by = front_end


def _loaders_with_samplers(loaders: Any) -> list[tuple[Any, BalancedBatchSampler]]:
    if isinstance(loaders, dict):
        return [pair for loader in loaders.values() for pair in _loaders_with_samplers(loader)]
    if isinstance(loaders, (list, tuple)):
        return [pair for loader in loaders for pair in _loaders_with_samplers(loader)]
    sampler = getattr(loaders, "batch_sampler", None)
    return [(loaders, sampler)] if isinstance(sampler, BalancedBatchSampler) else []
