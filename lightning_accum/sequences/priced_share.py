"""A rank's share priced by its cut as sequences join it, longest first: `PricedShare`, the mixed deal's ledger. Pure.

`lightning_accum.sequences.balancing.greedy_by_price` prices a share every time a sequence joins it (thousands a
step on hundreds of ranks). Cut from scratch (`token_cut.cut_groups`, from the shortest sequence back) each price is a
new shortest path over the whole share. Here the same shortest path runs the other way, from the longest sequence on:
the cheapest cut of each prefix of the share (longest first) is kept, so a sequence that joins last (the deal hands
them out longest first) costs one step over the window it can share a micro-batch with.

Both directions find a cheapest cut (the same cut cost, ``budget // MICRO_BATCH_COST`` per micro-batch plus its padded
tokens). Where the cheapest cut is unique, they find the same cut, and the price (`StepCost.of`'s: a pass cost plus
padded tokens per micro-batch, and the quadratic term) is summed in `StepCost.of`'s order: the same float to the bit.
Where two cuts tie, `cut_groups` takes the furthest stop, which a prefix cannot know: such a share is priced by
``exact`` (`StepCost.of` itself). Every rank must deal alike, so this matters: tests/test_balancing.py checks that the
prices equal `StepCost.of`'s exactly, ties included.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from lightning_accum.sequences.token_cut import MICRO_BATCH_COST


class PricedShare:
    """One rank's share of a step batch, longest first, with the cut's cost and price of each of its prefixes.

    Attributes:
        lengths: the share's lengths (each at least 1), longest first.
        members: the samples (positions in the step batch), in the same order.
    """

    __slots__ = ("_cut", "_exact", "_known", "_low", "_price", "_rule", "_unique", "lengths", "members")

    def __init__(self, rule: _CutRule, exact: Callable[[Sequence[int]], float]) -> None:
        self._rule, self._exact = rule, exact
        self.lengths: list[int] = []
        self.members: list[int] = []
        self._cut = [0]  # the cheapest cut's cost of the first e lengths, for e = 0..n
        self._price = [0.0]  # that cut's price (pass costs, padded tokens, quadratic term), summed group by group
        self._unique = [True]  # whether that cheapest cut is the only one (else `exact` prices the share)
        self._low = [0]  # the first position its last micro-batch can start at, of the cheapest cuts
        self._known: float | None = None  # `exact`'s price of the share as it is, where the cut is not unique

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def price(self) -> float:
        """`StepCost.of` of the share's lengths, to the bit."""
        if self._unique[-1]:
            return self._price[-1]
        if self._known is None:
            self._known = self._exact(self.lengths)
        return self._known

    def append(self, member: int, length: int) -> None:
        """Add a sequence no longer than any in the share (the deal hands them out longest first)."""
        self.lengths.append(length)
        self.members.append(member)
        self._known = None
        self._rule.extend(self.lengths, self._cut, self._price, self._unique, self._low, len(self.lengths) - 1)


class _CutRule:
    """The cut's and the price's arithmetic, `token_cut.cut_groups`' and `StepCost._of_ordered`'s, one prefix on."""

    __slots__ = ("budget", "overhead", "pass_cost", "quadratic")

    def __init__(self, budget: int, pass_cost: float, quadratic: float | None) -> None:
        self.budget, self.overhead = budget, budget // MICRO_BATCH_COST
        self.pass_cost, self.quadratic = pass_cost, quadratic

    def extend(
        self, lengths: list[int], cut: list[int], price: list[float], unique: list[bool], low: list[int], first: int
    ) -> None:
        """Extend the prefixes' entries (known up to ``first`` lengths) to the whole of ``lengths``.

        For each longer prefix: the cheapest cut's cost (``cut``), its price, whether it is the only cheapest, and the
        first start of its cheapest last micro-batch (``low``), within the budget.

        The cut's cost satisfies the quadrangle inequality (lengths longest first), so no start before ``low`` of the
        prefix one shorter (the first of its cheapest last starts) is as cheap: the scan stops there, ties included.
        """
        budget, overhead, pass_cost, quadratic = self.budget, self.overhead, self.pass_cost, self.quadratic
        for end in range(first + 1, len(lengths) + 1):
            start, best, ties = end - 1, -1, 0
            chosen = floor = start
            stop = low[end - 1]
            while start >= stop:
                longest, rows = lengths[start], end - start
                if rows > 1 and rows * longest > budget:  # longer starts hold longer sequences: none fits further
                    break
                here = cut[start] + overhead + rows * longest
                if best < 0 or here < best:
                    best, chosen, floor, ties = here, start, start, 0
                elif here == best:
                    floor, ties = start, ties + 1
                start -= 1
            longest, rows = lengths[chosen], end - chosen
            total = price[chosen] + (pass_cost + rows * longest)  # `StepCost._of_ordered`'s order, group by group
            if quadratic is not None:
                total += rows * longest * longest / quadratic
            cut.append(best)
            price.append(total)
            unique.append(ties == 0 and unique[chosen])
            low.append(floor)


def new_shares(
    parts: int, budget: int, pass_cost: float, quadratic: float | None, exact: Callable[[Sequence[int]], float]
) -> list[PricedShare]:
    """``parts`` empty shares, priced by one rule."""
    rule = _CutRule(budget, pass_cost, quadratic)
    return [PricedShare(rule, exact) for _ in range(parts)]
