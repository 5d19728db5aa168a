"""What every callback that owns accumulation does alike: claiming ``k``, undoing its patches, publishing reports.

``AccumulationScheduler`` (window mode) and ``AutoMicroBatching`` (split mode) differ in how a step is cut into
micro-batches; everything around that lives here, once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_only
from torch import Tensor
from typing_extensions import override

from lightning_accum import _compat
from lightning_accum._validation import check_int
from lightning_accum.distributed import sum_across_ranks_fn
from lightning_accum.items import resolve_counter
from lightning_accum.noise_scale import NoiseScaleEstimator, unbiased_estimates
from lightning_accum.normalization import (
    ItemCounter,
    LossReduction,
    WindowNormalizer,
    WindowTotals,
    check_loss_reduction,
)
from lightning_accum.report import AccumulationEvent, LossSum, Mode, StepReport
from lightning_accum.splitting import BatchHooks, resolve_batch_hooks

log = logging.getLogger("lightning_accum")


class AccumulationOwner(Callback):
    """Base of the callbacks that own gradient accumulation. Not used directly.

    It holds the item counter, the exactness arithmetic (`lightning_accum.normalization.WindowNormalizer`) and the
    batch hooks; it moves its callback to the front of ``trainer.callbacks`` (so that every other
    ``on_before_optimizer_step`` sees the exact gradient), undoes what the subclass installed on the trainer when
    ``fit`` ends or raises, and publishes one `lightning_accum.report.StepReport` per optimizer step.
    """

    def __init__(self, count_items: ItemCounter | str | None, loss_reduction: LossReduction) -> None:
        self.count_items = resolve_counter(count_items)
        self.loss_reduction: LossReduction = check_loss_reduction(loss_reduction)
        self.normalizer = WindowNormalizer(loss_reduction)
        self.last_step_report: StepReport | None = None
        self.consumed_samples = 0  # all ranks, since the start of training (restored on resume)
        self.oom_retries = 0
        self.events: list[AccumulationEvent] = []  # every event of the run (they are rare: OOMs, resizes, k changes)
        self._hooks: BatchHooks = resolve_batch_hooks(None)
        self._pending_events: list[AccumulationEvent] = []
        self._undo: list[Callable[[], None]] = []
        self._noise_wanted = False
        self._noise_every = 1  # measure every this many windows
        self._first_gradient: tuple[int, Tensor, float | Tensor, float, float] | None = None
        self._noise: tuple[float, float] | None = None

    # ----------------------------------------------------------------------------------------------------------
    # the trainer
    # ----------------------------------------------------------------------------------------------------------
    def _claim(self, trainer: pl.Trainer) -> None:
        """Refuse a second owner, and run first among the callbacks."""
        others = [cb for cb in trainer.callbacks if cb is not self and isinstance(cb, AccumulationOwner)]
        if others:
            raise RuntimeError(
                f"`{type(self).__name__}` and `{type(others[0]).__name__}` both want to own gradient accumulation."
                " Keep one of them."
            )
        trainer.callbacks.remove(self)
        trainer.callbacks.insert(0, self)

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
        return None

    def measure_noise_scale(self, every: int = 1) -> None:
        """Estimate the gradient noise scale in every ``every``-th window and put it in the step reports.

        Asked by ``AccumulationMonitor(gradient_noise_scale=True)`` and by schedules that adapt to it; when several
        ask, the most frequent wins. A measured window costs one squared norm over the gradients after the first
        micro-batch's backward and one at the optimizer step, one host read and, under DDP, one scalar all-reduce; no
        extra forward, backward or gradient all-reduce. The other windows cost nothing.
        """
        every = check_int(every, "every", 1)
        self._noise_every = every if not self._noise_wanted else min(self._noise_every, every)
        self._noise_wanted = True

    def _noise_window(self) -> bool:
        """Whether this window is measured: the first, then every ``every``-th (the same on every rank)."""
        return self._noise_wanted and (self.normalizer.windows_started - 1) % self._noise_every == 0

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.normalizer.micro_batches != 1 or not self._noise_window():
            return
        # The window's first micro-batch, before any other is added: its buffer holds `n_1 / (r k)` times the mean
        # gradient over its own items (and the loss scale, under 16-bit mixed precision).
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        if grads:
            normalizer = self.normalizer
            squared = _squared_norm(grads)
            scale = _compat.gradient_scale(trainer)
            self._first_gradient = (
                normalizer.windows_started,
                squared,
                normalizer.first_items,
                normalizer.divisor,
                scale,
            )

    def _measure_noise(self, trainer: pl.Trainer, params: list[Tensor], totals: WindowTotals) -> None:
        """After the step's gradient is exact: this window's estimates of |G|² and tr(Σ), averaged over ranks."""
        self._noise = None
        # Rank-consistent conditions only: the collective below must run on every rank or on none. The number of
        # micro-batches is this rank's (a sampler may give ranks different step batches), so it only decides
        # whether this rank's pair is valid: a window of one micro-batch has one batch size.
        if not self._noise_window() or getattr(self, "sync_every_micro_batch", False):
            return
        local = torch.zeros(3, dtype=torch.float64)
        capture, self._first_gradient = self._first_gradient, None
        grads = [p.grad for p in params if p.grad is not None]
        window = self.normalizer
        if capture is not None and capture[0] == window.windows_started and window.micro_batches >= 2 and grads:
            _, small, first_items, divisor, scale = capture
            small_sq, n_small, big_sq = torch.stack(
                [
                    small.double(),
                    torch.as_tensor(first_items, dtype=torch.float64, device=small.device),
                    _squared_norm(grads).double().to(small.device),
                ]
            ).tolist()
            if 0 < n_small < totals.items:
                small_sq *= (divisor / n_small) ** 2 / scale**2
                local = torch.tensor(
                    [*unbiased_estimates(small_sq, n_small, big_sq, totals.items), 1.0], dtype=torch.float64
                )
        sum_fn = sum_across_ranks_fn(trainer)
        grad_sq_norm, trace_cov, ranks = (sum_fn(local) if sum_fn is not None else local).tolist()
        if ranks > 0:
            self._noise = (grad_sq_norm / ranks, trace_cov / ranks)

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

    def _publish(self, report: StepReport) -> None:
        self.last_step_report = report

    def _publish_step(
        self,
        mode: Mode,
        micro_batch_size: int,
        totals: WindowTotals,
        loss: LossSum,
        peak_bytes: int | None = None,
        budget_bytes: float | None = None,
    ) -> None:
        """Publish the report of the optimizer step whose window ``totals`` the normalizer just returned."""
        self._publish(
            StepReport(
                mode=mode,
                micro_batch_size=micro_batch_size,
                accumulation_steps=self.normalizer.micro_batches,  # this step's, not the plan: a tail is short
                effective_batch_size=totals.samples,
                items=totals.items,
                consumed_samples=self.consumed_samples,
                oom_retries=self.oom_retries,
                loss_sum=loss.total,
                loss_items=loss.items,
                events=self._take_events(),
                peak_bytes=peak_bytes,
                budget_bytes=budget_bytes,
                noise=self._noise,
            )
        )
        self._noise = None

    def _take_events(self) -> tuple[AccumulationEvent, ...]:
        events, self._pending_events = tuple(self._pending_events), []
        return events

    # ----------------------------------------------------------------------------------------------------------
    # checkpointing
    # ----------------------------------------------------------------------------------------------------------
    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "version": 1,
            "consumed_samples": self.consumed_samples,
            "oom_retries": self.oom_retries,
            "normalizer": self.normalizer.state_dict(),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.consumed_samples = int(state_dict.get("consumed_samples", 0))
        self.oom_retries = int(state_dict.get("oom_retries", 0))
        self.normalizer.load_state_dict(state_dict.get("normalizer", {}))


def find_owner(callbacks: list[Any]) -> AccumulationOwner | None:
    """The callback that owns accumulation, if any."""
    return next((cb for cb in callbacks if isinstance(cb, AccumulationOwner)), None)


def describe_counter(counter: Callable[..., Any] | None) -> str:
    """How a run's config names an item counter: ``samples`` for the default, else its name or repr."""
    if counter is None:
        return "samples"
    return getattr(counter, "__qualname__", None) or repr(counter)


@rank_zero_only
def log_info(message: str) -> None:
    log.info(message)


def _squared_norm(tensors: list[Tensor]) -> Tensor:
    """The squared L2 norm of all ``tensors`` together, as a tensor (no host read)."""
    norms = torch._foreach_norm(tensors)  # one fused kernel per device and dtype
    return torch.stack([n.float() for n in norms]).square().sum()
