"""``probe_memory``: measure, on the user's own model, whether gradient accumulation lowers peak memory or raises it.

The answer depends on the baseline (see "The memory question" in the design brief):

- against the full batch ``B`` in one pass, accumulating ``k`` micro-batches of ``b = B/k`` lowers the peak by about
  the activation memory of ``B - b`` samples;
- against the same micro-batch ``b`` without accumulation, it raises the peak by up to one gradient copy, because the
  gradient buffer is alive during every forward pass after the first;
- the micro-batch size, not ``k``, sets the activation memory.

The probe runs a few real training steps per configuration and measures the peak of live tensor storage with
`lightning_accum.memory.tracker.MemoryTracker`. It drives the module with a plain loop (``training_step``,
``backward``, ``optimizer.step``, ``zero_grad``) instead of a ``Trainer``: a Trainer would add its own allocations
(loggers, progress tracking, checkpoint state), could not stop between the phases we label, and would take seconds to
start for every configuration. The loop does what Lightning's automatic optimization does for one optimizer: the loss
of each micro-batch is divided by ``k``, gradients are set to ``None`` after each step.
"""

from __future__ import annotations

import copy
import gc
import importlib
import inspect
import json
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from torch import nn

from lightning_accum._validation import check_int
from lightning_accum.memory.model import LinearPeakModel
from lightning_accum.memory.tracker import CATEGORIES, MemoryTracker

ModuleSpec = nn.Module | Callable[[], nn.Module] | str
DataSpec = Callable[[int], Any] | Any | str
_MiB = 2**20
_GiB = 2**30


# ---- resolving what the user passed ---------------------------------------------------------------------------------


def import_object(path: str, argument: str = "path") -> Any:
    """Import ``"pkg.mod:Name"`` or ``"pkg.mod.Name"``.

    Raises:
        ValueError: if ``path`` names no module and attribute.
        ImportError: if the module or attribute does not exist.

    Examples:
        >>> import_object("collections:OrderedDict").__name__
        'OrderedDict'
    """
    if not isinstance(path, str) or not path or (":" not in path and "." not in path):
        raise ValueError(f"`{argument}` must be an import path like 'pkg.module:Name', got {path!r}.")
    module_name, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        raise ImportError(
            f"`{argument}`={path!r}: cannot import module {module_name!r} ({err}). Check the spelling, and that the "
            "package is installed or its folder is on PYTHONPATH."
        ) from err
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ImportError(f"`{argument}`={path!r}: module {module_name!r} has no attribute {attr!r}.")
        obj = getattr(obj, part)
    return obj


def _instantiate(config: Any) -> Any:
    # LightningCLI style: {"class_path": ..., "init_args": {...}}, nested anywhere in the arguments.
    if isinstance(config, Mapping) and "class_path" in config:
        cls = import_object(config["class_path"], "class_path")
        return cls(**{k: _instantiate(v) for k, v in dict(config.get("init_args") or {}).items()})
    if isinstance(config, Mapping):
        return {k: _instantiate(v) for k, v in config.items()}
    if isinstance(config, list):
        return [_instantiate(v) for v in config]
    return config


def load_cli_config(
    path: str | Path, model_class: str | None = None, data_class: str | None = None
) -> tuple[Callable[[], nn.Module], Callable[[], Any] | None]:
    """Read a LightningCLI YAML config and return factories for its ``model`` and ``data`` sections.

    A section is either ``{class_path: pkg.mod.Class, init_args: {...}}`` or, for a CLI built around one class
    (``LightningCLI(MyModel, MyData)``), the init args themselves; then ``model_class``/``data_class`` name the
    class as an import path. The ``trainer`` section and everything else are ignored.

    Raises:
        FileNotFoundError: if ``path`` does not exist.
        ValueError: if the file is not YAML, the model section is missing, or a section has no ``class_path`` and no
            class was given.
    """
    import yaml

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"`config`={str(path)!r} does not exist. Pass the YAML file given to LightningCLI.")
    try:
        config = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = "" if mark is None else f" at line {mark.line + 1}, column {mark.column + 1}"
        problem = getattr(err, "problem", None) or type(err).__name__
        raise ValueError(
            f"`config`={str(path)!r} is not valid YAML: {problem}{where}. Fix the file, or pass the YAML file given "
            "to LightningCLI."
        ) from err
    if not isinstance(config, Mapping):
        raise ValueError(
            f"`config`={str(path)!r} holds a {type(config).__name__}, not a mapping of sections. Pass the YAML file "
            "given to LightningCLI."
        )
    sections: dict[str, dict[str, Any]] = {}
    for name, cls, flag in (("model", model_class, "--model"), ("data", data_class, "--data")):
        section = config.get(name)
        if section is None:
            if cls is not None:
                sections[name] = {"class_path": cls, "init_args": {}}
            continue
        if not isinstance(section, Mapping):
            raise ValueError(f"`config`={str(path)!r}: the `{name}` section must be a mapping, got {section!r}.")
        if "class_path" not in section:
            if cls is None:
                raise ValueError(
                    f"`config`={str(path)!r}: the `{name}` section has no `class_path`. Add one with a full import "
                    f"path, or name the class with `{flag} pkg.mod:Class`."
                )
            section = {"class_path": cls, "init_args": section.get("init_args", section)}
        sections[name] = dict(section)
    if "model" not in sections:
        raise ValueError(f"`config`={str(path)!r} has no `model` section; the probe needs a model to train.")
    model_section = sections["model"]
    data_section = sections.get("data")
    return (
        lambda: _instantiate(model_section),
        None if data_section is None else (lambda: _instantiate(data_section)),
    )


def _check_init_args(target: Any, kwargs: Mapping[str, Any], argument: str, *leading: Any) -> None:
    """Raise a `TypeError` naming ``argument`` when ``target(*leading, **kwargs)`` would not bind."""
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):  # no signature to check against (some builtins): the call itself will say
        return
    try:
        signature.bind(*leading, **kwargs)
    except TypeError as err:
        name = getattr(target, "__qualname__", type(target).__name__)
        empty = inspect.Parameter.empty
        plain = signature.replace(
            parameters=[p.replace(annotation=empty) for p in signature.parameters.values()], return_annotation=empty
        )
        raise TypeError(
            f"`{argument}`={dict(kwargs)!r} does not fit {name}{plain}: {err}. Pass only the arguments it takes."
        ) from None


def _module_factory(module: ModuleSpec, init_args: Mapping[str, Any] | None) -> Callable[[], nn.Module]:
    kwargs = dict(init_args or {})
    if isinstance(module, str):
        target = import_object(module, "module")
        _check_init_args(target, kwargs, "module_init_args")
        return lambda: target(**copy.deepcopy(kwargs))
    if isinstance(module, nn.Module):
        if kwargs:
            raise ValueError(
                f"`module_init_args`={kwargs!r} was given with a module instance; init args only apply to an import "
                "path or a factory. Drop them or pass the class."
            )
        template = module
        return lambda: copy.deepcopy(template)
    if callable(module):
        _check_init_args(module, kwargs, "module_init_args")
        return lambda: module(**copy.deepcopy(kwargs))
    raise TypeError(
        f"`module` must be an nn.Module, a callable returning one, or an import path 'pkg.mod:Class', got "
        f"{type(module).__name__}."
    )


def _batch_factory(data: DataSpec, init_args: Mapping[str, Any] | None, batch_size: int) -> Callable[[int, int], Any]:
    """Return ``make(start, size)``: a batch of ``size`` samples starting at sample ``start`` of the step's window."""
    kwargs = dict(init_args or {})
    if isinstance(data, str):
        data = import_object(data, "data")
    if isinstance(data, type):  # a datamodule class: build it with the init args
        _check_init_args(data, kwargs, "data_init_args")
        data = data(**kwargs)
        kwargs = {}
    if hasattr(data, "train_dataloader"):  # a LightningDataModule, duck-typed
        return _datamodule_batches(data, batch_size)
    if callable(data):
        _check_init_args(data, kwargs, "data_init_args", batch_size)
        factory = data
        return lambda start, size: factory(size, **kwargs)
    raise TypeError(
        f"`data` must be a LightningDataModule, a callable `(micro_batch_size) -> batch`, or an import path to "
        f"either, got {type(data).__name__}."
    )


def _datamodule_batches(datamodule: Any, batch_size: int) -> Callable[[int, int], Any]:
    # Collate micro-batches from the dataset itself, as a DataLoader with batch_size=b would: padding collates then
    # pad each micro-batch to its own longest sample, as in training.
    if hasattr(datamodule, "prepare_data"):
        datamodule.prepare_data()
    if hasattr(datamodule, "setup"):
        datamodule.setup("fit")
    loader = datamodule.train_dataloader()
    dataset = loader.dataset
    collate = loader.collate_fn
    if hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__"):
        if len(dataset) < batch_size:
            raise ValueError(
                f"`batch_size`={batch_size} is larger than the training set ({len(dataset)} samples). Lower it."
            )
        samples = [dataset[i] for i in range(batch_size)]
    else:  # an IterableDataset
        iterator = iter(dataset)
        samples = [next(iterator) for _ in range(batch_size)]
    return lambda start, size: collate(samples[start : start + size])


def _optimizers_of(config: Any) -> list[torch.optim.Optimizer]:
    # The forms `configure_optimizers` may return, see LightningModule.configure_optimizers.
    if config is None:
        return []
    if isinstance(config, torch.optim.Optimizer):
        return [config]
    if isinstance(config, Mapping):
        return _optimizers_of(config.get("optimizer"))
    if isinstance(config, (list, tuple)):
        if len(config) == 2 and isinstance(config[0], (list, tuple)):  # ([optimizers], [schedulers])
            return _optimizers_of(list(config[0]))
        return [opt for item in config for opt in _optimizers_of(item)]
    raise TypeError(f"`configure_optimizers` returned {type(config).__name__}, which the probe cannot read.")


def _loss_of(output: Any) -> torch.Tensor | None:
    if isinstance(output, Mapping):
        output = output.get("loss")
    return output if isinstance(output, torch.Tensor) else None


# ---- results --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProbeMeasurement:
    """The measured peak of one configuration (micro-batch ``b``, accumulation steps ``k``).

    Attributes:
        micro_batch_size: ``b``.
        accumulation_steps: ``k``.
        peak_bytes: the peak of live tensor storage over the measured steps.
        breakdown: bytes per category at that peak (parameters, gradients, optimizer_state, activations).
        peak_phase: when the peak happened: ``"forward"``, ``"backward"`` or ``"optimizer"``, with the micro-batch.
        device_peak_bytes: ``torch.cuda.max_memory_allocated`` over the measured steps on CUDA, else ``None``.
    """

    micro_batch_size: int
    accumulation_steps: int
    peak_bytes: int
    breakdown: dict[str, int]
    peak_phase: str
    device_peak_bytes: int | None = None

    @property
    def effective_batch_size(self) -> int:
        """Samples per optimizer step, ``b * k``."""
        return self.micro_batch_size * self.accumulation_steps

    @property
    def label(self) -> str:
        """``"b=16 k=4"``."""
        return f"b={self.micro_batch_size} k={self.accumulation_steps}"


@dataclass
class ProbeResult:
    """What `probe_memory` measured, the fitted ``peak(b)`` line and the answers to the memory question.

    Attributes:
        batch_size: the full batch ``B``.
        device: where the probe ran.
        measurements: one `ProbeMeasurement` per configuration, in the order they ran.
        parameter_bytes: bytes of parameters and buffers.
        gradient_bytes: bytes of one gradient copy (the trainable parameters).
        accumulation_steps: the ``k`` compared, each with ``(B/k, k)`` against ``(B, 1)`` and ``(B/k, 1)``.
        peak_model: `lightning_accum.memory.model.LinearPeakModel` fitted on every accumulating
            configuration (``k >= 2``), the case the micro-batch planner meets.
        holdout_error: mean relative error of a fit on part of the sizes, on the held-out sizes (``None`` when
            fewer than three sizes were measured).
        fit_sizes: the sizes that holdout fit used.
        holdout_sizes: the sizes it was tested on.
        budget_bytes: the memory budget asked about, if any.
    """

    batch_size: int
    device: str
    measurements: list[ProbeMeasurement]
    parameter_bytes: int
    gradient_bytes: int
    accumulation_steps: list[int]
    peak_model: LinearPeakModel
    holdout_error: float | None = None
    fit_sizes: list[int] = field(default_factory=list)
    holdout_sizes: list[int] = field(default_factory=list)
    budget_bytes: float | None = None

    def measurement(self, micro_batch_size: int, accumulation_steps: int) -> ProbeMeasurement:
        """The measurement of configuration ``(b, k)``.

        Raises:
            KeyError: if that configuration was not measured.
        """
        for m in self.measurements:
            if (m.micro_batch_size, m.accumulation_steps) == (micro_batch_size, accumulation_steps):
                return m
        measured = ", ".join(m.label for m in self.measurements)
        raise KeyError(f"b={micro_batch_size} k={accumulation_steps} was not measured; measured: {measured}.")

    @property
    def fitting_micro_batch_size(self) -> int | None:
        """The largest micro-batch (at most ``B``) whose predicted peak fits ``budget_bytes``; ``None`` if none fits."""
        if self.budget_bytes is None or not self.peak_model.fitted():
            return None
        return self.peak_model.largest_fitting(self.budget_bytes, upper=self.batch_size)

    def comparisons(self) -> list[dict[str, Any]]:
        """Both comparisons, with numbers, for every ``k``: full batch vs accumulation, accumulation vs without.

        Each dict has ``k``, ``micro_batch_size``, ``full_batch_bytes``, ``accumulation_bytes``,
        ``same_micro_batch_bytes``, ``saved_vs_full_bytes`` (full minus accumulation), ``expected_saving_bytes``
        (activation memory of ``B - b`` samples: the fitted per-sample bytes times ``B - b``),
        ``extra_vs_same_micro_batch_bytes`` (accumulation minus the same ``b`` with ``k = 1``) and
        ``extra_in_gradient_copies`` (that extra over one gradient copy).
        """
        full = self.measurement(self.batch_size, 1)
        slope = self.peak_model.per_sample_bytes
        out = []
        for k in self.accumulation_steps:
            b = self.batch_size // k
            acc = self.measurement(b, k)
            same = self.measurement(b, 1)
            extra = acc.peak_bytes - same.peak_bytes
            out.append(
                {
                    "k": k,
                    "micro_batch_size": b,
                    "full_batch_bytes": full.peak_bytes,
                    "accumulation_bytes": acc.peak_bytes,
                    "same_micro_batch_bytes": same.peak_bytes,
                    "saved_vs_full_bytes": full.peak_bytes - acc.peak_bytes,
                    "expected_saving_bytes": None if slope is None else slope * (self.batch_size - b),
                    "extra_vs_same_micro_batch_bytes": extra,
                    "extra_in_gradient_copies": extra / self.gradient_bytes if self.gradient_bytes else None,
                }
            )
        return out

    def findings(self) -> list[str]:
        """The answers to the memory question, in plain sentences with the measured numbers."""
        lines = []
        grad = self.gradient_bytes
        for c in self.comparisons():
            b, k, big = c["micro_batch_size"], c["k"], self.batch_size
            expected = c["expected_saving_bytes"]
            saved = c["saved_vs_full_bytes"]
            if saved > 0:
                verdict = "the activations saved outweigh the gradient buffer accumulation keeps alive"
            elif saved < 0:
                verdict = "here the gradient buffer costs more than the activations saved"
            else:
                verdict = (
                    f"both peaks are set in the {self.measurement(big, 1).peak_phase} phase, which b does not change"
                )
            lines.append(
                f"Full batch vs accumulation (k={k}): B={big} in one pass peaks at {_mib(c['full_batch_bytes'])}; "
                f"{k} micro-batches of {b} peak at {_mib(c['accumulation_bytes'])}, "
                f"{_signed(saved, 'lower', 'higher')}. "
                + (
                    ""
                    if expected is None
                    else f"The activation memory of the B-b={big - b} samples no longer in flight is about "
                    f"{_mib(expected)} (fitted per-sample bytes x {big - b}), and "
                )
                + f"accumulation adds up to one gradient copy ({_mib(grad)}): {verdict}."
            )
            copies = c["extra_in_gradient_copies"]
            lines.append(
                f"Accumulation vs the same micro-batch without it (b={b}): k={k} peaks at "
                f"{_mib(c['accumulation_bytes'])}, k=1 at {_mib(c['same_micro_batch_bytes'])}, "
                f"{_signed(c['extra_vs_same_micro_batch_bytes'], 'higher', 'lower')}"
                f"{'' if copies is None else f' = {copies:.2f} gradient copies'} (one copy is {_mib(grad)}): "
                + (
                    "the gradient buffer stays alive through every forward pass after the first."
                    if c["extra_vs_same_micro_batch_bytes"] > 0
                    else "the peak is set where the gradient exists either way, so the buffer costs nothing extra."
                )
            )
        by_b: dict[int, list[ProbeMeasurement]] = {}
        for m in self.measurements:
            by_b.setdefault(m.micro_batch_size, []).append(m)
        same_b = [ms for ms in by_b.values() if len(ms) > 1]
        if same_b:
            ms = max(same_b, key=len)
            acts = ", ".join(f"k={m.accumulation_steps}: {_mib(m.breakdown['activations'])}" for m in ms)
            lines.append(
                f"The micro-batch size, not k, sets activation memory: at b={ms[0].micro_batch_size}, activations at "
                f"the peak are {acts}. Raising k at a fixed micro-batch does not save memory; it only raises the "
                "effective batch."
            )
        if self.peak_model.fitted():
            fixed, slope = self.peak_model.fixed_bytes, self.peak_model.per_sample_bytes
            assert fixed is not None and slope is not None
            error = "" if self.holdout_error is None else f"; error on held-out sizes {self.holdout_error:.1%}"
            lines.append(f"Fitted peak(b) = {_mib(fixed)} + {_human(slope)} x b with accumulation{error}.")
        if self.budget_bytes is not None:
            b = self.fitting_micro_batch_size
            if b is None:
                lines.append(
                    f"With a budget of {self.budget_bytes / _GiB:.3g} GiB not even b=1 fits (predicted "
                    f"{_mib(self.peak_model.predict(1))}): shard the model or lower its memory."
                )
            else:
                k = math.ceil(self.batch_size / b)
                lines.append(
                    f"With a budget of {self.budget_bytes / _GiB:.3g} GiB the largest micro-batch that fits is b={b} "
                    f"(predicted {_mib(self.peak_model.predict(b))}); use k={k} to keep the effective batch at "
                    f"{self.batch_size}."
                )
        return lines

    def table(self) -> str:
        """The measurements as a fixed-width text table (MiB), followed by `findings`."""
        cuda = any(m.device_peak_bytes is not None for m in self.measurements)
        headers = ["b", "k", "b*k", "peak", "params", "grads", "optim", "activ.", "peak phase", "fit pred."]
        if cuda:
            headers.append("cuda max alloc")
        rows = []
        for m in self.measurements:
            pred = self.peak_model.predict(m.micro_batch_size) if self.peak_model.fitted() else None
            row = [
                str(m.micro_batch_size),
                str(m.accumulation_steps),
                str(m.effective_batch_size),
                f"{m.peak_bytes / _MiB:.2f}",
                *(f"{m.breakdown.get(c, 0) / _MiB:.2f}" for c in CATEGORIES),
                m.peak_phase,
                "" if pred is None or m.accumulation_steps == 1 else f"{pred / _MiB:.2f}",
            ]
            if cuda:
                row.append("" if m.device_peak_bytes is None else f"{m.device_peak_bytes / _MiB:.2f}")
            rows.append(row)
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
        lines = [
            f"Peak live tensor memory in MiB on {self.device}; full batch B={self.batch_size}; parameters "
            f"{_mib(self.parameter_bytes)}, one gradient copy {_mib(self.gradient_bytes)}.",
            "  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True)),
        ]
        lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
        return "\n".join([*lines, "", *(f"- {f}" for f in self.findings())])

    def to_dict(self) -> dict[str, Any]:
        """Everything as JSON-serializable values (bytes as numbers)."""
        return {
            "batch_size": self.batch_size,
            "device": self.device,
            "parameter_bytes": self.parameter_bytes,
            "gradient_bytes": self.gradient_bytes,
            "accumulation_steps": list(self.accumulation_steps),
            "measurements": [
                {
                    "micro_batch_size": m.micro_batch_size,
                    "accumulation_steps": m.accumulation_steps,
                    "effective_batch_size": m.effective_batch_size,
                    "peak_bytes": m.peak_bytes,
                    "breakdown": dict(m.breakdown),
                    "peak_phase": m.peak_phase,
                    "device_peak_bytes": m.device_peak_bytes,
                }
                for m in self.measurements
            ],
            "fit": {
                "fixed_bytes": self.peak_model.fixed_bytes,
                "per_sample_bytes": self.peak_model.per_sample_bytes,
                "fit_sizes": list(self.fit_sizes),
                "holdout_sizes": list(self.holdout_sizes),
                "holdout_relative_error": self.holdout_error,
            },
            "comparisons": self.comparisons(),
            "budget_bytes": self.budget_bytes,
            "fitting_micro_batch_size": self.fitting_micro_batch_size,
            "findings": self.findings(),
        }

    def plot(self, path: str | Path) -> Path:
        """Write a PNG: stacked peak breakdown per configuration, and peak against ``b`` with the fitted line.

        Raises:
            ModuleNotFoundError: if matplotlib is not installed (``pip install 'lightning-accum[report]'``).
        """
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ModuleNotFoundError as err:
            raise ModuleNotFoundError(
                "`ProbeResult.plot` needs matplotlib: pip install 'lightning-accum[report]'."
            ) from err
        path = Path(path)
        colors = {
            "parameters": "#4c72b0",
            "gradients": "#dd8452",
            "optimizer_state": "#55a868",
            "activations": "#c44e52",
        }
        fig, (ax_bar, ax_fit) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [3, 2]})
        ms = list(self.measurements)  # run order: (B, 1), then (B/k, k) next to (B/k, 1), then fit points
        x = range(len(ms))
        bottom = [0.0] * len(ms)
        for cat in CATEGORIES:
            heights = [m.breakdown.get(cat, 0) / _MiB for m in ms]
            ax_bar.bar(x, heights, bottom=bottom, color=colors[cat], label=cat.replace("_", " "))
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
        for i, m in enumerate(ms):
            if m.device_peak_bytes is not None:
                ax_bar.plot([i - 0.4, i + 0.4], [m.device_peak_bytes / _MiB] * 2, color="black", lw=1.5)
        ax_bar.set_xticks(list(x), [f"b={m.micro_batch_size}\nk={m.accumulation_steps}" for m in ms], fontsize=8)
        ax_bar.set_ylabel("peak live tensor memory (MiB)")
        ax_bar.set_title(f"Peak by configuration (B={self.batch_size}, {self.device})")
        ax_bar.legend(fontsize=8)

        acc = [m for m in self.measurements if m.accumulation_steps > 1]
        one = [m for m in self.measurements if m.accumulation_steps == 1]
        held = set(self.holdout_sizes)
        fit_pts = [m for m in acc if m.micro_batch_size not in held]
        held_pts = [m for m in acc if m.micro_batch_size in held]
        ax_fit.scatter([m.micro_batch_size for m in fit_pts], [m.peak_bytes / _MiB for m in fit_pts], label="k>=2")
        if held_pts:
            ax_fit.scatter(
                [m.micro_batch_size for m in held_pts],
                [m.peak_bytes / _MiB for m in held_pts],
                marker="D",
                facecolors="none",
                edgecolors="C0",
                label="k>=2, held out (error check)",
            )
        ax_fit.scatter([m.micro_batch_size for m in one], [m.peak_bytes / _MiB for m in one], marker="x", label="k=1")
        if self.peak_model.fitted():
            xs = [1, self.batch_size]
            ax_fit.plot(xs, [self.peak_model.predict(b) / _MiB for b in xs], color="C0", lw=1, label="fit (k>=2)")
        if self.budget_bytes is not None:
            ax_fit.axhline(self.budget_bytes / _MiB, color="grey", ls="--", label="budget")
        ax_fit.set_xlabel("micro-batch size b")
        ax_fit.set_ylabel("peak (MiB)")
        error = "" if self.holdout_error is None else f", held-out error {self.holdout_error:.1%}"
        ax_fit.set_title(f"peak(b){error}")
        ax_fit.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path

    def __repr__(self) -> str:
        return f"ProbeResult(B={self.batch_size}, device={self.device!r}, {len(self.measurements)} configurations)"


def _mib(value: float) -> str:
    return f"{value / _MiB:.2f} MiB"


def _human(value: float) -> str:
    for unit, size in (("GiB", _GiB), ("MiB", _MiB), ("KiB", 2**10)):
        if abs(value) >= size:
            return f"{value / size:.2f} {unit}"
    return f"{value:.0f} B"


def _signed(value: float, positive: str, negative: str) -> str:
    return f"{_mib(abs(value))} {positive if value >= 0 else negative}"


# ---- the measurement -------------------------------------------------------------------------------------------------


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
    if not _optimizers_of(model.configure_optimizers()):
        raise ValueError(f"`module` {name}: `configure_optimizers` returned no optimizer.")


def _measure(
    make_module: Callable[[], nn.Module],
    make_batch: Callable[[int, int], Any],
    b: int,
    k: int,
    steps: int,
    warmup_steps: int,
    device: torch.device,
    seed: int,
) -> tuple[ProbeMeasurement, int, int]:
    gc.collect()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    torch.manual_seed(seed)
    model = make_module().to(device)  # a fresh copy: no state carried over from another configuration
    model.train()
    optimizers = _optimizers_of(model.configure_optimizers())
    param_bytes = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    # Batches are built before measuring, on the CPU, so the data pipeline's own memory stays out of the peak; each
    # is counted from the moment it reaches the device until its micro-batch is done.
    batches = [make_batch(i * b, b) for _ in range(warmup_steps + steps) for i in range(k)]
    tracker = MemoryTracker(model, optimizers, device=device)
    batch_idx = 0
    with warnings.catch_warnings(), tracker:
        warnings.filterwarnings("ignore", message=r".*self\.log\(\).*")  # no Trainer on purpose
        for step in range(warmup_steps + steps):
            if step == warmup_steps:
                tracker.reset_peak()
                if cuda:
                    torch.cuda.synchronize(device)
                    torch.cuda.reset_peak_memory_stats(device)
            for i in range(k):
                batch = move_data_to_device(batches.pop(0), device)
                tracker.track(batch, "activations")
                with tracker.phase(f"forward {i + 1}/{k}"):
                    loss = _loss_of(model.training_step(batch, batch_idx))
                if loss is None:
                    raise ValueError(
                        f"`module` {type(model).__name__}.training_step returned no loss; the probe needs a Tensor or "
                        "a dict with a 'loss' Tensor."
                    )
                with tracker.phase(f"backward {i + 1}/{k}"):
                    (loss / k).backward()
                del loss, batch  # free the micro-batch's activations before the next one, as Lightning does
                batch_idx += 1
            with tracker.phase("optimizer"):
                for opt in optimizers:
                    opt.step()
            for opt in optimizers:
                opt.zero_grad(set_to_none=True)
    device_peak = None
    if cuda:
        torch.cuda.synchronize(device)
        device_peak = int(torch.cuda.max_memory_allocated(device))
    peak = tracker.peak
    measurement = ProbeMeasurement(b, k, peak.total_bytes, dict(peak.by_category), peak.phase, device_peak)
    del model, optimizers, tracker
    gc.collect()
    return measurement, param_bytes, grad_bytes


def probe_memory(
    module: ModuleSpec,
    data: DataSpec,
    *,
    batch_size: int,
    accumulation_steps: Sequence[int] = (2, 4),
    fit_micro_batch_sizes: Sequence[int] | None = None,
    grid: Sequence[tuple[int, int]] = (),
    steps: int = 2,
    warmup_steps: int = 1,
    device: str | torch.device = "cpu",
    budget_bytes: float | None = None,
    module_init_args: Mapping[str, Any] | None = None,
    data_init_args: Mapping[str, Any] | None = None,
    seed: int = 0,
) -> ProbeResult:
    """Measure peak memory of real training steps over a grid of ``(b, k)`` and answer the memory question.

    The grid always holds the full batch ``(B, 1)`` and, for every ``k`` in ``accumulation_steps``, ``(B/k, k)`` and
    ``(B/k, 1)``. For the ``peak(b)`` fit it adds ``(b, 2)`` for each ``b`` in ``fit_micro_batch_sizes`` (default:
    ``B/2, B/4, B/8, B/16``), then any extra ``grid`` points. Every configuration starts from a fresh copy of the
    model, runs ``warmup_steps`` steps (the first creates optimizer state), then ``steps`` measured steps. The peak
    is the maximum of live tensor storage over the measured steps (see
    `lightning_accum.memory.tracker.MemoryTracker`); on CUDA ``torch.cuda.max_memory_allocated`` is
    reported as well.

    The fit uses the accumulating configurations (``k >= 2``), where the gradient buffer is alive during the forward
    pass: that is what the micro-batch planner faces. Its error is checked by fitting the sizes at even positions of
    the sorted list and predicting the others, so both interpolation and, when the largest size is held out,
    extrapolation are tested.

    Every check of the arguments and of the module (on one throwaway instance) runs before anything is measured; only
    a ``training_step`` that returns no loss is found at the first step.

    Args:
        module: a LightningModule (copied for each configuration), a callable that returns a fresh one, or an import
            path ``"pkg.mod:Class"`` instantiated with ``module_init_args``. Anything with ``training_step`` and
            ``configure_optimizers`` (automatic optimization) works.
        data: a LightningDataModule (micro-batches are collated from its training set with its ``collate_fn``), a
            callable ``(micro_batch_size, **data_init_args) -> batch``, or an import path to either.
        batch_size: the full batch ``B`` per device.
        accumulation_steps: the ``k`` values to compare; each must divide ``B``.
        fit_micro_batch_sizes: extra micro-batch sizes measured with ``k = 2`` for the fit.
        grid: extra ``(b, k)`` configurations.
        steps: measured optimizer steps per configuration.
        warmup_steps: unmeasured steps before them.
        device: where to run.
        budget_bytes: a memory budget; the result says which micro-batch fits it.
        module_init_args: keyword arguments for an import-path or factory ``module``.
        data_init_args: keyword arguments for an import-path ``data`` class or a batch factory.
        seed: the seed set before building each model.

    Returns:
        a `ProbeResult`.

    Raises:
        TypeError: if an argument has the wrong type, init args do not fit the class or factory they are for, or
            the module lacks ``training_step``.
        ValueError: if ``k`` does not divide ``B``, a size is below 1, the module has no optimizer, or it returns
            no loss.
        RuntimeError: if the module uses manual optimization.
        ImportError: if an import path names no module or attribute.

    Examples:
        >>> import lightning.pytorch as pl
        >>> class Tiny(pl.LightningModule):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.net = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(4)])
        ...     def training_step(self, batch, batch_idx):
        ...         return self.net(batch).square().mean()
        ...     def configure_optimizers(self):
        ...         return torch.optim.SGD(self.parameters(), lr=0.1)
        >>> result = probe_memory(Tiny(), lambda b: torch.randn(b, 32), batch_size=32, accumulation_steps=[4],
        ...                       fit_micro_batch_sizes=[2, 4], steps=1)
        >>> full, acc, same = result.measurement(32, 1), result.measurement(8, 4), result.measurement(8, 1)
        >>> full.peak_bytes > acc.peak_bytes >= same.peak_bytes
        True
    """
    batch_size = check_int(batch_size, "batch_size", 1)
    steps = check_int(steps, "steps", 1)
    warmup_steps = check_int(warmup_steps, "warmup_steps", 0)
    ks = sorted({check_int(k, "accumulation_steps", 2) for k in accumulation_steps})
    for k in ks:
        if batch_size % k:
            raise ValueError(
                f"`accumulation_steps` holds {k}, which does not divide `batch_size`={batch_size}; the comparison "
                f"needs micro-batches of exactly B/k. Pick a divisor of {batch_size}."
            )
    if fit_micro_batch_sizes is None:
        fit_micro_batch_sizes = sorted({batch_size // d for d in (2, 4, 8, 16) if batch_size // d >= 1})
    fit_sizes_requested = [check_int(b, "fit_micro_batch_sizes", 1) for b in fit_micro_batch_sizes]
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"`device`={str(device)!r} but CUDA is not available here. Use `device='cpu'`.")

    configs: list[tuple[int, int]] = [(batch_size, 1)]
    for k in ks:
        configs += [(batch_size // k, k), (batch_size // k, 1)]
    configs += [(b, 2) for b in fit_sizes_requested]
    for b, k in grid:
        configs.append((check_int(b, "grid micro-batch size", 1), check_int(k, "grid accumulation steps", 1)))
    configs = list(dict.fromkeys(configs))  # drop repeats, keep order

    make_module = _module_factory(module, module_init_args)
    _check_module(make_module())  # on a throwaway instance, so that a wrong module fails before any measuring
    largest = max(b for b, _ in configs)
    make_batch = _batch_factory(data, data_init_args, max(batch_size, largest))
    measurements = []
    param_bytes = grad_bytes = 0
    for b, k in configs:
        m, param_bytes, grad_bytes = _measure(make_module, make_batch, b, k, steps, warmup_steps, dev, seed)
        measurements.append(m)

    # Fit on the accumulating configurations; with several k at one b, the largest peak counts.
    peaks: dict[int, int] = {}
    for m in measurements:
        if m.accumulation_steps >= 2:
            peaks[m.micro_batch_size] = max(peaks.get(m.micro_batch_size, 0), m.peak_bytes)
    peak_model = LinearPeakModel(max_sizes=max(2, len(peaks)))
    for b, peak in sorted(peaks.items()):
        peak_model.observe(b, peak)
    sizes = sorted(peaks)
    holdout_error = None
    fit_sizes, holdout_sizes = sizes, []
    if len(sizes) >= 3:
        fit_sizes, holdout_sizes = sizes[::2], sizes[1::2]
        holdout = LinearPeakModel(max_sizes=len(fit_sizes))
        for b in fit_sizes:
            holdout.observe(b, peaks[b])
        holdout_error = holdout.relative_error([(b, peaks[b]) for b in holdout_sizes])
    return ProbeResult(
        batch_size=batch_size,
        device=str(dev),
        measurements=measurements,
        parameter_bytes=param_bytes,
        gradient_bytes=grad_bytes,
        accumulation_steps=ks,
        peak_model=peak_model,
        holdout_error=holdout_error,
        fit_sizes=fit_sizes,
        holdout_sizes=holdout_sizes,
        budget_bytes=budget_bytes,
    )


def write_outputs(result: ProbeResult, output_dir: str | Path, stem: str = "probe") -> dict[str, Path]:
    """Write ``<stem>.txt`` (the table), ``<stem>.json`` and ``<stem>.png`` into ``output_dir``; return the paths."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"txt": out / f"{stem}.txt", "json": out / f"{stem}.json", "png": out / f"{stem}.png"}
    paths["txt"].write_text(result.table() + "\n")
    paths["json"].write_text(json.dumps(result.to_dict(), indent=2) + "\n")
    result.plot(paths["png"])
    return paths
