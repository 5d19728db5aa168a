"""``lightning-accum dashboard --output``: the workspace spec written offline; it draws exactly the logged keys."""

from __future__ import annotations

import csv
import json
import re

import pytest
from lightning.pytorch.loggers import CSVLogger, WandbLogger
from torch import nn
from torch.utils.data import DataLoader

import tests.helpers as h
from lightning_accum import AccumulationScheduler, AutoMicroBatching, keys
from lightning_accum.callbacks.accumulation_monitor import AccumulationMonitor
from lightning_accum.cli.main import main
from lightning_accum.integrations.wandb import (
    USER_SECTION,
    read_offline_run,
    spec_metric_keys,
    spec_metric_patterns,
)
from lightning_accum.memory.oom import OOMFault, OOMInjector
from lightning_accum.monitor.rows import BUDGET_FRACTION
from tests.cli.helpers import assert_one_error_line, run_cli
from tests.helpers import IndexedDataset, RegressionModel, make_trainer

pytest.importorskip("wandb_workspaces", reason="the `wandb` extra is not installed")


def test_dashboard_output_writes_the_spec_without_network(tmp_path, no_network, capsys):
    output = tmp_path / "spec.json"
    assert main(["dashboard", "--entity", "team", "--project", "proj", "--output", str(output)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {output}"
    spec = json.loads(output.read_text())
    assert (spec["entity"], spec["project"], spec["displayName"]) == ("team", "proj", "lightning_accum")

    # The keys the monitor actually logs in a CPU run are all drawn; what is drawn but was not logged is only what
    # a CPU run cannot produce (the CUDA reserved pool) or events that did not happen.
    csv_logger = CSVLogger(str(tmp_path), name="csv")
    trainer = make_trainer(tmp_path, [AccumulationScheduler(2), AccumulationMonitor()], logger=csv_logger)
    trainer.fit(RegressionModel(), DataLoader(IndexedDataset(16), batch_size=4))
    with open(f"{csv_logger.log_dir}/metrics.csv") as f:
        logged = set(next(csv.reader(f))) - {"step", "epoch"}
    drawn = spec_metric_keys(spec)
    assert logged <= drawn
    optional = {
        keys.PEAK_RESERVED_GIB,
        keys.ALLOC_RETRIES,
        *keys.EVENT_KEYS,
        *keys.NOISE_SCALE_KEYS,
        *keys.TOKEN_KEYS,
        *keys.RANK_KEYS,
        *keys.PRICE_KEYS,
        *keys.GOODPUT_KEYS,  # AdaptiveBatchSize(objective="goodput") only
    }
    assert drawn - logged <= optional


def test_the_dashboard_draws_every_key_a_run_split_by_tokens_logs(tmp_path, no_network):
    from tests.callbacks.test_monitor import token_fit

    output = tmp_path / "spec.json"
    assert main(["dashboard", "--entity", "team", "--project", "proj", "--output", str(output)]) == 0
    csv_logger = CSVLogger(str(tmp_path), name="csv")
    token_fit(tmp_path, csv_logger, [AccumulationMonitor()])
    with open(f"{csv_logger.log_dir}/metrics.csv") as f:
        logged = set(next(csv.reader(f))) - {"step", "epoch"}
    assert set(keys.TOKEN_KEYS) <= logged <= spec_metric_keys(json.loads(output.read_text()))


def test_dashboard_needs_entity_and_project(capsys, tmp_path):
    outcome = run_cli(capsys, "dashboard", "--project", "p", "--output", str(tmp_path / "x.json"))
    assert_one_error_line(outcome, "--entity", code=2)
    outcome = run_cli(capsys, "dashboard", "--entity", "", "--project", "p", "--output", str(tmp_path / "x.json"))
    assert_one_error_line(outcome, "`--entity` must name a W&B entity, got ''")
    outcome = run_cli(capsys, "dashboard", "--entity", "team", "--project", " ", "--output", str(tmp_path / "x.json"))
    assert_one_error_line(outcome, "`--project` must name a W&B project, got ' '")
    assert not (tmp_path / "x.json").exists()


def test_unwritable_output(capsys, tmp_path, no_network):
    (tmp_path / "blocker.txt").write_text("")
    output = tmp_path / "blocker.txt" / "spec.json"
    outcome = run_cli(capsys, "dashboard", "--entity", "team", "--project", "proj", "--output", str(output))
    assert_one_error_line(outcome, "`--output`", repr(str(output)), "not a directory")


@pytest.fixture
def no_login(monkeypatch, tmp_path):
    """No W&B credentials anywhere wandb looks: no key in the environment, an empty home, no netrc."""
    for var in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("NETRC", str(tmp_path / ".netrc"))
    for var in ("WANDB_CONFIG_DIR", "WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb"))
    # wandb keeps its settings and any session login in a process-wide singleton: start and leave without one.
    wandb = pytest.importorskip("wandb")
    wandb.teardown()
    yield
    wandb.teardown()


@pytest.mark.timeout(60)  # a wandb that prompts for a key must fail the test, not hang it
@pytest.mark.parametrize("api_key", [None, ""])
def test_upload_without_a_login_stops_before_the_network(capsys, monkeypatch, no_login, no_network, api_key):
    import lightning_accum.integrations.wandb as integration

    def upload(*args, **kwargs):
        raise AssertionError("the upload was tried without a login")

    monkeypatch.setattr(integration, "save_dashboard", upload)
    if api_key is not None:
        monkeypatch.setenv("WANDB_API_KEY", api_key)
    outcome = run_cli(capsys, "dashboard", "--entity", "team", "--project", "proj")
    assert_one_error_line(outcome, "W&B login", "wandb login", "WANDB_API_KEY", "--output")
    assert outcome.out == ""


@pytest.mark.timeout(60)
def test_a_malformed_api_key_is_one_line(capsys, monkeypatch, no_login, no_network):
    monkeypatch.setenv("WANDB_API_KEY", "not a key")
    outcome = run_cli(capsys, "dashboard", "--entity", "team", "--project", "proj")
    assert_one_error_line(outcome, "WANDB_API_KEY", "wandb login")


@pytest.mark.timeout(60)
def test_a_failed_upload_is_one_line(capsys, monkeypatch, no_login, no_network):
    import wandb

    import lightning_accum.integrations.wandb as integration

    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)  # well formed, so the upload is tried

    def rejected(entity, project, **options):
        raise wandb.errors.CommError(f"permission denied for {entity}/{project}")

    monkeypatch.setattr(integration, "save_dashboard", rejected)
    outcome = run_cli(capsys, "dashboard", "--entity", "team", "--project", "proj")
    assert_one_error_line(outcome, "team/proj", "permission denied", "--output")


# ---- the user's own metrics, the capacity, the events' run summary ------------------------------------------------
class LogsTrainAndVal(RegressionModel):
    """Logs ``train/loss`` and ``val/loss``, as a user's model does."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", nn.functional.mse_loss(self.layer(batch["x"]), batch["y"]))


def _workspace(spec: dict):
    # Validated by wandb-workspaces itself: the JSON parses back into its View model and its Workspace.
    from wandb_workspaces.workspaces import Workspace, internal

    return Workspace._from_model(internal.View.model_validate(spec))


def test_the_users_own_metrics_get_panels(tmp_path, no_network, capsys):
    output = tmp_path / "spec.json"
    argv = ["dashboard", "--entity", "team", "--project", "proj", "--user-keys", "train_loss_step", "-o", str(output)]
    assert main(argv) == 0
    spec = json.loads(output.read_text())
    sections = {section.name: section.panels for section in _workspace(spec).sections}
    assert list(sections) == [*h.DASHBOARD_SECTIONS, USER_SECTION]
    assert [panel.metric_regex for panel in sections[USER_SECTION][:2]] == ["^train/.*", "^val/.*"]
    assert [metric.name for metric in sections[USER_SECTION][2].y] == ["train_loss_step"]

    # Every key a user's run logs that is not ours is drawn: by one of the patterns, or by name.
    csv_logger = CSVLogger(str(tmp_path), name="csv")
    trainer = make_trainer(tmp_path, [AccumulationScheduler(2), AccumulationMonitor()], logger=csv_logger)
    data = DataLoader(IndexedDataset(16), batch_size=4)
    trainer.fit(LogsTrainAndVal(), data, data)
    with open(f"{csv_logger.log_dir}/metrics.csv") as f:
        logged = set(next(csv.reader(f))) - {"step", "epoch"} - spec_metric_keys(spec)
    assert logged == {"train/loss", "val/loss"}
    assert all(any(re.match(p, key) for p in spec_metric_patterns(spec)) for key in logged)


def test_no_user_prefixes_means_no_user_section(tmp_path, no_network):
    output = tmp_path / "spec.json"
    assert main(["dashboard", "--entity", "t", "--project", "p", "--user-prefixes", "-o", str(output)]) == 0
    names = [section.name for section in _workspace(json.loads(output.read_text())).sections]
    assert names == h.DASHBOARD_SECTIONS


def test_the_capacity_is_a_number_and_the_budget_shares_the_peaks_panel(tmp_path, no_network):
    from wandb_workspaces.reports.v2 import ScalarChart

    output = tmp_path / "spec.json"
    assert main(["dashboard", "--entity", "t", "--project", "p", "-o", str(output)]) == 0
    memory = next(s for s in _workspace(json.loads(output.read_text())).sections if s.name == "Memory")
    capacity = [panel for panel in memory.panels if isinstance(panel, ScalarChart)]
    assert [panel.metric.name for panel in capacity] == [keys.CAPACITY_GIB]
    lines = [[metric.name for metric in panel.y] for panel in memory.panels if panel not in capacity]
    assert [keys.PEAK_FRACTION, BUDGET_FRACTION] in lines and all(keys.CAPACITY_GIB not in y for y in lines)


def test_an_events_run_summary_is_not_its_last_size(tmp_path, wandb_offline):
    import wandb

    # Step batches of 8 in micro-batches of 4; an OOM in step 1 halves them to 2, so the event's value is 2.
    injector = OOMInjector(OOMFault(step=1, micro_batch=0, phase="backward"))
    owner = AutoMicroBatching(4, max_memory=0.5, fault_injector=injector)
    trainer = make_trainer(
        tmp_path, [owner, AccumulationMonitor()], logger=WandbLogger(project="accum", save_dir=str(tmp_path))
    )
    trainer.fit(RegressionModel(), DataLoader(IndexedDataset(24), batch_size=8))
    wandb.finish()
    run = read_offline_run(tmp_path / "wandb", wait_s=10)
    assert run.column(keys.EVENT_OOM_RECOVERED) == [(1, 2)]
    # The summary is the number of events (it used to read `events/oom_recovered: 2`, the size after the OOM).
    assert run.summary[keys.EVENT_OOM_RECOVERED] == 1 == run.summary[keys.OOM_RETRIES]
    assert run.summary[keys.EVENT_GROW] == run.summary[keys.EVENT_SHRINK] == 0
    assert run.summary[keys.EVENT_SCHEDULE_CHANGE] == 0
    assert all(run.metrics[key]["summary"] == ["none"] for key in keys.EVENT_KEYS)


def test_a_key_prefix_keeps_the_metric_definitions(tmp_path, wandb_offline):
    import wandb

    owner = AutoMicroBatching(4, max_memory=0.5, fault_injector=OOMInjector(OOMFault(step=1, micro_batch=0)))
    monitor = AccumulationMonitor(key_prefix="run2/")
    logger = WandbLogger(project="accum", save_dir=str(tmp_path))
    make_trainer(tmp_path, [owner, monitor], logger=logger).fit(
        RegressionModel(), DataLoader(IndexedDataset(24), batch_size=8)
    )
    wandb.finish()
    run = read_offline_run(tmp_path / "wandb", wait_s=10)
    assert run.metrics["run2/" + keys.PEAK_GIB]["summary"] == ["max"]
    assert run.metrics["run2/" + keys.EVENT_OOM_RECOVERED]["summary"] == ["none"]
    assert run.summary["run2/" + keys.EVENT_OOM_RECOVERED] == 1
