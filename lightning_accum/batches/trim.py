"""`SequenceTrim`: how a micro-batch's sequence fields are shortened to its longest sequence. Pure.

`lightning_accum.batches.plan.BatchPlan.take` applies it, through the walker (`lightning_accum.batches._walk`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lightning_accum._util.validation import check_int


@dataclasses.dataclass(frozen=True)
class SequenceTrim:
    """Keep the first ``to_length`` positions of the sequence fields: tensors whose ``sequence_dim`` is ``from_length``.

    A sequence field is a tensor with the batch on dim 0 (its rows are per-sample) whose dim ``sequence_dim`` has the
    padded length ``from_length``: with right padding, the positions past a micro-batch's longest sequence hold only
    padding. Tensors of another length there, shared values and the entries of per-sample lists are left whole. The
    trimmed tensors are views (`torch.Tensor.narrow`) of the batch's.

    Args:
        sequence_dim: the dimension that holds the sequence (``1`` for ``(batch, sequence, ...)``), at least 1.
        from_length: the padded length of the batch's sequence fields.
        to_length: the length they keep, from 0 to ``from_length``.
        fields: the paths of the only tensors that are sequence fields (``"batch['input_ids']"``, as
            `BatchPlan.roles` writes them); ``None`` reads every tensor of rows with that length as one.

    Raises:
        TypeError: an argument is not an int.
        ValueError: ``sequence_dim < 1``, a negative length, or ``to_length > from_length``.

    Examples:
        >>> import torch
        >>> from lightning_accum.batches import plan_batch
        >>> plan = plan_batch({"input_ids": torch.zeros(4, 9), "labels": torch.zeros(4, 9), "score": torch.zeros(4)})
        >>> {k: tuple(v.shape) for k, v in plan.take([2, 0], trim=SequenceTrim(1, 9, 5)).items()}
        {'input_ids': (2, 5), 'labels': (2, 5), 'score': (2,)}
    """

    sequence_dim: int
    from_length: int
    to_length: int
    fields: frozenset[str] | None = None

    def __post_init__(self) -> None:
        check_int(self.sequence_dim, "sequence_dim", 1, hint="Dim 0 holds the samples; the sequence is on another.")
        check_int(self.from_length, "from_length", 0)
        check_int(self.to_length, "to_length", 0)
        if self.to_length > self.from_length:
            raise ValueError(
                f"`to_length` must be at most `from_length={self.from_length}` (a trim only shortens), got"
                f" {self.to_length}. Pass the longest sequence length of the samples taken."
            )

    def applies_to(self, rows: Any) -> bool:
        """Whether ``rows`` (a tensor or array with the batch on dim 0) is a sequence field this trim shortens."""
        return bool(rows.ndim > self.sequence_dim and rows.shape[self.sequence_dim] == self.from_length)
