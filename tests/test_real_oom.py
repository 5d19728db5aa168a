"""A real out-of-memory error on CPU: training under an address-space limit (RLIMIT_AS) in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
HEADROOM_MIB = 100  # the 2048-sample step batch needs several 64 MiB activations; 256 samples fit


def train(out: Path, *flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "tests.scripts.real_oom", str(out), str(HEADROOM_MIB), *flags],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc are Linux features")
@pytest.mark.timeout(480)
def test_real_oom_is_recovered_and_the_update_equals_the_full_batch_update(tmp_path):
    plain = train(tmp_path / "plain.pt", "--plain")
    assert plain.returncode != 0 and "can't allocate memory" in plain.stderr, "the limit must bite without the callback"

    constrained = train(tmp_path / "split.pt")
    assert constrained.returncode == 0, constrained.stderr[-3000:]
    reference = train(tmp_path / "reference.pt", "--plain", "--no-limit")
    assert reference.returncode == 0, reference.stderr[-3000:]

    split = torch.load(tmp_path / "split.pt")
    full = torch.load(tmp_path / "reference.pt")
    assert split["oom_retries"] >= 1
    assert all(kind == "oom_recovered" for _, kind, _, _ in split["events"])
    settled = split["sizes"][-1]
    assert settled < 2048, split["sizes"]
    for name, value in full["params"].items():
        torch.testing.assert_close(split["params"][name], value, rtol=1e-5, atol=1e-6)
