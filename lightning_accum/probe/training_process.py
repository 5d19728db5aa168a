"""What a training process holds on the CPU before its first tensor, beyond what the probe's own process holds.

On the CPU split mode's planner holds the process's peak resident set to ``max_memory``: the interpreter, the
libraries, the Trainer and its loggers count as much as the tensors. The probe reads the resident set in its own
process, which runs the steps by hand; a training process also holds a `lightning.pytorch.Trainer`, its loggers (W&B
imports a good deal), the monitor and the progress bar. Measured on the Hugging Face example's machine that was
about 35-60 MiB, enough for the probe's token budget to end a first step at 101% of the budget.

`measure_training_process` measures that difference instead of guessing it: two fresh interpreters run the same tiny
model for a few steps, one by hand as the probe does, one under a Trainer with a CSV logger, an offline
`WandbLogger` (where W&B is installed), `AccumulationMonitor` and `AutoMicroBatching`; each reports its peak resident
set. The two run side by side, a few seconds in all, once per process (the answer is cached).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

_TIMEOUT_SECONDS = 180


@dataclass(frozen=True)
class TrainingProcess:
    """The peak resident sets of a process that trains a tiny model under a Trainer and of one that steps it by hand.

    Attributes:
        trainer_bytes: the Trainer's process (with its loggers, the monitor and split mode).
        by_hand_bytes: the process that steps the same model by hand, as the probe does.
        loggers: the loggers the Trainer's process ran, as their class names.
    """

    trainer_bytes: int
    by_hand_bytes: int
    loggers: tuple[str, ...]

    @property
    def overhead_bytes(self) -> int:
        """What the Trainer's process held beyond the hand-stepped one (never below 0)."""
        return max(0, self.trainer_bytes - self.by_hand_bytes)


@functools.cache
def measure_training_process() -> TrainingProcess:
    """Run the two tiny processes side by side and read their peak resident sets.

    Raises:
        RuntimeError: a process failed or ran past its time; the message holds the end of its output.
    """
    wandb = importlib.util.find_spec("wandb") is not None
    with tempfile.TemporaryDirectory(prefix="lightning_accum_probe_") as work_dir:
        env = {
            **os.environ,
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            "WANDB_MODE": "offline",
            "WANDB_SILENT": "true",
            "WANDB_DIR": work_dir,
        }
        modes = ["by_hand", "trainer_wandb" if wandb else "trainer"]
        children = [
            subprocess.Popen(
                [sys.executable, "-m", __name__, mode, work_dir],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=env,
                cwd=work_dir,
            )
            for mode in modes
        ]
        peaks = [_peak_of(child, mode) for child, mode in zip(children, modes, strict=True)]
    loggers = ("CSVLogger", "WandbLogger") if wandb else ("CSVLogger",)
    return TrainingProcess(trainer_bytes=peaks[1], by_hand_bytes=peaks[0], loggers=loggers)


def _peak_of(child: subprocess.Popen[str], mode: str) -> int:
    try:
        output, _ = child.communicate(timeout=_TIMEOUT_SECONDS)
    except subprocess.TimeoutExpired:
        child.kill()
        output, _ = child.communicate()
        raise RuntimeError(f"the {mode} process ran past {_TIMEOUT_SECONDS} s: {output[-500:]}") from None
    lines = [line for line in output.splitlines() if line.startswith("peak_resident_bytes=")]
    if child.returncode != 0 or not lines:
        raise RuntimeError(f"the {mode} process failed (exit {child.returncode}): {output[-500:]}")
    return int(lines[-1].split("=", 1)[1])


def _run_child(mode: str, work_dir: str) -> None:  # pragma: no cover - runs in the child process
    import warnings

    import torch

    import lightning_accum.probe.measure  # noqa: F401 - the probe's own process has it imported
    from lightning_accum.memory.host import proc_kib

    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8))
    if mode == "by_hand":
        _step_by_hand(data)
    else:
        _train_under_a_trainer(data, work_dir, wandb=mode == "trainer_wandb")
    peak = proc_kib("/proc/self/status", "VmHWM")
    print(f"peak_resident_bytes={0 if peak is None else peak * 1024}", flush=True)
    if mode == "trainer_wandb":
        import wandb

        wandb.finish()


def _step_by_hand(data: Dataset[Any]) -> None:  # pragma: no cover - runs in the child process
    model = nn.Linear(8, 1)
    optimizer = torch.optim.AdamW(model.parameters())
    for (batch,) in DataLoader(data, batch_size=8):
        model(batch).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def _train_under_a_trainer(data: Dataset[Any], work_dir: str, wandb: bool) -> None:  # pragma: no cover - child
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger, Logger

    from lightning_accum import AccumulationMonitor, AutoMicroBatching

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(8, 1)

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            loss: torch.Tensor = self.layer(batch[0]).pow(2).mean()
            self.log("train/loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters())

    loggers: list[Logger] = [CSVLogger(work_dir, name="csv")]
    if wandb:
        from lightning.pytorch.loggers import WandbLogger

        loggers.append(WandbLogger(save_dir=work_dir, offline=True))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=4,
        logger=loggers,
        callbacks=[AccumulationMonitor(summary=False), AutoMicroBatching(max_memory=1 << 40)],
        enable_checkpointing=False,
        default_root_dir=work_dir,
        log_every_n_steps=1,
    )
    trainer.fit(Tiny(), DataLoader(data, batch_size=16))


if __name__ == "__main__":  # pragma: no cover - the child process
    _run_child(sys.argv[1], sys.argv[2])
