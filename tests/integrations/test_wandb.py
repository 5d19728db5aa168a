"""The W&B integration, offline only: metric definitions and config in real offline runs, our reader of the
``.wandb`` transaction log (checked against ``wandb leet inspect``), and the dashboard spec built without network."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import tests.helpers as h
from lightning_accum import keys
from lightning_accum.integrations import wandb as integration
from lightning_accum.integrations import wandb_offline as reader
from lightning_accum.integrations.wandb import (
    CONFIG_KEY,
    MAX_SUMMARY_KEYS,
    MEAN_SUMMARY_KEYS,
    NO_SUMMARY_KEYS,
    PANEL_LAYOUT,
    STEP_METRIC,
    dashboard_spec,
    define_metrics,
    layout_keys,
    record_config,
    spec_metric_keys,
    spec_to_dict,
    spec_to_json,
)
from lightning_accum.integrations.wandb_offline import OfflineRun, find_run_file, iter_records, read_offline_run
from lightning_accum.monitor.rows import BUDGET_FRACTION

wandb = pytest.importorskip("wandb", reason="the `wandb` extra is not installed")

CONTRACT_KEYS = {
    *keys.ALL_KEYS,
    BUDGET_FRACTION,
    *keys.EVENT_KEYS,
    *keys.NOISE_SCALE_KEYS,
    *keys.TOKEN_KEYS,
    *keys.RANK_KEYS,
    *keys.PRICE_KEYS,
    *keys.SCHEDULE_KEYS,
    *keys.GOODPUT_KEYS,
}


def logged_run(tmp_path: Path) -> tuple[OfflineRun, list[dict], dict]:
    """A real offline run with known rows, a nested config and a row large enough to span several 32 KiB blocks."""
    rows = [
        {STEP_METRIC: step, keys.PEAK_GIB: peak, keys.EFFECTIVE_BATCH_SIZE: 8 * (step + 1), "text": f"s{step}"}
        for step, peak in enumerate([1.5, 3.25, 2.0])
    ]
    rows.append({STEP_METRIC: 3, keys.WINDOW_LOSS: math.nan, "blob": "x" * 100_000, "flag": True, "none": None})
    settings = {"mode": "window", "k": 4, "schedule": {"0": 2, "10": 4}, "fn": len}
    run = wandb.init(project="accum", dir=str(tmp_path))
    define_metrics(run, tokens=True, ranks=True)
    record_config(run, settings)
    for row in rows:
        run.log(row)
    wandb.finish()
    return read_offline_run(tmp_path / "wandb", wait_s=10), rows, settings


def test_reader_returns_history_summary_config_and_metric_definitions(tmp_path, wandb_offline):
    run, rows, settings = logged_run(tmp_path)

    assert len(run) == len(rows) and run.exit_code == 0 and run.project == "accum"
    for got, want in zip(run.history, rows, strict=True):
        for key, value in want.items():
            if isinstance(value, float) and math.isnan(value):
                assert math.isnan(got[key])
            else:
                assert got[key] == value, key
    assert [row["_step"] for row in run] == [0, 1, 2, 3]
    assert run.column(keys.PEAK_GIB) == [(0, 1.5), (1, 3.25), (2, 2.0)]

    # define_metrics: every contract key against trainer/global_step, max summaries for the peaks, the padding's mean.
    for key in CONTRACT_KEYS:
        assert run.metrics[key]["step_metric"] == STEP_METRIC, key
        expected = ["max"] if key in MAX_SUMMARY_KEYS else ["none"] if key in NO_SUMMARY_KEYS else []
        expected = ["mean"] if key in MEAN_SUMMARY_KEYS else expected
        assert run.metrics[key]["summary"] == expected, key
    assert run.summary[keys.PEAK_GIB] == {"max": 3.25}
    assert run.summary[keys.EFFECTIVE_BATCH_SIZE] == 24  # the last value
    # record_config: the settings under one entry, made JSON-safe (a function becomes its repr).
    assert run.config[CONFIG_KEY] == {**settings, "fn": repr(len)}


class DefinedMetrics:
    """Stands in for a W&B run: the keys `define_metrics` defines on it, and how."""

    def __init__(self) -> None:
        self.defined: dict[str, dict] = {}

    def define_metric(self, name: str, **kwargs) -> None:
        self.defined[name] = kwargs


def test_the_token_keys_are_defined_only_for_a_run_split_by_tokens():
    by_samples, by_tokens = DefinedMetrics(), DefinedMetrics()
    define_metrics(by_samples, "p/")
    define_metrics(by_tokens, "p/", tokens=True)
    assert set(by_tokens.defined) - set(by_samples.defined) == {"p/" + key for key in keys.TOKEN_KEYS}
    assert by_tokens.defined["p/" + keys.PADDING_FRACTION]["summary"] == "mean"  # the run's typical padding
    assert "summary" not in by_tokens.defined["p/" + keys.MICRO_BATCH_TOKENS]  # its last value: where it settled
    assert by_tokens.defined["p/" + keys.MICRO_BATCH_TOKENS]["step_metric"] == STEP_METRIC


def test_reader_accepts_a_file_a_run_directory_or_a_wandb_directory(tmp_path, wandb_offline):
    run, _, _ = logged_run(tmp_path)
    run_dir = run.path.parent
    assert run_dir.name.startswith("offline-run-")
    for path in (run.path, run_dir, tmp_path / "wandb", tmp_path):
        assert find_run_file(path) == run.path
    with pytest.raises(FileNotFoundError, match="No W&B run under"):
        find_run_file(tmp_path / "wandb" / "latest-run" / "files")
    with pytest.raises(FileNotFoundError, match="no such file"):
        find_run_file(tmp_path / "missing")


def test_reader_spans_blocks_and_refuses_corrupt_or_foreign_files(tmp_path, wandb_offline):
    run, _, _ = logged_run(tmp_path)
    data = run.path.read_bytes()
    assert len(data) > 3 * 32 * 1024  # the 100 kB row crosses block boundaries (FIRST/MIDDLE/LAST records)
    assert sum(1 for _ in iter_records(run.path)) > len(run.history)

    corrupt = tmp_path / "corrupt.wandb"
    flipped = bytearray(data)
    flipped[40_000] ^= 0xFF  # inside the big row
    corrupt.write_bytes(bytes(flipped))
    with pytest.raises(ValueError, match="checksum mismatch"):
        read_offline_run(corrupt)

    foreign = tmp_path / "foreign.wandb"
    foreign.write_bytes(b"SQLite format 3\x00" + data[16:])
    with pytest.raises(ValueError, match="is not a W&B transaction log"):
        read_offline_run(foreign)

    truncated = tmp_path / "truncated.wandb"
    truncated.write_bytes(data[: len(data) - 100])  # a run killed mid-write: the complete records still read
    assert len(read_offline_run(truncated).history) >= len(run.history) - 1


def test_reader_is_still_importable_from_the_integration():
    # It moved to `wandb_offline`; `report`, the monitor's tests and users import it from `wandb`.
    for name in ("OfflineRun", "find_run_file", "iter_records", "read_offline_run", "STEP_METRIC"):
        assert getattr(integration, name) is getattr(reader, name), name
        assert name in integration.__all__


def _wandb_cli() -> str | None:
    exe = shutil.which("wandb", path=str(Path(sys.executable).parent)) or shutil.which("wandb")
    if exe is None:
        return None
    probe = subprocess.run([exe, "leet", "inspect", "--help"], capture_output=True, text=True, timeout=60)
    return exe if probe.returncode == 0 else None


def test_reader_agrees_with_wandb_leet_inspect(tmp_path, wandb_offline):
    exe = _wandb_cli()
    if exe is None:  # `leet inspect` arrived in wandb 0.2x; the reader itself is covered above
        pytest.skip("this wandb has no `wandb leet inspect` command")
    run, _, _ = logged_run(tmp_path)

    summary = subprocess.run(
        [exe, "leet", "inspect", "--summary", "--json", str(run.path)], capture_output=True, text=True, timeout=120
    )
    assert summary.returncode == 0, summary.stderr
    theirs = json.loads(summary.stdout)
    assert theirs["run_id"] == run.run_id
    assert theirs["config"][CONFIG_KEY] == run.config[CONFIG_KEY]
    for key in (keys.PEAK_GIB, keys.EFFECTIVE_BATCH_SIZE, STEP_METRIC, "_step"):
        assert theirs["summary"][key] == run.summary[key], key

    records = subprocess.run(
        [exe, "leet", "inspect", "--json", str(run.path)], capture_output=True, text=True, timeout=120
    )
    assert records.returncode == 0, records.stderr
    history = [json.loads(line)["history"] for line in records.stdout.splitlines() if '"type":"history"' in line]
    assert len(history) == len(run.history)
    for theirs_row, ours in zip(history, run.history, strict=True):
        assert theirs_row["item"][STEP_METRIC] == ours[STEP_METRIC]
        if keys.PEAK_GIB in ours:
            assert theirs_row["item"][keys.PEAK_GIB] == ours[keys.PEAK_GIB]


# ----------------------------------------------------------------------------------------------------------------
# the dashboard
# ----------------------------------------------------------------------------------------------------------------
def test_dashboard_spec_is_built_offline_and_names_exactly_the_contract_keys(no_network):
    workspace = dashboard_spec("my-team", "my-project")
    spec = spec_to_dict(workspace)  # the private `_to_model()` this relies on is still there and offline

    assert spec["entity"] == "my-team" and spec["project"] == "my-project"
    assert spec_metric_keys(spec) == CONTRACT_KEYS == set(layout_keys())
    sections = spec["spec"]["section"]["panelBankConfig"]["sections"]
    assert [s["name"] for s in sections] == h.DASHBOARD_SECTIONS
    panels = [p for s in sections for p in s["panels"]]
    assert {p["config"]["xAxis"] for p in panels if "xAxis" in p["config"]} == {STEP_METRIC}
    assert spec["spec"]["section"]["settings"]["xAxis"] == STEP_METRIC
    # The budget is drawn in the same panel as the peak fraction, so the limit is visible next to the peak.
    fraction = next(p for p in panels if p["config"]["chartTitle"] == "Peak fraction vs budget")
    assert fraction["config"]["metrics"] == [keys.PEAK_FRACTION, BUDGET_FRACTION]
    # Split by tokens: the budget and the padding, a panel each (tokens and a fraction share no axis).
    tokens = {p["config"]["chartTitle"]: p["config"]["metrics"] for p in sections[1]["panels"]}
    assert tokens == {"Token budget": [keys.MICRO_BATCH_TOKENS], "Padding": [keys.PADDING_FRACTION]}
    assert json.loads(spec_to_json(workspace))["spec"]["section"]["panelBankConfig"]["sections"][0]["name"] == "Batch"


def test_dashboard_layout_has_the_four_sections_of_the_brief():
    names = {section.name: [p.title for p in section.panels] for section in PANEL_LAYOUT}
    assert names["Batch"][:4] == ["Effective batch size", "Micro-batch size", "Accumulation steps", "Items per step"]
    assert names["Throughput"] == ["Samples / s", "Items / s", "Training time", "Samples seen", "Items seen"]


@pytest.mark.parametrize(("entity", "project"), [("", "p"), ("e", "")])
def test_dashboard_spec_refuses_an_empty_entity_or_project(entity, project):
    with pytest.raises(ValueError, match="`entity` and `project` must be non-empty"):
        dashboard_spec(entity, project)


def test_the_docs_say_how_each_logger_files_the_monitors_keys_next_to_yours(tmp_path, wandb_offline):
    # Issue 19, item 8: docs/wandb.md said `accum/window_loss` and `train/loss` "share a row". In a real run they
    # carry the same step, in two W&B history rows and two CSV rows (TensorBoard, checked by hand, has no rows).
    import csv

    from lightning.pytorch.loggers import CSVLogger, WandbLogger
    from torch.utils.data import DataLoader

    from lightning_accum import AccumulationMonitor, AccumulationScheduler
    from tests.helpers import IndexedDataset, RegressionModel, make_trainer

    class LogsItsLoss(RegressionModel):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.log("train/loss", loss, on_step=True, on_epoch=False)
            return loss

    loggers = [WandbLogger(project="rows", save_dir=str(tmp_path)), CSVLogger(str(tmp_path), name="csv")]
    trainer = make_trainer(tmp_path, [AccumulationScheduler(2), AccumulationMonitor()], logger=loggers)
    trainer.fit(LogsItsLoss(), DataLoader(IndexedDataset(24), batch_size=4))  # 3 optimizer steps
    wandb.finish()

    def steps_of(rows: list[dict], step_key: str) -> tuple[list[int], list[int]]:
        ours = [int(float(r[step_key])) for r in rows if r.get(keys.WINDOW_LOSS) not in (None, "")]
        yours = [int(float(r[step_key])) for r in rows if r.get("train/loss") not in (None, "")]
        both = [r for r in rows if r.get(keys.WINDOW_LOSS) not in (None, "") and r.get("train/loss") not in (None, "")]
        assert both == []  # never in one row
        return ours, yours

    history = read_offline_run(tmp_path / "wandb", wait_s=10).history
    assert steps_of(history, STEP_METRIC) == ([0, 1, 2], [0, 1, 2])
    with open(Path(loggers[1].log_dir) / "metrics.csv") as f:
        assert steps_of(list(csv.DictReader(f)), "step") == ([0, 1, 2], [0, 1, 2])

    docs = (Path(__file__).parents[2] / "docs" / "wandb.md").read_text()
    assert "share a row" not in docs
    assert "two history rows" in docs and "two rows of `metrics.csv` with the same `step`" in docs
