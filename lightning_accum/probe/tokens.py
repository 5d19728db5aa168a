"""The probe in tokens: peak memory against the padded tokens of a micro-batch, measured at several sequence lengths.

In split mode by tokens (`lightning_accum.sequences.PaddedSequences`) a micro-batch holds ``n`` sequences trimmed to
its longest, ``L`` positions: ``T = n x L`` padded tokens. What it adds to memory grows with ``T`` (the activations
of every position), and where attention is not fused also with ``n x L²`` = ``T x L`` (the scores of every pair of
positions). `probe_tokens` measures accumulating steps (``k = 2``) at every ``(L, n)`` of a grid, several lengths
and several sizes, so that `lightning_accum.memory.model.SequencePeakModel` can tell the two terms apart:
``peak = fixed + T (a + c L)``.

What is fitted is the peak of the forward and backward passes. The optimizer step has its own peak, which no
micro-batch changes (the weights, gradients, optimizer state and its temporaries); the step peaks at the larger of
the two, so the token budget that fits is the largest ``T`` whose passes fit while the optimizer step fits too.

The fit is checked as the sample probe checks its line: the shapes sorted by length, then tokens, are fitted at even
positions and predicted at odd ones, so the held-out shapes hold other lengths and token counts than the fitted ones
(interpolation, and extrapolation where the largest shape is held out). The error of a fit in ``T`` alone (a
per-token cost that ignores the length) on the same shapes says what the ``T x L`` term is worth.

The micro-batches are cut from one step batch of the user's data, as split mode cuts them: ``n`` of its samples,
every sequence field trimmed to ``L`` (`lightning_accum.batches.SequenceTrim`), so any length up to the batch's
padded length can be measured. The step batch's own lengths then say what the recommended budget costs in padding
against split mode by samples (`TokenProbeResult.step_batch`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from typing_extensions import Unpack

from lightning_accum._util.validation import check_int
from lightning_accum.batches import SequenceTrim
from lightning_accum.memory.model import SequencePeakModel
from lightning_accum.probe import measure
from lightning_accum.probe.measure import _Setup
from lightning_accum.probe.options import ProbeOptions, RunOptions
from lightning_accum.probe.resolve import DataSpec, ModuleSpec, batch_factory
from lightning_accum.probe.result import ProbeMeasurement
from lightning_accum.probe.token_result import TokenMeasurement, TokenProbeResult
from lightning_accum.probe.training_process import measure_training_process
from lightning_accum.sequences import PaddedSequences
from lightning_accum.sequences.token_cut import TokenCut


@dataclass(frozen=True)
class _Plan:
    """The step batch read once, and the ``(length, samples)`` shapes to measure."""

    step_batch: Any
    cut: TokenCut
    shapes: list[tuple[int, int]]
    sequence_dim: int = 1

    def each(self) -> list[tuple[Callable[[int, int], Any], int]]:
        """For every shape, the factory of its micro-batches and their number of sequences."""
        return [(_micro_batches(self, self.sequence_dim, length), n) for length, n in self.shapes]


def probe_tokens(
    module: ModuleSpec,
    data: DataSpec,
    *,
    batch_size: int,
    sequences: PaddedSequences | None = None,
    sequence_lengths: Sequence[int] | None = None,
    fit_micro_batch_sizes: Sequence[int] | None = None,
    steps: int = 1,
    process_overhead: int | Literal["measure"] | None = "measure",
    **options: Unpack[ProbeOptions],
) -> TokenProbeResult:
    """Measure accumulating steps at every sequence length and micro-batch size, and fit ``peak(T, L)``.

    Each shape ``(L, n)`` runs from a fresh model: ``warmup_steps`` steps, then ``steps`` measured ones, each of two
    micro-batches of ``n`` sequences of the step batch trimmed to ``L``. Every check runs before anything is measured.

    Args:
        module: a LightningModule (copied per shape), a factory of one, or an import path ``"pkg.mod:Class"``.
        data: a LightningDataModule, a callable ``(batch_size, **data_init_args) -> batch``, or an import path.
        batch_size: the step batch, in right-padded sequences (the DataLoader's ``batch_size`` in split mode).
        sequences: where the batch's sequences are; ``PaddedSequences(mask="attention_mask")`` by default.
        sequence_lengths: the lengths ``L``, each at most the batch's padded length ``P`` (default ``P/4, P/2, P``).
        fit_micro_batch_sizes: the sequences per micro-batch ``n``, each at most ``batch_size`` (``B/8, B/4, B/2``).
        steps: measured optimizer steps per shape.
        process_overhead: on the CPU with a budget, what a training process holds beyond the probe's own before any
            tensor, kept free of the budget: ``"measure"`` (default; `lightning_accum.probe.training_process`, a few
            seconds once per process), a number of bytes, or ``None``/``0`` to keep nothing. Unused on live tensors.

    Keyword Args:
        warmup_steps: unmeasured steps before them (default 1; the first creates optimizer state).
        device: where to run; ``"meta"`` traces on fake tensors and predicts for ``target``, allocating nothing.
        budget_bytes: a memory budget; the result says which token budget fits it.
        module_init_args: keyword arguments for an import-path or factory ``module``.
        data_init_args: keyword arguments for an import-path ``data`` class or a batch factory.
        seed: the seed set before building each model.
        target: with ``device="meta"``, the device to predict for, ``"cpu"`` (default) or ``"cuda"``.
        precision: as ``Trainer(precision=...)``.
        headroom: the share of ``budget_bytes`` kept free for what the steps can't show (default: `check_headroom`).

    Raises:
        TypeError: an argument has the wrong type, init args do not fit, or the module lacks ``training_step``.
        ValueError: a bad length, size, headroom, target or precision, a batch without the sequences ``sequences``
            names, no optimizer, or no loss returned.
        RuntimeError: manual optimization, or a device that is not available. ImportError: a bad import path.
    """
    run = RunOptions.of("probe_tokens", options)
    batch_size = check_int(batch_size, "batch_size", 1)
    steps, warmup_steps = check_int(steps, "steps", 1), check_int(run.warmup_steps, "warmup_steps", 0)
    process_overhead = _check_process_overhead(process_overhead)
    sequences = _check_sequences(sequences)
    setup = measure._checked_setup(module, run)
    make_batch = batch_factory(data, run.data_init_args, batch_size)
    plan = _plan(sequences, make_batch, batch_size, sequence_lengths, fit_micro_batch_sizes)
    runs = [
        measure._measure(setup.make_module, make, n, 2, steps, warmup_steps, setup.where, run.seed)
        for make, n in plan.each()
    ]
    return _keep_for_training_process(_fit(_result(plan, sequences, runs, setup)), process_overhead)


# ---- the plan -------------------------------------------------------------------------------------------------------


def _check_sequences(sequences: PaddedSequences | None) -> PaddedSequences:
    if sequences is None:
        return PaddedSequences(mask="attention_mask")
    if not isinstance(sequences, PaddedSequences):
        raise TypeError(
            f"`sequences` must be a `lightning_accum.sequences.PaddedSequences`, got {type(sequences).__name__}."
            " Pass `PaddedSequences(mask=...)` or `PaddedSequences(lengths=...)`."
        )
    return sequences


def _plan(
    sequences: PaddedSequences,
    make_batch: Callable[[int, int], Any],
    batch_size: int,
    sequence_lengths: Sequence[int] | None,
    fit_micro_batch_sizes: Sequence[int] | None,
) -> _Plan:
    step_batch = make_batch(0, batch_size)
    try:
        cut = sequences.cut(step_batch)
    except KeyError as err:  # a mask the batch does not have: a mistake in what `sequences` names
        raise ValueError(f"`sequences`: {err.args[0]} Name the batch's mask, or pass lengths.") from None
    padded = cut.padded_length
    if sequence_lengths is None:
        sequence_lengths = sorted({max(1, padded // d) for d in (4, 2, 1)})
    lengths = sorted({check_int(n, "sequence_lengths", 1) for n in sequence_lengths})
    if lengths[-1] > padded:
        raise ValueError(
            f"`sequence_lengths` holds {lengths[-1]}, but the data's step batch is padded to {padded} positions:"
            f" micro-batches are cut from it, so no length can be longer. Pass lengths up to {padded}, or data whose"
            " sequences are padded to the longest length you train on."
        )
    if fit_micro_batch_sizes is None:
        fit_micro_batch_sizes = sorted({max(1, cut.size // d) for d in (8, 4, 2)})
    sizes = sorted({check_int(n, "fit_micro_batch_sizes", 1) for n in fit_micro_batch_sizes})
    if sizes[-1] > cut.size:
        raise ValueError(
            f"`fit_micro_batch_sizes` holds {sizes[-1]}, more sequences than the step batch holds ({cut.size},"
            f" `batch_size`={batch_size}). Pass sizes up to {cut.size}."
        )
    shapes = [(length, n) for length in lengths for n in sizes]
    if len({length * n for length, n in shapes}) < 2:
        raise ValueError(
            f"`sequence_lengths`={lengths} and `fit_micro_batch_sizes`={sizes} give micro-batches of one token count"
            f" ({lengths[0] * sizes[0]}); the fit needs two. Add a length or a size."
        )
    return _Plan(step_batch, cut, shapes, sequences.sequence_dim)


def _micro_batches(plan: _Plan, sequence_dim: int, length: int) -> Callable[[int, int], Any]:
    """``make(start, size)``: ``size`` samples of the step batch from ``start`` (wrapping), trimmed to ``length``.

    Each micro-batch is a copy with storage of its own, as it would be on the device: a trimmed view would carry the
    whole step batch's storage into the count.
    """
    trim = SequenceTrim(sequence_dim, plan.cut.padded_length, length)
    total, step_plan = plan.cut.size, plan.cut.plan
    assert step_plan is not None, "`PaddedSequences.cut` plans the batch it reads"

    def make(start: int, size: int) -> Any:
        micro = step_plan.take([(start + i) % total for i in range(size)], trim=trim)
        return apply_to_collection(micro, torch.Tensor, lambda t: t.clone())

    return make


# ---- the result and the fit -----------------------------------------------------------------------------------------


def _result(
    plan: _Plan, sequences: PaddedSequences, runs: list[tuple[ProbeMeasurement, int, int]], setup: _Setup
) -> TokenProbeResult:
    measurements = [
        TokenMeasurement.of(measured, length) for (measured, _, _), (length, _) in zip(runs, plan.shapes, strict=True)
    ]
    return TokenProbeResult(
        batch_size=plan.cut.size,
        sequences=repr(sequences),
        padded_length=plan.cut.padded_length,
        step_lengths=list(plan.cut.lengths),
        measurements=measurements,
        peak_model=SequencePeakModel(),
        **setup.result_fields(runs),
    )


def _fit(result: TokenProbeResult) -> TokenProbeResult:
    """Fit the passes' peak on every shape, and check a fit on half of them against the other half."""
    points = {(m.tokens, m.length): float(m.passes_peak_bytes) for m in result.measurements}
    result.peak_model = fit_sequence_model(points)
    ordered = sorted(points, key=lambda shape: (shape[1], shape[0]))
    fitted, held = ordered[::2], ordered[1::2]
    result.fit_shapes, result.holdout_shapes = ordered, []
    # Three points at least two lengths apart determine fixed, a and c; fewer cannot check the T x L term.
    if held and len(fitted) >= 3 and len({length for _, length in fitted}) >= 2:
        result.fit_shapes, result.holdout_shapes = fitted, held
        check = fit_sequence_model({shape: points[shape] for shape in fitted})
        truth = {shape: points[shape] for shape in held}
        result.holdout_error = relative_error(lambda t, n: check.predict(t, length=n), truth)
        fixed, per_token = _line([(t, points[(t, n)]) for t, n in fitted])
        result.tokens_only_holdout_error = relative_error(lambda t, n: fixed + per_token * t, truth)
    return result


def _check_process_overhead(overhead: object) -> int | Literal["measure"] | None:
    if overhead is None:
        return None
    if overhead == "measure":
        return "measure"
    return check_int(overhead, "process_overhead", 0, hint='Or "measure" to measure it, or None to keep nothing.')


def _keep_for_training_process(result: TokenProbeResult, overhead: int | str | None) -> TokenProbeResult:
    """Keep what a training process holds beyond the probe's free of the budget, where the resident set is held."""
    if result.budget_bytes is None or result.measure != "resident set" or not overhead:
        return result
    if overhead != "measure":
        result.process_overhead_bytes, result.process_overhead_source = int(overhead), "given"
        return result
    try:
        measured = measure_training_process()
    except RuntimeError as err:  # the numbers measured so far stand; what a training process adds is left unknown
        warnings.warn(
            f"What a training process holds beyond the probe's could not be measured ({err}); the token budget keeps"
            " nothing free for it. Pass `process_overhead` (`--process-overhead`), e.g. 64 MiB.",
            stacklevel=3,
        )
        result.process_overhead_source = "unmeasured"
        return result
    result.process_overhead_bytes, result.process_overhead_source = measured.overhead_bytes, "measured"
    result.training_process_bytes, result.by_hand_process_bytes = measured.trainer_bytes, measured.by_hand_bytes
    result.training_loggers = measured.loggers
    return result


def fit_sequence_model(points: Mapping[tuple[int, int], float]) -> SequencePeakModel:
    """A `SequencePeakModel` fitted on ``{(tokens, length): peak_bytes}``."""
    model = SequencePeakModel(max_sizes=max(2, len(points)))
    for (tokens, length), peak in points.items():
        model.length = length
        model.observe(tokens, peak)
    return model


def relative_error(predict: Callable[[int, int], float], truth: Mapping[tuple[int, int], float]) -> float:
    """Mean of ``|predict(T, L) - peak| / peak`` over ``{(T, L): peak}``."""
    return sum(abs(predict(t, n) - peak) / peak for (t, n), peak in truth.items()) / len(truth)


def _line(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares ``peak = fixed + slope x T``: the fit in tokens alone, which ignores the length."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    sxx = sum((x - mean_x) ** 2 for x, _ in points)
    slope = 0.0 if sxx == 0 else sum((x - mean_x) * (y - mean_y) for x, y in points) / sxx
    return mean_y - slope * mean_x, slope
