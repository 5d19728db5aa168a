"""What a person reads while a run goes: which loss the progress bar shows, and what the summary says to do."""

from __future__ import annotations

import logging
import re
import sys

import pytest
from torch.utils.data import DataLoader

from lightning_accum import AccumulationMonitor, AccumulationScheduler, keys
from lightning_accum.core.step_report import StepReport
from lightning_accum.monitor import window_loss
from lightning_accum.monitor.status import StatusLine, status_text
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


def _fit_with_output(tmp_path, monkeypatch, caplog, *, terminal: bool) -> list[str]:
    monkeypatch.setattr(sys.stderr, "isatty", lambda: terminal)
    caplog.clear()
    monitor = AccumulationMonitor()
    trainer = make_trainer(tmp_path, [AccumulationScheduler(2), monitor], max_steps=3)
    with caplog.at_level(logging.INFO):
        trainer.fit(RegressionModel(), DataLoader(IndexedDataset(24), batch_size=3))
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("lightning_accum: step")]


def test_output_to_a_file_gets_a_status_line_now_and_then(tmp_path, monkeypatch, caplog) -> None:
    lines = _fit_with_output(tmp_path, monkeypatch, caplog, terminal=False)
    # The first logging step has one; the next two come within the minute.
    assert len(lines) == 1 and re.fullmatch(r"lightning_accum: step 0, [\d.,]+ samples/s, peak memory .*", lines[0])
    assert _fit_with_output(tmp_path, monkeypatch, caplog, terminal=True) == []  # a terminal has its progress bar


def test_a_status_line_is_due_once_per_interval() -> None:
    status = StatusLine(every_s=60.0)
    logged = {keys.SAMPLES_PER_SEC: 5.0, keys.PEAK_GIB: 2.0, keys.PEAK_FRACTION: 0.5, keys.BUDGET_FRACTION: 1.0}
    due = [status.line(step, logged, now=30.0 * step) is not None for step in range(5)]
    assert due == [True, False, True, False, True]
    assert status_text(7, logged) == "lightning_accum: step 7, 5.0 samples/s, peak memory 2 GiB (50% of the capacity)"


@pytest.mark.parametrize(
    ("fraction", "limit", "flagged"), [(1.02, "budget", True), (0.97, "budget", False), (1.02, "capacity", False)]
)
def test_a_peak_over_the_budget_reads_as_a_problem_in_the_summary(fraction: float, limit: str, flagged: bool) -> None:
    # Issue 36, item 4: "peak memory 102% of the budget" read like any other figure.
    summary = _split_steps([1.0])
    summary.add_peak(fraction, limit)
    text = summary.text()
    assert f"peak memory {fraction:.0%} of the {limit}" in text
    assert ("OVER the budget" in text and "Raise `max_memory` above the peak" in text) is flagged, text
