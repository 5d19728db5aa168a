"""Lightning's training loops and their automatic-optimization closure, patched on one Trainer's loop instances.

Upstream (lightning 2.2 to 2.6, read on 2.6.6; refused outside ``SUPPORTED_LIGHTNING`` before anything is patched):

- ``lightning/pytorch/loops/training_epoch_loop.py``: ``_TrainingEpochLoop._accumulated_batches_reached``,
  ``_num_ready_batches_reached``, ``_should_accumulate`` (which calls both) and ``_batches_that_stepped``
  (incremented in ``on_advance_end``);
- ``lightning/pytorch/loops/optimization/automatic.py``: ``_AutomaticOptimization._make_closure``,
  ``_training_step``, ``_make_backward_fn``, ``_make_zero_grad_fn``, ``Closure`` and ``ClosureResult``
  (``from_training_step_output(..., normalize)``);
- ``lightning/pytorch/loops/utilities.py``: ``_block_parallel_sync_behavior``, which calls
  ``strategy.block_backward_sync()``.

Lightning decides the accumulation window with modular arithmetic on its own counters
(``_accumulated_batches_reached``: ``batch_progress.current.ready % trainer.accumulate_grad_batches == 0``) and zeroes
gradients when ``batch_idx % trainer.accumulate_grad_batches == 0`` (``_make_zero_grad_fn``). Both are wrong as soon
as ``k`` changes mid-epoch. Window mode therefore replaces these two decisions, on the trainer's own loop instances
only, with the callback's window plan. Everything else (the final-batch step, DDP's ``no_sync``, LR schedulers,
``global_step``) keeps flowing through Lightning's ``_should_accumulate``, which calls the first of them.

``tests/compat/test_loops.py`` fails if Lightning renames or changes any of these.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
from torch.optim import Optimizer

from lightning_accum._compat._version import _check_version, _missing


def install_window_control(
    trainer: pl.Trainer, window_complete: Callable[[], bool], window_start: Callable[[], bool]
) -> Callable[[], None]:
    """Let the callback decide where windows end and start. Returns a function that undoes it.

    Args:
        trainer: the trainer whose fit loop is patched (instance attributes only; the classes are untouched).
        window_complete: ``True`` when the current micro-batch is the last of its window (the epoch's last batch
            always steps, as in Lightning).
        window_start: ``True`` when the current micro-batch is the first of its window (gradients are zeroed).
    """
    _check_version()
    epoch_loop = trainer.fit_loop.epoch_loop
    automatic = epoch_loop.automatic_optimization
    for owner, name in ((epoch_loop, "_accumulated_batches_reached"), (automatic, "_make_zero_grad_fn")):
        if not callable(getattr(owner, name, None)):
            raise _missing(f"{type(owner).__name__}.{name}", "window mode replaces")
    original_make_zero_grad_fn = automatic._make_zero_grad_fn

    def _make_zero_grad_fn(batch_idx: int, optimizer: Optimizer) -> Callable[[], None] | None:
        if not window_start():
            return None
        # Lightning's own builder, told this batch is a window start (k=1 makes `batch_idx % k == 0` true). It keeps
        # Lightning's hooks (`on_before_zero_grad`, `optimizer_zero_grad`) and its skip-backward handling.
        with _attribute(trainer, "accumulate_grad_batches", 1):
            return original_make_zero_grad_fn(batch_idx, optimizer)

    # An instance attribute shadows the method on purpose (this trainer only); `uninstall` pops it again.
    epoch_loop._accumulated_batches_reached = window_complete  # type: ignore[method-assign]  # shadowed on purpose
    automatic._make_zero_grad_fn = _make_zero_grad_fn  # type: ignore[method-assign]  # shadowed on purpose

    def uninstall() -> None:
        for owner, name in ((epoch_loop, "_accumulated_batches_reached"), (automatic, "_make_zero_grad_fn")):
            owner.__dict__.pop(name, None)

    return uninstall


def disable_backward_sync_blocking(strategy: Any) -> Callable[[], None]:
    """Make ``strategy.block_backward_sync()`` a no-op, so every micro-batch syncs (FSDP's memory-saving choice).

    The loop enters it around every micro-batch but a window's last (``_block_parallel_sync_behavior``). Returns a
    function that undoes it.
    """
    if not hasattr(strategy, "block_backward_sync"):
        return lambda: None
    strategy.block_backward_sync = contextlib.nullcontext
    return lambda: strategy.__dict__.pop("block_backward_sync", None)


def is_last_training_batch(trainer: pl.Trainer) -> bool:
    """Whether the batch being processed is the epoch's last, as Lightning's own step decision sees it.

    That is ``_TrainingEpochLoop._num_ready_batches_reached``: the last batch of the data, or of
    ``limit_train_batches``.
    """
    epoch_loop = trainer.fit_loop.epoch_loop
    if not callable(getattr(epoch_loop, "_num_ready_batches_reached", None)):
        raise _missing(
            "_TrainingEpochLoop._num_ready_batches_reached", "lightning_accum uses to find the epoch's last batch"
        )
    return bool(epoch_loop._num_ready_batches_reached())


def logging_step(trainer: pl.Trainer) -> int:
    """The step Lightning's loggers file the current optimizer step under (the first step is 0).

    ``self.log``, ``LearningRateMonitor`` and ``ThroughputMonitor`` all use
    ``_TrainingEpochLoop._batches_that_stepped``, which is incremented in ``on_advance_end``, after the batch's
    ``on_train_batch_end`` hooks, whereas ``trainer.global_step`` already counts the step at that point.
    """
    epoch_loop = trainer.fit_loop.epoch_loop
    if not isinstance(getattr(epoch_loop, "_batches_that_stepped", None), int):
        raise _missing("_TrainingEpochLoop._batches_that_stepped", "`AccumulationMonitor` logs against")
    return epoch_loop._batches_that_stepped


def lightning_loss_divisor(trainer: pl.Trainer) -> int:
    """What Lightning divided the ``training_step`` loss by before its backward and the ``outputs`` hooks.

    ``ClosureResult.from_training_step_output(..., normalize=trainer.accumulate_grad_batches)`` in
    ``loops/optimization/automatic.py`` divides the closure loss by ``k`` under automatic optimization. Window mode
    replaces that factor by the exact window weight, and the window loss multiplies it back.
    """
    return int(trainer.accumulate_grad_batches)


# ---------------------------------------------------------------------------------------------------------------
# Split mode: the closure of one optimizer step
# ---------------------------------------------------------------------------------------------------------------
# Lightning's automatic closure runs `training_step`, then `zero_grad`, then `backward` (`Closure.closure` in
# `loops/optimization/automatic.py`), so passes made from inside `training_step` would be zeroed. Split mode therefore
# builds the whole closure itself: Lightning's own pieces (`_training_step` through the strategy, so DDP's forward and
# autocast apply; `_make_backward_fn`; `_make_zero_grad_fn`) are called in the order split mode needs. The optimizer
# step, `on_before_optimizer_step`, clipping and GradScaler stay Lightning's.


@dataclass
class SplitStepContext:
    """Lightning's pieces of one automatic-optimization step, for a split-mode runner to call in its own order."""

    batch: Any
    batch_idx: int
    optimizer: Optimizer
    training_step: Callable[[Any], tuple[Any, dict[str, Any]]]
    """Runs the user's ``training_step`` on a micro-batch via the strategy; returns its ``(loss, extra outputs)``.

    The loss is the user's own (Lightning divides it by ``accumulate_grad_batches``, which split mode keeps at 1);
    ``None`` when ``training_step`` returned ``None``."""
    backward: Callable[[Any], None] | None
    """Back-propagates a loss through the strategy (precision scaling, ``on_before_backward``); None to skip."""
    zero_grad: Callable[[], None]
    """Zeroes the gradients through Lightning's ``optimizer_zero_grad`` hook."""
    make_result: Callable[[Any, dict[str, Any]], Any]
    """Builds the ClosureResult Lightning expects from a detached loss and extra outputs."""


def install_split_closure(trainer: pl.Trainer, run_step: Callable[[SplitStepContext], Any]) -> Callable[[], None]:
    """Make every automatic-optimization step call ``run_step`` as its closure. Returns a function that undoes it."""
    _check_version()
    from lightning.pytorch.loops.optimization.automatic import Closure, ClosureResult

    automatic = trainer.fit_loop.epoch_loop.automatic_optimization
    for name in ("_make_closure", "_training_step", "_make_backward_fn", "_make_zero_grad_fn"):
        if not callable(getattr(automatic, name, None)):
            raise _missing(f"_AutomaticOptimization.{name}", "split mode uses")

    def _make_closure(kwargs: OrderedDict[str, Any], optimizer: Optimizer, batch_idx: int) -> Closure:
        def zero_grad() -> None:
            with _attribute(trainer, "accumulate_grad_batches", 1):
                fn = automatic._make_zero_grad_fn(batch_idx, optimizer)
            if fn is not None:
                fn()

        def training_step(micro_batch: Any) -> tuple[Any, dict[str, Any]]:
            micro_kwargs = OrderedDict(kwargs)
            micro_kwargs["batch"] = micro_batch
            result = automatic._training_step(micro_kwargs)
            return result.closure_loss, result.extra

        context = SplitStepContext(
            batch=kwargs["batch"],
            batch_idx=batch_idx,
            optimizer=optimizer,
            training_step=training_step,
            backward=automatic._make_backward_fn(optimizer),
            zero_grad=zero_grad,
            make_result=lambda loss, extra: ClosureResult(loss, extra=extra),
        )
        return Closure(step_fn=lambda: run_step(context), backward_fn=None, zero_grad_fn=None)

    # An instance attribute shadows the method on purpose (this trainer only); the undo pops it again.
    automatic._make_closure = _make_closure  # type: ignore[method-assign]  # shadowed on purpose
    return lambda: automatic.__dict__.pop("_make_closure", None)


@contextlib.contextmanager
def _attribute(obj: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)
