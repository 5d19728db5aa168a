"""What the probe says: the findings in sentences, the table, the JSON, the plot and the files they go to."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from lightning_accum.memory.sizes import FACTORS, UNITS, format_size, size_unit
from lightning_accum.memory.tracker import CATEGORIES

if TYPE_CHECKING:
    from lightning_accum.probe.result import ProbeMeasurement, ProbeResult

_COLORS = {"parameters": "#4c72b0", "gradients": "#dd8452", "optimizer_state": "#55a868", "activations": "#c44e52"}


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
        f"Full batch vs accumulation (k={k}): B={big} in one pass peaks at {format_size(c['full_batch_bytes'])}; "
        f"{k} micro-batches of {b} peak at {format_size(c['accumulation_bytes'])}, "
        f"{_signed(saved, 'lower', 'higher')}. "
        + (
            ""
            if expected is None
            else f"The activation memory of the B-b={big - b} samples no longer in flight is about "
            f"{format_size(expected)} (fitted per-sample bytes x {big - b}), and "
        )
        + f"accumulation adds up to one gradient copy ({format_size(grad)}): {verdict}."
    )
    copies = c["extra_in_gradient_copies"]
    acc_vs_same = (
        f"Accumulation vs the same micro-batch without it (b={b}): k={k} peaks at "
        f"{format_size(c['accumulation_bytes'])}, k=1 at {format_size(c['same_micro_batch_bytes'])}, "
        f"{_signed(c['extra_vs_same_micro_batch_bytes'], 'higher', 'lower')}"
        f"{'' if copies is None else f' = {copies:.2f} gradient copies'} (one copy is {format_size(grad)}): "
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
    acts = ", ".join(f"k={m.accumulation_steps}: {format_size(m.breakdown['activations'])}" for m in ms)
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
    return [f"Fitted peak(b) = {format_size(fixed)} + {format_size(slope)} x b with accumulation{error}."]


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
            f"{format_size(result.peak_model.predict(1))}): shard the model or lower its memory."
        ]
    k = math.ceil(result.batch_size / b)
    kept = f", keeping {result.headroom:.0%} of it free" if result.headroom else ""
    return [
        f"With a budget of {_budget_text(result.budget_bytes)}{kept} the largest micro-batch that fits is b={b} "
        f"(predicted {format_size(result.peak_model.predict(b))}); use k={k} to keep the effective batch at "
        f"{result.batch_size}."
    ]


class _Predicted(Protocol):
    """What `_prediction_lines` reads: a `ProbeResult` or a `TokenProbeResult`."""

    @property
    def target(self) -> str | None: ...

    @property
    def precision(self) -> str: ...

    @property
    def headroom(self) -> float: ...


def _prediction_lines(result: _Predicted) -> list[str]:
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
            + (
                f"op lists; {result.headroom:.0%} of a budget is kept free for them."
                if result.headroom
                else "op lists; none of the budget is kept free for them (headroom 0): count them in the budget."
            )
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


def table_unit(result: ProbeResult) -> str:
    """The one unit of the table's columns: the unit that reads best for its largest peak (``"MiB"``, ``"GiB"``)."""
    peaks = [m.peak_bytes for m in result.measurements] + [m.device_peak_bytes or 0 for m in result.measurements]
    return size_unit(max(peaks, default=0))


def table(result: ProbeResult) -> str:
    """The measurements as a fixed-width text table (in `table_unit`), followed by the findings."""
    cuda = any(m.device_peak_bytes is not None for m in result.measurements)
    headers = ["b", "k", "b*k", "peak", "params", "grads", "optim", "activ.", "peak phase", "fit pred."]
    if cuda:
        headers.append("cuda max alloc")
    unit = table_unit(result)

    def cell(nbytes: float) -> str:
        return format_size(nbytes, unit).removesuffix(f" {unit}")

    rows = []
    for m in result.measurements:
        pred = result.peak_model.predict(m.micro_batch_size) if result.peak_model.fitted() else None
        row = [
            str(m.micro_batch_size),
            str(m.accumulation_steps),
            str(m.effective_batch_size),
            cell(m.peak_bytes),
            *(cell(m.breakdown.get(c, 0)) for c in CATEGORIES),
            m.peak_phase,
            "" if pred is None or m.accumulation_steps == 1 else cell(pred),
        ]
        if cuda:
            row.append("" if m.device_peak_bytes is None else cell(m.device_peak_bytes))
        rows.append(row)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    what = "Peak live tensor memory" if result.target is None else "Predicted peak live tensor memory"
    lines = [
        f"{what} in {unit} on {result.device}, {result.precision}; full batch B={result.batch_size}; parameters "
        f"{format_size(result.parameter_bytes)}, one gradient copy {format_size(result.gradient_bytes)}.",
        "  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True)),
    ]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines += ["", *(f"- {f}" for f in findings(result))]
    paste = snippet(result)
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
        "findings": findings(result),
        "snippet": snippet(result),
    }


# ---- the plot -------------------------------------------------------------------------------------------------------


def plot(result: ProbeResult, path: str | Path) -> Path:
    """Write `figure` as a PNG to ``path``.

    Raises:
        ModuleNotFoundError: if matplotlib is not installed (``pip install 'lightning-accum[report]'``).
    """
    fig = figure(result)  # first: it says how to install matplotlib if it is missing
    import matplotlib.pyplot as plt

    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def pyplot(needed_by: str) -> Any:
    """``matplotlib.pyplot`` on the Agg backend (no display needed), or an error that says how to install it.

    Raises:
        ModuleNotFoundError: if matplotlib is not installed (``pip install 'lightning-accum[report]'``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError(
            f"`{needed_by}` needs matplotlib: pip install 'lightning-accum[report]'.", name="matplotlib"
        ) from err
    return plt


def figure(result: ProbeResult) -> Any:
    """A matplotlib figure: the stacked peak breakdown per configuration, and peak against ``b``.

    The second panel has the fitted line, the budget, the part of it the recommendation measures against (the budget
    less its `headroom`, drawn when there is one) and the recommended ``b``, each labelled.

    Raises:
        ModuleNotFoundError: if matplotlib is not installed (``pip install 'lightning-accum[report]'``).
    """
    plt = pyplot("ProbeResult.plot")
    fig, (ax_bar, ax_fit) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [3, 2]})
    unit = table_unit(result)
    _plot_breakdown(ax_bar, result, unit)
    _plot_fit(ax_fit, result, unit)
    fig.tight_layout()
    return fig


def _plot_breakdown(ax: Any, result: ProbeResult, unit: str) -> None:
    ms = list(result.measurements)  # run order: (B, 1), then (B/k, k) next to (B/k, 1), then fit points
    x = range(len(ms))
    bottom = [0.0] * len(ms)
    for cat in CATEGORIES:
        heights = [m.breakdown.get(cat, 0) / FACTORS[unit] for m in ms]
        ax.bar(x, heights, bottom=bottom, color=_COLORS[cat], label=cat.replace("_", " "))
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    for i, m in enumerate(ms):
        if m.device_peak_bytes is not None:
            ax.plot([i - 0.4, i + 0.4], [m.device_peak_bytes / FACTORS[unit]] * 2, color="black", lw=1.5)
    ax.set_xticks(list(x), [f"b={m.micro_batch_size}\nk={m.accumulation_steps}" for m in ms], fontsize=8)
    ax.set_ylabel(f"peak live tensor memory ({unit})")
    ax.set_title(f"Peak by configuration (B={result.batch_size}, {result.device})")
    ax.legend(fontsize=8)


def _plot_fit(ax: Any, result: ProbeResult, unit: str) -> None:
    scale = FACTORS[unit]
    acc = [m for m in result.measurements if m.accumulation_steps > 1]
    one = [m for m in result.measurements if m.accumulation_steps == 1]
    held = set(result.holdout_sizes)
    fit_pts = [m for m in acc if m.micro_batch_size not in held]
    held_pts = [m for m in acc if m.micro_batch_size in held]
    ax.scatter([m.micro_batch_size for m in fit_pts], [m.peak_bytes / scale for m in fit_pts], label="k>=2")
    if held_pts:
        ax.scatter(
            [m.micro_batch_size for m in held_pts],
            [m.peak_bytes / scale for m in held_pts],
            marker="D",
            facecolors="none",
            edgecolors="C0",
            label="k>=2, held out (error check)",
        )
    ax.scatter([m.micro_batch_size for m in one], [m.peak_bytes / scale for m in one], marker="x", label="k=1")
    if result.peak_model.fitted():
        xs = [1, result.batch_size]
        ax.plot(xs, [result.peak_model.predict(b) / scale for b in xs], color="C0", lw=1, label="fit (k>=2)")
    _plot_budget(ax, result, scale)
    ax.set_xlabel("micro-batch size b")
    ax.set_ylabel(f"peak ({unit})")
    error = "" if result.holdout_error is None else f", held-out error {result.holdout_error:.1%}"
    ax.set_title(f"peak(b){error}")
    ax.legend(fontsize=8)


def _plot_budget(ax: Any, result: ProbeResult, scale: int) -> None:
    """The budget, what the recommendation measures against (the budget less its headroom), and the ``b`` it gives."""
    budget = result.budget_bytes
    if budget is None:
        return
    ax.axhline(budget / scale, color="grey", ls="--", label=f"budget {format_size(budget)}")
    usable = budget * (1 - result.headroom)
    if result.headroom:
        label = f"budget less {result.headroom:.0%} kept free: {format_size(usable)}"
        ax.axhline(usable / scale, color="C3", ls="-.", label=label)
    b = result.fitting_micro_batch_size
    if b is not None:
        ax.axvline(b, color="C2", ls=":", label=f"b={b}: the largest predicted to fit {format_size(usable)}")


# ---- numbers --------------------------------------------------------------------------------------------------------


def _size_text(value: float) -> int | str:
    """``"8GiB"`` for a whole number of a unit, else the whole bytes (``max_memory`` reads both)."""
    for unit, size in UNITS[1:-1]:  # GiB, MiB, KiB: the units `max_memory` strings are written in
        if value >= size and value % size == 0:
            return f"{int(value // size)}{unit}"
    return int(value)


def _budget_text(value: float) -> str:
    """A budget as the user likely wrote it: ``100MiB`` for a whole number of a unit, else in GiB."""
    size = _size_text(value)
    return size if isinstance(size, str) else format_size(value)


def _signed(value: float, positive: str, negative: str) -> str:
    return f"{format_size(abs(value))} {positive if value >= 0 else negative}"
