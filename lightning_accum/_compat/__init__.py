"""The one place that touches Lightning's and torch's internals, one module per upstream area.

- ``loops``: Lightning's training loops and their closure (window control, the split-mode closure, the epoch's last
  batch, the logging step, the loss divisor, backward-sync blocking);
- ``trainer``: the Trainer around them (the ``estimated_stepping_batches`` class swap, the logger connector's
  metric dicts, the hook name ``self.log`` files under, precision's gradient scale, a module's reported device);
- ``ddp``: torch's DDP reducer driven by hand, its buffer broadcast, its process group and the strategy's timeout;
- ``fsdp2``: torch's FSDP2 internals (held-back gradients, unsharded parameters, the wrapper class).

Each module's docstring names the upstream files and versions it depends on, and ``tests/compat/`` has one test
module per module that fails if one of them changes. Callers use ``from lightning_accum import _compat`` and
``_compat.<name>``; every such name is re-exported here.
"""

from lightning_accum._compat._version import _LIGHTNING_OK, SUPPORTED_LIGHTNING
from lightning_accum._compat.ddp import (
    broadcast_ddp_buffers,
    ddp_process_group,
    mark_ddp_synced,
    prepare_ddp_backward,
    process_group_timeout,
    rebuild_ddp_buckets,
)
from lightning_accum._compat.fsdp2 import (
    block_fsdp2_backward_sync,
    discard_fsdp2_unsharded_grads,
    fsdp2_modules,
    fsdp2_unsharded_for_step,
    fsdp2_unsynced_state,
    fsdp2_unwrapped,
    no_fsdp2_gradient_sync,
    unsynced_gradients,
)
from lightning_accum._compat.loops import (
    SplitStepContext,
    disable_backward_sync_blocking,
    install_split_closure,
    install_window_control,
    is_last_training_batch,
    lightning_loss_divisor,
    logging_step,
)
from lightning_accum._compat.trainer import (
    checkpoint_step_schedule,
    gradient_scale,
    hook_context,
    override_estimated_stepping_batches,
    report_device,
    set_callback_metrics,
    set_progress_bar_metrics,
)

__all__ = [
    "SUPPORTED_LIGHTNING",
    "SplitStepContext",
    "_LIGHTNING_OK",
    "block_fsdp2_backward_sync",
    "broadcast_ddp_buffers",
    "checkpoint_step_schedule",
    "ddp_process_group",
    "disable_backward_sync_blocking",
    "discard_fsdp2_unsharded_grads",
    "fsdp2_modules",
    "fsdp2_unsharded_for_step",
    "fsdp2_unsynced_state",
    "fsdp2_unwrapped",
    "gradient_scale",
    "hook_context",
    "install_split_closure",
    "install_window_control",
    "is_last_training_batch",
    "lightning_loss_divisor",
    "logging_step",
    "mark_ddp_synced",
    "no_fsdp2_gradient_sync",
    "override_estimated_stepping_batches",
    "prepare_ddp_backward",
    "process_group_timeout",
    "rebuild_ddp_buckets",
    "report_device",
    "set_callback_metrics",
    "set_progress_bar_metrics",
    "unsynced_gradients",
]
