"""Dealing a step's global batch to the ranks by cost: the partition arithmetic behind `BalancedBatchSampler`. Pure.

Under DDP and FSDP2 every rank waits at the step's gradient sync for the slowest one. Dealt at random (as
``DistributedSampler`` deals), the ranks' step batches of variable-length sequences are far apart in cost: one rank
draws the long sequences. Split mode is exact when ranks hold different numbers of samples (the update is the token
mean over the whole global batch), so the global batch can be dealt by cost instead, and the update does not change.

Every function here is a function of its arguments alone: every rank computes the same deal from the same seed and
lengths, with no communication.

- `global_batches`: an epoch's step batches of global sample indices, from a seeded permutation. They do not depend
  on the number of ranks.
- `sample_costs`: what a sample adds to its rank's step (its tokens, and attention's quadratic term if asked).
- `partition`: a step batch cut into one part per rank, the most loaded part as close to the mean as the costs allow
  (Karmarkar-Karp's largest differencing, or greedy longest-first to the lightest part).
- `StepCost`: what a rank's step costs under split by tokens: its micro-batches' padded tokens, and a fixed cost per
  pass (``pass_cost_tokens``, in tokens) for each micro-batch the cut at ``micro_batch_tokens`` makes.
- `deal`: by the real cut, `greedy_by_price` (longest first to the rank whose priced share is cheapest), then
  `refine`: samples moved and swapped between the slowest rank and the lightest ones, each rank's share priced by
  its real cut (`StepCost.of`), while the slowest rank gets cheaper, then the slowest alone relieved move by move;
  by tokens alone, `partition`.
- `imbalance`: the slowest rank's cost over the mean rank's.

Examples:
    >>> partition([9, 7, 6, 5, 5, 4], 2)  # the indices of each part: 18 and 18
    [[0, 3, 5], [1, 2, 4]]
    >>> imbalance([18, 18]), imbalance([20, 16])
    (1.0, 1.1111111111111112)
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from lightning_accum.sequences.priced_share import new_shares
from lightning_accum.sequences.run_deal import deal_by_runs
from lightning_accum.sequences.share_moves import SharePrices, best_moves, relieve_the_slowest
from lightning_accum.sequences.token_cut import cut_price

Method = Literal["best", "karmarkar-karp", "greedy"]
METHODS: tuple[Method, ...] = ("best", "karmarkar-karp", "greedy")

PASS_COST_TOKENS = 112.0
"""A micro-batch pass's fixed cost in tokens (what a pass costs beyond its tokens' compute), measured on this machine's
CPU: ``examples/benchmarks/rank_balance.py`` fits a pass's CPU seconds as ``a + b * padded_tokens + c * rows *
length ** 2`` on its small causal LM, and ``a / b`` came to 112.6 and 112.5 tokens in two of three fits (273 in the
third, whose quadratic term took part of the tokens' share). On a GPU a pass's fixed cost (kernel launches, a small
micro-batch's lower efficiency) is larger in tokens: measure it on your model with
`lightning_accum.sequences.pass_timing.measure_step_cost`."""

KARMARKAR_KARP_MAX = 1 << 16
"""``"best"`` runs Karmarkar-Karp only when samples x parts is at most this (4096 samples on 512 ranks took 6.7 s on
this machine's CPU; greedy 0.01 s), greedy alone above it."""

ROUNDS = 16
"""`refine` makes at most this many rounds of moves (each pairs every rank over the mean with a light one)."""

CLOSE_ENOUGH = 1.01
"""`refine` moves samples off the ranks over this factor of the mean (1%: inside timing noise); none over it: done."""

PARTNERS = 8
"""`refine`'s relief of the slowest rank tries moves to this many of the lightest."""

RELIEF_MOVES = 64
"""`refine`'s relief of the slowest rank makes at most this many moves (it stops sooner, at `CLOSE_ENOUGH`)."""

BOTH_UP_TO = 64
"""`deal` also makes the deal that mixes lengths (`greedy_by_price`, `refine`) for a step batch of up to this many
samples, and keeps the one whose slowest rank is cheaper (see `deal`); above, the deal by runs alone."""


def global_batches(size: int, batch_size: int, *, seed: int, epoch: int, drop_last: bool) -> list[list[int]]:
    """The epoch's step batches of ``batch_size`` global sample indices, in the order they are trained on.

    The indices come from ``torch.randperm(size)`` seeded with ``seed + epoch``, as ``DistributedSampler(shuffle=True)``
    draws them, and are cut in order: step ``s`` holds positions ``s * batch_size`` to ``(s + 1) * batch_size``. The
    number of ranks plays no part, so a run on 2 ranks and one on 4 train on the same global batches. The last,
    incomplete step batch is dropped under ``drop_last`` and kept otherwise.

    Examples:
        >>> [len(b) for b in global_batches(10, 4, seed=0, epoch=0, drop_last=False)]
        [4, 4, 2]
        >>> sorted(sum(global_batches(10, 4, seed=0, epoch=0, drop_last=True), []))  # 8 of the 10, each once
        [0, 1, 3, 4, 5, 7, 8, 9]
    """
    generator = torch.Generator().manual_seed(seed + epoch)
    order = torch.randperm(size, generator=generator).tolist()
    batches = [order[start : start + batch_size] for start in range(0, size, batch_size)]
    if batches and drop_last and len(batches[-1]) < batch_size:
        batches.pop()
    return batches


def sample_costs(lengths: Sequence[int], quadratic: float | None = None) -> list[float]:
    """Each sample's cost: its tokens, plus ``length ** 2 / quadratic`` when attention's quadratic term matters.

    ``quadratic`` is the length at which a token's share of attention costs as much as the rest of its layer (about
    ``6 * hidden_size`` for a transformer block: its attention scores against its projections and MLP); ``None``
    counts tokens alone, which is what a short-context step costs.
    """
    if quadratic is None:
        return [float(max(1, n)) for n in lengths]
    return [max(1, n) + n * n / quadratic for n in lengths]


def partition(costs: Sequence[float], parts: int, method: Method = "best") -> list[list[int]]:
    """Positions of ``costs`` dealt into ``parts`` parts whose largest total is as close to the mean as it can be.

    ``"karmarkar-karp"`` is the largest differencing method (Karmarkar and Karp, 1982; verl deals its batches so):
    every sample starts as a partial deal of its own, and the two partial deals whose largest and smallest parts are
    furthest apart merge, largest part with smallest. ``"greedy"`` gives each sample, longest first, to the lightest
    part. ``"best"`` runs both and keeps the deal whose largest part is smaller (Karmarkar-Karp's on a tie): on
    log-normal lengths Karmarkar-Karp is closer to the mean at 8 or more samples a part, greedy at 4 (where one long
    sequence often outweighs the mean, and the deal cannot do better than the longest sequence alone). All are
    deterministic (ties go to the lower position), and every part holds at least one sample when there are at least
    ``parts`` of them. Each part is returned in ascending order.

    Raises:
        ValueError: ``parts < 1`` or an unknown ``method``.
    """
    if parts < 1:
        raise ValueError(f"`parts` must be at least 1, got {parts}.")
    if method not in METHODS:
        raise ValueError(f"`method` must be one of {METHODS}, got {method!r}.")
    deals = []
    runs = ("karmarkar-karp", "greedy") if method == "best" else (method,)
    if method == "best" and len(costs) * parts > KARMARKAR_KARP_MAX:
        runs = ("greedy",)  # Karmarkar-Karp merges `parts`-long deals n times: seconds at 4096 samples on 512 ranks
    for run in runs:
        deal = _greedy(costs, parts) if run == "greedy" else _karmarkar_karp(costs, parts)
        _fill_empty(deal, costs)
        deals.append(deal)
    best = min(deals, key=lambda deal: max(sum(costs[i] for i in part) for part in deal))
    return [sorted(part) for part in best]


def _greedy(costs: Sequence[float], parts: int) -> list[list[int]]:
    deal: list[list[int]] = [[] for _ in range(parts)]
    lightest = [(0.0, p) for p in range(parts)]  # a heap of (load, part)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, p = heapq.heappop(lightest)
        deal[p].append(i)
        heapq.heappush(lightest, (load + costs[i], p))
    return deal


def _karmarkar_karp(costs: Sequence[float], parts: int) -> list[list[int]]:
    # A heap of partial deals, by the spread of their loads (largest first); each deal's parts sorted heaviest first.
    heap: list[tuple[float, int, list[tuple[float, list[int]]]]] = []
    for i, cost in enumerate(costs):
        deal = [(float(cost), [i])] + [(0.0, []) for _ in range(parts - 1)]
        heapq.heappush(heap, (-float(cost), i, deal))
    while len(heap) > 1:
        _, first, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = [(la + lb, pa + pb) for (la, pa), (lb, pb) in zip(a, reversed(b), strict=True)]
        merged.sort(key=lambda part: -part[0])
        heapq.heappush(heap, (merged[-1][0] - merged[0][0], first, merged))
    if not heap:
        return [[] for _ in range(parts)]
    return [part for _, part in heap[0][2]]


def _fill_empty(deal: list[list[int]], costs: Sequence[float]) -> None:
    # A rank with no sample would have nothing to run: move the cheapest sample of the fullest part to it.
    for empty in [part for part in deal if not part]:
        donor = max(deal, key=len)
        if len(donor) < 2:
            return
        cheapest = min(donor, key=lambda i: (costs[i], -i))
        donor.remove(cheapest)
        empty.append(cheapest)


@dataclass(frozen=True)
class StepCost:
    """What a rank's step costs under split by tokens, in tokens: its cut's passes, each a fixed cost plus its tokens.

    For each micro-batch its cut makes: the pass's fixed cost plus its padded tokens (plus attention's quadratic term).

    Split by tokens cuts a rank's step batch longest first into micro-batches of at most ``micro_batch_tokens`` padded
    tokens (`lightning_accum.sequences.token_cut.cut_groups`, the cut `TokenCut.groups` makes). Each is a forward and
    backward pass with a fixed cost beyond its tokens, so two ranks with the same tokens but a different number of
    passes do not cost the same: dealing by tokens alone leaves the pass counts unequal (on this machine's benchmark,
    tokens balanced to 1.008, compute to 1.04-1.08).

    Attributes:
        micro_batch_tokens: the micro-batch token budget split by tokens cuts at (`AutoMicroBatching`'s
            ``micro_batch_tokens``); ``None`` prices a step by its tokens alone (the passes unknown).
        pass_cost_tokens: a pass's fixed cost in tokens (`PASS_COST_TOKENS`, measured on this machine, by default).
        quadratic: count ``length ** 2 / quadratic`` more per row for attention (see `sample_costs`); ``None``: no
            quadratic term.

    Example:
        >>> StepCost(micro_batch_tokens=8, pass_cost_tokens=10).of([9, 4, 4, 3, 1])  # [9] [4, 4] [3] [1]: 4 passes
        61.0
    """

    micro_batch_tokens: int | None = None
    pass_cost_tokens: float = PASS_COST_TOKENS
    quadratic: float | None = None

    def __post_init__(self) -> None:
        if self.micro_batch_tokens is not None and int(self.micro_batch_tokens) < 1:
            raise ValueError(
                f"`micro_batch_tokens` must be at least 1, got {self.micro_batch_tokens}. Pass the token budget split"
                " by tokens cuts at (AutoMicroBatching's `micro_batch_tokens`), or None to price steps by tokens."
            )
        if self.pass_cost_tokens < 0:
            raise ValueError(
                f"`pass_cost_tokens` must be non-negative, got {self.pass_cost_tokens}. It is a micro-batch pass's"
                f" fixed cost in tokens ({PASS_COST_TOKENS:g} measured on a CPU)."
            )

    @property
    def knows_passes(self) -> bool:
        """Whether the cost counts the passes (a budget is known), so a deal by tokens is worth refining."""
        return self.micro_batch_tokens is not None

    def of(self, lengths: Sequence[int]) -> float:
        """A rank's step cost for a step batch of sequences of ``lengths``."""
        if self.micro_batch_tokens is None:
            return float(sum(sample_costs(lengths, self.quadratic)))
        return self._of_ordered(sorted((max(1, int(n)) for n in lengths), reverse=True))

    def _of_ordered(self, ordered: Sequence[int]) -> float:
        # `of` for lengths already at least 1 and longest first, under a budget (the refinement's many prices).
        return cut_price(ordered, int(self.micro_batch_tokens or 0), self.pass_cost_tokens, self.quadratic)


def deal(lengths: Sequence[int], parts: int, method: Method = "best", cost: StepCost | None = None) -> list[list[int]]:
    """Positions of ``lengths`` dealt into ``parts`` ranks, the slowest rank's step (by ``cost``) as cheap as found.

    When ``cost`` knows the passes: the deal by runs (`lightning_accum.sequences.run_deal.deal_by_runs`: each rank a
    run of neighbouring lengths, which pads little and shares passes, the slowest rank then relieved). For a step batch
    of up to `BOTH_UP_TO` samples, also the deal that mixes lengths (`greedy_by_price`, then `refine`), which searches
    more (a few ms there, seconds at thousands of samples), and the one whose slowest rank is cheaper (then whose
    total is), runs on a tie. Otherwise `partition` by each sample's tokens with ``method``. Each part ascending; every
    part holds a sample when there are at least ``parts``.

    What a step costs is its slowest rank. On 480 simulated step batches (2 to 64 ranks, 2 to 16 sequences a rank,
    four prices), the runs' slowest rank was 2% cheaper than the mixed deal's at the median, and up to 17% dearer in
    47 of them, all at 64 samples or fewer but 4 (at most 6% dearer): hence both there. On the deal-cost benchmark's
    cases at 64 to 4096 ranks, 6-13% cheaper, in a tenth of the time or less.
    """
    cost = cost or StepCost()
    if not cost.knows_passes:
        return partition(sample_costs(lengths, cost.quadratic), parts, method)
    runs = deal_by_runs(lengths, parts, cost)
    if len(lengths) > BOTH_UP_TO:
        return runs
    mixed = refine(lengths, greedy_by_price(lengths, parts, cost), cost)
    price = SharePrices(lengths, cost)
    (runs_prices, mixed_prices) = (price.many(runs), price.many(mixed))
    runs_first = (max(runs_prices, default=0.0), sum(runs_prices)) <= (
        max(mixed_prices, default=0.0),
        sum(mixed_prices),
    )
    return runs if runs_first else mixed


def greedy_by_price(lengths: Sequence[int], parts: int, cost: StepCost) -> list[list[int]]:
    """Each sample, longest first, to the part whose share is cheapest by ``cost`` (its real cut): a pass counted.

    Deterministic: ties go to the lower part. Every part gets a sample before any gets a second (an empty share
    costs nothing). Parts ascending. Each share is priced as it grows (`lightning_accum.sequences.priced_share`): a
    sequence that joins it costs one step of the cut, not a new cut, at the same price to the bit.

    Example:
        >>> greedy_by_price([8, 8, 8, 8, 8, 8], 2, StepCost(micro_batch_tokens=16, pass_cost_tokens=8))
        [[0, 2, 4], [1, 3, 5]]
    """
    if parts < 1:
        raise ValueError(f"`parts` must be at least 1, got {parts}.")
    budget = int(cost.micro_batch_tokens or 0)
    shares = new_shares(parts, budget, cost.pass_cost_tokens, cost.quadratic, cost._of_ordered)
    at_least_one = [max(1, int(n)) for n in lengths]  # as `StepCost.of` counts them
    cheapest = [(0.0, p) for p in range(parts)]  # a heap of (price of the share, part)
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        _, p = heapq.heappop(cheapest)
        share = shares[p]
        share.append(i, at_least_one[i])  # the shortest yet: one step of the cut from its prefix's, not a new cut
        heapq.heappush(cheapest, (share.price, p))
    return [sorted(share.members) for share in shares]


def refine(lengths: Sequence[int], deal: Sequence[Sequence[int]], cost: StepCost) -> list[list[int]]:
    """``deal`` improved by moves and swaps of samples between heavy and light ranks, each priced by its real cut.

    Each round pairs the ranks over `CLOSE_ENOUGH` times the mean (by `StepCost.of` on their share), heaviest first,
    with the lightest ranks, lightest first; where a heavy rank can be made cheaper by giving one of its samples to
    its partner, or trading one for a shorter one of theirs (the `SWAPS` nearest in length to meeting in the middle),
    without the partner going over the heavy rank's cost before, the move that leaves the pair's dearer share
    cheapest is made. Rounds go on while a move is made, for at most `ROUNDS`. Then the slowest rank alone is relieved,
    one move at a time, while it stands over `CLOSE_ENOUGH` times the mean (`share_moves.relieve_the_slowest`).

    A deal by tokens balances the tokens, not the passes: a rank whose share cuts into one more micro-batch pays one
    more pass's fixed cost, and its padding depends on which lengths share a micro-batch. Pricing each candidate by
    its real cut fixes both. Deterministic (ties go to the lower rank and position); no move makes the slowest
    rank dearer. Each part is returned ascending.

    Example:
        >>> cost = StepCost(micro_batch_tokens=16, pass_cost_tokens=8)
        >>> refine([8, 8, 8, 8, 8, 8], [[0, 1, 2, 3], [4, 5]], cost)  # 2 passes against 1: 48 and 24 become 40 and 40
        [[1, 2, 3], [0, 4, 5]]
    """
    if cost.micro_batch_tokens is None:
        return [sorted(part) for part in deal]
    price = SharePrices(lengths, cost)
    shares = [list(part) for part in deal]
    loads = price.many(shares)
    for _ in range(ROUNDS):
        # Pair the ranks over the mean, heaviest first, with the lightest, lightest first: each pair one move a round.
        mean = sum(loads) / len(loads)
        by_load = sorted(range(len(shares)), key=lambda r: (-loads[r], r))
        heavy = [r for r in by_load if loads[r] > CLOSE_ENOUGH * mean]
        pairs = list(zip(heavy, reversed(by_load[len(heavy) :]), strict=False))
        moves = best_moves([(shares[slow], shares[light], loads[slow], loads[light]) for slow, light in pairs], price)
        for (slow, light), move in zip(pairs, moves, strict=True):
            if move is not None:
                shares[slow], shares[light] = move.mine, move.theirs
                loads[slow], loads[light] = move.prices
        if not any(moves):
            break
    # Then the slowest rank alone, one move at a time, while it stands over `CLOSE_ENOUGH` times the mean: the rounds
    # pair many ranks at once and stop while a few stand out (at 8 sequences a rank on the benchmark's lengths, 1.022-
    # 1.027 of the mean to 1.015-1.017 on 512 ranks).
    return relieve_the_slowest(shares, loads, price, partners=PARTNERS, moves=RELIEF_MOVES, until=CLOSE_ENOUGH)


def imbalance(costs: Sequence[float]) -> float:
    """The slowest rank's cost over the mean rank's: 1.0 when every rank's step costs the same."""
    mean = sum(costs) / len(costs) if costs else 0.0
    return max(costs) / mean if mean > 0 else 1.0
