"""``trainer.estimated_stepping_batches`` counts the optimizer steps a run really takes.

LR schedules (OneCycleLR, warm-up + cosine) are sized from it in ``configure_optimizers``. Lightning computes it as
``ceil(batches / accumulate_grad_batches) * max_epochs`` with the ``k`` the Trainer holds before the first batch,
which is 1 when a callback owns ``k``: 20 instead of 6 for 2 epochs of 10 batches at k=4.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_accum import AccumulationScheduler, AutoMicroBatching, BatchSizeRamp
from lightning_accum.core.stepping import count_optimizer_steps
from lightning_accum.schedules import ConstantSchedule, StepwiseSchedule
from tests.helpers import IndexedDataset, RegressionModel, make_trainer


class OneCycleModel(RegressionModel):
    """Sizes a OneCycleLR from ``estimated_stepping_batches``, as Lightning's docs show, and records both counts."""

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr)
        self.estimated = self.trainer.estimated_stepping_batches
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=self.lr, total_steps=self.estimated)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def fit(tmp_path, callback, *, n=40, batch_size=4, **trainer_kwargs):
    model = OneCycleModel()
    if isinstance(callback, AutoMicroBatching):
        model.split_mode = True
    trainer = make_trainer(tmp_path, [callback], **trainer_kwargs)
    trainer.fit(model, DataLoader(IndexedDataset(n), batch_size=batch_size))
    return model, trainer


@pytest.mark.parametrize(
    ("schedule", "unit", "n", "trainer_kwargs"),
    [
        (4, "epoch", 40, {"max_epochs": 2}),  # the issue's case: windows 4, 4, 2 per epoch -> 6 steps, not 20
        (4, "epoch", 40, {"max_epochs": 2, "limit_train_batches": 7}),  # 4, 3 per epoch
        (3, "epoch", 40, {"max_epochs": 3, "max_steps": 7}),  # max_steps cuts the run
        ({0: 1, 1: 2}, "epoch", 24, {"max_epochs": 3}),  # 6 + 3 + 3
        ({0: 2, 3: 3}, "step", 64, {"max_epochs": 1}),  # changes mid-epoch at step 3
        ({0: 1, 8: 2, 24: 4}, "sample", 50, {"max_epochs": 2}),  # the last micro-batch of each epoch holds 2
        (BatchSizeRamp(start=4, target=16, increment=4, ramp_samples=48), "epoch", 100, {"max_epochs": 2}),
    ],
)
def test_estimated_stepping_batches_equals_the_steps_taken(tmp_path, schedule, unit, n, trainer_kwargs):
    model, trainer = fit(tmp_path, AccumulationScheduler(schedule, unit=unit), n=n, **trainer_kwargs)
    assert model.estimated == trainer.global_step
    # The one-cycle schedule ends exactly at the last step: the LR annealed all the way down.
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    assert scheduler.last_epoch == scheduler.total_steps


def test_issue_figure_6_not_20(tmp_path):
    model, trainer = fit(tmp_path, AccumulationScheduler(4), n=40, max_epochs=2)
    assert (model.estimated, trainer.global_step) == (6, 6)


def test_schedule_none_adopts_the_trainer_k(tmp_path):
    model, trainer = fit(tmp_path, AccumulationScheduler(), n=40, max_epochs=2, accumulate_grad_batches=3)
    assert model.estimated == trainer.global_step == 8


def test_split_mode_counts_one_step_per_batch(tmp_path):
    model, trainer = fit(tmp_path, AutoMicroBatching(2), n=40, batch_size=8, max_epochs=2)
    assert model.estimated == trainer.global_step == 10


def test_the_trainer_is_itself_again_after_fit(tmp_path):
    scheduler = AccumulationScheduler(4)
    _, trainer = fit(tmp_path, scheduler, n=40, max_epochs=2)
    assert type(trainer) is pl.Trainer
    trainer.accumulate_grad_batches = 1  # what Lightning would now compute without the callback
    assert trainer.estimated_stepping_batches == 20


@pytest.mark.parametrize(
    ("schedule", "kwargs", "expected"),
    [
        (ConstantSchedule(4), {"batches_per_epoch": 10, "max_epochs": 2}, 6),
        (ConstantSchedule(1), {"batches_per_epoch": 10, "max_epochs": 3, "max_steps": 25}, 25),
        (StepwiseSchedule({0: 1, 3: 4}, unit="step"), {"batches_per_epoch": 10, "max_epochs": 1}, 3 + 2),
        # 2 samples per micro-batch: k=1 until 4 samples are consumed, then 3; epochs of 7 micro-batches.
        (
            StepwiseSchedule({0: 1, 4: 3}, unit="sample"),
            {"batches_per_epoch": 7, "max_epochs": 2, "micro_batch_size": 2},
            2 + 2 + (3),  # epoch 0: 1, 1, 3, 2 ; epoch 1: 3, 3, 1
        ),
        # Two ranks double the consumed samples: k=1 only for the first window.
        (
            StepwiseSchedule({0: 1, 4: 3}, unit="sample"),
            {"batches_per_epoch": 7, "max_epochs": 1, "micro_batch_size": 2, "world_size": 2},
            1 + 2,  # 1, 3, 3
        ),
    ],
)
def test_count_optimizer_steps(schedule, kwargs, expected):
    assert count_optimizer_steps(schedule, **kwargs) == expected
