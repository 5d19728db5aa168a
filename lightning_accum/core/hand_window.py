"""The window a hand-written loop runs, for `ManualAccumulation` and `FabricAccumulation` alike. Pure: no Trainer.

A hand loop hands in its micro-batches one by one. For each, the front end calls, in this order:

1. `HandWindow.enter` as the micro-batch starts: it is counted, and the window opens at its first micro-batch (the
   schedule's ``k``; the plan says whether ``k`` changed);
2. `HandWindow.closes`: whether this micro-batch completes the window (the front end then lets its backward sync);
3. `HandWindow.weigh` at its backward: the loss times its exact weight. Its items are added *now*, as the Trainer's
   window mode adds them at ``on_before_backward``: a micro-batch whose backward the loop skips adds nothing;
4. `HandWindow.after_backward` after a micro-batch that does not close (the noise scale's small batch), or
   `HandWindow.close` after the one that does (the exact window mean over every rank).

A backward outside a micro-batch, or a second one in the same micro-batch, is refused (`weigh` raises): its
gradient would carry no weight, or twice one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

from lightning_accum.core.engine import AccumulationEngine, ClosedWindow, Ranks, WindowPlan
from lightning_accum.core.step_report import LossSum


class HandWindow:
    """One hand loop's window: its position, the current micro-batch's counts until its backward, the window loss.

    Args:
        engine: the front end's accumulation engine (counting, weights, the schedule, the close).
        name: how the front end's backward is called in messages, e.g. ``"acc.backward(loss)"``.
    """

    def __init__(self, engine: AccumulationEngine, name: str) -> None:
        self.engine, self.name = engine, name
        self.position = -1  # the open window's current micro-batch (from 0); -1: no window open
        self.loss = LossSum()  # this rank's loss over the window's items, for the window loss
        self.backwards = 0  # backwards run in the open window
        self._counts: tuple[Any, int] | None = None  # the current micro-batch's (items, samples), until its backward

    @property
    def is_open(self) -> bool:
        return self.position >= 0

    def abandon(self) -> None:
        """Forget an open window (a fit that stopped part-way, a resumed state): the next micro-batch opens one."""
        self.position, self._counts = -1, None

    def enter(self, batch: Any, *, epoch: int, step: int, ranks: Ranks) -> WindowPlan | None:
        """A micro-batch starts: count it, and open a window at its first. Returns the plan of a window it opened."""
        items, samples = self.engine.count(batch)
        plan = None
        if self.position < 0:
            plan = self.engine.plan_window(epoch=epoch, step=step, n_samples=samples, ranks=ranks)
            self.position, self.loss, self.backwards = 0, LossSum(), 0
        else:
            self.position += 1
        self._counts = (items, samples)
        return plan

    def closes(self, last: bool = False) -> bool:
        """Whether the current micro-batch completes the window: the schedule's ``k`` reached, or the epoch's last."""
        return self.position >= self.engine.schedule.k - 1 or last

    def weigh(self, loss: Tensor) -> Tensor:
        """The current micro-batch's loss times its exact weight in the window; its items count from here.

        Raises:
            RuntimeError: no micro-batch is in progress (a backward outside one, or a second in the same one).
        """
        if self._counts is None:
            raise RuntimeError(self._outside_message())
        (items, samples), self._counts = self._counts, None
        weight = self.engine.add(items, samples)
        self.loss.add(loss.detach(), items, self.engine.loss_reduction)
        self.backwards += 1
        return loss * weight

    def leave(self) -> None:
        """The current micro-batch ended: a backward after this point belongs to no micro-batch and is refused."""
        self._counts = None

    def after_backward(self, step: int, gradients: Callable[[], list[Tensor]], loss_scale: float = 1.0) -> None:
        """After a micro-batch that does not close: its gradient is the noise scale's small batch, if the first."""
        engine = self.engine
        if self.backwards == 1 and engine.normalizer.micro_batches == 1 and engine.wants_noise(step):
            engine.capture_first_gradient(step, gradients(), loss_scale)

    def close(self, step: int, parameters: list[Tensor], ranks: Ranks) -> ClosedWindow:
        """After the micro-batch that completes the window: its exact gradient over every rank (a collective)."""
        closed = self.engine.close_window(step, parameters, ranks)
        self.abandon()
        return closed

    def _outside_message(self) -> str:
        if self.position < 0:
            where = "before any micro-batch of a window started"
        else:
            where = "after its micro-batch ended, or a second time in one micro-batch"
        return (
            f"`{self.name}` ran {where}. Each micro-batch's backward must run once, inside it, so that its gradient"
            " gets its exact weight in the window; a backward outside one would be trained with no weight (or twice"
            " one). Indent the backward into the micro-batch, once per micro-batch."
        )
