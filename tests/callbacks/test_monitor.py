"""AccumulationMonitor: every contract key at every optimizer step, with the right values, to every logger.

Real offline W&B runs are read back from disk with our own reader; CSVLogger sees the same keys in the same run.
"""

from __future__ import annotations

import csv
import math
import re
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import yaml
from lightning.pytorch.loggers import CSVLogger, WandbLogger
from lightning_utilities.core.imports import RequirementCache
from torch import nn
from torch.utils.data import DataLoader

from lightning_accum import AccumulationScheduler, keys
from lightning_accum.callbacks._owner import AccumulationOwner
from lightning_accum.callbacks.accumulation_monitor import AccumulationMonitor
from lightning_accum.core.step_report import AccumulationEvent, StepReport
from lightning_accum.integrations.wandb import CONFIG_KEY, STEP_METRIC, read_offline_run
from lightning_accum.memory.backends import backend_for
from lightning_accum.monitor.rows import BUDGET_FRACTION
from tests.helpers import IndexedDataset, RegressionModel, ddp_strategy, make_trainer

_LIGHTNING_BEFORE_2_5 = not RequirementCache("lightning>=2.5")
GIB = 1024**3
# What a CPU run logs at every optimizer step (no reserved pool on CPU; events only when they happen).
EVERY_STEP_KEYS = (set(keys.ALL_KEYS) - {keys.PEAK_RESERVED_GIB, keys.ALLOC_RETRIES}) | {BUDGET_FRACTION}


def read_csv(log_dir: str | Path) -> dict[int, dict[str, float]]:
    """CSVLogger's metrics.csv as step -> {key: value}, merging the rows of one step."""
    rows: dict[int, dict[str, float]] = {}
    with open(Path(log_dir) / "metrics.csv") as f:
        for row in csv.DictReader(f):
            values = {k: float(v) for k, v in row.items() if v not in ("", None) and k != "step"}
            rows.setdefault(int(row["step"]), {}).update(values)
    return rows


def wandb_steps(run: Any) -> dict[int, dict[str, Any]]:
    """History rows that hold monitor metrics, by optimizer step (asserting each step is logged once)."""
    by_step: dict[int, dict[str, Any]] = {}
    for row in run.history:
        if keys.EFFECTIVE_BATCH_SIZE in row:
            step = int(row[STEP_METRIC])
            assert step not in by_step, f"step {step} logged twice"
            by_step[step] = row
    return by_step


def fit(tmp_path, callbacks, loggers, *, n=40, batch_size=4, max_epochs=2, **trainer_kwargs) -> pl.Trainer:
    trainer = make_trainer(tmp_path, callbacks, logger=loggers, max_epochs=max_epochs, **trainer_kwargs)
    trainer.fit(RegressionModel(), DataLoader(IndexedDataset(n), batch_size=batch_size))
    return trainer


def monitor_with_owner(owner: str, k: int) -> tuple[list[pl.Callback], dict[str, Any]]:
    """A monitor with accumulation over ``k`` batches owned by an `AccumulationScheduler` ("scheduler") or by
    Lightning's own ``accumulate_grad_batches`` ("plain"): the callbacks and the extra Trainer arguments."""
    callbacks: list[pl.Callback] = [AccumulationMonitor()]
    kwargs: dict[str, Any] = {}
    if owner == "scheduler":
        callbacks.insert(0, AccumulationScheduler(k))
    else:
        kwargs["accumulate_grad_batches"] = k
    return callbacks, kwargs


def finish_wandb() -> None:
    import wandb

    wandb.finish()


def assert_memory_figures(row: dict[str, Any], capacity_bytes: int) -> None:
    assert 0 < row[keys.PEAK_GIB] <= row[keys.CAPACITY_GIB]
    assert row[keys.CAPACITY_GIB] == pytest.approx(capacity_bytes / GIB)
    assert row[keys.PEAK_FRACTION] == pytest.approx(row[keys.PEAK_GIB] / row[keys.CAPACITY_GIB])


# ----------------------------------------------------------------------------------------------------------------
# window mode, W&B and CSV in the same run
# ----------------------------------------------------------------------------------------------------------------
def test_window_mode_logs_every_key_at_every_step_to_wandb_and_csv(tmp_path, wandb_offline):
    b, k, n, epochs = 4, 2, 40, 2
    wandb_logger = WandbLogger(project="accum", save_dir=str(tmp_path))
    csv_logger = CSVLogger(str(tmp_path), name="csv")
    trainer = fit(tmp_path, [AccumulationScheduler(k), AccumulationMonitor()], [wandb_logger, csv_logger], n=n)
    finish_wandb()

    steps = n // (b * k) * epochs
    assert trainer.global_step == steps
    run = read_offline_run(tmp_path / "wandb", wait_s=10)
    logged = wandb_steps(run)
    assert sorted(logged) == list(range(steps))  # Lightning's step axis: the first optimizer step is 0
    capacity = backend_for("cpu").capacity_bytes()
    for step, row in logged.items():
        assert EVERY_STEP_KEYS <= row.keys(), f"step {step} misses {EVERY_STEP_KEYS - row.keys()}"
        assert row[keys.EFFECTIVE_BATCH_SIZE] == b * k
        assert row[keys.MICRO_BATCH_SIZE] == b
        assert row[keys.ACCUMULATION_STEPS] == k
        assert row[keys.ITEMS_PER_STEP] == b * k
        assert row[keys.OOM_RETRIES] == 0
        assert row[BUDGET_FRACTION] == 1.0
        assert row[keys.SAMPLES_PER_SEC] > 0 and row[keys.ITEMS_PER_SEC] == pytest.approx(row[keys.SAMPLES_PER_SEC])
        assert math.isfinite(row[keys.WINDOW_LOSS])
        assert_memory_figures(row, capacity)
    # A constant schedule never changes k: its first k is where the run starts, not an event.
    assert not any(keys.EVENT_SCHEDULE_CHANGE in logged[s] for s in range(steps))

    # Memory peaks are summarised by their maximum, the rest by their last value.
    assert run.summary[keys.PEAK_GIB] == {"max": max(r[keys.PEAK_GIB] for r in logged.values())}
    assert run.summary[keys.PEAK_FRACTION] == {"max": max(r[keys.PEAK_FRACTION] for r in logged.values())}
    assert run.summary[keys.EFFECTIVE_BATCH_SIZE] == b * k
    assert run.metrics[keys.PEAK_GIB] == {"step_metric": STEP_METRIC, "summary": ["max"]}
    assert run.config[CONFIG_KEY]["mode"] == "window"
    assert run.config[CONFIG_KEY]["world_size"] == 1
    assert run.config[CONFIG_KEY]["monitor_logging_interval"] == 1

    # CSVLogger saw the same keys with the same values at the same steps.
    csv_rows = read_csv(csv_logger.log_dir)
    for step, row in logged.items():
        assert EVERY_STEP_KEYS <= csv_rows[step].keys()
        for key in EVERY_STEP_KEYS:
            assert csv_rows[step][key] == pytest.approx(row[key], rel=1e-6), (step, key)


def test_plain_lightning_accumulation_is_counted_from_the_batches(tmp_path, wandb_offline):
    # No accumulation callback: 10 micro-batches of 4 per epoch with k=3 make windows of 3, 3, 3 and a 1-batch tail.
    b, k = 4, 3
    wandb_logger = WandbLogger(project="accum", save_dir=str(tmp_path))
    trainer = fit(tmp_path, [AccumulationMonitor()], [wandb_logger], accumulate_grad_batches=k)
    finish_wandb()

    windows = [3, 3, 3, 1] * 2
    assert trainer.global_step == len(windows)
    logged = wandb_steps(read_offline_run(tmp_path / "wandb", wait_s=10))
    assert [logged[s][keys.ACCUMULATION_STEPS] for s in sorted(logged)] == windows
    assert [logged[s][keys.EFFECTIVE_BATCH_SIZE] for s in sorted(logged)] == [w * b for w in windows]
    assert [logged[s][keys.ITEMS_PER_STEP] for s in sorted(logged)] == [w * b for w in windows]
    for row in logged.values():
        assert EVERY_STEP_KEYS <= row.keys()
        assert row[keys.MICRO_BATCH_SIZE] == b
        assert not any(key in row for key in keys.EVENT_KEYS)


# ----------------------------------------------------------------------------------------------------------------
# window loss
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("owner", ["scheduler", "plain"])
def test_window_loss_is_the_item_weighted_mean_over_uneven_micro_batches(tmp_path, owner):
    # 10 samples in micro-batches of 4, 4 and 2 make one window (k=3), seen by the initial parameters.
    n, b, k = 10, 4, 3
    dataset = IndexedDataset(n)
    model = RegressionModel()
    with torch.no_grad():
        expected = nn.functional.mse_loss(model.layer(dataset.x), dataset.y).item()
        chunks = [
            (
                nn.functional.mse_loss(model.layer(dataset.x[i : i + b]), dataset.y[i : i + b]).item(),
                len(dataset.x[i : i + b]),
            )
            for i in range(0, n, b)
        ]
    mean_of_means = sum(loss for loss, _ in chunks) / len(chunks)
    assert abs(mean_of_means - expected) > 1e-3 * expected  # the case tells the right answer from the common wrong one
    assert expected == pytest.approx(sum(loss * m for loss, m in chunks) / n)

    callbacks, kwargs = monitor_with_owner(owner, k)
    csv_logger = CSVLogger(str(tmp_path), name="csv")
    trainer = make_trainer(tmp_path, callbacks, logger=csv_logger, max_epochs=1, **kwargs)
    trainer.fit(model, DataLoader(dataset, batch_size=b))

    rows = read_csv(csv_logger.log_dir)
    assert rows[0][keys.WINDOW_LOSS] == pytest.approx(expected, rel=1e-6)
    assert rows[0][keys.EFFECTIVE_BATCH_SIZE] == n


class SumLossModel(RegressionModel):
    """Returns the *sum* of squared errors over the micro-batch (``loss_reduction="sum"``)."""

    def training_step(self, batch, batch_idx):
        return nn.functional.mse_loss(self.layer(batch["x"]), batch["y"], reduction="sum")


def test_window_loss_with_sum_reduction_and_an_item_counter(tmp_path):
    # Items are "samples with an even index": the window loss is the sum over all samples divided by those items.
    n, b, k = 10, 4, 3
    dataset = IndexedDataset(n)
    model = SumLossModel()
    with torch.no_grad():
        total = nn.functional.mse_loss(model.layer(dataset.x), dataset.y, reduction="sum").item()
    n_items = sum(1 for i in range(n) if i % 2 == 0)

    def count_even(batch):
        return (batch["index"] % 2 == 0).sum()

    scheduler = AccumulationScheduler(k, count_items=count_even, loss_reduction="sum")
    csv_logger = CSVLogger(str(tmp_path), name="csv")
    trainer = make_trainer(tmp_path, [scheduler, AccumulationMonitor()], logger=csv_logger, max_epochs=1)
    trainer.fit(model, DataLoader(dataset, batch_size=b))

    row = read_csv(csv_logger.log_dir)[0]
    assert row[keys.WINDOW_LOSS] == pytest.approx(total / n_items, rel=1e-6)
    assert row[keys.ITEMS_PER_STEP] == n_items
    assert row[keys.EFFECTIVE_BATCH_SIZE] == n


# ----------------------------------------------------------------------------------------------------------------
# an owner in split mode (a stand-in for AutoMicroBatching): what it provides is what is logged
# ----------------------------------------------------------------------------------------------------------------
class SplitModeOwner(AccumulationOwner):
    """Publishes step reports the way split mode does: k from memory, OOMs, its own window loss and budget."""

    def __init__(self) -> None:
        super().__init__(count_items=None, loss_reduction="mean")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step - 1  # the step that just ended
        if step == 1:
            self.oom_retries += 1
            self._record(AccumulationEvent("oom_recovered", step, 4, 2, "CUDA out of memory"))
        report = StepReport(
            mode="split",
            micro_batch_size=2,
            accumulation_steps=4 if step == 0 else 2,
            effective_batch_size=8,
            items=16.0,  # tokens
            consumed_samples=8 * (step + 1),
            oom_retries=self.oom_retries,
            loss_sum=3.0 * (step + 1),  # local sum over the items of this rank
            loss_items=6.0,
            events=self._take_events(),
            budget_bytes=0.5 * backend_for("cpu").capacity_bytes(),
        )
        self._publish(report)


def test_owner_state_is_logged_as_is_with_events_and_its_window_loss(tmp_path):
    csv_logger = CSVLogger(str(tmp_path), name="csv")
    fit(tmp_path, [SplitModeOwner(), AccumulationMonitor()], csv_logger, n=12, batch_size=4, max_epochs=1)

    rows = read_csv(csv_logger.log_dir)
    assert sorted(rows) == [0, 1, 2]
    assert [rows[s][keys.ACCUMULATION_STEPS] for s in (0, 1, 2)] == [4, 2, 2]
    assert [rows[s][keys.OOM_RETRIES] for s in (0, 1, 2)] == [0, 1, 1]
    assert [rows[s][keys.WINDOW_LOSS] for s in (0, 1, 2)] == pytest.approx([3.0 / 6, 6.0 / 6, 9.0 / 6])
    for row in rows.values():
        assert row[keys.EFFECTIVE_BATCH_SIZE] == 8
        assert row[keys.ITEMS_PER_STEP] == 16
        assert row[BUDGET_FRACTION] == pytest.approx(0.5)
        assert row[keys.ITEMS_PER_SEC] == pytest.approx(2 * row[keys.SAMPLES_PER_SEC])
    assert rows[1][keys.EVENT_OOM_RECOVERED] == 2
    assert keys.EVENT_OOM_RECOVERED not in rows[0] and keys.EVENT_OOM_RECOVERED not in rows[2]
    # The log line is the owner's to write (AutoMicroBatching logs each event as it happens), not the monitor's.


# ----------------------------------------------------------------------------------------------------------------
# logging interval, memory reset, contract
# ----------------------------------------------------------------------------------------------------------------
def test_logging_interval_logs_every_nth_step_with_throughput_over_the_interval(tmp_path):
    csv_logger = CSVLogger(str(tmp_path), name="csv")
    trainer = fit(tmp_path, [AccumulationScheduler(2), AccumulationMonitor(logging_interval=2)], csv_logger)
    rows = read_csv(csv_logger.log_dir)
    assert sorted(rows) == list(range(1, trainer.global_step, 2))  # the 2nd, 4th, ... step: 1, 3, ...
    for row in rows.values():
        assert EVERY_STEP_KEYS <= row.keys()
        assert row[keys.EFFECTIVE_BATCH_SIZE] == 8


class AllocatesAtStep(RegressionModel):
    """Holds a large, touched tensor during one optimizer step, so that step's peak resident set stands out."""

    def __init__(self, step: int, n_bytes: int, rank: int = 0) -> None:
        super().__init__()
        self.spike_step, self.n_bytes, self.spike_rank = step, n_bytes, rank

    def training_step(self, batch, batch_idx):
        if self.global_step == self.spike_step and self.global_rank == self.spike_rank:
            block = torch.ones(self.n_bytes // 4)  # ones, not empty: only touched pages count in the resident set
            del block
        return super().training_step(batch, batch_idx)


def test_peak_is_reset_at_each_logging_step(tmp_path):
    spike = 512 * 1024**2
    csv_logger = CSVLogger(str(tmp_path), name="csv")
    trainer = make_trainer(tmp_path, [AccumulationScheduler(2), AccumulationMonitor()], logger=csv_logger)
    trainer.fit(AllocatesAtStep(step=2, n_bytes=spike), DataLoader(IndexedDataset(40), batch_size=4))
    peaks = {s: r[keys.PEAK_GIB] for s, r in read_csv(csv_logger.log_dir).items()}
    # The spike happens in the third optimizer step (global_step 2 while it runs), logged at step 2.
    assert peaks[2] - peaks[1] > 0.8 * spike / GIB
    assert peaks[2] - peaks[3] > 0.8 * spike / GIB  # reset: the next interval no longer holds it


@pytest.mark.parametrize(
    ("interval", "error", "match"),
    [
        (0, ValueError, r"`logging_interval` must be >= 1.*got 0"),
        ("2", TypeError, r"`logging_interval` must be an int.*'2'"),
        (True, TypeError, "must be an int"),
    ],
)
def test_bad_logging_interval_raises_a_clear_error(interval, error, match):
    with pytest.raises(error, match=match):
        AccumulationMonitor(logging_interval=interval)


# ----------------------------------------------------------------------------------------------------------------
# DDP: global totals and the largest peak of any rank
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.ddp
@pytest.mark.timeout(180)
@pytest.mark.parametrize("owner", ["scheduler", "plain"])
def test_ddp_logs_global_totals_and_the_max_peak_over_ranks(tmp_path, owner):
    b, k, world = 4, 2, 2
    spike = 512 * 1024**2
    callbacks, kwargs = monitor_with_owner(owner, k)
    callbacks[-1] = AccumulationMonitor(per_rank_memory=True)
    # A fixed version: the spawned rank 0 writes the file, and the parent would otherwise resolve the next version.
    csv_logger = CSVLogger(str(tmp_path), name="csv", version="ddp")
    strategy = ddp_strategy()
    trainer = make_trainer(tmp_path, callbacks, logger=csv_logger, strategy=strategy, devices=world, **kwargs)
    # 32 samples: 16 per rank, 4 micro-batches, 2 windows of k=2 per rank. Only rank 1 allocates, in the 2nd step.
    trainer.fit(AllocatesAtStep(step=1, n_bytes=spike, rank=1), DataLoader(IndexedDataset(32), batch_size=b))

    rows = read_csv(csv_logger.log_dir)
    assert sorted(rows) == [0, 1]
    for row in rows.values():
        assert EVERY_STEP_KEYS <= row.keys()
        assert row[keys.EFFECTIVE_BATCH_SIZE] == b * k * world
        assert row[keys.ITEMS_PER_STEP] == b * k * world
        assert row[keys.MICRO_BATCH_SIZE] == b
        assert row[keys.ACCUMULATION_STEPS] == k
        assert 0 < row[keys.PEAK_GIB] <= row[keys.CAPACITY_GIB]
    # Rank 0 (the one that logs) never held the block: the logged peak is rank 1's.
    assert rows[1][keys.PEAK_GIB] - rows[0][keys.PEAK_GIB] > 0.8 * spike / GIB
    # per_rank_memory: each rank's own peak, gathered; the block shows on rank 1 only, in the 2nd step.
    assert rows[1]["memory/rank1/peak_gib"] == rows[1][keys.PEAK_GIB]
    assert rows[1]["memory/rank1/peak_gib"] - rows[1]["memory/rank0/peak_gib"] > 0.8 * spike / GIB
    assert rows[0]["memory/rank1/peak_gib"] - rows[0]["memory/rank0/peak_gib"] < 0.2 * spike / GIB
    # The end-of-fit summary counts the samples of every rank, also when plain Lightning counts from the batches.
    summary = yaml.safe_load((Path(csv_logger.log_dir) / "hparams.yaml").read_text())["lightning_accum_summary"]
    assert (summary["steps"], summary["samples"]) == (2, 32)


# ----------------------------------------------------------------------------------------------------------------
# split mode with the real AutoMicroBatching
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
def test_split_mode_with_auto_micro_batching(tmp_path, loss_reduction):
    from lightning_accum.callbacks.auto_micro_batching import AutoMicroBatching

    # Step batches of 10 cut into micro-batches of 4, 4 and 2: the window loss is the item-weighted mean over all 10.
    n, step_batch, micro = 10, 10, 4
    dataset = IndexedDataset(n)
    model = RegressionModel() if loss_reduction == "mean" else SumLossModel()
    with torch.no_grad():
        expected = nn.functional.mse_loss(model.layer(dataset.x), dataset.y).item()
    owner = AutoMicroBatching(micro, max_memory=0.5, loss_reduction=loss_reduction)
    csv_logger = CSVLogger(str(tmp_path), name="csv")
    trainer = make_trainer(tmp_path, [owner, AccumulationMonitor()], logger=csv_logger, max_epochs=1)
    trainer.fit(model, DataLoader(dataset, batch_size=step_batch))

    row = read_csv(csv_logger.log_dir)[0]
    assert EVERY_STEP_KEYS <= row.keys()
    assert row[keys.WINDOW_LOSS] == pytest.approx(expected, rel=1e-5)
    assert row[keys.EFFECTIVE_BATCH_SIZE] == n and row[keys.ITEMS_PER_STEP] == n
    assert row[keys.MICRO_BATCH_SIZE] == micro and row[keys.ACCUMULATION_STEPS] == 3
    assert row[BUDGET_FRACTION] == pytest.approx(0.5)
    assert 0 < row[keys.PEAK_GIB] <= row[keys.CAPACITY_GIB]


# ----------------------------------------------------------------------------------------------------------------
# Lightning's step axis, callback_metrics, the short tail window (issue 9, items 2, 3 and 7)
# ----------------------------------------------------------------------------------------------------------------
class LogsItsLoss(RegressionModel):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train/loss", loss, on_step=True, on_epoch=False)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


@pytest.mark.parametrize("log_every_n_steps", [1, 2])
def test_the_monitor_logs_on_lightnings_step_axis(tmp_path, log_every_n_steps):
    # `self.log` and LearningRateMonitor write the first optimizer step at step 0; the monitor's row for an optimizer
    # step must be the same row. With k=1 the window loss of a step is the loss `self.log` saw in that step.
    from lightning.pytorch.callbacks import LearningRateMonitor, ThroughputMonitor

    csv_logger = CSVLogger(str(tmp_path), name="csv")
    throughput = ThroughputMonitor(batch_size_fn=lambda batch: len(batch["x"]))
    callbacks = [AccumulationScheduler(1), AccumulationMonitor(), LearningRateMonitor(), throughput]
    trainer = make_trainer(tmp_path, callbacks, logger=csv_logger, max_epochs=1, log_every_n_steps=log_every_n_steps)
    trainer.fit(LogsItsLoss(), DataLoader(IndexedDataset(24), batch_size=4))
    rows = read_csv(csv_logger.log_dir)
    monitor_steps = sorted(s for s, r in rows.items() if keys.WINDOW_LOSS in r)
    user_steps = sorted(s for s, r in rows.items() if "train/loss" in r)
    lr_steps = sorted(s for s, r in rows.items() if "lr-SGD" in r)
    throughput_steps = sorted(s for s, r in rows.items() if "train/samples" in r)
    expected = list(range(log_every_n_steps - 1, 6, log_every_n_steps))
    assert monitor_steps == user_steps == lr_steps == throughput_steps == expected
    # ThroughputMonitor counts samples up to the step it logs at; so does the monitor (4 per step).
    for step in monitor_steps:
        assert rows[step]["train/samples"] == 4 * (step + 1)
    if log_every_n_steps == 1:  # (a longer interval's window loss covers the whole interval)
        for step in monitor_steps:
            assert rows[step][keys.WINDOW_LOSS] == pytest.approx(rows[step]["train/loss"], rel=1e-6)


def test_the_default_interval_follows_log_every_n_steps(tmp_path):
    csv_logger = CSVLogger(str(tmp_path), name="csv")
    trainer = make_trainer(tmp_path, [AccumulationMonitor()], logger=csv_logger, log_every_n_steps=3)
    trainer.fit(RegressionModel(), DataLoader(IndexedDataset(40), batch_size=4))
    rows = read_csv(csv_logger.log_dir)
    assert sorted(s for s, row in rows.items() if keys.EFFECTIVE_BATCH_SIZE in row) == [2, 5, 8]


def test_monitor_metrics_reach_callback_metrics_and_model_checkpoint(tmp_path):
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor=keys.WINDOW_LOSS, mode="min", every_n_train_steps=1)
    early_stopping = EarlyStopping(monitor=keys.WINDOW_LOSS, check_on_train_epoch_end=True, patience=100)
    trainer = make_trainer(
        tmp_path,
        [AccumulationScheduler(2), AccumulationMonitor(), checkpoint, early_stopping],
        logger=CSVLogger(str(tmp_path), name="csv"),
        enable_checkpointing=True,
        max_epochs=2,
    )
    trainer.fit(RegressionModel(), DataLoader(IndexedDataset(40), batch_size=4))
    metrics = trainer.callback_metrics
    assert EVERY_STEP_KEYS <= metrics.keys()
    assert float(metrics[keys.EFFECTIVE_BATCH_SIZE]) == 8
    # ModelCheckpoint really watched the window loss: it kept the best of every step's value.
    assert checkpoint.best_model_path.endswith(".ckpt")
    assert math.isfinite(float(checkpoint.best_model_score))
    # EarlyStopping saw it at each epoch end (its initial best is +inf); the best of every step is at most that.
    assert math.isfinite(float(early_stopping.best_score))
    assert float(checkpoint.best_model_score) <= float(early_stopping.best_score)


def test_accumulation_steps_is_the_steps_own_count_on_a_short_tail(tmp_path):
    # 10 micro-batches at k=4: windows of 4, 4 and 2; the tail step had 2 micro-batches, not the planned 4.
    csv_logger = CSVLogger(str(tmp_path), name="csv")
    fit(tmp_path, [AccumulationScheduler(4), AccumulationMonitor()], csv_logger, n=40, max_epochs=1)
    rows = read_csv(csv_logger.log_dir)
    assert [rows[s][keys.ACCUMULATION_STEPS] for s in sorted(rows)] == [4, 4, 2]
    assert [rows[s][keys.EFFECTIVE_BATCH_SIZE] for s in sorted(rows)] == [16, 16, 8]


def test_the_target_is_the_schedules_k_on_a_short_tail_and_the_samples_seen_go_on_after_a_resume(tmp_path):
    # Issue 39: the tail's 2 micro-batches read as a drop of k; the target says the schedule still asks for 4. The
    # samples (and items) seen count from the start of training, all ranks, and a checkpoint carries them.
    csv_logger = CSVLogger(str(tmp_path), name="csv")
    trainer = fit(tmp_path, [AccumulationScheduler(4), AccumulationMonitor()], csv_logger, n=40, max_epochs=1)
    rows = read_csv(csv_logger.log_dir)
    assert [rows[s][keys.TARGET_ACCUMULATION_STEPS] for s in sorted(rows)] == [4, 4, 4]
    assert [rows[s][keys.SAMPLES_SEEN] for s in sorted(rows)] == [16, 32, 40]
    assert [rows[s][keys.ITEMS_SEEN] for s in sorted(rows)] == [16, 32, 40]
    assert not set(keys.GOODPUT_KEYS) & rows[0].keys()  # a fixed schedule weighs no goodput
    ckpt = tmp_path / "one_epoch.ckpt"
    trainer.save_checkpoint(ckpt)
    resumed_logger = CSVLogger(str(tmp_path), name="resumed")
    resumed = make_trainer(
        tmp_path, [AccumulationScheduler(4), AccumulationMonitor()], logger=resumed_logger, max_epochs=2
    )
    resumed.fit(RegressionModel(), DataLoader(IndexedDataset(40), batch_size=4), ckpt_path=ckpt)
    rows = read_csv(resumed_logger.log_dir)
    assert [rows[s][keys.SAMPLES_SEEN] for s in sorted(rows)] == [56, 72, 80]


def test_the_wandb_run_config_holds_every_setting(tmp_path, wandb_offline):
    # Issue 9, item 19: every argument of the owner, the budget as given and in bytes, and the schedule's real unit.
    from lightning_accum import AutoMicroBatching, BatchSizeRamp

    split = AutoMicroBatching(4, max_memory="20GiB", grow_patience=7, low_watermark=0.6, oom_cooldown=11)
    ramp = AccumulationScheduler(BatchSizeRamp(start=4, target=8, increment=4, ramp_samples=16))
    for name, owner, batch_size in (("split", split, 8), ("window", ramp, 4)):
        wandb_logger = WandbLogger(project="accum", name=name, save_dir=str(tmp_path / name))
        model = RegressionModel()
        model.split_mode = name == "split"
        trainer = make_trainer(tmp_path / name, [owner, AccumulationMonitor()], logger=wandb_logger)
        trainer.fit(model, DataLoader(IndexedDataset(16), batch_size=batch_size))
        finish_wandb()
        config = read_offline_run(tmp_path / name / "wandb", wait_s=10).config[CONFIG_KEY]
        if name == "split":
            assert config["max_memory"] == "20GiB" and config["budget_bytes"] == 20 * 2**30
            expected = {"grow_patience": 7, "low_watermark": 0.6, "oom_cooldown": 11, "predictive": True}
            expected |= {"pin_micro_batch_size": False, "min_micro_batch_size": 1, "gradient_sync": "deferred"}
            expected |= {"micro_batch_size": 4, "count_items": "samples", "loss_reduction": "mean"}
            assert expected.items() <= config.items()
        else:
            assert config["unit"] == "sample"
            assert config["schedule"].startswith("BatchSizeRamp(start=4, target=8")


# ----------------------------------------------------------------------------------------------------------------
# what a user sees while it runs and at the end (issue 14, items 1 and 2)
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bar", ["tqdm", "rich"])
@pytest.mark.parametrize("budget", [True, False])
def test_the_progress_bar_shows_the_micro_batch_k_and_memory(tmp_path, bar, budget):
    # Issue 19, item 8: the label says what the memory figure is a fraction of (`mem=0.98` did not).
    from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar

    from lightning_accum import AutoMicroBatching

    progress = TQDMProgressBar() if bar == "tqdm" else RichProgressBar()
    model = RegressionModel()
    model.split_mode = budget
    owner = AutoMicroBatching(4, max_memory=0.5) if budget else AccumulationScheduler(4)
    label = "mem/budget" if budget else "mem/capacity"
    trainer = make_trainer(tmp_path, [owner, AccumulationMonitor(), progress], enable_progress_bar=True)
    trainer.fit(model, DataLoader(IndexedDataset(32), batch_size=16 if budget else 4))
    shown = progress.get_metrics(trainer, model)  # what the bar draws next to the loss
    assert shown["mb"] == "4" and shown["k"] == "4"  # text: Rich would draw a number as "4.000"
    assert "mem" not in shown
    # The peak as a fraction of the budget (half the machine's memory), or of the capacity without one.
    assert 0 < float(shown[label]) < 1 and shown[label] == f"{float(shown[label]):.2f}"
    # ...and the line each bar drew last (Lightning internals: the tqdm postfix, Rich's metrics column).
    if bar == "tqdm":
        drawn = progress.train_progress_bar.postfix
        assert drawn.startswith("mb=4, k=4, ") and drawn.endswith(f"{label}={shown[label]}"), drawn
    else:
        drawn = " ".join(progress._metric_component._generate_metrics_texts())
        assert drawn.startswith("mb: 4 k: 4 ") and drawn.endswith(f"{label}: {shown[label]}"), drawn


def test_the_progress_bar_fields_can_be_turned_off(tmp_path):
    from lightning.pytorch.callbacks import TQDMProgressBar

    progress = TQDMProgressBar()
    model = RegressionModel()
    trainer = make_trainer(
        tmp_path,
        [AccumulationScheduler(2), AccumulationMonitor(progress_bar=False), progress],
        enable_progress_bar=True,
    )
    trainer.fit(model, DataLoader(IndexedDataset(16), batch_size=4))
    assert not {"mb", "k", "mem/budget", "mem/capacity"} & progress.get_metrics(trainer, model).keys()


def test_the_end_of_fit_summary_is_printed_and_logged(tmp_path, caplog):
    import logging

    from lightning_accum import AutoMicroBatching
    from lightning_accum.memory.oom import OOMFault, OOMInjector

    injector = OOMInjector(OOMFault(step=2, micro_batch=0, phase="forward"))
    owner = AutoMicroBatching(8, max_memory=0.5, fault_injector=injector)
    model = RegressionModel()
    model.split_mode = True
    csv_logger = CSVLogger(str(tmp_path), name="csv")
    trainer = make_trainer(tmp_path, [owner, AccumulationMonitor()], logger=csv_logger)
    with caplog.at_level(logging.INFO):
        trainer.fit(model, DataLoader(IndexedDataset(64), batch_size=16))
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("lightning_accum: 4 optimizer"))
    assert "effective batch 16 samples" in line
    assert "micro-batch 4 to 8, settled at 4 from step 2" in line
    assert "1 OOM recovered (step 2)" in line
    assert "of the budget" in line and "samples/s" in line

    logged = yaml.safe_load((Path(csv_logger.log_dir) / "hparams.yaml").read_text())["lightning_accum_summary"]
    assert logged["steps"] == 4 and logged["oom_recovered"] == 1 and logged["micro_batch_size_settled"] == 4
    assert logged["samples_per_sec"] > 0 and 0 < logged["peak_fraction_of_budget"]
    assert logged["samples"] == 64


def test_without_a_budget_the_summary_gives_the_peak_against_the_capacity(tmp_path, caplog):
    import logging

    csv_logger = CSVLogger(str(tmp_path), name="csv")
    with caplog.at_level(logging.INFO):
        fit(tmp_path, [AccumulationScheduler(2), AccumulationMonitor()], csv_logger, n=32, max_epochs=1)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("lightning_accum: 4 optimizer"))
    assert "of the capacity" in line and "budget" not in line
    logged = yaml.safe_load((Path(csv_logger.log_dir) / "hparams.yaml").read_text())["lightning_accum_summary"]
    assert 0 < logged["peak_fraction_of_capacity"] < 1 and "peak_fraction_of_budget" not in logged


def test_monitor_options_prefix_training_time_and_per_rank_memory(tmp_path):
    # Issue 14, item 5: a key prefix, wall-clock totals, and each rank's peak as an opt-in (one rank here).
    csv_logger = CSVLogger(str(tmp_path), name="csv")
    monitor = AccumulationMonitor(key_prefix="run2/", per_rank_memory=True)
    fit(tmp_path, [AccumulationScheduler(2), monitor], csv_logger, n=32, max_epochs=1)
    rows = read_csv(csv_logger.log_dir)
    seconds = [rows[s]["run2/" + keys.TRAIN_SECONDS] for s in sorted(rows)]
    assert seconds == sorted(seconds) and seconds[0] > 0  # a running total
    assert all(rows[s]["run2/memory/rank0/peak_gib"] == rows[s]["run2/" + keys.PEAK_GIB] for s in rows)
    assert not any(key.startswith("accum/") for row in rows.values() for key in row)
    assert keys.ALLOC_RETRIES not in {k.removeprefix("run2/") for row in rows.values() for k in row}  # CUDA only


def test_a_bad_key_prefix_is_refused():
    with pytest.raises(TypeError, match=r"`key_prefix` must be a str"):
        AccumulationMonitor(key_prefix=3)


# ----------------------------------------------------------------------------------------------------------------
# the summary's peak is the peak of the whole fit (issue 19, item 6)
# ----------------------------------------------------------------------------------------------------------------
def summary_line(caplog: pytest.LogCaptureFixture) -> str:
    return next(
        r.getMessage()
        for r in caplog.records
        if r.getMessage().startswith("lightning_accum: ") and "optimizer steps" in r.getMessage()
    )


def test_a_run_shorter_than_the_logging_interval_still_gives_its_peak(tmp_path, caplog):
    # 4 steps at the default interval of 50: no logging step at all.
    import logging

    csv_logger = CSVLogger(str(tmp_path), name="csv")
    with caplog.at_level(logging.INFO):
        fit(
            tmp_path,
            [AccumulationScheduler(2), AccumulationMonitor()],
            csv_logger,
            n=32,
            max_epochs=1,
            log_every_n_steps=50,
        )
    assert "peak memory" in summary_line(caplog) and "of the capacity" in summary_line(caplog)
    logged = yaml.safe_load((Path(csv_logger.log_dir) / "hparams.yaml").read_text())["lightning_accum_summary"]
    assert 0 < logged["peak_fraction_of_capacity"] < 1


def test_the_summary_peak_covers_the_steps_after_the_last_logging_step(tmp_path):
    # 6 steps, logged every 4th: the block held in step 5 comes after the last logging step (step 3).
    spike = 512 * 1024**2
    csv_logger = CSVLogger(str(tmp_path), name="csv")
    monitor = AccumulationMonitor(logging_interval=4)
    trainer = make_trainer(tmp_path, [AccumulationScheduler(2), monitor], logger=csv_logger)
    trainer.fit(AllocatesAtStep(step=5, n_bytes=spike), DataLoader(IndexedDataset(48), batch_size=4))
    assert trainer.global_step == 6
    rows = read_csv(csv_logger.log_dir)
    assert sorted(rows) == [3]
    logged = yaml.safe_load((Path(csv_logger.log_dir) / "hparams.yaml").read_text())["lightning_accum_summary"]
    summary_peak_gib = logged["peak_fraction_of_capacity"] * rows[3][keys.CAPACITY_GIB]
    assert summary_peak_gib - rows[3][keys.PEAK_GIB] > 0.8 * spike / GIB


def test_interval_totals_has_no_stray_add_peak():
    # Issue 20, item 8: a copy of `FitSummary.add_peak` that nothing called, and that raised AttributeError.
    from lightning_accum.monitor.summary import FitSummary
    from lightning_accum.monitor.totals import IntervalTotals

    assert not hasattr(IntervalTotals(), "add_peak")
    summary = FitSummary()
    summary.add_peak(0.5, "budget")
    summary.add_peak(0.25, "budget")
    assert (summary.peak_fraction, summary.memory_limit) == (0.5, "budget")


# ----------------------------------------------------------------------------------------------------------------
# between logging steps: what ModelCheckpoint and EarlyStopping can read at every step (issue 18, item 7)
# ----------------------------------------------------------------------------------------------------------------
class RecordsStepMetrics(pl.Callback):
    """Put after the monitor: what `trainer.callback_metrics` holds at the end of each optimizer step."""

    def __init__(self) -> None:
        self.by_step: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step > len(self.by_step):
            self.by_step.append({key: float(value) for key, value in trainer.callback_metrics.items()})


class RecordsMicroBatchLosses(RegressionModel):
    """Records each micro-batch's loss, its samples and the optimizer step it belongs to."""

    def __init__(self) -> None:
        super().__init__()
        self.losses: list[tuple[float, int, int]] = []

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.losses.append((float(loss), len(batch["x"]), self.global_step))
        return loss


def interval_mean(losses: list[tuple[float, int, int]], first: int, last: int) -> float:
    """The item-weighted mean loss of the optimizer steps ``first`` to ``last``."""
    seen = [(loss, n) for loss, n, step in losses if first <= step <= last]
    return sum(loss * n for loss, n in seen) / sum(n for _, n in seen)


def test_model_checkpoint_every_step_sees_the_window_loss_between_logging_steps(tmp_path):
    # The case: 10 steps at the default interval (Trainer(log_every_n_steps=50)) saved nothing, because the
    # monitor's keys reached `trainer.callback_metrics` only at its logging steps.
    from lightning.pytorch.callbacks import ModelCheckpoint

    checkpoint = ModelCheckpoint(
        dirpath=tmp_path / "ckpt", monitor=keys.WINDOW_LOSS, mode="min", every_n_train_steps=1, save_top_k=-1
    )
    model = RecordsMicroBatchLosses()
    trainer = make_trainer(
        tmp_path,
        [AccumulationScheduler(2), AccumulationMonitor(), checkpoint],
        enable_checkpointing=True,
        log_every_n_steps=50,
    )
    trainer.fit(model, DataLoader(IndexedDataset(80), batch_size=4))
    assert trainer.global_step == 10
    assert len(checkpoint.best_k_models) == 10
    # No logging step yet: at each step the window loss covers every step so far.
    scores = sorted(float(score) for score in checkpoint.best_k_models.values())
    assert scores == pytest.approx(sorted(interval_mean(model.losses, 0, s) for s in range(10)), rel=1e-6)


@pytest.mark.parametrize("owner", ["scheduler", "plain"])
def test_between_logging_steps_callbacks_see_the_step_figures_and_the_window_loss_so_far(tmp_path, owner):
    # 19 micro-batches at k=2: 9 windows of 2 and a tail of 1; logged at steps 3 and 7.
    csv_logger = CSVLogger(str(tmp_path), name="csv")
    model = RecordsMicroBatchLosses()
    seen = RecordsStepMetrics()
    callbacks, kwargs = monitor_with_owner(owner, 2)
    callbacks[-1] = AccumulationMonitor(logging_interval=4)
    trainer = make_trainer(tmp_path, [*callbacks, seen], logger=csv_logger, **kwargs)
    trainer.fit(model, DataLoader(IndexedDataset(76), batch_size=4))
    assert trainer.global_step == len(seen.by_step) == 10
    rows = read_csv(csv_logger.log_dir)
    assert sorted(rows) == [3, 7]
    for step, metrics in enumerate(seen.by_step):
        k = 2 if step < 9 else 1
        assert metrics[keys.ACCUMULATION_STEPS] == k and metrics[keys.EFFECTIVE_BATCH_SIZE] == 4 * k
        assert metrics[keys.ITEMS_PER_STEP] == 4 * k and metrics[keys.MICRO_BATCH_SIZE] == 4
        assert metrics[keys.OOM_RETRIES] == 0
        # The window loss since the previous logging step: what the monitor would log if this step were one.
        first = 0 if step <= 3 else 4 if step <= 7 else 8
        assert metrics[keys.WINDOW_LOSS] == pytest.approx(interval_mean(model.losses, first, step), rel=1e-6)
        if step in rows:  # at a logging step, what the loggers got
            assert metrics[keys.WINDOW_LOSS] == pytest.approx(rows[step][keys.WINDOW_LOSS], rel=1e-6)
            assert EVERY_STEP_KEYS <= metrics.keys()
    # Memory and throughput are figures of a logging interval: none before the first logging step.
    assert not {keys.PEAK_GIB, keys.SAMPLES_PER_SEC} & seen.by_step[2].keys()


def test_a_checkpoint_that_reads_an_interval_figure_between_logging_steps_is_warned_about(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    def run(monitor: str, every_n_train_steps: int) -> list[str]:
        checkpoint = ModelCheckpoint(
            dirpath=tmp_path / "ckpt", monitor=monitor, every_n_train_steps=every_n_train_steps, save_top_k=1
        )
        trainer = make_trainer(
            tmp_path,
            [AccumulationScheduler(2), AccumulationMonitor(key_prefix="run2/"), checkpoint],
            enable_checkpointing=True,
            log_every_n_steps=4,
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(RegressionModel(), DataLoader(IndexedDataset(32), batch_size=4))
        return [str(w.message) for w in caught if "AccumulationMonitor" in str(w.message)]

    (message,) = run("run2/memory/peak_gib", 2)
    assert re.search(
        r"`ModelCheckpoint\(monitor='run2/memory/peak_gib', every_n_train_steps=2\)` reads.*more often than"
        r" `AccumulationMonitor` logs it \(every 4 optimizer steps\).*figure of a logging interval.*"
        r"`every_n_train_steps` to a multiple of 4",
        message,
    ), message
    assert run("run2/memory/peak_gib", 8) == []  # it reads at logging steps only
    assert run("run2/" + keys.WINDOW_LOSS, 1) == []  # available at every step on one process


@pytest.mark.parametrize(
    ("owner", "world_size", "expected"),
    [
        (True, 1, {*keys.BATCH_KEYS, keys.OOM_RETRIES, keys.WINDOW_LOSS}),
        (False, 1, {*keys.BATCH_KEYS, keys.OOM_RETRIES, keys.WINDOW_LOSS}),
        # Under DDP only what needs no collective: an owner's counts are global already; the window loss is each
        # rank's own sum until a logging step adds them up, and plain Lightning counts this rank's batches.
        (True, 2, {*keys.BATCH_KEYS, keys.OOM_RETRIES}),
        (False, 2, set()),
    ],
)
def test_which_keys_are_there_at_every_step(owner, world_size, expected):
    from lightning_accum.monitor.rows import every_step_keys

    assert set(every_step_keys(has_owner=owner, world_size=world_size, noise_scale=False)) == expected
    with_noise = every_step_keys(has_owner=True, world_size=world_size, noise_scale=True)
    assert set(keys.NOISE_SCALE_KEYS) <= set(with_noise)  # averaged over ranks when measured


class CountsCollectives(AccumulationMonitor):
    """The monitor, counting the collectives its own step hook makes, per optimizer step."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.collectives: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        import torch.distributed as dist

        names = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce")
        originals = {name: getattr(dist, name) for name in names}
        count = [0]

        def counting(fn):
            def call(*args, **kwargs):
                count[0] += 1
                return fn(*args, **kwargs)

            return call

        for name, fn in originals.items():
            setattr(dist, name, counting(fn))
        try:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)
        if trainer.global_step > len(self.collectives):
            self.collectives.append(count[0])


class WritesStepMetrics(RecordsStepMetrics):
    """What each rank's `callback_metrics` held at each step, and its monitor's collectives, into a JSON file."""

    def __init__(self, directory: Path) -> None:
        super().__init__()
        self.directory = directory

    def on_train_end(self, trainer, pl_module):
        import json

        monitor = next(cb for cb in trainer.callbacks if isinstance(cb, CountsCollectives))
        record = {"metrics": self.by_step, "collectives": monitor.collectives}
        (self.directory / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


@pytest.mark.ddp
@pytest.mark.timeout(180)
def test_ddp_between_logging_steps_the_owners_figures_are_there_without_a_new_collective(tmp_path):
    import json

    csv_logger = CSVLogger(str(tmp_path), name="csv", version="ddp")
    strategy = ddp_strategy()
    callbacks = [AccumulationScheduler(2), CountsCollectives(logging_interval=3), WritesStepMetrics(tmp_path)]
    trainer = make_trainer(tmp_path, callbacks, logger=csv_logger, strategy=strategy, devices=2)
    # 28 samples a rank in micro-batches of 2 at k=2: 7 steps, logged at steps 2 and 5; step 6 comes after the last.
    trainer.fit(RegressionModel(), DataLoader(IndexedDataset(56), batch_size=2))

    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    rows = read_csv(csv_logger.log_dir)
    assert sorted(rows) == [2, 5]
    for rank in ranks:
        assert len(rank["metrics"]) == 7
        for step, metrics in enumerate(rank["metrics"]):
            assert metrics[keys.EFFECTIVE_BATCH_SIZE] == 2 * 2 * 2 and metrics[keys.ACCUMULATION_STEPS] == 2
            assert metrics[keys.ITEMS_PER_STEP] == 8 and metrics[keys.MICRO_BATCH_SIZE] == 2
            # The window loss needs a sum over ranks: refreshed at logging steps only (and warned about).
            logged = max((s for s in rows if s <= step), default=None)
            if logged is None:
                assert keys.WINDOW_LOSS not in metrics
            else:
                assert metrics[keys.WINDOW_LOSS] == pytest.approx(rows[logged][keys.WINDOW_LOSS], rel=1e-6)
        # No collective between logging steps; the logging steps' own (the same on both ranks).
        assert [n for s, n in enumerate(rank["collectives"]) if s not in rows] == [0] * 5
        assert all(n > 0 for s, n in enumerate(rank["collectives"]) if s in rows)
    shared = (*keys.BATCH_KEYS, keys.OOM_RETRIES, keys.WINDOW_LOSS)  # (a rank's own clock times its throughput)
    assert [{k: m[k] for k in shared if k in m} for m in ranks[0]["metrics"]] == [
        {k: m[k] for k in shared if k in m} for m in ranks[1]["metrics"]
    ]
    summary = yaml.safe_load((Path(csv_logger.log_dir) / "hparams.yaml").read_text())["lightning_accum_summary"]
    assert summary["steps"] == 7 and 0 < summary["peak_fraction_of_capacity"] < 1


def test_a_second_fit_finds_the_step_figures_again(tmp_path):
    # Lightning empties `callback_metrics` at the start of a run; figures that did not change must go in again.
    monitor = AccumulationMonitor(logging_interval=50)
    for _ in range(2):
        seen = RecordsStepMetrics()
        trainer = make_trainer(tmp_path, [AccumulationScheduler(2), monitor, seen])
        trainer.fit(RegressionModel(), DataLoader(IndexedDataset(16), batch_size=4))
        assert [metrics[keys.EFFECTIVE_BATCH_SIZE] for metrics in seen.by_step] == [8, 8]


# ----------------------------------------------------------------------------------------------------------------
# the callback is glue over a Trainer-free core (issue 20)
# ----------------------------------------------------------------------------------------------------------------
class RecordsReports(pl.Callback):
    """Put after the monitor: each new step report the accumulation owner published."""

    def __init__(self) -> None:
        self.reports: list[StepReport] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        owner = next(cb for cb in trainer.callbacks if isinstance(cb, AccumulationOwner))
        report = owner.last_step_report
        if report is not None and (not self.reports or report is not self.reports[-1]):
            self.reports.append(report)


def test_the_monitor_logs_what_its_trainer_free_core_makes_of_the_owners_reports(tmp_path):
    from lightning_accum.core.engine import Ranks
    from lightning_accum.monitor.metrics import AccumulationMetrics
    from lightning_accum.monitor.rows import every_step_keys

    csv_logger = CSVLogger(str(tmp_path), name="csv")
    recorder = RecordsReports()
    callbacks = [AccumulationScheduler(2), AccumulationMonitor(logging_interval=3), recorder]
    trainer = make_trainer(tmp_path, callbacks, logger=csv_logger)
    trainer.fit(RegressionModel(), DataLoader(IndexedDataset(48), batch_size=4))  # 6 steps, logged at 2 and 5
    rows = read_csv(csv_logger.log_dir)

    core = AccumulationMetrics()
    core.setup(torch.device("cpu"))
    core.start(every_step_keys(has_owner=True, world_size=1, noise_scale=False), has_owner=True)
    replayed = {}
    for step, report in enumerate(recorder.reports):
        assert core.add(report)
        if (step + 1) % 3 == 0:
            replayed[step] = core.logging_step(Ranks(), None, allocator=False)
            core.new_interval()
    assert sorted(rows) == sorted(replayed) == [2, 5]
    same = (*keys.BATCH_KEYS, keys.OOM_RETRIES, keys.WINDOW_LOSS, keys.CAPACITY_GIB, BUDGET_FRACTION)
    for step, row in rows.items():
        assert {key: row[key] for key in same} == pytest.approx({key: replayed[step][key] for key in same})
        assert set(row) - {"epoch"} == set(replayed[step])  # the same keys, no more and no fewer


# ----------------------------------------------------------------------------------------------------------------
# split mode by tokens: the token budget, the padding and the micro-batches (issue 21, item 4)
# ----------------------------------------------------------------------------------------------------------------
TOKEN_BUDGET = 96
TOKEN_STEP_BATCH = 16


def token_fit(tmp_path, loggers, callbacks, *, budget=TOKEN_BUDGET, **trainer_kwargs):
    """A real fit split by tokens: 48 log-normal sequences padded to 56, 3 steps of 16 at a pinned token budget."""
    import functools

    from lightning_accum import AutoMicroBatching
    from lightning_accum.items import CountTokens
    from lightning_accum.sequences import PaddedSequences
    from tests.token_models import TinyCausalLM, TokenSequences, lognormal_lengths, pad_right

    lengths = lognormal_lengths(48, seed=2)
    owner = AutoMicroBatching(
        sequences=PaddedSequences(),
        micro_batch_tokens=budget,
        pin_micro_batch_size=True,
        count_items=CountTokens("labels", shift=1),
    )
    model = TinyCausalLM()
    trainer = make_trainer(tmp_path, [owner, *callbacks], logger=loggers, **trainer_kwargs)
    collate = functools.partial(pad_right, pad_to=56)
    trainer.fit(model, DataLoader(TokenSequences(lengths, seed=1), batch_size=TOKEN_STEP_BATCH, collate_fn=collate))
    return trainer, model, lengths


def token_steps(shapes: list[tuple[int, int]], step_indices: list[list[int]], lengths: list[int]) -> list[dict]:
    """Each step's figures worked out from what the model computed: its micro-batches' (samples, length) shapes."""
    remaining, steps = iter(shapes), []
    for indices in step_indices:
        ran: list[tuple[int, int]] = []
        while sum(b for b, _ in ran) < len(indices):
            ran.append(next(remaining))
        padded, real = sum(b * n for b, n in ran), sum(lengths[i] for i in indices)
        steps.append({"padding": 1 - real / padded, "micro_batches": len(ran), "largest": max(b for b, _ in ran)})
    assert next(remaining, None) is None  # every micro-batch belongs to a step: none ran twice
    return steps


def test_split_by_tokens_logs_the_token_budget_and_the_padding_to_wandb_and_csv(tmp_path, wandb_offline):
    wandb_logger = WandbLogger(project="accum", save_dir=str(tmp_path))
    csv_logger = CSVLogger(str(tmp_path), name="csv")
    trainer, model, lengths = token_fit(tmp_path, [wandb_logger, csv_logger], [AccumulationMonitor()])
    finish_wandb()

    expected = token_steps(model.micro_batch_shapes, model.step_indices, lengths)
    assert trainer.global_step == len(expected) == 3
    assert all(b * n <= TOKEN_BUDGET for b, n in model.micro_batch_shapes)  # (no sequence is longer than 96)
    run = read_offline_run(tmp_path / "wandb", wait_s=10)
    logged, csv_rows = wandb_steps(run), read_csv(csv_logger.log_dir)
    assert sorted(logged) == sorted(csv_rows) == [0, 1, 2]
    for step, want in enumerate(expected):
        for row in (logged[step], csv_rows[step]):
            assert EVERY_STEP_KEYS <= row.keys()
            assert row[keys.MICRO_BATCH_TOKENS] == TOKEN_BUDGET
            assert row[keys.PADDING_FRACTION] == pytest.approx(want["padding"], rel=1e-9)
            # The step's own micro-batches (this rank's), and the samples of the largest of them.
            assert row[keys.ACCUMULATION_STEPS] == want["micro_batches"]
            assert row[keys.MICRO_BATCH_SIZE] == want["largest"]
            assert row[keys.EFFECTIVE_BATCH_SIZE] == TOKEN_STEP_BATCH
    # Sorting and trimming leave far less padding than the step batch at its padded width would compute.
    full_width = 1 - sum(lengths) / (len(lengths) * 56)
    assert max(w["padding"] for w in expected) < 0.5 * full_width

    # W&B: the padding's run summary is its mean over the logged steps (what padding cost the run); the budget's, its
    # last value.
    mean = sum(w["padding"] for w in expected) / len(expected)
    assert run.metrics[keys.PADDING_FRACTION] == {"step_metric": STEP_METRIC, "summary": ["mean"]}
    assert run.summary[keys.PADDING_FRACTION] == {"mean": pytest.approx(mean, rel=1e-9)}
    assert run.metrics[keys.MICRO_BATCH_TOKENS]["step_metric"] == STEP_METRIC
    assert run.summary[keys.MICRO_BATCH_TOKENS] == TOKEN_BUDGET


def test_split_by_tokens_the_token_figures_reach_callback_metrics_at_every_step(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    # Logged at step 1 only; ModelCheckpoint reads the padding at every step, and is not warned about it.
    checkpoint = ModelCheckpoint(
        dirpath=tmp_path / "ckpt", monitor=keys.PADDING_FRACTION, mode="min", every_n_train_steps=1, save_top_k=-1
    )
    seen = RecordsStepMetrics()
    csv_logger = CSVLogger(str(tmp_path), name="csv")
    callbacks = [AccumulationMonitor(logging_interval=2), seen, checkpoint]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, model, lengths = token_fit(tmp_path, csv_logger, callbacks, enable_checkpointing=True)
    assert not [w for w in caught if "AccumulationMonitor" in str(w.message)]

    expected = token_steps(model.micro_batch_shapes, model.step_indices, lengths)
    assert len(seen.by_step) == len(expected) == 3
    for metrics, want in zip(seen.by_step, expected, strict=True):
        assert metrics[keys.MICRO_BATCH_TOKENS] == TOKEN_BUDGET
        assert metrics[keys.PADDING_FRACTION] == pytest.approx(want["padding"], rel=1e-6)
        assert metrics[keys.ACCUMULATION_STEPS] == want["micro_batches"]
    assert sorted(float(s) for s in checkpoint.best_k_models.values()) == pytest.approx(
        sorted(w["padding"] for w in expected), rel=1e-6
    )
    rows = read_csv(csv_logger.log_dir)
    assert sorted(rows) == [1]  # a logging step logs its own (last) step's padding, as the batch figures
    assert rows[1][keys.PADDING_FRACTION] == pytest.approx(expected[1]["padding"], rel=1e-9)


def test_a_run_split_by_samples_logs_no_token_key(tmp_path, wandb_offline):
    # A guard: the token keys belong to runs split by tokens; a run by samples logs, and defines, what it did before.
    from lightning_accum import AutoMicroBatching

    model = RegressionModel()
    model.split_mode = True
    loggers = [WandbLogger(project="accum", save_dir=str(tmp_path)), CSVLogger(str(tmp_path), name="csv")]
    trainer = make_trainer(tmp_path, [AutoMicroBatching(4, max_memory=0.5), AccumulationMonitor()], logger=loggers)
    trainer.fit(model, DataLoader(IndexedDataset(32), batch_size=16))
    finish_wandb()
    run = read_offline_run(tmp_path / "wandb", wait_s=10)
    seen = {*run.metrics, *run.summary, *(k for row in run.history for k in row)}
    seen |= {k for row in read_csv(loggers[1].log_dir).values() for k in row} | set(trainer.callback_metrics)
    assert not set(keys.TOKEN_KEYS) & seen
    assert not {"mb_tokens", "pad"} & set(trainer.progress_bar_metrics)


@pytest.mark.parametrize("bar", ["tqdm", "rich"])
def test_split_by_tokens_the_progress_bar_shows_the_token_budget_and_the_padding(tmp_path, bar):
    from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar

    progress = TQDMProgressBar() if bar == "tqdm" else RichProgressBar()
    callbacks = [AccumulationMonitor(), progress]
    trainer, model, lengths = token_fit(tmp_path, False, callbacks, enable_progress_bar=True)
    last = token_steps(model.micro_batch_shapes, model.step_indices, lengths)[-1]
    shown = progress.get_metrics(trainer, model)
    pad = f"{last['padding']:.2f}"
    assert (shown["mb_tokens"], shown["pad"]) == (str(TOKEN_BUDGET), pad)  # text, as the other figures
    assert (shown["mb"], shown["k"]) == (str(last["largest"]), str(last["micro_batches"]))
    fields = [
        ("mb", last["largest"]),
        ("k", last["micro_batches"]),
        ("mb_tokens", TOKEN_BUDGET),
        ("pad", pad),
        ("window_loss", shown["window_loss"]),  # the loss optimized, beside the module's own micro-batch loss
        ("mem/budget", shown["mem/budget"]),
    ]
    if bar == "tqdm":
        drawn = progress.train_progress_bar.postfix
        assert drawn.endswith(", ".join(f"{key}={value}" for key, value in fields)), drawn
    else:
        drawn = " ".join(progress._metric_component._generate_metrics_texts())
        assert drawn.endswith(" ".join(f"{key}: {value}" for key, value in fields)), drawn


def test_split_by_tokens_the_end_of_fit_summary_gives_the_token_budget_and_the_padding(tmp_path, caplog):
    import logging

    csv_logger = CSVLogger(str(tmp_path), name="csv")
    with caplog.at_level(logging.INFO):
        _, model, lengths = token_fit(tmp_path, csv_logger, [AccumulationMonitor()])
    expected = token_steps(model.micro_batch_shapes, model.step_indices, lengths)
    mean = sum(w["padding"] for w in expected) / len(expected)
    largest = [w["largest"] for w in expected]
    line = summary_line(caplog)
    assert line.startswith("lightning_accum: 3 optimizer steps, effective batch 16 samples; ")
    assert f"; micro-batch budget {TOKEN_BUDGET} tokens ({min(largest)} to {max(largest)} samples); " in line
    assert f"; padding {mean:.0%} of the token positions computed (mean over steps); " in line
    assert "settled" not in line  # the budget never moved; the samples a micro-batch holds follow the lengths
    logged = yaml.safe_load((Path(csv_logger.log_dir) / "hparams.yaml").read_text())["lightning_accum_summary"]
    assert logged["micro_batch_tokens_settled"] == TOKEN_BUDGET
    assert logged["padding_fraction_mean"] == pytest.approx(mean, rel=1e-9)
    assert "micro_batch_size_settled" not in logged


class WritesTokenRun(WritesStepMetrics):
    """`WritesStepMetrics`, with the micro-batches the rank's model computed and the samples of each step."""

    def on_train_end(self, trainer, pl_module):
        super().on_train_end(trainer, pl_module)
        import json

        record = {"shapes": pl_module.micro_batch_shapes, "indices": pl_module.step_indices}
        (self.directory / f"rank{trainer.global_rank}.tokens.json").write_text(json.dumps(record))


@pytest.mark.ddp
@pytest.mark.timeout(300)
def test_ddp_split_by_tokens_logs_the_padding_of_all_ranks_and_rank_zeros_micro_batches(tmp_path):
    # Rank 0's step batches hold long sequences, rank 1's short ones: at 48 tokens, rank 0 runs 4 micro-batches a step
    # ([30], [22, 17], [12, 9, 8, 5], [3]: 125 positions for 106 tokens) and rank 1 one ([6, ..., 2] x 8: 48 for 29).
    import json

    from lightning_accum import AutoMicroBatching
    from lightning_accum.items import CountTokens
    from lightning_accum.sequences import PaddedSequences
    from lightning_accum.sequences.token_cut import TokenCut
    from tests.test_token_split_ddp import LONG, SHORT
    from tests.test_uneven_ranks import RankBatches
    from tests.token_models import TinyCausalLM, TokenSequences, pad_right

    budget, steps = 48, 3
    lengths = (LONG + SHORT) * steps
    per_rank = [[list(range(16 * s + 8 * r, 16 * s + 8 * r + 8)) for s in range(steps)] for r in (0, 1)]
    owner = AutoMicroBatching(
        sequences=PaddedSequences(),
        micro_batch_tokens=budget,
        pin_micro_batch_size=True,
        count_items=CountTokens("labels", shift=1),
    )
    csv_logger = CSVLogger(str(tmp_path), name="csv", version="ddp")
    callbacks = [owner, CountsCollectives(logging_interval=2), WritesTokenRun(tmp_path)]
    strategy = ddp_strategy()
    trainer = make_trainer(
        tmp_path, callbacks, logger=csv_logger, strategy=strategy, devices=2, use_distributed_sampler=False
    )
    loader = DataLoader(TokenSequences(lengths, seed=3), batch_sampler=RankBatches(per_rank), collate_fn=pad_right)
    trainer.fit(TinyCausalLM(), loader)

    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    runs = [json.loads((tmp_path / f"rank{r}.tokens.json").read_text()) for r in (0, 1)]
    figures = [token_steps([tuple(s) for s in run["shapes"]], run["indices"], lengths) for run in runs]
    # What each rank's cut gives from its lengths alone: rank 0's long sequences take more micro-batches.
    cuts = [TokenCut(None, list(range(8)), sorted(own, reverse=True), max(own), 1) for own in (LONG, SHORT)]
    stats = [cut.stats(budget) for cut in cuts]
    assert stats[0].micro_batches > stats[1].micro_batches and (stats[0].real, stats[1].real) == (106, 29)
    assert [[f["micro_batches"] for f in rank] for rank in figures] == [[s.micro_batches] * steps for s in stats]
    # Each rank's own padding, from what its model computed, is its cut's; the step's is both ranks' positions.
    for own, cut_stats in zip(figures, stats, strict=True):
        assert [f["padding"] for f in own] == pytest.approx([1 - cut_stats.real / cut_stats.padded] * steps)
    all_ranks = [1 - (106 + 29) / (stats[0].padded + stats[1].padded)] * steps
    largest = max(len(group) for cut in cuts for group in cut.groups(budget))

    rows = read_csv(csv_logger.log_dir)
    assert sorted(rows) == [1]
    assert rows[1][keys.PADDING_FRACTION] == pytest.approx(all_ranks[1], rel=1e-9)  # all ranks' positions
    assert rows[1][keys.MICRO_BATCH_TOKENS] == budget
    assert rows[1][keys.ACCUMULATION_STEPS] == stats[0].micro_batches  # the logging rank's (rank 0's) own
    assert rows[1][keys.MICRO_BATCH_SIZE] == largest  # the largest micro-batch of any rank, in samples
    for rank, (record, own) in enumerate(zip(ranks, figures, strict=True)):
        for step, metrics in enumerate(record["metrics"]):
            # Every rank sees the same budget and padding; the number of micro-batches is each rank's own.
            assert metrics[keys.PADDING_FRACTION] == pytest.approx(all_ranks[step], rel=1e-6)  # (float32)
            assert metrics[keys.MICRO_BATCH_TOKENS] == budget
            assert metrics[keys.ACCUMULATION_STEPS] == own[step]["micro_batches"], rank
        # No collective between the logging steps by tokens either: the figures came in the owner's report.
        assert [n for s, n in enumerate(record["collectives"]) if s not in rows] == [0, 0]


# ----------------------------------------------------------------------------------------------------------------
# issue 25: event keys in callback_metrics, and a resumed run's step axis and training time
# ----------------------------------------------------------------------------------------------------------------
class SeenAtEachStep(pl.Callback):
    """What ``trainer.callback_metrics`` holds under ``key`` after each optimizer step (after the monitor's hook)."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.seen: dict[int, float | None] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        value = trainer.callback_metrics.get(self.key)
        self.seen[trainer.global_step - 1] = None if value is None else float(value)


def test_an_event_key_is_in_callback_metrics_at_its_step_only_and_a_count_after_fit_as_in_wandb(
    tmp_path, wandb_offline
):
    from lightning_accum import AutoMicroBatching
    from lightning_accum.memory.oom import OOMFault, OOMInjector

    # OOMs at steps 1 and 2 (8 -> 4 -> 2); steps 3 and 4 have no event.
    injector = OOMInjector([OOMFault(step=1, micro_batch=0), OOMFault(step=2, micro_batch=0)])
    owner = AutoMicroBatching(8, max_memory=0.5, fault_injector=injector, oom_cooldown=100)
    seen = SeenAtEachStep(keys.EVENT_OOM_RECOVERED)
    model = RegressionModel()
    model.split_mode = True
    logger = WandbLogger(project="events", save_dir=str(tmp_path))
    trainer = make_trainer(tmp_path, [owner, AccumulationMonitor(), seen], logger=logger)
    trainer.fit(model, DataLoader(IndexedDataset(80), batch_size=16))
    after_fit = float(trainer.callback_metrics[keys.EVENT_OOM_RECOVERED])
    finish_wandb()
    run = read_offline_run(tmp_path / "wandb", wait_s=10)
    assert run.complete

    sizes_after = {e.step: e.after for e in owner.events if e.kind == "oom_recovered"}
    assert sizes_after == {1: 4, 2: 2}, owner.events
    logged = {int(row[STEP_METRIC]): row[keys.EVENT_OOM_RECOVERED] for row in wandb_steps(run).values()
              if keys.EVENT_OOM_RECOVERED in row}  # fmt: skip
    assert logged == sizes_after  # the history: the size after each event, at its step
    # callback_metrics holds the same at those steps, and nothing at the others (no stale "1.0" read as one OOM).
    assert seen.seen == {0: None, 1: 4.0, 2: 2.0, 3: None, 4: None}
    # After fit, the count: what the W&B run summary shows.
    assert after_fit == run.summary[keys.EVENT_OOM_RECOVERED] == len(sizes_after) == owner.oom_retries


@pytest.mark.xfail(
    _LIGHTNING_BEFORE_2_5,
    reason="Lightning 2.4 logs a resumed fit's first step one lower (rows 5..8, not 6..9): not yet told apart from"
    " the monitor's own axis there; 2.5 and later agree (tox -e tests-oldest records it)",
    strict=True,
)
def test_a_resumed_fit_goes_on_on_the_runs_step_axis_and_training_time(tmp_path, caplog):
    import logging

    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_accum import AutoMicroBatching
    from lightning_accum.memory.oom import OOMFault, OOMInjector

    def run(root, max_steps, ckpt_path=None, faults=()):
        owner = AutoMicroBatching(8, max_memory=0.5, fault_injector=OOMInjector(list(faults)), oom_cooldown=100)
        model = RegressionModel()
        model.split_mode = True
        checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=max_steps, save_top_k=-1)
        csv_logger = CSVLogger(str(root), name="csv")
        trainer = make_trainer(
            root, [owner, AccumulationMonitor(), checkpoint], logger=csv_logger, max_steps=max_steps,
            max_epochs=-1, enable_checkpointing=True,
        )  # fmt: skip
        with caplog.at_level(logging.INFO):
            trainer.fit(model, DataLoader(IndexedDataset(32), batch_size=16), ckpt_path=ckpt_path)
        return trainer, read_csv(csv_logger.log_dir)

    # Steps 0 to 5, an OOM at step 5 (8 -> 4); then steps 6 to 9 resumed from the checkpoint of step 6.
    _first, first_rows = run(tmp_path / "a", 6, faults=[OOMFault(step=5, micro_batch=0)])
    ckpt = tmp_path / "ckpt" / "epoch=2-step=6.ckpt"
    assert ckpt.is_file()
    saved = torch.load(ckpt, weights_only=False)["callbacks"]
    monitor_state = next(state for name, state in saved.items() if "AccumulationMonitor" in name)
    caplog.clear()
    _second, rows = run(tmp_path / "b", 10, ckpt_path=ckpt)

    assert sorted(rows) == [6, 7, 8, 9]  # the run's step axis
    line = next(r.getMessage() for r in caplog.records if "optimizer steps" in r.getMessage())
    assert line.startswith("lightning_accum: 4 optimizer steps (from step 6)")
    assert "micro-batch 4, settled at 4 from step 6;" in line  # the run's step, not the fit's (it said "step 0")
    # The training time goes on from what the checkpoint holds: the first fit's, up to its last logged step.
    carried = monitor_state["train_seconds"]
    assert carried >= first_rows[5][keys.TRAIN_SECONDS] > 0
    assert rows[6][keys.TRAIN_SECONDS] > carried
    seconds = [rows[s][keys.TRAIN_SECONDS] for s in sorted(rows)]
    assert seconds == sorted(seconds)
    AccumulationMonitor().load_state_dict({})  # an older checkpoint, without the training time, still loads
