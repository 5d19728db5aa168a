"""Pre-flight for split mode: fit ``peak(b)`` from two traced steps on fake tensors, before a real micro-batch runs.

Without it, `AutoMicroBatching("auto")` would start cold by halving from the whole step batch, and a failed attempt
leaves no peak to fit. `preflight` traces the step instead: a fake copy of the module and its optimizers (no weight,
state or batch is copied for real) runs a warm-up step, then one step of two micro-batches at each of two sizes, under a
`lightning_accum.memory.tracker.MemoryTracker`. The two peaks fit the same
`lightning_accum.memory.model.LinearPeakModel` the planner uses. Where tracing fails (an op without a fake
implementation, a data-dependent shape, a ``.item()`` in ``training_step``, an attribute ``deepcopy`` refuses), the
result holds no model and says why, and the caller falls back to probing for the size.

The traced peaks count live tensors only, so `Preflight.starting_micro_batch_size` predicts what a step *adds* to
the memory in use now, and fits it in what is free (under the budget, and under what the device can still
allocate), keeping a margin for what fake tensors can't see (see `lightning_accum.memory.fake`).

Examples:
    >>> import lightning.pytorch as pl
    >>> class Net(pl.LightningModule):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.layer = nn.Linear(64, 64)
    ...     def training_step(self, batch, batch_idx):
    ...         return self.layer(batch).square().mean()
    ...     def configure_optimizers(self):
    ...         return torch.optim.SGD(self.parameters(), lr=0.1)
    >>> found = preflight(Net(), torch.randn(32, 64), (4, 16))
    >>> found.reason is None, found.peak_model.per_sample_bytes > 0
    (True, True)
    >>> class DataDependent(Net):
    ...     def training_step(self, batch, batch_idx):
    ...         return self.layer(batch[: int(batch[0, 0] > 0) + 1]).sum()  # a shape read from the data
    >>> failed = preflight(DataDependent(), torch.randn(32, 64), (4, 16))
    >>> failed.peak_model is None, failed.reason.split(":")[0]
    (True, 'DataDependentOutputException')
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_accum._validation import check_int
from lightning_accum.memory.fake import CUDA_HEADROOM, FakeTarget
from lightning_accum.memory.model import LinearPeakModel
from lightning_accum.memory.precision import StepPrecision
from lightning_accum.memory.tracker import MemoryTracker
from lightning_accum.probe.measure import optimizers_of, train_step
from lightning_accum.splitting import BatchHooks


@dataclass(frozen=True)
class Preflight:
    """What `preflight` found: the fitted ``peak(b)`` of live tensors, or why there is none.

    Attributes:
        peak_model: the fit of the traced peaks, or ``None`` when tracing failed.
        reason: why tracing failed (the error's type and first line), or ``None``.
        peaks: the traced peak of live tensors for each micro-batch size.
        baseline_bytes: live tensors when the trace started: parameters, buffers, optimizer state already there,
            the step batch. The device holds these now too; the difference is what the trace can't see.
        seconds: how long the pre-flight took.
    """

    peak_model: LinearPeakModel | None
    reason: str | None = None
    peaks: dict[int, int] = field(default_factory=dict)
    baseline_bytes: int = 0
    seconds: float = 0.0

    def starting_micro_batch_size(
        self,
        budget_bytes: float,
        upper: int,
        current_bytes: int = 0,
        free_bytes: int | None = None,
        margin: float = CUDA_HEADROOM,
    ) -> int | None:
        """The largest micro-batch predicted to fit, or ``None`` (no model, or not even 1 fits).

        What a step adds to memory is its traced peak minus the live tensors when the trace started,
        ``peak(b) - baseline_bytes``. It must fit what is free, less ``margin`` of it for what the trace can't see:
        ``peak(b) - baseline_bytes <= (1 - margin) * min(budget_bytes - current_bytes, free_bytes)``.

        Args:
            budget_bytes: the memory budget, as the device backend measures it.
            upper: the step batch size: the micro-batch is never larger.
            current_bytes: what the backend measures now, before the step (the traced baseline is part of it).
            free_bytes: what the device can still allocate (`lightning_accum.memory.backends.free_bytes`), when
                that is less than the budget's room: under an address-space limit on CPU, for example.
            margin: the share of the free memory kept for what the trace can't see.

        Raises:
            ValueError: if ``margin`` is not in ``[0, 1)``.
        """
        if not 0 <= margin < 1:
            raise ValueError(f"`margin` must be a fraction in [0, 1), got {margin!r}.")
        if self.peak_model is None:
            return None
        room = budget_bytes - current_bytes
        if free_bytes is not None:
            room = min(room, free_bytes)
        return self.peak_model.largest_fitting(self.baseline_bytes + max(0.0, (1 - margin) * room), upper=upper)


def preflight(
    module: nn.Module,
    step_batch: Any,
    micro_batch_sizes: tuple[int, int],
    *,
    optimizers: Sequence[torch.optim.Optimizer] | None = None,
    precision: str | int = "32-true",
    hooks: BatchHooks | None = None,
) -> Preflight:
    """Trace a split-mode step at two micro-batch sizes on fake tensors, and fit ``peak(b)`` on the two peaks.

    Each traced step runs two micro-batches of the given size (the first two micro-batches of the step batch), as an
    accumulating step does, after one warm-up step that creates the optimizer state. The module, its optimizers and
    the batch are copied as fake tensors on the CPU; for a module on CUDA the prediction is for CUDA (see
    `lightning_accum.memory.fake.FakeTarget`). Nothing real is touched: not the weights, the optimizer state,
    the random number generator nor the module's trainer.

    Args:
        module: the LightningModule (on its device, as training will run it).
        step_batch: one per-device step batch, as the dataloader yields it.
        micro_batch_sizes: two different sizes, each at most half the step batch so that both micro-batches are full.
        optimizers: the optimizers to copy (e.g. ``trainer.optimizers``); ``None`` calls
            ``module.configure_optimizers()`` on the copy.
        precision: the Trainer's precision (``trainer.precision``).
        hooks: how to cut the batch (`lightning_accum.splitting.resolve_batch_hooks`); the built-in rules if
            ``None``.

    Raises:
        TypeError: if a size is not an int.
        ValueError: if a size is below 1, or both are the same.

    """
    sizes = [check_int(b, "micro_batch_sizes", 1) for b in micro_batch_sizes]
    if len(sizes) != 2 or sizes[0] == sizes[1]:
        raise ValueError(f"`micro_batch_sizes` must be two different sizes to fit a line, got {micro_batch_sizes!r}.")
    start = time.perf_counter()
    try:
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*self\.log\(\).*")  # the copy has no Trainer
            peaks, baseline = _trace(module, step_batch, sizes, optimizers, StepPrecision(precision), hooks)
    except Exception as err:  # anything tracing can't do means: fall back to probing for the size
        first_line = next(iter(str(err).strip().splitlines()), "")
        return Preflight(None, f"{type(err).__name__}: {first_line}", seconds=time.perf_counter() - start)
    model = LinearPeakModel()
    for b, peak in peaks.items():
        model.observe(b, peak)
    return Preflight(model, None, peaks, baseline, time.perf_counter() - start)


def _trace(
    module: nn.Module,
    step_batch: Any,
    sizes: list[int],
    optimizers: Sequence[torch.optim.Optimizer] | None,
    precision: StepPrecision,
    hooks: BatchHooks | None,
) -> tuple[dict[int, int], int]:
    on_cuda = any(p.device.type == "cuda" for p in module.parameters())
    fake = FakeTarget("cuda" if on_cuda else "cpu")
    hooks = hooks or BatchHooks()
    with fake:
        model, opts = fake.copy_step(module, optimizers or [])
        opts = fake.optimizers(opts if optimizers is not None else optimizers_of(model.configure_optimizers()))
        model.train()
        batch = fake.tensors(precision.convert_input(step_batch))
        tracker = MemoryTracker(model, opts, device=fake.device, block_bytes=fake.block_bytes)
        with tracker:
            tracker.track(batch, "activations")  # the step batch stays alive through the step, as in split mode
            baseline = tracker.current.total_bytes
            context = lambda: precision.forward_context("cpu")  # noqa: E731  (fake tensors live on the CPU)
            peaks: dict[int, int] = {}
            for b in [sizes[0], *sizes]:  # a warm-up step first: optimizer state exists from then on
                tracker.reset_peak()
                train_step(model, opts, [m.batch for m in hooks.split(batch, b)[:2]], tracker, forward_context=context)
                peaks[b] = tracker.peak.total_bytes
    return peaks, baseline
