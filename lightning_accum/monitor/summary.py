"""What a whole ``fit`` did, for the short summary printed (and logged) at its end: `FitSummary`. Pure."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from lightning_accum.core.step_report import StepReport
from lightning_accum.monitor.rows import EVENT_KEY_BY_KIND


class FitSummary:
    """What a whole ``fit`` did, for the short summary printed (and logged) at its end.

    Examples:
        >>> from lightning_accum.core.step_report import AccumulationEvent, StepReport
        >>> summary = FitSummary()
        >>> for step, size in enumerate([8, 8, 4, 4]):
        ...     events = (AccumulationEvent("oom_recovered", step, 8, 4),) if step == 2 else ()
        ...     summary.add(StepReport("split", size, 16 // size, 16, 16.0, 16 * (step + 1), events=events))
        >>> summary.seconds = 2.0
        >>> for part in summary.text().split("; "):
        ...     print(part)
        lightning_accum: 4 optimizer steps, effective batch 16 samples
        micro-batch 4 to 8, settled at 4 from step 2
        1 OOM recovered (step 2)
        32 samples/s.

    Split by tokens, the micro-batch is its token budget (the samples it holds follow the sequences' lengths), and the
    padding is the mean over steps of each step's share of positions computed that held no real token. Split on more
    than one rank, the ranks' imbalance is the mean over steps of the slowest rank's step cost over the mean rank's,
    and the sync wait the longest any rank waited at each step's sync, summed over steps.
    """

    def __init__(self, first_step: int = 0) -> None:
        self.first_step = first_step  # the run's step this fit started at (a resumed fit goes on counting)
        self.steps = 0
        self.effective_batch_sizes: set[int] = set()
        self.micro_batch_range: tuple[int, int] | None = None
        self.settled: tuple[int, int] | None = None  # (size, since step)
        self.token_range: tuple[int, int] | None = None  # split by tokens: the budget's
        self.token_settled: tuple[int, int] | None = None  # (budget, since step)
        self.padding: list[float] = []  # split by tokens: each step's padding fraction
        self.imbalance: list[float] = []  # split on several ranks: each step's slowest rank over the mean rank
        self.sync_wait_seconds = 0.0  # ... the longest any rank waited at each step's sync, summed over steps
        self.price_error: list[float] = []  # ... dealt by a balanced sampler: measured compute's imbalance over priced
        self.oom_steps: list[int] = []
        self.samples = 0
        self._step_samples: list[int] = []  # each step's effective batch size
        self.event_counts: dict[str, int] = {}  # events of the run by metric key
        self.seconds = 0.0
        self.peak_fraction: float | None = None  # the highest peak, as a fraction of `memory_limit`
        self.memory_limit = "budget"  # or "capacity", where no budget is set

    def add_peak(self, fraction: float, memory_limit: str) -> None:
        """A peak (of a logging interval, or of the steps after the last one) as a fraction of the budget or capacity.

        ``memory_limit`` says which: ``"budget"`` or ``"capacity"``.
        """
        self.peak_fraction = fraction if self.peak_fraction is None else max(self.peak_fraction, fraction)
        self.memory_limit = memory_limit

    def add_peak_bytes(self, peak_bytes: int, budget_bytes: float | None, capacity_bytes: int) -> float | None:
        """Count a peak against the budget (the capacity without one); returns that fraction, ``None`` if unknown.

        Examples:
            >>> from lightning_accum.memory.budget import GIB
            >>> summary = FitSummary()
            >>> summary.add_peak_bytes(3 * GIB, None, 4 * GIB), summary.memory_limit
            (0.75, 'capacity')
            >>> summary.add_peak_bytes(1, None, 0) is None  # no capacity known: nothing to divide by
            True
        """
        limit = budget_bytes if budget_bytes is not None else capacity_bytes
        if limit <= 0:
            return None
        fraction = peak_bytes / limit
        self.add_peak(fraction, "budget" if budget_bytes is not None else "capacity")
        return fraction

    def add(self, report: StepReport, step: int | None = None) -> None:
        """Count one optimizer step: ``step`` on the run's axis (by default, the next one after `first_step`)."""
        step = self.first_step + self.steps if step is None else step
        self.micro_batch_range, self.settled = _track(
            self.micro_batch_range, self.settled, report.micro_batch_size, step
        )
        if report.micro_batch_tokens is not None:
            self.token_range, self.token_settled = _track(
                self.token_range, self.token_settled, report.micro_batch_tokens, step
            )
            if report.padding_fraction is not None:
                self.padding.append(report.padding_fraction)
        if report.rank_imbalance is not None:
            self.imbalance.append(report.rank_imbalance)
            self.sync_wait_seconds += report.sync_wait_seconds or 0.0
        if report.price_error is not None:
            self.price_error.append(report.price_error)
        self.effective_batch_sizes.add(report.effective_batch_size)
        self.oom_steps.extend(e.step for e in report.events if e.kind == "oom_recovered")
        for event in report.events:
            key = EVENT_KEY_BY_KIND[event.kind]
            self.event_counts[key] = self.event_counts.get(key, 0) + 1
        self.samples += report.effective_batch_size
        self._step_samples.append(report.effective_batch_size)
        self.steps += 1

    def sum_over_ranks(self, sum_across_ranks: Callable[[Tensor], Tensor]) -> None:
        """Make counts taken from this rank's batches only (plain Lightning under DDP) global: one all-reduce.

        Every rank must call it, with the same number of steps (ranks step together).
        """
        total = sum_across_ranks(torch.tensor(self._step_samples, dtype=torch.int64)).tolist()
        self._step_samples = [int(n) for n in total]
        self.effective_batch_sizes = set(self._step_samples)
        self.samples = sum(self._step_samples)

    def as_dict(self) -> dict[str, float]:
        """The numbers, for a logger."""
        figures: dict[str, float] = {"steps": self.steps, "samples": self.samples, "oom_recovered": len(self.oom_steps)}
        if self.token_settled is not None:
            figures["micro_batch_tokens_settled"] = self.token_settled[0]
        elif self.settled is not None:
            figures["micro_batch_size_settled"] = self.settled[0]
        if self.padding:
            figures["padding_fraction_mean"] = sum(self.padding) / len(self.padding)
        if self.imbalance:
            figures["rank_imbalance_mean"] = sum(self.imbalance) / len(self.imbalance)
            figures["sync_wait_seconds"] = self.sync_wait_seconds
        if self.price_error:
            figures["price_error_mean"] = sum(self.price_error) / len(self.price_error)
        if self.seconds > 0:
            figures["samples_per_sec"] = self.samples / self.seconds
        if self.peak_fraction is not None:
            figures[f"peak_fraction_of_{self.memory_limit}"] = self.peak_fraction
        return figures

    def text(self) -> str:
        """One line a person reads at the end of ``fit``."""
        sizes = sorted(self.effective_batch_sizes)
        batch = f"{sizes[0]}" if len(sizes) == 1 else f"{sizes[0]} to {sizes[-1]}" if sizes else "?"
        resumed = f" (from step {self.first_step})" if self.first_step > 0 else ""
        parts = [f"lightning_accum: {self.steps} optimizer steps{resumed}, effective batch {batch} samples"]
        if self.token_range is not None and self.token_settled is not None:
            parts.extend(self._token_text())
        elif self.micro_batch_range is not None and self.settled is not None:
            low, high = self.micro_batch_range
            span = f"micro-batch {low}" if low == high else f"micro-batch {low} to {high}"
            parts.append(f"{span}, settled at {self.settled[0]} from step {self.settled[1]}")
        if self.oom_steps:
            plural = "s" if len(self.oom_steps) > 1 else ""
            steps = ", ".join(str(s) for s in self.oom_steps)
            parts.append(f"{len(self.oom_steps)} OOM{plural} recovered (step{plural} {steps})")
        if self.imbalance:
            mean = sum(self.imbalance) / len(self.imbalance)
            parts.append(
                f"slowest rank {mean:.2f}x the mean rank's step (mean over steps), {self.sync_wait_seconds:.1f} s"
                " waited at the sync" + (_BALANCE_HINT if mean >= WORTH_BALANCING else "")
            )
        if self.price_error:
            parts.append(_price_text(sum(self.price_error) / len(self.price_error)))
        if self.peak_fraction is not None:
            over = self.memory_limit == "budget" and self.peak_fraction > 1
            parts.append(f"peak memory {self.peak_fraction:.0%} of the {self.memory_limit}" + (_OVER if over else ""))
        if self.seconds > 0:
            parts.append(f"{self.samples / self.seconds:,.0f} samples/s")
        return "; ".join(parts) + "."

    def _token_text(self) -> list[str]:
        # The budget, where it settled if it moved, and the samples its micro-batches held; then the padding.
        assert self.token_range is not None and self.token_settled is not None and self.micro_batch_range is not None
        (low, high), (budget, since) = self.token_range, self.token_settled
        span = f"{low} tokens" if low == high else f"{low} to {high} tokens, settled at {budget} from step {since}"
        fewest, most = self.micro_batch_range
        samples = f"{most} samples" if fewest == most else f"{fewest} to {most} samples"
        parts = [f"micro-batch budget {span} ({samples})"]
        if self.padding:
            mean = sum(self.padding) / len(self.padding)
            parts.append(f"padding {mean:.0%} of the token positions computed (mean over steps)")
        return parts


_OVER = (
    ", OVER the budget: the part of the peak that no micro-batch changes (the process, the weights, the optimizer"
    " state, on the CPU the resident set's noise) does not leave it room; the planner's warning said where it stopped"
    " shrinking. Raise `max_memory` above the peak, or lower that part (a sharded strategy, a smaller optimizer state)"
)

# From here the ranks wait for the slowest long enough to be worth a sampler that deals them equal costs (measured on
# the HF example: 1.07x without it, 1.01x with it).
WORTH_BALANCING = 1.05

PRICE_OFF = 1.05
"""Where the slowest rank's measured compute stands this far over the mean's more than its price says (mean over
steps), the balanced sampler's price does not fit the model: the summary says to measure it."""


def _price_text(error: float) -> str:
    """The summary's line on the balanced sampler's price against the ranks' measured compute."""
    text = f"the slowest rank's measured compute {error:.2f}x the mean's over what the sampler's price foresees"
    if error < PRICE_OFF:
        return text
    return text + (
        " (the price does not fit this model: measure it with `lightning_accum.sequences.measure_step_cost` on every"
        " rank and give its `pass_cost_tokens` and `quadratic` to the BalancedBatchSampler, or give `quadratic=`"
        " where long sequences run slower than their tokens say)"
    )


_BALANCE_HINT = (
    " (a BalancedBatchSampler in the training DataLoader deals each rank an equal share of every step's cost, with"
    " the same updates: docs/language-models.md#balancing-the-ranks)"
)


def _track(
    span: tuple[int, int] | None, settled: tuple[int, int] | None, value: int, step: int
) -> tuple[tuple[int, int], tuple[int, int]]:
    """A size's range over a fit, and the value it holds with the step it has held it since, after ``step``."""
    if settled is None or settled[0] != value:
        settled = (value, step)
    low, high = span or (value, value)
    return (min(low, value), max(high, value)), settled
