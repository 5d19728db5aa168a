"""Fails if Lightning changes the Trainer internals that ``lightning_accum._compat.trainer`` relies on.

Each one is checked on a real Trainer during a real ``fit``: the stepping-batches property, the logger connector's
metric dicts, the hook name ``self.log`` files under, 16-bit mixed precision's scaler and a module's device.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric.utilities.device_dtype_mixin import _DeviceDtypeModuleMixin
from lightning.pytorch.callbacks import ModelCheckpoint, TQDMProgressBar
from lightning.pytorch.plugins import MixedPrecision
from lightning.pytorch.trainer import call
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightning_accum import _compat
from tests.helpers import IndexedDataset, RegressionModel, make_trainer, mse_loss, reference_grads


def _loader(n: int = 10, batch_size: int = 2) -> DataLoader:
    return DataLoader(IndexedDataset(n), batch_size=batch_size)


# ---------------------------------------------------------------------------------------------------------------
# `Trainer.estimated_stepping_batches`: a property of the class, swapped on one instance
# ---------------------------------------------------------------------------------------------------------------
class _EstimatingModel(RegressionModel):
    """Reads ``estimated_stepping_batches`` where LR schedules are sized from it."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        self.estimated = self.trainer.estimated_stepping_batches
        return super().configure_optimizers()


def test_the_estimated_stepping_batches_override_answers_for_its_trainer_only(tmp_path):
    assert isinstance(pl.Trainer.__dict__["estimated_stepping_batches"], property)
    trainer, other = make_trainer(tmp_path, max_epochs=2), make_trainer(tmp_path, max_epochs=2)
    asked: list[int] = []

    def estimate(batches: int) -> int:
        asked.append(batches)
        return 123

    undo = _compat.override_estimated_stepping_batches(trainer, estimate)
    assert isinstance(trainer, pl.Trainer) and type(trainer).__name__ == "Trainer" and type(other) is pl.Trainer
    model, other_model = _EstimatingModel(), _EstimatingModel()
    trainer.fit(model, _loader(n=10, batch_size=2))
    other.fit(other_model, _loader(n=10, batch_size=2))
    assert model.estimated == 123
    assert asked == [5]  # `num_training_batches`, which Lightning's own property loaded first
    assert other_model.estimated == math.ceil(5 / 1) * 2  # Lightning's own figure, for the Trainer left alone
    undo()
    assert type(trainer) is pl.Trainer
    assert trainer.estimated_stepping_batches == 10


def test_lightnings_own_estimate_answers_for_an_endless_run(tmp_path):
    trainer = make_trainer(tmp_path, max_epochs=-1, max_steps=3)
    _compat.override_estimated_stepping_batches(trainer, lambda batches: 123)
    model = _EstimatingModel()
    trainer.fit(model, _loader())
    assert model.estimated == 3


# ---------------------------------------------------------------------------------------------------------------
# the logger connector's dicts: `callback_metrics`, `progress_bar_metrics`
# ---------------------------------------------------------------------------------------------------------------
class _SetsMetrics(pl.Callback):
    """Puts a value into the Trainer's dicts after every batch, as ``AccumulationMonitor`` does."""

    def __init__(self) -> None:
        self.bar_at_epoch_end: dict[str, Any] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        _compat.set_callback_metrics(trainer, {"accum/window_loss": 10.0 - batch_idx})
        _compat.set_progress_bar_metrics(trainer, {"mb": str(batch_idx)})

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self.bar_at_epoch_end = TQDMProgressBar().get_metrics(trainer, pl_module)


class _LogsToTheBar(RegressionModel):
    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("own", 1.0, prog_bar=True)
        return loss


def test_callback_metrics_is_the_connectors_own_dict(tmp_path):
    # `set_callback_metrics` relies on the property handing out the dict it keeps, not a copy.
    trainer = make_trainer(tmp_path)
    _compat.set_callback_metrics(trainer, {"accum/window_loss": 0.5})
    assert trainer.callback_metrics is trainer.callback_metrics
    assert float(trainer.callback_metrics["accum/window_loss"]) == 0.5


def test_what_is_put_in_the_dicts_reaches_model_checkpoint_and_the_progress_bar(tmp_path):
    setter = _SetsMetrics()
    checkpoint = ModelCheckpoint(dirpath=tmp_path, monitor="accum/window_loss", mode="min", save_top_k=1)
    trainer = make_trainer(tmp_path, [setter, checkpoint], enable_checkpointing=True)
    trainer.fit(_LogsToTheBar(), _loader(n=10, batch_size=2))
    assert float(checkpoint.best_model_score) == 10.0 - 4  # kept through Lightning's own updates to epoch end
    assert setter.bar_at_epoch_end["mb"] == "4" and "own" in setter.bar_at_epoch_end  # next to `self.log`'s


# ---------------------------------------------------------------------------------------------------------------
# the hook name: `LightningModule._current_fx_name`
# ---------------------------------------------------------------------------------------------------------------
class _HookNames(RegressionModel):
    def __init__(self) -> None:
        super().__init__()
        self.names: dict[str, Any] = {}

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        self.names.setdefault("training_step", self._current_fx_name)
        return super().training_step(batch, batch_idx)

    def raises(self) -> None:
        raise ValueError("a hook that fails")

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx:
            return
        with _compat.hook_context(self, "training_step"):
            self.log("inside", 2.0, on_epoch=True)
        self.names["restored"] = self._current_fx_name
        with pytest.raises(ValueError, match="a hook that fails"), _compat.hook_context(self, "training_step"):
            raise ValueError("a hook that fails")
        self.names["restored_after_error"] = self._current_fx_name
        with pytest.raises(ValueError, match="a hook that fails"):
            call._call_lightning_module_hook(self.trainer, "raises")
        self.names["after_lightnings_failed_hook"] = self._current_fx_name
        with _compat.hook_context(self):  # `None`: restores whatever is current once the block ends
            self._current_fx_name = "on_train_batch_end"
        self.names["results"] = set(self.trainer._results)


def test_self_log_files_under_the_hook_name_compat_sets_and_restores(tmp_path):
    model = _HookNames()
    make_trainer(tmp_path).fit(model, _loader(n=4))
    assert model.names["training_step"] == "training_step"  # what `trainer/call.py` sets around the hook
    assert "training_step.inside" in model.names["results"]  # filed under the hook `hook_context` named
    assert model.names["restored"] == model.names["restored_after_error"] == "on_train_batch_end"
    # Lightning does not restore the name when a hook raises: why `hook_context` exists.
    assert model.names["after_lightnings_failed_hook"] == "raises"
    assert "pl_module._current_fx_name = hook_name" in inspect.getsource(call._call_lightning_module_hook)


# ---------------------------------------------------------------------------------------------------------------
# precision: `MixedPrecision.scaler`
# ---------------------------------------------------------------------------------------------------------------
class _GradientAfterBackward(RegressionModel):
    def on_after_backward(self) -> None:
        self.scale = _compat.gradient_scale(self.trainer)
        self.scaled = {n: p.grad.detach().clone() for n, p in self.named_parameters()}


def test_the_gradient_scale_is_what_16_bit_mixed_precision_multiplied_the_gradients_by(tmp_path):
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    trainer = make_trainer(tmp_path, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)], max_steps=1)
    model = _GradientAfterBackward()
    expected = reference_grads(RegressionModel(), [next(iter(_loader(n=8, batch_size=8)))], mse_loss)
    trainer.fit(model, _loader(n=8, batch_size=8))
    assert model.scale == 8.0 == _compat.gradient_scale(trainer)
    close = {"rtol": 1e-2, "atol": 1e-2}  # float16 autocast on CPU
    for name, grad in model.scaled.items():
        torch.testing.assert_close(grad, 8.0 * expected[name], **close)  # scaled from backward
        torch.testing.assert_close(model.step_grads[0][name], expected[name], **close)  # unscaled at the step
    assert _compat.gradient_scale(make_trainer(tmp_path)) == 1.0  # 32-bit: no scaler


# ---------------------------------------------------------------------------------------------------------------
# the module's device: `_DeviceDtypeModuleMixin._device`
# ---------------------------------------------------------------------------------------------------------------
class _Outer(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.inner = RegressionModel()
        self.plain = nn.Linear(2, 2)


def test_report_device_makes_self_device_read_it_without_moving_anything():
    model = _Outer()
    assert isinstance(model, _DeviceDtypeModuleMixin) and model.device == torch.device("cpu")
    _compat.report_device(model, torch.device("meta"))
    assert model.device == model.inner.device == torch.device("meta")
    assert {p.device for p in model.parameters()} == {torch.device("cpu")}


# ---------------------------------------------------------------------------------------------------------------
# outside `_compat`: `lightning_accum/split/preflight.py` reads `LightningModule._trainer` (None when detached)
# ---------------------------------------------------------------------------------------------------------------
class _SeesItsTrainer(RegressionModel):
    def on_train_start(self) -> None:
        self.attached = self._trainer


def test_a_lightning_modules_trainer_is_kept_in_its_private_attribute(tmp_path):
    model = _SeesItsTrainer()
    assert model._trainer is None  # what the pre-flight reads for a module no Trainer holds
    with pytest.raises(RuntimeError, match="is not attached to a `Trainer`"):
        model.trainer  # noqa: B018  # the public property refuses instead
    trainer = make_trainer(tmp_path, max_steps=1)
    trainer.fit(model, _loader())
    assert model.attached is trainer


def test_a_model_checkpoints_step_schedule_is_read_from_its_private_attributes():
    # `ModelCheckpoint._every_n_train_steps` and `_train_time_interval` (callbacks/model_checkpoint.py).
    from datetime import timedelta

    assert _compat.checkpoint_step_schedule(ModelCheckpoint(every_n_train_steps=3)) == (3, False)
    assert _compat.checkpoint_step_schedule(ModelCheckpoint(train_time_interval=timedelta(minutes=5))) == (0, True)
    assert _compat.checkpoint_step_schedule(ModelCheckpoint()) == (0, False)
