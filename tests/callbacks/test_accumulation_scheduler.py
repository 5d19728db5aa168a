"""Window mode: every optimizer step equals the full-batch step on the same samples or tokens."""

from __future__ import annotations

import copy
import logging
from functools import partial

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from torch.utils.data import DataLoader

from lightning_accum import AccumulationScheduler, BatchSizeRamp
from tests.helpers import (
    FP32,
    IndexedDataset,
    RegressionModel,
    TokenDataset,
    TokenModel,
    assert_grads_close,
    count_tokens,
    make_trainer,
    mse_loss,
    replay_reference,
    token_loss,
)


def fit_regression(tmp_path, callbacks, n=40, batch_size=4, lr=0.1, **trainer_kwargs):
    dataset = IndexedDataset(n)
    model = RegressionModel(lr=lr)
    initial = copy.deepcopy(model)
    trainer = make_trainer(tmp_path, callbacks, **trainer_kwargs)
    trainer.fit(model, DataLoader(dataset, batch_size=batch_size))
    return model, initial, dataset, trainer


@pytest.mark.parametrize("limit_train_batches", [None, 7])
def test_short_tail_window_is_exact(tmp_path, limit_train_batches):
    # 10 micro-batches (or 7 with limit_train_batches) and k=4: the last window holds 2 (or 3) micro-batches.
    kwargs = {"limit_train_batches": limit_train_batches} if limit_train_batches else {}
    model, initial, dataset, _ = fit_regression(tmp_path, [AccumulationScheduler(4)], **kwargs)
    n_batches = limit_train_batches or 10
    assert [len(i) for i in model.step_indices] == [16] * (n_batches // 4) + [4 * (n_batches % 4)]
    expected = replay_reference(initial, dataset, model.step_indices, mse_loss, lr=0.1)
    assert_grads_close(model.step_grads, expected, **FP32)


def test_uneven_micro_batches_mean_loss_is_exact(tmp_path):
    # 38 samples in micro-batches of 4: the last micro-batch holds 2 samples, so a mean of means would be wrong.
    model, initial, dataset, _ = fit_regression(tmp_path, [AccumulationScheduler(5)], n=38)
    assert [len(i) for i in model.step_indices] == [20, 18]
    expected = replay_reference(initial, dataset, model.step_indices, mse_loss, lr=0.1)
    assert_grads_close(model.step_grads, expected, **FP32)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_token_loss_with_count_items_is_exact(tmp_path, reduction):
    dataset = TokenDataset(30)
    model = TokenModel(reduction=reduction, lr=0.05)
    initial = copy.deepcopy(model)
    scheduler = AccumulationScheduler(3, count_items=count_tokens, loss_reduction=reduction)
    make_trainer(tmp_path, [scheduler]).fit(model, DataLoader(dataset, batch_size=4))
    assert len(model.step_grads) == 3  # 8 micro-batches: windows of 3, 3, 2
    # The exact window gradient is the mean over all loss-bearing tokens of the window, whatever the reduction.
    expected = replay_reference(initial, dataset, model.step_indices, partial(token_loss, reduction="mean"), lr=0.05)
    assert_grads_close(model.step_grads, expected, **FP32)
    assert scheduler.last_step_report.items == float(dataset.mask[model.step_indices[-1]].sum())


def test_token_loss_without_count_items_is_a_mean_of_means(tmp_path):
    # Guard that the token test can fail: counting samples instead of tokens gives a different gradient.
    dataset = TokenDataset(30)
    model = TokenModel(lr=0.05)
    initial = copy.deepcopy(model)
    make_trainer(tmp_path, [AccumulationScheduler(3)]).fit(model, DataLoader(dataset, batch_size=4))
    expected = replay_reference(initial, dataset, model.step_indices, token_loss, lr=0.05)
    with pytest.raises(AssertionError, match="not close"):
        assert_grads_close(model.step_grads, expected, **FP32)


def test_gradient_clipping_acts_on_the_exact_gradient(tmp_path):
    # Uneven token counts: a mean of means points elsewhere, so clipping the wrong gradient changes the direction.
    dataset = TokenDataset(30)
    model = TokenModel(lr=0.05)
    initial = copy.deepcopy(model)
    trainer = make_trainer(tmp_path, [AccumulationScheduler(3, count_items=count_tokens)], gradient_clip_val=0.5)
    trainer.fit(model, DataLoader(dataset, batch_size=4))
    unclipped = replay_reference(initial, dataset, model.step_indices, token_loss, lr=0.05)
    norms = [float(torch.cat([g.flatten() for g in step.values()]).norm()) for step in unclipped]
    assert max(norms) > 0.5, f"clipping must bite for this test to mean anything, norms {norms}"
    expected = replay_reference(initial, dataset, model.step_indices, token_loss, lr=0.05, clip_norm=0.5)
    assert_grads_close(model.step_grads, expected, **FP32)


def test_bf16_mixed_on_cpu_is_exact_within_bf16_tolerance(tmp_path):
    model, initial, dataset, _ = fit_regression(tmp_path, [AccumulationScheduler(4)], precision="bf16-mixed")
    assert [len(i) for i in model.step_indices] == [16, 16, 8]
    expected = replay_reference(initial, dataset, model.step_indices, mse_loss, lr=0.1)
    assert_grads_close(model.step_grads, expected, rtol=3e-2, atol=3e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="16-mixed with GradScaler needs CUDA")
def test_16_mixed_with_grad_scaler_is_exact(tmp_path):
    dataset = IndexedDataset(40)
    model = RegressionModel()
    initial = copy.deepcopy(model)
    trainer = make_trainer(tmp_path, [AccumulationScheduler(4)], accelerator="cuda", precision="16-mixed")
    trainer.fit(model, DataLoader(dataset, batch_size=4))
    grads = [{n: g.cpu() for n, g in step.items()} for step in model.step_grads]
    expected = replay_reference(initial, dataset, model.step_indices, mse_loss, lr=0.1)
    assert_grads_close(grads, expected, rtol=1e-2, atol=1e-3)


def test_schedule_change_mid_epoch_lands_on_the_next_window_boundary(tmp_path, caplog):
    # k=4 for the first optimizer step, then k=3: windows [0-3], [4-6], [7-9], [10-12], [13].
    with caplog.at_level(logging.INFO, logger="lightning_accum"):
        model, initial, dataset, _trainer = fit_regression(
            tmp_path, [AccumulationScheduler({0: 4, 1: 3}, unit="step")], n=56
        )
    assert [len(i) // 4 for i in model.step_indices] == [4, 3, 3, 3, 1]
    expected = replay_reference(initial, dataset, model.step_indices, mse_loss, lr=0.1)
    assert_grads_close(model.step_grads, expected, **FP32)
    assert "accumulation steps 4 -> 3 at step 1" in caplog.text


@pytest.mark.parametrize(
    ("schedule", "unit", "windows"),
    [
        ({0: 1, 1: 2}, "epoch", [1] * 6 + [2, 2, 2]),
        ({0: 2, 3: 3}, "step", [2, 2, 2, 3, 3, 3, 1]),
        # consumed samples (4 per micro-batch): k=1 until 8 samples, then 2 until 24, then 4.
        ({0: 1, 8: 2, 24: 4}, "sample", [1, 1, 2, 2, 4, 2]),
    ],
)
def test_mapping_schedules(tmp_path, schedule, unit, windows):
    max_epochs = 2 if unit == "epoch" else 1
    n = 24 if unit == "epoch" else (16 * 4 if unit == "step" else 48)
    model, initial, dataset, _ = fit_regression(
        tmp_path, [AccumulationScheduler(schedule, unit=unit)], n=n, max_epochs=max_epochs
    )
    assert [len(i) // 4 for i in model.step_indices] == windows
    expected = replay_reference(initial, dataset, model.step_indices, mse_loss, lr=0.1)
    assert_grads_close(model.step_grads, expected, **FP32)


def test_ramp_schedule_grows_the_global_batch(tmp_path):
    # Global batch 4 -> 16 in steps of 4 over 48 samples, with micro-batches of 4 on one device.
    ramp = BatchSizeRamp(start=4, target=16, increment=4, ramp_samples=48)
    model, initial, dataset, _ = fit_regression(tmp_path, [AccumulationScheduler(ramp)], n=100)
    sizes = [len(i) for i in model.step_indices]
    assert sizes[:8] == [4, 4, 4, 4, 8, 8, 12, 12]  # +4 every 16 consumed samples
    assert sum(sizes) == 100
    expected = replay_reference(initial, dataset, model.step_indices, mse_loss, lr=0.1)
    assert_grads_close(model.step_grads, expected, **FP32)


def test_schedule_none_adopts_trainer_accumulate_grad_batches(tmp_path):
    model, *_ = fit_regression(tmp_path, [AccumulationScheduler()], accumulate_grad_batches=3)
    assert [len(i) // 4 for i in model.step_indices] == [3, 3, 3, 1]


def test_window_with_no_items_skips_the_step(tmp_path):
    # Every token is padding: the mean is undefined, so the step must neither produce NaN nor move a parameter.
    dataset = TokenDataset(8, lengths=[0] * 8)
    model = TokenModel()
    before = copy.deepcopy(model.state_dict())
    scheduler = AccumulationScheduler(2, count_items=count_tokens)
    make_trainer(tmp_path, [scheduler]).fit(model, DataLoader(dataset, batch_size=2))
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, before[name])
    assert scheduler.last_step_report.items == 0


def test_resume_mid_ramp_continues_the_schedule(tmp_path):
    ramp = BatchSizeRamp(start=4, target=16, increment=4, ramp_samples=64)
    full, *_ = fit_regression(tmp_path / "full", [AccumulationScheduler(ramp)], n=64, max_epochs=2)

    first, _, dataset, trainer = fit_regression(tmp_path / "a", [AccumulationScheduler(ramp)], n=64, max_epochs=1)
    ckpt = tmp_path / "mid.ckpt"
    trainer.save_checkpoint(ckpt)
    resumed = RegressionModel()
    trainer = make_trainer(tmp_path / "b", [AccumulationScheduler(ramp)], max_epochs=2)
    trainer.fit(resumed, DataLoader(dataset, batch_size=4), ckpt_path=ckpt)

    assert [len(i) for i in first.step_indices + resumed.step_indices] == [len(i) for i in full.step_indices]
    for name, value in full.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[name], value)


# ---------------------------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"schedule": 0}, ValueError, r"`schedule` must be an int >= 1, got 0"),
        ({"schedule": 2.5}, TypeError, r"`schedule` must be an int, a \{epoch: k\} mapping"),
        ({"schedule": True}, TypeError, r"`schedule` must be an int"),
        ({"schedule": {0: 1, -3: 2}}, ValueError, r"keys must be >= 0, got key -3"),
        ({"schedule": {5: 2, 1: 3}}, ValueError, r"strictly increasing, got \[5, 1\]"),
        ({"schedule": {0: 0}}, ValueError, r"`schedule\[0\]` must be an int >= 1, got 0"),
        ({"schedule": {0: "2"}}, TypeError, r"`schedule\[0\]` must be an int >= 1, got '2'"),
        ({"schedule": 2, "unit": "batch"}, ValueError, r"`unit` must be one of 'epoch', 'step', 'sample', got 'batch'"),
        ({"loss_reduction": "avg"}, ValueError, r"`loss_reduction` must be 'mean' .* got 'avg'"),
        ({"count_items": 3}, TypeError, r"`count_items` must be a function of a batch.*got 3 of type int"),
        ({"sync_every_micro_batch": "no"}, TypeError, r"`sync_every_micro_batch` must be a bool, got 'no' of type str"),
        ({"sync_every_micro_batch": 1}, TypeError, r"`sync_every_micro_batch` must be a bool, got 1 of type int"),
    ],
)
def test_bad_arguments_raise_clear_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        AccumulationScheduler(**kwargs)


def test_schedule_together_with_trainer_accumulate_grad_batches_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"accumulate_grad_batches=2\)` is set together with"):
        fit_regression(tmp_path, [AccumulationScheduler(4)], accumulate_grad_batches=2)


def test_lightning_gradient_accumulation_scheduler_is_refused(tmp_path):
    with pytest.raises(RuntimeError, match="Remove `GradientAccumulationScheduler`"):
        fit_regression(tmp_path, [AccumulationScheduler(4), GradientAccumulationScheduler({0: 2})])


def test_manual_optimization_is_refused_with_a_pointer_to_the_helper(tmp_path):
    class Manual(RegressionModel):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

    trainer = make_trainer(tmp_path, [AccumulationScheduler(2)])
    with pytest.raises(RuntimeError, match=r"use `lightning_accum\.ManualAccumulation`"):
        trainer.fit(Manual(), DataLoader(IndexedDataset(8), batch_size=4))


@pytest.mark.parametrize(
    ("counter", "error", "match"),
    [
        (lambda b: -1, ValueError, "non-negative count, got -1"),
        (lambda b: float("nan"), ValueError, "returned nan"),
        (lambda b: b["mask"].any(), TypeError, "dtype torch.bool"),
        (lambda b: b["mask"].sum(dim=1), TypeError, r"shape \(2,\)"),
        (lambda b: -b["mask"].sum(), ValueError, "returned a negative count"),
    ],
)
def test_bad_item_counts_raise_clear_errors(tmp_path, counter, error, match):
    trainer = make_trainer(tmp_path, [AccumulationScheduler(2, count_items=counter)])
    with pytest.raises(error, match=match):
        trainer.fit(TokenModel(), DataLoader(TokenDataset(8, lengths=[3] * 8), batch_size=2))


def test_deepspeed_like_strategy_is_refused(tmp_path):
    scheduler = AccumulationScheduler(2)
    trainer = make_trainer(tmp_path, [scheduler])
    type(trainer.strategy).handles_gradient_accumulation = property(lambda self: True)
    try:
        with pytest.raises(RuntimeError, match="accumulates gradients by itself"):
            trainer.fit(RegressionModel(), DataLoader(IndexedDataset(8), batch_size=4))
    finally:
        del type(trainer.strategy).handles_gradient_accumulation


def test_a_schedule_change_is_an_event_but_the_starting_k_is_not(tmp_path):
    scheduler = AccumulationScheduler({0: 2, 2: 3}, unit="step")
    fit_regression(tmp_path, [scheduler], n=40)
    events = [(e.kind, e.step, e.before, e.after) for e in scheduler.events]
    assert events == [("schedule_change", 2, 2, 3)]


def test_a_skipped_micro_batch_counts_no_items(tmp_path):
    # `training_step` may return None to skip a micro-batch: it must not dilute the window's mean.
    class SkipsBatch3(RegressionModel):
        def training_step(self, batch, batch_idx):
            if batch_idx == 3:
                return None
            return super().training_step(batch, batch_idx)

    dataset = IndexedDataset(32)
    model = SkipsBatch3()
    initial = copy.deepcopy(model)
    make_trainer(tmp_path, [AccumulationScheduler(4)]).fit(model, DataLoader(dataset, batch_size=4))
    assert [len(i) for i in model.step_indices] == [12, 16]  # batch 3 (samples 12-15) was skipped
    expected = replay_reference(initial, dataset, model.step_indices, mse_loss, lr=0.1)
    assert_grads_close(model.step_grads, expected, **FP32)


# ---------------------------------------------------------------------------------------------------------------
# after an exception in fit (issue 9, item 15) and what the run config records (item 19)
# ---------------------------------------------------------------------------------------------------------------
class FailsOnce(RegressionModel):
    def __init__(self) -> None:
        super().__init__()
        self.fail_at: int | None = 5

    def training_step(self, batch, batch_idx):
        if batch_idx == self.fail_at:
            self.fail_at = None
            raise ValueError("a bug in training_step")
        return super().training_step(batch, batch_idx)


def test_an_exception_in_fit_leaves_the_trainer_as_it_was(tmp_path):
    scheduler = AccumulationScheduler(4)
    trainer = make_trainer(tmp_path, [scheduler], max_epochs=1)
    model = FailsOnce()
    loader = DataLoader(IndexedDataset(40), batch_size=4)
    with pytest.raises(ValueError, match="a bug in training_step"):
        trainer.fit(model, loader)
    assert trainer.accumulate_grad_batches == 1
    epoch_loop = trainer.fit_loop.epoch_loop
    assert "_accumulated_batches_reached" not in vars(epoch_loop)
    assert "_make_zero_grad_fn" not in vars(epoch_loop.automatic_optimization)
    assert type(trainer) is pl.Trainer

    # The same Trainer fits again (no misleading "set together" error) and every step is exact.
    retry = RegressionModel()
    initial = copy.deepcopy(retry)
    trainer.fit(retry, loader)
    assert [len(i) for i in retry.step_indices] == [16, 16, 8]
    expected = replay_reference(initial, loader.dataset, retry.step_indices, mse_loss, lr=0.1)
    assert_grads_close(retry.step_grads, expected, **FP32)


@pytest.mark.parametrize(
    ("schedule", "unit", "expected_unit"),
    [
        (BatchSizeRamp(start=4, target=16, increment=4, ramp_samples=48), "epoch", "sample"),
        ({0: 1, 8: 2}, "sample", "sample"),
        ({0: 1, 2: 2}, "step", "step"),
        (4, "epoch", None),  # a constant k depends on no progress counter
    ],
)
def test_settings_record_the_schedules_real_unit(tmp_path, schedule, unit, expected_unit):
    scheduler = AccumulationScheduler(schedule, unit=unit, sync_every_micro_batch=True)
    fit_regression(tmp_path, [scheduler], n=16)
    settings = scheduler.settings()
    assert settings["unit"] == expected_unit
    assert settings["schedule"] == repr(scheduler._active_schedule)
    assert settings["count_items"] == "samples"
    assert settings["loss_reduction"] == "mean"
    assert settings["sync_every_micro_batch"] is True
