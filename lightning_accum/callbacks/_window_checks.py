"""What `lightning_accum.AccumulationScheduler` warns about in the batches it sees, with the messages."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

IGNORE_INDEX = -100
"""The label that carries no loss: PyTorch's ``cross_entropy`` default, and Hugging Face's padding label."""

SAMPLE_COUNT_WITH_IGNORED_LABELS = (
    "`AccumulationScheduler(count_items=None)` (the default: each micro-batch counts its samples) sees batches whose"
    " `labels` hold -100. A loss that averages over the tokens that carry one (`cross_entropy(ignore_index=-100)`,"
    " Hugging Face models) then weighs each micro-batch by its samples where its tokens count, and the update is not"
    " the full batch's: micro-batches hold different numbers of loss-bearing tokens. Count them:"
    ' `count_items=CountTokens("labels", shift=1)` (`from lightning_accum.items import CountTokens`; `shift=1` for a'
    " model that shifts its labels inside, as Hugging Face causal LMs do, `shift=0` for labels already shifted), in"
    " a LightningCLI config `count_items: {class_path: lightning_accum.items.CountTokens, init_args: {key: labels,"
    " shift: 1}}`. If the loss is a mean over samples, pass `count_items=CountSamples()` to say so."
)


def holds_ignored_labels(batch: Any) -> bool:
    """Whether ``batch`` is a mapping whose ``"labels"`` tensor holds `IGNORE_INDEX` (one host read: call it once).

    Example:
        >>> holds_ignored_labels({"labels": torch.tensor([[5, -100]])}), holds_ignored_labels({"x": torch.ones(2)})
        (True, False)
    """
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    if not isinstance(labels, torch.Tensor) or labels.is_floating_point() or labels.is_complex():
        return False
    return bool((labels == IGNORE_INDEX).any())
