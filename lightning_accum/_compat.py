"""The one place that touches Lightning internals.

Lightning decides the accumulation window with modular arithmetic on its own counters
(``lightning/pytorch/loops/training_epoch_loop.py``, ``_TrainingEpochLoop._accumulated_batches_reached``:
``batch_progress.current.ready % trainer.accumulate_grad_batches == 0``) and zeroes gradients when
``batch_idx % trainer.accumulate_grad_batches == 0`` (``loops/optimization/automatic.py``,
``_AutomaticOptimization._make_zero_grad_fn``). Both are wrong as soon as ``k`` changes mid-epoch. Window mode
therefore replaces these two decisions, on the trainer's own loop instances only, with the callback's window plan.
Everything else (the final-batch step, DDP's ``no_sync``, LR schedulers, ``global_step``) keeps flowing through
Lightning's ``_should_accumulate``, which calls the first of them.

``tests/test_compat.py`` fails if Lightning renames or changes either method.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import lightning
import lightning.pytorch as pl
from lightning_utilities.core.imports import compare_version
from torch.optim import Optimizer

SUPPORTED_LIGHTNING = ">=2.2,<2.7"
_LIGHTNING_OK = compare_version("lightning", lambda a, b: a >= b, "2.2.0") and compare_version(
    "lightning", lambda a, b: a < b, "2.7.0"
)


def _check_version() -> None:
    if not _LIGHTNING_OK:
        raise RuntimeError(
            f"lightning_accum's window mode supports lightning{SUPPORTED_LIGHTNING}, found {lightning.__version__}."
            " Install a supported version, e.g. `pip install 'lightning>=2.2,<2.7'`."
        )


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
            raise RuntimeError(
                f"lightning {lightning.__version__} has no `{type(owner).__name__}.{name}`, which window mode"
                f" replaces. Use lightning{SUPPORTED_LIGHTNING}."
            )
    original_make_zero_grad_fn = automatic._make_zero_grad_fn

    def _make_zero_grad_fn(batch_idx: int, optimizer: Optimizer) -> Callable[[], None] | None:
        if not window_start():
            return None
        # Lightning's own builder, told this batch is a window start (k=1 makes `batch_idx % k == 0` true). It keeps
        # Lightning's hooks (`on_before_zero_grad`, `optimizer_zero_grad`) and its skip-backward handling.
        with _attribute(trainer, "accumulate_grad_batches", 1):
            return original_make_zero_grad_fn(batch_idx, optimizer)

    epoch_loop._accumulated_batches_reached = window_complete  # type: ignore[method-assign]
    automatic._make_zero_grad_fn = _make_zero_grad_fn  # type: ignore[method-assign]

    def uninstall() -> None:
        for owner, name in ((epoch_loop, "_accumulated_batches_reached"), (automatic, "_make_zero_grad_fn")):
            owner.__dict__.pop(name, None)

    return uninstall


def disable_backward_sync_blocking(strategy: Any) -> Callable[[], None]:
    """Make ``strategy.block_backward_sync()`` a no-op, so every micro-batch syncs (FSDP's memory-saving choice).

    Returns a function that undoes it.
    """
    if not hasattr(strategy, "block_backward_sync"):
        return lambda: None
    strategy.block_backward_sync = contextlib.nullcontext
    return lambda: strategy.__dict__.pop("block_backward_sync", None)


def precision_scaler(trainer: pl.Trainer) -> Any:
    """The GradScaler of 16-mixed precision, or ``None``."""
    return getattr(trainer.precision_plugin, "scaler", None)


@contextlib.contextmanager
def _attribute(obj: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def is_last_training_batch(trainer: pl.Trainer) -> bool:
    """Whether the batch being processed is the epoch's last, as Lightning's own step decision sees it
    (``_TrainingEpochLoop._num_ready_batches_reached``: the last batch of the data, or of ``limit_train_batches``)."""
    epoch_loop = trainer.fit_loop.epoch_loop
    return bool(epoch_loop._num_ready_batches_reached())
