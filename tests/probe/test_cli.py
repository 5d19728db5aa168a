"""``lightning-accum probe``: its outputs, and each mistake in its arguments as one ``error:`` line before measuring."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lightning_accum.cli.probe as probe_cli
import lightning_accum.probe.measure
from lightning_accum.cli.main import main
from lightning_accum.probe import load_cli_config
from tests.cli.helpers import assert_one_error_line, run_cli
from tests.probe import models

ROOT = Path(__file__).resolve().parents[2]
MODELS = "tests.probe.models"
DATA = ["--data", f"{MODELS}:RegressionData"]
PROBE = ["probe", "--model", f"{MODELS}:ActHeavy", *DATA]


@pytest.fixture
def measuring():
    """Asked for by the tests that let the probe measure."""


@pytest.fixture(autouse=True)
def _never_measure(request, monkeypatch):
    # Every other case must fail before the probe measures anything.
    if "measuring" in request.fixturenames:
        return

    def refuse(*args, **kwargs):
        raise AssertionError("the probe measured: the mistake was not caught first")

    monkeypatch.setattr(lightning_accum.probe.measure, "_measure", refuse)


# ---- what it writes -------------------------------------------------------------------------------------------------


def test_cli_writes_table_json_and_png(tmp_path, capsys, measuring):
    out = tmp_path / "out"
    code = main(
        [
            *PROBE,
            "--data-init-args",
            '{"batch_size": 32}',
            "--accumulation-steps",
            "2",
            "--accumulation-steps",
            "4",
            "--max-memory",
            "1MiB",
            "--steps",
            "1",
            "--output-dir",
            str(out),
        ]
    )
    assert code == 0
    assert "B=32" in capsys.readouterr().out  # the datamodule's batch size is the default B
    data = json.loads((out / "probe.json").read_text())
    assert data["batch_size"] == 32 and data["accumulation_steps"] == [2, 4]
    assert data["fitting_micro_batch_size"] is not None
    assert "Full batch vs accumulation" in (out / "probe.txt").read_text()
    assert (out / "probe.png").stat().st_size > 10_000


def test_cli_reads_a_lightning_cli_config(tmp_path, measuring):
    config = tmp_path / "cli.yaml"
    config.write_text(
        "trainer:\n  max_epochs: 1\n"
        f"model:\n  class_path: {MODELS}.ActHeavy\n  init_args:\n    optimizer: adam\n"
        "data:\n  batch_size: 4\n"  # only init args: the class comes from --data
    )
    make_model, make_data = load_cli_config(config, data_class=f"{MODELS}:RegressionData")
    assert make_model().optimizer == "adam" and make_data().batch_size == 4
    code = main(
        [
            "probe",
            "--config",
            str(config),
            *DATA,
            "--batch-size",
            "2",
            "--accumulation-steps",
            "2",
            "--fit-micro-batch-sizes",
            "1",
            "--steps",
            "1",
            "--output-dir",
            str(tmp_path),
        ]
    )
    assert code == 0
    assert json.loads((tmp_path / "probe.json").read_text())["batch_size"] == 2


# ---- mistakes: one line, before measuring ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "fragments"),
    [
        ("no_such_package.models:Net", ["`--model`", "'no_such_package.models:Net'", "cannot import module"]),
        (f"{MODELS}:NoSuchModel", ["`--model`", f"'{MODELS}:NoSuchModel'", "no attribute 'NoSuchModel'"]),
        ("ActHeavy", ["`--model`", "'ActHeavy'", "'pkg.module:Name'"]),
        ("collections:OrderedDict", ["`--model`", "OrderedDict", "training_step", "LightningModule"]),
    ],
)
def test_bad_model_path(capsys, model, fragments):
    assert_one_error_line(run_cli(capsys, "probe", "--model", model, *DATA), *fragments)


def test_bad_data_path(capsys):
    outcome = run_cli(capsys, "probe", "--model", f"{MODELS}:ActHeavy", "--data", f"{MODELS}:Nope")
    assert_one_error_line(outcome, "`--data`", f"'{MODELS}:Nope'", "no attribute 'Nope'")


def test_init_args_the_model_does_not_take(capsys):
    outcome = run_cli(capsys, *PROBE, "--init-args", '{"width": 3}')
    assert_one_error_line(outcome, "`--init-args`={'width': 3}", "ActHeavy", "unexpected keyword argument 'width'")
    outcome = run_cli(capsys, *PROBE, "--data-init-args", '{"rows": 3}')
    assert_one_error_line(outcome, "`--data-init-args`={'rows': 3}", "RegressionData", "'rows'")


def test_manual_optimization_model(capsys, monkeypatch):
    class Manual(models.ActHeavy):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

    monkeypatch.setattr(models, "Manual", Manual, raising=False)
    outcome = run_cli(capsys, "probe", "--model", f"{MODELS}:Manual", *DATA)
    assert_one_error_line(outcome, "`--model`", "manual optimization")


def test_cuda_device_without_cuda(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    outcome = run_cli(capsys, *PROBE, "--device", "cuda")
    assert_one_error_line(outcome, "`--device`", "'cuda'", "CUDA is not available", "--device cpu")


def test_cuda_device_index_out_of_range(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    outcome = run_cli(capsys, *PROBE, "--device", "cuda:3")
    assert_one_error_line(outcome, "`--device`", "'cuda:3'", "1 CUDA device", "cuda:0")


def test_unknown_device(capsys):
    assert_one_error_line(run_cli(capsys, *PROBE, "--device", "banana"), "`--device`", "'banana'", "cpu")


def test_accumulation_steps_that_do_not_divide_the_batch(capsys):
    outcome = run_cli(capsys, *PROBE, "--batch-size", "32", "--accumulation-steps", "3")
    assert_one_error_line(outcome, "`--accumulation-steps`", "3", "`--batch-size`=32", "divisor")


def test_output_dir_under_a_file(capsys, tmp_path):
    blocker = tmp_path / "results.txt"
    blocker.write_text("")
    outcome = run_cli(capsys, *PROBE, "--output-dir", str(blocker / "probe"))
    assert_one_error_line(outcome, "`--output-dir`", repr(str(blocker / "probe")), "not a directory")
    outcome = run_cli(capsys, *PROBE, "--output-dir", str(blocker))
    assert_one_error_line(outcome, "`--output-dir`", repr(str(blocker)), "not a directory")


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes into read-only directories")
def test_output_dir_without_write_permission(capsys, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    outcome = run_cli(capsys, *PROBE, "--output-dir", str(locked / "probe"))
    assert_one_error_line(outcome, "`--output-dir`", "not writable")


def test_missing_and_malformed_config(capsys, tmp_path):
    outcome = run_cli(capsys, "probe", "--config", str(tmp_path / "missing.yaml"))
    assert_one_error_line(outcome, "`--config`", "missing.yaml", "does not exist")
    broken = tmp_path / "broken.yaml"
    broken.write_text("model: [unclosed\n")
    assert_one_error_line(run_cli(capsys, "probe", "--config", str(broken)), "`--config`", "broken.yaml", "YAML")


def test_no_model_and_no_batch_size(capsys):
    assert_one_error_line(run_cli(capsys, "probe", *DATA), "`--model`", "`--config`")
    outcome = run_cli(capsys, "probe", "--model", f"{MODELS}:ActHeavy", "--data", f"{MODELS}:regression_batch")
    assert_one_error_line(outcome, "`--batch-size`")


def test_a_failed_write_after_measuring_is_one_line(capsys, tmp_path, monkeypatch, measuring):
    # The directory looked writable when the probe started (as root, or on a disk that filled up meanwhile).
    def disk_full(result, output_dir):
        raise OSError(28, "No space left on device", str(output_dir))

    monkeypatch.setattr(probe_cli, "write_outputs", disk_full)
    argv = [*PROBE, "--batch-size", "4", "--accumulation-steps", "2", "--fit-micro-batch-sizes", "2", "--steps", "1"]
    outcome = run_cli(capsys, *argv, "--init-args", '{"optimizer": "adam"}', "--output-dir", str(tmp_path / "out"))
    assert_one_error_line(outcome, "`--output-dir`", "No space left on device")
    assert "B=4" in outcome.out  # valid arguments passed every check: the probe ran and printed its table


def test_a_batch_larger_than_the_dataset(capsys):
    outcome = run_cli(capsys, *PROBE, "--batch-size", "128", "--accumulation-steps", "2")
    assert_one_error_line(outcome, "`--batch-size`=128", "64 samples")


def test_a_bug_in_the_model_keeps_its_traceback(capsys, monkeypatch, measuring):
    # The model's own code failing is not a mistake in the command: Python's traceback shows the user where.
    class Broken(models.ActHeavy):
        def training_step(self, batch, batch_idx):
            raise RuntimeError("a bug in the user's training_step")

    monkeypatch.setattr(models, "Broken", Broken, raising=False)
    with pytest.raises(RuntimeError, match="a bug in the user's training_step"):
        run_cli(capsys, "probe", "--model", f"{MODELS}:Broken", *DATA, "--batch-size", "4")


# ---- predictions: --device meta, --target, --precision, --json ------------------------------------------------------

SMALL = ["--batch-size", "4", "--accumulation-steps", "2", "--fit-micro-batch-sizes", "1", "--steps", "1"]


def test_cli_json_is_the_only_thing_on_stdout(capsys, tmp_path, measuring):
    out = tmp_path / "out"
    outcome = run_cli(
        capsys, *PROBE, *SMALL, "--device", "meta", "--max-memory", "1MiB", "--json", "--output-dir", str(out)
    )
    assert outcome.code == 0, outcome
    data = json.loads(outcome.out)  # nothing else on stdout: `probe --json | jq` works
    assert (data["device"], data["target"], data["precision"]) == ("meta (as cpu)", "cpu", "32-true")
    assert data["budget_bytes"] == 2**20  # --max-memory takes a size, as AutoMicroBatching(max_memory=) does
    assert data["snippet"].startswith("AutoMicroBatching(micro_batch_size=")
    assert data == json.loads((out / "probe.json").read_text())
    assert outcome.err.startswith("wrote ")


def test_cli_predicts_for_cuda_in_bf16_and_ends_with_the_snippet(capsys, measuring):
    # --budget-gib, the older spelling of --max-memory in GiB, still works.
    argv = [*SMALL, "--device", "meta", "--target", "cuda", "--precision", "bf16-true", "--budget-gib", "0.001"]
    outcome = run_cli(capsys, *PROBE, *argv)
    assert outcome.code == 0, outcome
    assert outcome.out.startswith("Predicted peak live tensor memory in KiB on meta (as cuda), bf16-true")
    assert "Ready to paste (split mode):\nAutoMicroBatching(micro_batch_size=" in outcome.out
    assert "class_path: lightning_accum.AutoMicroBatching" in outcome.out


def test_cli_target_needs_the_meta_device(capsys):
    outcome = run_cli(capsys, *PROBE, "--target", "cuda")
    assert_one_error_line(outcome, "`--target`='cuda' only applies with `--device`='meta'", "Drop `--target`")


def test_cli_precision_must_be_lightnings(capsys):
    outcome = run_cli(capsys, *PROBE, "--precision", "fp8")
    assert_one_error_line(outcome, "--precision", "'fp8'", "bf16-mixed", code=2)


def test_cli_headroom_replaces_the_share_kept_free(capsys, measuring):
    argv = [*SMALL, "--device", "meta", "--target", "cuda", "--max-memory", "1MiB", "--json"]
    kept = json.loads(run_cli(capsys, *PROBE, *argv).out)
    none = json.loads(run_cli(capsys, *PROBE, *argv, "--headroom", "0").out)
    assert (kept["headroom"], none["headroom"]) == (0.1, 0.0)
    assert none["fitting_micro_batch_size"] >= kept["fitting_micro_batch_size"]
    assert not any("keeping" in line for line in none["findings"])
    outcome = run_cli(capsys, *PROBE, "--headroom", "1.5")
    assert_one_error_line(outcome, "`--headroom` must be a fraction in [0, 1)", "1.5")


# ---- by tokens: --sequences -----------------------------------------------------------------------------------------

TOKENS = [
    "probe",
    "--model",
    f"{MODELS}:TokenLM",
    "--data",
    f"{MODELS}:token_batch",
    "--data-init-args",
    '{"seq_len": 32, "lengths": [32, 20, 9, 5]}',
    "--batch-size",
    "4",
]
TOKEN_GRID = ["--sequence-lengths", "8", "16", "32", "--fit-micro-batch-sizes", "1", "2", "4", "--steps", "1"]


def test_cli_answers_in_tokens_with_the_snippet(capsys, tmp_path, measuring):
    outcome = run_cli(
        capsys, *TOKENS, "--sequences", *TOKEN_GRID, "--max-memory", "1GiB", "--output-dir", str(tmp_path)
    )  # on the CPU the budget holds the process's resident set, a few hundred MiB before any tensor
    assert outcome.code == 0, outcome
    assert outcome.out.startswith("Peak live tensor memory in KiB on cpu, 32-true, by tokens (PaddedSequences(mask=")
    assert "- Checked on held-out shapes: fitted on 5 of the shapes, the fit errs" in outcome.out
    assert "the largest token budget that fits sequences of L=32 is micro_batch_tokens=" in outcome.out
    assert (
        "Ready to paste (split mode by tokens):\nfrom lightning_accum.items import CountTokens\n"
        "from lightning_accum.sequences import PaddedSequences\n" in outcome.out
    )
    assert "          class_path: lightning_accum.sequences.PaddedSequences\n" in outcome.out
    data = json.loads((tmp_path / "probe.json").read_text())
    assert data["unit"] == "tokens" and data["budget_bytes"] == 2**30
    assert "- On the CPU `AutoMicroBatching` holds the process's peak resident set (VmHWM)" in outcome.out
    assert f"micro_batch_tokens={data['fitting_micro_batch_tokens']}," in outcome.out
    assert all(isinstance(m["passes_peak_bytes"], int) for m in data["measurements"])  # bytes, as numbers
    assert (tmp_path / "probe.png").stat().st_size > 10_000


@pytest.mark.parametrize(
    ("argv", "fragments"),
    [
        (["--sequence-lengths", "16"], ["`--sequence-lengths` needs `--sequences`"]),
        (["--sequences", "--accumulation-steps", "2"], ["`--accumulation-steps` does not apply with `--sequences`"]),
        (["--sequences", "shape=3"], ["`--sequences`='shape=3' is not a mask key or `lengths=pkg.mod:fn`"]),
        (["--sequences", "mask"], ["`--sequences`:", "the batch has no 'mask'", "'attention_mask'"]),
        (["--sequences", "lengths=no_such_package:lengths"], ["`--sequences`='lengths=no_such_package:lengths'"]),
        (["--sequences", "--sequence-lengths", "64"], ["`--sequence-lengths` holds 64", "padded to 32 positions"]),
        (["--sequences", "--fit-micro-batch-sizes", "8"], ["`--fit-micro-batch-sizes` holds 8", "`--batch-size`=4"]),
    ],
)
def test_token_mistakes_are_one_line_before_measuring(capsys, argv, fragments):
    assert_one_error_line(run_cli(capsys, *TOKENS, *argv), *fragments)


def test_the_token_budget_keeps_what_a_training_process_adds_as_given(capsys, measuring):
    # Issue 36, item 2: --process-overhead gives what a training process holds beyond the probe's; the default
    # measures it (tests/probe/test_tokens.py), a size is kept as given, 0 keeps nothing.
    argv = [*TOKENS, "--sequences", *TOKEN_GRID, "--max-memory", "1GiB", "--json"]
    given = json.loads(run_cli(capsys, *argv, "--process-overhead", "3MiB").out)
    nothing = json.loads(run_cli(capsys, *argv, "--process-overhead", "0").out)
    assert (given["process_overhead_bytes"], given["process_overhead_source"]) == (3 * 2**20, "given")
    assert (nothing["process_overhead_bytes"], nothing["process_overhead_source"]) == (0, None)


def test_a_bad_process_overhead_is_one_error_line(capsys):
    outcome = run_cli(capsys, *TOKENS, "--sequences", "--process-overhead", "lots")
    assert_one_error_line(
        outcome, "--process-overhead", "expected a size such as 8GiB", "'lots'", "'measure', or 0", code=2
    )


def test_a_real_process_answers_in_tokens_on_the_meta_device(tmp_path):
    # The command as a user runs it: a fresh interpreter, the import paths resolved from the working directory.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    argv = [*TOKENS, "--sequences", "attention_mask", *TOKEN_GRID, "--device", "meta", "--max-memory", "1MiB"]
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_accum.cli.main", *argv, "--json"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert (data["unit"], data["device"], data["step_lengths"]) == ("tokens", "meta (as cpu)", [32, 20, 9, 5])
    fit = data["fit"]
    assert fit["per_token_length_bytes"] > 0 and fit["holdout_relative_error"] < 0.05
    assert fit["tokens_only_holdout_relative_error"] > fit["holdout_relative_error"]
    tokens = data["fitting_micro_batch_tokens"]
    assert 32 <= tokens <= 4 * 32 and data["snippet"].count(f"micro_batch_tokens={tokens}") == 1


def test_a_missing_matplotlib_leaves_the_picture_out_with_a_warning(capsys, tmp_path, monkeypatch, measuring):
    # `import matplotlib` fails as it does where the `report` extra is not installed.
    for name in ("matplotlib", "matplotlib.pyplot"):
        monkeypatch.setitem(sys.modules, name, None)
    out = tmp_path / "out"
    outcome = run_cli(capsys, *PROBE, *SMALL, "--device", "meta", "--output-dir", str(out))
    assert outcome.code == 0, outcome
    (line,) = outcome.err.splitlines()
    assert line.startswith("warning: probe.png was not written") and "matplotlib" in line, line
    assert "pip install 'lightning-accum[report]'" in line
    assert sorted(p.name for p in out.iterdir()) == ["probe.json", "probe.txt"]
    assert "wrote" in outcome.out and "probe.png" not in outcome.out
