"""The package's warnings read as ``lightning_accum: <message>`` (issue 36, item 13), every other warning as before."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import lightning_accum

ROOT = Path(__file__).resolve().parents[1]


def test_a_warning_from_the_package_prints_without_its_source_path():
    # A user saw `/.../lightning_accum/split/session.py:242: The step's peak memory ...`: Lightning formats a warning
    # from any path holding "lightning" behind its path and line.
    script = textwrap.dedent(
        """
        import torch
        from lightning_accum.items import CountTokens

        ids = torch.tensor([[5, 6, 7]])
        CountTokens("labels")({"input_ids": ids, "labels": ids.clone()})
        """
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    (line,) = [line for line in done.stderr.splitlines() if "CountTokens" in line]
    assert line.startswith("lightning_accum: `CountTokens(key='labels', ignore_index=-100)` sees labels equal"), line
    assert "items.py" not in line


def test_other_warnings_keep_their_format():
    package_file = lightning_accum.__file__
    assert warnings.formatwarning("careful", UserWarning, package_file, 3) == "lightning_accum: careful\n"
    assert warnings.formatwarning("old", DeprecationWarning, package_file, 3) == (
        "lightning_accum: DeprecationWarning: old\n"
    )
    theirs = warnings.formatwarning("careful", UserWarning, "/elsewhere/train.py", 12)
    assert theirs.startswith("/elsewhere/train.py:12: ") and "careful" in theirs
