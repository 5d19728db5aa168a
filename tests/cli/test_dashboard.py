"""``lightning-accum dashboard --output``: the workspace spec written offline; it draws exactly the logged keys."""

from __future__ import annotations

import csv
import json

import pytest
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from lightning_accum import AccumulationScheduler, keys
from lightning_accum.callbacks.accumulation_monitor import AccumulationMonitor
from lightning_accum.cli.main import main
from lightning_accum.integrations.wandb import spec_metric_keys
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
    assert drawn - logged <= {keys.PEAK_RESERVED_GIB, *keys.EVENT_KEYS}


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

    def rejected(entity, project, *, name):
        raise wandb.errors.CommError(f"permission denied for {entity}/{project}")

    monkeypatch.setattr(integration, "save_dashboard", rejected)
    outcome = run_cli(capsys, "dashboard", "--entity", "team", "--project", "proj")
    assert_one_error_line(outcome, "team/proj", "permission denied", "--output")
