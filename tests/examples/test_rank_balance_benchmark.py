"""The rank-balance benchmark's quick mode, in a subprocess (issue 27, item 4).

Timings are the benchmark's to report (the machine is shared). What is checked is what holds whatever the timing: the
tables' structure, exactness (the deal by cost gives the random deal's and the full batch's gradient, identical on
both ranks), and that the deal by cost balances the tokens better than the random deal.
"""

from __future__ import annotations

import pytest

import tests.helpers as h

pytestmark = [pytest.mark.ddp, pytest.mark.timeout(900)]


def test_the_quick_run_is_exact_and_balances_the_tokens():
    out, result = h.run_quick_benchmark("rank_balance", timeout=880)
    assert list(result["measured"]) == ["8", "4"]
    for row in result["measured"].values():
        assert row["parity"]["by_cost_vs_random"] < 1e-5 and row["parity"]["by_cost_vs_full_batch"] < 1e-5
        assert row["parity"]["replicas"] == 0
        assert row["by cost"]["token_imbalance"] < row["at random"]["token_imbalance"]
    for row in result["simulated"].values():
        assert row["by cost"]["mean"] < row["at random"]["mean"]
    assert out.count("| per rank | deal |") == 1 and out.count("| ranks x per rank |") == 1
