"""Lightning Fabric: the same exact, memory-aware accumulation in a loop of your own.

Two front ends over the same pieces the ``Trainer``'s use:

- `FabricAccumulation` (window mode) drives the hand-run window `ManualAccumulation` drives too
  (`lightning_accum.core.hand_window.HandWindow`): the loop hands in each micro-batch; each loss is weighed by the
  exact window mean, the gradient sync is held back on all but the window's last micro-batch, ``k`` follows any
  schedule (`lightning_accum.schedules.AdaptiveBatchSize` included), and a slip of the loop is refused;
- `FabricMicroBatching` (split mode) holds split mode's one session (`lightning_accum.split.session.SplitSession`,
  as `lightning_accum.AutoMicroBatching` does): the loop hands in a step batch and a loss function, and the step runs
  in micro-batches that fit.

Both log the monitor's keys (`lightning_accum.keys`) through ``fabric.log_dict`` and save with ``fabric.save``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from lightning.fabric import Fabric
from torch import Tensor

from lightning_accum import _compat
from lightning_accum._compat import fabric_host as _fabric
from lightning_accum._util import MicroBatchSize, check_int, log_info
from lightning_accum.core import (
    AccumulationEngine,
    AccumulationEvent,
    ClosedWindow,
    HandWindow,
    HoldsEngine,
    ItemCounter,
    LossReduction,
    LossSum,
    Mode,
    Ranks,
    StepReport,
)
from lightning_accum.memory.backends import backend_for
from lightning_accum.memory.oom import OOMInjector
from lightning_accum.monitor.step_log import StepLog
from lightning_accum.schedules import AccumulationSchedule, ScheduleUnit, as_schedule
from lightning_accum.sequences import PaddedSequences
from lightning_accum.sequences.loaders import balanced_samplers, check_loader_lengths, weigh_shares
from lightning_accum.split.session import SplitSession
from lightning_accum.split.sync import GradientSync

__all__ = ["FabricAccumulation", "FabricMicroBatching"]


class _FabricFrontEnd(HoldsEngine):
    """What both Fabric front ends share: the ranks, the step count, the reports, logging and the state."""

    mode: Mode = "window"

    def __init__(self, fabric: Fabric, model: Any, optimizer: Any, engine: AccumulationEngine, log_every: int) -> None:
        self.fabric, self.model, self.optimizer, self.engine = fabric, model, optimizer, engine
        _fabric.wrapped_module(model)  # refuses a module `fabric.setup` did not return
        self.log_every_n_steps = check_int(log_every, "log_every_n_steps", 1)
        self.optimizer_steps = 0
        self.oom_retries = 0  # OOMs recovered from since the start (split mode has them)
        self.events: list[AccumulationEvent] = []
        self.last_step_report: StepReport | None = None
        self.host = _fabric.FabricHost(fabric, model)
        self.ranks = Ranks.of(self.host)
        self.step_log = StepLog(backend_for(fabric.device), self.ranks, self.log_every_n_steps)
        own = {id(p) for p in model.parameters()}
        if not all(id(p) in own for p in self._parameters()):
            raise ValueError(
                "`optimizer` holds parameters that are not `model`'s, so their gradients would never be weighed or"
                " synced. Make the optimizer from the module `fabric.setup` returned; under `ModelParallelStrategy`"
                " (`fully_shard` replaces the parameters) set up the module first: `model = fabric.setup_module(model)`"
                ", then `optimizer = fabric.setup_optimizers(SGD(model.parameters()))`."
            )
        self._pending: list[AccumulationEvent] = []

    def _parameters(self) -> list[Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def _record(self, event: AccumulationEvent) -> None:
        self.events.append(event)
        self._pending.append(event)

    def _count_oom(self) -> None:
        self.oom_retries += 1

    def _publish(self, closed: ClosedWindow, micro_batch_size: int, loss: LossSum, **figures: Any) -> None:
        """The step's report; at logging steps, the monitor's keys to ``fabric.log_dict`` (every rank calls it)."""
        report = closed.report(
            self.mode,
            micro_batch_size,
            loss,
            consumed_samples=self.consumed_samples,
            oom_retries=self.oom_retries,
            events=tuple(self._pending),
            **figures,
        )
        self._pending = []
        self.last_step_report = report
        step, self.optimizer_steps = self.optimizer_steps, self.optimizer_steps + 1
        row = self.step_log.add(report, step)
        if row is not None:
            self.fabric.log_dict(row, step=step)

    def summary_text(self) -> str:
        """The end-of-run summary the ``Trainer``'s monitor prints, for this front end's steps so far."""
        return self.step_log.summary.text()

    def state_dict(self) -> dict[str, Any]:
        return {**self.engine.state_dict(), "optimizer_steps": self.optimizer_steps, "oom_retries": self.oom_retries}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.engine.load_state_dict(state)
        self.optimizer_steps = int(state.get("optimizer_steps", 0))
        self.oom_retries = int(state.get("oom_retries", 0))


class FabricAccumulation(_FabricFrontEnd):
    """Window mode for a Fabric loop: exact accumulation over ``k`` micro-batches, one gradient sync per step.

    Each micro-batch runs inside `micro_batch`, which opens a window at its first micro-batch (asking the schedule
    for ``k``), holds back the gradient sync (``fabric.no_backward_sync``) on all but the window's last, and closes
    the window after the last one: its gradient is then the exact mean over every item of the window on every rank,
    and `should_step` is true. `backward` weighs the loss by the exact window mean. `batches` iterates a loader so
    that the epoch's last batch closes a (short) window, and resumes mid-epoch after `load_state_dict`.

    Args:
        fabric: the launched ``Fabric``.
        model: the module ``fabric.setup`` returned.
        optimizer: the optimizer ``fabric.setup`` returned (its parameters' gradients are rescaled).
        schedule: ``k`` as an int, a ``{key: k}`` mapping read as ``unit`` says, or a schedule object, as for
            `lightning_accum.AccumulationScheduler` (e.g. `lightning_accum.schedules.AdaptiveBatchSize`).
        unit: what a mapping's keys count: ``"epoch"``, ``"step"`` or ``"sample"``.
        count_items: counts the items of a micro-batch (default: its samples).
        loss_reduction: whether the loss passed to `backward` is the ``"mean"`` or the ``"sum"`` over its items.
        log_every_n_steps: log the monitor's keys through ``fabric.log_dict`` every this many optimizer steps.

    Raises:
        TypeError, ValueError: as for `lightning_accum.AccumulationScheduler`'s ``schedule``; ``model`` not set up.
    """

    def __init__(
        self,
        fabric: Fabric,
        model: Any,
        optimizer: Any,
        schedule: int | Mapping[int, int] | AccumulationSchedule = 1,
        *,
        unit: ScheduleUnit = "epoch",
        count_items: ItemCounter | str | None = None,
        loss_reduction: LossReduction = "mean",
        log_every_n_steps: int = 50,
    ) -> None:
        engine = AccumulationEngine(count_items, loss_reduction, as_schedule(schedule, unit))
        super().__init__(fabric, model, optimizer, engine, log_every_n_steps)
        self.epoch = 0
        self.batch_in_epoch = 0  # micro-batches of this epoch already run (restored on resume: `batches` skips them)
        self.should_step = False
        self.window = HandWindow(engine, "acc.backward(loss)")
        self._last_in_epoch = False
        if engine.schedule.adaptive is not None:
            engine.noise.request()  # k follows the measured noise scale

    def batches(self, loader: Iterable[Any]) -> Iterator[Any]:
        """One epoch of the loader's batches, knowing the last (it closes a window); skips those run before a resume."""
        check_loader_lengths(loader)
        weigh_shares(loader, "FabricAccumulation")  # exact over ranks whose shares differ: the sampler need not warn
        skip, previous, have = self.batch_in_epoch, None, False
        for index, batch in enumerate(loader):
            if index < skip:
                continue
            if have:
                yield previous
            previous, have = batch, True
        if have:
            self._last_in_epoch = True
            yield previous
        self._last_in_epoch = False
        self.epoch, self.batch_in_epoch = self.epoch + 1, 0

    @contextlib.contextmanager
    def micro_batch(self, batch: Any, last: bool | None = None) -> Iterator[None]:
        """Run one micro-batch's forward and `backward` inside: the sync is held back unless it closes the window.

        Inside, call `backward` once (not ``fabric.backward``, which is refused here); a micro-batch whose backward
        the loop skips adds nothing to the window, and a window whose every backward was skipped skips its step.

        Args:
            batch: the micro-batch, for counting its items and samples.
            last: whether it is the epoch's last (closing a short window); default: as `batches` knows it.
        """
        window, self.should_step = self.window, False
        plan = window.enter(batch, epoch=self.epoch, step=self.optimizer_steps, ranks=self.ranks)
        if plan is not None and plan.change is not None:
            plan.scale_learning_rates([self.optimizer])
            self._record(plan.change)
        closes = window.closes(self._last_in_epoch if last is None else last)
        refused = _fabric.backward_refused(self.fabric, _fabric.FABRIC_BACKWARD_IN_A_WINDOW)
        with self.fabric.no_backward_sync(self.model, enabled=not closes), refused:
            yield
        window.leave()
        self.batch_in_epoch += 1
        if not closes:
            window.after_backward(
                self.optimizer_steps,
                lambda: _compat.unsynced_gradients(self.model.module, self._parameters()),  # read only where measured
                _fabric.gradient_scale(self.fabric),
            )
            return
        closed = window.close(self.optimizer_steps, self._parameters(), self.ranks)
        if closed.totals.items <= 0:
            log_info(f"lightning_accum: window at step {self.optimizer_steps} has no items; optimizer step skipped")
        self.should_step = closed.totals.items > 0
        self._publish(closed, self.engine.schedule.micro_batch_size, window.loss)

    def backward(self, loss: Tensor, **kwargs: Any) -> None:
        """``fabric.backward`` of the micro-batch's ``loss`` times its exact weight in the window.

        Raises:
            RuntimeError: outside ``with acc.micro_batch(batch):``, or a second time in one micro-batch.
        """
        weighted = self.window.weigh(loss)
        with _fabric.backward_allowed(self.fabric):
            self.fabric.backward(weighted, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        if self.window.is_open:
            run = self.window.position + 1
            raise RuntimeError(
                f"`FabricAccumulation.state_dict()` was called inside a window ({run} micro-batch{'es' * (run > 1)}"
                f" of {self.engine.schedule.k} run): the gradients held so far are not in any state. Save after the"
                " optimizer step, `if acc.should_step: optimizer.step(); ...; fabric.save(path, state)`."
            )
        return {**super().state_dict(), "epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.epoch, self.batch_in_epoch = int(state.get("epoch", 0)), int(state.get("batch_in_epoch", 0))
        self.window.abandon()


class FabricMicroBatching(_FabricFrontEnd):
    """Split mode for a Fabric loop: each step batch runs in the largest micro-batches that fit, OOMs recovered.

    `step` takes the whole per-device step batch and ``loss_fn(model, micro_batch) -> loss``, and returns with the
    exact gradient of the step batch (all ranks) in the parameters' ``.grad``: call ``optimizer.step()`` next. It
    starts where a trace on fake tensors predicts the step fits (the pre-flight), shrinks before the budget, recovers
    from an OOM by re-running the same step batch on every rank, grows back, and splits by tokens with ``sequences``;
    under DDP (``gradient_sync`` ``"deferred"`` or ``"overlap"``) and FSDP2 it syncs once per step, as
    `lightning_accum.AutoMicroBatching` does. The arguments it shares with that callback mean the same.

    ``loss_fn`` gets the model as its first argument so that the pre-flight can trace it on a fake copy.

    `batches` iterates an epoch of a loader's step batches, as `FabricAccumulation.batches` does: it gives a
    `lightning_accum.sequences.BalancedBatchSampler` its epoch, refuses ranks whose samplers would deal apart (at the
    first call, on every rank), and after `load_state_dict` resumes mid-epoch at the step batch after the last one
    stepped.
    """

    mode: Mode = "split"

    def __init__(
        self,
        fabric: Fabric,
        model: Any,
        optimizer: Any,
        micro_batch_size: MicroBatchSize = "auto",
        *,
        max_memory: float | int | str | None = None,
        sequences: PaddedSequences | None = None,
        micro_batch_tokens: MicroBatchSize = "auto",
        count_items: ItemCounter | str | None = None,
        loss_reduction: LossReduction = "mean",
        gradient_sync: GradientSync | None = None,
        preflight: bool = True,
        fault_injector: OOMInjector | None = None,
        log_every_n_steps: int = 50,
        **planner: Any,
    ) -> None:
        super().__init__(fabric, model, optimizer, AccumulationEngine(count_items, loss_reduction), log_every_n_steps)
        self.session = SplitSession(
            self.engine,
            self._record,
            self._count_oom,
            micro_batch_size=micro_batch_size,
            micro_batch_tokens=micro_batch_tokens,
            sequences=sequences,
            max_memory=max_memory,
            gradient_sync=gradient_sync,
            preflight=preflight,
            fault_injector=fault_injector,
            **planner,
        )
        self.planner, self.sequences = self.session.planner, self.session.sequences
        self.runner = self.session.start(self.host, self.host.strategy, _fabric.sync_kind(fabric, model))
        self.policy = self.runner.policy
        self.epoch = 0
        self.batch_in_epoch = 0  # step batches of this epoch stepped from `batches` (on resume, it starts after them)
        self._in_batches = False
        self._samplers_checked = False

    def batches(self, loader: Iterable[Any]) -> Iterator[Any]:
        """One epoch of the loader's step batches; after `load_state_dict`, from the one after the last stepped.

        Every rank must call it at the same point: its first call gathers every rank's `BalancedBatchSampler`
        settings and raises on every rank where they differ (each rank deals every step itself, so a rank that deals
        otherwise loses samples or trains on some twice). A `BalancedBatchSampler` is given the epoch and starts at
        the resumed step batch itself; any other loader's step batches already stepped are loaded and skipped.
        Fabric's own loader is told the epoch too, so a resumed process draws the resumed epoch's order, not epoch 0's.
        """
        samplers = balanced_samplers(loader)
        if not self._samplers_checked:
            self.session.watch_loaders(loader, self.fabric.world_size)
            self._samplers_checked = True
        _fabric.start_loader_epoch(loader, self.epoch)
        for sampler in samplers:
            sampler.set_epoch(self.epoch)
            sampler.resume(self.epoch, self.batch_in_epoch)
        skip = 0 if samplers else self.batch_in_epoch
        self._in_batches = True
        try:
            for index, batch in enumerate(loader):
                if index >= skip:
                    yield batch
        finally:
            self._in_batches = False
        self.epoch, self.batch_in_epoch = self.epoch + 1, 0

    @property
    def preflight_result(self) -> Any:
        """What the cold start's trace found on this rank (`lightning_accum.split.preflight.Preflight`), or None."""
        return self.session.preflight_result

    def step(self, batch: Any, loss_fn: Callable[[Any, Any], Tensor]) -> Tensor:
        """Run one step batch in micro-batches; returns the step's loss (the item-weighted mean on this rank)."""
        self.host.global_step = step = self.optimizer_steps
        session, fabric = self.session, self.fabric
        context = _compat.SplitStepContext(
            batch, step, self.optimizer,
            training_step=lambda micro: (loss_fn(self.model, micro), {}),
            backward=fabric.backward, zero_grad=self.optimizer.zero_grad, make_result=lambda loss, _: loss,
        )  # fmt: skip
        # `loss_fn` returns the loss; the step's own backward (`context.backward`, bound above) is the only one.
        with _fabric.backward_refused(fabric, _fabric.FABRIC_BACKWARD_IN_LOSS_FN):
            session.begin_step(batch, _LossModule(self.model.module, loss_fn), [self.optimizer.optimizer])
            loss: Tensor = self.runner(context)
        closed = session.close_window(step, self._parameters())
        figures = session.end_step(step, closed)
        assert figures is not None
        self._publish(closed, figures.micro_batch_size, session.window_loss, **figures.report)
        if self._in_batches:
            self.batch_in_epoch += 1
        return loss

    def state_dict(self) -> dict[str, Any]:
        position = {"epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch}
        return {**super().state_dict(), **self.session.state_dict(), **position}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.session.load_state_dict(dict(state))
        self.epoch, self.batch_in_epoch = int(state.get("epoch", 0)), int(state.get("batch_in_epoch", 0))


class _LossModule(torch.nn.Module):
    """The user's module and loss function as the pre-flight traces a step: ``training_step`` is ``loss_fn``."""

    def __init__(self, model: torch.nn.Module, loss_fn: Callable[[Any, Any], Tensor]) -> None:
        super().__init__()
        self.model, self.loss_fn = model, loss_fn

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self.loss_fn(self.model, batch)
