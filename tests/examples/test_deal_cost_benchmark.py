"""The deal-cost benchmark's quick mode, in a subprocess (issue 37).

Timings are the benchmark's to report (the machine is shared): none is asserted. What is checked holds whatever the
timing: the table's structure, every deal priced (the benchmark checks each holds every sample once), the deal priced
by the cut well under the deal by tokens in imbalance, and the same deal as the commit before issue 37 (greedy_by_price
now prices a share as it grows, to the same floats), where git can show that commit.
"""

from __future__ import annotations

import pytest

import tests.helpers as h

pytestmark = pytest.mark.timeout(600)


def test_the_quick_run_deals_as_before_and_balances_the_price():
    out, result = h.run_quick_benchmark("deal_cost", timeout=580)
    table = result["table"]
    assert list(table) == [f"{case} {ranks} x 8" for case in ("issue", "rank-balance") for ranks in (8, 64, 512)]
    for key, row in table.items():
        for name in ("now", "by tokens"):
            assert row[name]["ms"] > 0 and row[name]["slowest"] > 0
        assert 1.0 <= row["now"]["imbalance"] < 1.03 < row["by tokens"]["imbalance"], key
        if "before" in row:  # up to 64 ranks in the quick run, where git has the commit
            assert row["same deal"] is True, key
            assert row["now"]["slowest"] == row["before"]["slowest"]
    assert out.count("| case | ranks x per rank |") == 1
