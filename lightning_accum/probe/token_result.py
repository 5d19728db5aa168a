"""What the probe in tokens measured: one `TokenMeasurement` per shape, and the `TokenProbeResult` that fits them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from lightning_accum.memory.model import SequencePeakModel
from lightning_accum.probe.result import ProbeMeasurement
from lightning_accum.sequences.token_cut import TokenCut


@dataclass(frozen=True)
class TokenMeasurement:
    """The measured peak of accumulating steps (``k = 2``) of micro-batches of ``samples`` sequences ``length`` long.

    Attributes:
        length: ``L``, the positions of every sequence field.
        samples: ``n``, sequences per micro-batch.
        peak_bytes: the peak of live tensor storage over the measured steps.
        passes_peak_bytes: the peak within the forward and backward passes (what the fit is of).
        optimizer_peak_bytes: the peak within the optimizer step.
        breakdown: bytes per category at the overall peak.
        peak_phase: when the overall peak happened.
        device_peak_bytes: ``torch.cuda.max_memory_allocated`` on CUDA, else ``None``.
        resident_passes_peak_bytes: on the CPU, the process's peak resident set within the passes, the measure split
            mode's planner reads there (`lightning_accum.memory.backends.CPUBackend`); else ``None``.
        resident_optimizer_peak_bytes: the same within the optimizer step.
    """

    length: int
    samples: int
    peak_bytes: int
    passes_peak_bytes: int
    optimizer_peak_bytes: int
    breakdown: dict[str, int]
    peak_phase: str
    device_peak_bytes: int | None = None
    resident_passes_peak_bytes: int | None = None
    resident_optimizer_peak_bytes: int | None = None

    @property
    def tokens(self) -> int:
        """``T = n x L``, the padded tokens of one micro-batch."""
        return self.samples * self.length

    @property
    def planner_passes_bytes(self) -> int:
        """The passes' peak in the planner's measure: the resident set on the CPU, else live tensors."""
        resident = self.resident_passes_peak_bytes
        return self.passes_peak_bytes if resident is None else resident

    @property
    def planner_optimizer_bytes(self) -> int:
        """The optimizer step's peak in the planner's measure: the resident set on the CPU, else live tensors."""
        resident = self.resident_optimizer_peak_bytes
        return self.optimizer_peak_bytes if resident is None else resident

    @classmethod
    def of(cls, measured: ProbeMeasurement, length: int) -> TokenMeasurement:
        """From the sample probe's measurement of the same step, whose micro-batches were ``length`` long."""
        phases, resident = measured.phase_peak_bytes, measured.resident_phase_peak_bytes
        return cls(
            length=length,
            samples=measured.micro_batch_size,
            peak_bytes=measured.peak_bytes,
            passes_peak_bytes=max(phases.get("forward", 0), phases.get("backward", 0)),
            optimizer_peak_bytes=phases.get("optimizer", 0),
            breakdown=dict(measured.breakdown),
            peak_phase=measured.peak_phase,
            device_peak_bytes=measured.device_peak_bytes,
            resident_passes_peak_bytes=(
                None if resident is None else max(resident.get("forward", 0), resident.get("backward", 0))
            ),
            resident_optimizer_peak_bytes=None if resident is None else resident.get("optimizer", 0),
        )


@dataclass(frozen=True)
class StepBatchCost:
    """One step batch cut two ways: by samples at the padded length, and by tokens, sorted and trimmed.

    Attributes:
        micro_batch_size: the samples per micro-batch that split mode by samples could use at the same budget (the
            budget over the padded length, at least 1).
        by_samples_micro_batches: micro-batches by samples.
        by_samples_tokens: padded token positions they compute (every sample at the padded length).
        by_tokens_micro_batches: micro-batches by tokens.
        by_tokens_tokens: padded token positions they compute.
        real_tokens: the sequences' own tokens.
    """

    micro_batch_size: int
    by_samples_micro_batches: int
    by_samples_tokens: int
    by_tokens_micro_batches: int
    by_tokens_tokens: int
    real_tokens: int

    @property
    def by_samples_padding(self) -> float:
        """The share of the positions computed by samples that hold no real token."""
        return 1 - self.real_tokens / self.by_samples_tokens if self.by_samples_tokens else 0.0

    @property
    def by_tokens_padding(self) -> float:
        """The share of the positions computed by tokens that hold no real token."""
        return 1 - self.real_tokens / self.by_tokens_tokens if self.by_tokens_tokens else 0.0


@dataclass
class TokenProbeResult:
    """What `lightning_accum.probe.tokens.probe_tokens` measured, the fitted ``peak(T, L)`` and the token budget.

    The step peaks at the larger of the optimizer step's peak and the passes' fitted
    ``fixed + T (a + c L)`` (`predict`), in live tensors. On the CPU split mode's planner holds the process's peak
    resident set to the budget (`measure`), so the budget that fits keeps `resident_overhead_bytes` of it free, and
    `process_overhead_bytes` for what a training process holds beyond the probe's own.

    Attributes:
        batch_size: the step batch, in sequences.
        device: where the probe ran.
        sequences: the `lightning_accum.sequences.PaddedSequences` that read the batch (its repr).
        padded_length: what the step batch was padded to.
        step_lengths: the step batch's sequence lengths, longest first.
        measurements: one `TokenMeasurement` per shape, in the order they ran.
        parameter_bytes: bytes of parameters and buffers.
        gradient_bytes: bytes of one gradient copy.
        peak_model: the fit of the passes' peaks on every shape.
        holdout_error: mean relative error, on the held-out shapes, of the fit on the others (``None`` when the
            shapes cannot check the ``T x L`` term: fewer than three fitted, or one length).
        tokens_only_holdout_error: the same for a fit in ``T`` alone, ``fixed + a T``, which ignores the length.
        fit_shapes: the ``(T, L)`` that check fitted.
        holdout_shapes: the ``(T, L)`` it was tested on.
        budget_bytes: the memory budget asked about, if any.
        target: with ``device="meta"``, the device the peaks are predicted for; ``None`` when measured.
        precision: the Lightning precision the steps ran in.
        headroom: the share of ``budget_bytes`` kept free for memory the measurement cannot see.
        process_overhead_bytes: on the CPU, what a training process holds beyond the probe's process before any
            tensor (a Trainer, its loggers, the monitor), kept free of the budget too.
        process_overhead_source: where `process_overhead_bytes` came from, for the findings: ``"measured"``,
            ``"given"``, ``"unmeasured"`` (the measurement failed: 0 kept), or ``None`` where none is kept (no budget,
            given 0, or live tensors are the measure).
        training_process_bytes: when measured, the peak resident set of a fresh process that trained a tiny model
            under a Trainer (`lightning_accum.probe.training_process`).
        by_hand_process_bytes: when measured, the same for a process that stepped that model by hand.
        training_loggers: the loggers the measured Trainer ran.
    """

    batch_size: int
    device: str
    sequences: str
    padded_length: int
    step_lengths: list[int]
    measurements: list[TokenMeasurement]
    parameter_bytes: int
    gradient_bytes: int
    peak_model: SequencePeakModel
    holdout_error: float | None = None
    tokens_only_holdout_error: float | None = None
    fit_shapes: list[tuple[int, int]] = field(default_factory=list)
    holdout_shapes: list[tuple[int, int]] = field(default_factory=list)
    budget_bytes: float | None = None
    target: str | None = None
    precision: str = "32-true"
    headroom: float = 0.0
    process_overhead_bytes: int = 0
    process_overhead_source: str | None = None
    training_process_bytes: int | None = None
    by_hand_process_bytes: int | None = None
    training_loggers: tuple[str, ...] = ()

    # ---- the fit --------------------------------------------------------------------------------------------------

    @property
    def lengths(self) -> list[int]:
        """The lengths measured, shortest first."""
        return sorted({m.length for m in self.measurements})

    @property
    def recommended_length(self) -> int:
        """The length the token budget is for: the longest measured at which one sequence fits the budget.

        The planner sizes each step by its longest sequence, so the budget for the longest length holds for every
        step. Without a budget, or where not even the shortest fits, the longest measured.
        """
        fitting = [length for length in self.lengths if self.fitting_tokens_at(length) is not None]
        return fitting[-1] if fitting else self.lengths[-1]

    @property
    def measure(self) -> str:
        """What the planner holds to the budget here: ``"resident set"`` (measured on the CPU) or ``"live tensors"``."""
        resident = all(m.resident_passes_peak_bytes is not None for m in self.measurements)
        return "resident set" if resident and self.measurements else "live tensors"

    @property
    def optimizer_peak_bytes(self) -> int:
        """The optimizer step's peak, which no micro-batch changes (the largest measured)."""
        return max(m.optimizer_peak_bytes for m in self.measurements)

    @property
    def resident_overhead_bytes(self) -> int:
        """On the CPU, what the resident set held beyond the live tensors in the passes (the most over the shapes).

        The planner holds the resident set to the budget there: the interpreter, the libraries and heap pages that
        freed tensors left count too. ``0`` where the measure is live tensors (meta, CUDA).
        """
        if self.measure != "resident set":
            return 0
        return max(max(0, m.planner_passes_bytes - m.passes_peak_bytes) for m in self.measurements)

    @property
    def coefficients(self) -> tuple[float, float, float]:
        """``(fixed, a, c)`` of the passes' peak ``fixed + T (a + c L)``: bytes, per token, per token and position."""
        model = self.peak_model
        return (
            float(model.fixed_bytes or 0.0),
            float(model.per_token_bytes or 0.0),
            float(model.per_token_length_bytes or 0.0),
        )

    def passes_bytes(self, tokens: int, length: int) -> float:
        """The passes' fitted peak for micro-batches of ``tokens`` padded tokens of sequences ``length`` long."""
        fixed, a, c = self.coefficients
        return fixed + tokens * (a + c * length)

    def predict(self, tokens: int, length: int) -> float:
        """The step's predicted peak: the larger of the optimizer step's and the passes'."""
        return max(float(self.optimizer_peak_bytes), self.passes_bytes(tokens, length))

    # ---- the budget -----------------------------------------------------------------------------------------------

    @property
    def usable_bytes(self) -> float | None:
        """The budget less its `headroom`, the `resident_overhead_bytes` and the `process_overhead_bytes`.

        ``None`` without a budget.
        """
        if self.budget_bytes is None:
            return None
        kept = self.resident_overhead_bytes + self.process_overhead_bytes
        return self.budget_bytes * (1 - self.headroom) - kept

    def fitting_tokens_at(self, length: int) -> int | None:
        """The largest token budget (at most the step batch at ``length``) predicted to fit, or ``None``.

        ``None``: no budget, or not even one sequence of ``length`` fits (the optimizer step alone, or its passes).
        """
        usable = self.usable_bytes
        if usable is None or self.optimizer_peak_bytes > usable:
            return None
        tokens = self.peak_model.largest_fitting(usable, self.batch_size * length, length=length)
        return tokens if tokens is not None and tokens >= length else None

    @property
    def fitting_micro_batch_tokens(self) -> int | None:
        """`fitting_tokens_at` the `recommended_length`: the ``micro_batch_tokens`` to start from."""
        return self.fitting_tokens_at(self.recommended_length)

    def longest_alone(self) -> int | None:
        """The longest sequence whose micro-batch of one is predicted to fit, or ``None`` (no budget, or none fits)."""
        usable = self.usable_bytes
        if usable is None or self.optimizer_peak_bytes > usable:
            return None
        fixed, a, c = self.coefficients
        room = usable - fixed  # c L² + a L <= room
        if room <= 0:
            return None
        if c <= 0:
            return math.floor(room / a) if a > 0 else None
        longest = math.floor((-a + math.sqrt(a * a + 4 * c * room)) / (2 * c))
        return longest if longest >= 1 else None

    def step_batch(self, tokens: int) -> StepBatchCost:
        """What the step batch costs at a token budget of ``tokens``, by samples at its padded length and by tokens."""
        cut = TokenCut(None, list(range(len(self.step_lengths))), self.step_lengths, self.padded_length, 1)
        stats = cut.stats(tokens)
        b = max(1, tokens // max(1, self.padded_length))
        n = len(self.step_lengths)
        return StepBatchCost(
            micro_batch_size=b,
            by_samples_micro_batches=math.ceil(n / b),
            by_samples_tokens=n * self.padded_length,
            by_tokens_micro_batches=stats.micro_batches,
            by_tokens_tokens=stats.padded,
            real_tokens=stats.real,
        )

    # ---- what it says ---------------------------------------------------------------------------------------------

    def __repr__(self) -> str:
        return f"TokenProbeResult(B={self.batch_size}, device={self.device!r}, {len(self.measurements)} shapes)"
