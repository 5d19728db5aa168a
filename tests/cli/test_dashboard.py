"""``lightning-accum dashboard --output``: the workspace spec written offline; it draws exactly the logged keys."""

from __future__ import annotations

import csv
import json
import socket

import pytest
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from lightning_accum import AccumulationScheduler, keys
from lightning_accum.callbacks.accumulation_monitor import AccumulationMonitor
from lightning_accum.cli.main import main
from lightning_accum.integrations.wandb import spec_metric_keys
from tests.helpers import IndexedDataset, RegressionModel, make_trainer

pytest.importorskip("wandb_workspaces", reason="the `wandb` extra is not installed")


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args!r}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


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


def test_dashboard_needs_entity_and_project(capsys):
    with pytest.raises(SystemExit):
        main(["dashboard", "--project", "p", "--output", "x.json"])
    assert "--entity" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="`entity` and `project` must be non-empty"):
        main(["dashboard", "--entity", "", "--project", "p", "--output", "x.json"])
