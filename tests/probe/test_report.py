"""The probe's report: the table and its findings, the JSON, the plot."""

from __future__ import annotations

import json

import pytest

from lightning_accum.memory.model import LinearPeakModel
from lightning_accum.memory.sizes import format_size
from lightning_accum.probe import ProbeMeasurement, ProbeResult, present, probe_memory
from lightning_accum.probe import sample_report as report
from tests.probe import models


def test_table_dict_and_plot(act_heavy, tmp_path):
    table = present.table(act_heavy)
    assert "b=" not in table.splitlines()[1]  # header row
    assert "the micro-batch size, not k, sets activation memory" in table.lower()
    data = json.loads(json.dumps(present.to_dict(act_heavy)))
    assert {(m["micro_batch_size"], m["accumulation_steps"]) for m in data["measurements"]} >= {
        (512, 1),
        (256, 2),
        (256, 1),
        (128, 4),
        (128, 1),
    }
    assert data["fit"]["holdout_relative_error"] == act_heavy.holdout_error
    assert [c["k"] for c in data["comparisons"]] == [2, 4]
    png = present.plot(act_heavy, tmp_path / "probe.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_snippet_is_ready_to_paste_in_python_and_yaml(act_heavy):
    import yaml

    from lightning_accum import AutoMicroBatching

    b = act_heavy.fitting_micro_batch_size
    snippet = present.snippet(act_heavy)
    python, _, config = snippet.partition("\n# or in a LightningCLI config:\n")
    callback = eval(python.split("  #")[0], {"AutoMicroBatching": AutoMicroBatching})
    assert isinstance(callback, AutoMicroBatching)
    parsed = yaml.safe_load(config)
    (entry,) = parsed["trainer"]["callbacks"]
    assert entry["class_path"] == "lightning_accum.AutoMicroBatching"
    assert entry["init_args"]["micro_batch_size"] == b and parsed["data"]["batch_size"] == 512
    assert entry["init_args"]["max_memory"] == "2MiB" and AutoMicroBatching(**entry["init_args"]).max_memory == 2**21
    assert "Ready to paste" in present.table(act_heavy) and present.to_dict(act_heavy)["snippet"] == snippet


# ---- units per value, and a plot that agrees with the recommendation (issue 19, item 4) ------------------------------

GiB = 2**30


class _Tiny(models._Stack):
    def __init__(self) -> None:
        super().__init__(width=8, depth=2)


def test_a_tiny_model_reads_in_kib_not_in_hundredths_of_a_mib():
    result = probe_memory(
        _Tiny, lambda b: models.regression_batch(b, 8), batch_size=8, accumulation_steps=(2,), budget_bytes=64 * 1024
    )
    text = present.table(result)
    header = text.splitlines()[0]
    print("\n" + text)
    assert "0.01 MiB" not in text and "0.00 MiB" not in text
    # 2 x (8 x 8 + 8) float parameters: 576 bytes, under a KiB
    assert header.startswith("Peak live tensor memory in KiB on cpu") and "parameters 576 B" in header
    fit = next(line for line in present.findings(result) if line.startswith("Fitted peak(b)"))
    assert fit.startswith(f"Fitted peak(b) = {format_size(result.peak_model.fixed_bytes)} + ")
    assert " KiB + " in fit or " B + " in fit
    assert json.loads(json.dumps(present.to_dict(result)))["parameter_bytes"] == 576  # the JSON stays in bytes


def _llama8b_like(budget_bytes: float, headroom: float = 0.1) -> ProbeResult:
    """The 8B prediction's figures (docs/memory.md), without tracing it: peak(b) = 59.83 GiB + 16.01 GiB x b."""
    fixed, slope = 59.83 * GiB, 16.01 * GiB
    peaks = {(8, 1): 172.92, (1, 8): 75.84, (1, 1): 74.79, (2, 2): (fixed + 2 * slope) / GiB, (4, 2): None}
    peaks[(4, 2)] = (fixed + 4 * slope) / GiB
    measurements = []
    for (b, k), peak in peaks.items():
        split = {"parameters": 14.96, "gradients": 14.96 if k > 1 else 0.0, "optimizer_state": 29.92}
        split["activations"] = peak - sum(split.values())
        breakdown = {category: int(gib * GiB) for category, gib in split.items()}
        measurements.append(ProbeMeasurement(b, k, int(peak * GiB), breakdown, "backward 1/1"))
    model = LinearPeakModel()
    for b in (1, 2, 4):
        model.observe(b, fixed + slope * b)
    return ProbeResult(
        batch_size=8,
        device="meta (as cuda)",
        measurements=measurements,
        parameter_bytes=16_060_522_496,
        gradient_bytes=16_060_522_496,
        accumulation_steps=[8],
        peak_model=model,
        budget_bytes=budget_bytes,
        target="cuda",
        precision="bf16-true",
        headroom=headroom,
    )


def test_8b_sized_figures_read_in_gib():
    result = _llama8b_like(141 * GiB)
    text = present.table(result)
    assert "177074.85" not in text and "MiB" not in text
    assert text.startswith("Predicted peak live tensor memory in GiB on meta (as cuda), bf16-true")
    assert "parameters 14.96 GiB" in text and "172.92" in text.splitlines()[2]
    assert "Fitted peak(b) = 59.83 GiB + 16.01 GiB x b with accumulation" in text


@pytest.mark.parametrize(("budget_gib", "headroom"), [(141, 0.1), (141, 0.0), (100, 0.1)])
def test_the_plot_draws_the_budget_the_recommendation_uses(budget_gib: float, headroom: float):
    result = _llama8b_like(budget_gib * GiB, headroom)
    b = result.fitting_micro_batch_size
    assert f"the largest micro-batch that fits is b={b} " in present.table(result)
    fig = report.figure(result)
    try:
        ax = fig.axes[1]
        lines = {line.get_label(): line for line in ax.get_lines()}
        usable = budget_gib * (1 - headroom)  # GiB: the axis unit
        budget_line = next(line for label, line in lines.items() if label.startswith("budget "))
        assert budget_line.get_ydata()[0] == pytest.approx(budget_gib)
        used = [line for label, line in lines.items() if label.startswith("budget less 10% kept free")]
        assert len(used) == (1 if headroom else 0)
        if headroom:
            assert used[0].get_ydata()[0] == pytest.approx(usable)
        (chosen,) = [line for label, line in lines.items() if label.startswith(f"b={b}: the largest predicted to fit")]
        assert chosen.get_xdata()[0] == b
        # The fitted line is under the line the recommendation uses at b, and over it at b + 1.
        fit = lines["fit (k>=2)"]
        (x0, x1), (y0, y1) = fit.get_xdata(), fit.get_ydata()
        at = lambda x: y0 + (y1 - y0) * (x - x0) / (x1 - x0)  # noqa: E731
        assert at(b) <= usable < at(b + 1)
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
    if (budget_gib, headroom) == (141, 0.1):
        # The case: the whole budget fits b=5, the recommendation keeps 10% free and says b=4.
        assert b == 4 and result.peak_model.largest_fitting(141 * GiB, 8) == 5
