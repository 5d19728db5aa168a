"""The probe's report: the table and its findings, the JSON, the plot."""

from __future__ import annotations

import json


def test_table_dict_and_plot(act_heavy, tmp_path):
    table = act_heavy.table()
    assert "b=" not in table.splitlines()[1]  # header row
    assert "the micro-batch size, not k, sets activation memory" in table.lower()
    data = json.loads(json.dumps(act_heavy.to_dict()))
    assert {(m["micro_batch_size"], m["accumulation_steps"]) for m in data["measurements"]} >= {
        (512, 1),
        (256, 2),
        (256, 1),
        (128, 4),
        (128, 1),
    }
    assert data["fit"]["holdout_relative_error"] == act_heavy.holdout_error
    assert [c["k"] for c in data["comparisons"]] == [2, 4]
    png = act_heavy.plot(tmp_path / "probe.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_snippet_is_ready_to_paste_in_python_and_yaml(act_heavy):
    import yaml

    from lightning_accum import AutoMicroBatching

    b = act_heavy.fitting_micro_batch_size
    snippet = act_heavy.snippet()
    python, _, config = snippet.partition("\n# or in a LightningCLI config:\n")
    callback = eval(python.split("  #")[0], {"AutoMicroBatching": AutoMicroBatching})
    assert isinstance(callback, AutoMicroBatching)
    parsed = yaml.safe_load(config)
    (entry,) = parsed["trainer"]["callbacks"]
    assert entry["class_path"] == "lightning_accum.AutoMicroBatching"
    assert entry["init_args"]["micro_batch_size"] == b and parsed["data"]["batch_size"] == 512
    assert entry["init_args"]["max_memory"] == "2MiB" and AutoMicroBatching(**entry["init_args"]).max_memory == 2**21
    assert "Ready to paste" in act_heavy.table() and act_heavy.to_dict()["snippet"] == snippet
