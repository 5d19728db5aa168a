"""Moves and swaps of samples between two ranks' shares, each priced by its real cut: the deals' shared relief. Pure.

Both deals priced by the cut (`lightning_accum.sequences.balancing.refine`, the deal that mixes lengths, and
`lightning_accum.sequences.run_deal`, the deal by runs) improve a deal the same way: one of the slowest rank's
samples given to a lighter rank, or traded for a shorter one of theirs, priced as split by tokens would cut each share
(`StepCost.of`): `best_moves` finds the best such move for each pair of ranks, `relieve_the_slowest` repeats it from
the slowest rank. ``cost`` is a `lightning_accum.sequences.balancing.StepCost` that knows the passes (any object with
its fields and ``_of_ordered``: `Pricing`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

SWAPS = 3
"""For each sample a move may give, it tries swaps with this many of the partner's, the nearest in length to what would
meet in the middle."""


class Pricing(Protocol):
    """What the moves read of a `lightning_accum.sequences.balancing.StepCost`."""

    @property
    def micro_batch_tokens(self) -> int | None: ...
    @property
    def pass_cost_tokens(self) -> float: ...
    @property
    def quadratic(self) -> float | None: ...
    def _of_ordered(self, ordered: Sequence[int]) -> float: ...


class SharePrices:
    """``cost.of`` of shares (positions into ``lengths``), kept by their sorted lengths (a retried share is known)."""

    def __init__(self, lengths: Sequence[int], cost: Pricing) -> None:
        self.lengths, self._cost, self._known = lengths, cost, dict[tuple[int, ...], float]()
        self._at_least_one = [max(1, int(n)) for n in lengths]  # as `StepCost.of` counts them, normalized once

    def key(self, part: Sequence[int]) -> tuple[int, ...]:
        """What a share's price depends on: its lengths (at least 1 each), longest first."""
        return tuple(sorted((self._at_least_one[i] for i in part), reverse=True))

    def of(self, part: Sequence[int]) -> float:
        return self.of_key(self.key(part))

    def many(self, parts: Sequence[Sequence[int]]) -> list[float]:
        return [self.of(part) for part in parts]

    def of_key(self, key: tuple[int, ...]) -> float:
        known = self._known.get(key)
        if known is None:
            known = self._known[key] = self._cost._of_ordered(key)
        return known

    def exchanged(self, key: tuple[int, ...], out: int | None, into: int | None) -> tuple[int, ...]:
        """``key`` with sample ``out``'s length taken out and ``into``'s put in, in order: a move's, unbuilt."""
        rest = list(key)
        if out is not None:
            rest.remove(self._at_least_one[out])
        if into is not None:
            length, at = self._at_least_one[into], 0
            while at < len(rest) and rest[at] >= length:
                at += 1
            rest.insert(at, length)
        return tuple(rest)


class Move(NamedTuple):
    """Two ranks' shares after a move, and their prices."""

    mine: list[int]
    theirs: list[int]
    prices: tuple[float, float]


def move_score(prices: tuple[float, float]) -> tuple[float, float]:
    """How good a move is: the dearer share's price after it, then the pair's sum (less is better)."""
    return max(prices), prices[0] + prices[1]


Pair = tuple[list[int], list[int], float, float]
"""A heavy rank's share and a light one's, and their prices."""

Givers = Callable[[list[int], Sequence[int], float], list[int]]
"""Which of a heavy share's samples a move tries to give, from the lengths and the tokens that would meet halfway."""


def every_length(mine: list[int], lengths: Sequence[int], target: float) -> list[int]:
    """`Givers`: one sample of each length (two of one length make the same moves)."""
    return one_per_length(mine, lengths)


def best_moves(pairs: Sequence[Pair], price: SharePrices, givers: Givers = every_length) -> list[Move | None]:
    """For each pair, the best move between them, or None if no move makes the heavy rank cheaper.

    The move of one of the heavy rank's samples (those ``givers`` names) to the light one, or swap for a shorter one of
    theirs (the `SWAPS` whose length difference is nearest to meeting in the middle), that leaves the pair's dearer
    share cheapest (then their sum), if it is below the heavy rank's price.
    """
    lengths = price.lengths
    moves: list[Move | None] = []
    for mine, theirs, peak, their_price in pairs:
        target = (peak - their_price) / 2  # the tokens a move would shift to meet in the middle
        others = sorted(one_per_length(theirs, lengths), key=lambda i: (lengths[i], i))
        mine_key, theirs_key = price.key(mine), price.key(theirs)
        best: tuple[tuple[float, float], int, int | None, tuple[float, float]] | None = None
        for a in givers(mine, lengths, target):
            near = sorted(others, key=lambda i: (abs(lengths[a] - lengths[i] - target), i))[:SWAPS]
            for b in [None, *near]:
                if (b is None and len(mine) < 2) or (b is not None and lengths[b] >= lengths[a]):
                    continue  # the slow rank keeps a sample; a longer sample in its place cannot make it cheaper
                after = (price.of_key(price.exchanged(mine_key, a, b)), price.of_key(price.exchanged(theirs_key, b, a)))
                score = move_score(after)
                if score[0] < peak * (1 - 1e-12) and (best is None or score < best[0]):
                    best = (score, a, b, after)
        if best is None:
            moves.append(None)
            continue
        _, a, b, after = best
        left = [i for i in mine if i != a] + ([] if b is None else [b])
        moves.append(Move(left, [i for i in theirs if i != b] + [a], after))
    return moves


def relieve_the_slowest(
    shares: list[list[int]],
    loads: list[float],
    price: SharePrices,
    *,
    partners: int,
    moves: int,
    until: float = 0.0,
    stall: int | None = None,
    givers: Givers = every_length,
) -> list[list[int]]:
    """The slowest rank's share made cheaper, one move at a time; each part returned ascending.

    Each move is the best of `best_moves` between the slowest rank and each of the ``partners`` lightest (the one that
    leaves the pair's dearer share cheapest). It stops when no move lowers the slowest rank, after ``moves`` moves,
    once the slowest rank is within ``until`` times the mean, or after ``stall`` moves in a row that leave the dearest
    price where it was (many ranks at it). ``shares`` and ``loads`` (their prices) are changed in place.
    """
    dearest, stalled = max(loads, default=0.0), 0
    for _ in range(moves if len(shares) > 1 else 0):
        order = sorted(range(len(shares)), key=lambda r: (loads[r], r))
        slow = order[-1]
        if loads[slow] <= until * sum(loads) / len(loads):
            break
        lightest = order[: min(partners, len(order) - 1)]  # never the slowest itself
        found = best_moves(
            [(shares[slow], shares[light], loads[slow], loads[light]) for light in lightest], price, givers
        )
        best: tuple[Move, int] | None = None
        for move, light in zip(found, lightest, strict=True):
            if move is not None and (best is None or move_score(move.prices) < move_score(best[0].prices)):
                best = (move, light)
        if best is None:
            break
        move, light = best
        shares[slow], shares[light] = move.mine, move.theirs
        loads[slow], loads[light] = move.prices
        now = max(loads)
        stalled = 0 if now < dearest * (1 - 1e-12) else stalled + 1
        dearest = min(dearest, now)
        if stall is not None and stalled >= stall:
            break
    return [sorted(part) for part in shares]


def one_per_length(part: Sequence[int], lengths: Sequence[int]) -> list[int]:
    """One sample of each length in ``part`` (the first): two of one length make the same candidates."""
    seen: dict[int, int] = {}
    for i in part:
        seen.setdefault(lengths[i], i)
    return list(seen.values())
