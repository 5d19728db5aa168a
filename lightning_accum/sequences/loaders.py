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


def unpinned_budget(samplers: list[BalancedBatchSampler], micro_batch_tokens: Any, pinned: bool) -> str | None:
    """The warning where a sampler prices each rank's step at a token budget the run may not cut at; else ``None``.

    A `BalancedBatchSampler` given ``micro_batch_tokens`` prices each rank's share by the cut at that budget. Split
    mode by tokens cuts at its planner's budget: ``"auto"``, or an int not pinned (``pin_micro_batch_size=True``),
    grows past it when memory allows, and the ranks are then balanced for a cut they do not make (on 2 Fabric ranks,
    1.07-1.10 of the mean at some steps against 1.00-1.01 pinned). ``micro_batch_tokens`` and ``pinned`` are the split
    front end's settings.

    Example:
        >>> sampler = BalancedBatchSampler([3, 1], 2, num_replicas=1, micro_batch_tokens=4096)
        >>> unpinned_budget([sampler], 4096, pinned=True) is None, unpinned_budget([sampler], "auto", pinned=False)[:40]
        (True, '`BalancedBatchSampler(micro_batch_tokens')
    """
    budgets = sorted({s.step_cost.micro_batch_tokens for s in samplers if s.step_cost.micro_batch_tokens is not None})
    if not budgets or (pinned and budgets == [micro_batch_tokens]):
        return None
    sampler_budget = budgets[0]
    how = "grows past it when memory allows" if micro_batch_tokens == "auto" or not pinned else "cuts at another"
    return (
        f"`BalancedBatchSampler(micro_batch_tokens={sampler_budget})` prices each rank's step by the cut at"
        f" {sampler_budget} tokens, but split mode runs at `micro_batch_tokens={micro_batch_tokens!r}`"
        f"{'' if pinned else ' not pinned'}, and {how}: the ranks are then balanced for a cut they do not make. Pin"
        f" the budget the sampler prices with: `micro_batch_tokens={sampler_budget}, pin_micro_batch_size=True`"
        " (an out-of-memory error still shrinks it for a step)."
    )


def _loaders_with_samplers(loaders: Any) -> list[tuple[Any, BalancedBatchSampler]]:
    if isinstance(loaders, dict):
        return [pair for loader in loaders.values() for pair in _loaders_with_samplers(loader)]
    if isinstance(loaders, (list, tuple)):
        return [pair for loader in loaders for pair in _loaders_with_samplers(loader)]
    sampler = getattr(loaders, "batch_sampler", None)
    return [(loaders, sampler)] if isinstance(sampler, BalancedBatchSampler) else []
