"""Reading a padding mask: which positions of each sample are real, for every mask form a model uses. Pure.

`lightning_accum.sequences.PaddedSequences(mask=...)` reads the step batch's lengths here.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

MASK_FORMS = (
    "a bool mask (True on real positions), an integer mask (0 on padding, 1 or any positive id on real positions), a"
    " float 0/1 mask, or an additive float mask (0 on real positions, a negative number such as -1e9 or -inf on"
    " padding)"
)
"""The masks `PaddedSequences(mask=...)` reads; any other is refused with this list."""


def mask_lengths(mask: Any, where: str | int | None, sequence_dim: int) -> Tensor:
    if not isinstance(mask, Tensor):
        raise TypeError(
            f"`PaddedSequences(mask={where!r})` expects a tensor mask at batch[{where!r}], got"
            f" {type(mask).__name__}. Point `mask` at the attention mask, or pass `lengths=`."
        )
    if mask.ndim <= sequence_dim:
        raise ValueError(
            f"`PaddedSequences(mask={where!r}, sequence_dim={sequence_dim})`: the mask has shape {tuple(mask.shape)},"
            f" with no dim {sequence_dim}. Pass the `sequence_dim` of the sequence."
        )
    present = real_positions(mask, where, sequence_dim)
    positions = torch.arange(1, present.shape[1] + 1)
    lengths = (present * positions).amax(dim=1)  # the last real position, plus one; 0 for an empty sample
    left_padded = ~present[:, 0] & (lengths > 0)
    if bool(left_padded.any()):
        row = int(left_padded.nonzero()[0, 0])
        raise ValueError(
            f"`PaddedSequences(mask={where!r})`: sample {row} of the step batch is left-padded (its mask starts with 0"
            f" and has a 1 later: {_around_first_one(present[row])}). Split mode trims padding on the right;"
            " trimming it on the left would move every real token to another position. Pad on the right (Hugging"
            " Face: `tokenizer.padding_side = 'right'`)."
        )
    return lengths.to(torch.int64)


def real_positions(mask: Tensor, where: str | int | None, sequence_dim: int) -> Tensor:
    """Where ``mask`` (one of `MASK_FORMS`) marks a real token: ``[samples, positions]`` bools on the CPU.

    Any other mask is refused for what it is. An all-zero float mask reads as additive (every position real): a step
    batch of empty samples is not a float 0/1 mask's likely meaning.
    """
    values = mask.detach()
    if values.dtype == torch.bool:
        real = values
    elif values.is_complex():
        raise TypeError(mask_error(where, f"a complex mask (dtype {values.dtype})"))
    else:
        numbers = values if values.is_floating_point() else values.to(torch.int64)
        # One host read for the whole check: the smallest and largest value, any NaN, and whether all are 0 or 1.
        zero_one = ((numbers == 0) | (numbers == 1)).all()
        low, high, nan, binary = (
            torch.stack(
                [numbers.min(), numbers.max(), numbers.isnan().any().to(numbers.dtype), zero_one.to(numbers.dtype)]
            ).tolist()
            if numbers.numel()
            else (0, 0, 0, 1)
        )
        if nan:
            raise ValueError(mask_error(where, "a mask holding NaN"))
        if not values.is_floating_point():
            if low < 0:
                raise ValueError(mask_error(where, f"an integer mask holding {int(low)} (below 0)"))
            real = values != 0
        elif binary:
            real = values != 0
        elif high <= 0:
            real = values == 0  # additive: 0 where attention goes, a large negative number where it does not
        else:
            raise ValueError(
                mask_error(where, f"a float mask holding values from {low:g} to {high:g}, neither 0/1 nor additive")
            )
    other = [d for d in range(1, real.ndim) if d != sequence_dim]
    if other:
        real = real.any(dim=other)  # one flag per sample and position
    return real.to("cpu")


def mask_error(where: str | int | None, what: str) -> str:
    return (
        f"`PaddedSequences(mask={where!r})` found {what} at batch[{where!r}]. It reads {MASK_FORMS}. Point `mask` at"
        " such a mask, or pass `lengths=` (a function that returns each sample's length)."
    )


def _around_first_one(row: Tensor, shown: int = 16) -> str:
    """A left-padded mask row where it turns to 1: the positions around its first 1, with where they start.

    Examples:
        >>> _around_first_one(torch.tensor([False] * 40 + [True] * 4))
        'positions 32-43: [0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1]'
    """
    first = int(row.int().argmax())
    start = max(0, first - shown // 2)
    stop = min(row.numel(), start + shown)
    return f"positions {start}-{stop - 1}: {row[start:stop].int().tolist()}"
