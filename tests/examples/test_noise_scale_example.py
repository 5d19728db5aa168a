"""Smoke tests of the noise-scale example (char LM: the noise scale over training, AdaptiveBatchSize vs fixed k) and
of the estimator's overhead benchmark, both at tiny sizes: they run and write what the docs quote, nothing more."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from examples.benchmarks import noise_scale_overhead
from examples.noise_scale import char_lm_noise_scale


@pytest.fixture(autouse=True)
def _keep_threads() -> Iterator[None]:
    """The scripts pin torch to one thread, as their measurements need; give the rest of the session its setting."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_example_logs_finite_noise_scales_and_writes_the_comparison(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    figure = tmp_path / "figure.png"
    char_lm_noise_scale.main(["--tiny", "--out", str(tmp_path), "--plot", str(figure)])

    results = json.loads((tmp_path / "results.json").read_text())
    reference = results["runs"]["k=2"]["curves"]  # --tiny: ks 1,2,4, reference k=2
    noise = [b for b in reference["noise_scale"] if math.isfinite(b)]
    assert len(noise) >= len(reference["noise_scale"]) // 2, "most windows should give an estimate"
    assert all(math.isfinite(v) for v in reference["trace_cov"] + reference["grad_sq_norm"])
    assert not any(math.isfinite(b) for b in results["runs"]["k=1"]["curves"]["noise_scale"]), "k=1 measures nothing"
    for name, rise in results["rise"].items():
        assert math.isfinite(rise["noise_scale_start"]) and math.isfinite(rise["noise_scale_end"]), name

    rows = {row["name"]: row for row in results["comparison"]}
    assert list(rows) == ["k=1", "k=2", "k=4", "adaptive"]
    n_train = results["train_sequences"]
    assert all(row["samples"] == n_train for row in rows.values()), "every run sees the same samples"
    micro_batches = math.ceil(n_train / results["settings"]["batch_size"])
    assert [rows[f"k={k}"]["steps"] for k in (1, 2, 4)] == [math.ceil(micro_batches / k) for k in (1, 2, 4)]
    assert all(math.isfinite(row["held_out_loss"]) for row in rows.values())
    table = (tmp_path / "comparison.md").read_text()
    assert all(f"| {name} |" in table for name in rows)
    assert figure.stat().st_size > 10_000


def test_same_seed_same_data_order_gives_the_same_run(tmp_path: Path) -> None:
    # The comparison is only fair if every variant starts from the same weights on the same samples in order.
    first = char_lm_noise_scale.main(["--tiny", "--only", "k=2", "--out", str(tmp_path / "a")])
    again = char_lm_noise_scale.main(["--tiny", "--only", "k=2", "--out", str(tmp_path / "b")])
    assert first["runs"]["k=2"]["probes"] == again["runs"]["k=2"]["probes"]


def test_overhead_benchmark_quick_mode_reports_a_ratio(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    results = noise_scale_overhead.main(["--quick", "--repeats", "1", "--only", "tiny", "--root", str(tmp_path)])
    (runs,) = results.values()
    assert set(runs) == set(noise_scale_overhead.VARIANTS)
    (ratio,) = noise_scale_overhead.paired_ratios(runs)
    assert ratio > 0
    assert "ratio" in capsys.readouterr().out
