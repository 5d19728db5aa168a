"""The deal priced by the cut: each rank a run of neighbouring lengths, then the slowest rank relieved. Pure.

Split by tokens cuts a rank's share into micro-batches of sequences of similar length (`token_cut.cut_groups`); a share
that holds one sequence of each length range (what a deal that mixes lengths gives every rank) is cut into many
micro-batches, each a pass and each padded to its longest. A share of neighbouring lengths pads almost nothing and
fills a micro-batch or two. So the deal gives each rank a *run*: the step batch sorted by length, cut into one run per
rank, the run ends placed where the dearest run is cheapest (`deal_by_runs`). A rank then holds two sequences of 1200
tokens, or forty of 60: what the step costs is the price of the dearest rank's cut, and every rank's cut is cheap.

- The run ends: a binary search on the largest price, each run priced as micro-batches of its longest sequence's rows
  within the budget (a bound on its real cut's price), scanned in ``O(ranks)`` a probe.
- Then each rank's price is its real cut's (`StepCost.of`), and the slowest rank is relieved: a move or swap of one of
  its samples with one of the `PARTNERS` lightest ranks, the one that leaves the pair's dearer share cheapest, while
  it lowers the slowest, for at most `RELIEF_MOVES` moves and `STALL` in a row that leave the dearest price where it
  was.

On the deal-cost benchmark's cases at 64 to 4096 ranks, this deal's slowest rank is 6-13% cheaper than the one of
the deal that mixes lengths (`lightning_accum.sequences.balancing.refine`: each rank one sequence of each range, 16
rounds of moves and swaps), in a tenth of its time or less; for small step batches, where that deal searches further
and is cheap, `lightning_accum.sequences.balancing.deal` makes both and keeps the cheaper. The runs' ranks are
further from their mean (1.02-1.15): some ranks cannot take another long sequence under the dearest price, and wait.
The deal counts on the price: a share of long sequences is dearer in attention (the price's ``quadratic`` term) than
one of short ones; with the term unset, their ranks run slower than priced (see docs/language-models.md).

``cost`` is a `lightning_accum.sequences.balancing.StepCost` that knows the passes (any object with its fields and
``_of_ordered``: `lightning_accum.sequences.share_moves.Pricing`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from lightning_accum.sequences.share_moves import Pricing, SharePrices, one_per_length, relieve_the_slowest

SEARCH_TOLERANCE = 1e-3
"""The binary search on the dearest run's price stops within this fraction of it (the relief finishes the job)."""

PARTNERS = 4
"""The relief tries moves from the slowest rank to this many of the lightest."""

RELIEF_MOVES = 64
"""The relief makes at most this many moves."""

STALL = 4
"""The relief stops after this many moves in a row that leave the dearest price where it was (many ranks at it)."""


def deal_by_runs(lengths: Sequence[int], parts: int, cost: Pricing) -> list[list[int]]:
    """Positions of ``lengths`` dealt into ``parts`` runs of neighbouring lengths, the dearest as cheap as found.

    Deterministic (ties go to the lower position and rank): every rank computes the same deal. Every part holds a
    sample when there are at least ``parts``; each part ascending.

    Example:
        >>> from lightning_accum.sequences import StepCost
        >>> cost = StepCost(micro_batch_tokens=400, pass_cost_tokens=20)
        >>> deal_by_runs([100, 10, 90, 12, 11, 95], 2, cost)  # 95 and 90 in one pass; 100 in one, 12, 11, 10 in one
        [[2, 5], [0, 1, 3, 4]]
        >>> cost.of([95, 90]), cost.of([100, 12, 11, 10])
        (210.0, 176.0)
    """
    if parts < 1:
        raise ValueError(f"`parts` must be at least 1, got {parts}.")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    ordered = [max(1, int(lengths[i])) for i in order]  # as `StepCost.of` counts them
    starts = _run_starts(ordered, parts, cost)
    runs = [order[start:stop] for start, stop in zip(starts, [*starts[1:], len(order)], strict=True)]
    while len(runs) < min(parts, len(order)):  # fewer runs than ranks: the longest run in two
        longest = max(range(len(runs)), key=lambda r: (len(runs[r]), -r))
        run = runs[longest]
        runs[longest : longest + 1] = [run[: len(run) // 2], run[len(run) // 2 :]]
    runs += [[] for _ in range(parts - len(runs))]
    price = SharePrices(lengths, cost)
    loads = price.many(runs)
    return relieve_the_slowest(runs, loads, price, partners=PARTNERS, moves=RELIEF_MOVES, stall=STALL, givers=_givers)


def _run_starts(ordered: list[int], parts: int, cost: Pricing) -> list[int]:
    """Where each run starts in ``ordered`` (longest first): at most ``parts`` runs, the dearest's bound least."""
    if not ordered:
        return []
    lower = cost.pass_cost_tokens + _row(ordered[0], cost)  # the run of the longest sequence costs it alone at least
    upper = 2 * lower
    while (starts := _scan(ordered, upper, parts, cost)) is None:
        upper *= 2
    while upper - lower > SEARCH_TOLERANCE * upper:
        middle = (lower + upper) / 2
        found = _scan(ordered, middle, parts, cost)
        if found is None:
            lower = middle
        else:
            upper, starts = middle, found
    return starts


def _scan(ordered: list[int], cap: float, parts: int, cost: Pricing) -> list[int] | None:
    """Each run as long as its bound stays within ``cap``; ``None`` where that takes more than ``parts`` runs."""
    starts, start = list[int](), 0
    while start < len(ordered):
        if len(starts) == parts:
            return None
        starts.append(start)
        start = _run_end(ordered, start, cap, cost)
    return starts


def _run_end(ordered: list[int], start: int, cap: float, cost: Pricing) -> int:
    """The end of the run from ``start`` whose bound stays within ``cap`` (one sequence at least).

    The bound prices the run as micro-batches of as many rows of the longest sequence as the budget holds, each
    padded to its first (longest) sequence: a cut the real one costs no more than by the cut's own measure.
    """
    budget, pass_cost = int(cost.micro_batch_tokens or 0), cost.pass_cost_tokens
    total, end = 0.0, start
    while end < len(ordered):
        longest = ordered[end]
        per_row = _row(longest, cost)
        fits = max(1, budget // longest)  # rows of this length in one micro-batch
        room = cap - total - pass_cost
        rows = min(len(ordered) - end, fits, math.floor(room / per_row) if room > 0 else 0)
        if rows < 1:
            break
        total += pass_cost + rows * per_row
        end += rows
        if rows < fits:
            break  # the cap stopped this micro-batch short: the run ends here
    return max(end, start + 1)


def _row(length: int, cost: Pricing) -> float:
    """What one row of ``length`` tokens adds to a micro-batch's price: its tokens and attention's term."""
    return length + (length * length / cost.quadratic if cost.quadratic is not None else 0.0)


def _givers(mine: list[int], lengths: Sequence[int], target: float) -> list[int]:
    """`share_moves.Givers`: a run's longest sample, its shortest, and the one nearest ``target`` tokens.

    A run's lengths are close together, so its samples make much the same moves: three, not one of each length (a
    run of forty short sequences made the relief 6x dearer, for moves no better).
    """
    ordered = sorted(one_per_length(mine, lengths), key=lambda i: (lengths[i], i))
    nearest = min(ordered, key=lambda i: (abs(lengths[i] - target), i))
    return list(dict.fromkeys((ordered[0], ordered[-1], nearest)))
