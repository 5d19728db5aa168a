"""What every callback of the package promises, checked alike for each (as torchmetrics' MetricTester does):

it constructs with its defaults, survives ``fit`` twice, and its state survives a real checkpoint: the state a
resumed run's fresh callback loads is the state that was saved, and an empty (older) checkpoint entry loads too.
"""

from __future__ import annotations

from collections.abc import Callable

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_accum import AccumulationMonitor, AccumulationScheduler, AutoMicroBatching
from tests.helpers import IndexedDataset, RegressionModel, make_trainer

FACTORIES: dict[str, tuple[Callable[[], pl.Callback], int, bool]] = {
    # name: (factory, dataloader batch size, split mode)
    "AccumulationScheduler": (lambda: AccumulationScheduler({0: 2, 2: 3}, unit="step"), 4, False),
    "AutoMicroBatching": (lambda: AutoMicroBatching(4, max_memory=0.9), 8, True),
    "AccumulationMonitor": (lambda: AccumulationMonitor(), 4, False),
}


def fit(tmp_path, callback: pl.Callback, batch_size: int, split: bool, **kwargs) -> pl.Trainer:
    model = RegressionModel()
    model.split_mode = split
    trainer = make_trainer(tmp_path, [callback], enable_checkpointing=True, **kwargs)
    trainer.fit(model, DataLoader(IndexedDataset(24), batch_size=batch_size))
    return trainer


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_fit_twice_and_the_state_survives_a_checkpoint(tmp_path, name):
    factory, batch_size, split = FACTORIES[name]
    callback = factory()
    first = fit(tmp_path / "a", callback, batch_size, split)
    fit(tmp_path / "b", callback, batch_size, split)  # the same callback object in a second Trainer
    saved = callback.state_dict()
    ckpt = tmp_path / "state.ckpt"
    first.save_checkpoint(ckpt)
    saved_in_ckpt = torch.load(ckpt, weights_only=False)["callbacks"].get(callback.state_key, {})

    fresh = factory()
    fresh.load_state_dict(saved_in_ckpt)
    if "consumed_samples" in saved:  # owners: what they count carries over a resume
        assert saved_in_ckpt.keys() == saved.keys()
        assert fresh.state_dict() == saved_in_ckpt
        assert saved_in_ckpt["consumed_samples"] == 48  # two fits of 24 samples, counted by the same callback
    else:  # the monitor's figures are per logging interval; the run's training time goes on after a resume
        assert saved_in_ckpt.keys() == {"train_seconds"} and saved_in_ckpt["train_seconds"] > 0
        assert fresh.state_dict() == saved_in_ckpt
    factory().load_state_dict({})  # an older checkpoint without our entries still loads


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_resuming_from_a_checkpoint_runs(tmp_path, name):
    factory, batch_size, split = FACTORIES[name]
    first = fit(tmp_path / "a", factory(), batch_size, split, max_epochs=1)
    ckpt = tmp_path / "epoch1.ckpt"
    first.save_checkpoint(ckpt)
    model = RegressionModel()
    model.split_mode = split
    trainer = make_trainer(tmp_path / "b", [factory()], max_epochs=2)
    trainer.fit(model, DataLoader(IndexedDataset(24), batch_size=batch_size), ckpt_path=ckpt)
    assert trainer.current_epoch == 2 and trainer.global_step > first.global_step


def test_the_monitors_noise_scale_average_survives_a_checkpoint(tmp_path):
    # With the noise scale on, the monitor carries a moving average over windows: a resumed run continues it.
    monitor = AccumulationMonitor(gradient_noise_scale=True)
    trainer = make_trainer(tmp_path, [AccumulationScheduler(2), monitor], enable_checkpointing=True)
    trainer.fit(RegressionModel(), DataLoader(IndexedDataset(24), batch_size=4))
    ckpt = tmp_path / "state.ckpt"
    trainer.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=False)["callbacks"][monitor.state_key]
    assert saved["noise_scale"]["windows"] == trainer.global_step == 3

    fresh = AccumulationMonitor(gradient_noise_scale=True)
    fresh.load_state_dict(saved)
    assert fresh.state_dict() == saved
    assert fresh.noise_scale.value() == monitor.noise_scale.value()
