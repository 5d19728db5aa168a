"""``lightning-accum``: a usage error is one ``error:`` line and exit status 2, from argparse as from our checks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli.helpers import assert_one_error_line, run_cli

REPO = Path(__file__).resolve().parents[2]
PROBE = ["probe", "--model", "tests.test_probe:ActHeavy", "--data", "tests.test_probe:RegressionData"]


@pytest.mark.parametrize(
    ("argv", "fragments"),
    [
        ([*PROBE, "--steps", "0"], ["--steps", "'0'", ">= 1"]),
        ([*PROBE, "--steps", "two"], ["--steps", "'two'", ">= 1"]),
        ([*PROBE, "--warmup-steps", "-1"], ["--warmup-steps", "'-1'", ">= 0"]),
        ([*PROBE, "--batch-size", "0"], ["--batch-size", "'0'", ">= 1"]),
        ([*PROBE, "--accumulation-steps", "1"], ["--accumulation-steps", "'1'", ">= 2"]),
        ([*PROBE, "--fit-micro-batch-sizes", "8", "0"], ["--fit-micro-batch-sizes", "'0'", ">= 1"]),
        ([*PROBE, "--max-memory", "8"], ["--max-memory", "'8'", "8GiB", "add a unit"]),
        ([*PROBE, "--max-memory", "8iB"], ["--max-memory", "'8iB'", "such as 8GiB"]),
        ([*PROBE, "--max-memory", "0GiB"], ["--max-memory", "'0GiB'", "> 0"]),
        ([*PROBE, "--max-memory", "1GiB", "--budget-gib", "1"], ["--budget-gib", "not allowed with", "--max-memory"]),
        ([*PROBE, "--budget-gib", "-1"], ["--budget-gib", "'-1'", "> 0"]),
        ([*PROBE, "--budget-gib", "nan"], ["--budget-gib", "'nan'", "> 0"]),
        ([*PROBE, "--init-args", "[1]"], ["--init-args", "'[1]'", "JSON object"]),
        (["dashboard", "--project", "p", "--output", "x.json"], ["--entity", "required"]),
        (["report"], ["RUN", "required"]),
        (["nonsense"], ["'nonsense'", "probe"]),
    ],
)
def test_usage_errors_are_one_line(capsys, argv, fragments):
    line = assert_one_error_line(run_cli(capsys, *argv), *fragments, code=2)
    assert "--help" in line  # where to read how to call it


def test_a_real_process_prints_one_line_and_no_traceback():
    # The console script runs `main` and exits with what it returns; `python -m` does the same.
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    for argv, code in (
        (["probe", "--model", "no_such_package.models:Net", "--data", "tests.test_probe:RegressionData"], 1),
        ([*PROBE, "--steps", "0"], 2),
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "lightning_accum.cli.main", *argv],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == code, (argv, proc.stderr)
        assert "Traceback" not in proc.stderr, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
        assert proc.stdout == ""


@pytest.mark.parametrize(
    ("command", "summary", "description"),
    [
        ("probe", "measure peak memory with and without gradient accumulation", "Run a few real training steps"),
        ("report", "plot a run's accumulation, memory, recovery and throughput", "Draw the panels of the"),
        ("dashboard", "create the lightning_accum W&B workspace", "Build the W&B workspace with the Batch"),
    ],
)
def test_each_subcommand_is_listed_with_its_summary_and_describes_itself(capsys, command, summary, description):
    # The entry point builds every subcommand's parser from what the subcommand's module says of itself.
    with pytest.raises(SystemExit, match="0"):
        run_cli(capsys, "--help")
    assert summary in " ".join(capsys.readouterr().out.split())
    with pytest.raises(SystemExit, match="0"):
        run_cli(capsys, command, "--help")
    assert description in " ".join(capsys.readouterr().out.split())
