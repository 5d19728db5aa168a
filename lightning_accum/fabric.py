"""Lightning Fabric: the same exact, memory-aware accumulation in a loop of your own.

Two front ends over the one core (`lightning_accum.core.engine.AccumulationEngine`), as the ``Trainer``'s are:

- `FabricAccumulation` (window mode): the loop hands in each micro-batch; it weighs each loss by the exact window
  mean, holds back the gradient sync on all but the window's last micro-batch, and says when to step, following
  ``k`` from any schedule (`lightning_accum.schedules.AdaptiveBatchSize` included);
- `FabricMicroBatching` (split mode): the loop hands in a step batch and a loss function; the step runs in
  micro-batches that fit (`lightning_accum.split.step.SplitStepRunner`, `lightning_accum.split.planner`).

Both log the monitor's keys (`lightning_accum.keys`) through ``fabric.log_dict`` and save with ``fabric.save``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric import Fabric
from torch import Tensor

from lightning_accum import keys
from lightning_accum._compat import SplitStepContext
from lightning_accum._compat import fabric_host as _fabric
from lightning_accum._compat.fsdp2 import unsynced_gradients
from lightning_accum._util.cli_types import MicroBatchSize
from lightning_accum._util.distributed import max_across_ranks
from lightning_accum._util.validation import check_int
from lightning_accum.callbacks._owner import log, log_info, ranks_of, window_report
from lightning_accum.callbacks._split_checks import refuse_ranks_that_deal_apart
from lightning_accum.callbacks.balanced_sampler_state import balanced_samplers
from lightning_accum.core.engine import AccumulationEngine, ClosedWindow, HoldsEngine
from lightning_accum.core.normalization import ItemCounter, LossReduction
from lightning_accum.core.step_report import AccumulationEvent, LossSum, Mode, StepReport
from lightning_accum.memory.backends import backend_for, free_bytes
from lightning_accum.memory.budget import budget_bytes, check_max_memory
from lightning_accum.memory.oom import OOMInjector
from lightning_accum.monitor.rows import event_metrics, rank_metrics, step_metrics, to_gib
from lightning_accum.monitor.summary import FitSummary
from lightning_accum.schedules import AccumulationSchedule, ScheduleUnit, as_schedule, scale_learning_rates
from lightning_accum.sequences import PaddedSequences
from lightning_accum.split.planner import MicroBatchPlanner
from lightning_accum.split.planner.settings import PlannerSettings
from lightning_accum.split.planner.units import Tokens
from lightning_accum.split.preflight import preflight
from lightning_accum.split.step import SplitStepRunner, published_figures
from lightning_accum.split.step_logs import StepLogCombiner
from lightning_accum.split.sync import FSDP2, DDPDeferred, DDPOverlap, GradientSync, SyncPolicy

__all__ = ["FabricAccumulation", "FabricMicroBatching"]


class _FabricFrontEnd(HoldsEngine):
    """What both Fabric front ends share: the ranks, the step count, the reports, logging and the state."""

    mode: Mode = "window"

    def __init__(self, fabric: Fabric, model: Any, optimizer: Any, engine: AccumulationEngine, log_every: int) -> None:
        self.fabric, self.model, self.optimizer, self.engine = fabric, model, optimizer, engine
        _fabric.wrapped_module(model)  # refuses a module `fabric.setup` did not return
        self.log_every_n_steps = check_int(log_every, "log_every_n_steps", 1)
        self.optimizer_steps = 0
        self.oom_retries = 0
        self.events: list[AccumulationEvent] = []
        self.last_step_report: StepReport | None = None
        self.summary = FitSummary()
        self.host = _fabric.FabricHost(fabric, model)
        self.ranks = ranks_of(self.host)
        own = {id(p) for p in model.parameters()}
        if not all(id(p) in own for p in self._parameters()):
            raise ValueError(
                "`optimizer` holds parameters that are not `model`'s, so their gradients would never be weighed or"
                " synced. Make the optimizer from the module `fabric.setup` returned; under `ModelParallelStrategy`"
                " (`fully_shard` replaces the parameters) set up the module first: `model = fabric.setup_module(model)`"
                ", then `optimizer = fabric.setup_optimizers(SGD(model.parameters()))`."
            )
        self._pending: list[AccumulationEvent] = []
        self._backend = backend_for(fabric.device)
        self._clock = time.perf_counter()

    def _parameters(self) -> list[Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def _record(self, event: AccumulationEvent) -> None:
        self.events.append(event)
        self._pending.append(event)

    def _publish(self, closed: ClosedWindow, micro_batch_size: int, loss: LossSum, **figures: Any) -> None:
        """The step's report; at logging steps, the monitor's keys to ``fabric.log_dict`` (every rank calls it)."""
        report = window_report(
            closed,
            self.mode,
            micro_batch_size,
            loss,
            consumed_samples=self.consumed_samples,
            oom_retries=self.oom_retries,
            events=tuple(self._pending),
            noise=closed.noise,
            **figures,
        )
        self._pending = []
        self.last_step_report = report
        self.summary.add(report)
        step, self.optimizer_steps = self.optimizer_steps, self.optimizer_steps + 1
        if step % self.log_every_n_steps == 0:
            self.fabric.log_dict(self._metrics(report), step=step)

    def _metrics(self, report: StepReport) -> dict[str, float]:
        """The contract's keys for one step: its batch figures, the window loss and peak memory over ranks, speed."""
        loss = torch.stack(
            [
                torch.as_tensor(report.loss_sum, dtype=torch.float64).reshape(()).detach().cpu(),
                torch.as_tensor(report.loss_items, dtype=torch.float64).reshape(()).cpu(),
            ]
        )
        peak = torch.tensor([self._backend.peak_bytes()], dtype=torch.int64)
        if self.ranks.sum is not None and self.ranks.max is not None:
            loss, peak = self.ranks.sum(loss), self.ranks.max(peak)
        capacity = self._backend.capacity_bytes()
        now = time.perf_counter()
        seconds, self._clock = now - self._clock, now
        metrics = {**step_metrics(report), **rank_metrics(report), **event_metrics(report.events)}
        metrics[keys.WINDOW_LOSS] = float(loss[0] / loss[1]) if loss[1] > 0 else float("nan")
        metrics[keys.PEAK_GIB] = to_gib(int(peak[0]))
        metrics[keys.CAPACITY_GIB] = to_gib(capacity)
        metrics[keys.PEAK_FRACTION] = int(peak[0]) / capacity if capacity else 0.0
        steps = self.log_every_n_steps if self.optimizer_steps > 1 else 1
        if seconds > 0:
            metrics[keys.SAMPLES_PER_SEC] = report.effective_batch_size * steps / seconds
            metrics[keys.ITEMS_PER_SEC] = float(report.items) * steps / seconds
        self._backend.reset_peak()
        return metrics

    def summary_text(self) -> str:
        """The end-of-run summary the ``Trainer``'s monitor prints, for this front end's steps so far."""
        return self.summary.text()

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
        self._position = -1  # -1: no window open
        self._weight: float | Tensor = 1.0
        self._loss = LossSum()
        self._items: Any = 0
        self._last_in_epoch = False
        if engine.schedule.adaptive is not None:
            engine.noise.request()  # k follows the measured noise scale

    def batches(self, loader: Iterable[Any]) -> Iterator[Any]:
        """One epoch of the loader's batches, knowing the last (it closes a window); skips those run before a resume."""
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

        Args:
            batch: the micro-batch, for counting its items and samples.
            last: whether it is the epoch's last (closing a short window); default: as `batches` knows it.
        """
        engine, self.should_step = self.engine, False
        self._items, samples = engine.count(batch)
        if self._position < 0:
            self._open(samples)
        self._weight = engine.add(self._items, samples)
        closes = self._position >= engine.schedule.k - 1 or (self._last_in_epoch if last is None else last)
        with self.fabric.no_backward_sync(self.model, enabled=not closes):
            yield
        self.batch_in_epoch += 1
        if not closes:
            if self._position == 0 and engine.wants_noise(self.optimizer_steps):
                grads = unsynced_gradients(self.model.module, self._parameters())
                engine.capture_first_gradient(self.optimizer_steps, grads, _fabric.gradient_scale(self.fabric))
            self._position += 1
            return
        closed = engine.close_window(self.optimizer_steps, self._parameters(), self.ranks)
        self._position, self.should_step = -1, True
        self._publish(closed, samples, self._loss)

    def backward(self, loss: Tensor, **kwargs: Any) -> None:
        """``fabric.backward`` of the micro-batch's ``loss`` times its exact weight in the window."""
        self._loss.add(loss.detach(), self._items, self.loss_reduction)
        self.fabric.backward(loss * self._weight, **kwargs)

    def _open(self, n_samples: int) -> None:
        self._position, self._loss = 0, LossSum()
        plan = self.engine.plan_window(
            epoch=self.epoch, step=self.optimizer_steps, n_samples=n_samples, ranks=self.ranks
        )
        if plan.change is not None:
            scale_learning_rates([self.optimizer], [], plan.lr_factor)
            self._record(plan.change)

    def state_dict(self) -> dict[str, Any]:
        if self._position >= 0:
            raise RuntimeError(
                f"`FabricAccumulation.state_dict()` was called inside a window ({self._position + 1} micro-batches of"
                f" {self.engine.schedule.k} run): the gradients held so far are not in any state. Save after the"
                " optimizer step, `if acc.should_step: optimizer.step(); ...; fabric.save(path, state)`."
            )
        return {**super().state_dict(), "epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.epoch, self.batch_in_epoch = int(state.get("epoch", 0)), int(state.get("batch_in_epoch", 0))
        self._position = -1


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
        from lightning_accum.callbacks.auto_micro_batching import check_sequences  # the callback's own checks

        super().__init__(fabric, model, optimizer, AccumulationEngine(count_items, loss_reduction), log_every_n_steps)
        self.sequences = check_sequences(sequences, micro_batch_size, micro_batch_tokens, None)
        size = micro_batch_tokens if sequences is not None else micro_batch_size
        self.planner = MicroBatchPlanner(PlannerSettings(size, **planner), unit=Tokens() if sequences else None)
        self.planner.budget_bytes = budget_bytes(check_max_memory(max_memory), self._backend.capacity_bytes())
        self.preflight = preflight
        self.policy = _policy(_fabric.sync_kind(fabric, model), self.host.strategy, fabric.world_size, gradient_sync)
        self.runner = SplitStepRunner(
            self.host, self.engine, self.planner, self.policy, StepLogCombiner(pl.LightningModule()), self._backend,
            on_oom=self._recovered, fault_injector=fault_injector, sequences=self.sequences,
        )  # fmt: skip
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
            refuse_ranks_that_deal_apart(loader, self.fabric.world_size)
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

    def step(self, batch: Any, loss_fn: Callable[[Any, Any], Tensor]) -> Tensor:
        """Run one step batch in micro-batches; returns the step's loss (the item-weighted mean on this rank)."""
        self.host.global_step = step = self.optimizer_steps
        if self.preflight and self.planner.micro_batch_size is None and self.planner.micro_batch_size_setting == "auto":
            self._preflight(batch, loss_fn)
        backend = self._backend
        backend.reset_peak()
        retries = backend.alloc_retries()
        context = SplitStepContext(
            batch, step, self.optimizer,
            training_step=lambda micro: (loss_fn(self.model, micro), {}),
            backward=self.fabric.backward, zero_grad=self.optimizer.zero_grad, make_result=lambda loss, _: loss,
        )  # fmt: skip
        loss: Tensor = self.runner(context)
        closed = self.engine.close_window(
            step, self._parameters(), self.ranks, 1 if self.policy.sums_gradients else None,
            extra=self.runner.summed_figures(),
        )  # fmt: skip
        figures = self.runner.agreed_figures(backend.alloc_retries() - retries)
        self.planner.on_step(figures.size, figures.peak, step, figures.alloc_retries)
        self._take_planner_events()
        by_tokens = self.sequences is not None
        samples, tokens, balance = published_figures(figures, closed.totals.extra, by_tokens, self.fabric.world_size)
        self._publish(
            closed, samples, self.runner.window_loss, peak_bytes=figures.peak, budget_bytes=self.planner.budget_bytes,
            micro_batch_tokens=None if tokens is None else tokens[0],
            padding_fraction=None if tokens is None else tokens[1],
            rank_imbalance=None if balance is None else balance.imbalance,
            sync_wait_seconds=None if balance is None else balance.sync_wait_seconds,
        )  # fmt: skip
        if self._in_batches:
            self.batch_in_epoch += 1
        return loss

    def _preflight(self, batch: Any, loss_fn: Callable[[Any, Any], Tensor]) -> None:
        """The cold start: trace the first step on fake tensors and start at the size predicted to fit, on all ranks."""
        module = _LossModule(self.model.module, loss_fn)
        hooks = self.engine.hooks
        cut: Any = hooks if self.sequences is None else self.sequences.cut(batch, hooks)
        size = hooks.batch_size(batch) if self.sequences is None else cut.tokens
        if self.sequences is not None:
            self.planner.unit.set_longest(cut.longest)
        start = None
        if size // 4 >= 1 and size // 4 != size // 2:
            found = preflight(module, batch, (size // 4, size // 2), optimizers=[self.optimizer.optimizer], hooks=cut)
            if found.peak_model is not None and self.planner.budget_bytes is not None:
                current, free = self._backend.current_bytes(), free_bytes(self._backend)
                start = found.starting_micro_batch_size(self.planner.budget_bytes, size, current, free)
        local = torch.tensor([int(start is None), -(start or 0)], dtype=torch.int64)
        failed, negative = (int(v) for v in max_across_ranks(self.host, local).tolist())
        if not failed:
            self.planner.start_from(-negative)

    def _recovered(self, size: int, detail: str, here: bool) -> None:
        self.oom_retries += 1
        message = f"lightning_accum: OOM at {self.planner.unit.noun} {size} ({detail}); retrying the step"
        # Rank 0 speaks for every rank; a rank that ran out of memory also says so, with its own error.
        (log.info if here else log_info)(message)
        self._take_planner_events()

    def _take_planner_events(self) -> None:
        for event in self.planner.take_events():
            self._record(AccumulationEvent(event.kind, event.step, event.before, event.after, event.reason, event.unit))

    def state_dict(self) -> dict[str, Any]:
        position = {"epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch}
        return {**super().state_dict(), "planner": self.planner.state_dict(), **position}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.planner.load_state_dict(state.get("planner", {}))
        self.epoch, self.batch_in_epoch = int(state.get("epoch", 0)), int(state.get("batch_in_epoch", 0))


class _LossModule(torch.nn.Module):
    """The user's module and loss function as the pre-flight traces a step: ``training_step`` is ``loss_fn``."""

    def __init__(self, model: torch.nn.Module, loss_fn: Callable[[Any, Any], Tensor]) -> None:
        super().__init__()
        self.model, self.loss_fn = model, loss_fn

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self.loss_fn(self.model, batch)


def _policy(kind: str, strategy: Any, world_size: int, gradient_sync: GradientSync | None) -> SyncPolicy:
    if kind == "fsdp2":
        if gradient_sync == "deferred":
            raise ValueError("`gradient_sync='deferred'` is not available under FSDP2; leave it unset or 'overlap'.")
        return FSDP2(strategy, world_size)
    if kind == "single":
        return SyncPolicy(strategy)
    return DDPOverlap(strategy) if gradient_sync == "overlap" else DDPDeferred(strategy)
