"""LightningCLI builds ``lightning_accum`` callbacks from the example's shipped YAML configs and from the command line.

The CLI runs in-process, on the shipped files in ``examples/char_lm/configs``, so a config that stops parsing (or a
type hint that stops accepting what the YAML writes) fails here rather than in a user's first run.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.strategies import DDPStrategy

from examples.char_lm.main import CharLMCLI, main
from lightning_accum import AccumulationScheduler, BatchSizeRamp, Progress, StepwiseSchedule
from lightning_accum.items import CountSamples, CountTokens

CONFIGS = Path(__file__).resolve().parents[1] / "examples" / "char_lm" / "configs"
TINY = ["--model.d_model=32", "--model.n_layers=1", "--model.n_heads=2", "--data.max_sequences=200"]


@pytest.fixture(autouse=True)
def _no_pytest_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    # LightningCLI warns when both `args` and `sys.argv` hold arguments; pytest's own must not leak into the CLI.
    monkeypatch.setattr(sys, "argv", ["main.py"])


def build(tmp_path: Path, *args: str, subcommand: str | None = None) -> CharLMCLI:
    quiet = [
        f"--trainer.default_root_dir={tmp_path}",
        "--trainer.logger=false",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        "--trainer.enable_checkpointing=false",
    ]
    if subcommand is None:
        return main(args=[*args, *quiet], run=False)
    return main(args=[subcommand, *args, *quiet])


def build_from(tmp_path: Path, config: str | Path, *args: str, subcommand: str | None = None) -> CharLMCLI:
    """`build` from a config: the name of a shipped one, or a path."""
    path = CONFIGS / config if isinstance(config, str) else config
    return build(tmp_path, f"--config={path}", *args, subcommand=subcommand)


def fit_tiny(tmp_path: Path, config: str | Path, *args: str) -> CharLMCLI:
    """Fit the tiny model from a config."""
    return build_from(tmp_path, config, *TINY, *args, subcommand="fit")


def scheduler_of(cli: CharLMCLI) -> AccumulationScheduler:
    found = [cb for cb in cli.trainer.callbacks if isinstance(cb, AccumulationScheduler)]
    assert len(found) == 1, f"expected one AccumulationScheduler, got {cli.trainer.callbacks}"
    return found[0]


def first_batch(cli: CharLMCLI) -> dict[str, Any]:
    cli.datamodule.setup("fit")
    return next(iter(cli.datamodule.train_dataloader()))


def test_window_ramp_config(tmp_path: Path) -> None:
    cli = build_from(tmp_path, "window_ramp.yaml")
    scheduler = scheduler_of(cli)
    ramp = scheduler.schedule
    assert isinstance(ramp, BatchSizeRamp)
    assert (ramp.start, ramp.target, ramp.increment, ramp.ramp_samples, ramp.rounding) == (16, 64, 16, 1024, "error")
    assert scheduler.count_items == CountTokens(key="labels", ignore_index=-100)
    assert scheduler.loss_reduction == "mean"
    assert cli.trainer.accumulate_grad_batches == 1  # the callback owns k; setting both would be an error
    assert cli.trainer.gradient_clip_val == 1.0
    assert cli.model.hparams.max_length == cli.datamodule.max_length == 128  # linked by CharLMCLI

    batch = first_batch(cli)
    assert int(scheduler.count_items(batch)) == int((batch["labels"] != -100).sum())
    # The ramp divides into whole micro-batches of this config's size: k = 1, 2, 3, 4.
    increment_every = 1024 / 3  # ramp_samples / number of increments
    starts = [0, int(increment_every) + 1, int(2 * increment_every) + 1, 1024]
    steps = [ramp.accumulation_steps(Progress(consumed_samples=s, micro_batch_size=16)) for s in starts]
    assert steps == [1, 2, 3, 4]


def test_ddp_cpu_config_parses(tmp_path: Path) -> None:
    cli = build_from(tmp_path, "ddp_cpu.yaml")
    trainer = cli.trainer
    assert isinstance(trainer.strategy, DDPStrategy) and isinstance(trainer.accelerator, CPUAccelerator)
    assert trainer.num_devices == 2
    scheduler = scheduler_of(cli)
    assert scheduler.count_items == CountTokens(key="labels")
    ramp = scheduler.schedule
    assert isinstance(ramp, BatchSizeRamp)
    # Every global batch of the ramp is a whole number of micro-steps of 2 ranks x batch_size, or the run would stop.
    per_micro_step = trainer.num_devices * cli.datamodule.batch_size
    sizes = range(ramp.start, ramp.target + 1, ramp.increment)
    assert [size % per_micro_step for size in sizes] == [0] * len(sizes)


def test_mapping_schedule_with_int_keys_from_yaml(tmp_path: Path) -> None:
    config = tmp_path / "mapping.yaml"
    config.write_text(
        "trainer:\n"
        "  callbacks:\n"
        "    - class_path: lightning_accum.AccumulationScheduler\n"
        "      init_args:\n"
        "        schedule: {0: 1, 2: 4}\n"
        "        unit: epoch\n"
    )
    scheduler = scheduler_of(build_from(tmp_path, config))
    assert isinstance(scheduler.schedule, StepwiseSchedule)
    assert scheduler.schedule.milestones == {0: 1, 2: 4} and scheduler.unit == "epoch"
    assert [scheduler.schedule.accumulation_steps(Progress(epoch=e)) for e in range(4)] == [1, 1, 4, 4]
    assert scheduler.count_items is None


def test_scheduler_appended_on_the_command_line(tmp_path: Path) -> None:
    cli = build(
        tmp_path,
        "--trainer.callbacks+=lightning_accum.AccumulationScheduler",
        "--trainer.callbacks.schedule={0: 2, 100: 4}",
        "--trainer.callbacks.unit=step",
        "--trainer.callbacks.count_items=lightning_accum.items.CountSamples",
    )
    scheduler = scheduler_of(cli)
    assert isinstance(scheduler.schedule, StepwiseSchedule)
    assert scheduler.schedule.milestones == {0: 2, 100: 4} and scheduler.unit == "step"
    assert scheduler.count_items == CountSamples()


def test_command_line_overrides_the_shipped_config(tmp_path: Path) -> None:
    cli = build_from(
        tmp_path,
        "window_ramp.yaml",
        "--trainer.callbacks.schedule.target=128",
        "--trainer.callbacks.count_items.ignore_index=0",
        "--trainer.callbacks+=lightning.pytorch.callbacks.LearningRateMonitor",
    )
    scheduler = scheduler_of(cli)
    assert isinstance(scheduler.schedule, BatchSizeRamp)
    assert (scheduler.schedule.start, scheduler.schedule.target) == (16, 128)
    assert scheduler.count_items == CountTokens(key="labels", ignore_index=0)
    assert any(isinstance(cb, LearningRateMonitor) for cb in cli.trainer.callbacks)


def test_fit_from_the_shipped_config_follows_the_ramp(tmp_path: Path) -> None:
    # A ramp over 32 samples with micro-batches of 16: windows of 1 and 2 micro-batches, then k=4 cut short by the
    # epoch's end after 4 micro-batches.
    cli = fit_tiny(
        tmp_path,
        "window_ramp.yaml",
        "--trainer.callbacks.schedule.ramp_samples=32",
        "--trainer.max_epochs=1",
        "--trainer.limit_train_batches=4",
        "--trainer.limit_val_batches=1",
    )
    scheduler = scheduler_of(cli)
    last = scheduler.last_step_report
    assert cli.trainer.global_step == 3
    assert [(e.before, e.after) for e in scheduler.events] == [(1, 2), (2, 4)]
    assert scheduler.consumed_samples == 4 * 16
    assert last.items > last.effective_batch_size  # tokens, not samples, are what the last step averaged
    assert torch.isfinite(cli.trainer.callback_metrics["val/loss"])

    # The config LightningCLI saved (with the counter's class_path) builds the same callback again.
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    # Drop the `fit` options (ckpt_path, ...): the parser without a subcommand has no such keys.
    saved = {key: saved[key] for key in ("seed_everything", "trainer", "model", "data")}
    (tmp_path / "saved.yaml").write_text(yaml.safe_dump(saved))
    rebuilt = scheduler_of(build_from(tmp_path / "again", tmp_path / "saved.yaml"))
    assert repr(rebuilt.schedule) == repr(scheduler.schedule) and rebuilt.count_items == scheduler.count_items


def test_split_auto_config_builds_auto_micro_batching_and_the_monitor(tmp_path: Path) -> None:
    from lightning_accum import AccumulationMonitor, AutoMicroBatching

    cli = build_from(tmp_path, "split_auto.yaml")
    (splitter,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, AutoMicroBatching)]
    (monitor,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, AccumulationMonitor)]
    assert splitter.max_memory == 0.8
    assert splitter.planner.micro_batch_size_setting == "auto"
    assert splitter.preflight is True
    assert splitter.planner.grow_patience == 20
    assert splitter.count_items == CountTokens()
    assert monitor.logging_interval == 1
    assert cli.datamodule.batch_size == 64


def test_max_memory_in_bytes_survives_yaml(tmp_path: Path) -> None:
    # jsonargparse hands YAML ints over as floats for a `float | int` hint; the callback must still read bytes.
    from lightning_accum import AutoMicroBatching

    budgets = []
    for value in (8 * 2**30, "6GiB"):
        config = tmp_path / "bytes.yaml"
        callback = {"class_path": "lightning_accum.AutoMicroBatching", "init_args": {"max_memory": value}}
        config.write_text(yaml.safe_dump({"trainer": {"callbacks": [callback]}}))
        cli = build_from(tmp_path, config)
        budgets += [cb.max_memory for cb in cli.trainer.callbacks if isinstance(cb, AutoMicroBatching)]
    assert budgets == [8 * 2**30, 6 * 2**30]


def test_fit_from_the_split_config(tmp_path: Path) -> None:
    from lightning_accum import AutoMicroBatching

    cli = fit_tiny(
        tmp_path,
        "split_auto.yaml",
        "--data.batch_size=16",
        "--trainer.max_steps=3",
    )
    assert cli.trainer.global_step == 3
    (splitter,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, AutoMicroBatching)]
    assert splitter.last_step_report.effective_batch_size == 16


# An override of one argument of each shipped config's accumulation callback, and what the callback must then hold.
# `--trainer.callbacks.ARG=VALUE` applies to the last callback of the list (jsonargparse), so the owner goes last.
SHIPPED_OVERRIDES: dict[str, tuple[str, str, Any]] = {
    "split_auto.yaml": ("--trainer.callbacks.max_memory=1GiB", "max_memory", 2**30),
    "window_ramp.yaml": ("--trainer.callbacks.loss_reduction=sum", "loss_reduction", "sum"),
    "ddp_cpu.yaml": ("--trainer.callbacks.loss_reduction=sum", "loss_reduction", "sum"),
}


def test_every_shipped_config_has_an_override_test() -> None:
    assert sorted(SHIPPED_OVERRIDES) == sorted(p.name for p in CONFIGS.glob("*.yaml"))


@pytest.mark.parametrize("name", sorted(SHIPPED_OVERRIDES))
def test_the_shipped_config_takes_a_command_line_override_of_its_main_callback(tmp_path: Path, name: str) -> None:
    from lightning_accum import AutoMicroBatching

    override, attribute, expected = SHIPPED_OVERRIDES[name]
    cli = build_from(tmp_path, name, override)
    (owner,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, (AutoMicroBatching, AccumulationScheduler))]
    assert getattr(owner, attribute) == expected
    callbacks = yaml.safe_load((CONFIGS / name).read_text())["trainer"]["callbacks"]
    assert callbacks[-1]["class_path"] == f"lightning_accum.{type(owner).__name__}"


def test_callback_order_in_the_yaml_does_not_change_the_run(tmp_path: Path) -> None:
    # The owner moves itself to the front of `trainer.callbacks` at setup, so the shipped order (owner last, for
    # overrides) trains exactly as the monitor-last order did.
    from lightning_accum import AccumulationMonitor, AutoMicroBatching

    shipped = yaml.safe_load((CONFIGS / "split_auto.yaml").read_text())
    swapped = {**shipped, "trainer": {**shipped["trainer"], "callbacks": shipped["trainer"]["callbacks"][::-1]}}
    assert swapped["trainer"]["callbacks"][0]["class_path"] == "lightning_accum.AutoMicroBatching"
    (tmp_path / "swapped.yaml").write_text(yaml.safe_dump(swapped))
    runs = []
    for config in (CONFIGS / "split_auto.yaml", tmp_path / "swapped.yaml"):
        cli = fit_tiny(
            tmp_path / config.stem,
            config,
            "--data.batch_size=16",
            "--trainer.max_steps=2",
            "--trainer.limit_val_batches=0",
        )
        callbacks = cli.trainer.callbacks
        assert isinstance(callbacks[0], AutoMicroBatching)
        monitor = next(cb for cb in callbacks if isinstance(cb, AccumulationMonitor))
        assert monitor._owner is callbacks[0]
        runs.append((cli.trainer.global_step, {k: v.clone() for k, v in cli.model.state_dict().items()}))
    (steps_shipped, weights_shipped), (steps_swapped, weights_swapped) = runs
    assert steps_shipped == steps_swapped == 2
    for key, value in weights_shipped.items():
        torch.testing.assert_close(weights_swapped[key], value, rtol=0, atol=0, msg=key)


def test_the_documented_ways_to_reach_a_callback_that_is_not_last(tmp_path: Path) -> None:
    from lightning_accum import AccumulationMonitor, AutoMicroBatching

    # Two overrides of the shipped window config's scheduler, as docs/cli.md shows them.
    cli = build_from(
        tmp_path,
        "window_ramp.yaml",
        "--trainer.callbacks.loss_reduction=sum",
        "--trainer.callbacks.schedule.target=128",
    )
    scheduler = scheduler_of(cli)
    assert scheduler.loss_reduction == "sum" and scheduler.schedule.target == 128

    # The whole list again, with the config's classes in the config's order: merged entry by entry.
    cli = build_from(
        tmp_path,
        "split_auto.yaml",
        "--trainer.callbacks=[{class_path: lightning_accum.AccumulationMonitor, init_args: {logging_interval: 10}},"
        " {class_path: lightning_accum.AutoMicroBatching}]",
    )
    (splitter,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, AutoMicroBatching)]
    (monitor,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, AccumulationMonitor)]
    assert monitor.logging_interval == 10
    assert (splitter.max_memory, splitter.count_items, splitter.planner.grow_patience) == (0.8, CountTokens(), 20)

    # A list of other classes replaces the config's, arguments and all.
    cli = build_from(
        tmp_path,
        "split_auto.yaml",
        "--trainer.callbacks=[{class_path: lightning_accum.AutoMicroBatching, init_args: {max_memory: 1GiB}}]",
    )
    (splitter,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, AutoMicroBatching)]
    assert (splitter.max_memory, splitter.count_items) == (2**30, None)
    assert not any(isinstance(cb, AccumulationMonitor) for cb in cli.trainer.callbacks)


def test_batch_hooks_from_yaml_as_import_paths(tmp_path: Path) -> None:
    from lightning_accum import AutoMicroBatching
    from tests.test_batch_inputs import count_pairs, split_pairs

    init_args = {
        "split_batch": "tests.test_batch_inputs:split_pairs",
        "batch_size_of": "tests.test_batch_inputs.count_pairs",
    }
    config = tmp_path / "hooks.yaml"
    callback = {"class_path": "lightning_accum.AutoMicroBatching", "init_args": init_args}
    config.write_text(yaml.safe_dump({"trainer": {"callbacks": [callback]}}))
    cli = build_from(tmp_path, config)
    (built,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, AutoMicroBatching)]
    assert built._hooks.split_batch is split_pairs and built._hooks.batch_size_of is count_pairs
