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
from typing import Literal

import torch

Method = Literal["best", "karmarkar-karp", "greedy"]
METHODS: tuple[Method, ...] = ("best", "karmarkar-karp", "greedy")


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
    for run in ("karmarkar-karp", "greedy") if method == "best" else (method,):
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


def imbalance(costs: Sequence[float]) -> float:
    """The slowest rank's cost over the mean rank's: 1.0 when every rank's step costs the same."""
    mean = sum(costs) / len(costs) if costs else 0.0
    return max(costs) / mean if mean > 0 else 1.0
