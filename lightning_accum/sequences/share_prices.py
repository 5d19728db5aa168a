"""Many ranks' shares priced by their real cut at once: `StepCost.of`, batched in tensors. Pure.

`lightning_accum.sequences.balancing.refine` prices every candidate move of a round (thousands of shares of a few
sequences each, on 512 ranks) by the cut split by tokens would make of it. One share at a time in Python, that was
seconds a step; here a round's shares are cut together, one tensor column of the shortest-path cut at a time. It is
`lightning_accum.sequences.token_cut.cut_groups` laid out across shares (at the same `MICRO_BATCH_COST`), not another
cut: tests/test_balancing.py checks they cut alike, stop for stop, on many random shares.

The prices are the same floats as `StepCost.of`'s, bit for bit, on any CPU: the cut is integer arithmetic, and the
price's few float operations are element-wise (an addition and a division each, correctly rounded by IEEE 754) in
the order `StepCost.of` makes them, with no reduction whose order could depend on the CPU's vector width. Every rank
must compute the same deal, so this matters: a price one ulp apart on one rank could tip a comparison and deal a
sample twice. tests/test_balancing.py checks the prices equal `StepCost.of`'s exactly.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_accum.sequences.token_cut import MICRO_BATCH_COST

_NEVER = torch.iinfo(torch.int64).max // 4
"""A cut cost no stop reaches (a stop past the budget)."""


def share_prices(
    shares: Sequence[Sequence[int]],
    *,
    budget: int,
    pass_cost_tokens: float,
    quadratic: float | None,
) -> list[float]:
    """Each share's price: its cut's passes, each ``pass_cost_tokens`` plus its padded tokens (and the quadratic term).

    Args:
        shares: lengths, each at least 1 and longest first (a share may be empty).
        budget: the micro-batch token budget the cut is made at.
        pass_cost_tokens: a pass's fixed cost in the price.
        quadratic: count ``rows * longest ** 2 / quadratic`` more per micro-batch; ``None``: no quadratic term.
    """
    if not shares:
        return []
    lengths, counts = _padded(shares)
    stops = cut_stops(lengths, counts, budget)
    return _priced(lengths, counts, stops, pass_cost_tokens, quadratic).tolist()


def _padded(shares: Sequence[Sequence[int]]) -> tuple[Tensor, Tensor]:
    # The shares as rows of one int64 tensor, zeros after each share's own lengths; and each share's count.
    width = max(len(share) for share in shares)
    flat, zeros = array("q"), array("q", [0]) * width  # one flat buffer: from nested lists, some 20 times slower
    for share in shares:
        flat.extend(share)
        flat.extend(zeros[: width - len(share)])
    lengths = torch.frombuffer(flat, dtype=torch.int64).reshape(len(shares), width).clone()
    return lengths, torch.tensor([len(share) for share in shares], dtype=torch.int64)


def cut_stops(lengths: Tensor, counts: Tensor, budget: int) -> Tensor:
    """Where each micro-batch starting at a position stops: `token_cut.cut_groups`' shortest path, every row at once.

    ``lengths`` holds a share a row, longest first and padded with zeros, ``counts`` each row's own length. From the
    shortest sequence back: the stop of a micro-batch starting at ``start`` is the one that minimizes the cut's own
    cost (``budget // MICRO_BATCH_COST`` per micro-batch plus its padded tokens) from there on, within the budget; on a
    tie, the furthest (as `cut_groups` breaks them). Positions past a row's count stop at the width.
    """
    shares, width = lengths.shape
    overhead = budget // MICRO_BATCH_COST
    cost = torch.zeros(shares, width + 1, dtype=torch.int64)
    stops = torch.full((shares, width + 1), width, dtype=torch.int64)
    for start in range(width - 1, -1, -1):
        longest = lengths[:, start].clamp(min=1)
        last = torch.minimum(counts, start + (budget // longest).clamp(min=1))
        ends = torch.arange(start + 1, width + 1)
        here = overhead + (ends - start)[None, :] * longest[:, None] + cost[:, start + 1 :]
        here = here.masked_fill(ends[None, :] > last[:, None], _NEVER)
        furthest_first = here.flip(1)  # argmin keeps the first of equal minima: here, the furthest stop
        pick = furthest_first.argmin(dim=1)
        inside = start < counts
        cost[:, start] = torch.where(inside, furthest_first.gather(1, pick[:, None]).squeeze(1), 0)
        stops[:, start] = torch.where(inside, width - pick, width)
    return stops


def _priced(lengths: Tensor, counts: Tensor, stops: Tensor, pass_cost_tokens: float, quadratic: float | None) -> Tensor:
    # Walk each row's micro-batches in order, adding each one's price as `StepCost._of_ordered` adds it.
    shares, width = lengths.shape
    padded = torch.cat([lengths, torch.zeros(shares, 1, dtype=torch.int64)], dim=1)
    total = torch.zeros(shares, dtype=torch.float64)
    start = torch.zeros(shares, dtype=torch.int64)
    for _ in range(width):
        inside = start < counts
        if not bool(inside.any()):
            break
        stop = stops.gather(1, start[:, None]).squeeze(1)
        rows, longest = stop - start, padded.gather(1, start[:, None]).squeeze(1)
        step = total + (pass_cost_tokens + (rows * longest).to(torch.float64))
        if quadratic is not None:
            step = step + (rows * longest * longest).to(torch.float64) / quadratic
        total = torch.where(inside, step, total)
        start = torch.where(inside, stop, start)
    return total
