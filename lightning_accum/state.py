"""What the accumulation callbacks know about the current step, shared with `AccumulationMonitor`.

A callback that owns accumulation (``AccumulationScheduler`` or ``AutoMicroBatching``) exposes one
`AccumulationState` as its ``accumulation_state`` attribute and updates it at every optimizer step. The
monitor only reads it. Counts are global (summed over ranks) unless the field says otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from torch import Tensor

EventKind = Literal["schedule_change", "oom_recovered", "shrink", "grow"]


@dataclass(frozen=True)
class AccumulationEvent:
    """Something that changed the shape of the work, for logs and dashboards."""

    kind: EventKind
    step: int
    before: int
    after: int
    reason: str = ""

    def message(self) -> str:
        what = {
            "schedule_change": "accumulation steps",
            "oom_recovered": "micro-batch size after an OOM",
            "shrink": "micro-batch size (memory pressure)",
            "grow": "micro-batch size (memory freed)",
        }[self.kind]
        tail = f" ({self.reason})" if self.reason else ""
        return f"lightning_accum: {what} {self.before} -> {self.after} at step {self.step}{tail}"


@dataclass
class AccumulationState:
    """The figures of the last completed optimizer step.

    Attributes:
        mode: ``"window"`` (the dataloader yields micro-batches) or ``"split"`` (it yields whole step batches).
        accumulation_steps: micro-batches per optimizer step on one rank (the current ``k``).
        micro_batch_size: samples per micro-batch on one rank (the size of the first micro-batch of the step).
        samples_per_step: samples in the last optimizer step, all ranks: the effective batch size.
        items_per_step: items (samples or tokens) in the last optimizer step, all ranks.
        consumed_samples: samples consumed since the start of training, all ranks.
        oom_retries: OOMs recovered from since the start of training (cumulative).
        world_size: number of data-parallel ranks.
        settings: the accumulation settings, for a run's config.
        events: events not yet taken by a monitor.
        micro_batch_items: items in the current micro-batch on this rank, as the owner counted them (window mode),
            so a monitor doesn't count them again.
        window_loss_sum: the item-weighted loss summed over the last step's micro-batches on this rank (split mode,
            where the micro-batches run inside one Lightning batch and only the owner sees their losses).
        window_items: the items behind ``window_loss_sum``.
    """

    mode: Literal["window", "split"] = "window"
    accumulation_steps: int = 1
    micro_batch_size: int = 0
    samples_per_step: int = 0
    items_per_step: float = 0.0
    consumed_samples: int = 0
    oom_retries: int = 0
    world_size: int = 1
    settings: dict[str, Any] = field(default_factory=dict)
    events: list[AccumulationEvent] = field(default_factory=list)
    micro_batch_items: int | Tensor | None = None
    window_loss_sum: Tensor | float | None = None
    window_items: int | Tensor | None = None

    def take_events(self) -> list[AccumulationEvent]:
        """Return the pending events and forget them."""
        events, self.events = self.events, []
        return events


def find_state(callbacks: list[Any]) -> AccumulationState | None:
    """The `AccumulationState` of the first callback that owns accumulation, if any."""
    for callback in callbacks:
        state = getattr(callback, "accumulation_state", None)
        if isinstance(state, AccumulationState):
            return state
    return None
