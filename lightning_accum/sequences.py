"""Split mode by tokens: where a batch's padded sequences are, and how a step batch is cut by a token budget. Pure.

A language-model step batch holds sequences of very different lengths, right-padded to the longest. Memory and
compute follow the *padded tokens* of a micro-batch (samples x longest length), not its number of samples. With
`PaddedSequences`, `lightning_accum.AutoMicroBatching` cuts each step batch as `TokenCut` does:

1. the samples are ordered by length, longest first (a stable sort: equal lengths keep their order), so that a
   micro-batch holds sequences of similar length, and the longest sequences run first, where an out-of-memory error
   is still recoverable on every rank;
2. consecutive samples share a micro-batch whose padded size stays within the token budget, cut where the step
   computes the fewest padded tokens, each micro-batch counted as `MICRO_BATCH_COST`'s share of the budget more
   (`TokenCut.groups`); a sequence longer than the budget gets a micro-batch of its own;
3. each micro-batch is trimmed to its own longest sequence in every *sequence field*: every tensor with the batch
   on dim 0 whose dim ``sequence_dim`` has the padded length (`lightning_accum.splitting.SequenceTrim`).

Sorting is exact for losses that treat samples independently. Trimming is exact for right-padded models whose real
positions do not attend to padding (causal LMs, and models that mask padding). Left padding is refused: trimming it
would move every real token to another position.

Examples:
    >>> batch = {"input_ids": torch.tensor([[5, 6, 0, 0], [7, 8, 9, 4], [3, 0, 0, 0]]),
    ...          "attention_mask": torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])}
    >>> cut = PaddedSequences(mask="attention_mask").cut(batch)
    >>> cut.order, cut.lengths, cut.padded_length
    ([1, 0, 2], [4, 2, 1], 4)
    >>> [m.batch["input_ids"].tolist() for m in cut.split(batch, 4)]  # at most 4 padded tokens per micro-batch
    [[[7, 8, 9, 4]], [[5, 6]], [[3]]]
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_accum._cli_types import ImportPath, PositiveInt
from lightning_accum._validation import check_int, import_object
from lightning_accum.balanced_sampler import BalancedBatchSampler as BalancedBatchSampler  # next to PaddedSequences
from lightning_accum.items import lookup
from lightning_accum.splitting import (
    BatchHooks,
    BatchPlan,
    MicroBatch,
    RowOrder,
    SequenceTrim,
    plan_batch,
    resolve_batch_hooks,
)

MICRO_BATCH_COST = 32
"""A micro-batch costs as much as ``budget // MICRO_BATCH_COST`` padded tokens beyond its own (see `TokenCut.groups`).

At 32, a step batch of 64 sequences log-normal around 40 tokens (capped at 256) at a budget of 8 x 256 runs in about 9
micro-batches with 9% padding, against 3 with 35% when each micro-batch is filled to the budget
(``examples/benchmarks/token_split.py``). A fraction of the budget, so the cut keeps its shape at every scale.
"""

_SHORT_WINDOW = 48  # `TokenCut.groups` takes the minimum over a window of up to this many stops in Python

LengthsFn = Callable[[Any], Any]
"""``lengths(batch)``: each sample's length, a 1-D integer tensor, array or list of ints."""


class PaddedSequences:
    """Where a batch's right-padded sequences are, so that split mode can sort, trim and size micro-batches by tokens.

    Give either ``mask`` (each sample's length is the position of the last nonzero entry of its mask, plus one) or
    ``lengths`` (a function of the batch). With ``mask``, the padded length is the mask's size along
    ``sequence_dim``; with ``lengths``, it is the size along ``sequence_dim`` that most of the batch's per-sample
    tensors share, among those at least as long as the longest sequence.

    Args:
        mask: where the 0/1 mask is: a mapping key (``"attention_mask"``, the default when ``lengths`` is not given),
            a position in a tuple batch, or an attribute name of a batch object.
        lengths: ``lengths(batch)`` returns each sample's length (a 1-D integer tensor, array or list), or the import
            path of such a function; instead of ``mask``.
        sequence_dim: the dimension that holds the sequence in the sequence fields (1 for ``(batch, sequence)``).

    Raises:
        TypeError: ``mask`` is not a str or an int, ``lengths`` is not callable, or an argument has the wrong type.
        ValueError: both ``mask`` and ``lengths`` are given, or ``sequence_dim < 1``.

    Examples:
        >>> sequences = PaddedSequences(mask="attention_mask")
        >>> sequences.lengths({"attention_mask": torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])}).tolist()
        [2, 3, 1]
        >>> PaddedSequences(lengths=lambda batch: batch["n"]).lengths({"n": [4, 2]}).tolist()
        [4, 2]
    """

    def __init__(
        self,
        mask: str | int | None = None,
        *,
        lengths: LengthsFn | ImportPath | None = None,
        sequence_dim: PositiveInt = 1,
    ) -> None:
        if mask is not None and lengths is not None:
            raise ValueError(
                f"`PaddedSequences` takes `mask` or `lengths`, not both (got mask={mask!r} and lengths={lengths!r})."
                " Pass the mask's key, or a function that returns each sample's length."
            )
        if lengths is None and mask is None:
            mask = "attention_mask"
        if mask is not None and (isinstance(mask, bool) or not isinstance(mask, (str, int))):
            raise TypeError(
                f"`mask` must be a str (a mapping key or attribute name) or an int (a position in a tuple batch),"
                f" got {mask!r} of type {type(mask).__name__}."
            )
        self.mask = mask
        self._lengths_given = lengths
        self.lengths_fn: LengthsFn | None = _resolve_lengths(lengths)
        self.sequence_dim = check_int(sequence_dim, "sequence_dim", 1, hint="Dim 0 holds the samples.")

    def lengths(self, batch: Any) -> Tensor:
        """Each sample's length, a 1-D int64 tensor on the CPU (one host read per step batch).

        Raises:
            KeyError: the batch has no mask under ``mask``.
            TypeError: the mask is not a tensor, or ``lengths`` returned something that is not a list of lengths.
            ValueError: a sample is left-padded (its mask starts with 0 and has a 1 later), or a length is negative.
        """
        if self.lengths_fn is not None:
            return _checked_lengths(self.lengths_fn(batch), self._lengths_given)
        mask = self._mask(batch)
        return _mask_lengths(mask, self.mask, self.sequence_dim)

    def padded_length(self, batch: Any, plan: BatchPlan, lengths: Tensor) -> int:
        """The length the batch's sequence fields are padded to (see the class docstring).

        Raises:
            ValueError: no per-sample tensor of the batch is as long as its longest sequence along ``sequence_dim``.
        """
        if self.lengths_fn is None:
            return int(self._mask(batch).shape[self.sequence_dim])
        longest = int(lengths.max()) if len(lengths) else 0
        sizes = Counter(
            int(node.shape[self.sequence_dim])
            for node in plan.row_tensors()
            if node.ndim > self.sequence_dim and node.shape[self.sequence_dim] >= longest
        )
        if not sizes:
            raise ValueError(
                f"`PaddedSequences(lengths=...)` says the longest sequence has {longest} tokens, but no tensor of the"
                f" batch is that long along `sequence_dim={self.sequence_dim}`. Return each sample's real length, and"
                " check `sequence_dim`."
            )
        return max(sizes, key=lambda size: (sizes[size], size))

    def cut(self, batch: Any, hooks: BatchHooks | None = None) -> TokenCut:
        """Read ``batch`` once: its plan, its samples ordered by length (longest first) and its padded length."""
        plan = (hooks or resolve_batch_hooks(None)).plan(batch)
        lengths = self.lengths(batch)
        if len(lengths) != plan.size:
            raise ValueError(
                f"`PaddedSequences` found {len(lengths)} sequence lengths in a batch of {plan.size} samples. The mask"
                " (or `lengths`) must hold one entry per sample, with the samples on dim 0."
            )
        padded = self.padded_length(batch, plan, lengths)
        if len(lengths) and int(lengths.max()) > padded:
            raise ValueError(
                f"`PaddedSequences(lengths=...)` returned a length of {int(lengths.max())} for a batch padded to"
                f" {padded}: a sequence cannot be longer than its padding. Return each sample's real length."
            )
        ordered, order = torch.sort(lengths, descending=True, stable=True)
        return TokenCut(plan, order.tolist(), ordered.tolist(), padded, self.sequence_dim)

    def _mask(self, batch: Any) -> Any:
        assert self.mask is not None
        return lookup(batch, self.mask, f"PaddedSequences(mask={self.mask!r})", "a mask (or pass `lengths=`)")

    def __repr__(self) -> str:
        if self.lengths_fn is not None:
            source = self._lengths_given if isinstance(self._lengths_given, str) else _name(self.lengths_fn)
            return f"PaddedSequences(lengths={source!r}, sequence_dim={self.sequence_dim})"
        return f"PaddedSequences(mask={self.mask!r}, sequence_dim={self.sequence_dim})"

    def _key(self) -> tuple[Any, ...]:
        # The function itself, not its name: two lambdas both read `<lambda>`; an import path and the function it
        # names are the same.
        return (self.mask, self.lengths_fn, self.sequence_dim)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PaddedSequences) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())


@dataclass(frozen=True)
class TokenStats:
    """The padded and real tokens of one cut, on one rank."""

    padded: int  # token positions computed: samples x longest length, summed over the micro-batches
    real: int  # real tokens among them (the sequences' lengths)
    largest: int  # padded tokens of the largest micro-batch
    micro_batches: int


class TokenCut:
    """One step batch, read once and ordered by length, cut into micro-batches by a token budget (see the module).

    Made by `PaddedSequences.cut`. A retry after an out-of-memory error cuts the same step batch again at a smaller
    budget without reading it again.

    Attributes:
        plan: the step batch's `lightning_accum.splitting.BatchPlan`; ``None`` for a cut made only for its figures
            (`stats`), as the probe's report makes one.
        order: sample indices, longest sequence first.
        lengths: the sequences' lengths in that order.
        padded_length: what the batch's sequence fields are padded to.
        sequence_dim: where the sequence is in them.
    """

    def __init__(
        self, plan: BatchPlan | None, order: list[int], lengths: list[int], padded_length: int, sequence_dim: int
    ) -> None:
        self.plan, self.order, self.lengths = plan, order, lengths
        self.padded_length, self.sequence_dim = padded_length, sequence_dim
        self._groups: dict[int, list[range]] = {}  # by budget: `split` and `stats` cut alike, once

    @property
    def size(self) -> int:
        """The step batch's samples."""
        return len(self.order)

    @property
    def longest(self) -> int:
        """The longest sequence's length (at least 1): the smallest micro-batch that holds it has this many tokens."""
        return max(1, self.lengths[0]) if self.lengths else 1

    @property
    def tokens(self) -> int:
        """Padded tokens of the whole step batch in one micro-batch trimmed to its longest sequence."""
        return self.size * self.longest

    def groups(self, budget: int) -> list[range]:
        """Positions in `order` of each micro-batch at a budget of ``budget`` padded tokens, longest first.

        Of the cuts into consecutive samples, each within the budget (a sequence longer than it alone), this is the
        one that computes the fewest padded tokens, counting every micro-batch as ``budget // MICRO_BATCH_COST``
        tokens more: what a micro-batch costs beyond its tokens (its passes' fixed work, and a smaller one's lower
        efficiency). Filling each micro-batch to the budget instead pads a long-tailed step batch by a third: its
        longest sequences differ too much to share one. Ties go to fewer micro-batches. A shortest path over the
        sorted lengths, once per budget: ``O(n * min(n, budget / shortest))`` additions, vectorized (a step batch of
        4096 short sequences at 65,536 tokens takes about 0.1 s on one CPU core, 64 sequences 0.3 ms).

        Examples:
            >>> cut = TokenCut(None, [0, 1, 2, 3, 4], [9, 4, 4, 3, 1], 9, 1)
            >>> [list(g) for g in cut.groups(8)]  # 9 > 8 runs alone; then 2 of 4; 3 and 1 apart pad nothing
            [[0], [1, 2], [3], [4]]
            >>> [list(g) for g in cut.groups(160)]  # 5 tokens a micro-batch: 4 x 4 + 5 beats 3 x 4 + 5 + 1 + 5
            [[0], [1, 2, 3, 4]]
        """
        budget = check_int(budget, "budget", 1)
        if budget in self._groups:
            return self._groups[budget]
        overhead, lengths, n = budget // MICRO_BATCH_COST, self.lengths, len(self.order)
        cost, end = [0] * (n + 1), [n] * (n + 1)  # the cheapest cut of positions start.. n, and its first stop
        costs = torch.zeros(n + 1, dtype=torch.int64)  # `cost` again, for the long windows' vectorized minimum
        for start in range(n - 1, -1, -1):
            longest = max(1, lengths[start])  # sorted: the first is the group's longest
            last = min(n, start + max(1, budget // longest))
            if last - start <= _SHORT_WINDOW:
                # -stop: of equal costs, the longest micro-batch (fewest of them) wins
                best, stop = min((overhead + (e - start) * longest + cost[e], -e) for e in range(start + 1, last + 1))
                cost[start], end[start] = best, -stop
            else:  # the same minimum over a window of thousands, in one pass: flipped, so that a tie takes the last
                window = costs[start + 1 : last + 1] + longest * torch.arange(1, last - start + 1)
                back = int(torch.argmin(window.flip(0)))
                cost[start], end[start] = overhead + int(window[-1 - back]), last - back
            costs[start] = cost[start]
        groups, start = [], 0
        while start < n:
            groups.append(range(start, end[start]))
            start = end[start]
        self._groups[budget] = groups
        return groups

    def split(self, batch: Any, budget: int) -> list[MicroBatch]:
        """The micro-batches of ``batch`` at ``budget`` padded tokens each, longest first, each trimmed.

        ``batch`` is the step batch, or a copy of it with the same structure (the pre-flight's fake one): the lengths
        are the step batch's.
        """
        # The fake copy holds as many samples as the step batch: read at that size, as a user's `batch_size_of`
        # hook read the step batch.
        plan = (
            self.plan if self.plan is not None and batch is self.plan.batch else plan_batch(batch, batch_size=self.size)
        )
        order = RowOrder(self.order)  # one index tensor per device for the whole step, not one per micro-batch
        micro_batches = []
        for group in self.groups(budget):
            trim = SequenceTrim(self.sequence_dim, self.padded_length, max(1, self.lengths[group.start]))
            micro_batches.append(MicroBatch(plan.take_span(order, group, trim=trim), len(group)))
        return micro_batches

    def stats(self, budget: int) -> TokenStats:
        """The padded and real tokens the micro-batches at ``budget`` compute."""
        groups = self.groups(budget)
        padded = [len(g) * max(1, self.lengths[g.start]) for g in groups]
        return TokenStats(sum(padded), sum(self.lengths), max(padded, default=0), len(groups))

    def batch_size(self, batch: Any) -> int:
        """The step batch's samples (what the pre-flight asks a cutter)."""
        return self.size


def _mask_lengths(mask: Any, where: str | int | None, sequence_dim: int) -> Tensor:
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
    present = mask.detach() != 0
    other = [d for d in range(1, present.ndim) if d != sequence_dim]
    if other:
        present = present.any(dim=other)  # one flag per sample and position
    present = present.to("cpu")
    positions = torch.arange(1, present.shape[1] + 1)
    lengths = (present * positions).amax(dim=1)  # the last real position, plus one; 0 for an empty sample
    left_padded = ~present[:, 0] & (lengths > 0)
    if bool(left_padded.any()):
        row = int(left_padded.nonzero()[0, 0])
        raise ValueError(
            f"`PaddedSequences(mask={where!r})`: sample {row} of the step batch is left-padded (its mask starts with 0"
            f" and has a 1 later: {present[row].int().tolist()[:16]}...). Split mode trims padding on the right;"
            " trimming it on the left would move every real token to another position. Pad on the right (Hugging"
            " Face: `tokenizer.padding_side = 'right'`)."
        )
    return lengths.to(torch.int64)


def _checked_lengths(value: Any, given: Any) -> Tensor:
    try:
        lengths = torch.as_tensor(value.tolist() if hasattr(value, "tolist") else value, dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError) as err:
        raise TypeError(
            f"`PaddedSequences(lengths={_name(given)})` must return each sample's length (a 1-D integer tensor, array"
            f" or list), got {type(value).__name__}: {err}."
        ) from None
    if lengths.ndim != 1 or not bool((lengths == lengths.round()).all()):
        raise TypeError(
            f"`PaddedSequences(lengths={_name(given)})` must return one whole length per sample (a 1-D integer"
            f" tensor or list), got shape {tuple(lengths.shape)}."
        )
    if bool((lengths < 0).any()):
        raise ValueError(f"`PaddedSequences(lengths={_name(given)})` returned a negative length: {value!r}.")
    return lengths.to(torch.int64)


def _resolve_lengths(lengths: Any) -> LengthsFn | None:
    if lengths is None:
        return None
    target: object = import_object(lengths, "lengths") if isinstance(lengths, str) else lengths
    if not callable(target):
        raise TypeError(
            f"`lengths` must be a function of the batch that returns each sample's length, or its import path, got"
            f" {lengths!r} of type {type(lengths).__name__}."
        )
    return target


def _name(fn: Any) -> str:
    return str(getattr(fn, "__qualname__", None) or repr(fn))
