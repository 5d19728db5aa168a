"""AdaptiveBatchSize: k follows the measured gradient noise scale, at window boundaries, exact in every window."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
import yaml
from torch.utils.data import DataLoader

from lightning_accum import AccumulationScheduler
from lightning_accum.schedules import AdaptiveBatchSize, Progress
from tests.helpers import (
    FP32,
    IndexedDataset,
    RegressionModel,
    assert_grads_close,
    make_trainer,
    mse_loss,
    replay_reference,
)


def adaptive(**kwargs) -> AdaptiveBatchSize:
    settings = {"min_accumulation_steps": 2, "max_accumulation_steps": 8, "warmup_windows": 5, "beta": 0.8}
    settings["objective"] = "noise_scale"  # the goodput objective's tests are in tests/test_goodput.py
    return AdaptiveBatchSize(**{**settings, **kwargs})


def fit(tmp_path, schedule, *, epochs=2, n=256, ckpt=None, model=None):
    # y is pure noise: as the least-squares fit converges, |G|² falls towards 0 and the noise scale rises.
    dataset = IndexedDataset(n)
    model = model or RegressionModel(lr=0.2)
    trainer = make_trainer(tmp_path, [AccumulationScheduler(schedule)], max_epochs=epochs)
    trainer.fit(model, DataLoader(dataset, batch_size=4), ckpt_path=ckpt)
    return model, dataset, trainer


def test_k_rises_with_the_noise_scale_at_window_boundaries_and_every_window_is_exact(tmp_path):
    schedule = adaptive()
    initial = RegressionModel(lr=0.2)
    model, dataset, trainer = fit(tmp_path, schedule, model=copy.deepcopy(initial))
    windows = [len(indices) // 4 for indices in model.step_indices]
    assert windows[0] == 2 and max(windows) > 2  # it started at the minimum and grew
    changes = [(e.before, e.after) for e in trainer.callbacks[0].events if e.kind == "schedule_change"]
    assert changes and all(after > before for before, after in changes)  # only ever up
    assert schedule.estimator.value().windows == len(windows)
    expected = replay_reference(initial, dataset, model.step_indices, mse_loss, lr=0.2, lrs=model.step_lrs)
    assert_grads_close(model.step_grads, expected, **FP32)


def test_k_never_decreases_unless_asked_and_respects_the_bounds():
    schedule = adaptive(warmup_windows=1, beta=0.0, max_growth=None)
    progress = Progress()
    schedule.observe(items=8.0, micro_batches=2, world_size=1, noise=(1.0, 24.0))  # B = 24: k = 24 / 4 = 6
    assert schedule.accumulation_steps(progress) == 6
    schedule.observe(items=8.0, micro_batches=2, world_size=1, noise=(1.0, 4.0))  # B = 4: target 1, but no decrease
    assert schedule.accumulation_steps(progress) == 6
    schedule.observe(items=8.0, micro_batches=2, world_size=1, noise=(1.0, 1000.0))  # B = 1000: clamped to 8
    assert schedule.accumulation_steps(progress) == 8
    falling = adaptive(warmup_windows=1, beta=0.0, allow_decrease=True, max_growth=None)
    falling.observe(items=8.0, micro_batches=2, world_size=1, noise=(1.0, 24.0))
    falling.observe(items=8.0, micro_batches=2, world_size=1, noise=(1.0, 8.0))
    assert falling.accumulation_steps(progress) == 2


def test_one_wild_window_moves_k_by_at_most_max_growth_and_the_next_change_waits():
    # The char LM at k=2: one window's |G|² came out near 0, so its noise scale read 2.9e4 tokens, and k jumped from
    # 2 to its maximum at once. With the defaults, k doubles at most, and only again `warmup_windows` windows later.
    schedule = adaptive(warmup_windows=3, beta=0.0, max_accumulation_steps=64)
    for _ in range(3):
        schedule.observe(items=8.0, micro_batches=2, world_size=1, noise=(1.0, 8.0))  # B = 8: k = 2 stays
    assert schedule.accumulation_steps(Progress()) == 2
    schedule.observe(items=8.0, micro_batches=2, world_size=1, noise=(0.001, 29000.0))  # a wild window
    assert schedule.accumulation_steps(Progress()) == 4  # not 64
    schedule.observe(items=8.0, micro_batches=2, world_size=1, noise=(0.001, 29000.0))
    schedule.observe(items=8.0, micro_batches=2, world_size=1, noise=(0.001, 29000.0))
    assert schedule.accumulation_steps(Progress()) == 4  # 2 windows since the change: waits for 3
    schedule.observe(items=8.0, micro_batches=2, world_size=1, noise=(0.001, 29000.0))
    assert schedule.accumulation_steps(Progress()) == 8
    state = schedule.state_dict()
    restored = adaptive(warmup_windows=3, beta=0.0, max_accumulation_steps=64)
    restored.load_state_dict(state)
    restored.observe(items=8.0, micro_batches=2, world_size=1, noise=(0.001, 29000.0))
    assert restored.accumulation_steps(Progress()) == 8  # the wait survives a checkpoint


def test_hysteresis_keeps_small_moves_from_changing_k():
    schedule = adaptive(warmup_windows=1, beta=0.0, hysteresis=0.5)
    schedule.observe(items=8.0, micro_batches=2, world_size=1, noise=(1.0, 12.0))  # target 3 vs k 2: +50%, not more
    assert schedule.accumulation_steps(Progress()) == 2
    schedule.observe(items=8.0, micro_batches=2, world_size=1, noise=(1.0, 16.0))  # target 4: +100%
    assert schedule.accumulation_steps(Progress()) == 4


@pytest.mark.parametrize(("scaling", "factor"), [("linear", 3.0), ("sqrt", math.sqrt(3.0)), (None, 1.0)])
def test_lr_factor(scaling, factor):
    schedule = adaptive(lr_scaling=scaling, max_accumulation_steps=6, warmup_windows=1)
    schedule._k = 2
    schedule.observe(items=8.0, micro_batches=2, world_size=1, noise=(1.0, 24.0))  # k: 2 -> 6 at the next window
    assert schedule.lr_factor(2, 6) == pytest.approx(factor)


def test_a_change_mid_run_scales_the_learning_rate(tmp_path):
    schedule = adaptive(lr_scaling="linear")
    _, _, trainer = fit(tmp_path, schedule)
    k_end = schedule.accumulation_steps(Progress())
    changes = [e for e in trainer.callbacks[0].events if e.kind == "schedule_change"]
    assert changes and changes[-1].after == k_end > 2
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.2 * k_end / 2)


def test_resume_mid_adaptation_continues_identically(tmp_path):
    full_model, *_ = fit(tmp_path / "full", adaptive(), epochs=2)
    first, _, trainer = fit(tmp_path / "a", adaptive(), epochs=1)
    ckpt = tmp_path / "mid.ckpt"
    trainer.save_checkpoint(ckpt)
    resumed_schedule = adaptive()
    resumed, *_ = fit(tmp_path / "b", resumed_schedule, epochs=2, ckpt=ckpt)
    sizes = [len(i) for i in first.step_indices + resumed.step_indices]
    assert sizes == [len(i) for i in full_model.step_indices]
    for name, value in full_model.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[name], value)


def test_from_lightningcli_yaml(tmp_path: Path, monkeypatch):
    from tests.test_cli_config import build

    monkeypatch.setattr("sys.argv", ["main.py"])
    schedule = {
        "class_path": "lightning_accum.schedules.AdaptiveBatchSize",
        "init_args": {
            "max_accumulation_steps": 16,
            "objective": "noise_scale",
            "factor": 2.0,
            "lr_scaling": "sqrt_gain",
        },
    }
    callback = {"class_path": "lightning_accum.AccumulationScheduler", "init_args": {"schedule": schedule}}
    config = tmp_path / "adaptive.yaml"
    config.write_text(yaml.safe_dump({"trainer": {"callbacks": [callback]}}))
    cli = build(tmp_path, f"--config={config}")
    (scheduler,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, AccumulationScheduler)]
    assert isinstance(scheduler.schedule, AdaptiveBatchSize) and scheduler.schedule.max_k == 16
    assert (scheduler.schedule.objective, scheduler.schedule.factor) == ("noise_scale", 2.0)
    assert scheduler.schedule.lr_scaling == "sqrt_gain"


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"min_accumulation_steps": 0}, ValueError, "`min_accumulation_steps` must be an int >= 2"),
        ({"min_accumulation_steps": 4, "max_accumulation_steps": 2}, ValueError, "`max_accumulation_steps` must be"),
        ({"objective": "noise_scale", "factor": 0}, ValueError, "`factor` must be"),
        ({"lr_scaling": "cubic"}, ValueError, "`lr_scaling` must be"),
        ({"beta": 1.0}, ValueError, r"`beta` must be a number in \[0, 1\)"),
        ({"max_growth": 1.0}, ValueError, r"`max_growth` must be a finite number > 1.0, got 1.0. Or None"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        AdaptiveBatchSize(**kwargs)


def test_a_minimum_of_one_micro_batch_is_refused_it_would_never_measure(tmp_path):
    # Before: accepted, and the run measured 0 of 128 windows and kept k=1 for good.
    with pytest.raises(
        ValueError,
        match=r"`min_accumulation_steps` must be an int >= 2, got 1\. A window of one micro-batch has one batch size,"
        r" so the noise scale is never measured and k would stay 1 for good\. Use 2 \(the default\) or more",
    ):
        AdaptiveBatchSize(min_accumulation_steps=1, max_accumulation_steps=8)


def test_the_monitor_logs_the_noise_scale_the_schedule_acts_on(tmp_path):
    # The monitor's own average (beta 0.5 here) would differ from the schedule's (0.8): it logs the schedule's.
    from lightning.pytorch.loggers import CSVLogger

    from lightning_accum import AccumulationMonitor, keys

    schedule = adaptive()
    monitor = AccumulationMonitor(gradient_noise_scale=True, noise_scale_beta=0.5)
    logger = CSVLogger(str(tmp_path), name="csv")
    trainer = make_trainer(tmp_path, [AccumulationScheduler(schedule), monitor], logger=logger, max_epochs=1)
    trainer.fit(RegressionModel(lr=0.2), DataLoader(IndexedDataset(128), batch_size=4))
    logged = trainer.callback_metrics[keys.GRADIENT_NOISE_SCALE].item()
    assert logged == pytest.approx(schedule.estimator.value().gradient_noise_scale, rel=1e-6)
    assert monitor.noise_scale.value().windows == 0  # it kept no second average


class SkipsNonFiniteSteps(RegressionModel):
    """A user's guard: a step whose gradient is not finite is skipped. One micro-batch's loss is NaN."""

    def __init__(self, nan_batch: int | None) -> None:
        super().__init__(lr=0.2)
        self.nan_batch = nan_batch
        self.skipped_steps = 0

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if (self.current_epoch, batch_idx) == (0, self.nan_batch) else loss

    def on_before_optimizer_step(self, optimizer):
        if not all(torch.isfinite(p.grad).all() for p in self.parameters() if p.grad is not None):
            self.skipped_steps += 1
            optimizer.zero_grad(set_to_none=True)


def test_a_non_finite_window_is_skipped_and_counted_not_averaged_in(tmp_path):
    # Before: the NaN window made the average NaN for good; k froze at 2 where the clean run reached 8.
    from lightning_accum import AccumulationMonitor, keys

    runs = {}
    for nan_batch in (None, 9):
        schedule = adaptive()
        monitor = AccumulationMonitor(gradient_noise_scale=True)
        trainer = make_trainer(tmp_path / str(nan_batch), [AccumulationScheduler(schedule), monitor], max_epochs=2)
        model = SkipsNonFiniteSteps(nan_batch)
        trainer.fit(model, DataLoader(IndexedDataset(256), batch_size=4))
        logged = trainer.callback_metrics[keys.GRAD_SQ_NORM].item()  # what the monitor logs
        assert trainer.callback_metrics[keys.NOISE_SCALE_SKIPPED].item() == (0 if nan_batch is None else 1)
        runs[nan_batch] = (model, schedule, logged)
    (_, clean, _), (model, skipping, logged) = runs[None], runs[9]
    estimate = skipping.estimator.value()
    assert math.isfinite(estimate.grad_sq_norm) and math.isfinite(estimate.trace_cov) and math.isfinite(logged)
    # One skipped step moves the run a little off the clean one: k ends within the schedule's hysteresis of it.
    k_clean, k = clean.accumulation_steps(Progress()), skipping.accumulation_steps(Progress())
    assert k_clean == 8 and abs(k - k_clean) <= skipping.hysteresis * k_clean
    assert model.skipped_steps == estimate.skipped == 1 and clean.estimator.value().skipped == 0
    measurable = sum(len(indices) > 4 for indices in model.step_indices)  # windows of two micro-batches or more
    assert estimate.windows == measurable - 1  # every other window is averaged in


class _OnTwoRanks:
    """A Trainer as ``setup`` sees it on 2 ranks (the check needs no collective)."""

    world_size = 2

    def __init__(self, trainer) -> None:
        self._trainer = trainer

    def __getattr__(self, name):
        return getattr(self._trainer, name)


def test_syncing_every_micro_batch_on_several_ranks_is_refused_it_would_never_measure(tmp_path):
    # Syncing every micro-batch averages the first micro-batch over the ranks before it can be read: no window would
    # ever be measured, and k would stay at its minimum without a word.
    scheduler = AccumulationScheduler(adaptive(), sync_every_micro_batch=True)
    with pytest.raises(RuntimeError, match=r"sync_every_micro_batch=True\)` on 2 ranks would never adapt k"):
        scheduler.setup(_OnTwoRanks(make_trainer(tmp_path)), RegressionModel(), "fit")
    # On one process nothing is synced: it measures every window.
    schedule = adaptive()
    trainer = make_trainer(tmp_path, [AccumulationScheduler(schedule, sync_every_micro_batch=True)])
    trainer.fit(RegressionModel(lr=0.2), DataLoader(IndexedDataset(64), batch_size=4))
    # Every window measured (16 micro-batches: 8 steps at k=2, fewer where k grew on the last valid estimate).
    assert schedule.estimator.value().windows == trainer.global_step > 0


def test_the_minimum_defaults_to_two_micro_batches():
    # Issue 39: a minimum of 4 micro-batches of 8 sequences (32) lay above the char LM's noise scale (20 to 30
    # sequences), so with its defaults the schedule never moved k in any seed.
    assert AdaptiveBatchSize().min_k == 2
    # And it waits 20 windows, not 50: with max_growth=2, three doublings took 150 windows, more than a short run has.
    assert AdaptiveBatchSize().warmup_windows == 20


def test_a_window_that_leaves_the_smoothed_grad_sq_norm_negative_holds_the_last_valid_noise_scale():
    # Windows of 2 make |G|² noisy: while the smoothed |G|² is not positive, the target is the last valid one, and k
    # goes on following it (as the growth cap and the wait allow), instead of freezing where it stood.
    schedule = adaptive(warmup_windows=1, beta=0.0, max_accumulation_steps=16)
    schedule.observe(items=8.0, micro_batches=2, world_size=1, noise=(1.0, 24.0))  # B = 24: target 6, k 2 -> 4
    assert (schedule.accumulation_steps(Progress()), schedule.target) == (4, 6.0)
    schedule.observe(items=8.0, micro_batches=2, world_size=1, noise=(-0.5, 24.0))  # |G|² < 0: no noise scale
    assert math.isnan(schedule.estimator.value().gradient_noise_scale)
    assert (schedule.accumulation_steps(Progress()), schedule.target) == (6, 6.0)
    restored = adaptive(warmup_windows=1, beta=0.0, max_accumulation_steps=16)
    restored.load_state_dict(schedule.state_dict())
    assert restored.figures().target_accumulation_steps == 6.0


@pytest.mark.parametrize(
    ("noise", "setting", "bound", "where"),
    [((1.0, 2.0), "min_accumulation_steps", 2, "below"), ((1.0, 400.0), "max_accumulation_steps", 8, "above")],
)
def test_a_target_held_out_of_bounds_for_100_windows_is_said_once(caplog, noise, setting, bound, where):
    schedule = adaptive(warmup_windows=1, beta=0.0, max_growth=None)
    with caplog.at_level("INFO", logger="lightning_accum"):
        for _ in range(99):
            schedule.observe(items=8.0, micro_batches=2, world_size=1, noise=noise)
        assert not [r for r in caplog.records if setting in r.getMessage()]
        for _ in range(150):
            schedule.observe(items=8.0, micro_batches=2, world_size=1, noise=noise)
    notes = [r.getMessage() for r in caplog.records if setting in r.getMessage()]
    target = noise[1] / 4
    assert notes == [
        f"lightning_accum: AdaptiveBatchSize's target k has stayed {where} `{setting}` ({bound}) for 100 windows"
        f" (target {target:.3g}); `{setting}` holds k at {bound}: {'lower' if where == 'below' else 'raise'} it to"
        " let k follow the target."
    ]
