"""Running the configurations and measuring their peaks: the training loop the probe drives, and `probe_memory`.

The loop does what Lightning's automatic optimization does for one optimizer, without a ``Trainer``: the loss of each
micro-batch is divided by ``k``, gradients are set to ``None`` after each step. A Trainer would add its own
allocations (loggers, progress tracking, checkpoint state), could not stop between the phases we label, and would
take seconds to start for every configuration.

On ``device="meta"`` the same loop runs on fake tensors (`lightning_accum.memory.fake.FakeTarget`): nothing is
allocated, and the peak is what the step would hold on the ``target`` device.
"""

from __future__ import annotations

import contextlib
import gc
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from torch import nn
from typing_extensions import Unpack

from lightning_accum._util.validation import check_int
from lightning_accum.memory.backends import CPUBackend
from lightning_accum.memory.fake import CUDA_HEADROOM, FakeTarget, Target
from lightning_accum.memory.host import trim_cpu_heap
from lightning_accum.memory.model import LinearPeakModel
from lightning_accum.memory.precision import StepPrecision
from lightning_accum.memory.tracker import MemoryTracker
from lightning_accum.memory.training_step import configured_optimizers, train_step
from lightning_accum.probe.options import ProbeOptions, RunOptions
from lightning_accum.probe.resolve import DataSpec, ModuleSpec, batch_factory, module_factory
from lightning_accum.probe.result import ProbeMeasurement, ProbeResult


def probe_memory(
    module: ModuleSpec,
    data: DataSpec,
    *,
    batch_size: int,
    accumulation_steps: Sequence[int] = (2, 4),
    fit_micro_batch_sizes: Sequence[int] | None = None,
    grid: Sequence[tuple[int, int]] = (),
    steps: int = 2,
    **options: Unpack[ProbeOptions],
) -> ProbeResult:
    """Measure peak memory of training steps over a grid of ``(b, k)`` and answer the memory question.

    The grid always holds ``(B, 1)`` and, for every ``k``, ``(B/k, k)`` and ``(B/k, 1)``; then ``(b, 2)`` for each
    fit size, then ``grid``. Each configuration starts from a fresh model, runs ``warmup_steps`` steps (the first
    creates optimizer state) and ``steps`` measured ones. Every check runs before anything is measured. See the
    package docstring for the fit, ``device="meta"`` and an example.

    Args:
        module: a LightningModule (copied per configuration), a factory of one, or an import path ``"pkg.mod:Class"``.
        data: a LightningDataModule, a callable ``(micro_batch_size, **data_init_args) -> batch``, or an import path.
        batch_size: the full batch ``B`` per device.
        accumulation_steps: the ``k`` values to compare; each must divide ``B``.
        fit_micro_batch_sizes: micro-batch sizes measured with ``k = 2`` for the fit (default ``B/2 .. B/16``).
        grid: extra ``(b, k)`` configurations.
        steps: measured optimizer steps per configuration.

    Keyword Args:
        warmup_steps: unmeasured steps before them (default 1).
        device: where to run; ``"meta"`` traces on fake tensors and predicts for ``target``, allocating nothing.
        budget_bytes: a memory budget; the result says which micro-batch fits it.
        module_init_args: keyword arguments for an import-path or factory ``module``.
        data_init_args: keyword arguments for an import-path ``data`` class or a batch factory.
        seed: the seed set before building each model.
        target: with ``device="meta"``, the device to predict for, ``"cpu"`` (default) or ``"cuda"``.
        precision: as ``Trainer(precision=...)``: ``"32-true"``, ``"bf16-mixed"``, ``"bf16-true"``, ...
        headroom: the share of ``budget_bytes`` kept free for what the steps can't show (default: `check_headroom`).

    Raises:
        TypeError: an argument has the wrong type, init args do not fit, or the module lacks ``training_step``.
        ValueError: a bad ``k``, size, target, precision or headroom, no optimizer, or no loss returned.
        RuntimeError: the module uses manual optimization, or the device is not available.
        ImportError: an import path names no module or attribute.
    """
    run = RunOptions.of("probe_memory", options)
    batch_size = check_int(batch_size, "batch_size", 1)
    steps, warmup_steps = check_int(steps, "steps", 1), check_int(run.warmup_steps, "warmup_steps", 0)
    ks, configs = _plan(batch_size, accumulation_steps, fit_micro_batch_sizes, grid)
    setup = _checked_setup(module, run)
    make_batch = batch_factory(data, run.data_init_args, max(batch_size, *(b for b, _ in configs)))
    runs = [
        _measure(setup.make_module, make_batch, b, k, steps, warmup_steps, setup.where, run.seed) for b, k in configs
    ]
    return _fit(_result(batch_size, ks, runs, setup))


def _checked_setup(module: ModuleSpec, run: RunOptions) -> _Setup:
    """Where the probe runs, the module's factory, and the budget and headroom it answers for, checked (both probes).

    The module is built once and checked here, so that a wrong module fails before any measuring.
    """
    where = _Where.of(run.device, run.target, run.precision)
    kept = check_headroom(run.headroom, where)
    make_module = module_factory(module, run.module_init_args)
    _check_module(where.throwaway(make_module))
    return _Setup(where, make_module, run.budget_bytes, kept)


# ---- the plan -------------------------------------------------------------------------------------------------------


def _plan(
    batch_size: int,
    accumulation_steps: Sequence[int],
    fit_micro_batch_sizes: Sequence[int] | None,
    grid: Sequence[tuple[int, int]],
) -> tuple[list[int], list[tuple[int, int]]]:
    """The ``k`` values compared and every ``(b, k)`` to measure, checked."""
    ks = _accumulation_steps(accumulation_steps, batch_size)
    return ks, _configurations(batch_size, ks, fit_micro_batch_sizes, grid)


def _accumulation_steps(accumulation_steps: Sequence[int], batch_size: int) -> list[int]:
    ks = sorted({check_int(k, "accumulation_steps", 2) for k in accumulation_steps})
    for k in ks:
        if batch_size % k:
            raise ValueError(
                f"`accumulation_steps` holds {k}, which does not divide `batch_size`={batch_size}; the comparison "
                f"needs micro-batches of exactly B/k. Pick a divisor of {batch_size}."
            )
    return ks


def _configurations(
    batch_size: int, ks: list[int], fit_micro_batch_sizes: Sequence[int] | None, grid: Sequence[tuple[int, int]]
) -> list[tuple[int, int]]:
    if fit_micro_batch_sizes is None:
        fit_micro_batch_sizes = sorted({batch_size // d for d in (2, 4, 8, 16) if batch_size // d >= 1})
    fit_sizes = [check_int(b, "fit_micro_batch_sizes", 1) for b in fit_micro_batch_sizes]
    configs: list[tuple[int, int]] = [(batch_size, 1)]
    for k in ks:
        configs += [(batch_size // k, k), (batch_size // k, 1)]
    configs += [(b, 2) for b in fit_sizes]
    for b, k in grid:
        configs.append((check_int(b, "grid micro-batch size", 1), check_int(k, "grid accumulation steps", 1)))
    return list(dict.fromkeys(configs))  # drop repeats, keep order


def check_headroom(headroom: float | None, where: _Where) -> float:
    """``headroom`` checked, or its default: `CUDA_HEADROOM` for a CUDA prediction, else 0 (a measurement sees all).

    Raises:
        TypeError: ``headroom`` is not a number.
        ValueError: ``headroom`` is not in ``[0, 1)``.
    """
    if headroom is None:
        return CUDA_HEADROOM if where.target == "cuda" else 0.0
    if isinstance(headroom, bool) or not isinstance(headroom, (int, float)):
        raise TypeError(f"`headroom` must be a fraction in [0, 1), got {headroom!r} of type {type(headroom).__name__}.")
    if not 0 <= headroom < 1:
        raise ValueError(
            f"`headroom` must be a fraction in [0, 1) of the budget kept free, got {headroom!r}. Pass e.g. 0.05."
        )
    return float(headroom)


@dataclass(frozen=True)
class _Where:
    """Where the configurations run: a real device, or fake tensors predicting for ``target``; and the precision."""

    device: torch.device
    target: Target | None
    precision: StepPrecision

    @classmethod
    def of(cls, device: str | torch.device, target: Target | None, precision: str | int) -> _Where:
        dev = torch.device(device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"`device`={str(device)!r} but CUDA is not available here. Use `device='cpu'`.")
        if dev.type != "meta" and target not in (None, dev.type):
            raise ValueError(
                f"`target`={target!r} only applies with `device`='meta' (a prediction on fake tensors); on "
                f"`device`={str(device)!r} the target is that device. Drop `target`, or use `device`='meta'."
            )
        if dev.type == "meta":
            FakeTarget(target or "cpu")  # checks the name
        return cls(dev, (target or "cpu") if dev.type == "meta" else None, StepPrecision(precision))

    @property
    def label(self) -> str:
        return str(self.device) if self.target is None else f"{self.device} (as {self.target})"

    def fake(self) -> FakeTarget | None:
        """A fresh fake-tensor context for one configuration, or ``None`` on a real device."""
        return None if self.target is None else FakeTarget(self.target)

    def throwaway(self, make_module: Callable[[], nn.Module]) -> Any:
        """An instance to check before measuring: on fake tensors for a prediction, since the real one may not fit."""
        fake = self.fake()
        with _entered(fake):
            return make_module()


@dataclass(frozen=True)
class _Setup:
    """What a probe checks before it measures: where it runs, the module's factory, the budget and its headroom."""

    where: _Where
    make_module: Callable[[], nn.Module]
    budget_bytes: float | None
    headroom: float

    def result_fields(self, runs: list[tuple[ProbeMeasurement, int, int]]) -> dict[str, Any]:
        """The fields both probes' results take from the setup and the runs: where, the model's bytes, the budget."""
        _, param_bytes, grad_bytes = runs[-1]  # the same for every configuration
        return {
            "device": self.where.label,
            "parameter_bytes": param_bytes,
            "gradient_bytes": grad_bytes,
            "budget_bytes": self.budget_bytes,
            "target": self.where.target,
            "precision": self.where.precision.name,
            "headroom": self.headroom,
        }


def _result(
    batch_size: int, ks: list[int], runs: list[tuple[ProbeMeasurement, int, int]], setup: _Setup
) -> ProbeResult:
    measurements = [m for m, _, _ in runs]
    return ProbeResult(
        batch_size=batch_size,
        measurements=measurements,
        accumulation_steps=ks,
        peak_model=LinearPeakModel(),
        **setup.result_fields(runs),
    )


def _fit(result: ProbeResult) -> ProbeResult:
    """Fit ``peak(b)`` on the accumulating configurations, and check it on held-out sizes when there are three."""
    peaks: dict[int, int] = {}
    for m in result.measurements:  # with several k at one b, the largest peak counts
        if m.accumulation_steps >= 2:
            peaks[m.micro_batch_size] = max(peaks.get(m.micro_batch_size, 0), m.peak_bytes)
    result.peak_model = LinearPeakModel(max_sizes=max(2, len(peaks)))
    for b, peak in sorted(peaks.items()):
        result.peak_model.observe(b, peak)
    sizes = sorted(peaks)
    result.fit_sizes, result.holdout_sizes = sizes, []
    if len(sizes) >= 3:
        result.fit_sizes, result.holdout_sizes = sizes[::2], sizes[1::2]
        holdout = LinearPeakModel(max_sizes=len(result.fit_sizes))
        for b in result.fit_sizes:
            holdout.observe(b, peaks[b])
        result.holdout_error = holdout.relative_error([(b, peaks[b]) for b in result.holdout_sizes])
    return result


# ---- the module -----------------------------------------------------------------------------------------------------


def _check_module(model: Any) -> None:
    """Raise if the probe cannot train ``model``: run on one instance before anything is measured."""
    name = type(model).__name__
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"`module` must build an nn.Module with `training_step` and `configure_optimizers` (a LightningModule), "
            f"got {name}."
        )
    for hook in ("training_step", "configure_optimizers"):
        if not callable(getattr(model, hook, None)):
            raise TypeError(f"`module` {name} has no `{hook}` method; pass a LightningModule.")
    if not getattr(model, "automatic_optimization", True):
        raise RuntimeError(
            f"`module` {name} uses manual optimization (`automatic_optimization = False`); the probe drives "
            "`training_step` itself and needs automatic optimization. Probe a variant with it on."
        )
    if not configured_optimizers(model):
        raise ValueError(f"`module` {name}: `configure_optimizers` returned no optimizer.")


# ---- the measurement ------------------------------------------------------------------------------------------------


def _measure(
    make_module: Callable[[], nn.Module],
    make_batch: Callable[[int, int], Any],
    b: int,
    k: int,
    steps: int,
    warmup_steps: int,
    where: _Where,
    seed: int,
) -> tuple[ProbeMeasurement, int, int]:
    fake = where.fake()
    if fake is None:  # fake tensors hold no memory to release
        _release(where.device)
    torch.manual_seed(seed)
    with _entered(fake):
        model, optimizers = _build(make_module, where, fake)  # a fresh copy: nothing carried over from another (b, k)
    param_bytes = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    # Batches are built before measuring, on the CPU, so the data pipeline's own memory stays out of the peak.
    batches = [make_batch(i * b, b) for _ in range(warmup_steps + steps) for i in range(k)]
    blocks = 1 if fake is None else fake.block_bytes
    # On the CPU split mode's planner measures the process's peak resident set (`CPUBackend`), not live tensors: the
    # probe reads the same backend over each phase, so that a budget can be fitted in the planner's own measure.
    resident = CPUBackend() if fake is None and where.device.type == "cpu" else None
    tracker = MemoryTracker(
        model,
        optimizers,
        device=where.device if fake is None else fake.device,
        block_bytes=blocks,
        backend=resident,
    )
    with _entered(fake), warnings.catch_warnings(), tracker:
        warnings.filterwarnings("ignore", message=r".*self\.log\(\).*")  # no Trainer on purpose
        for step in range(warmup_steps + steps):
            if step == warmup_steps:
                _reset_peaks(tracker, where.device)
            micro_batches = [batches.pop(0) for _ in range(k)]
            train_step(model, optimizers, micro_batches, tracker, _preparer(where, fake), _autocast(where), step * k)
    device_peak = _device_peak(where.device)
    peak = tracker.peak
    phases, resident_phases = _by_kind(tracker.phase_peaks), _by_kind(tracker.backend_phase_peaks)
    measurement = ProbeMeasurement(
        b,
        k,
        peak.total_bytes,
        dict(peak.by_category),
        peak.phase,
        device_peak,
        phases,
        resident_phases if resident is not None else None,
    )
    del model, optimizers, tracker
    if fake is None:
        gc.collect()
    return measurement, param_bytes, grad_bytes


def _by_kind(peaks: Mapping[str, int]) -> dict[str, int]:
    """Peaks per phase, ``"backward 2/4"`` and ``"backward 1/4"`` as one ``"backward"``."""
    kinds: dict[str, int] = {}
    for label, total in peaks.items():
        if label:
            kinds[label.split()[0]] = max(kinds.get(label.split()[0], 0), total)
    return kinds


def _build(
    make_module: Callable[[], nn.Module], where: _Where, fake: FakeTarget | None
) -> tuple[nn.Module, list[torch.optim.Optimizer]]:
    model = make_module()
    model = fake.module(model) if fake is not None else model.to(where.device)
    model = where.precision.convert_module(model)
    model.train()
    optimizers = configured_optimizers(model)
    return model, optimizers if fake is None else fake.optimizers(optimizers)


def _preparer(where: _Where, fake: FakeTarget | None) -> Callable[[Any], Any]:
    def prepare(batch: Any) -> Any:
        batch = where.precision.convert_input(batch)
        return move_data_to_device(batch, where.device) if fake is None else fake.tensors(batch)

    return prepare


def _autocast(where: _Where) -> Callable[[], AbstractContextManager[None]]:
    device_type = "cpu" if where.target is not None else where.device.type  # fake tensors live on the CPU
    return lambda: where.precision.forward_context(device_type)


@contextlib.contextmanager
def _entered(fake: FakeTarget | None) -> Iterator[None]:
    if fake is None:
        yield
    else:
        with fake:
            yield


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cpu":  # the heap keeps what the last configuration freed resident, in the next one's peak
        trim_cpu_heap()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _device_peak(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return int(torch.cuda.max_memory_allocated(device))


def _reset_peaks(tracker: MemoryTracker, device: torch.device) -> None:
    tracker.reset_peak()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
