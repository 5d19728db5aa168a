"""``lightning-accum report``: a PNG of the dashboard's panels from a real offline W&B run and from a CSV."""

from __future__ import annotations

from pathlib import Path

import pytest
from lightning.pytorch.loggers import CSVLogger, WandbLogger
from torch.utils.data import DataLoader

from lightning_accum import AccumulationScheduler, keys
from lightning_accum.callbacks.accumulation_monitor import AccumulationMonitor
from lightning_accum.cli.main import main
from lightning_accum.cli.report import load_series
from lightning_accum.integrations.wandb import layout_keys, read_offline_run
from tests.helpers import IndexedDataset, RegressionModel, make_trainer

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory):
    """One real training run, logged to an offline W&B run and to a CSVLogger at once."""
    wandb = pytest.importorskip("wandb", reason="the `wandb` extra is not installed")
    tmp_path = tmp_path_factory.mktemp("run")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_MODE", "offline")
        mp.setenv("WANDB_SILENT", "true")
        for var in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
            mp.setenv(var, str(tmp_path))
        try:
            loggers = [WandbLogger(project="accum", save_dir=str(tmp_path)), CSVLogger(str(tmp_path), name="csv")]
            trainer = make_trainer(
                tmp_path,
                [AccumulationScheduler({0: 1, 2: 2}, unit="step"), AccumulationMonitor()],
                logger=loggers,
                max_epochs=2,
            )
            trainer.fit(RegressionModel(), DataLoader(IndexedDataset(40), batch_size=4))
            wandb.finish()
            assert read_offline_run(tmp_path / "wandb", wait_s=10).exit_code == 0  # the file is complete
        finally:
            wandb.teardown()
    return tmp_path, Path(loggers[1].log_dir) / "metrics.csv"


def test_report_from_an_offline_wandb_run(logged_run, tmp_path, capsys):
    run_dir, _ = logged_run
    output = tmp_path / "out" / "report.png"
    assert main(["report", str(run_dir / "wandb"), "--output", str(output)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {output}"
    data = output.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 50_000  # 11 drawn panels, not an empty canvas


def test_report_from_a_csv_logger_file(logged_run, tmp_path):
    _, csv_file = logged_run
    output = tmp_path / "csv.png"
    assert main(["report", str(csv_file), "--output", str(output), "--title", "from CSV"]) == 0
    assert output.read_bytes().startswith(PNG_MAGIC)


def test_wandb_and_csv_give_the_same_series(logged_run):
    run_dir, csv_file = logged_run
    from_wandb, from_csv = load_series(run_dir / "wandb"), load_series(csv_file.parent)
    drawn = [key for key in layout_keys() if from_wandb.get(key)]
    assert keys.EFFECTIVE_BATCH_SIZE in drawn and keys.EVENT_SCHEDULE_CHANGE in drawn
    for key in drawn:
        assert [s for s, _ in from_csv[key]] == [s for s, _ in from_wandb[key]], key
        assert [v for _, v in from_csv[key]] == pytest.approx([v for _, v in from_wandb[key]], rel=1e-6), key
    # The step schedule doubled k after two optimizer steps: 4, 4, then 8 samples per step.
    assert [v for _, v in from_wandb[keys.EFFECTIVE_BATCH_SIZE][:3]] == [4, 4, 8]


def test_report_errors_name_the_problem(tmp_path):
    with pytest.raises(SystemExit, match="error: No W&B run at"):
        main(["report", str(tmp_path / "missing"), "--output", str(tmp_path / "x.png")])
    other = tmp_path / "metrics.csv"
    other.write_text("step,val_loss\n1,0.5\n")
    with pytest.raises(SystemExit, match="holds none of the lightning_accum metrics"):
        main(["report", str(other), "--output", str(tmp_path / "x.png")])
    bad = tmp_path / "bad.csv"
    bad.write_text("epoch,loss\n0,1\n")
    with pytest.raises(SystemExit, match="has no `step` column"):
        main(["report", str(bad)])
