"""Throughput with and without AccumulationMonitor, side by side in one process.

    OMP_NUM_THREADS=1 python examples/benchmarks/monitor_overhead.py [--repeats 7]

Prints, for a tiny model (the worst case: the fixed per-step cost against a step that costs almost nothing) and for
an MLP whose micro-batch takes tens of milliseconds, the median samples/s of plain Lightning
(`accumulate_grad_batches=4`), of `AccumulationScheduler(4)` alone, with `AccumulationMonitor()` at its default
interval (`Trainer(log_every_n_steps)`) and with the monitor logging every step, and each variant's ratio to plain
Lightning (1.0: no overhead), as the median of the ratios of interleaved runs. Each variant also reports the share
of its wall time spent inside lightning_accum's hooks, and of that the monitor's own: read inside each run, so free
of the run-to-run noise of a shared machine.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
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
        self.hook_seconds = 0.0  # wall time inside the timed callbacks' hooks (see `_time_hooks`)
        self.monitor_seconds = 0.0  # the part of it inside AccumulationMonitor's

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        self.samples += len(batch[0])

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.seconds = time.perf_counter() - self._start


def time_methods(obj: Any, names: list[str], add_seconds: Callable[[float], None]) -> None:
    """Patch the methods ``names`` of ``obj`` (this instance only) to pass the wall time each call took on."""
    for name in names:
        original = getattr(obj, name)

        def timed(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                add_seconds(time.perf_counter() - start)

        setattr(obj, name, timed)


def _time_hooks(callback: pl.Callback, clock: _Clock) -> None:
    """Add the wall time spent in ``callback``'s own hooks to ``clock.hook_seconds``.

    That time is the callback's cost read inside the run itself, so it is free of the run-to-run noise of a shared
    machine, where one matrix multiply's time varies by 2x between runs of the same variant.
    """
    # The hooks the callback implements itself.
    hooks = [
        n for n in dir(pl.Callback) if n.startswith("on_") and getattr(type(callback), n) is not getattr(pl.Callback, n)
    ]

    is_monitor = isinstance(callback, AccumulationMonitor)

    def add(seconds: float) -> None:
        clock.hook_seconds += seconds
        if is_monitor:
            clock.monitor_seconds += seconds

    time_methods(callback, hooks, add)


VARIANTS = ("plain Lightning", "scheduler", "scheduler + monitor", "scheduler + monitor(logging_interval=1)")
# A Trainer that writes nothing: no logger, checkpoint, progress bar or model summary.
QUIET = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False}


def _samples_per_sec(
    variant: str, dim: int, hidden: int, n: int, batch_size: int, k: int, root: str
) -> tuple[float, float, float]:
    """Samples per second, and the shares of the run's wall time inside lightning_accum's hooks and the monitor's."""
    clock = _Clock()
    callbacks: list[pl.Callback] = [clock]
    if variant != "plain Lightning":
        callbacks.insert(0, AccumulationScheduler(k))
    if variant == "scheduler + monitor":
        callbacks.append(AccumulationMonitor())  # the default: follows Trainer(log_every_n_steps)
    elif variant == "scheduler + monitor(logging_interval=1)":
        callbacks.append(AccumulationMonitor(logging_interval=1))
    for callback in callbacks:
        if callback is not clock:
            _time_hooks(callback, clock)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(n, dim, generator=g), torch.randn(n, 1, generator=g))
    trainer = pl.Trainer(
        default_root_dir=root,
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        callbacks=callbacks,
        accumulate_grad_batches=k if variant == "plain Lightning" else 1,
        num_sanity_val_steps=0,
        **QUIET,
    )
    trainer.fit(_Model(dim, hidden), DataLoader(data, batch_size=batch_size))
    return clock.samples / clock.seconds, clock.hook_seconds / clock.seconds, clock.monitor_seconds / clock.seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--root", default="/tmp/lightning_accum_overhead")
    parser.add_argument("--quick", action="store_true", help="fewer samples (a smoke test, not a measurement)")
    parser.add_argument("--only", default="", help="run only the cases whose name contains this, e.g. MLP")
    args = parser.parse_args()
    torch.set_num_threads(1)
    scale = 8 if args.quick else 1
    cases = {
        "tiny linear (6->1), b=4, k=4": {"dim": 6, "hidden": 0, "n": 4096 // scale, "batch_size": 4, "k": 4},
        "MLP (1024->2048->1), b=64, k=4": {"dim": 1024, "hidden": 2048, "n": 8192 // scale, "batch_size": 64, "k": 4},
    }
    for name, case in cases.items():
        if args.only and args.only not in name:
            continue
        runs: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
        shares: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
        monitor_shares: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
        for repeat in range(args.repeats):
            # Interleaved, so drift in machine load hits every variant alike, and rotated, so no variant always
            # runs first (warm caches and clocks favoured whichever ran first).
            shift = repeat % len(VARIANTS)
            for variant in VARIANTS[shift:] + VARIANTS[:shift]:
                rate, share, monitor_share = _samples_per_sec(variant, root=args.root, **case)
                runs[variant].append(rate)
                shares[variant].append(share)
                monitor_shares[variant].append(monitor_share)
        base = statistics.median(runs["plain Lightning"])
        print(f"{name}: plain Lightning {base:,.0f} samples/s (median of {args.repeats})")
        for variant in VARIANTS[1:]:
            paired = [m / b for m, b in zip(runs[variant], runs["plain Lightning"], strict=True)]
            share = statistics.median(shares[variant])
            monitor = (
                f", the monitor's {statistics.median(monitor_shares[variant]):.2%}" if "monitor" in variant else ""
            )
            print(
                f"    {variant}: {statistics.median(runs[variant]):,.0f} samples/s, ratio to plain"
                f" {statistics.median(paired):.3f} (median of paired ratios {[round(r, 3) for r in paired]});"
                f" inside lightning_accum's hooks {share:.2%} of the wall time (median){monitor}, a ratio of about"
                f" {1 - share:.3f} if nothing else differed"
            )


if __name__ == "__main__":
    main()
