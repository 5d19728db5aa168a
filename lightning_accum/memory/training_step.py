"""One optimizer step of a LightningModule, driven by hand with its phases labelled for a `MemoryTracker`.

The memory probe (`lightning_accum.probe`) and split mode's cold start (`lightning_accum.split.preflight`) both run a
module's ``training_step`` and its optimizers outside a Trainer; this is the one loop they share.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from lightning_accum.memory.tracker import MemoryTracker


def configured_optimizers(model: nn.Module) -> list[torch.optim.Optimizer]:
    """The optimizers ``model.configure_optimizers()`` returns (`optimizers_of`); `_check_module` saw the hook."""
    return optimizers_of(model.configure_optimizers())  # type: ignore[operator]  # a hook; torch types Module attributes as Tensor | Module


def optimizers_of(config: Any) -> list[torch.optim.Optimizer]:
    """The optimizers in what ``configure_optimizers`` returned, in any of the forms Lightning accepts.

    Raises:
        TypeError: the value is none of those forms.
    """
    if config is None:
        return []
    if isinstance(config, torch.optim.Optimizer):
        return [config]
    if isinstance(config, Mapping):
        return optimizers_of(config.get("optimizer"))
    if isinstance(config, (list, tuple)):
        if len(config) == 2 and isinstance(config[0], (list, tuple)):  # ([optimizers], [schedulers])
            return optimizers_of(list(config[0]))
        return [opt for item in config for opt in optimizers_of(item)]
    raise TypeError(f"`configure_optimizers` returned {type(config).__name__}, which the probe cannot read.")


def loss_of(output: Any) -> torch.Tensor | None:
    if isinstance(output, Mapping):
        output = output.get("loss")
    return output if isinstance(output, torch.Tensor) else None


def train_step(
    model: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    batches: list[Any],
    tracker: MemoryTracker,
    prepare: Callable[[Any], Any] = lambda batch: batch,
    forward_context: Callable[[], AbstractContextManager[None]] = contextlib.nullcontext,
    batch_idx: int = 0,
) -> None:
    """One optimizer step over ``batches`` (its micro-batches, numbered from ``batch_idx``), phases labelled.

    Each micro-batch goes through ``prepare`` (to the device) just before its forward pass, and is counted from then
    until it is done; ``training_step`` runs inside ``forward_context()`` (autocast), as Lightning's precision
    plugin runs it. The loss is divided by ``k``, and gradients are set to ``None`` after the step.

    Raises:
        ValueError: ``training_step`` returned no loss.
    """
    k = len(batches)
    for i in range(k):
        batch = prepare(batches[i])
        batches[i] = None
        tracker.track(batch, "activations")
        with tracker.phase(f"forward {i + 1}/{k}"), forward_context():
            loss = loss_of(model.training_step(batch, batch_idx + i))  # type: ignore[operator]  # a hook; torch types Module attributes as Tensor | Module
        if loss is None:
            raise ValueError(
                f"`module` {type(model).__name__}.training_step returned no loss; the probe needs a Tensor or "
                "a dict with a 'loss' Tensor."
            )
        with tracker.phase(f"backward {i + 1}/{k}"):
            (loss / k).backward()
        del loss, batch  # free the micro-batch's activations before the next one, as Lightning does
    with tracker.phase("optimizer"):
        for opt in optimizers:
            opt.step()
    for opt in optimizers:
        opt.zero_grad(set_to_none=True)
