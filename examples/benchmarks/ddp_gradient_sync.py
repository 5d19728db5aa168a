"""What OOM-safety costs under DDP, side by side in one run (2 CPU processes, gloo).

    OMP_NUM_THREADS=1 python examples/benchmarks/ddp_gradient_sync.py [--steps 20] [--repeats 3]

Each configuration trains the same model on the same per-rank step batch of 256 samples:

* ``plain``: Lightning's DDP, the whole step batch in one pass (the fastest possible, no accumulation);
* ``window``: ``AccumulationScheduler(4)`` over micro-batches of 64 (DDP syncs the last backward);
* ``overlap``: ``AutoMicroBatching(64, gradient_sync="overlap")``: DDP syncs the last micro-batch's backward;
* ``deferred``: ``AutoMicroBatching(64)``, the OOM-safe default: every micro-batch under ``no_sync``, then one
  flattened all-reduce after all ranks agreed that no OOM happened.

Ratios of samples/s are the result (medians over interleaved repeats); each configuration runs in its own
``torchrun``-free subprocess pair started by Lightning's ``ddp`` launcher.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

STEP = 256
MICRO = 64
# A Trainer that writes nothing: no logger, checkpoint, progress bar or model summary.
QUIET = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False}


def worker(config: str, steps: int, out: str) -> None:
    import lightning.pytorch as pl
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_accum import AccumulationScheduler, AutoMicroBatching

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            # ~17M parameters: the all-reduce is a visible part of a step, as it is for real models on real links.
            self.net = nn.Sequential(
                nn.Linear(512, 4096), nn.GELU(), nn.Linear(4096, 4096), nn.GELU(), nn.Linear(4096, 1)
            )

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    class Timer(pl.Callback):
        def __init__(self) -> None:
            self.start = 0.0
            self.samples = 0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 2 and self.start == 0.0:
                self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if self.start:
                self.samples += len(batch[0])

        def on_train_end(self, trainer, pl_module):
            if trainer.is_global_zero:
                elapsed = time.perf_counter() - self.start
                with open(out, "w") as f:
                    json.dump({"samples_per_sec": self.samples * trainer.world_size / elapsed}, f)

    micro = config == "window"
    batch = MICRO if micro else STEP
    n = 2 * STEP * steps
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(n, 512, generator=g), torch.randn(n, 1, generator=g))
    callbacks: list[pl.Callback] = [Timer()]
    if config == "window":
        callbacks.insert(0, AccumulationScheduler(STEP // MICRO))
    elif config in ("overlap", "deferred"):
        callbacks.insert(0, AutoMicroBatching(MICRO, pin_micro_batch_size=True, gradient_sync=config))
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=steps, callbacks=callbacks, **QUIET)
    trainer.fit(Model(), DataLoader(data, batch_size=batch))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.out)
        return
    configs = ["plain", "window", "overlap", "deferred"]
    results: dict[str, list[float]] = {c: [] for c in configs}
    out = os.path.abspath("ddp_gradient_sync.json")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for _ in range(args.repeats):
        for config in configs:
            command = [
                sys.executable,
                os.path.abspath(__file__),
                "--worker",
                config,
                "--steps",
                str(args.steps),
                "--out",
                out,
            ]
            subprocess.run(command, env=env, check=True, capture_output=True)
            with open(out) as f:
                results[config].append(json.load(f)["samples_per_sec"])
    os.remove(out)
    medians = {c: statistics.median(v) for c, v in results.items()}
    print(f"median samples/s over {args.repeats} interleaved repeats (2 ranks x {STEP} samples per step):")
    for c in configs:
        print(f"  {c:>8}: {medians[c]:8.1f}   ({medians[c] / medians['plain']:.3f} x plain)")
    print(f"deferred / overlap: {medians['deferred'] / medians['overlap']:.3f}")


if __name__ == "__main__":
    main()
