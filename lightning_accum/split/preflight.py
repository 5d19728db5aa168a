"""Pre-flight for split mode: fit ``peak(b)`` from two traced steps on fake tensors, before a real micro-batch runs.

Without it, `AutoMicroBatching("auto")` would start cold by halving from the whole step batch, and a failed attempt
leaves no peak to fit. `preflight` traces the step instead: a fake copy of the module and its optimizers (no weight,
state or batch is copied for real) runs a warm-up micro-batch, then one step of two micro-batches at each of two
sizes, under a `lightning_accum.memory.tracker.MemoryTracker`: `TRACED_TRAINING_STEPS` calls of ``training_step``,
during which `in_preflight` is true. The two peaks fit the same `lightning_accum.memory.model.LinearPeakModel` the
planner uses. The copy's ``self.trainer`` is a read-only view of the real Trainer, and a model sharded with FSDP2 is
traced as split mode runs it (`lightning_accum.memory.fake.FakeStep`). Where tracing fails (an op without a fake
implementation, a data-dependent shape, a ``.item()`` in ``training_step``, an attribute ``deepcopy`` refuses, a
write to the Trainer), the result holds no model and says why, and the caller falls back to probing for the size
(`fallback_warning` says so).

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

import contextlib
import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_accum import _compat
from lightning_accum._util.validation import check_int
from lightning_accum.batches import BatchHooks, MicroBatch
from lightning_accum.memory.fake import CUDA_HEADROOM, FakeStep, FakeTarget
from lightning_accum.memory.model import LinearPeakModel
from lightning_accum.memory.precision import StepPrecision
from lightning_accum.memory.tracker import MemoryTracker
from lightning_accum.memory.training_step import configured_optimizers, train_step


@dataclass(frozen=True)
class Preflight:
    """What `preflight` found: the fitted ``peak(b)`` of live tensors, or why there is none.

    Attributes:
        peak_model: the fit of the traced peaks, or ``None`` when tracing failed.
        reason: why tracing failed (the error's type and first line), or ``None``.
        peaks: the traced peak of live tensors for each micro-batch size.
        baseline_bytes: live tensors when the trace started: parameters (under FSDP2 this rank's shards, not the
            unsharded parameters a step gathers), buffers, optimizer state already there, the step batch. The device
            holds these now too; the difference is what the trace can't see.
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


def in_preflight() -> bool:
    """Whether the pre-flight is tracing ``training_step`` now: as ``trainer.sanity_checking``, for the trace.

    ``AutoMicroBatching(micro_batch_size="auto")`` traces the first step before it runs: ``training_step`` runs
    `TRACED_TRAINING_STEPS` (5) more times, on a fake copy of the module, with fake tensors. There ``self.log`` does
    nothing, and ``self.trainer`` reads the real Trainer but cannot change it. The copy's attributes are its own, but
    anything outside it is real: skip what must happen once per real micro-batch (writing files, printing, counting
    in a global or class attribute, calling an outside service) while this is true, and what fake tensors cannot
    run (a ``.item()``, a shape read from the data) if the trace falls back because of it.

    Examples:
        >>> import lightning.pytorch as pl
        >>> calls = []  # outside the module: the trace's calls land here too
        >>> class Net(pl.LightningModule):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.layer = nn.Linear(8, 1)
        ...     def training_step(self, batch, batch_idx):
        ...         calls.append("trace" if in_preflight() else "train")
        ...         return self.layer(batch).square().mean()
        ...     def configure_optimizers(self):
        ...         return torch.optim.SGD(self.parameters(), lr=0.1)
        >>> found = preflight(Net(), torch.randn(16, 8), (4, 8))
        >>> calls, in_preflight()
        (['trace', 'trace', 'trace', 'trace', 'trace'], False)
    """
    return _tracing > 0


TRACED_TRAINING_STEPS = 5
"""How many times the pre-flight calls ``training_step``: one warm-up micro-batch, then two at each of two sizes."""

_tracing = 0  # a count, not a flag: a trace inside a trace (a test's, say) ends with the outer one


class MicroBatchCutter(Protocol):
    """What cuts the traced step batch: `lightning_accum.batches.BatchHooks`, or a cut by tokens.

    A cut by tokens (`lightning_accum.sequences.token_cut.TokenCut`) takes token budgets for sizes.
    """

    def split(self, batch: Any, micro_batch_size: int) -> list[MicroBatch]: ...


def preflight(
    module: nn.Module,
    step_batch: Any,
    micro_batch_sizes: tuple[int, int],
    *,
    optimizers: Sequence[torch.optim.Optimizer] | None = None,
    precision: str | int = "32-true",
    hooks: MicroBatchCutter | None = None,
) -> Preflight:
    """Trace a split-mode step at two micro-batch sizes on fake tensors, and fit ``peak(b)`` on the two peaks.

    Each traced step runs two micro-batches of the given size (the first two micro-batches of the step batch), as an
    accumulating step does, after a warm-up micro-batch whose optimizer step creates the optimizer state: 5 calls of
    ``training_step`` in all, during which `in_preflight` is true. The module, its optimizers and the batch are
    copied as fake tensors on the CPU; for a module on CUDA the prediction is for CUDA (see
    `lightning_accum.memory.fake.FakeTarget`). Nothing real is touched: not the weights, the optimizer state, the
    random number generator nor the module's Trainer. The copy's ``self.trainer`` is a read-only view of the real
    one (its progress, its settings; no logger), its ``self.device`` is the fake tensors' (the CPU), and its
    ``self.log`` does nothing.

    A model sharded with FSDP2 (``fully_shard``) is traced as split mode runs it: on fake unsharded parameters,
    whose gradients accumulate unsharded and are reduce-scattered into fake shards after the last backward, and
    optimizers that step the shards (`lightning_accum.memory.fake.FakeStep`). Its baseline holds the shards, not
    the unsharded parameters, which a step gathers.

    Args:
        module: the LightningModule (on its device, as training will run it).
        step_batch: one per-device step batch, as the dataloader yields it.
        micro_batch_sizes: two different sizes, each at most half the step batch so that both micro-batches are full.
        optimizers: the optimizers to copy (e.g. ``trainer.optimizers``); ``None`` calls
            ``module.configure_optimizers()`` on the copy.
        precision: the Trainer's precision (``trainer.precision``).
        hooks: how to cut the batch (`lightning_accum.batches.resolve_batch_hooks`); the built-in rules if
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
        with torch.random.fork_rng(devices=[]):
            peaks, baseline = _trace(module, step_batch, sizes, optimizers, StepPrecision(precision), hooks)
    except Exception as err:  # anything tracing can't do means: fall back to probing for the size
        return Preflight(None, _reason(err), seconds=time.perf_counter() - start)
    model = LinearPeakModel()
    for b, peak in peaks.items():
        model.observe(b, peak)
    return Preflight(model, None, peaks, baseline, time.perf_counter() - start)


def fallback_warning(reason: str | None) -> str:
    """The warning split mode gives when the pre-flight fell back: why (``None``: on another rank), and what it costs.

    Examples:
        >>> print(fallback_warning("KeyError: 'x'"))  # doctest: +ELLIPSIS +NORMALIZE_WHITESPACE
        lightning_accum: the pre-flight fell back to halving from the whole step batch: it could not trace the first
        step on fake tensors (KeyError: 'x'). Each halving costs an out-of-memory error and a re-run of the step's ...
    """
    why = reason if reason is not None else "the trace failed on another rank; run on one device to see why"
    return (
        "lightning_accum: the pre-flight fell back to halving from the whole step batch: it could not trace the first"
        f" step on fake tensors ({why}). Each halving costs an out-of-memory error and a re-run of the step's work so"
        " far, until a micro-batch fits (up to log2 of the step batch size of them). Skip what the trace cannot run"
        " with `if not lightning_accum.in_preflight(): ...` in `training_step`, or pass an int `micro_batch_size` to"
        " start there (`preflight=False` turns the pre-flight off)."
    )


_HINTS = {
    "DataDependentOutputException": "a number read from a tensor's values in `training_step`: `.item()`, `int(t)`,"
    " `if t > 0`; `self.log` takes the tensor itself",
    "DynamicOutputShapeException": "a shape that depends on a tensor's values: `nonzero`, boolean indexing",
    "UnsupportedOperatorException": "an op without a fake-tensor implementation",
}


def _reason(err: Exception) -> str:
    """Why tracing failed: the error's type and first line, and what that usually means in ``training_step``."""
    first_line = next(iter(str(err).strip().splitlines()), "")
    hint = _HINTS.get(type(err).__name__)
    return f"{type(err).__name__}: {first_line}" + (f" ({hint})" if hint else "")


def _trace(
    module: nn.Module,
    step_batch: Any,
    sizes: list[int],
    optimizers: Sequence[torch.optim.Optimizer] | None,
    precision: StepPrecision,
    hooks: MicroBatchCutter | None,
) -> tuple[dict[int, int], int]:
    on_cuda = any(p.device.type == "cuda" for p in module.parameters())
    fake = FakeTarget("cuda" if on_cuda else "cpu")
    hooks = hooks or BatchHooks()
    step = fake.copy_step(module, optimizers or [])
    context = lambda: precision.forward_context("cpu")  # noqa: E731  (fake tensors live on the CPU)
    with fake:
        model = step.module
        opts = fake.optimizers(step.optimizers if optimizers is not None else _configured(step))
        model.train()
        batch = fake.tensors(precision.convert_input(step_batch))
        tracker = MemoryTracker(model, opts, device=fake.device, block_bytes=fake.block_bytes)
        with tracker, _as_in_training(model, getattr(module, "_trainer", None), opts), step.sharding():
            tracker.track(step.shards, "parameters")
            tracker.track(batch, "activations")  # the step batch stays alive through the step, as in split mode
            baseline = tracker.current.total_bytes - step.unsharded_bytes(fake.block_bytes)
            peaks: dict[int, int] = {}
            for b in [0, *sizes]:  # a warm-up micro-batch first (0): optimizer state exists from then on
                micro_batches = [m.batch for m in hooks.split(batch, b or sizes[0])[: 2 if b else 1]]
                tracker.reset_peak()
                train_step(model, opts, micro_batches, tracker, _syncing_last(step, len(micro_batches)), context)
                peaks[b] = tracker.peak.total_bytes
    del peaks[0]
    return peaks, baseline


def _configured(step: FakeStep) -> list[torch.optim.Optimizer]:
    if step.sharded:
        raise ValueError(
            "`optimizers` must be given for a model sharded with FSDP2: `configure_optimizers()` on the copy would"
            " step its unsharded parameters. Pass `trainer.optimizers`."
        )
    return configured_optimizers(step.module)


def _syncing_last(step: FakeStep, k: int) -> Callable[[Any], Any]:
    """A ``prepare`` for `train_step` that turns gradient sync on for the last of ``k`` micro-batches only.

    Split mode holds FSDP2's reduce-scatter back until the last micro-batch of a step (see
    `lightning_accum._compat.fsdp2`).
    """
    calls = itertools.count()

    def prepare(batch: Any) -> Any:
        step.sync_gradients = next(calls) == k - 1
        return batch

    return prepare


@contextlib.contextmanager
def _as_in_training(
    model: nn.Module, trainer: pl.Trainer | None, optimizers: list[torch.optim.Optimizer]
) -> Iterator[None]:
    """Make the copy's ``training_step`` see what it would see in training, and `in_preflight` true.

    ``self.trainer`` is a read-only view of the real Trainer (`_TrainerView`), ``self.optimizers()`` gives the
    copied optimizers, ``self.device`` is the fake tensors' device, and ``self.log`` does nothing: the values are
    fake, and would go to the real Trainer.
    """
    global _tracing

    def copied_optimizers(use_pl_optimizer: bool = True) -> Any:
        return optimizers[0] if len(optimizers) == 1 else optimizers

    _compat.report_device(model, torch.device("cpu"))  # where fake tensors live, whatever device they stand for
    for sub in model.modules():
        if isinstance(sub, pl.LightningModule):
            sub.log = sub.log_dict = _ignore  # type: ignore[method-assign]  # the fake copy's, on purpose
            sub.optimizers = copied_optimizers  # type: ignore[method-assign]  # the fake copy's, on purpose
    if isinstance(model, pl.LightningModule) and trainer is not None:
        model.trainer = _TrainerView(trainer, optimizers)  # type: ignore[assignment]  # a read-only stand-in
    _tracing += 1
    try:
        yield
    finally:
        _tracing -= 1


def _ignore(*args: Any, **kwargs: Any) -> None:
    return None


class _TrainerView:
    """What the traced copy sees as ``self.trainer``: the real Trainer's attributes, read-only.

    Progress (``global_step``, ``current_epoch``), settings and the strategy are the real Trainer's, read when
    asked. ``optimizers`` are the copies, and there is no logger (``self.log`` is ignored during the trace too).
    Setting an attribute raises, so a trace cannot change the Trainer.
    """

    def __init__(self, trainer: pl.Trainer, optimizers: list[torch.optim.Optimizer]) -> None:
        object.__setattr__(self, "_trainer", trainer)
        object.__setattr__(self, "_overrides", {"optimizers": optimizers, "logger": None, "loggers": []})

    def __getattr__(self, name: str) -> Any:
        overrides = object.__getattribute__(self, "_overrides")
        if name in overrides:
            return overrides[name]
        return getattr(object.__getattribute__(self, "_trainer"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise RuntimeError(
            f"`training_step` set `trainer.{name}` while the pre-flight traced it; the trace runs on a copy and must"
            " not change the Trainer. Skip it during the trace: `if not lightning_accum.in_preflight(): ...`."
        )

    def __delattr__(self, name: str) -> None:
        self.__setattr__(name, None)
