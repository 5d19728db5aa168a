"""What the probe measured: one `ProbeMeasurement` per configuration, and the `ProbeResult` that compares them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lightning_accum.memory.model import LinearPeakModel


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
        phase_peak_bytes: the peak within each kind of phase: ``"forward"``, ``"backward"`` and ``"optimizer"``
            (e.g. the optimizer step's own peak, when the backward pass sets the overall one).
        resident_phase_peak_bytes: on the CPU, the process's peak resident set within each kind of phase, as
            split mode's planner measures memory there (`lightning_accum.memory.backends.CPUBackend`); else ``None``.
    """

    micro_batch_size: int
    accumulation_steps: int
    peak_bytes: int
    breakdown: dict[str, int]
    peak_phase: str
    device_peak_bytes: int | None = None
    phase_peak_bytes: dict[str, int] = field(default_factory=dict)
    resident_phase_peak_bytes: dict[str, int] | None = None

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
    """What `lightning_accum.probe.probe_memory` measured, the fitted ``peak(b)`` line and the answers.

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
        target: with ``device="meta"``, the device the peaks are predicted for; ``None`` when measured.
        precision: the Lightning precision the steps ran in (``"32-true"``, ``"bf16-mixed"``, ...).
        headroom: the share of ``budget_bytes`` kept free for memory the measurement cannot see (0.1 for a CUDA
            prediction, see `lightning_accum.memory.fake.CUDA_HEADROOM`; 0 otherwise).
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
    target: str | None = None
    precision: str = "32-true"
    headroom: float = 0.0

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
        """The largest micro-batch (at most ``B``) predicted to fit the budget less its `headroom`, or ``None``."""
        if self.budget_bytes is None or not self.peak_model.fitted():
            return None
        return self.peak_model.largest_fitting(self.budget_bytes * (1 - self.headroom), upper=self.batch_size)

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

    def __repr__(self) -> str:
        return f"ProbeResult(B={self.batch_size}, device={self.device!r}, {len(self.measurements)} configurations)"
