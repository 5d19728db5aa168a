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


def test_split_mode_internals_are_where_compat_expects():
    # Split mode builds Lightning's closure itself from these pieces (see `_compat.install_split_closure`).
    from lightning.pytorch.loops.optimization.automatic import Closure, ClosureResult

    for name in ("_make_closure", "_training_step", "_make_backward_fn", "_make_zero_grad_fn"):
        assert callable(getattr(_AutomaticOptimization, name)), name
    assert {"closure_loss", "extra"} <= set(ClosureResult.__dataclass_fields__)
    assert list(inspect.signature(Closure.__init__).parameters)[1:4] == ["step_fn", "backward_fn", "zero_grad_fn"]
    # The loss reaching the hooks is divided by `accumulate_grad_batches` (what `lightning_loss_divisor` undoes).
    assert "normalize" in inspect.signature(ClosureResult.from_training_step_output).parameters
    assert "from_training_step_output(training_step_output, trainer.accumulate_grad_batches)" in inspect.getsource(
        _AutomaticOptimization._training_step
    )


def test_logging_step_and_the_last_batch_are_where_compat_expects(tmp_path):
    trainer = make_trainer(tmp_path)
    assert _compat.logging_step(trainer) == 0
    assert "_batches_that_stepped += 1" in inspect.getsource(_TrainingEpochLoop.on_advance_end)
    assert callable(_TrainingEpochLoop._num_ready_batches_reached)


def test_estimated_stepping_batches_override_touches_only_the_instance(tmp_path):
    import lightning.pytorch as pl

    trainer, other = make_trainer(tmp_path), make_trainer(tmp_path)
    assert isinstance(pl.Trainer.__dict__["estimated_stepping_batches"], property)
    undo = _compat.override_estimated_stepping_batches(trainer, lambda batches: 123)
    assert isinstance(trainer, pl.Trainer) and type(other) is pl.Trainer
    undo()
    assert type(trainer) is pl.Trainer


def test_ddp_reducer_calls_split_mode_drives_by_hand_exist():
    from torch.nn.parallel import DistributedDataParallel

    for name in ("will_sync_module_buffers", "_sync_buffers"):
        assert callable(getattr(DistributedDataParallel, name)), name
    from torch._C._distributed_c10d import Reducer

    for name in ("prepare_for_forward", "prepare_for_backward", "_rebuild_buckets"):
        assert callable(getattr(Reducer, name)), name


def test_callback_metrics_is_the_connectors_own_dict(tmp_path):
    # `set_callback_metrics` relies on the property handing out the dict it keeps, not a copy.
    trainer = make_trainer(tmp_path)
    _compat.set_callback_metrics(trainer, {"accum/window_loss": 0.5})
    assert trainer.callback_metrics is trainer.callback_metrics
    assert float(trainer.callback_metrics["accum/window_loss"]) == 0.5
