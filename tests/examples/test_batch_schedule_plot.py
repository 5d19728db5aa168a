"""The batch-schedule benchmark's figure (issue 39, item 5), drawn from a report of its own shape (no training)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _benchmark():
    pytest.importorskip("matplotlib")
    spec = importlib.util.spec_from_file_location("batch_schedule", ROOT / "examples/benchmarks/batch_schedule.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_figure_draws_every_variant_of_every_setting(tmp_path):
    def run(k: int) -> dict:  # (samples, steps, seconds, held-out loss), as `Probe` records them
        return {"points": [[0, 0, 0.0, 2.3], [512, 64 // k, 1.0 + k / 8, 2.0 - k / 100], [1024, 128 // k, 2.5, 1.7]]}

    results = {f"k={k}": [run(k), run(k)] for k in (1, 2, 4)} | {"AdaptiveBatchSize()": [run(2)]}
    report = {key: {"name": f"setting {key}", "target": 1.9, "results": results} for key in ("a", "b")}
    path = tmp_path / "figure" / "batch_schedule.png"  # its folder made as it is written
    _benchmark().plot(report, path)
    assert path.stat().st_size > 10_000
