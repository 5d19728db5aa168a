"""How a step batch is cut by a token budget: `TokenCut`, and the check that the trim kept every item. Pure.

`lightning_accum.sequences.PaddedSequences.cut` reads a step batch into a `TokenCut`; split mode runs its
micro-batches (see `lightning_accum.sequences` for the cut's rules).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_accum._util.validation import check_int
from lightning_accum.batches import BatchPlan, MicroBatch, RowOrder, SequenceTrim, plan_batch

MICRO_BATCH_COST = 32
"""A micro-batch costs as much as ``budget // MICRO_BATCH_COST`` padded tokens beyond its own (see `TokenCut.groups`).

At 32, a step batch of 64 sequences log-normal around 40 tokens (capped at 256) at a budget of 8 x 256 runs in about 9
micro-batches with 9% padding, against 3 with 35% when each micro-batch is filled to the budget
(``examples/benchmarks/token_split.py``). A fraction of the budget, so the cut keeps its shape at every scale.
"""

_SHORT_WINDOW = 256
"""`cut_groups` takes the minimum over a window of up to this many stops in a plain loop, over a longer one in tensors:
where they cost alike on this machine's CPU (256 sequences of 1-64 tokens at 4096 cut in 1.8 ms, against 3.6 ms
vectorized from 48 stops on; 4096 at 65,536 in the same 0.07-0.09 s)."""


def cut_groups(ordered: Sequence[int], budget: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of each micro-batch of ``ordered`` (lengths, longest first) at ``budget`` padded tokens.

    The one cut split by tokens makes (`TokenCut.groups` says which), and the one the balancing prices a share by
    (`lightning_accum.sequences.balancing.StepCost`, through `cut_price`, which makes it for a small share in
    place). A shortest path from the shortest sequence back: the cheapest stop of a micro-batch starting at
    each position, the furthest on a tie. A window of up to `_SHORT_WINDOW` stops is a plain loop (a rank's share of a
    few sequences: the balancing's hot spot), a longer one one vectorized minimum over a tensor copy of the costs,
    filled only as far as the long windows need.

    Example:
        >>> cut_groups([9, 4, 4, 3, 1], 8)
        [(0, 1), (1, 3), (3, 4), (4, 5)]
    """
    n, overhead = len(ordered), budget // MICRO_BATCH_COST
    cost, end = [0] * (n + 1), [n] * (n + 1)  # the cheapest cut of positions start.. n, and its first stop
    costs: Tensor | None = None  # `cost` from `filled` on, for the long windows
    filled, short = n, _SHORT_WINDOW  # read once: a global lookup a position is a few % of a small share's cut
    for start in range(n - 1, -1, -1):
        longest = max(1, ordered[start])  # sorted: the first is the group's longest
        last = min(n, start + max(1, budget // longest))
        if last - start <= short:
            best, stop = overhead + (last - start) * longest + cost[last], last
            for e in range(last - 1, start, -1):
                here = overhead + (e - start) * longest + cost[e]
                if here < best:
                    best, stop = here, e
        else:  # the same minimum over a window of thousands, in one pass: flipped, so that a tie takes the last
            if costs is None:
                costs = torch.zeros(n + 1, dtype=torch.int64)
            if filled > start + 1:  # the short windows' costs since the last long one, at once
                costs[start + 1 : filled] = torch.tensor(cost[start + 1 : filled], dtype=torch.int64)
            window = costs[start + 1 : last + 1] + longest * torch.arange(1, last - start + 1)
            back = int(torch.argmin(window.flip(0)))
            best, stop = overhead + int(window[-1 - back]), last - back
            costs[start], filled = best, start
        cost[start], end[start] = best, stop
    groups, start = [], 0
    while start < n:
        groups.append((start, end[start]))
        start = end[start]
    return groups


SMALL_SHARE = 512
"""`cut_price` cuts a share of up to this many sequences itself, a longer one through `cut_groups` (long windows)."""


def cut_price(ordered: Sequence[int], budget: int, pass_cost: float, quadratic: float | None) -> float:
    """The price of `cut_groups`' cut of ``ordered`` (each at least 1, longest first): `StepCost.of` of a rank's share.

    Per micro-batch: a pass, its padded tokens, and ``rows * longest ** 2 / quadratic`` where ``quadratic`` is given.

    The deal prices thousands of shares of a few sequences a step: here the same shortest path (the same stops, ties
    to the furthest) and the price's sum in the same order, in one function without the micro-batches' list. And a
    micro-batch starting one sequence earlier stops no later: its leader is at least as long, so each further stop
    costs it ``stop - start`` times that difference more than it costs the one after; of the stops after the
    furthest cheapest of the later start, none is as cheap. Its window ends there. On shares of 9 sequences this is
    about 1.8x faster than `cut_groups` and a sum over its micro-batches. A share longer than `SMALL_SHARE` goes
    through `cut_groups`.
    tests/test_balancing.py checks both give the same floats.

    Example:
        >>> cut_price([9, 4, 4, 3, 1], 8, 10.0, None)  # [9] [4, 4] [3] [1]: 4 passes, 9 + 8 + 3 + 1 tokens
        61.0
    """
    n = len(ordered)
    end = [n] * (n + 1)  # the stop of the micro-batch that starts at each position
    if n > SMALL_SHARE:
        for start, stop in cut_groups(ordered, budget):
            end[start] = stop
    else:
        overhead, cost = budget // MICRO_BATCH_COST, [0] * (n + 1)
        for start in range(n - 1, -1, -1):
            longest = ordered[start]
            last = start + (budget // longest or 1)
            if last > end[start + 1]:  # a longer leader stops no later (see above): the window ends there
                last = end[start + 1]
            best, stop = overhead + (last - start) * longest + cost[last], last
            for e in range(last - 1, start, -1):
                here = overhead + (e - start) * longest + cost[e]
                if here < best:
                    best, stop = here, e
            cost[start], end[start] = best, stop
    total, start = 0.0, 0
    while start < n:
        stop, longest = end[start], ordered[start]
        total += pass_cost + (stop - start) * longest
        if quadratic is not None:
            total += (stop - start) * longest * longest / quadratic
        start = stop
    return total


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
        plan: the step batch's `lightning_accum.batches.BatchPlan`; ``None`` for a cut made only for its figures
            (`stats`), as the probe's report makes one.
        order: sample indices, longest sequence first.
        lengths: the sequences' lengths in that order.
        padded_length: what the batch's sequence fields are padded to.
        sequence_dim: where the sequence is in them.
    """

    def __init__(
        self,
        plan: BatchPlan | None,
        order: list[int],
        lengths: list[int],
        padded_length: int,
        sequence_dim: int,
        fields: frozenset[str] | None = None,
        shared: frozenset[str] = frozenset(),
    ) -> None:
        self.plan, self.order, self.lengths = plan, order, lengths
        self.padded_length, self.sequence_dim = padded_length, sequence_dim
        self.fields, self.shared = fields, shared  # the paths of the named sequence fields and shared parts
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
        sorted lengths (`cut_groups`), once per budget: ``O(n * min(n, budget / shortest))`` additions, the long
        windows vectorized (a step batch of 4096 short sequences at 65,536 tokens takes about 0.1 s on one CPU core,
        64 sequences 0.1 ms).

        Examples:
            >>> cut = TokenCut(None, [0, 1, 2, 3, 4], [9, 4, 4, 3, 1], 9, 1)
            >>> [list(g) for g in cut.groups(8)]  # 9 > 8 runs alone; then 2 of 4; 3 and 1 apart pad nothing
            [[0], [1, 2], [3], [4]]
            >>> [list(g) for g in cut.groups(160)]  # 5 tokens a micro-batch: 4 x 4 + 5 beats 3 x 4 + 5 + 1 + 5
            [[0], [1, 2, 3, 4]]
        """
        budget = check_int(budget, "budget", 1)
        if budget not in self._groups:
            self._groups[budget] = [range(start, stop) for start, stop in cut_groups(self.lengths, budget)]
        return self._groups[budget]

    def split(self, batch: Any, budget: int) -> list[MicroBatch]:
        """The micro-batches of ``batch`` at ``budget`` padded tokens each, longest first, each trimmed.

        ``batch`` is the step batch, or a copy of it with the same structure (the pre-flight's fake one): the lengths
        are the step batch's.
        """
        # The fake copy holds as many samples as the step batch: read at that size, as a user's `batch_size_of`
        # hook read the step batch.
        plan = (
            self.plan
            if self.plan is not None and batch is self.plan.batch
            else plan_batch(batch, batch_size=self.size, shared=self.shared)
        )
        order = RowOrder(self.order)  # one index tensor per device for the whole step, not one per micro-batch
        micro_batches = []
        for group in self.groups(budget):
            longest = max(1, self.lengths[group.start])
            trim = SequenceTrim(self.sequence_dim, self.padded_length, longest, self.fields)
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


def check_items_kept(step_items: Any, micro_items: Sequence[Any], counter: Any) -> None:
    """Refuse a step whose trimmed micro-batches hold fewer items than the step batch: the trim cut scored positions.

    Split mode by tokens trims each micro-batch to its longest sequence; that is exact only if the positions it cuts
    carry no item of the loss. ``step_items`` is what ``counter`` (the ``count_items``) finds in the untrimmed step
    batch, ``micro_items`` what it finds in each trimmed micro-batch. One host read.

    Raises:
        ValueError: the counts differ: the loss scores padding (labels that are not ``-100`` there), and the update
            would not be the full-batch one.

    Examples:
        >>> check_items_kept(torch.tensor(7), [torch.tensor(4), torch.tensor(3)], "count")
        >>> check_items_kept(torch.tensor(9), [torch.tensor(4), torch.tensor(3)], "count")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: `count_items` ('count') counts 9 items in the step batch, but 7 in its micro-batches trimmed ...
    """
    counts = [step_items, *micro_items]
    tensors = [c for c in counts if isinstance(c, Tensor)]
    if tensors:
        device = tensors[0].device
        values = torch.stack([torch.as_tensor(c, device=device, dtype=torch.float64).reshape(()) for c in counts])
        step, *micro = values.tolist()
    else:
        step, *micro = (float(c) for c in counts)
    kept = math.fsum(micro)
    if math.isclose(step, kept, rel_tol=1e-6, abs_tol=1e-6):
        return
    raise ValueError(
        f"`count_items` ({_name(counter)}) counts {step:g} items in the step batch, but {kept:g} in its micro-batches"
        f" trimmed to their longest sequences: the trim cuts {step - kept:g} positions the loss scores (padding past"
        " each micro-batch's longest sequence), so the update would not be the full-batch one. Set the"
        " labels of padding to the ignore index (`labels[attention_mask == 0] = -100`; Hugging Face's"
        " `DataCollatorForLanguageModeling` does), so that neither the loss nor `count_items` scores it; to score"
        " padding on purpose, split by samples (no `sequences=`), which trims nothing."
    )


def _name(fn: Any) -> str:
    return str(getattr(fn, "__qualname__", None) or repr(fn))
