"""Train under a real address-space limit where the whole step batch cannot fit (run as a subprocess).

Usage: python -m tests.scripts.real_oom OUT.pt HEADROOM_MIB [--no-limit] [--plain] [--bytearray] [--no-preflight]

``--plain`` trains without AutoMicroBatching (the unconstrained full-batch reference); ``--no-limit`` skips the
limit. ``--bytearray`` makes ``training_step`` first allocate a scratch ``bytearray`` of ``BYTEARRAY_PER_SAMPLE``
bytes per sample, whose failure is a bare ``MemoryError()`` without a message. ``--no-preflight`` starts cold from
the whole step batch, as before the pre-flight existed. The final parameters, what the callback did, its log lines
and each step's wall time are saved to OUT.pt.
"""

from __future__ import annotations

import logging
import resource
import sys
import time
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_accum import AutoMicroBatching
from tests.helpers import quiet_trainer_kwargs

STEP_BATCH = 2048
WIDTH = 8192
BYTEARRAY_PER_SAMPLE = 80 * 1024  # 160 MiB for the whole step batch: more than the headroom


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


class Wide(pl.LightningModule):
    def __init__(self, scratch_per_sample: int = 0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(64, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 1))
        self.sizes: list[int] = []
        self.scratch_per_sample = scratch_per_sample

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.sizes.append(len(x))
        if self.scratch_per_sample:
            scratch = bytearray(len(x) * self.scratch_per_sample)  # host scratch memory, e.g. a decoding buffer
            del scratch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class StepTimes(pl.Callback):
    """Wall time of each optimizer step, from batch start to batch end (the pre-flight runs inside the first)."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, i: int) -> None:
        self.seconds.append(time.perf_counter() - self._start)


def vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize")


def main() -> None:
    out, headroom_mib = sys.argv[1], int(sys.argv[2])
    plain = "--plain" in sys.argv
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(3 * STEP_BATCH, 64, generator=g), torch.randn(3 * STEP_BATCH, 1, generator=g))
    model = Wide(BYTEARRAY_PER_SAMPLE if "--bytearray" in sys.argv else 0)
    callback = None if plain else AutoMicroBatching("auto", max_memory=1.0, preflight="--no-preflight" not in sys.argv)
    times = StepTimes()
    lines = _Lines()
    logging.getLogger("lightning_accum").addHandler(lines)
    logging.getLogger("lightning_accum").setLevel(logging.INFO)
    trainer = pl.Trainer(
        **quiet_trainer_kwargs(accelerator="cpu", max_epochs=1, callbacks=[callback, times] if callback else [times])
    )
    loader = DataLoader(data, batch_size=STEP_BATCH)
    if "--no-limit" not in sys.argv:
        # Warm up allocator and threads first, so the limit bites on activations rather than on start-up.
        model.net(torch.randn(8, 64)).sum().backward()
        model.zero_grad()
        limit = vm_size() + headroom_mib * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    trainer.fit(model, loader)
    torch.save(
        {
            "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "sizes": model.sizes,
            "oom_retries": callback.oom_retries if callback else 0,
            "events": [(e.step, e.kind, e.before, e.after) for e in callback.events] if callback else [],
            "log": lines.lines,
            "step_seconds": times.seconds,
            "preflight_seconds": callback.preflight_result.seconds if callback and callback.preflight_result else None,
        },
        out,
    )


if __name__ == "__main__":
    main()
