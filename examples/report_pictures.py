"""Train three small runs on CPU, logged to W&B offline, and draw their ``lightning-accum report`` pictures.

    OMP_NUM_THREADS=1 python examples/report_pictures.py [--out /tmp/report_pictures] [--images docs/images]

The pictures in docs/wandb.md come from here: split mode under a byte budget with one simulated OOM, window mode
with a step-keyed schedule, and the split-mode run again on two CPU processes under DDP. Each run is 30 optimizer
steps (about a minute and a half for all three on 2 CPU cores); nothing talks to W&B's servers. The W&B runs and
the text summaries go to ``--out``, the pictures to ``--images``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("WANDB_MODE", "offline")  # nothing here talks to W&B's servers
os.environ.setdefault("WANDB_SILENT", "true")

import lightning.pytorch as pl
import torch
import wandb
from lightning.pytorch.loggers import WandbLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_accum import AccumulationMonitor, AccumulationScheduler, AutoMicroBatching
from lightning_accum.cli.report import load_series, write_report
from lightning_accum.memory import OOMFault, OOMInjector, backend_for

IMAGES = Path(__file__).resolve().parents[1] / "docs" / "images"
STEPS = 30
STEP_BATCH = 32
WIDTH = 2**20  # hidden units: one sample's activations and their gradients take about 10 MiB
# The budget, above the resident set at the start. The fixed part (the model, its gradients, Lightning) and 16
# samples' activations fit it; 32 samples' peak passes it, so 32 shrinks to 16, and the memory model fitted to the
# two keeps the micro-batch at 16 from then on, except while the OOM's cool-down holds it below.
HEADROOM = 420 * 2**20
OOM_STEP = 12


class WideRegression(pl.LightningModule):
    """One wide hidden layer, so that memory grows with the micro-batch; logs its own loss, as a user's model does."""

    def __init__(self, width: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lr = 2 / width  # the output sums `width` activations: a larger step diverges
        self.net = nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 1))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def fit(out: Path, callbacks: list[pl.Callback], batch_size: int, width: int = WIDTH, **trainer_kwargs: Any) -> Path:
    """Train `STEPS` optimizer steps with `AccumulationMonitor`, logged to W&B offline; return the wandb/ directory."""
    x = torch.randn(100_000, 8, generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True) / 8**0.5), batch_size=batch_size, shuffle=True)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=STEPS,
        logger=WandbLogger(project="report-pictures", save_dir=str(out), log_model=False),
        log_every_n_steps=1,
        callbacks=[*callbacks, AccumulationMonitor()],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **trainer_kwargs,
    )
    trainer.fit(WideRegression(width), loader)
    wandb.finish()
    return out / "wandb"


def splitter(budget: int, oom: OOMFault) -> AutoMicroBatching:
    """Split mode from micro-batches of `STEP_BATCH` under ``budget``, with one injected OOM.

    A short patience and cool-down, so that 30 steps show a shrink, an OOM and growing back twice.
    """
    return AutoMicroBatching(
        STEP_BATCH,
        max_memory=budget,
        low_watermark=0.9,
        grow_patience=3,
        oom_cooldown=10,
        fault_injector=OOMInjector(oom),
    )


def split_mode(out: Path, budget: int) -> Path:
    """32 samples a step under a budget that fits 16 of them: shrinks, grows, and an OOM at `OOM_STEP`."""
    return fit(out / "split", [splitter(budget, OOMFault(step=OOM_STEP, phase="backward"))], STEP_BATCH)


def window_mode(out: Path) -> Path:
    """Micro-batches of 8, k = 1 for the first 10 steps, then 4 (no budget: window mode does not split)."""
    return fit(out / "window", [AccumulationScheduler({0: 1, 10: 4}, unit="step")], 8, width=4096)


def ddp(out: Path, budget: int) -> Path:
    """`split_mode` on 2 CPU processes (gloo), 32 samples a rank a step; the OOM strikes rank 1 alone."""
    owner = splitter(budget, OOMFault(step=OOM_STEP, phase="backward", rank=1))
    return fit(out / "ddp", [owner], STEP_BATCH, devices=2, strategy="ddp_spawn")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="/tmp/report_pictures", help="where the W&B runs go (default %(default)s)")
    parser.add_argument("--images", default=str(IMAGES), help="where the pictures go (default: docs/images)")
    args = parser.parse_args(argv)
    out, images = Path(args.out), Path(args.images)
    budget = backend_for("cpu").current_bytes() + HEADROOM  # before any run: the DDP ranks start from this too
    runs = {
        "split_mode": (split_mode(out, budget), "split mode: 32-sample steps under a byte budget, one simulated OOM"),
        "window_mode": (window_mode(out), "window mode: AccumulationScheduler({0: 1, 10: 4}, unit='step')"),
        "ddp": (ddp(out, budget), "DDP, 2 CPU ranks: split mode under a byte budget, one simulated OOM on rank 1"),
    }
    images.mkdir(parents=True, exist_ok=True)
    for name, (run_dir, title) in runs.items():
        picture = write_report(load_series(run_dir), out / f"report_{name}.png", title=title)
        print(f"{name}: {picture.with_suffix('.txt').read_text().strip()}")
        print(f"wrote {shutil.copy(picture, images)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
