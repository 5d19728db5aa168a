"""Fails if Lightning changes the internals that `_compat` replaces."""

import inspect

from lightning.pytorch.loops.optimization.automatic import _AutomaticOptimization
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

from lightning_accum import _compat
from tests.helpers import make_trainer


def test_lightning_still_decides_windows_where_compat_expects():
    should_accumulate = inspect.getsource(_TrainingEpochLoop._should_accumulate)
    assert "self._accumulated_batches_reached()" in should_accumulate
    assert "self._num_ready_batches_reached()" in should_accumulate
    assert "accumulate_grad_batches" in inspect.getsource(_TrainingEpochLoop._accumulated_batches_reached)
    zero_grad = inspect.getsource(_AutomaticOptimization._make_zero_grad_fn)
    assert "batch_idx % self.trainer.accumulate_grad_batches == 0" in zero_grad


def test_install_and_uninstall_touch_only_the_instances(tmp_path):
    trainer = make_trainer(tmp_path)
    epoch_loop = trainer.fit_loop.epoch_loop
    undo = _compat.install_window_control(trainer, window_complete=lambda: True, window_start=lambda: False)
    assert epoch_loop._accumulated_batches_reached() is True
    assert epoch_loop.automatic_optimization._make_zero_grad_fn(0, None) is None
    undo()
    assert "_accumulated_batches_reached" not in vars(epoch_loop)
    assert _TrainingEpochLoop._accumulated_batches_reached is not None
    assert _compat._LIGHTNING_OK
