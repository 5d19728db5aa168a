"""The rank-balance benchmark's quick mode, in a subprocess (issue 27, item 4).

Timings are the benchmark's to report (the machine is shared). What is checked is what holds whatever the timing: the
tables' structure, exactness (the deal by cost gives the random deal's and the full batch's gradient, identical on
both ranks), that the deal by cost balances the ranks' fitted step cost better than the random deal, and that the
sampler was given the step cost `measure_step_cost` fitted on this machine (in both ranks, agreed), that the noise
floor's ranks ran the same share, and that every deal ran every repeat (the samples/s ratios paired by repeat).
"""

from __future__ import annotations

import math

import pytest

import tests.helpers as h
from lightning_accum.sequences import balancing, token_cut

pytestmark = [pytest.mark.ddp, pytest.mark.timeout(900)]


def priced(lengths: list[int], cost: balancing.StepCost) -> float:
    # The reference: the price's own formula, summed over the cut split by tokens makes (longest first, at the budget).
    ordered, q = sorted(lengths, reverse=True), cost.quadratic
    return sum(
        cost.pass_cost_tokens + (stop - start) * ordered[start] + ((stop - start) * ordered[start] ** 2 / q if q else 0)
        for start, stop in token_cut.cut_groups(ordered, int(cost.micro_batch_tokens or 0))
    )


def test_the_quick_run_is_exact_and_balances_the_fitted_cost():
    out, result = h.run_quick_benchmark("rank_balance", timeout=880)
    assert list(result["measured"]) == ["8", "4"]
    for row in result["measured"].values():
        assert row["parity"]["by_cost_vs_random"] < 1e-5 and row["parity"]["by_cost_vs_full_batch"] < 1e-5
        assert row["parity"]["replicas"] == 0
        # The deal by cost balances its shares' cut as priced by the fit (no longer tokens alone).
        assert row["by cost"]["modelled_imbalance"] < row["at random"]["modelled_imbalance"]
        # The noise floor's ranks run the same share: equal tokens and prices by the fit, whatever their times.
        floor = row["the same share on both"]
        assert floor["token_imbalance"] == 1.0 and floor["modelled_imbalance"] == 1.0
        # Each share's time, the median of its repeats on both cores: a ratio of the slowest to the mean, so >= 1.
        assert all(1.0 <= row[name]["share_compute_imbalance"] < 3.0 for name in ("at random", "by cost"))
        # Every deal ran every repeat (the quick run: 2), step by step in turn: a samples/s each, paired by repeat.
        assert all(len(row[name]["samples_per_s"]) == 2 for name in ("at random", "by cost", "the same share on both"))
        for ratio in ("speedup", "ceiling"):
            low, high = row[ratio]["range"]
            assert 0 < low <= row[ratio]["median"] <= high
    for row in result["simulated"].values():
        assert row["by cost"]["mean"] < row["at random"]["mean"]
        assert 1.0 <= row["bound"]["mean"] <= row["by cost"]["mean"] * (1 + 1e-12)  # no deal beats the dearest sample
        assert 0 < row["slowest vs random"]["mean"] < 1.0  # the step itself: cheaper dealt by cost
    assert out.count("| per rank | deal |") == 1 and out.count("| ranks x per rank |") == 1

    # The sampler deals by the cut at the benchmark's budget, with the step cost measure_step_cost fitted on this
    # machine in both ranks (agreed: the ranks' deals are one).
    sampler = result["sampler"]
    assert result["pass_cost"] == sampler
    assert set(sampler) == {"micro_batch_tokens", "pass_cost_tokens", "quadratic"}
    assert "sampler (by cost): micro_batch_tokens=1024" in out
    assert sampler["micro_batch_tokens"] == 1024  # the benchmark's BUDGET, which its own cut uses
    assert math.isfinite(sampler["pass_cost_tokens"]) and sampler["pass_cost_tokens"] >= 0
    assert sampler["quadratic"] is None or (math.isfinite(sampler["quadratic"]) and sampler["quadratic"] > 0)
    # The simulation prices a rank's share as the sampler does: by its cut at the budget (TokenCut's), here in tokens.
    step = balancing.StepCost(sampler["micro_batch_tokens"], sampler["pass_cost_tokens"], sampler["quadratic"])
    for lengths in ([512], [300, 200, 40, 8], [64] * 20, [500, 480, 100, 90, 30, 30, 12, 9]):
        assert step.of(lengths) == pytest.approx(priced(lengths, step), rel=1e-12)
