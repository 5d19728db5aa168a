"""Combine what ``self.log`` records in each micro-batch of a split step into one value per optimizer step.

In split mode the user's ``training_step`` runs once per micro-batch. Left alone, Lightning would keep the *last*
micro-batch's value for ``on_step`` logging and weight epoch aggregates by the whole step batch each time. Instead,
every ``self.log`` call made during a split step is captured, and when the step succeeds each name is logged once:

* ``reduce_fx="mean"`` (the default): the item-weighted mean over the micro-batches, which is the value the unsplit
  batch would have logged for a mean over items;
* ``"sum"``, ``"max"``, ``"min"``: the sum, maximum or minimum over the micro-batches;
* a micro-batch without items (its weight is 0) contributes nothing to a mean, and its value is left out of a sum,
  maximum or minimum when it is NaN (the 0/0 of a mean over no items);
* anything else (a torchmetrics ``Metric`` object, a custom reduction): the last micro-batch's value.

The combined value is logged with ``batch_size`` = samples in the step, so epoch aggregates weight steps by samples.
Calls made during an attempt that ran out of memory are dropped with the attempt: nothing is counted twice.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

_LOG_SIGNATURE = inspect.signature(pl.LightningModule.log)
_REDUCTIONS = {"mean": "mean", "avg": "mean", "sum": "sum", "max": "max", "min": "min"}


class StepLogCombiner:
    """Captures ``module.log`` calls per micro-batch and replays one combined call per name.

    Examples:
        >>> module = pl.LightningModule()
        >>> logged = {}
        >>> module.log = lambda name, value, **kw: logged.update({name: (float(value), kw["batch_size"])})
        >>> combiner = StepLogCombiner(module)
        >>> for loss, items in ((1.0, 3), (3.0, 1)):
        ...     with combiner.capture(weight=items):
        ...         module.log("loss", torch.tensor(loss))
        >>> combiner.replay(batch_size=4)
        >>> logged
        {'loss': (1.5, 4)}
    """

    def __init__(self, module: pl.LightningModule) -> None:
        self.module = module
        self._records: dict[str, list[tuple[Any, Any, dict[str, Any]]]] = {}

    def clear(self) -> None:
        """Forget everything captured (an attempt that failed)."""
        self._records = {}

    @contextlib.contextmanager
    def capture(self, weight: float | Tensor) -> Iterator[None]:
        """Within this block, ``module.log`` records instead of logging; ``weight`` is the micro-batch's item count."""
        module = self.module
        had_own = "log" in vars(module)
        previous = vars(module).get("log")

        def record(*args: Any, **kwargs: Any) -> None:
            bound = _LOG_SIGNATURE.bind(module, *args, **kwargs)
            arguments = dict(bound.arguments)
            arguments.pop("self")
            name, value = arguments.pop("name"), arguments.pop("value")
            self._records.setdefault(name, []).append((value, weight, arguments))

        module.log = record  # type: ignore[method-assign]
        try:
            yield
        finally:
            if had_own:
                module.log = previous  # type: ignore[method-assign]
            else:
                del module.log

    def replay(self, batch_size: int) -> None:
        """Log each captured name once, combined over the micro-batches, then forget them."""
        records, self._records = self._records, {}
        for name, entries in records.items():
            options = dict(entries[-1][2])
            value = _combine(entries, options.get("reduce_fx", "mean"))
            if options.get("batch_size") is None:
                options["batch_size"] = batch_size
            self.module.log(name, value, **options)


def _combine(entries: list[tuple[Any, Any, dict[str, Any]]], reduce_fx: Any) -> Any:
    values = [value for value, _, _ in entries]
    reduction = (
        _REDUCTIONS.get(reduce_fx)
        if isinstance(reduce_fx, str)
        else _REDUCTIONS.get(getattr(reduce_fx, "__name__", ""))
    )
    if len(values) == 1 or reduction is None or not all(isinstance(v, (Tensor, int, float)) for v in values):
        return values[-1]
    stacked = torch.stack([torch.as_tensor(v).detach().to(torch.float64).reshape(()) for v in values])
    weights = torch.stack([torch.as_tensor(w).to(stacked.device, torch.float64).reshape(()) for _, w, _ in entries])
    # A micro-batch without items contributes nothing: its mean over no items is 0/0 = NaN, and 0 * NaN is NaN too.
    contributes = (weights > 0) | ~stacked.isnan()
    if reduction in ("sum", "max", "min"):
        kept = stacked.masked_fill(~contributes, {"sum": 0.0, "max": -math.inf, "min": math.inf}[reduction])
        combined = kept.sum() if reduction == "sum" else kept.max() if reduction == "max" else kept.min()
        return torch.where(contributes.any(), combined, torch.full_like(combined, math.nan)).float()
    total = weights.sum()
    weighted = torch.where(weights > 0, stacked * weights, torch.zeros_like(stacked)).sum()
    # No items at all (everything masked): fall back to the plain mean rather than 0/0.
    return torch.where(total > 0, weighted / total.clamp(min=1e-30), stacked.mean()).float()
