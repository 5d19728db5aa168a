"""What every callback that owns accumulation does alike: claiming ``k``, undoing its patches, publishing reports.

``AccumulationScheduler`` (window mode) and ``AutoMicroBatching`` (split mode) differ in how a step is cut into
micro-batches; the arithmetic lives in their shared `lightning_accum.core.engine.AccumulationEngine`, and the Lightning
glue around it here, once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from torch.optim import Optimizer
from typing_extensions import override

from lightning_accum import _compat
from lightning_accum._util.log import log_info
from lightning_accum.batches import BatchHooks
from lightning_accum.core.engine import AccumulationEngine, ClosedWindow, HoldsEngine, Ranks
from lightning_accum.core.noise_scale import NoiseScaleEstimator
from lightning_accum.core.normalization import ItemCounter, LossReduction
from lightning_accum.core.step_report import AccumulationEvent, LossSum, Mode, StepReport


class AccumulationOwner(HoldsEngine, Callback):
    """Base of the callbacks that own gradient accumulation. Not used directly.

    It holds the `lightning_accum.core.engine.AccumulationEngine` (counting, the exactness arithmetic, the schedule, the
    noise scale, the state); it moves its callback to the front of ``trainer.callbacks`` (so that every other
    ``on_before_optimizer_step`` sees the exact gradient), undoes what the subclass installed on the trainer when
    ``fit`` ends or raises, and publishes one `lightning_accum.core.step_report.StepReport` per optimizer step.
    """

    def __init__(
        self, count_items: ItemCounter | str | None, loss_reduction: LossReduction, schedule: Any = None
    ) -> None:
        self.engine = AccumulationEngine(count_items, loss_reduction, schedule)
        self.last_step_report: StepReport | None = None
        self.oom_retries = 0  # OOMs recovered from since the start of training (split mode has them)
        self.events: list[AccumulationEvent] = []  # every event of the run (they are rare: OOMs, resizes, k changes)
        self._pending_events: list[AccumulationEvent] = []
        self._undo: list[Callable[[], None]] = []
        self.splits_by_tokens = False  # cuts micro-batches by padded tokens, reporting the budget and the padding
        self.splits_steps = False  # split mode: on several ranks, it reports how unequal the ranks' steps were

    @property
    def _hooks(self) -> BatchHooks:
        return self.engine.hooks

    # ----------------------------------------------------------------------------------------------------------
    # the trainer
    # ----------------------------------------------------------------------------------------------------------
    def _claim(self, trainer: pl.Trainer) -> None:
        """Refuse a second owner, and run first among the callbacks."""
        callbacks: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]  # undeclared on Lightning's Trainer
        others = [cb for cb in callbacks if cb is not self and isinstance(cb, AccumulationOwner)]
        if others:
            raise RuntimeError(
                f"`{type(self).__name__}` and `{type(others[0]).__name__}` both want to own gradient accumulation."
                " Keep one of them."
            )
        callbacks.remove(self)
        callbacks.insert(0, self)

    def _install(self, undo: Callable[[], None]) -> None:
        """Remember how to undo something installed on the trainer."""
        self._undo.append(undo)

    def _restore(self, trainer: pl.Trainer) -> None:
        """Undo everything installed, last first. Subclasses extend it to put back what else they changed."""
        while self._undo:
            self._undo.pop()()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._restore(trainer)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # Lightning calls no `teardown` hook after an exception; a re-fit of this Trainer must find it as it was.
        self._restore(trainer)

    # ----------------------------------------------------------------------------------------------------------
    # the gradient noise scale: two batch sizes per window, at the cost of two norms (see `noise_scale`)
    # ----------------------------------------------------------------------------------------------------------
    def noise_scale_in_use(self) -> NoiseScaleEstimator | None:
        """The noise-scale average that decides ``k``, where a schedule follows it (`AdaptiveBatchSize`), else None.

        `lightning_accum.AccumulationMonitor` logs this one, so the chart shows what the schedule acted on.
        """
        return self.engine.schedule.noise_scale

    def measure_noise_scale(self, every: int = 1) -> None:
        """Estimate the gradient noise scale in every ``every``-th window and put it in the step reports.

        Asked by ``AccumulationMonitor(gradient_noise_scale=True)`` and by schedules that adapt to it; when several
        ask, the most frequent wins. The measured windows are those whose optimizer step (from 0) is a multiple of
        ``every``, so a resumed run measures the ones an uninterrupted run does. A measured window costs one squared
        norm over the gradients after the first micro-batch's backward and one at the optimizer step, one host read
        and, under DDP or FSDP2, one all-reduce of six numbers; no extra forward, backward or gradient collective. The
        other windows cost nothing.
        """
        self.engine.noise.request(every)

    @property
    def noise_windows(self) -> int:
        """How many windows the last step report's noise measurement stands for (0 when that step has none).

        The windows since the previous measurement, counted from the optimizer steps (and restored on resume), so an
        average that weighs each measurement by it covers the same span of training in a resumed run.
        """
        return self.engine.noise.windows

    def _syncs_first_micro_batch(self, trainer: pl.Trainer) -> bool:
        """Whether the ranks sync the gradient after the window's first micro-batch, so no rank holds its own."""
        return False

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        engine = self.engine
        if engine.normalizer.micro_batches != 1 or not engine.wants_noise(trainer.global_step):
            return
        if self._syncs_first_micro_batch(trainer):
            return
        # The window's first micro-batch, before any other is added: its buffer holds `n_1 / D` times the mean
        # gradient over its own items (and the loss scale, under 16-bit mixed precision). Under FSDP2 it sits on
        # FSDP2's unsharded parameters, the sync being held back.
        gradients = _compat.unsynced_gradients(pl_module, list(pl_module.parameters()))
        engine.capture_first_gradient(trainer.global_step, gradients, _compat.gradient_scale(trainer))

    def _close_window(
        self, trainer: pl.Trainer, optimizer: Optimizer, averaged_over: int | None = None, extra: Any = ()
    ) -> ClosedWindow:
        """At the optimizer step: the window's exact gradient, its noise scale and its totals (every rank alike)."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        return self.engine.close_window(
            trainer.global_step,
            params,
            Ranks.of(trainer),
            averaged_over,
            # Rank-consistent: the meter's collective runs on every rank or on none.
            measure_noise=not self._syncs_first_micro_batch(trainer),
            extra=extra,
        )

    # ----------------------------------------------------------------------------------------------------------
    # what happened
    # ----------------------------------------------------------------------------------------------------------
    def settings(self) -> dict[str, Any]:
        """Every setting, as the user gave it, for a run's config (W&B's ``lightning_accum`` entry)."""
        return {
            "count_items": describe_counter(self.count_items),
            "loss_reduction": self.loss_reduction,
            "batch_size_of": self._hooks.batch_size_of_source,
        }

    def _record(self, event: AccumulationEvent) -> None:
        self.events.append(event)
        self._pending_events.append(event)
        log_info(event.message())

    def _publish_step(
        self, mode: Mode, micro_batch_size: int, closed: ClosedWindow, loss: LossSum, **figures: Any
    ) -> None:
        """Publish the report of the optimizer step whose window the engine just closed.

        ``figures``: the `StepReport` fields only some steps have (split mode's peak, budget, token figures and the
        ranks' balance: `lightning_accum.split.session.StepFigures`).
        """
        report = closed.report(
            mode,
            micro_batch_size,
            loss,
            consumed_samples=self.consumed_samples,
            oom_retries=self.oom_retries,
            events=self._take_events(),
            **figures,
        )
        self._publish(report)

    def _publish(self, report: StepReport) -> None:
        """Make ``report`` the one the monitor reads for this step."""
        self.last_step_report = report

    def _take_events(self) -> tuple[AccumulationEvent, ...]:
        """The events recorded since the last report, once."""
        events, self._pending_events = tuple(self._pending_events), []
        return events

    # ----------------------------------------------------------------------------------------------------------
    # checkpointing
    # ----------------------------------------------------------------------------------------------------------
    @override
    def state_dict(self) -> dict[str, Any]:
        return {**self.engine.state_dict(), "oom_retries": self.oom_retries}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.engine.load_state_dict(state_dict)
        self.oom_retries = int(state_dict.get("oom_retries", 0))

    def _count_oom(self) -> None:
        self.oom_retries += 1


def find_owner(callbacks: list[Any]) -> AccumulationOwner | None:
    """The callback that owns accumulation, if any."""
    return next((cb for cb in callbacks if isinstance(cb, AccumulationOwner)), None)


def describe_counter(counter: Callable[..., Any] | None) -> str:
    """How a run's config names an item counter: ``samples`` for the default, else its name or repr."""
    if counter is None:
        return "samples"
    return getattr(counter, "__qualname__", None) or repr(counter)
