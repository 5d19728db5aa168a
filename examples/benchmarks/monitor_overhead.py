"""Throughput with and without AccumulationMonitor, side by side in one process.

    OMP_NUM_THREADS=1 python examples/benchmarks/monitor_overhead.py [--repeats 7]

Prints, for a tiny model (the worst case: the monitor's fixed per-step cost against a step that costs almost
nothing) and for a small MLP, the median samples/s of each variant and their ratio (monitor / no monitor; 1.0 means
no overhead).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_accum import AccumulationScheduler
from lightning_accum.callbacks.accumulation_monitor import AccumulationMonitor


class _Model(pl.LightningModule):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        layers: list[nn.Module] = (
            [nn.Linear(dim, 1)] if hidden == 0 else [nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, 1)]
        )
        self.net = nn.Sequential(*layers)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class _Clock(pl.Callback):
    """Training samples per second between on_train_start and on_train_end."""

    def __init__(self) -> None:
        self.samples = 0
        self.seconds = 0.0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        self.samples += len(batch[0])

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.seconds = time.perf_counter() - self._start


def _samples_per_sec(monitor: int, dim: int, hidden: int, n: int, batch_size: int, k: int, root: str) -> float:
    clock = _Clock()
    callbacks: list[pl.Callback] = [AccumulationScheduler(k), clock]
    if monitor:
        callbacks.append(AccumulationMonitor(logging_interval=monitor))
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(n, dim, generator=g), torch.randn(n, 1, generator=g))
    trainer = pl.Trainer(
        default_root_dir=root,
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        callbacks=callbacks,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(_Model(dim, hidden), DataLoader(data, batch_size=batch_size))
    return clock.samples / clock.seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--root", default="/tmp/lightning_accum_overhead")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cases = {
        "tiny linear (6->1), b=4, k=2": {"dim": 6, "hidden": 0, "n": 4096, "batch_size": 4, "k": 2},
        "MLP (256->1024->1), b=64, k=4": {"dim": 256, "hidden": 1024, "n": 16384, "batch_size": 64, "k": 4},
    }
    for name, case in cases.items():
        # 0: no monitor; n: a monitor logging every n optimizer steps.
        runs: dict[int, list[float]] = {0: [], 1: [], 10: []}
        for _ in range(args.repeats):
            for monitor in runs:  # interleaved, so drift in machine load hits every variant alike
                runs[monitor].append(_samples_per_sec(monitor, root=args.root, **case))
        base = statistics.median(runs[0])
        print(f"{name}: no monitor {base:,.0f} samples/s (median of {args.repeats})")
        for interval in (1, 10):
            paired = [m / b for m, b in zip(runs[interval], runs[0], strict=True)]
            print(
                f"    monitor, logging_interval={interval}: {statistics.median(runs[interval]):,.0f} samples/s,"
                f" ratio {statistics.median(runs[interval]) / base:.3f}; paired ratios {[round(r, 2) for r in paired]}"
            )


if __name__ == "__main__":
    main()
