"""What a step's deal costs every rank, by world size: priced by the cut, before and now, against by tokens alone.

    OMP_NUM_THREADS=1 python examples/benchmarks/deal_cost.py [--before c189abc] [--repeats 3] [--quick]

Every rank computes each step's whole deal itself (`BalancedBatchSampler.deal`, no communication), in the process
that iterates the sampler, so its time is paid on every rank at every step. Measured here, on the CPU, for a global
batch of 8 sequences a rank on 8, 64, 512 and 4096 ranks, in two cases:

- **the issue's**: log-normal lengths, median 200, 16 to 2048 tokens, cut at 4096 tokens, the default pass cost
  (`PASS_COST_TOKENS`): issue 37's case;
- **the rank-balance benchmark's**: log-normal lengths, median 64, 8 to 512 tokens, cut at 1024 tokens, a pass at 135
  tokens and ``quadratic=405`` (a fit of ``examples/benchmarks/rank_balance.py`` on this machine).

Three deals, side by side in one run: **before**, the deal priced by the cut as the commit ``--before`` made it
(its ``balancing.py`` read from git and imported beside this one; skipped where git or the commit is missing);
**now**, this checkout's (`lightning_accum.sequences.balancing.deal`); and **by tokens**, the deal without
``micro_batch_tokens`` (`balancing.partition`, Karmarkar-Karp's or greedy's, whichever is better, greedy alone above
`KARMARKAR_KARP_MAX`). Each is timed as the median of ``--repeats`` runs (one at 4096 ranks), and its deal priced
as a rank's step is (`StepCost.of`): the slowest rank's price over the mean rank's (the simulated imbalance), and
the slowest rank's price over the deal before's (below 1: a faster step: what the step costs is its slowest rank).
The last line is ``RESULT`` and the results as JSON. Timings on a shared machine are noisy: read the ratios.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import statistics
import subprocess
import sys
import time
import types
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from lightning_accum.sequences import balancing
from lightning_accum.sequences.balancing import StepCost

RANKS = (8, 64, 512, 4096)
PER_RANK = 8
BEFORE = "c189abc"
"""The last commit before the deal by runs: the deal that mixed lengths (greedy by price, then 16 rounds of moves)."""

CASES: dict[str, tuple[dict[str, Any], StepCost]] = {
    "issue": ({"median": 200.0, "low": 16, "high": 2048, "sigma": 0.8}, StepCost(4096)),
    "rank-balance": ({"median": 64.0, "low": 8, "high": 512, "sigma": 0.9}, StepCost(1024, 135.0, 405.0)),
}


def lognormal(n: int, seed: int, median: float, low: int, high: int, sigma: float) -> list[int]:
    rng = random.Random(seed)
    return [min(high, max(low, round(math.exp(rng.gauss(math.log(median), sigma))))) for _ in range(n)]


def deal_before(rev: str) -> Callable[[Sequence[int], int, StepCost], list[list[int]]] | None:
    """The deal priced by the cut as commit ``rev`` made it, or ``None`` where git cannot show it.

    Its ``balancing.py`` is read from git, and so is each module of ``lightning_accum.sequences`` it imports (imported
    under a name of their own, beside this checkout's).
    """
    source = _show(rev, "balancing.py")
    if source is None:
        return None
    for name in sorted(set(re.findall(r"from lightning_accum\.sequences\.(\w+) import", source))):
        imported = _show(rev, f"{name}.py")
        if imported is None:
            return None
        _load(f"_before_{name}", imported, f"{rev}:{name}.py")
        source = source.replace(f"lightning_accum.sequences.{name} import", f"_before_{name} import")
    module = _load("_balancing_before", source, f"{rev}:balancing.py")

    def run(lengths: Sequence[int], parts: int, cost: StepCost) -> list[list[int]]:
        old_cost = module.StepCost(cost.micro_batch_tokens, cost.pass_cost_tokens, cost.quadratic)
        return module.deal(lengths, parts, cost=old_cost)  # type: ignore[no-any-return]

    return run


def _show(rev: str, name: str) -> str | None:
    root = Path(__file__).resolve().parents[2]
    try:
        return subprocess.run(
            ["git", "show", f"{rev}:lightning_accum/sequences/{name}"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None


def _load(name: str, source: str, where: str) -> types.ModuleType:
    module = types.ModuleType(name)
    sys.modules[name] = module  # dataclasses and imports look their module up there
    exec(compile(source, where, "exec"), module.__dict__)
    return module


def timed(deal: Callable[[], list[list[int]]], repeats: int) -> tuple[float, list[list[int]]]:
    """The median CPU seconds of ``repeats`` runs of ``deal`` (this process's: what the rank's process spends on it,
    steadier than the wall clock on a shared machine), and its deal."""
    seconds, result = [], None
    for _ in range(repeats):
        start = time.process_time()
        result = deal()
        seconds.append(time.process_time() - start)
    assert result is not None
    return statistics.median(seconds), result


def priced(lengths: Sequence[int], deal: list[list[int]], cost: StepCost) -> tuple[float, float]:
    """The slowest rank's price, and it over the mean rank's; every sample dealt once."""
    assert sorted(i for part in deal for i in part) == list(range(len(lengths)))
    prices = [cost.of([lengths[i] for i in part]) for part in deal]
    return max(prices), balancing.imbalance(prices)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    before = deal_before(args.before)
    table: dict[str, Any] = {}
    for case, (shape, cost) in CASES.items():
        for ranks in RANKS[:3] if args.quick else RANKS:
            lengths = lognormal(ranks * PER_RANK, 1000 + ranks, **shape)
            deals: dict[str, Callable[[], list[list[int]]]] = {
                "by tokens": partial(balancing.partition, balancing.sample_costs(lengths), ranks),
                "now": partial(balancing.deal, lengths, ranks, cost=cost),
            }
            if before is not None and not (args.quick and ranks >= 512):
                deals["before"] = partial(before, lengths, ranks, cost)
            table[f"{case} {ranks} x {PER_RANK}"] = row_of(deals, lengths, cost, 1 if ranks >= 4096 else args.repeats)
            print(f"... {case} on {ranks} ranks", file=sys.stderr, flush=True)
    return table


def row_of(
    deals: dict[str, Callable[[], list[list[int]]]], lengths: list[int], cost: StepCost, repeats: int
) -> dict[str, Any]:
    """Each deal's time, its slowest rank's price and its imbalance; whether the deal before and now's are one."""
    row: dict[str, Any] = {}
    results = {}
    for name, deal in deals.items():
        seconds, results[name] = timed(deal, repeats)
        slowest, imbalance = priced(lengths, results[name], cost)
        row[name] = {"ms": seconds * 1e3, "slowest": slowest, "imbalance": imbalance}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", default=BEFORE, help="the commit whose deal is 'before' (git)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="up to 512 ranks, the deal before up to 64")
    args = parser.parse_args()
    table = measure(args)
    print(
        "| case | ranks x per rank | before: ms a step | now: ms a step | by tokens: ms a step | now / by tokens"
        " | imbalance before | imbalance now | imbalance by tokens | slowest now / before |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for key, row in table.items():
        case, shape = key.split(" ", 1)
        before, now, tokens = row.get("before"), row["now"], row["by tokens"]
        ms_before = f"{before['ms']:.1f}" if before else "-"
        imbalance_before = f"{before['imbalance']:.3f}" if before else "-"
        slowest = f"{now['slowest'] / before['slowest']:.3f}" if before else "-"
        print(
            f"| {case} | {shape} | {ms_before} | {now['ms']:.1f} | {tokens['ms']:.1f} | {now['ms'] / tokens['ms']:.1f}x"
            f" | {imbalance_before} | {now['imbalance']:.3f} | {tokens['imbalance']:.3f} | {slowest} |"
        )
    print("RESULT " + json.dumps({"before": args.before, "per_rank": PER_RANK, "table": table}))


if __name__ == "__main__":
    main()
