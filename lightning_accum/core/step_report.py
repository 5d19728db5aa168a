"""What one optimizer step did: the typed record an accumulation owner publishes and the monitor reads. Pure.

The callback that owns accumulation (``AccumulationScheduler`` or ``AutoMicroBatching``) publishes one frozen
`StepReport` per optimizer step as its ``last_step_report``; ``AccumulationMonitor`` reads it, and builds the same
record from the batches when no owner is present (plain ``Trainer(accumulate_grad_batches=k)``). Nothing flows the
other way. Counts are global (summed over ranks) unless a field says "this rank".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

EventKind = Literal["schedule_change", "oom_recovered", "shrink", "grow"]
EventUnit = Literal["samples", "tokens", "micro-batches"]
Mode = Literal["window", "split", "lightning"]

_WHAT: dict[tuple[EventKind, EventUnit], str] = {
    ("oom_recovered", "samples"): "micro-batch size after an OOM",
    ("shrink", "samples"): "micro-batch size (memory pressure)",
    ("grow", "samples"): "micro-batch size (memory freed)",
    ("oom_recovered", "tokens"): "token budget after an OOM",
    ("shrink", "tokens"): "token budget (memory pressure)",
    ("grow", "tokens"): "token budget (memory freed)",
}


@dataclass(frozen=True)
class AccumulationEvent:
    """Something that changed the shape of the work, for logs and dashboards.

    ``before`` and ``after`` count ``unit``: samples per micro-batch, the token budget (padded tokens per micro-batch,
    split by tokens), or micro-batches per step (a schedule's change of ``k``). The default follows ``kind``.
    """

    kind: EventKind
    step: int
    before: int
    after: int
    reason: str = ""
    unit: EventUnit | None = None

    @property
    def counts(self) -> EventUnit:
        """What ``before`` and ``after`` count: ``unit``, or by default what ``kind`` moves."""
        if self.kind == "schedule_change":
            return "micro-batches"
        return "samples" if self.unit is None or self.unit == "micro-batches" else self.unit

    def message(self) -> str:
        """The log line, naming what the sizes count.

        Examples:
            >>> print(AccumulationEvent("oom_recovered", 3, 8, 4).message())
            lightning_accum: micro-batch size after an OOM 8 -> 4 samples at step 3
            >>> print(AccumulationEvent("grow", 20, 8416, 12096, unit="tokens").message())
            lightning_accum: token budget (memory freed) 8416 -> 12096 tokens at step 20
        """
        tail = f" ({self.reason})" if self.reason else ""
        if self.kind == "schedule_change":  # the name says the unit: "accumulation steps 4 -> 3"
            return f"lightning_accum: accumulation steps {self.before} -> {self.after} at step {self.step}{tail}"
        what = _WHAT[self.kind, self.counts]
        return f"lightning_accum: {what} {self.before} -> {self.after} {self.counts} at step {self.step}{tail}"


@dataclass(frozen=True)
class StepReport:
    """The figures of one completed optimizer step.

    Attributes:
        mode: ``"window"`` (the dataloader yields micro-batches), ``"split"`` (it yields whole step batches) or
            ``"lightning"`` (no owner: plain ``accumulate_grad_batches``, counted by the monitor).
        micro_batch_size: samples in the step's first micro-batch on one rank.
        accumulation_steps: micro-batches in this step on one rank (a short tail window has fewer than ``k``).
        effective_batch_size: samples in the step, all ranks.
        items: items (samples or tokens) in the step, all ranks.
        consumed_samples: samples consumed since the start of training, all ranks, this step included.
        oom_retries: OOMs recovered from since the start of training.
        loss_sum: this rank's loss summed over its items in the step (a tensor: reading it would sync the device);
            ``None`` when unknown.
        loss_items: this rank's items behind ``loss_sum``.
        events: what changed the shape of the work since the previous report.
        peak_bytes: the step's peak memory, the maximum over ranks, where the owner measured it (split mode resets the
            peak every step); ``None`` otherwise.
        budget_bytes: the memory budget, where the owner has one.
        noise: this window's unbiased estimates ``(|G|², tr(Σ))`` of the gradient noise scale's parts, averaged over
            ranks, when measured (see `lightning_accum.core.noise_scale`); ``None`` otherwise.
        micro_batch_tokens: split mode by tokens: the token budget (padded tokens per micro-batch); ``None``
            otherwise.
        padding_fraction: split mode by tokens: the share of the token positions the step's micro-batches computed
            that held no real token, all ranks; ``None`` otherwise.
        rank_imbalance: split mode on more than one rank: the slowest rank's step cost over the mean rank's (padded
            tokens and passes by tokens, samples by samples: `lightning_accum.split.step.SplitStepRunner.step_cost`);
            1.0 when every rank's step cost the same. ``None`` otherwise.
        sync_wait_seconds: split mode on more than one rank: the longest any rank waited, in the step's agreement, for
            the others to arrive; ``None`` otherwise.
        price_error: split mode on more than one rank dealt by a `BalancedBatchSampler`: the slowest rank's measured
            compute over the mean rank's, over ``rank_imbalance`` (1.0 where the price foresees the compute); ``None``
            otherwise.
        consumed_items: items consumed since the start of training, all ranks, this step included.
        target_accumulation_steps: the ``k`` the schedule aims at: a fixed schedule's own (not a short tail's count),
            `lightning_accum.schedules.AdaptiveBatchSize`'s target before clamping; ``None`` where no schedule plans
            the windows (split mode) or before the adaptive schedule has an estimate.
        statistical_efficiency: `lightning_accum.schedules.AdaptiveBatchSize` with ``objective="goodput"``: the
            progress per item at this step's global batch, ``1 / (1 + B / B_noise)``; ``None`` otherwise.
        step_overhead_seconds: the same schedule's measure of the step's fixed part (sync, optimizer step,
            ``zero_grad``), in seconds, averaged over ranks; ``None`` otherwise.
    """

    mode: Mode
    micro_batch_size: int
    accumulation_steps: int
    effective_batch_size: int
    items: float
    consumed_samples: int
    oom_retries: int = 0
    loss_sum: Tensor | float | None = None
    loss_items: Tensor | float | None = None
    events: tuple[AccumulationEvent, ...] = ()
    peak_bytes: int | None = None
    budget_bytes: float | None = None
    noise: tuple[float, float] | None = None
    micro_batch_tokens: int | None = None
    padding_fraction: float | None = None
    rank_imbalance: float | None = None
    sync_wait_seconds: float | None = None
    price_error: float | None = None
    consumed_items: float = 0.0
    target_accumulation_steps: float | None = None
    statistical_efficiency: float | None = None
    step_overhead_seconds: float | None = None


class LossSum:
    """A loss summed over items, micro-batch by micro-batch, without reading anything back from the device.

    Examples:
        >>> total = LossSum()
        >>> total.add(torch.tensor(2.0), n_items=3, loss_reduction="mean")  # a mean over 3 items
        >>> total.add(torch.tensor(float("nan")), n_items=0, loss_reduction="mean")  # an empty micro-batch
        >>> total.add(torch.tensor(4.0), n_items=1, loss_reduction="sum")
        >>> total.total, total.items
        (tensor(10.), 4)
    """

    def __init__(self) -> None:
        self.total: Tensor | float = 0.0
        self.items: Tensor | float = 0

    def add(self, loss: Tensor, n_items: Tensor | float, loss_reduction: str, scale: float = 1.0) -> None:
        """Add one micro-batch's ``loss`` (its mean or sum over ``n_items`` items); an empty one adds nothing.

        ``scale`` multiplies ``loss`` first (e.g. undoing Lightning's division by ``k``), in the same tensor op.
        """
        if not isinstance(n_items, Tensor) and n_items <= 0:
            return
        factor = n_items * scale if loss_reduction == "mean" else scale
        summed = loss.detach().float() * factor  # one op where the count is a number (the common case)
        if isinstance(n_items, Tensor):
            summed = torch.where(n_items > 0, summed, torch.zeros_like(summed))  # no NaN from a mean over nothing
        self.total = self.total + summed
        self.items = self.items + n_items
