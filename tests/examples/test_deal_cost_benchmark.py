"""The deal-cost benchmark's quick mode, in a subprocess (issue 37).

Timings are the benchmark's to report (the machine is shared): none is asserted. What is checked holds whatever the
timing: the table's structure, every deal priced (the benchmark checks each holds every sample once), and the deal by
runs' slowest rank cheaper than the deal by tokens' and than the deal that mixed lengths before it (where git can show
that commit): what the step costs is its slowest rank.
"""

from __future__ import annotations

import pytest

import tests.helpers as h

pytestmark = pytest.mark.timeout(600)


def test_the_quick_run_deals_every_rank_cheaper_than_before_and_than_by_tokens():
    out, result = h.run_quick_benchmark("deal_cost", timeout=580)
    table = result["table"]
    assert list(table) == [f"{case} {ranks} x 8" for case in ("issue", "rank-balance") for ranks in (8, 64, 512)]
    for key, row in table.items():
        for name in ("now", "by tokens"):
            assert row[name]["ms"] > 0 and row[name]["slowest"] > 0
        assert row["now"]["imbalance"] >= 1.0 and row["now"]["slowest"] < row["by tokens"]["slowest"], key
        if "before" in row:  # up to 64 ranks in the quick run, where git has the commit
            assert row["now"]["slowest"] < row["before"]["slowest"], key
    assert out.count("| case | ranks x per rank |") == 1
