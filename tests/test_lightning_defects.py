"""The defects of plain Lightning 2.6 that window mode exists to fix, measured side by side with the fix.

Each test runs the same training twice, without and with ``AccumulationScheduler``, and compares every optimizer
step's gradient with the exact full-window gradient. The "without" figures document the upstream behaviour: if
Lightning fixes it, these tests say so.
"""

from __future__ import annotations

import copy

import pytest
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

from lightning_accum import AccumulationScheduler
from tests.helpers import IndexedDataset, RegressionModel, grad_ratio, make_trainer, mse_loss, replay_reference


def step_ratios(tmp_path, callbacks, n=40, **trainer_kwargs):
    """Window sizes (in micro-batches) and each step's gradient as a multiple of the exact window gradient."""
    dataset = IndexedDataset(n)
    # Identical samples and lr=0: every micro-batch has the same gradient, so each ratio is a pure scale factor.
    dataset.x[:] = dataset.x[0]
    dataset.y[:] = dataset.y[0]
    model = RegressionModel(lr=0.0)
    initial = copy.deepcopy(model)
    make_trainer(tmp_path, callbacks, **trainer_kwargs).fit(model, DataLoader(dataset, batch_size=4))
    expected = replay_reference(initial, dataset, model.step_indices, mse_loss, lr=0.0)
    windows = [len(i) // 4 for i in model.step_indices]
    return windows, [round(grad_ratio(a, e), 3) for a, e in zip(model.step_grads, expected, strict=False)]


def test_short_tail_window(tmp_path):
    # 10 micro-batches, k=4: Lightning divides the 2-batch tail window by 4.
    windows, ratios = step_ratios(tmp_path, [], accumulate_grad_batches=4)
    assert windows == [4, 4, 2]
    assert ratios == [1.0, 1.0, 0.5]

    windows, ratios = step_ratios(tmp_path, [AccumulationScheduler(4)])
    assert windows == [4, 4, 2]
    assert ratios == [1.0, 1.0, 1.0]


class _SwitchK(Callback):
    """What a user would write today: change ``trainer.accumulate_grad_batches`` in the middle of an epoch."""

    def __init__(self, batch_idx: int, k: int, hook: str) -> None:
        self.batch_idx, self.k, self.hook = batch_idx, k, hook

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.hook == "start" and batch_idx == self.batch_idx:
            trainer.accumulate_grad_batches = self.k

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.hook == "end" and batch_idx == self.batch_idx:
            trainer.accumulate_grad_batches = self.k


def test_changing_k_mid_epoch_at_batch_start(tmp_path):
    # k 4 -> 3 as batch 5 starts: Lightning's modular step decision closes a 2-batch window whose halves were
    # divided by 4 and by 3: 1/4 + 1/3 = 0.583 of the exact gradient.
    windows, ratios = step_ratios(tmp_path, [_SwitchK(5, 3, "start")], n=48, accumulate_grad_batches=4)
    assert windows == [4, 2, 3, 3]
    assert ratios == [1.0, round(1 / 4 + 1 / 3, 3), 1.0, 1.0]

    # The same change through the scheduler lands on the next window boundary and every step is exact.
    windows, ratios = step_ratios(tmp_path, [AccumulationScheduler({0: 4, 1: 3}, unit="step")], n=48)
    assert windows == [4, 3, 3, 2]
    assert ratios == [1.0] * 4


def test_changing_k_mid_epoch_after_a_batch_drops_samples(tmp_path):
    # k 4 -> 3 after batch 5: the window runs batches 4..8, but `batch_idx % k == 0` zeroes the gradient at batch
    # 6, so batches 4 and 5 are silently lost. With distinct samples the step is the mean of the last 3 only.
    dataset = IndexedDataset(48)
    model = RegressionModel(lr=0.0)
    trainer = make_trainer(tmp_path, [_SwitchK(5, 3, "end")], accumulate_grad_batches=4)
    trainer.fit(model, DataLoader(dataset, batch_size=4))
    window = model.step_indices[1]
    assert len(window) == 5 * 4
    kept = replay_reference(model, dataset, [window[8:]], mse_loss, lr=0.0)[0]
    exact = replay_reference(model, dataset, [window], mse_loss, lr=0.0)[0]
    assert grad_ratio(model.step_grads[1], kept) == pytest.approx(1.0, abs=1e-4)
    assert grad_ratio(model.step_grads[1], exact) != pytest.approx(1.0, abs=0.05)
