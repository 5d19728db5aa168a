"""What the probe in tokens says: the fit and its check in sentences, the token budget, the table, JSON and a plot."""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

from lightning_accum.memory.sizes import FACTORS, format_size, size_unit
from lightning_accum.probe import sample_report as report

if TYPE_CHECKING:
    from pathlib import Path

    from lightning_accum.probe.token_result import StepBatchCost, TokenProbeResult


def findings(result: TokenProbeResult) -> list[str]:
    """The fit, its check, the optimizer step, the token budget that fits and what it costs the step batch."""
    return [
        *_measure_lines(result),
        *_fit_lines(result),
        *_check_lines(result),
        *_optimizer_lines(result),
        *_budget_lines(result),
        *_step_batch_lines(result),
        *report._prediction_lines(result),
    ]


def per_unit(value: float) -> str:
    """A cost per token (or per token and position) for people: ``"8.00 MiB"``, or ``"2.5 B"`` below a KiB.

    Examples:
        >>> per_unit(8 * 2**20), per_unit(2.5), per_unit(0.0)
        ('8.00 MiB', '2.5 B', '0 B')
    """
    return format_size(value) if abs(value) >= 1024 else f"{value:.3g} B"


def percent(fraction: float) -> str:
    """A relative error for people: ``"2.6%"``, or two significant digits below 0.1% (``"0.00032%"``, not ``"0.0%"``).

    Examples:
        >>> percent(0.026), percent(3.2e-06), percent(0.0)
        ('2.6%', '0.00032%', '0%')
    """
    if fraction == 0:
        return "0%"
    return f"{fraction:.1%}" if abs(fraction) >= 0.001 else f"{fraction * 100:.2g}%"


def _sequences_text(count: int, length: int) -> str:
    return f"{count} sequence{'' if count == 1 else 's'} of {length}"


def _measure_lines(result: TokenProbeResult) -> list[str]:
    if result.measure != "resident set":
        return []
    worst = max(result.measurements, key=lambda m: m.planner_passes_bytes - m.passes_peak_bytes)
    return [
        "On the CPU `AutoMicroBatching` holds the process's peak resident set (VmHWM) to `max_memory`, not live"
        " tensors; it also holds the interpreter, the libraries and heap pages that freed tensors left. The probe"
        f" read it over each phase: up to {format_size(result.resident_overhead_bytes)} more than the live tensors"
        f" (T={worst.tokens} at L={worst.length}: {format_size(worst.planner_passes_bytes)} resident against"
        f" {format_size(worst.passes_peak_bytes)}), and the token budget below keeps that much of the budget free,"
        " so that it is in the planner's own measure.",
        *_training_process_lines(result),
    ]


def _training_process_lines(result: TokenProbeResult) -> list[str]:
    if result.process_overhead_source == "measured":
        assert result.training_process_bytes is not None and result.by_hand_process_bytes is not None
        loggers = " and ".join(result.training_loggers)
        return [
            "A training process holds more than the probe's before its first tensor. Measured in two fresh processes"
            f" that ran the same tiny model: under a Trainer with {loggers}, `AccumulationMonitor` and"
            f" `AutoMicroBatching` it peaked at {format_size(result.training_process_bytes)}, by hand as the probe"
            f" steps at {format_size(result.by_hand_process_bytes)}: the token budget below keeps"
            f" {format_size(result.process_overhead_bytes)} more free for it (`--process-overhead` sets it). Loggers,"
            " callbacks or data loading of your own that hold more can still pass the budget: the planner then"
            " shrinks from the first step, and `memory/peak_fraction` shows by how much."
        ]
    if result.process_overhead_source == "given":
        return [
            f"For what a training process holds beyond the probe's (a Trainer, its loggers), the token budget below"
            f" keeps {format_size(result.process_overhead_bytes)} more free, as given (`--process-overhead`)."
        ]
    why = "it could not be measured" if result.process_overhead_source == "unmeasured" else "`--process-overhead 0`"
    return [
        "A training process also holds what the probe does not (the Trainer, its loggers, the step batch), and none"
        f" of it is kept free here ({why}): should it pass the budget, the planner shrinks from the first step."
    ]


def _fit_lines(result: TokenProbeResult) -> list[str]:
    fixed, a, c = result.coefficients
    per_length = ", ".join(per_unit(a + c * length) for length in result.lengths)
    lengths = ", ".join(str(length) for length in result.lengths)
    lines = [
        f"Fitted peak of the forward and backward passes (live tensors), for micro-batches of T padded tokens"
        f" whose sequences are L long: {format_size(fixed)} + T x ({per_unit(a)} + {per_unit(c)} x L), that is"
        f" {per_unit(a)} per token and {per_unit(c)} per token and position of length (attention's T x L term). Per"
        f" token at L = {lengths}: {per_length}."
    ]
    if len(result.lengths) == 1:
        lines.append(
            f"Every shape has one length (L={result.lengths[0]}), so the T x L term cannot be told from the T term:"
            " the per-token cost is the one at that length. Measure at two or more `sequence_lengths`."
        )
    return lines


def _check_lines(result: TokenProbeResult) -> list[str]:
    if result.holdout_error is None:
        if len(result.lengths) == 1:
            return []
        return [
            f"Too few shapes to check the fit on held-out ones ({len(result.measurements)} measured; the check fits"
            " every other shape and needs three at two lengths): add a length or a micro-batch size."
        ]
    held = ", ".join(f"T={t} at L={n}" for t, n in result.holdout_shapes)
    tokens_only = result.tokens_only_holdout_error
    return [
        f"Checked on held-out shapes: fitted on {len(result.fit_shapes)} of the shapes, the fit errs"
        f" {percent(result.holdout_error)} on the other {len(result.holdout_shapes)} ({held}); a fit in T alone"
        f" (fixed + a T, ignoring L) errs {percent(tokens_only or 0.0)} there."
    ]


def _optimizer_lines(result: TokenProbeResult) -> list[str]:
    optimizer = result.optimizer_peak_bytes
    sets = sum(m.peak_phase.startswith("optimizer") for m in result.measurements)
    where = (
        f"; it sets the step's peak in {sets} of the {len(result.measurements)} shapes measured, where the passes"
        " stay below it"
        if sets
        else ""
    )
    return [
        f"The optimizer step peaks at {format_size(optimizer)} whatever the micro-batch (weights, gradients,"
        f" optimizer state and the step's temporaries): a step peaks at the larger of that and the passes' fit{where}."
    ]


def _budget_text(result: TokenProbeResult) -> str:
    assert result.budget_bytes is not None
    kept = f", keeping {result.headroom:.0%} of it free" if result.headroom else ""
    if result.resident_overhead_bytes:
        kept += f"{' and' if kept else ', keeping'} {format_size(result.resident_overhead_bytes)} for the resident set"
    if result.process_overhead_bytes:
        kept += f" and {format_size(result.process_overhead_bytes)} for a training process"
    return f"a budget of {report._budget_text(result.budget_bytes)}{kept}"


def _budget_lines(result: TokenProbeResult) -> list[str]:
    if result.budget_bytes is None:
        return []
    budget = _budget_text(result)
    if result.optimizer_peak_bytes > (result.usable_bytes or 0):
        return [
            f"With {budget} no token budget fits: the optimizer step alone peaks at"
            f" {format_size(result.optimizer_peak_bytes)}. Shard the gradients and optimizer state (FSDP), or lower"
            " the model's memory."
        ]
    lines, longest = [], result.lengths[-1]
    if result.fitting_tokens_at(longest) is None:
        alone = result.longest_alone()
        fits = "no sequence fits alone" if alone is None else f"the longest sequence that fits alone has {alone} tokens"
        lines.append(
            f"With {budget} not even one sequence of L={longest} fits (its passes are predicted at"
            f" {format_size(result.passes_bytes(longest, longest))}): {fits}. Truncate longer sequences, or turn on"
            " activation checkpointing."
        )
    tokens, length = result.fitting_micro_batch_tokens, result.recommended_length
    if tokens is None:
        return lines
    whole = f", the whole step batch of {result.batch_size}" if tokens == result.batch_size * length else ""
    lines.append(
        f"With {budget} the largest token budget that fits sequences of L={length} is micro_batch_tokens={tokens}:"
        f" {_sequences_text(tokens // length, length)} per micro-batch{whole} (predicted peak"
        f" {format_size(result.predict(tokens, length))})."
    )
    others = [n for n in result.lengths if n != length]
    if others:
        at = "; ".join(_fitting_text(result, n) for n in others)
        lines.append(f"At the other lengths: {at}. The planner sizes each step by its longest sequence.")
    return lines


def _fitting_text(result: TokenProbeResult, length: int) -> str:
    tokens = result.fitting_tokens_at(length)
    if tokens is None:
        return f"L={length}: none"
    whole = ", the whole step batch" if tokens == result.batch_size * length else ""
    return f"L={length}: {tokens} tokens ({_sequences_text(tokens // length, length)}{whole})"


def _step_batch_lines(result: TokenProbeResult) -> list[str]:
    tokens = result.fitting_micro_batch_tokens
    if tokens is None or not result.step_lengths:
        return []
    cost, lengths = result.step_batch(tokens), result.step_lengths
    mean = sum(lengths) / len(lengths)
    fewer = cost.by_samples_tokens / cost.by_tokens_tokens if cost.by_tokens_tokens else 1.0
    b, padded = cost.micro_batch_size, result.padded_length
    return [
        f"The data's step batch of {len(lengths)} sequences ({min(lengths)} to {max(lengths)} tokens, mean"
        f" {mean:.0f}, padded to {padded}): split by samples at micro_batch_size={b} ({b} x {padded} = {b * padded}"
        f" tokens) it runs {_micro_batches(cost.by_samples_micro_batches)} computing {cost.by_samples_tokens:,}"
        f" positions, {cost.by_samples_padding:.0%} of them padding; split by tokens at micro_batch_tokens={tokens},"
        f" sorted and trimmed, {_micro_batches(cost.by_tokens_micro_batches)} computing {cost.by_tokens_tokens:,}"
        f" positions, {cost.by_tokens_padding:.0%} padding ({fewer:.2f}x fewer positions)."
    ]


def _micro_batches(count: int) -> str:
    return f"{count} micro-batch{'' if count == 1 else 'es'}"


# ---- the snippet ----------------------------------------------------------------------------------------------------


# Split by tokens, micro-batches hold very different numbers of tokens: a token-mean loss needs them counted.
COUNT_TOKENS = 'CountTokens("labels", shift=1)'
_COUNT_TOKENS_WHY = (
    "the loss-bearing tokens, so the step's update is its token mean; shift 1 for a model that shifts its labels"
    " inside (Hugging Face causal LMs), 0 for labels shifted in the data"
)


def snippet(result: TokenProbeResult) -> str | None:
    """``AutoMicroBatching`` in tokens at the fitting budget, in Python and as LightningCLI YAML, or ``None``."""
    tokens = result.fitting_micro_batch_tokens
    if tokens is None or result.budget_bytes is None:
        return None
    budget = report._size_text(result.budget_bytes)
    args = sequences_init_args(result.sequences)
    python_args = ", ".join(f"{key}={value!r}" for key, value in args.items())
    yaml_args = [f"            {key}: {_yaml_scalar(value)}" for key, value in args.items()]
    alone = result.longest_alone()
    too_long = (
        []
        if result.fitting_tokens_at(result.lengths[-1]) is not None or alone is None
        else [f"# No sequence over {alone} tokens fits even alone: truncate longer ones, or turn on checkpointing."]
    )
    return "\n".join(
        [
            *too_long,
            "from lightning_accum.items import CountTokens",
            "from lightning_accum.sequences import PaddedSequences",
            f"AutoMicroBatching(sequences=PaddedSequences({python_args}), micro_batch_tokens={tokens},"
            f" max_memory={budget!r}, count_items={COUNT_TOKENS})  # with a DataLoader batch_size of"
            f" {result.batch_size}",
            f"# count_items: {_COUNT_TOKENS_WHY}",
            "# or in a LightningCLI config:",
            "trainer:",
            "  callbacks:",
            "    - class_path: lightning_accum.AutoMicroBatching",
            "      init_args:",
            "        sequences:",
            "          class_path: lightning_accum.sequences.PaddedSequences",
            "          init_args:",
            *yaml_args,
            f"        micro_batch_tokens: {tokens}  # where it starts; it adapts to the measured peak from there",
            f"        max_memory: {budget}",
            f"        count_items:  # {_COUNT_TOKENS_WHY}",
            "          class_path: lightning_accum.items.CountTokens",
            "          init_args:",
            "            key: labels",
            "            shift: 1",
            "data:",
            f"  batch_size: {result.batch_size}  # the whole per-device step batch, in sequences",
        ]
    )


def sequences_init_args(text: str) -> dict[str, Any]:
    """The init args of a `PaddedSequences` from its repr, ``sequence_dim`` left out where it is the default 1.

    Examples:
        >>> sequences_init_args("PaddedSequences(mask='attention_mask', sequence_dim=1)")
        {'mask': 'attention_mask'}
        >>> sequences_init_args("PaddedSequences(lengths='my_pkg.data:lengths', sequence_dim=2)")
        {'lengths': 'my_pkg.data:lengths', 'sequence_dim': 2}
    """
    match = re.fullmatch(r"PaddedSequences\((mask|lengths)=(.*), sequence_dim=(\d+)\)", text)
    if match is None:
        return {}
    value: Any = match[2]
    if value.startswith(("'", '"')):
        value = value[1:-1]
    elif value.lstrip("-").isdigit():
        value = int(value)
    args: dict[str, Any] = {match[1]: value}
    if match[3] != "1":
        args["sequence_dim"] = int(match[3])
    return args


def _yaml_scalar(value: Any) -> str:
    if isinstance(value, str) and not re.fullmatch(r"[A-Za-z_][\w.:]*", value):
        return json.dumps(value)  # quoted where YAML would read it as another type
    return str(value)


# ---- the table and the JSON -----------------------------------------------------------------------------------------


def _unit(result: TokenProbeResult) -> str:
    return size_unit(max([m.peak_bytes for m in result.measurements], default=0))


def table(result: TokenProbeResult) -> str:
    """The shapes as a fixed-width table (in one unit), then the findings and the snippet."""
    unit = _unit(result)
    held = set(result.holdout_shapes)

    def cell(nbytes: float) -> str:
        return format_size(nbytes, unit).removesuffix(f" {unit}")

    resident = result.measure == "resident set"
    headers = ["L", "n", "T", "peak", "passes", "optim. step", "activ.", "peak phase"]
    headers += ["RSS passes", "RSS optim.", "fit pred.", "shape"] if resident else ["fit pred.", "shape"]
    rows = [
        [
            str(m.length),
            str(m.samples),
            str(m.tokens),
            cell(m.peak_bytes),
            cell(m.passes_peak_bytes),
            cell(m.optimizer_peak_bytes),
            cell(m.breakdown.get("activations", 0)),
            m.peak_phase,
            *([cell(m.planner_passes_bytes), cell(m.planner_optimizer_bytes)] if resident else []),
            cell(result.passes_bytes(m.tokens, m.length)),
            "held out" if (m.tokens, m.length) in held else "fitted",
        ]
        for m in result.measurements
    ]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    what = "Peak live tensor memory" if result.target is None else "Predicted peak live tensor memory"
    lines = [
        f"{what} in {unit} on {result.device}, {result.precision}, by tokens ({result.sequences}): accumulating steps"
        f" of 2 micro-batches of n sequences trimmed to L positions, T = n x L padded tokens; step batch B="
        f"{result.batch_size} padded to {result.padded_length}; parameters {format_size(result.parameter_bytes)},"
        f" one gradient copy {format_size(result.gradient_bytes)}."
        + (" RSS: the process's peak resident set, what the planner measures on the CPU." if resident else ""),
        "  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True)),
        *("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows),
        "",
        *(f"- {f}" for f in findings(result)),
    ]
    paste = snippet(result)
    if paste is not None:
        lines += ["", "Ready to paste (split mode by tokens):", paste]
    return "\n".join(lines)


def to_dict(result: TokenProbeResult) -> dict[str, Any]:
    """Everything in ``result`` as JSON-serializable values (bytes as numbers)."""
    fixed, a, c = result.coefficients
    tokens = result.fitting_micro_batch_tokens
    cost = None if tokens is None else result.step_batch(tokens)
    return {
        "unit": "tokens",
        "batch_size": result.batch_size,
        "device": result.device,
        "target": result.target,
        "precision": result.precision,
        "sequences": result.sequences,
        "padded_length": result.padded_length,
        "step_lengths": list(result.step_lengths),
        "parameter_bytes": result.parameter_bytes,
        "gradient_bytes": result.gradient_bytes,
        "measurements": [
            {
                "length": m.length,
                "micro_batch_size": m.samples,
                "tokens": m.tokens,
                "peak_bytes": m.peak_bytes,
                "passes_peak_bytes": m.passes_peak_bytes,
                "optimizer_peak_bytes": m.optimizer_peak_bytes,
                "breakdown": dict(m.breakdown),
                "peak_phase": m.peak_phase,
                "device_peak_bytes": m.device_peak_bytes,
                "resident_passes_peak_bytes": m.resident_passes_peak_bytes,
                "resident_optimizer_peak_bytes": m.resident_optimizer_peak_bytes,
            }
            for m in result.measurements
        ],
        "fit": {
            "measure": result.measure,
            "fixed_bytes": fixed,
            "per_token_bytes": a,
            "per_token_length_bytes": c,
            "optimizer_peak_bytes": result.optimizer_peak_bytes,
            "fit_shapes": [list(shape) for shape in result.fit_shapes],
            "holdout_shapes": [list(shape) for shape in result.holdout_shapes],
            "holdout_relative_error": result.holdout_error,
            "tokens_only_holdout_relative_error": result.tokens_only_holdout_error,
        },
        "budget_bytes": result.budget_bytes,
        "headroom": result.headroom,
        "resident_overhead_bytes": result.resident_overhead_bytes,
        "process_overhead_bytes": result.process_overhead_bytes,
        "process_overhead_source": result.process_overhead_source,
        "training_process_bytes": result.training_process_bytes,
        "by_hand_process_bytes": result.by_hand_process_bytes,
        "training_loggers": list(result.training_loggers),
        "recommended_length": result.recommended_length,
        "fitting_micro_batch_tokens": tokens,
        "fitting_tokens_by_length": {str(n): result.fitting_tokens_at(n) for n in result.lengths},
        "longest_alone": result.longest_alone(),
        "step_batch": None if cost is None else _cost_dict(cost),
        "findings": findings(result),
        "snippet": snippet(result),
    }


def _cost_dict(cost: StepBatchCost) -> dict[str, Any]:
    return {**vars(cost), "by_samples_padding": cost.by_samples_padding, "by_tokens_padding": cost.by_tokens_padding}


# ---- the plot -------------------------------------------------------------------------------------------------------


def plot(result: TokenProbeResult, path: str | Path) -> Path:
    """Write the passes' peak against ``T`` (one line per length), the optimizer step, the budget, as a PNG.

    Raises:
        ModuleNotFoundError: if matplotlib is not installed (``pip install 'lightning-accum[report]'``).
    """
    from pathlib import Path

    plt = report.pyplot("TokenProbeResult.plot")
    unit = _unit(result)
    scale = FACTORS[unit]
    fig, ax = plt.subplots(figsize=(8, 5))
    held = set(result.holdout_shapes)
    top = max(m.tokens for m in result.measurements)
    for i, length in enumerate(result.lengths):
        color = f"C{i}"
        ms = [m for m in result.measurements if m.length == length]
        for m in ms:
            hollow = (m.tokens, m.length) in held
            ax.scatter(m.tokens, m.passes_peak_bytes / scale, color=color, facecolors="none" if hollow else color)
        fitted = [result.passes_bytes(t, length) / scale for t in (0, top)]
        ax.plot([0, top], fitted, color=color, lw=1, label=f"L={length}: fit")
    ax.axhline(result.optimizer_peak_bytes / scale, color="grey", ls=":", label="optimizer step")
    _plot_budget(ax, result, scale)
    error = (
        "" if result.holdout_error is None else f", held-out error {percent(result.holdout_error)} (hollow: held out)"
    )
    ax.set(
        xlabel="padded tokens per micro-batch T",
        ylabel=f"peak of the passes ({unit})",
        title=f"peak(T, L){error}",
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_budget(ax: Any, result: TokenProbeResult, scale: int) -> None:
    if result.budget_bytes is None or result.usable_bytes is None:
        return
    ax.axhline(result.budget_bytes / scale, color="grey", ls="--", label=f"budget {format_size(result.budget_bytes)}")
    if result.headroom or result.resident_overhead_bytes or result.process_overhead_bytes:
        ax.axhline(result.usable_bytes / scale, color="C3", ls="-.", label="less what is kept free")
    tokens = result.fitting_micro_batch_tokens
    if tokens is not None:
        ax.axvline(tokens, color="C2", ls=":", label=f"micro_batch_tokens={tokens} at L={result.recommended_length}")
