"""What the probe says: the findings in sentences, the table, the JSON, the plot and the files they go to."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_accum.memory.budget import GIB
from lightning_accum.memory.tracker import CATEGORIES

if TYPE_CHECKING:
    from lightning_accum.probe.result import ProbeMeasurement, ProbeResult

_MiB = 2**20
_GiB = GIB
_COLORS = {"parameters": "#4c72b0", "gradients": "#dd8452", "optimizer_state": "#55a868", "activations": "#c44e52"}


def write_outputs(result: ProbeResult, output_dir: str | Path, stem: str = "probe") -> dict[str, Path]:
    """Write ``<stem>.txt`` (the table), ``<stem>.json`` and ``<stem>.png`` into ``output_dir``; return the paths."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"txt": out / f"{stem}.txt", "json": out / f"{stem}.json", "png": out / f"{stem}.png"}
    paths["txt"].write_text(result.table() + "\n")
    paths["json"].write_text(json.dumps(result.to_dict(), indent=2) + "\n")
    result.plot(paths["png"])
    return paths


# ---- sentences ------------------------------------------------------------------------------------------------------


def findings(result: ProbeResult) -> list[str]:
    """The answers to the memory question, in plain sentences with the measured numbers."""
    lines = []
    for c in result.comparisons():
        lines += _comparison_lines(result, c)
    lines += _activation_lines(result)
    lines += _fit_lines(result)
    lines += _budget_lines(result)
    lines += _prediction_lines(result)
    return lines


def _comparison_lines(result: ProbeResult, c: dict[str, Any]) -> list[str]:
    grad = result.gradient_bytes
    b, k, big = c["micro_batch_size"], c["k"], result.batch_size
    expected = c["expected_saving_bytes"]
    saved = c["saved_vs_full_bytes"]
    if saved > 0:
        verdict = "the activations saved outweigh the gradient buffer accumulation keeps alive"
    elif saved < 0:
        verdict = "here the gradient buffer costs more than the activations saved"
    else:
        verdict = f"both peaks are set in the {result.measurement(big, 1).peak_phase} phase, which b does not change"
    full_vs_acc = (
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
    acc_vs_same = (
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
    return [full_vs_acc, acc_vs_same]


def _activation_lines(result: ProbeResult) -> list[str]:
    by_b: dict[int, list[ProbeMeasurement]] = {}
    for m in result.measurements:
        by_b.setdefault(m.micro_batch_size, []).append(m)
    same_b = [ms for ms in by_b.values() if len(ms) > 1]
    if not same_b:
        return []
    ms = max(same_b, key=len)
    acts = ", ".join(f"k={m.accumulation_steps}: {_mib(m.breakdown['activations'])}" for m in ms)
    return [
        f"The micro-batch size, not k, sets activation memory: at b={ms[0].micro_batch_size}, activations at "
        f"the peak are {acts}. Raising k at a fixed micro-batch does not save memory; it only raises the "
        "effective batch."
    ]


def _fit_lines(result: ProbeResult) -> list[str]:
    fixed, slope = result.peak_model.fixed_bytes, result.peak_model.per_sample_bytes
    if fixed is None or slope is None:
        return []
    error = "" if result.holdout_error is None else f"; error on held-out sizes {result.holdout_error:.1%}"
    return [f"Fitted peak(b) = {_mib(fixed)} + {_human(slope)} x b with accumulation{error}."]


def _budget_lines(result: ProbeResult) -> list[str]:
    if result.budget_bytes is None:
        return []
    if not result.peak_model.fitted():
        return [
            f"A budget of {_budget_text(result.budget_bytes)} was given, but peak(b) needs accumulating "
            "configurations at two micro-batch sizes to say which b fits it: add `fit_micro_batch_sizes`."
        ]
    b = result.fitting_micro_batch_size
    if b is None:
        return [
            f"With a budget of {_budget_text(result.budget_bytes)} not even b=1 fits (predicted "
            f"{_mib(result.peak_model.predict(1))}): shard the model or lower its memory."
        ]
    k = math.ceil(result.batch_size / b)
    kept = f", keeping {result.headroom:.0%} of it free" if result.headroom else ""
    return [
        f"With a budget of {_budget_text(result.budget_bytes)}{kept} the largest micro-batch that fits is b={b} "
        f"(predicted {_mib(result.peak_model.predict(b))}); use k={k} to keep the effective batch at "
        f"{result.batch_size}."
    ]


def _prediction_lines(result: ProbeResult) -> list[str]:
    if result.target is None:
        return []
    lines = [
        f"Predicted on fake tensors for {result.target} in {result.precision}: nothing was allocated; the peaks are "
        "the live tensors the step would hold there."
    ]
    if result.target == "cuda":
        lines.append(
            "For CUDA: counted in the caching allocator's 512-byte blocks, with CUDA's foreach optimizer; attention "
            "runs the CPU's flash kernel, which keeps what CUDA's fused kernels keep. Not seen: the CUDA context, "
            "cuBLAS workspaces, NCCL buffers, fragmentation, a math-path attention fallback and CUDA's own autocast "
            f"op lists; {result.headroom:.0%} of a budget is kept free for them."
        )
    return lines


def snippet(result: ProbeResult) -> str | None:
    """``AutoMicroBatching`` settings for the fitting micro-batch, in Python and as LightningCLI YAML, or ``None``.

    The step batch ``B`` becomes the dataloader's batch size (split mode); the budget becomes ``max_memory``.
    """
    b = result.fitting_micro_batch_size
    if b is None or result.budget_bytes is None:
        return None
    budget = _size_text(result.budget_bytes)
    return "\n".join(
        [
            f"AutoMicroBatching(micro_batch_size={b}, max_memory={budget!r})  # with a DataLoader batch_size of "
            f"{result.batch_size}",
            "# or in a LightningCLI config:",
            "trainer:",
            "  callbacks:",
            "    - class_path: lightning_accum.AutoMicroBatching",
            "      init_args:",
            f"        micro_batch_size: {b}  # where it starts; it adapts to the measured peak from there",
            f"        max_memory: {budget}",
            "data:",
            f"  batch_size: {result.batch_size}  # the whole per-device step batch",
        ]
    )


# ---- the table and the JSON -----------------------------------------------------------------------------------------


def table(result: ProbeResult) -> str:
    """The measurements as a fixed-width text table (MiB), followed by the findings."""
    cuda = any(m.device_peak_bytes is not None for m in result.measurements)
    headers = ["b", "k", "b*k", "peak", "params", "grads", "optim", "activ.", "peak phase", "fit pred."]
    if cuda:
        headers.append("cuda max alloc")
    rows = []
    for m in result.measurements:
        pred = result.peak_model.predict(m.micro_batch_size) if result.peak_model.fitted() else None
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
    what = "Peak live tensor memory" if result.target is None else "Predicted peak live tensor memory"
    lines = [
        f"{what} in MiB on {result.device}, {result.precision}; full batch B={result.batch_size}; parameters "
        f"{_mib(result.parameter_bytes)}, one gradient copy {_mib(result.gradient_bytes)}.",
        "  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True)),
    ]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines += ["", *(f"- {f}" for f in result.findings())]
    paste = result.snippet()
    if paste is not None:
        lines += ["", "Ready to paste (split mode):", paste]
    return "\n".join(lines)


def to_dict(result: ProbeResult) -> dict[str, Any]:
    """Everything in ``result`` as JSON-serializable values (bytes as numbers)."""
    return {
        "batch_size": result.batch_size,
        "device": result.device,
        "target": result.target,
        "precision": result.precision,
        "parameter_bytes": result.parameter_bytes,
        "gradient_bytes": result.gradient_bytes,
        "accumulation_steps": list(result.accumulation_steps),
        "measurements": [
            {
                "micro_batch_size": m.micro_batch_size,
                "accumulation_steps": m.accumulation_steps,
                "effective_batch_size": m.effective_batch_size,
                "peak_bytes": m.peak_bytes,
                "breakdown": dict(m.breakdown),
                "peak_phase": m.peak_phase,
                "phase_peak_bytes": dict(m.phase_peak_bytes),
                "device_peak_bytes": m.device_peak_bytes,
            }
            for m in result.measurements
        ],
        "fit": {
            "fixed_bytes": result.peak_model.fixed_bytes,
            "per_sample_bytes": result.peak_model.per_sample_bytes,
            "fit_sizes": list(result.fit_sizes),
            "holdout_sizes": list(result.holdout_sizes),
            "holdout_relative_error": result.holdout_error,
        },
        "comparisons": result.comparisons(),
        "budget_bytes": result.budget_bytes,
        "headroom": result.headroom,
        "fitting_micro_batch_size": result.fitting_micro_batch_size,
        "findings": result.findings(),
        "snippet": result.snippet(),
    }


# ---- the plot -------------------------------------------------------------------------------------------------------


def plot(result: ProbeResult, path: str | Path) -> Path:
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
    fig, (ax_bar, ax_fit) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [3, 2]})
    _plot_breakdown(ax_bar, result)
    _plot_fit(ax_fit, result)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_breakdown(ax: Any, result: ProbeResult) -> None:
    ms = list(result.measurements)  # run order: (B, 1), then (B/k, k) next to (B/k, 1), then fit points
    x = range(len(ms))
    bottom = [0.0] * len(ms)
    for cat in CATEGORIES:
        heights = [m.breakdown.get(cat, 0) / _MiB for m in ms]
        ax.bar(x, heights, bottom=bottom, color=_COLORS[cat], label=cat.replace("_", " "))
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    for i, m in enumerate(ms):
        if m.device_peak_bytes is not None:
            ax.plot([i - 0.4, i + 0.4], [m.device_peak_bytes / _MiB] * 2, color="black", lw=1.5)
    ax.set_xticks(list(x), [f"b={m.micro_batch_size}\nk={m.accumulation_steps}" for m in ms], fontsize=8)
    ax.set_ylabel("peak live tensor memory (MiB)")
    ax.set_title(f"Peak by configuration (B={result.batch_size}, {result.device})")
    ax.legend(fontsize=8)


def _plot_fit(ax: Any, result: ProbeResult) -> None:
    acc = [m for m in result.measurements if m.accumulation_steps > 1]
    one = [m for m in result.measurements if m.accumulation_steps == 1]
    held = set(result.holdout_sizes)
    fit_pts = [m for m in acc if m.micro_batch_size not in held]
    held_pts = [m for m in acc if m.micro_batch_size in held]
    ax.scatter([m.micro_batch_size for m in fit_pts], [m.peak_bytes / _MiB for m in fit_pts], label="k>=2")
    if held_pts:
        ax.scatter(
            [m.micro_batch_size for m in held_pts],
            [m.peak_bytes / _MiB for m in held_pts],
            marker="D",
            facecolors="none",
            edgecolors="C0",
            label="k>=2, held out (error check)",
        )
    ax.scatter([m.micro_batch_size for m in one], [m.peak_bytes / _MiB for m in one], marker="x", label="k=1")
    if result.peak_model.fitted():
        xs = [1, result.batch_size]
        ax.plot(xs, [result.peak_model.predict(b) / _MiB for b in xs], color="C0", lw=1, label="fit (k>=2)")
    if result.budget_bytes is not None:
        ax.axhline(result.budget_bytes / _MiB, color="grey", ls="--", label="budget")
    ax.set_xlabel("micro-batch size b")
    ax.set_ylabel("peak (MiB)")
    error = "" if result.holdout_error is None else f", held-out error {result.holdout_error:.1%}"
    ax.set_title(f"peak(b){error}")
    ax.legend(fontsize=8)


# ---- numbers --------------------------------------------------------------------------------------------------------


def _mib(value: float) -> str:
    return f"{value / _MiB:.2f} MiB"


def _human(value: float) -> str:
    for unit, size in (("GiB", _GiB), ("MiB", _MiB), ("KiB", 2**10)):
        if abs(value) >= size:
            return f"{value / size:.2f} {unit}"
    return f"{value:.0f} B"


def _size_text(value: float) -> int | str:
    """``"8GiB"`` for a whole number of a unit, else the whole bytes (``max_memory`` reads both)."""
    for unit, size in (("GiB", _GiB), ("MiB", _MiB), ("KiB", 2**10)):
        if value >= size and value % size == 0:
            return f"{int(value // size)}{unit}"
    return int(value)


def _budget_text(value: float) -> str:
    """A budget as the user likely wrote it: ``100MiB`` for a whole number of a unit, else in GiB."""
    size = _size_text(value)
    return size if isinstance(size, str) else f"{value / _GiB:.3g} GiB"


def _signed(value: float, positive: str, negative: str) -> str:
    return f"{_mib(abs(value))} {positive if value >= 0 else negative}"
