"""The exactness arithmetic: item counting and window weights.

The optimizer update must equal the full-batch update over every item (sample or loss-bearing token) of the window
on every rank, i.e. the gradient must be ``sum_i grad(S_i) / N`` where ``S_i`` is the summed loss of micro-batch
``i`` and ``N`` the number of items in the whole window, all ranks together.

Nothing about the window is known in advance: the tail of an epoch is short and token counts vary. So each
micro-batch's gradient is weighted by what *is* known at its backward, and the window total is applied once, at the
optimizer step:

1. micro-batch ``i`` contributes ``w_i * grad(L_i)``, with ``w_i = n_i / r`` when ``L_i`` is a mean over its
   ``n_i`` items and ``w_i = 1 / r`` when it is a sum. The gradient buffer then holds ``sum_i grad(S_i) / r``.
2. at the step, the item counts are summed across ranks (one small all-reduce) and the buffers are multiplied by
   ``r * world_size / N``; the ``world_size`` undoes DDP's mean.

``r`` is only a scale that keeps gradient magnitudes near those of a plain mean loss (it matters for fp16 loss
scaling). It must be the same on every rank, so it is derived from the previous window's *global* count: in window
mode, where every rank runs the same ``k``, the divisor is ``r · k`` with ``r`` the previous window's items per
micro-batch per rank; in split mode, where ranks with different step batches run different numbers of micro-batches,
``k`` is not shared, and the divisor is the previous window's items per rank (1 in a run's first window).

This module needs no Trainer; `WindowNormalizer` is shared by window mode, split mode and the manual helper.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
from torch import Tensor

from lightning_accum._util.validation import check_choice

# `batch_size_of` reads a batch the way `split_batch` cuts it, so it lives with it; it is part of this module's API.
from lightning_accum.batches import batch_size_of as batch_size_of

LossReduction = Literal["mean", "sum"]
# Returns a non-negative int, float, NumPy number or single-element tensor. The return type stays `Any` on purpose:
# jsonargparse (LightningCLI) reads `Callable[..., int | Tensor]` as "a factory of Tensors" and would refuse counters
# given in YAML.
ItemCounter = Callable[[Any], Any]


_LOSS_REDUCTIONS: dict[LossReduction, str] = {
    "mean": "training_step returns the mean over the items of its micro-batch",
    "sum": "it returns their sum",
}


def check_loss_reduction(loss_reduction: Any) -> LossReduction:
    """``loss_reduction`` if it is ``"mean"`` or ``"sum"``.

    Raises:
        ValueError: it is neither; the message says what each one means.
    """
    return check_choice(loss_reduction, "loss_reduction", _LOSS_REDUCTIONS)


def count_items(batch: Any, counter: ItemCounter | None) -> int | float | Tensor:
    """Count the items in ``batch`` with the user's ``counter`` (samples when ``None``), checking what it returns.

    A count is a non-negative number: an int, a float (a weighted count, such as the sum of a float loss mask or of
    sample weights; the window mean is then the weighted mean), a NumPy number, or a single-element tensor. A tensor
    count stays a tensor so that counting never waits for the device: on the CPU it is checked at once, elsewhere at
    the optimizer step (negative, NaN and inf are refused there, on every rank).

    Raises:
        TypeError: the count is not a number (a bool, a string, a tensor or array of several elements, a boolean or
            complex tensor).
        ValueError: the count is negative, NaN or infinite.

    Examples:
        >>> labels = torch.tensor([[1, 2, -100], [3, -100, -100]])
        >>> count_items({"labels": labels}, lambda b: (b["labels"] != -100).sum())
        tensor(3)
        >>> count_items({"loss_mask": torch.tensor([[1.0, 1.0, 0.0]])}, lambda b: b["loss_mask"].sum())
        tensor(2.)
    """
    if counter is None:
        return batch_size_of(batch)
    return _check_count(counter(batch))


def _check_count(value: Any) -> int | float | Tensor:
    np = sys.modules.get("numpy")  # only if the user's code already imported it
    if np is not None and isinstance(value, (np.ndarray, np.generic)):
        value = _from_numpy(value)
    if isinstance(value, Tensor):
        return _check_tensor_count(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            "`count_items` must return a non-negative number of items: an int, a float (a weighted count such as"
            " `loss_mask.sum()` over a float mask), a NumPy number or a single-element tensor; got"
            f" {value!r} of type {type(value).__name__}."
        )
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(_NOT_FINITE.format(value=value))
    if value < 0:
        raise ValueError(_NEGATIVE.format(value=value))
    return value


_NEGATIVE = (
    "`count_items` returned a negative count for a micro-batch: it must return a non-negative count, got {value}."
    " It must count items, e.g. `lambda b: (b['labels'] != -100).sum()`, or sum non-negative weights."
)
_NOT_FINITE = (
    "`count_items` returned {value} for a micro-batch: a count must be finite. Look for a NaN or inf in the mask or"
    " weights it sums, or a division by zero."
)


def _from_numpy(value: Any) -> Any:
    if value.size != 1:
        raise TypeError(
            f"`count_items` must return a single number, got an array of shape {value.shape}. Reduce it with `.sum()`."
        )
    kind = value.dtype.kind
    if kind in "iu":
        return int(value.reshape(()).item())
    if kind == "f":
        return float(value.reshape(()).item())
    raise TypeError(
        f"`count_items` must return an integer or a float, got a NumPy value of dtype {value.dtype}. Sum a mask"
        " to count it, e.g. `mask.sum()`."
    )


def _check_tensor_count(value: Tensor) -> Tensor:
    if value.numel() != 1:
        raise TypeError(
            f"`count_items` must return a single number, got a tensor of shape {tuple(value.shape)} and dtype"
            f" {value.dtype}. Reduce it with `.sum()`, e.g. `lambda b: (b['labels'] != -100).sum()`."
        )
    if value.dtype == torch.bool or value.is_complex():
        raise TypeError(
            f"`count_items` returned a tensor of dtype {value.dtype}; it must return an integer or a float count."
            " Sum a boolean mask to count it, e.g. `lambda b: (b['labels'] != -100).sum()`."
        )
    value = value.reshape(())
    if value.is_floating_point() and value.dtype in (torch.float16, torch.bfloat16):
        # Half-precision sums round (bf16 above 256): keep the window total in float32, exact on these values.
        value = value.float()
    if value.device.type == "cpu":
        # Free to read here; a count on an accelerator is checked at the step instead, without a sync per micro-batch.
        number = value.item()
        if not math.isfinite(number):
            raise ValueError(_NOT_FINITE.format(value=number))
        if number < 0:
            raise ValueError(_NEGATIVE.format(value=number))
    return value


@dataclass(frozen=True)
class WindowTotals:
    """What one window held, summed over all ranks, and the factor that made its gradient exact."""

    items: float
    samples: int
    micro_batches: int
    factor: float
    extra: tuple[float, ...] = ()  # what the caller asked to sum over ranks along with the counts


class WindowNormalizer:
    """Weights each micro-batch's gradient and, at the optimizer step, rescales the sum to the exact window mean.

    Args:
        loss_reduction: whether the loss of a micro-batch is the ``"mean"`` or the ``"sum"`` over its items.

    Examples:
        Two micro-batches of uneven size whose *mean* losses are accumulated give the gradient of the mean over all
        five samples, not the mean of the two means:

        >>> w = torch.zeros(1, requires_grad=True)
        >>> x = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
        >>> norm = WindowNormalizer("mean")
        >>> norm.start_window(accumulation_steps=2)
        >>> for micro_batch in (x[:4], x[4:]):
        ...     loss = (w * micro_batch).mean()
        ...     n = len(micro_batch)
        ...     (loss * norm.add_micro_batch(n_items=n, n_samples=n)).backward()
        >>> totals = norm.finish_window([w])
        >>> w.grad, x.mean()
        (tensor([3.]), tensor(3.))
    """

    def __init__(self, loss_reduction: LossReduction = "mean") -> None:
        self.loss_reduction: LossReduction = check_loss_reduction(loss_reduction)
        # Reference scale r; see the module docstring. Derived from global counts only, so equal on all ranks.
        self.scale = 1.0
        self.items_per_rank: float | None = None  # the previous window's global items / ranks (split mode's divisor)
        self._accumulation_steps: int | None = 1
        self._items: Tensor | float = 0
        self._min_items: Tensor | float = 0
        self._samples = 0
        self._micro_batches = 0
        self.first_items: float | Tensor = 0  # items of the window's first micro-batch, this rank
        self.windows_started = 0

    @property
    def micro_batches(self) -> int:
        """Micro-batches added to the current window on this rank."""
        return self._micro_batches

    def start_window(self, accumulation_steps: int | None) -> None:
        """Forget the previous window.

        Args:
            accumulation_steps: the planned window length ``k``, the same on every rank (window mode); it only sets
                the divisor. ``None`` when ranks may run different numbers of micro-batches (split mode): the
                divisor is then the previous window's items per rank, which every rank knows alike.
        """
        self._accumulation_steps = None if accumulation_steps is None else max(1, accumulation_steps)
        self._items = 0
        self._min_items = 0
        self._samples = 0
        self._micro_batches = 0
        self.first_items = 0
        self.windows_started += 1

    @property
    def divisor(self) -> float:
        """``D``: a micro-batch's gradient buffer holds ``n_i / D`` times its mean-loss gradient, on every rank alike.

        ``r · k`` in window mode; the previous window's items per rank (1 before any) when ``k`` is not shared.
        """
        if self._accumulation_steps is None:
            return self.items_per_rank or 1.0
        return self.scale * self._accumulation_steps

    def add_micro_batch(self, n_items: float | Tensor, n_samples: int) -> float | Tensor:
        """Record a micro-batch and return ``w_i``, the weight its loss gradient must be multiplied by.

        The weight is a tensor when ``n_items`` is one (no host sync), a float otherwise.
        """
        if self._micro_batches == 0:
            self._min_items = n_items
            self.first_items = n_items
        elif isinstance(n_items, Tensor) or isinstance(self._min_items, Tensor):
            self._min_items = torch.minimum(torch.as_tensor(self._min_items), torch.as_tensor(n_items))
        else:
            self._min_items = min(self._min_items, n_items)
        self._items = self._items + n_items
        self._samples += n_samples
        self._micro_batches += 1
        divisor = self.divisor
        if self.loss_reduction == "sum":
            return 1.0 / divisor
        if isinstance(n_items, Tensor):
            return n_items.to(torch.float32) / divisor
        return n_items / divisor

    def finish_window(
        self,
        parameters: Iterable[Tensor],
        sum_across_ranks: Callable[[Tensor], Tensor] | None = None,
        world_size: int = 1,
        ranks: int | None = None,
        extra: Sequence[float] = (),
    ) -> WindowTotals:
        """Rescale the accumulated gradients of ``parameters`` to the exact window mean.

        Args:
            parameters: the parameters whose ``.grad`` holds ``sum_i w_i * grad(L_i)`` (after DDP's mean, if any).
            sum_across_ranks: sums a small tensor over all ranks; ``None`` on a single process.
            world_size: the number of ranks whose gradients DDP averaged (1 when they were summed instead).
            ranks: the number of ranks that took part in the window (default ``world_size``); sets the next
                divisor where ``k`` is not shared.
            extra: more figures of this rank to sum over ranks in the same all-reduce (``WindowTotals.extra``).

        A window with no items at all (everything masked) has no mean: its gradients are set to ``None`` so that
        the optimizer skips every parameter, and ``factor`` is 0.
        """
        items, samples, micro_batches, negative_ranks, *summed = self._window_counts(sum_across_ranks, extra)
        if negative_ranks:
            # Raised on every rank at once (the flag was summed), so no rank is left waiting in a collective.
            raise ValueError(
                "`count_items` returned a negative count, NaN or inf for a micro-batch of this window. It must count"
                " items, e.g. `lambda b: (b['labels'] != -100).sum()`, or sum finite non-negative weights."
            )
        params = [p for p in parameters if p.grad is not None]
        if items <= 0:
            for p in params:
                p.grad = None
            factor = 0.0
        else:
            factor = self.divisor * world_size / items
            if factor != 1.0:
                # Each is a tensor: `params` holds only the parameters with a gradient.
                torch._foreach_mul_(cast(list[Tensor], [p.grad for p in params]), factor)
            # Next window's divisor, from global counts only: weights stay near 1/k, and equal on every rank.
            self.scale = items / max(1.0, micro_batches)
            self.items_per_rank = items / (ranks or world_size)
        return WindowTotals(items, int(samples), int(micro_batches), factor, tuple(summed))

    def _window_counts(
        self, sum_across_ranks: Callable[[Tensor], Tensor] | None, extra: Sequence[float] = ()
    ) -> list[float]:
        """Items, samples, micro-batches, a bad-count flag and ``extra`` of this window, summed over ranks."""
        counts_are_numbers = not isinstance(self._items, Tensor) and not isinstance(self._min_items, Tensor)
        if sum_across_ranks is None and counts_are_numbers:
            # One process counting with Python numbers: nothing to sum or read back (the common single-device case,
            # where building the tensors below costs more than the rest of the step's bookkeeping).
            bad = not (self._min_items >= 0 and math.isfinite(self._items))
            return [
                float(self._items),
                float(self._samples),
                float(self._micro_batches),
                float(bad),
                *map(float, extra),
            ]
        device = self._items.device if isinstance(self._items, Tensor) else torch.device("cpu")
        # The host figures go to the device in one copy (on CUDA each copy waits for the queued work), the counts
        # stay where they are.
        host = [float(self._samples), float(self._micro_batches), *map(float, extra)]
        on_host = torch.tensor(host, dtype=torch.float64).to(device)
        items = torch.as_tensor(self._items, dtype=torch.float64, device=device).reshape(1)
        flag = self._bad_count_flag(device).reshape(1)
        local = torch.cat([items, on_host[:2], flag, on_host[2:]])  # items, samples, micro-batches, flag, extra
        totals = sum_across_ranks(local) if sum_across_ranks is not None else local
        # One host read per optimizer step (never per micro-batch): the count decides between scaling and skipping.
        return totals.tolist()

    def _bad_count_flag(self, device: torch.device) -> Tensor:
        # 1.0 when a count of this window was negative, NaN or inf (float counts can be all three); read at the step.
        smallest = torch.as_tensor(self._min_items, device=device)
        total = torch.as_tensor(self._items, dtype=torch.float64, device=device)
        return (~(smallest >= 0) | ~torch.isfinite(total)).to(torch.float64)

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "items_per_rank": self.items_per_rank}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.scale = float(state.get("scale", 1.0))
        items_per_rank = state.get("items_per_rank")
        self.items_per_rank = None if items_per_rank is None else float(items_per_rank)
