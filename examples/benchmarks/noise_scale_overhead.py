"""What measuring the gradient noise scale costs: AccumulationMonitor with and without it, side by side.

    OMP_NUM_THREADS=1 python examples/benchmarks/noise_scale_overhead.py [--repeats 7] [--only MLP] [--profile]

Both variants run `AccumulationScheduler(k)` and `AccumulationMonitor()` at its default interval
(`Trainer(log_every_n_steps)`) on the same model and data; two of them also pass `gradient_noise_scale=True`, one with
`noise_scale_interval=4` (every 4th window measured). The
estimate costs a squared norm over the gradients after each window's first backward, another at the optimizer step
and one host read per step. Printed for each case: the median samples/s of each variant, per wall-clock second and
per CPU second of this process, and the throughput ratio (noise scale / without; 1.0: no overhead) on each clock as
the median of the ratios of interleaved runs, the variant order rotated every repeat. The target is a ratio >= 0.98.
On a shared machine single ratios scatter by +-10%, so it also prints the share of each run's wall time spent inside
the estimator's own hooks (timed within the run, on this scheduler instance only): the steadiest figure.

Cases: a tiny linear model (the worst case: a fixed per-step cost against a step that costs almost nothing), an MLP
whose micro-batch takes tens of milliseconds (the house benchmark of `monitor_overhead.py`), and the byte-level LM of
`examples/char_lm` with token counts (`CountTokens`), the model `examples/noise_scale` measures.

``--profile`` runs each variant of each case once more under cProfile and prints the `lightning_accum` functions
(and the torch built-ins they call) whose cumulative time grew most, so an overhead above the target can be traced.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    # Run as a script: make the repository root importable so that `examples.*` resolves as under `-m`.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from examples.benchmarks.monitor_overhead import QUIET, _Clock, _Model, time_methods
from examples.char_lm.data import CharLMDataModule
from examples.char_lm.model import CharLM
from lightning_accum import AccumulationMonitor, AccumulationScheduler
from lightning_accum.items import CountTokens

VARIANTS = ("monitor", "monitor + noise scale", "monitor + noise scale every 4th window")
NOISE_INTERVAL = {"monitor + noise scale": 1, "monitor + noise scale every 4th window": 4}


class _Clocks(_Clock):
    """`_Clock`'s wall-clock seconds, and the CPU seconds this process spent in the same span.

    On a machine shared with other work, wall time counts the time other processes held the cores; CPU time counts
    only this process's own work (torch runs on one thread here), so its ratio is the steadier of the two.
    """

    def __init__(self) -> None:
        super().__init__()
        self.cpu_seconds = 0.0
        self.noise_seconds = 0.0  # wall time inside the estimator's own hooks (see `_time_noise_hooks`)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._cpu_start = time.process_time()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        self.cpu_seconds = time.process_time() - self._cpu_start

    def rates(self) -> tuple[float, float, float]:
        """Samples per wall-clock second, per CPU second, and the share of the wall time spent in the estimator."""
        return self.samples / self.seconds, self.samples / self.cpu_seconds, self.noise_seconds / self.seconds


class _CharLMClock(_Clocks):
    """Both rates for dict batches (`_Clock` counts ``batch[0]``)."""

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        self.samples += len(batch["labels"])


def _time_noise_hooks(scheduler: AccumulationScheduler, clock: _Clocks) -> None:
    """Add the wall time spent in the estimator's two hooks to ``clock.noise_seconds`` (patched on this instance only).

    ``on_after_backward`` reads the first micro-batch's squared norm; the engine's noise meter (`measure`) reads the
    window's and turns the pair into estimates. Without ``gradient_noise_scale`` both return at once, so their time is
    the overhead, read inside the run itself and therefore free of the run-to-run noise of a shared machine.
    """

    def add(seconds: float) -> None:
        clock.noise_seconds += seconds

    time_methods(scheduler, ["on_after_backward"], add)
    time_methods(scheduler.engine.noise, ["measure"], add)


def _trainer(variant: str, k: int, clock: _Clocks, root: str, count_items: Any = None) -> pl.Trainer:
    scheduler = AccumulationScheduler(k, count_items=count_items)
    _time_noise_hooks(scheduler, clock)
    callbacks: list[pl.Callback] = [
        scheduler,
        AccumulationMonitor(
            gradient_noise_scale=variant in NOISE_INTERVAL,
            noise_scale_interval=NOISE_INTERVAL.get(variant, 1),
            progress_bar=False,
            summary=False,
        ),
        clock,
    ]
    return pl.Trainer(
        default_root_dir=root,
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        callbacks=callbacks,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        **QUIET,
    )


def _regression(variant: str, dim: int, hidden: int, n: int, batch_size: int, k: int, root: str) -> tuple[float, float]:
    clock = _Clocks()
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(n, dim, generator=g), torch.randn(n, 1, generator=g))
    _trainer(variant, k, clock, root).fit(_Model(dim, hidden), DataLoader(data, batch_size=batch_size))
    return clock.rates()


def _char_lm(variant: str, n: int, batch_size: int, k: int, root: str) -> tuple[float, float, float]:
    clock = _CharLMClock()
    data = CharLMDataModule(batch_size=batch_size, max_length=64, val_fraction=0.0, max_sequences=n, seed=0)
    pl.seed_everything(0, verbose=False)
    model = CharLM(max_length=64, d_model=64, n_layers=2, n_heads=4)
    _trainer(variant, k, clock, root, count_items=CountTokens(key="labels")).fit(model, datamodule=data)
    return clock.rates()


def cases(quick: bool) -> dict[str, tuple[Any, dict[str, Any]]]:
    """The cases by name: the function that runs one variant, and its settings."""
    scale = 8 if quick else 1
    return {
        "tiny linear (6->1), b=4, k=4": (
            _regression,
            {"dim": 6, "hidden": 0, "n": 4096 // scale, "batch_size": 4, "k": 4},
        ),
        "MLP (1024->2048->1), b=64, k=4": (
            _regression,
            {"dim": 1024, "hidden": 2048, "n": 8192 // scale, "batch_size": 64, "k": 4},
        ),
        "char LM (d=64, 2 layers, <=64 bytes), b=8, k=4, CountTokens": (
            _char_lm,
            {"n": 2048 // scale, "batch_size": 8, "k": 4},
        ),
    }


def measure(run: Any, case: dict[str, Any], repeats: int, root: str) -> dict[str, list[tuple[float, float, float]]]:
    """(wall samples/s, CPU samples/s, estimator share) of every variant, ``repeats`` times, interleaved, rotated."""
    runs: dict[str, list[tuple[float, float, float]]] = {variant: [] for variant in VARIANTS}
    for repeat in range(repeats):
        # Interleaved, so drift in machine load hits both variants alike, and rotated, so neither always runs first
        # (warm caches and clocks favoured whichever ran first).
        shift = repeat % len(VARIANTS)
        for variant in VARIANTS[shift:] + VARIANTS[:shift]:
            runs[variant].append(run(variant, root=root, **case))
    return runs


def paired_ratios(
    runs: dict[str, list[tuple[float, float, float]]], clock: int = 0, variant: str = VARIANTS[1]
) -> list[float]:
    """Per repeat, the throughput of ``variant`` over that without the noise scale (``clock`` 0: wall, 1: CPU)."""
    return [a[clock] / b[clock] for a, b in zip(runs[variant], runs[VARIANTS[0]], strict=True)]


def profile(run: Any, case: dict[str, Any], root: str, top: int = 10) -> None:
    """Run each variant once under cProfile and print where the package's own functions spend the difference.

    Only ``lightning_accum`` functions (and the torch built-ins they call) are listed: the frames around a whole run
    differ by the run-to-run noise of the machine, which says nothing about the estimator.
    """
    stats: dict[str, dict[tuple[str, int, str], float]] = {}
    for variant in VARIANTS:
        profiler = cProfile.Profile()
        profiler.runcall(run, variant, root=root, **case)
        table = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
        stats[variant] = {
            func: row[3]  # cumulative seconds
            for func, row in table.items()
            if "lightning_accum" in func[0] or any("lightning_accum" in caller[0] for caller in row[4])
        }
    without, with_ = stats[VARIANTS[0]], stats[VARIANTS[1]]
    growth = sorted(((with_[f] - without.get(f, 0.0), f) for f in with_), reverse=True)
    print("    profile (one run each under cProfile): lightning_accum functions, cumulative s, with noise scale:")
    for seconds, (path, line, name) in growth[:top]:
        where = f"{Path(path).name}:{line}"
        print(f"      {with_[(path, line, name)]:7.3f} s ({seconds:+.3f} s vs without)  {name}  ({where})")


def main(argv: list[str] | None = None) -> dict[str, dict[str, list[tuple[float, float, float]]]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--root", default="/tmp/lightning_accum_noise_overhead")
    parser.add_argument("--quick", action="store_true", help="fewer samples (a smoke test, not a measurement)")
    parser.add_argument("--only", default="", help="run only the cases whose name contains this, e.g. MLP")
    parser.add_argument("--profile", action="store_true", help="also profile each variant once (see above)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results: dict[str, dict[str, list[tuple[float, float, float]]]] = {}
    for name, (run, case) in cases(args.quick).items():
        if args.only and args.only not in name:
            continue
        runs = measure(run, case, args.repeats, args.root)
        results[name] = runs
        print(f"{name}:")
        for variant in VARIANTS:
            wall = statistics.median(r[0] for r in runs[variant])
            cpu = statistics.median(r[1] for r in runs[variant])
            print(f"    {variant}: {wall:,.0f} samples/s wall, {cpu:,.0f} per CPU second (median of {args.repeats})")
        for variant in VARIANTS[1:]:
            for clock, label in enumerate(("wall-clock", "CPU-time")):
                ratios = paired_ratios(runs, clock, variant)
                ratio = statistics.median(ratios)
                verdict = "meets" if ratio >= 0.98 else "BELOW"
                print(
                    f"    {variant}: {label} ratio {ratio:.3f} ({verdict} the 0.98 target; median of paired ratios"
                    f" {[round(r, 3) for r in ratios]})",
                    flush=True,
                )
            share = statistics.median(r[2] for r in runs[variant])
            print(
                f"    {variant}: inside the estimator's hooks {share:.2%} of the run's wall time (median), a ratio of"
                f" about {1 - share:.3f} if nothing else changed",
                flush=True,
            )
        if args.profile:
            profile(run, case, args.root)
    return results


if __name__ == "__main__":
    main()
