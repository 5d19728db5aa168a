"""Ranks dealt by cost (`BalancedBatchSampler`) against dealt at random: measured on 2 CPU ranks, simulated to 512.

    OMP_NUM_THREADS=1 python examples/benchmarks/rank_balance.py [--repeats 8] [--steps 32] [--quick]

**Measured.** 2 gloo ranks on the CPU, one thread and one core each, train a small causal LM (2 pre-norm transformer
blocks) on log-normal lengths (median 64, 8 to 512 tokens). Every step, the same global batch of ``2 x per_rank``
sequences is dealt at random (in stride over the seeded permutation, as ``DistributedSampler`` deals) or by cost
(`lightning_accum.sequences.BalancedBatchSampler.deal` with ``micro_batch_tokens=BUDGET``: each rank's share priced as
its cut costs, with the pass cost fitted on this machine, below); each rank cuts its share as split mode by tokens does
(`lightning_accum.sequences.token_cut.TokenCut`, longest first, trimmed), runs every micro-batch's forward and
backward, sums the token-summed loss's gradients, and all-reduces them once (the step's sync; the update is the token
mean over the global batch). The loop is written out by hand, not through the Trainer, so that the ranks' compute time
(forward and backward) can be timed apart from the wait at the sync. Each repeat runs the epoch's steps, and at every
step each deal's in turn (the order alternating step by step), so that the machine's ups and downs in the middle of a
repeat move every deal alike; a step is timed from a barrier (where the previous step's sync leaves the ranks) to the
end of
its sync, its deal included. Reported: the slowest rank's compute time over the mean (median over steps and repeats:
a step as it ran, what the sync waits for), the same of each share's compute time taken as the median of its repeats
(the ranks swap shares every other repeat, so both cores run both: a core slower than the other through a run moves
both shares alike, and what is left is the deal's), the same of the ranks' tokens and of their shares' prices by the
fit (what the deal by cost balances), samples/s of by cost over at random (median over repeats, with the range), the
share of a step that is the model's forward and backward, and parity: the largest relative difference between the two
deals' gradients, and to one full-batch pass.

**How many steps.** Samples/s weighs each step by its time, so a few long steps where the random deal happens to be
even move it: the first 12 global batches of these lengths were the evenest at random of any run length tried (the
slowest rank's priced step over the mean, summed over steps, 1.17 at 8 per rank and 1.14 at 4, against 1.19 and 1.24
over 200 steps), and runs of 12 steps measured 1.02-1.05x against 1.07-1.13x for runs of 16 and 32. The default, 32
steps, comes to 1.21 and 1.23 there: near the long run's.

**The fit.** First, in both ranks at once (as they then train, each on its own core),
`lightning_accum.sequences.measure_step_cost` times a pass on the shapes the cut makes (a grid up to the budget, and the
micro-batches of shares drawn from log-normal lengths apart from the run's), each the fastest of 7 passes, the shapes
taking turns, and fits a pass's time as ``a + b * padded_tokens + c * rows * length ** 2`` (least squares on the
relative error); every rank takes rank 0's fit of both ranks' mean times. In the sampler's units, tokens:
``pass_cost_tokens = a / b`` and ``quadratic = b / c`` (`lightning_accum.sequences.balancing.StepCost.of` prices a
micro-batch as ``pass_cost_tokens + rows * longest + rows * longest ** 2 / quadratic`` tokens). Both the measured deal
by cost and the simulated one use these figures. Timed in the main process alone (before), the fit met another machine
than the ranks': two processes on two cores, and the measured compute balanced to 1.05-1.07.

**The noise floor, and the ceiling.** A third deal gives both ranks the same share (the deal by cost's first): their
compute times differ by timing noise alone, the floor under what any deal can show on this machine, and its samples/s
over the random deal's is the ceiling: a deal that balanced perfectly, on the same work. Each rank runs on a core of
its own. On this machine (2 vCPUs) the same share runs 1-6% slower on one core than on the other through a run, and
which one differs from run to run: a floor of 1.03-1.04 a step, which longer steps do not lower (4 times the step: 1.045
to 1.036) nor the CPU clock in place of the wall clock. Taken as each share's median on both cores, the floor came to
1.008-1.029 over six runs.

**Simulated.** A rank's step is its share priced by the fit (`StepCost.of`, the fit's seconds in tokens); the slowest
rank's step over the mean, for 8, 64 and 512 ranks at 4, 8, 16 and 64 sequences per rank, at random and by cost.

Timings on a shared machine are noisy: read the ratios. The last line is ``RESULT`` and the results as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn
from torch.nn import functional as F

from lightning_accum.sequences import BalancedBatchSampler, balancing
from lightning_accum.sequences.balancing import StepCost
from lightning_accum.sequences.pass_timing import measure_step_cost, pass_shapes
from lightning_accum.sequences.token_cut import TokenCut

VOCAB, DIM, HEADS, MAX_LEN = 256, 64, 4, 512
BUDGET = 1024  # padded tokens a micro-batch
PER_RANK = (8, 4)
SIM_RANKS = (8, 64, 512)
SIM_PER_RANK = (4, 8, 16, 64)


def lognormal_lengths(n: int, seed: int, median: float = 64.0, low: int = 8, high: int = MAX_LEN) -> list[int]:
    rng = random.Random(seed)
    return [min(high, max(low, round(math.exp(rng.gauss(math.log(median), 0.9))))) for _ in range(n)]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.out = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x: Tensor) -> Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, HEADS, -1).permute(2, 0, 3, 1, 4)
        x = x + self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, n, DIM))
        return x + self.mlp(self.norm2(x))


class CausalLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.position = nn.Embedding(VOCAB, DIM), nn.Embedding(MAX_LEN, DIM)
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(DIM, VOCAB)

    def token_loss_sum(self, ids: Tensor, labels: Tensor) -> Tensor:
        x = self.embed(ids) + self.position(torch.arange(ids.shape[1]))
        logits = self.head(self.blocks(x))
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), reduction="sum")


def padded(samples: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    length = max(len(s) for s in samples)
    ids = torch.zeros(len(samples), length, dtype=torch.long)
    labels = torch.full((len(samples), length), -100)
    for row, s in enumerate(samples):
        ids[row, : len(s)], labels[row, : len(s)] = s, s
    return ids, labels


def micro_batches(lengths: Sequence[int]) -> list[list[int]]:
    """Positions of each micro-batch as split by tokens cuts them (longest first, at `BUDGET`)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    cut = TokenCut(None, order, [lengths[i] for i in order], max(lengths), 1)
    return [[order[p] for p in group] for group in cut.groups(BUDGET)]


def rank_step(model: CausalLM, samples: list[Tensor], global_tokens: int) -> tuple[float, float, Tensor]:
    """This rank's step: forward and backward of every micro-batch, then the sync. Its compute and sync seconds."""
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    for group in micro_batches([len(s) for s in samples]):
        ids, labels = padded([samples[i] for i in group])
        (model.token_loss_sum(ids, labels) / global_tokens).backward()
    computed = time.perf_counter()
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    dist.all_reduce(flat)
    return computed - start, time.perf_counter() - computed, flat


def _worker(rank: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    pin_to_a_core(rank)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    cost = calibrate(args.quick)
    sampler = sampler_kwargs(cost)
    results: dict[str, Any] = {"pass_cost": cost}
    for per_rank in PER_RANK:
        lengths, data = make_data(per_rank, args.steps)
        deals = {
            "at random": _StrideDeal(lengths, 2 * per_rank),
            "by cost": BalancedBatchSampler(lengths, 2 * per_rank, **sampler),
            SAME: _SameShare(lengths, 2 * per_rank, **sampler),
        }
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in deals}
        for repeat in range(args.repeats):
            for name, run in _repeat(deals, data, rank, cost, swap=repeat % 2 == 1).items():
                runs[name].append(run)
        results[str(per_rank)] = runs
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


SAME = "the same share on both"
"""Both ranks run the same share (the deal by cost's first): what is left of the compute imbalance is timing noise."""


class _StrideDeal(BalancedBatchSampler):
    def deal(self, batch: Sequence[int], num_replicas: int) -> list[list[int]]:
        return [list(batch[r::num_replicas]) for r in range(num_replicas)]


class _SameShare(BalancedBatchSampler):
    def deal(self, batch: Sequence[int], num_replicas: int) -> list[list[int]]:
        return [super().deal(batch, num_replicas)[0]] * num_replicas


def calibrate(quick: bool) -> StepCost:
    """The pass cost, timed in both ranks at once (as they train): `measure_step_cost` agrees on rank 0's fit."""
    model, inputs = CausalLM(), dict[tuple[int, int], Tensor]()

    def run_pass(rows: int, length: int) -> None:
        ids = inputs.setdefault((rows, length), torch.randint(1, VOCAB, (rows, length)))  # made at the warm-up pass
        model.token_loss_sum(ids, ids).backward()

    return measure_step_cost(run_pass, calibration_lengths(), BUDGET, per_rank=8, repeats=3 if quick else 7)


def calibration_lengths() -> list[int]:
    """The lengths whose shares' cuts the fit times: drawn apart from the run's own."""
    return lognormal_lengths(400, seed=99)


def pin_to_a_core(rank: int) -> None:
    """This rank's process on a core of its own, where the machine has one for each rank (else as it was)."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cores) >= 2:
        os.sched_setaffinity(0, {cores[rank]})


def _repeat(
    deals: dict[str, BalancedBatchSampler], data: list[Tensor], rank: int, cost: StepCost, swap: bool
) -> dict[str, dict[str, Any]]:
    """One repeat: every step of the epoch, each deal's in turn (the order alternating step by step), so that a
    machine that slows down or speeds up in the middle of a repeat moves every deal alike. ``swap``: the ranks run
    each other's share (the same update), so that each share's time is taken on both cores."""
    model = CausalLM()  # the runs never step the weights: one model serves every deal
    batches = {name: deal.global_batches(0) for name, deal in deals.items()}
    runs: dict[str, dict[str, Any]] = {
        name: {"compute": [], "sync": [], "tokens": [], "modelled": [], "grads": [], "seconds": 0.0} for name in deals
    }
    for step in range(len(next(iter(batches.values())))):
        for name in list(deals)[:: 1 if step % 2 else -1]:
            batch, run = batches[name][step], runs[name]
            dist.barrier()  # the step starts on both ranks at once, as after the previous step's sync
            start = time.perf_counter()
            mine = deals[name].deal(batch, 2)[rank ^ swap]  # dealt in the timed step, as a sampler deals
            c, s, flat = rank_step(model, [data[i] for i in mine], sum(len(data[i]) for i in batch) - len(batch))
            if step == 0:  # warm-up
                continue
            run["seconds"] += time.perf_counter() - start
            run["compute"].append(c), run["sync"].append(s), run["tokens"].append(sum(len(data[i]) for i in mine))
            run["modelled"].append(cost.of([len(data[i]) for i in mine]))  # the fit's price of this share
            if len(run["grads"]) < 2:
                run["grads"].append(flat)
    for name, run in runs.items():
        run.update(share=rank ^ swap, samples=sum(len(b) for b in batches[name][1:]), batches=batches[name][1:3])
    return runs


def measured(args: argparse.Namespace, out: str) -> tuple[dict[str, Any], StepCost]:
    """The measured table, and the step cost the ranks agreed on."""
    port = random.Random(os.getpid()).randint(20000, 40000)
    mp.start_processes(_worker, args=(port, args, out), nprocs=2, start_method="spawn")
    ranks = [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(2)]
    table = {}
    for per_rank in PER_RANK:
        key, row = str(per_rank), {}
        for name in ("at random", "by cost", SAME):
            runs = [r[key][name] for r in ranks]
            compute = [
                max(a, b) / ((a + b) / 2)
                for i in range(len(runs[0]))
                for a, b in zip(runs[0][i]["compute"], runs[1][i]["compute"], strict=True)
            ]
            tokens, modelled = (
                [
                    max(a, b) / ((a + b) / 2)
                    for i in range(len(runs[0]))
                    for a, b in zip(runs[0][i][figure], runs[1][i][figure], strict=True)
                ]
                for figure in ("tokens", "modelled")
            )
            step = [sum(r["compute"]) + sum(r["sync"]) for r in runs[0]]
            row[name] = {
                "compute_imbalance": statistics.median(compute),
                "share_compute_imbalance": share_compute_imbalance(runs),
                "token_imbalance": statistics.median(tokens),
                "modelled_imbalance": statistics.median(modelled),
                "samples_per_s": [
                    r["samples"] / max(r0["seconds"], r1["seconds"])
                    for r, r0, r1 in zip(runs[0], runs[0], runs[1], strict=True)
                ],
                "compute_share": statistics.median(sum(r["compute"]) / r["seconds"] for r in runs[0] + runs[1]),
                "step_s": statistics.median(step),
            }
        ratios, ceiling = (
            [b / a for a, b in zip(row["at random"]["samples_per_s"], row[name]["samples_per_s"], strict=True)]
            for name in ("by cost", SAME)
        )
        reference = full_batch_grads(ranks[0][key]["at random"][0]["batches"], make_data(per_rank, args.steps)[1])
        g_random, g_cost = ranks[0][key]["at random"][0]["grads"], ranks[0][key]["by cost"][0]["grads"]
        row["speedup"] = {"median": statistics.median(ratios), "range": [min(ratios), max(ratios)]}
        # Both ranks at the same share: a deal that balanced perfectly, on the same work. What no deal can pass here.
        row["ceiling"] = {"median": statistics.median(ceiling), "range": [min(ceiling), max(ceiling)]}
        row["parity"] = {
            "by_cost_vs_random": max(
                float((a - b).abs().max() / b.abs().max()) for a, b in zip(g_cost, g_random, strict=True)
            ),
            "by_cost_vs_full_batch": max(
                float((a - b).abs().max() / b.abs().max()) for a, b in zip(g_cost, reference, strict=True)
            ),
            "replicas": max(
                float((a - b).abs().max()) for a, b in zip(g_cost, ranks[1][key]["by cost"][0]["grads"], strict=True)
            ),
        }
        table[key] = row
    return table, ranks[0]["pass_cost"]


def share_compute_imbalance(runs: list[list[dict[str, Any]]]) -> float:
    """The slowest share's compute time over the mean, each share's time the median of its repeats (on both cores).

    The ranks swap shares every other repeat, so a core that runs slower than the other through a run (by 1-6% on this
    machine, which differs from run to run) moves both shares' medians alike: what is left is the deal's imbalance.
    Median over steps.
    """
    steps = len(runs[0][0]["compute"])
    per_step = []
    for step in range(steps):
        medians = [
            statistics.median(run["compute"][step] for rank_runs in runs for run in rank_runs if run["share"] == share)
            for share in (0, 1)
        ]
        per_step.append(max(medians) / statistics.mean(medians))
    return statistics.median(per_step)


def make_data(per_rank: int, steps: int) -> tuple[list[int], list[Tensor]]:
    """The run's lengths and token ids: ``steps + 1`` global batches (the first is the warm-up)."""
    lengths = lognormal_lengths(2 * per_rank * (steps + 1), seed=per_rank)
    g = torch.Generator().manual_seed(1)
    return lengths, [torch.randint(1, VOCAB, (n,), generator=g) for n in lengths]


def full_batch_grads(batches: list[list[int]], data: list[Tensor]) -> list[Tensor]:
    """The reference: each step's global batch in one padded pass, token mean (the runs never step the weights)."""
    model, out = CausalLM(), []
    for batch in batches:
        model.zero_grad(set_to_none=True)
        ids, labels = padded([data[i] for i in batch])
        (model.token_loss_sum(ids, labels) / int((labels[:, 1:] != -100).sum())).backward()
        out.append(torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None]))
    return out


# ---- simulation ------------------------------------------------------------------------------------------------


def sampler_kwargs(cost: StepCost) -> dict[str, Any]:
    """The fitted step cost as `BalancedBatchSampler`'s keywords."""
    return {
        "micro_batch_tokens": cost.micro_batch_tokens,
        "pass_cost_tokens": cost.pass_cost_tokens,
        "quadratic": cost.quadratic,
    }


def simulate(cost: StepCost, quick: bool) -> dict[str, dict[str, dict[str, float]]]:
    table: dict[str, dict[str, dict[str, float]]] = {}
    for ranks in SIM_RANKS[:2] if quick else SIM_RANKS:
        for per_rank in SIM_PER_RANK[:2] if quick else SIM_PER_RANK:
            steps = 2 if quick else max(2, min(20, 4096 // (ranks * per_rank)))
            figures: dict[str, list[float]] = {"at random": [], "by cost": [], "bound": [], "slowest vs random": []}
            for step in range(steps):
                lengths = lognormal_lengths(ranks * per_rank, seed=1000 + step)
                batch = list(range(len(lengths)))
                sampler = BalancedBatchSampler(
                    lengths, len(lengths), num_replicas=ranks, rank=0, **sampler_kwargs(cost)
                )
                slowest = {}
                for name, deal in (
                    ("at random", _StrideDeal.deal(sampler, batch, ranks)),
                    ("by cost", sampler.deal(batch, ranks)),
                ):
                    steps_s = [cost.of([lengths[i] for i in part]) for part in deal]
                    figures[name].append(balancing.imbalance(steps_s))
                    slowest[name] = max(steps_s)
                # What the step costs: the slowest rank's price, dealt by cost over dealt at random.
                figures["slowest vs random"].append(slowest["by cost"] / slowest["at random"])
                # No deal does better than the dearest sample alone on one rank, nor than the mean.
                mean = statistics.mean(steps_s)
                figures["bound"].append(max(mean, max(cost.of([n]) for n in lengths)) / mean)
            table[f"{ranks} x {per_rank}"] = {
                name: {"mean": statistics.mean(v), "max": max(v)} for name, v in figures.items()
            }
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--quick", action="store_true", help="2 repeats of 2 steps, a smaller simulation")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.steps = 2, 1
    import tempfile

    torch.set_num_threads(1)
    clock = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        table, cost = measured(args, out)
    wall = {"measured": time.perf_counter() - clock}
    sampler = sampler_kwargs(cost)
    q = sampler["quadratic"]
    shapes = len(pass_shapes(calibration_lengths(), BUDGET, per_rank=8))
    print(
        f"sampler (by cost): micro_batch_tokens={sampler['micro_batch_tokens']},"
        f" pass_cost_tokens={sampler['pass_cost_tokens']:.1f}, quadratic={'None' if q is None else f'{q:.0f}'}"
        f" (measure_step_cost in both ranks at once, on {shapes} shapes)\n"
    )
    print(
        "| per rank | deal | slowest rank's compute / mean, a step as it ran | the slowest share's, its repeats' median on both cores | its tokens / mean | its priced step / mean | samples/s vs at random (range) | forward+backward share |"  # noqa: E501 (a table row)
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for per_rank, row in table.items():
        for name in ("at random", "by cost", SAME):
            f = row[name]
            speed = {
                "at random": "1.00",
                "by cost": f"{row['speedup']['median']:.2f}x ({row['speedup']['range'][0]:.2f}-{row['speedup']['range'][1]:.2f})",  # noqa: E501 (a table row)
                SAME: f"{row['ceiling']['median']:.2f}x ({row['ceiling']['range'][0]:.2f}-{row['ceiling']['range'][1]:.2f}): the ceiling",  # noqa: E501 (a table row)
            }[name]
            print(
                f"| {per_rank} | {name} | {f['compute_imbalance']:.3f} | {f['share_compute_imbalance']:.3f} | {f['token_imbalance']:.3f} | {f['modelled_imbalance']:.3f} | {speed} | {f['compute_share']:.0%} |"  # noqa: E501 (a table row)
            )
        p = row["parity"]
        print(
            f"parity at {per_rank} per rank: by cost vs at random {p['by_cost_vs_random']:.1e}, vs one full-batch pass {p['by_cost_vs_full_batch']:.1e}, replicas {p['replicas']:.1e}; 0 OOMs (none can occur: CPU)"  # noqa: E501 (a table row)
        )
    clock = time.perf_counter()
    sim = simulate(cost, args.quick)
    wall["simulated"] = time.perf_counter() - clock
    print(
        "\n| ranks x per rank | at random: slowest / mean (worst) | by cost: slowest / mean (worst) | the dearest sample alone / by cost's mean (worst) | by cost's slowest / at random's (worst) |"  # noqa: E501 (a table row)
    )
    print("|---|---:|---:|---:|---:|")
    for key, row in sim.items():
        print(
            f"| {key} | {row['at random']['mean']:.3f} ({row['at random']['max']:.3f}) | {row['by cost']['mean']:.3f} ({row['by cost']['max']:.3f}) | {row['bound']['mean']:.3f} ({row['bound']['max']:.3f}) | {row['slowest vs random']['mean']:.3f} ({row['slowest vs random']['max']:.3f}) |"  # noqa: E501 (a table row)
        )
    print(
        "RESULT "
        + json.dumps(
            {
                "measured": table,
                "pass_cost": sampler,
                "sampler": sampler,
                "simulated": sim,
                "wall_s": wall,
            }
        )
    )


if __name__ == "__main__":
    main()
