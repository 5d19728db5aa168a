"""The deal priced by the cut as `lightning_accum.sequences.balancing` made it before issue 37: the reference the faster
deal is compared against (tests/test_balancing.py: no worse on the simulation's cases). Kept verbatim but for the
docstrings: `greedy_by_price` with a share priced from scratch at every sequence, then `refine`'s rounds of moves and
swaps between heavy and light ranks, each round's candidates priced in one batch, then `_relieve_the_slowest`.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import NamedTuple

from lightning_accum.sequences.balancing import StepCost
from lightning_accum.sequences.share_prices import share_prices

SWAPS = 3
ROUNDS = 16
CLOSE_ENOUGH = 1.01
PARTNERS = 8
RELIEF_MOVES = 64
BATCHED_FROM = 256


def reference_deal(lengths: Sequence[int], parts: int, cost: StepCost) -> list[list[int]]:
    return refine(lengths, greedy_by_price(lengths, parts, cost), cost)


def greedy_by_price(lengths: Sequence[int], parts: int, cost: StepCost) -> list[list[int]]:
    if parts < 1:
        raise ValueError(f"`parts` must be at least 1, got {parts}.")
    shares: list[list[int]] = [[] for _ in range(parts)]
    cheapest = [(0.0, p) for p in range(parts)]  # a heap of (price of the share, part)
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        _, p = heapq.heappop(cheapest)
        shares[p].append(i)
        heapq.heappush(cheapest, (cost.of([lengths[j] for j in shares[p]]), p))
    return [sorted(share) for share in shares]


def refine(lengths: Sequence[int], deal: Sequence[Sequence[int]], cost: StepCost) -> list[list[int]]:
    if cost.micro_batch_tokens is None:
        return [sorted(part) for part in deal]
    price = _Prices(lengths, cost)
    shares = [list(part) for part in deal]
    loads = price.many(shares)
    for _ in range(ROUNDS):
        # Pair the ranks over the mean, heaviest first, with the lightest, lightest first: each pair one move a round.
        mean = sum(loads) / len(loads)
        by_load = sorted(range(len(shares)), key=lambda r: (-loads[r], r))
        heavy = [r for r in by_load if loads[r] > CLOSE_ENOUGH * mean]
        pairs = list(zip(heavy, reversed(by_load[len(heavy) :]), strict=False))
        moves = _best_moves([(shares[slow], shares[light], loads[slow], loads[light]) for slow, light in pairs], price)
        for (slow, light), move in zip(pairs, moves, strict=True):
            if move is not None:
                shares[slow], shares[light] = move.mine, move.theirs
                loads[slow], loads[light] = move.prices
        if not any(moves):
            break
    return _relieve_the_slowest(shares, loads, price)


def _relieve_the_slowest(shares: list[list[int]], loads: list[float], price: _Prices) -> list[list[int]]:
    for _ in range(RELIEF_MOVES):
        mean = sum(loads) / len(loads)
        order = sorted(range(len(shares)), key=lambda r: (loads[r], r))
        slow = order[-1]
        if loads[slow] <= CLOSE_ENOUGH * mean:
            break
        partners = order[: min(PARTNERS, len(order) - 1)]  # never the slowest itself
        moves = _best_moves([(shares[slow], shares[light], loads[slow], loads[light]) for light in partners], price)
        best: tuple[_Move, int] | None = None
        for move, light in zip(moves, partners, strict=True):
            if move is not None and (best is None or _after(move.prices) < _after(best[0].prices)):
                best = (move, light)
        if best is None:
            break
        move, light = best
        shares[slow], shares[light] = move.mine, move.theirs
        loads[slow], loads[light] = move.prices
    return [sorted(part) for part in shares]


class _Prices:

    def __init__(self, lengths: Sequence[int], cost: StepCost) -> None:
        self.lengths, self._cost, self._known = lengths, cost, dict[tuple[int, ...], float]()
        self._at_least_one = [max(1, int(n)) for n in lengths]  # as `StepCost.of` counts them, normalized once

    def key(self, part: Sequence[int]) -> tuple[int, ...]:
        """What a share's price depends on: its lengths (at least 1 each), longest first."""
        return tuple(sorted((self._at_least_one[i] for i in part), reverse=True))

    def many(self, parts: Sequence[Sequence[int]]) -> list[float]:
        return self.of_keys([self.key(part) for part in parts])

    def of_keys(self, keys: Sequence[tuple[int, ...]]) -> list[float]:
        unknown = list({key: None for key in keys if key not in self._known})
        if len(unknown) < BATCHED_FROM:  # a batch's tensor work costs more than it saves (the same floats either way)
            self._known.update((key, self._cost._of_ordered(key)) for key in unknown)
        else:
            prices = share_prices(
                unknown,
                budget=int(self._cost.micro_batch_tokens or 0),
                pass_cost_tokens=self._cost.pass_cost_tokens,
                quadratic=self._cost.quadratic,
            )
            self._known.update(zip(unknown, prices, strict=True))
        return [self._known[key] for key in keys]

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


class _Move(NamedTuple):

    mine: list[int]
    theirs: list[int]
    prices: tuple[float, float]


def _after(prices: tuple[float, float]) -> tuple[float, float]:
    return max(prices), prices[0] + prices[1]


_Pair = tuple[list[int], list[int], float, float]


def _best_moves(pairs: Sequence[_Pair], price: _Prices) -> list[_Move | None]:
    lengths = price.lengths
    candidates: list[tuple[int, int, int | None]] = []  # (pair, the heavy rank's sample, the light rank's or None)
    keys: list[tuple[int, ...]] = []  # each candidate's heavy share's price key
    light_keys: list[tuple[int, ...]] = []  # and its light share's
    for k, (mine, theirs, peak, their_price) in enumerate(pairs):
        target = (peak - their_price) / 2  # the tokens a move would shift to meet in the middle
        others = sorted(_one_per_length(theirs, lengths), key=lambda i: (lengths[i], i))
        mine_key, theirs_key = price.key(mine), price.key(theirs)
        for a in _one_per_length(mine, lengths):
            # Of the swaps, the ones whose length difference is nearest the target: a few, not every pair.
            near = sorted(others, key=lambda i: (abs(lengths[a] - lengths[i] - target), i))[:SWAPS]
            for b in [None, *near]:
                if (b is None and len(mine) < 2) or (b is not None and lengths[b] >= lengths[a]):
                    continue  # the slow rank keeps a sample; a longer sample in its place cannot make it cheaper
                candidates.append((k, a, b))
                keys.append(price.exchanged(mine_key, a, b))
                light_keys.append(price.exchanged(theirs_key, b, a))
    prices = price.of_keys(keys + light_keys)
    chosen: list[tuple[int, int | None, tuple[float, float]] | None] = [None] * len(pairs)
    for (k, a, b), left_price, right_price in zip(candidates, prices[: len(keys)], prices[len(keys) :], strict=True):
        after, best = _after((left_price, right_price)), chosen[k]
        if after[0] < pairs[k][2] * (1 - 1e-12) and (best is None or after < _after(best[2])):
            chosen[k] = (a, b, (left_price, right_price))
    moves: list[_Move | None] = []
    for (mine, theirs, _, _), best in zip(pairs, chosen, strict=True):
        if best is None:
            moves.append(None)
            continue
        a, b, pair_prices = best
        left = [i for i in mine if i != a] + ([] if b is None else [b])
        moves.append(_Move(left, [i for i in theirs if i != b] + [a], pair_prices))
    return moves


def _one_per_length(part: Sequence[int], lengths: Sequence[int]) -> list[int]:
    # Two samples of one length make the same candidates: try the first of each.
    seen: dict[int, int] = {}
    for i in part:
        seen.setdefault(lengths[i], i)
    return list(seen.values())


