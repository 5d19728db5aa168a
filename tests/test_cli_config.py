"""LightningCLI builds ``lightning_accum`` callbacks from the example's shipped YAML configs and from the command line.

The CLI runs in-process, on the shipped files in ``examples/char_lm/configs``, so a config that stops parsing (or a
type hint that stops accepting what the YAML writes) fails here rather than in a user's first run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.strategies import DDPStrategy

from examples.char_lm.main import CharLMCLI, main
from lightning_accum import (
    AccumulationMonitor,
    AccumulationScheduler,
    AdaptiveBatchSize,
    AutoMicroBatching,
    BatchSizeRamp,
    ConstantSchedule,
    Progress,
    StepwiseSchedule,
)
from lightning_accum.items import CountSamples, CountTokens

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "examples" / "char_lm" / "configs"
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


@pytest.mark.parametrize("schedule", ["BatchSizeRamp", "StepwiseSchedule"])
def test_lr_scaling_of_a_fixed_schedule_from_yaml(tmp_path: Path, schedule: str) -> None:
    # Issue 39: a ramp with the square-root rule needed a callback of the user's own; now it is the schedule's setting.
    init_args: dict[str, Any] = {"lr_scaling": "sqrt"}
    if schedule == "BatchSizeRamp":
        init_args.update(start=16, target=64, increment=16, ramp_samples=1024)
    else:
        init_args.update(milestones={0: 1, 100: 4}, unit="step")
    callback = {
        "class_path": "lightning_accum.AccumulationScheduler",
        "init_args": {"schedule": {"class_path": f"lightning_accum.schedules.{schedule}", "init_args": init_args}},
    }
    config = tmp_path / "scaled.yaml"
    config.write_text(yaml.safe_dump({"trainer": {"callbacks": [callback]}}))
    built = scheduler_of(build_from(tmp_path, config)).schedule
    assert type(built).__name__ == schedule and built.lr_scaling == "sqrt"


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
    # A YAML int reaches the callback as a float (as through the `float | int` hint before `MemorySize`); still bytes.
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


# ----------------------------------------------------------------------------------------------------------------------
# A bad value is a usage error while LightningCLI parses (jsonargparse's own form), not a traceback from `__init__`.
# ----------------------------------------------------------------------------------------------------------------------


def error_section(output: str) -> list[str]:
    """The lines from jsonargparse's `error:` on (before them it prints the usage, the same for every error)."""
    lines = output.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("error: ")]
    assert starts, f"no `error:` line in:\n{output}"
    return lines[starts[0] :]


@pytest.mark.parametrize(
    ("override", "argument", "shown"),
    [
        ("--trainer.callbacks.max_memory=8 gigs", "max_memory", "got '8 gigs'"),
        ("--trainer.callbacks.grow_patience=-3", "grow_patience", "got -3"),
    ],
)
def test_a_bad_value_on_the_command_line_is_a_short_usage_error(override: str, argument: str, shown: str) -> None:
    # The real command line of the shipped config, as a user types it. Before the parse-time types this was an
    # 86-line traceback from `__init__` (exit code 1) with the message in the middle.
    command = [
        sys.executable,
        "-m",
        "examples.char_lm.main",
        "fit",
        f"--config={CONFIGS / 'split_auto.yaml'}",
        override,
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    output = done.stdout + done.stderr
    assert done.returncode == 2, output
    assert "Traceback" not in output
    section = error_section(output)
    assert len(section) <= 20, "\n".join(section)
    text = "\n".join(section)
    assert f'Parser key "{argument}"' in text and shown in text, text


# (arguments after the config, the argument the error must name, what it must say, with the value). Every argument that
# an `__init__` checks, of each callback and of each schedule and counter a config can build; the Literal and bool
# ones are jsonargparse's own checks, listed to show they stay short too.
SCHEDULER = ("--trainer.callbacks+=lightning_accum.AccumulationScheduler",)
ADAPTIVE = (*SCHEDULER, "--trainer.callbacks.schedule=lightning_accum.AdaptiveBatchSize")
MONITOR = ("--trainer.callbacks+=lightning_accum.AccumulationMonitor",)
CONSTANT = (*SCHEDULER, "--trainer.callbacks.schedule=lightning_accum.ConstantSchedule")
STEPWISE = (*SCHEDULER, "--trainer.callbacks.schedule=lightning_accum.StepwiseSchedule")
SPLIT = (f"--config={CONFIGS / 'split_auto.yaml'}",)
RAMP = (f"--config={CONFIGS / 'window_ramp.yaml'}",)


def _bad(base: tuple[str, ...], setting: str, shown: str) -> tuple[tuple[str, ...], str, str]:
    """A case: ``base``, then ``--trainer.callbacks.SETTING``; the error names the setting's last key."""
    argument = setting.partition("=")[0].rsplit(".", 1)[-1]
    return (*base, f"--trainer.callbacks.{setting}"), argument, shown


BAD_VALUES: dict[str, tuple[tuple[str, ...], str, str]] = {
    "micro_batch_size": _bad(SPLIT, "micro_batch_size=0", 'or "auto", got 0'),
    "max_memory size": _bad(SPLIT, "max_memory=8 gigs", "got '8 gigs'"),
    "max_memory fraction": _bad(SPLIT, "max_memory=1.5", "(0, 1], got 1.5"),
    "min_micro_batch_size": _bad(SPLIT, "min_micro_batch_size=0", ">= 1, got 0"),
    "count_items": _bad(SPLIT, "count_items=no_such_module:count", "'no_such_module'"),
    "low_watermark": _bad(SPLIT, "low_watermark=1.5", "(0, 1), got 1.5"),
    "grow_patience": _bad(SPLIT, "grow_patience=-3", ">= 1, got -3"),
    "grow_patience type": _bad(SPLIT, "grow_patience=often", "got 'often'"),
    "oom_cooldown": _bad(SPLIT, "oom_cooldown=-1", ">= 0, got -1"),
    "split_batch": _bad(SPLIT, "split_batch=tests.helpers:no_such", "'no_such'"),
    "batch_size_of": _bad(SPLIT, "batch_size_of=os.sep", "not callable"),
    "loss_reduction": _bad(SPLIT, "loss_reduction=median", "median"),
    "gradient_sync": _bad(SPLIT, "gradient_sync=fast", "fast"),
    "preflight": _bad(SPLIT, "preflight=sometimes", "sometimes"),
    "schedule int": _bad(SCHEDULER, "schedule=0", ">= 1, got 0"),
    "schedule key order": _bad(SCHEDULER, "schedule={2: 4, 0: 1}", "got [2, 0]"),
    "schedule k": _bad(SCHEDULER, "schedule={0: 0}", "`schedule[0]` must be"),
    "unit": _bad(SCHEDULER, "unit=epochs", "epochs"),
    "scheduler count_items": _bad(SCHEDULER, "count_items=lightning_accum.items.NoCounter", "no attribute 'NoCounter'"),
    "ConstantSchedule": _bad(CONSTANT, "schedule.accumulation_steps=0", ">= 1, got 0"),
    "StepwiseSchedule": _bad(STEPWISE, "schedule.milestones={0: 1, -2: 4}", "got key -2"),
    "BatchSizeRamp start": _bad(RAMP, "schedule.start=0", ">= 1, got 0"),
    "BatchSizeRamp ramp_samples": _bad(RAMP, "schedule.ramp_samples=-1", "got -1"),
    "BatchSizeRamp rounding": _bad(RAMP, "schedule.rounding=up", "up"),
    "BatchSizeRamp lr_scaling": _bad(RAMP, "schedule.lr_scaling=cubic", "cubic"),
    "StepwiseSchedule lr_scaling": _bad(STEPWISE, "schedule.lr_scaling=square", "square"),
    "BatchSizeRamp gain": _bad(RAMP, "schedule.lr_scaling=sqrt_gain", "sqrt_gain"),  # only AdaptiveBatchSize's
    "min_accumulation_steps": _bad(ADAPTIVE, "schedule.min_accumulation_steps=1", ">= 2, got 1"),
    "max_accumulation_steps": _bad(ADAPTIVE, "schedule.max_accumulation_steps=0", ">= 1, got 0"),
    "factor": _bad(ADAPTIVE, "schedule.factor=0", "> 0, got 0"),
    "objective": _bad(ADAPTIVE, "schedule.objective=fastest", "fastest"),
    "min_gain": _bad(ADAPTIVE, "schedule.min_gain=-1", ">= 0, got -1"),
    "warmup_windows": _bad(ADAPTIVE, "schedule.warmup_windows=-1", ">= 0, got -1"),
    "hysteresis": _bad(ADAPTIVE, "schedule.hysteresis=-0.5", ">= 0, got -0.5"),
    "max_growth": _bad(ADAPTIVE, "schedule.max_growth=1", "> 1, got 1"),
    "beta": _bad(ADAPTIVE, "schedule.beta=1.0", "[0, 1), got 1.0"),
    "lr_scaling": _bad(ADAPTIVE, "schedule.lr_scaling=cubic", "cubic"),
    "logging_interval": _bad(MONITOR, "logging_interval=0", ">= 1, got 0"),
    "noise_scale_beta": _bad(MONITOR, "noise_scale_beta=1.0", "got 1.0"),
    "noise_scale_interval": _bad(MONITOR, "noise_scale_interval=0", ">= 1, got 0"),
    "CountTokens ignore_index": _bad(RAMP, "count_items.ignore_index=none_of_them", "none_of_them"),
}


@pytest.mark.parametrize("case", sorted(BAD_VALUES))
def test_every_checked_argument_is_checked_while_parsing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    args, argument, shown = BAD_VALUES[case]
    with pytest.raises(SystemExit) as exited:  # jsonargparse's usage error; `__init__` is never reached
        build(tmp_path, *args)
    assert exited.value.code == 2
    section = error_section(capsys.readouterr().err)
    # jsonargparse lists every branch of every union on the way: a callback's own argument takes about 12 lines, one
    # that may be None (jsonargparse makes every default-None argument optional) about 18, and an optional argument of
    # a schedule inside the scheduler, three unions deep, about 32. The message itself is one of them.
    assert len(section) <= 36, "\n".join(section)
    text = "\n".join(section)
    assert f'Parser key "{argument}"' in text and shown in text, text


# What each class a config builds may leave to jsonargparse's plain `int`, `float` or `str`: any value of the type is
# valid there. Every other argument an `__init__` checks needs a type of `lightning_accum._util.cli_types`.
UNCHECKED = {("CountTokens", "key"), ("CountTokens", "ignore_index"), ("AccumulationMonitor", "key_prefix")}
CONFIGURABLE = [AutoMicroBatching, AccumulationScheduler, AccumulationMonitor, ConstantSchedule, StepwiseSchedule]
CONFIGURABLE += [BatchSizeRamp, AdaptiveBatchSize, CountTokens]


def plain_members(hint: Any) -> set[type]:
    """The bare `int`, `float` and `str` in a type hint, unions and all."""
    if hint in (int, float, str):
        return {hint}
    return set().union(*(plain_members(arg) for arg in typing.get_args(hint) if not isinstance(arg, str)))


@pytest.mark.parametrize("cls", CONFIGURABLE, ids=lambda cls: cls.__name__)
def test_no_checked_argument_is_left_to_a_plain_type(cls: type) -> None:
    # The guard that keeps item 1 fixed: a new `grow_patience: int` would parse -3 and fail in `__init__` again.
    hints = typing.get_type_hints(cls.__init__)
    plain = {name: plain_members(hint) for name, hint in hints.items() if name != "return"}
    unchecked = {name for name, members in plain.items() if members and (cls.__name__, name) not in UNCHECKED}
    assert not unchecked, f"{cls.__name__}: annotate {sorted(unchecked)} with a type of lightning_accum._util.cli_types"


@pytest.mark.parametrize(
    ("override", "read", "expected"),
    [
        ("--trainer.callbacks.grow_patience=5", lambda cb: cb.planner.grow_patience, 5),
        ("--trainer.callbacks.micro_batch_size=8", lambda cb: cb.planner.micro_batch_size_setting, 8),
        ("--trainer.callbacks.low_watermark=0.5", lambda cb: cb.planner.low_watermark, 0.5),
        ("--trainer.callbacks.max_memory=1", lambda cb: cb.max_memory, 1.0),  # a fraction: the whole device
        ("--trainer.callbacks.max_memory=8589934592", lambda cb: cb.max_memory, 8 * 2**30),  # bytes
        ("--trainer.callbacks.max_memory=500 MB", lambda cb: cb.max_memory, 500 * 10**6),
        ("--trainer.callbacks.max_memory=null", lambda cb: cb.max_memory, 0.9),
        (
            "--trainer.callbacks.split_batch=tests.test_batch_inputs:split_pairs",
            lambda cb: cb._hooks.split_batch.__name__,
            "split_pairs",
        ),
    ],
)
def test_good_values_reach_the_callback_as_plain_values(
    tmp_path: Path, override: str, read: Any, expected: Any
) -> None:
    cli = build_from(tmp_path, "split_auto.yaml", override)
    (splitter,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, AutoMicroBatching)]
    value = read(splitter)
    assert value == expected and type(value) is type(expected)


def test_the_scheduler_and_the_monitor_get_plain_values(tmp_path: Path) -> None:
    cli = build(
        tmp_path, *SCHEDULER, "--trainer.callbacks.schedule=3", *MONITOR, "--trainer.callbacks.logging_interval=7"
    )
    assert repr(scheduler_of(cli).schedule) == "ConstantSchedule(3)"
    (monitor,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, AccumulationMonitor)]
    assert monitor.logging_interval == 7 and type(monitor.logging_interval) is int


def test_without_jsonargparse_the_package_imports_and_init_still_checks() -> None:
    # jsonargparse is the `cli` extra: blocked here, the types stay unregistered and `__init__` gives its own message.
    script = (
        "import sys; sys.modules['jsonargparse'] = None\n"
        "from lightning_accum import AutoMicroBatching\n"
        "from lightning_accum.memory.budget import check_max_memory\n"
        "try:\n    AutoMicroBatching(grow_patience=-3)\nexcept ValueError as err:\n    print(err)\n"
        "print(AutoMicroBatching(max_memory='6GiB', grow_patience=5).max_memory)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["`grow_patience` must be an int >= 1, got -3.", str(6 * 2**30)]
