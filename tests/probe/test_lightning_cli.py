"""``lightning-accum probe --config``: the model the user's own LightningCLI builds (links and ``--init-args``
applied), and a model that fails on the data's batch as one ``error:`` line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_accum.probe import load_cli_config
from lightning_accum.probe.lightning_cli import build_with_cli
from tests.cli.helpers import assert_one_error_line, run_cli

pytest.importorskip("transformers", reason="the `hf` extra (transformers) is not installed")

HF_CLI = "examples.hf_finetune.main:FinetuneCLI"
HF_CLASSES = [
    "--model",
    "examples.hf_finetune.model:HFCausalLM",
    "--data",
    "examples.hf_finetune.data:InstructionDataModule",
]
SMALL = ["--batch-size", "4", "--accumulation-steps", "2", "--fit-micro-batch-sizes", "1", "--steps", "1", "--json"]


@pytest.fixture
def wide_vocab_config(tmp_path: Path) -> Path:
    """The HF example's sections, with data drawing ids up to 512: only the CLI's link gives the model 512 ids."""
    config = tmp_path / "config.yaml"
    config.write_text(
        "model:\n  n_layer: 1\n  n_embd: 16\n  n_head: 2\n"
        "data:\n  batch_size: 4\n  num_samples: 16\n  vocab_size: 512\n  max_length: 48\n"
    )
    return config


def test_the_cli_class_applies_its_links_and_the_init_args(wide_vocab_config: Path) -> None:
    model, data = build_with_cli(HF_CLI, [wide_vocab_config], model_init_args={"n_layer": 2})
    assert model.model.config.vocab_size == data.vocab_size == 512  # data.vocab_size -> model.vocab_size
    assert model.model.config.n_positions == 48 and model.model.config.n_layer == 2  # the link, and --init-args


def test_the_probe_with_cli_measures_what_fit_would_build(capsys, wide_vocab_config: Path) -> None:
    outcome = run_cli(capsys, "probe", "--config", str(wide_vocab_config), "--cli", HF_CLI, *SMALL)
    assert outcome.code == 0, outcome.err[-2000:]
    assert json.loads(outcome.out)["batch_size"] == 4


def test_a_model_that_fails_on_the_data_is_one_line_naming_the_fix(capsys, wide_vocab_config: Path) -> None:
    # Without the CLI the model keeps its default 256 ids; the data draws up to 512: torch's IndexError, not a bug.
    outcome = run_cli(capsys, "probe", "--config", str(wide_vocab_config), *HF_CLASSES, *SMALL)
    assert_one_error_line(
        outcome, "the model and the data disagree", "IndexError", "index out of range", "--cli pkg.mod:YourCLI"
    )


def test_a_cli_that_is_not_one_and_a_cli_without_config(capsys, wide_vocab_config: Path) -> None:
    outcome = run_cli(
        capsys, "probe", "--config", str(wide_vocab_config), "--cli", "examples.hf_finetune.model:HFCausalLM"
    )
    assert_one_error_line(outcome, "`--cli`='examples.hf_finetune.model:HFCausalLM'", "not a LightningCLI subclass")
    assert_one_error_line(run_cli(capsys, "probe", "--cli", HF_CLI), "`--cli`", "needs `--config`")
    outcome = run_cli(
        capsys, "probe", "--config", str(wide_vocab_config), "--cli", HF_CLI, "--init-args", '{"width": 3}'
    )
    assert_one_error_line(outcome, "`--config`", "`--init-args`={'width': 3}", "--model.width=3")


def test_init_args_override_a_config_without_cli(capsys, tmp_path: Path) -> None:
    config = tmp_path / "cli.yaml"
    config.write_text("model:\n  class_path: tests.probe.models.ActHeavy\n  init_args:\n    optimizer: adam\n")
    make_model, _ = load_cli_config(config, model_init_args={"optimizer": "sgd"})
    assert make_model().optimizer == "sgd"
    outcome = run_cli(
        capsys,
        "probe",
        "--config",
        str(config),
        "--data",
        "tests.probe.models:RegressionData",
        "--init-args",
        '{"width": 3}',
    )
    assert_one_error_line(outcome, "`--config`", "'width': 3", "ActHeavy")
