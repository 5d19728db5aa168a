"""What `lightning_accum.AutoMicroBatching` refuses and warns about in the Trainer it joins, with the messages."""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_warn
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_accum import _compat
from lightning_accum.split.sync import (
    GradientSync,
    overlap_wait_warning,
)


def refuse_what_split_mode_cannot_run(trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
    if not pl_module.automatic_optimization:
        raise RuntimeError(
            "`AutoMicroBatching` needs automatic optimization, but this LightningModule sets"
            " `automatic_optimization = False`. Under manual optimization, split the batch yourself and use"
            " `lightning_accum.ManualAccumulation`."
        )
    if trainer.accumulate_grad_batches != 1:
        raise ValueError(
            f"`Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches})` cannot be combined with"
            " `AutoMicroBatching`: in split mode each dataloader batch is one optimizer step. Remove"
            " `accumulate_grad_batches` and make the dataloader yield the whole per-device step batch."
        )


GRADIENT_ACCUMULATION_SCHEDULER = (
    "Lightning's `GradientAccumulationScheduler` cannot be combined with `AutoMicroBatching`: it sets"
    " `trainer.accumulate_grad_batches` at each epoch start, and in split mode each dataloader batch is one optimizer"
    " step. Remove `GradientAccumulationScheduler`; to grow the effective batch size, make the dataloader yield"
    " larger step batches (`AutoMicroBatching` splits them to fit memory), or use `AccumulationScheduler` (window"
    " mode) instead of `AutoMicroBatching`."
)


ACCUMULATE_GRAD_BATCHES_CHANGED = (
    "`trainer.accumulate_grad_batches` became {trainer.accumulate_grad_batches} at epoch {trainer.current_epoch}, but"
    " `AutoMicroBatching` needs 1: in split mode each dataloader batch is one optimizer step. Remove whatever sets it"
    " (e.g. a `GradientAccumulationScheduler`), and make the dataloader yield larger step batches to grow the"
    " effective batch size."
)


def warn_about_overlap_waits(trainer: pl.Trainer, gradient_sync: GradientSync) -> None:
    """Warn where an OOM in the synced backward could leave the other ranks waiting out a long NCCL timeout."""
    strategy = trainer.strategy
    backend = getattr(strategy, "process_group_backend", None)
    warning = overlap_wait_warning(gradient_sync, trainer.world_size, backend, _compat.process_group_timeout(strategy))
    if warning:
        rank_zero_warn(warning)


def warn_about_batch_norm(pl_module: pl.LightningModule) -> None:
    layers = [
        f"{name}: {type(module).__name__}"
        for name, module in pl_module.named_modules()
        if isinstance(module, _BatchNorm)
    ]
    if not layers:
        return
    shown = ", ".join(layers[:3]) + (f" and {len(layers) - 3} more" if len(layers) > 3 else "")
    rank_zero_warn(
        f"The LightningModule has batch-norm layers ({shown}). `AutoMicroBatching` runs the step batch in"
        " micro-batches, and batch norm normalizes each micro-batch over its own samples, so the update is not the"
        " full-batch update (the one part of split mode that is not exact) and the running statistics differ too."
        " Use GroupNorm or LayerNorm, or keep the step batch in one piece with"
        " `AutoMicroBatching(<step batch size>, pin_micro_batch_size=True)` if it fits (it is still split after an"
        " OOM)."
    )
