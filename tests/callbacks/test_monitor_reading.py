"""What a person reads while a run goes: which loss the progress bar shows, and what the summary says to do."""

from __future__ import annotations

import pytest
from torch.utils.data import DataLoader

from lightning_accum import AccumulationMonitor, AccumulationScheduler, keys
from lightning_accum.core.step_report import StepReport
from lightning_accum.monitor import window_loss
from lightning_accum.monitor.summary import FitSummary
from tests.helpers import IndexedDataset, RegressionModel, make_trainer


def test_the_progress_bar_shows_the_loss_optimized(tmp_path) -> None:
    # k=3 on 8 batches: the module's own loss would be one micro-batch's; the bar shows the window's.
    monitor = AccumulationMonitor()
    trainer = make_trainer(tmp_path, [AccumulationScheduler(3), monitor], max_steps=2)
    trainer.fit(RegressionModel(), DataLoader(IndexedDataset(24), batch_size=3))
    shown = trainer.progress_bar_metrics["window_loss"]
    assert shown == f"{float(trainer.callback_metrics[keys.WINDOW_LOSS]):.4g}"
    assert window_loss.progress_bar_loss(float("nan")) == {}  # no items yet: nothing, not "nan"


def _split_steps(imbalances: list[float]) -> FitSummary:
    summary = FitSummary()
    for step, imbalance in enumerate(imbalances):
        summary.add(StepReport("split", 4, 2, 16, 16.0, 16 * (step + 1), rank_imbalance=imbalance))
    return summary


@pytest.mark.parametrize(("imbalances", "hinted"), [([1.07, 1.07], True), ([1.01, 1.03], False)])
def test_a_slow_rank_in_the_summary_names_what_removes_it(imbalances: list[float], hinted: bool) -> None:
    text = _split_steps(imbalances).text()
    assert "slowest rank" in text
    assert ("BalancedBatchSampler" in text) is hinted, text
    assert text.endswith(".")
