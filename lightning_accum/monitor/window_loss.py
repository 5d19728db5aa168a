"""The window loss: the item-weighted mean loss over a window and all ranks (``accum/window_loss``). Pure."""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torchmetrics import Metric

from lightning_accum.core.step_report import LossSum


def mean_loss(loss: LossSum) -> Tensor | float:
    """The item-weighted mean of ``loss``, as a tensor on its device (no host read); ``nan`` without items.

    Examples:
        >>> mean_loss(LossSum())
        nan
        >>> total = LossSum()
        >>> total.add(torch.tensor(2.0), n_items=3, loss_reduction="mean")
        >>> mean_loss(total)
        tensor(2.)
    """
    total, items = loss.total, loss.items
    if isinstance(total, Tensor) or isinstance(items, Tensor):
        return total / items  # a tensor, and 0/0 is nan
    return total / items if items > 0 else math.nan


class WeightedMean(Metric):
    """The weighted mean of the values seen since the last reset, summed across processes by torchmetrics.

    ``update`` never reads a value back to the host (no NaN check), so it costs no device synchronization. It
    exists because ``torchmetrics.aggregation.MeanMetric(nan_strategy="disable")`` drops the weights (torchmetrics
    1.9 replaces them by ones when the NaN check is disabled), and the check itself would synchronize.

    Examples:
        >>> mean = WeightedMean()
        >>> mean.update(torch.tensor(1.0), torch.tensor(4.0))
        >>> mean.update(torch.tensor(4.0), torch.tensor(2.0))
        >>> mean.compute()
        tensor(2.)
    """

    full_state_update = False
    total: Tensor
    weight: Tensor

    def __init__(self) -> None:
        super().__init__()
        self.add_state("total", default=torch.tensor(0.0), dist_reduce_fx="sum")
        self.add_state("weight", default=torch.tensor(0.0), dist_reduce_fx="sum")

    def update(self, value: Tensor, weight: Tensor) -> None:
        """Add ``value`` with ``weight`` (both scalars, on the metric's device)."""
        self.total += value * weight
        self.weight += weight

    def compute(self) -> Tensor:
        """The weighted mean; ``nan`` when nothing with a positive weight was seen."""
        return self.total / self.weight


def window_loss(mean: WeightedMean, loss: LossSum) -> float:
    """The item-weighted mean of ``loss`` over all ranks (``nan`` when no rank saw a loss); resets ``mean``.

    Every rank must call it, also with nothing, so that ``compute()`` syncs the same way on all of them. It reads the
    result back to the host, so it also waits for the device.

    Examples:
        >>> total = LossSum()
        >>> total.add(torch.tensor(2.0), n_items=3, loss_reduction="mean")
        >>> window_loss(WeightedMean(), total)
        2.0
    """
    device = mean.device
    weight = torch.as_tensor(loss.items, dtype=torch.float32, device=device)
    total = torch.as_tensor(loss.total, dtype=torch.float32).to(device)
    mean.update(torch.where(weight > 0, total / weight.clamp(min=1e-30), torch.zeros_like(total)), weight)
    value = float(mean.compute())
    mean.reset()
    return value


def progress_bar_loss(window_loss: float) -> dict[str, str]:
    """The window loss for the progress bar: the loss optimized, over every rank's items (none when unknown).

    Next to a module's own ``self.log("loss", ..., prog_bar=True)``, which is one micro-batch's on rank 0.

    Examples:
        >>> progress_bar_loss(1.22294)
        {'window_loss': '1.223'}
        >>> progress_bar_loss(float("nan"))
        {}
    """
    return {} if math.isnan(window_loss) else {"window_loss": f"{window_loss:.4g}"}
