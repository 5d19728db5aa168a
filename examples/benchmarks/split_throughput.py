"""Split mode, side by side in one run: steady-state throughput of AutoMicroBatching("auto") against fixed
micro-batch sizes under the same memory budget, and OOMs until settled (predictive planner vs plain halving).

    OMP_NUM_THREADS=1 python examples/benchmarks/split_throughput.py [--steps 30] [--repeats 3]

The budget is a number of bytes above the process's resident set at start; "fits" means the run's peak resident set
stayed under it. Ratios, not times, are the result: the machine is shared.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_accum import AutoMicroBatching
from lightning_accum.memory.backends import CPUBackend

STEP_BATCH = 2048
WIDTH = 4096
# A Trainer that writes nothing: no logger, checkpoint, progress bar or model summary.
QUIET = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False}


class Wide(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Linear(64, WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH // 8), nn.GELU(), nn.Linear(WIDTH // 8, 1)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Timer(pl.Callback):
    def __init__(self, warmup: int) -> None:
        self.warmup, self.start, self.samples, self.elapsed = warmup, 0.0, 0, 0.0
        self.peak = 0
        self.backend = CPUBackend()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.warmup:
            self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        # AutoMicroBatching reset the peak at this step's start; read it before the next step resets it again.
        if trainer.global_step > self.warmup:
            self.peak = max(self.peak, self.backend.peak_bytes())
            self.samples += len(batch[0])
            self.elapsed = time.perf_counter() - self.start


def run(micro_batch_size, budget: int, steps: int, predictive: bool = True) -> tuple[float, int, AutoMicroBatching]:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(STEP_BATCH * steps, 64, generator=g), torch.randn(STEP_BATCH * steps, 1, generator=g)
    )
    callback = AutoMicroBatching(
        micro_batch_size,
        max_memory=budget,
        pin_micro_batch_size=micro_batch_size != "auto",
        predictive=predictive,
        grow_patience=5,
    )
    timer = Timer(warmup=steps // 3)
    trainer = pl.Trainer(accelerator="cpu", max_epochs=1, callbacks=[callback, timer], **QUIET)
    trainer.fit(Wide(), DataLoader(data, batch_size=STEP_BATCH))
    return timer.samples / timer.elapsed, timer.peak, callback


def worker(candidate: str, budget: int, steps: int) -> None:
    size: int | str = candidate if candidate == "auto" else int(candidate)
    throughput, peak, callback = run(size, budget, steps)
    last = callback.last_step_report
    print(
        "RESULT",
        json.dumps(
            {
                "throughput": throughput,
                "peak": peak,
                "micro_batch_size": last.micro_batch_size,
                "k": last.accumulation_steps,
                "events": [(e.kind, e.before, e.after) for e in callback.events],
            }
        ),
    )


def measure(candidate: str | int, budget: int, steps: int) -> dict:
    """One configuration in a fresh process: resident-set peaks of earlier runs in the same process would leak in."""
    command = [sys.executable, __file__, "--worker", str(candidate), "--budget", str(budget), "--steps", str(steps)]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    return json.loads(next(line for line in out.splitlines() if line.startswith("RESULT"))[len("RESULT ") :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker")
    parser.add_argument("--budget", type=int, default=2**50)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.budget, args.steps)
        return

    # Calibrate: the budget sits half-way between the steady peaks of the smallest and the largest fixed size, so
    # the largest sizes don't fit and the smallest waste throughput.
    small_peak = measure(128, 2**50, args.steps)["peak"]
    full_peak = measure(STEP_BATCH, 2**50, args.steps)["peak"]
    budget = (small_peak + full_peak) // 2
    print(
        f"budget: {budget / 2**30:.3f} GiB resident (steady peaks: b=128 {small_peak / 2**30:.3f},"
        f" b={STEP_BATCH} {full_peak / 2**30:.3f} GiB)"
    )
    candidates: list[int | str] = ["auto", 2048, 1024, 512, 256, 128]
    results: dict[str, list[float]] = {str(c): [] for c in candidates}
    over_budget: set[str] = set()
    for repeat in range(args.repeats):
        for candidate in candidates:  # interleaved, so drift in machine load hits every candidate alike
            result = measure(candidate, budget, args.steps)
            results[str(candidate)].append(result["throughput"])
            if result["peak"] > budget:
                over_budget.add(str(candidate))
            if repeat == 0:
                print(
                    f"  {candidate!s:>5}: settled micro-batch {result['micro_batch_size']}, k={result['k']},"
                    f" steady peak {(result['peak'] - budget) / 2**20:+.0f} MiB vs budget, events {result['events']}"
                )
    print(f"median samples/s over {args.repeats} interleaved repeats:")
    medians = {c: statistics.median(v) for c, v in results.items()}
    for c, m in medians.items():
        print(f"  {c:>5}: {m:8.1f}{'  (over budget)' if c in over_budget else ''}")
    fixed = {c: m for c, m in medians.items() if c != "auto" and c not in over_budget}
    if "auto" in over_budget:
        print("auto went over the budget in its steady state")
    if fixed:
        best = max(fixed, key=fixed.__getitem__)
        print(f"auto / best fixed size under the budget ({best}): {medians['auto'] / fixed[best]:.3f}")
    else:
        print("no fixed size stayed under the budget")


if __name__ == "__main__":
    main()
