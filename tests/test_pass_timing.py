"""`measure_step_cost`: a pass timed on your own model, fitted to the `StepCost` `BalancedBatchSampler` deals by.

The timings come from a machine simulated in the test (a clock that a pass moves by a known cost), so the fit can be
checked against the truth; one test times a real model, and one runs on 2 real ranks, which must agree on one fit.
"""

from __future__ import annotations

import math
import os
import random

import pytest
import torch
import torch.distributed as dist
from torch import nn

import tests.helpers as h
from lightning_accum.sequences import BalancedBatchSampler, token_cut
from lightning_accum.sequences.pass_timing import fit_step_cost, measure_step_cost, pass_shapes, time_passes
from tests.test_fsdp2 import _free_port

LENGTHS = [min(512, max(8, round(math.exp(random.Random(i).gauss(math.log(64), 0.9))))) for i in range(400)]


class Machine:
    """A clock and a pass that moves it by ``speed * (a + b * tokens + c * rows * length ** 2)`` seconds, plus a
    disturbance on some passes (never less: a pass is never faster than its cost), and a slow first pass of each shape
    (a warm-up)."""

    def __init__(self, a: float, b: float, c: float, speed: float = 1.0, seed: int = 0) -> None:
        self.a, self.b, self.c, self.speed, self.now = a, b, c, speed, 0.0
        self.rng, self.calls, self.seen = random.Random(seed), list[tuple[int, int]](), set[tuple[int, int]]()

    def clock(self) -> float:
        return self.now

    def run_pass(self, rows: int, length: int) -> None:
        cost = self.speed * (self.a + self.b * rows * length + self.c * rows * length**2)
        warm_up = 5.0 if (rows, length) not in self.seen else 1.0
        self.seen.add((rows, length))
        self.calls.append((rows, length))
        self.now += cost * warm_up * (1.0 + (self.rng.random() * 0.5 if self.rng.random() < 0.3 else 0.0))


def test_the_fit_finds_the_pass_cost_and_quadratic_term_of_the_machine_it_timed():
    # A pass at 150 tokens, attention's term at 1 / 400 of a token per length: the fit reads both back.
    machine = Machine(a=150e-6, b=1e-6, c=1e-6 / 400)
    cost = measure_step_cost(machine.run_pass, LENGTHS, 1024, clock=machine.clock)
    assert cost.micro_batch_tokens == 1024
    assert cost.pass_cost_tokens == pytest.approx(150, rel=1e-6)
    assert cost.quadratic == pytest.approx(400, rel=1e-6)


def test_with_no_quadratic_term_timed_the_fit_leaves_it_out():
    for seed in range(5):
        machine = Machine(a=40e-6, b=2e-6, c=0.0, seed=seed)
        cost = measure_step_cost(machine.run_pass, LENGTHS, 512, clock=machine.clock, seed=seed)
        assert cost.quadratic is None  # fitted at 0 give or take the last bits: dropped, the rest refitted
        assert cost.pass_cost_tokens == pytest.approx(20, rel=1e-6)


def test_a_share_priced_by_the_fit_is_the_machines_seconds():
    # What the sampler balances is the machine's time: its price of a share, in seconds, is the timed machine's.
    machine = Machine(a=300e-6, b=1e-6, c=1e-6 / 250)
    cost = measure_step_cost(machine.run_pass, LENGTHS, 1024, clock=machine.clock)
    rng = random.Random(3)
    for _ in range(50):
        share = sorted(rng.choices(LENGTHS, k=8), reverse=True)
        seconds = sum(
            machine.a + machine.b * (stop - start) * share[start] + machine.c * (stop - start) * share[start] ** 2
            for start, stop in token_cut.cut_groups(share, 1024)
        )
        assert cost.of(share) * machine.b == pytest.approx(seconds, rel=1e-6)


def test_the_shapes_take_turns_and_each_is_timed_repeats_plus_one_times():
    machine = Machine(a=1.0, b=1.0, c=0.0)
    shapes = [(1, 8), (2, 8), (1, 64)]
    synced: list[int] = []
    seconds = time_passes(
        machine.run_pass, shapes, repeats=4, clock=machine.clock, synchronize=lambda: synced.append(len(machine.calls))
    )
    assert machine.calls == shapes * 5  # a round of every shape, 5 times: the warm-up and 4 timed
    assert synced == [n for k in range(15) for n in (k, k + 1)]  # before and after each pass
    assert seconds == [1.0 + 8, 1.0 + 16, 1.0 + 64]  # the fastest timed pass: never the warm-up, never a disturbed one


def test_the_shapes_are_a_grid_within_the_budget_and_the_cuts_of_drawn_shares():
    shapes = pass_shapes(LENGTHS, 1024, per_rank=8)
    assert shapes == sorted(set(shapes))
    assert (1, max(LENGTHS)) in shapes
    assert {(rows, 64) for rows in (1, 2, 4, 8, 16)} <= set(shapes)
    assert all(rows * length <= 1024 or rows == 1 for rows, length in shapes)
    # Every micro-batch the cut makes of a drawn share is timed.
    rng = random.Random(0)
    for _ in range(24):
        share = sorted(rng.choices(LENGTHS, k=8), reverse=True)
        assert {(stop - start, share[start]) for start, stop in token_cut.cut_groups(share, 1024)} <= set(shapes)
    # A sequence longer than the budget is a micro-batch of its own.
    assert (1, 3000) in pass_shapes([3000, 20, 20], 256)


@pytest.mark.parametrize(
    ("call", "error", "words"),
    [
        (lambda: pass_shapes([], 1024), ValueError, "`lengths` is empty"),
        (lambda: pass_shapes([10], 0), ValueError, "`micro_batch_tokens`"),
        (lambda: pass_shapes([10], 64, per_rank=0), ValueError, "`per_rank`"),
        (lambda: time_passes(lambda r, n: None, [(1, 8)], repeats=0), ValueError, "`repeats`"),
        (lambda: fit_step_cost([(1, 8)], [1.0, 2.0], 64), ValueError, "1 shapes and 2 times"),
        (lambda: fit_step_cost([(1, 8), (2, 8)], [0.0, 1.0], 64), ValueError, "must be positive"),
        (lambda: fit_step_cost([(1, 8), (2, 8), (1, 64), (4, 64)], [1.0] * 4, 512), ValueError, "no cost per token"),
        (lambda: fit_step_cost([(1, 8), (2, 8), (1, 64), (4, 64)], [4.0, 3.0, 2.0, 1.0], 512), ValueError, "per token"),
    ],
)
def test_bad_input_is_refused_naming_it(call, error, words):
    with pytest.raises(error, match=words):
        call()


def test_a_real_models_pass_is_timed_and_fitted_to_a_price_the_sampler_takes():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(256, 32), nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 256))

    def run_pass(rows: int, length: int) -> None:
        ids = torch.randint(0, 256, (rows, length))
        nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()

    cost = measure_step_cost(run_pass, LENGTHS[:100], 256, per_rank=4, repeats=2)
    assert cost.micro_batch_tokens == 256 and math.isfinite(cost.pass_cost_tokens) and cost.pass_cost_tokens >= 0
    assert cost.quadratic is None or cost.quadratic > 0
    sampler = BalancedBatchSampler(
        LENGTHS[:100],
        16,
        num_replicas=2,
        rank=0,
        micro_batch_tokens=cost.micro_batch_tokens,
        pass_cost_tokens=cost.pass_cost_tokens,
        quadratic=cost.quadratic,
    )
    assert sum(len(batch) for batch in sampler) > 0


def _ranks_worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=h.RANK_TIMEOUT)
    try:
        # Rank 1's pass costs 200 tokens, rank 0's 150, and their disturbances differ: alone, they would fit apart.
        machine = _machine(rank)
        cost = measure_step_cost(machine.run_pass, LENGTHS, 1024, clock=machine.clock)
        alone = fit_step_cost(*_own_timing(rank), 1024)
        torch.save({"cost": cost, "alone": alone}, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _own_timing(rank: int) -> tuple[list[tuple[int, int]], list[float]]:
    shapes = pass_shapes(LENGTHS, 1024)
    machine = _machine(rank)
    return shapes, time_passes(machine.run_pass, shapes, clock=machine.clock)


def _machine(rank: int) -> Machine:
    return Machine(a=(150e-6, 200e-6)[rank], b=1e-6, c=1e-6 / 400, seed=rank)


@pytest.mark.ddp
@pytest.mark.timeout(120)
def test_on_two_ranks_every_rank_gets_rank_0s_fit_of_their_mean_times(tmp_path):
    h.start_ranks(_ranks_worker, (_free_port(), str(tmp_path)), 2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert ranks[0]["cost"] == ranks[1]["cost"]  # the same floats on both: the deals agree
    shapes, times0 = _own_timing(0)
    _, times1 = _own_timing(1)
    # The fit of the mean times (LAPACK's last bits can differ from call to call: rank 0's is the one every rank took).
    mean = fit_step_cost(shapes, [(a + b) / 2 for a, b in zip(times0, times1, strict=True)], 1024)
    assert ranks[0]["cost"].pass_cost_tokens == pytest.approx(mean.pass_cost_tokens, rel=1e-9)
    assert ranks[0]["cost"].quadratic == pytest.approx(mean.quadratic, rel=1e-9)
    assert ranks[0]["cost"].pass_cost_tokens == pytest.approx(175, rel=1e-6)  # the mean machine's
    assert [r["alone"].pass_cost_tokens for r in ranks] == [pytest.approx(150, rel=1e-6), pytest.approx(200, rel=1e-6)]


def _faulty_worker(rank: int, port: int, out: str, fault: str) -> None:
    """Times on 2 ranks with ``fault``: "oom on rank 1" (mid-timing) or "no cost per token" (rank 0's fit fails)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=h.RANK_TIMEOUT)
    try:
        machine = _machine(rank) if fault == "oom on rank 1" else Machine(a=1e-3, b=0.0, c=0.0, seed=rank)

        def run_pass(rows: int, length: int) -> None:
            if fault == "oom on rank 1" and rank == 1 and len(machine.calls) == 40:
                raise MemoryError("out of memory at 40 passes")
            machine.run_pass(rows, length)

        try:
            measure_step_cost(run_pass, LENGTHS, 1024, clock=machine.clock)
        except Exception as err:
            torch.save(f"{type(err).__name__}: {err}", os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.ddp
@pytest.mark.timeout(120)
def test_a_rank_that_fails_to_time_its_passes_fails_every_rank_and_none_waits(tmp_path):
    h.start_ranks(_faulty_worker, (_free_port(), str(tmp_path), "oom on rank 1"), 2)
    errors = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert errors[1] == "MemoryError: out of memory at 40 passes"  # its own error
    assert errors[0] == (
        "RuntimeError: Rank 1 failed to time its passes, so no rank has a step cost: MemoryError: out of memory at 40"
        " passes"
    )


@pytest.mark.ddp
@pytest.mark.timeout(120)
def test_where_rank_0s_fit_fails_every_rank_raises_its_error(tmp_path):
    h.start_ranks(_faulty_worker, (_free_port(), str(tmp_path), "no cost per token"), 2)
    errors = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert errors[0] == errors[1]
    assert errors[0].startswith("ValueError: On rank 0, the fit of every rank's mean times failed: The pass timings")
