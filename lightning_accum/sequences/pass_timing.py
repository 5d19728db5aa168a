"""What a micro-batch pass costs on your own model: timed, and fitted to the `StepCost` the ranks are dealt by. Pure.

`lightning_accum.sequences.BalancedBatchSampler` prices a rank's step as its cut costs: for each micro-batch, a fixed
cost per pass (``pass_cost_tokens``) plus its padded tokens, plus attention's quadratic term (``quadratic``). Both
figures are the model's and the machine's: a pass's fixed cost came to 116-153 tokens on a small CPU model, and is
larger on a GPU, where a small micro-batch runs far below the device's speed. `measure_step_cost` times your own
forward and backward on the shapes your cut makes and fits them:

1. `pass_shapes`: the ``(rows, length)`` to time: a grid up to the token budget, and the micro-batches that split by
   tokens cuts shares of your lengths into (the shapes the price must be right on);
2. `time_passes`: each shape's pass, the fastest of ``repeats`` after a warm-up, the shapes taking turns (one pass
   each a round: a machine whose speed drifts moves every shape alike, not the shapes timed last);
3. `fit_step_cost`: seconds ``a + b * rows * length + c * rows * length ** 2``, least squares on the relative error
   with no negative term, as a `StepCost` in tokens: ``pass_cost_tokens = a / b``, ``quadratic = b / c``.

**Every rank must deal by the same figures**, or the ranks' deals differ and samples are lost or seen twice. Under
``torch.distributed``, call `measure_step_cost` on every rank: each times rank 0's shapes (at once, as they train),
and all take rank 0's fit of their mean times.

Example:
    >>> shapes = [(1, 64), (4, 64), (1, 256), (4, 256), (2, 512)]
    >>> seconds = [0.002 + 1e-5 * r * n + 2e-8 * r * n * n for r, n in shapes]  # a pass: 200 tokens, quadratic 500
    >>> cost = fit_step_cost(shapes, seconds, micro_batch_tokens=1024)
    >>> round(cost.pass_cost_tokens), round(cost.quadratic)
    (200, 500)
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable, Sequence
from typing import cast

import torch
import torch.distributed as dist

from lightning_accum._util.validation import check_int
from lightning_accum.sequences.balancing import StepCost
from lightning_accum.sequences.token_cut import cut_groups

NEGLIGIBLE = 1e-6
"""`fit_step_cost` drops a quadratic term under this share of every shape's time (the fit's rounding, not attention),
and refuses a cost per token under it."""

Shape = tuple[int, int]
"""A micro-batch's ``(rows, length)``: its sequences, and the length they are padded to."""


def measure_step_cost(
    run_pass: Callable[[int, int], object],
    lengths: Sequence[int],
    micro_batch_tokens: int,
    *,
    per_rank: int = 8,
    repeats: int = 7,
    synchronize: Callable[[], object] | None = None,
    seed: int = 0,
    clock: Callable[[], float] = time.perf_counter,
) -> StepCost:
    """The step cost of your own model, for `BalancedBatchSampler`: `pass_shapes`, `time_passes`, `fit_step_cost`.

    Args:
        run_pass: runs one forward and backward of a micro-batch of ``rows`` sequences padded to ``length``, as
            training does (``run_pass(rows, length)``); what it returns is not used. Leave the gradients to it (zero
            them, or not: a pass's time is what is measured).
        lengths: your data's lengths in tokens (all of them, or a sample): the shapes timed are the ones its shares
            cut into. Under ``torch.distributed`` each rank may pass its own (its shard's): every rank times the
            shapes drawn from rank 0's, so that the ranks' times of each shape can be averaged.
        micro_batch_tokens: the token budget split by tokens cuts at (`AutoMicroBatching`'s ``micro_batch_tokens``).
        per_rank: sequences per rank per step, the shares whose cuts are timed.
        repeats: timed passes per shape (after a warm-up one); the fastest counts.
        synchronize: called before each clock read; pass ``torch.cuda.synchronize`` on a GPU, where a pass returns
            before its kernels have run.
        seed: draws the shares.
        clock: the clock passes are timed by (seconds).

    Returns:
        ``StepCost(micro_batch_tokens, pass_cost_tokens, quadratic)``: give its three fields to `BalancedBatchSampler`.
        Under ``torch.distributed`` (call it on every rank), rank 0's fit of every rank's mean times, on every rank.

    Raises:
        ValueError: ``lengths`` is empty, or the timings gave no cost per token (see `fit_step_cost`).
        RuntimeError: under ``torch.distributed``, another rank failed to draw its shapes or to time its passes (every
            rank raises: the one that failed its own error, the others this, naming it), so no rank waits for another.
    """
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    try:
        shapes = pass_shapes(lengths, micro_batch_tokens, per_rank=per_rank, seed=seed)
    except Exception as err:  # told to every rank, which all raise: none is left waiting at the gather
        if distributed:
            with contextlib.suppress(RuntimeError):  # what the others are told; this rank raises its own
                _rank_zeros_shapes(f"{type(err).__name__}: {err}")
        raise
    if distributed:  # each rank may pass its own shard's lengths: all time rank 0's shapes, so their times average
        shapes = _rank_zeros_shapes(shapes)
    try:
        seconds = time_passes(run_pass, shapes, repeats=repeats, synchronize=synchronize, clock=clock)
    except Exception as err:  # told to every rank, which all raise: none is left waiting at the gather
        if distributed:
            with contextlib.suppress(RuntimeError):  # what the others are told; this rank raises its own
                _agree_on_one_fit(f"{type(err).__name__}: {err}", micro_batch_tokens)
        raise
    if not distributed:
        return fit_step_cost(shapes, seconds, micro_batch_tokens)
    return _agree_on_one_fit((shapes, seconds), micro_batch_tokens)


def _rank_zeros_shapes(mine: list[Shape] | str) -> list[Shape]:
    """Rank 0's shapes to time, on every rank; raises on every rank where one failed to draw its own.

    A rank whose `pass_shapes` raised sends its error instead (and raises its own after this returns or raises).
    """
    every: list[list[Shape] | str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    failed = [(rank, got) for rank, got in enumerate(every) if not isinstance(got, list)]
    if failed:
        rank, error = failed[0]
        raise RuntimeError(
            f"Rank {rank} failed to draw the shapes to time from its `lengths`, so no rank times its passes: {error}"
        )
    return cast(list[Shape], every[0])  # a list: no rank failed


def _agree_on_one_fit(timed: tuple[list[Shape], list[float]] | str, micro_batch_tokens: int) -> StepCost:
    """Rank 0's fit of every rank's mean times, on every rank; raises on every rank where one failed.

    One fit for every rank: a fit on each could differ in its last bits (LAPACK's), and deal the ranks apart. A rank
    whose timing raised sends its error instead of its times (and raises its own after this returns or raises).
    """
    every: list[tuple[list[Shape], list[float]] | str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, timed)
    failed = [(rank, got) for rank, got in enumerate(every) if not isinstance(got, tuple)]
    if failed:
        rank, error = failed[0]
        raise RuntimeError(f"Rank {rank} failed to time its passes, so no rank has a step cost: {error}")
    answer: list[StepCost | str | None] = [None]
    if dist.get_rank() == 0:
        timings = [got for got in every if isinstance(got, tuple)]
        mean = [sum(t) / len(t) for t in zip(*(seconds for _, seconds in timings), strict=True)]
        try:
            answer[0] = fit_step_cost(timings[0][0], mean, micro_batch_tokens)
        except ValueError as err:  # sent to every rank, which all raise it
            answer[0] = str(err)
    dist.broadcast_object_list(answer, src=0)
    if not isinstance(answer[0], StepCost):
        raise ValueError(f"On rank 0, the fit of every rank's mean times failed: {answer[0]}")
    return answer[0]


def pass_shapes(
    lengths: Sequence[int], micro_batch_tokens: int, *, per_rank: int = 8, shares: int = 24, seed: int = 0
) -> list[Shape]:
    """The shapes to time: a grid up to the budget, and the micro-batches of ``shares`` drawn shares' cuts. Sorted.

    The grid is lengths 16, 32, ... up to the longest sequence (or the budget), each at 1, 2, 4, ... rows within the
    budget; a sequence longer than the budget is a micro-batch of its own, so the longest is timed at 1 row. The grid
    alone leaves the quadratic term to the noise; the cut shares' shapes are where the price must be right.

    Example:
        >>> pass_shapes([100, 30, 30, 7], 64, per_rank=2, shares=4)
        [(1, 7), (1, 16), (1, 30), (1, 32), (1, 64), (1, 100), (2, 7), (2, 16), (2, 30), (2, 32), (4, 16)]
    """
    budget = check_int(micro_batch_tokens, "micro_batch_tokens", 1, hint="Pass AutoMicroBatching's token budget.")
    check_int(per_rank, "per_rank", 1, hint="It is the sequences a rank holds a step.")
    known = [max(1, int(n)) for n in lengths]
    if not known:
        raise ValueError("`lengths` is empty: pass your data's lengths in tokens (or a sample of them).")
    longest = max(known)
    found: set[Shape] = {(1, longest)}
    length = 16
    while length <= min(longest, budget):
        found.update((rows, length) for rows in _powers_of_two(budget // length))
        length *= 2
    rng = random.Random(seed)
    for _ in range(shares):
        ordered = sorted(rng.choices(known, k=per_rank), reverse=True)
        found.update((stop - start, ordered[start]) for start, stop in cut_groups(ordered, budget))
    return sorted(found)


def _powers_of_two(most: int) -> list[int]:
    rows, out = 1, []
    while rows <= most:
        out.append(rows)
        rows *= 2
    return out


def time_passes(
    run_pass: Callable[[int, int], object],
    shapes: Sequence[Shape],
    *,
    repeats: int = 7,
    synchronize: Callable[[], object] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> list[float]:
    """Each shape's pass seconds: the fastest of ``repeats`` after a warm-up (the least disturbed), shapes in turn.

    One pass of each shape a round: where the machine's speed drifts while they are timed, it moves every shape alike,
    not the ones timed last (timed shape after shape, a pass's fitted cost moved from 132 to 394 tokens between two
    runs minutes apart on the rank-balance benchmark; taking turns, 116 and 139).
    """
    check_int(repeats, "repeats", 1, hint="It counts the timed passes of each shape.")
    wait = synchronize or (lambda: None)
    seconds: list[list[float]] = [[] for _ in shapes]
    for _ in range(repeats + 1):
        for (rows, length), times in zip(shapes, seconds, strict=True):
            wait()
            start = clock()
            run_pass(rows, length)
            wait()
            times.append(clock() - start)
    return [min(times[1:]) for times in seconds]


def fit_step_cost(shapes: Sequence[Shape], seconds: Sequence[float], micro_batch_tokens: int) -> StepCost:
    """A pass's seconds ``a + b * rows * length + c * rows * length ** 2``, fitted to ``seconds``, as a `StepCost`.

    Least squares on the relative error (each shape's row over its time): unweighted, the largest passes' noise
    decides the fixed cost ``a`` (a pass's cost in tokens, ``a / b``, came to 78, 247 and 587 in three fits; weighted,
    76 to 173). A term fitted below 0 is dropped and the rest fitted again (none negative), as is a quadratic term
    under `NEGLIGIBLE` of every shape's time. ``pass_cost_tokens`` is ``a / b``; ``quadratic`` is ``b / c``, or
    ``None`` where ``c`` is 0.

    The fit is least squares in LAPACK, whose last bits can differ from one call to the next (with the memory's
    alignment, under MKL): fit once and share the result, as `measure_step_cost` does across ranks.

    Raises:
        ValueError: the shapes and seconds differ in number, a time is not positive, or the fit gave no cost per token
            (``b`` at 0, or under `NEGLIGIBLE` of every time: the timings were too noisy, or the passes did not grow
            with their tokens).
    """
    if len(shapes) != len(seconds):
        raise ValueError(f"{len(shapes)} shapes and {len(seconds)} times: pass one time for each shape.")
    if not seconds or min(seconds) <= 0:
        raise ValueError(f"Every time must be positive, got {sorted(seconds)[:3]}: time real passes.")
    columns = [0, 1, 2]
    x = torch.tensor([[1.0, r * n, r * n * n] for r, n in shapes], dtype=torch.float64)
    y = torch.tensor(list(seconds), dtype=torch.float64)
    while True:
        fitted = torch.linalg.lstsq(x[:, columns] / y[:, None], torch.ones_like(y)).solution.tolist()
        if 2 in columns and fitted[-1] >= 0 and float((fitted[-1] * x[:, 2] / y).max()) < NEGLIGIBLE:
            columns.pop()  # a quadratic term that is the fit's rounding, not attention: none
            continue
        if min(fitted) >= 0 or len(columns) == 1:
            break
        columns.pop(min(range(len(columns)), key=lambda k: fitted[k]))
    a, b, c = (float(fitted[columns.index(k)]) if k in columns else 0.0 for k in range(3))
    if b <= 0 or float((b * x[:, 1] / y).max()) < NEGLIGIBLE:
        raise ValueError(
            f"The pass timings gave no cost per token (a={a:g} s, b={b:g} s a token, c={c:g}): the passes did not grow"
            " with their tokens, or the timings were too noisy. Time again with more `repeats`, on a quiet machine."
        )
    return StepCost(micro_batch_tokens, max(0.0, a) / b, b / c if c > 0 else None)
