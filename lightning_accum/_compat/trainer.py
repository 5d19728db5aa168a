"""The Trainer around the loops: its class, its logger connector's dicts, hook names, precision and module device.

Upstream (lightning 2.2 to 2.6, read on 2.6.6):

- ``lightning/pytorch/trainer/trainer.py``: the ``Trainer.estimated_stepping_batches`` property, and
  ``callback_metrics`` / ``progress_bar_metrics``, which hand out the logger connector's own dicts
  (``_LoggerConnector`` in ``trainer/connectors/logger_connector/logger_connector.py``);
- ``lightning/pytorch/trainer/call.py``: sets ``LightningModule._current_fx_name`` around every hook, which
  ``LightningModule.log`` files a value under (``core/module.py``);
- ``lightning/pytorch/plugins/precision/amp.py``: ``MixedPrecision.scaler``, a ``torch.amp.GradScaler``;
- ``lightning/fabric/utilities/device_dtype_mixin.py``: ``_DeviceDtypeModuleMixin._device``, what
  ``LightningModule.device`` reads (fabric 2.0 to 2.6).

``tests/compat/test_trainer.py`` fails if Lightning renames or changes any of these.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, cast

import lightning.pytorch as pl
import torch


def override_estimated_stepping_batches(trainer: pl.Trainer, estimate: Callable[[int], int]) -> Callable[[], None]:
    """Make ``trainer.estimated_stepping_batches`` return ``estimate(num_training_batches)``. Returns the undo.

    Lightning computes it as ``ceil(batches / accumulate_grad_batches) * max_epochs``
    (``Trainer.estimated_stepping_batches`` in ``trainer/trainer.py``), with the ``k`` the Trainer holds before the
    first batch, so it ignores a ``k`` set by a callback or a schedule. The property lives on the class, so the
    instance gets a subclass of its own class that overrides it; other Trainers are untouched. Lightning's own
    property still runs first: it loads the train dataloader when nobody has yet, and answers for infinite runs.
    """
    original_class = type(trainer)
    # The property object itself (what `original_class.estimated_stepping_batches` gives), typed as such.
    original_property: property = inspect.getattr_static(original_class, "estimated_stepping_batches")

    def estimated_stepping_batches(self: pl.Trainer) -> int | float:
        lightning_estimate: int | float = original_property.__get__(self, original_class)
        total_batches = self.num_training_batches
        if self.max_epochs == -1 or total_batches == float("inf"):
            return lightning_estimate
        return estimate(int(total_batches))

    namespace = {
        "estimated_stepping_batches": property(estimated_stepping_batches, doc=original_property.__doc__),
        "__module__": original_class.__module__,
        "__qualname__": original_class.__qualname__,
    }
    patched = type(original_class.__name__, (original_class,), namespace)
    trainer.__class__ = patched

    def undo() -> None:
        if type(trainer) is patched:
            trainer.__class__ = original_class

    return undo


def set_callback_metrics(
    trainer: pl.Trainer, metrics: Mapping[str, float | torch.Tensor], drop: Iterable[str] = ()
) -> None:
    """Make ``metrics`` part of ``trainer.callback_metrics``, where ModelCheckpoint and EarlyStopping look.

    The keys in ``drop`` (and not in ``metrics``) are taken out: a value that holds at one step only must not be read
    at the next.

    ``self.log(..., logger=False)`` does the same but costs about 2 ms per key from a callback hook (each key is a
    ``_ResultMetric`` update); the property returns the connector's own dict
    (``_LoggerConnector.callback_metrics`` in ``trainer/connectors/logger_connector/logger_connector.py``), which
    keeps what is put into it until the next stage resets it. A tensor goes in as it is (no host read).
    """
    trainer.callback_metrics.update(
        {
            key: value if isinstance(value, torch.Tensor) else torch.tensor(float(value))
            for key, value in metrics.items()
        }
    )
    for key in drop:
        if key not in metrics:
            trainer.callback_metrics.pop(key, None)


def checkpoint_step_schedule(checkpoint: Any) -> tuple[int, bool]:
    """A ``ModelCheckpoint``'s ``every_n_train_steps`` (0: not by steps) and whether it also saves by training time.

    Lightning keeps both only as private attributes (``ModelCheckpoint._every_n_train_steps`` and
    ``_train_time_interval`` in ``callbacks/model_checkpoint.py``); ``tests/compat/test_trainer.py`` and
    ``tests/callbacks/test_monitor.py`` fail if they go.
    """
    every = getattr(checkpoint, "_every_n_train_steps", 0)
    return (every if isinstance(every, int) else 0), getattr(checkpoint, "_train_time_interval", None) is not None


def set_progress_bar_metrics(trainer: pl.Trainer, metrics: Mapping[str, float | int | str]) -> None:
    """Show ``metrics`` in Lightning's progress bar (TQDM or Rich), as ``self.log(..., prog_bar=True)`` would.

    Both bars read ``trainer.progress_bar_metrics`` (``ProgressBar.get_metrics``), which returns the connector's own
    dict (``_LoggerConnector.progress_bar_metrics``); updating it costs nothing per step, unlike ``self.log``.
    """
    # Lightning types the dict as numbers only; both bars show a string as it is.
    cast(dict[str, Any], trainer.progress_bar_metrics).update(metrics)


@contextlib.contextmanager
def hook_context(module: pl.LightningModule, name: str | None = None) -> Iterator[None]:
    """Run as if inside the hook ``name`` (``None``: keep the current one), and restore it afterwards, also on error.

    ``LightningModule._current_fx_name`` is what ``trainer/call.py`` sets around every hook, without a
    ``try/finally``: an exception inside a hook (an OOM in ``backward``) leaves it pointing at that hook, and later
    ``self.log`` calls would be filed under it.
    """
    previous = getattr(module, "_current_fx_name", None)
    module._current_fx_name = previous if name is None else name
    try:
        yield
    finally:
        module._current_fx_name = previous


def gradient_scale(trainer: pl.Trainer) -> float:
    """The factor 16-bit mixed precision multiplies the gradients by until the optimizer step unscales them (else 1).

    ``MixedPrecision.scaler`` (``plugins/precision/amp.py``) is a ``torch.amp.GradScaler``; reading its scale syncs
    the device, so it is read only where a gradient norm is read anyway.
    """
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if scaler is None or not scaler.is_enabled():
        return 1.0
    return float(scaler.get_scale())


# A LightningModule's `device` property reads `_device`, which `.to()` updates without looking at the parameters
# (`_DeviceDtypeModuleMixin` and `_update_properties` in `lightning/fabric/utilities/device_dtype_mixin.py`, 2.0 to
# 2.6). `tests/probe/test_preflight.py` and `tests/compat/test_trainer.py` fail if `self.device` stops reading it.
def report_device(module: torch.nn.Module, device: torch.device) -> None:
    """Make ``module.device`` (and its sub-LightningModules') read ``device``, without moving anything.

    The pre-flight's fake copy of a module on CUDA computes on fake CPU tensors: a tensor that ``training_step`` makes
    on ``self.device`` must be made there too.
    """
    from lightning.fabric.utilities.device_dtype_mixin import _DeviceDtypeModuleMixin

    for sub in module.modules():
        if isinstance(sub, _DeviceDtypeModuleMixin):
            sub._device = device
