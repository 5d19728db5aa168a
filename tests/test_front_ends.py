"""The contract of the three accumulation front ends, checked alike over each (issue 20).

`AccumulationScheduler` (window mode, a callback), `ManualAccumulation` (manual optimization, an object the
LightningModule holds and calls ``backward`` on) and `AutoMicroBatching` (split mode, a callback) hold one
`lightning_accum.core.engine.AccumulationEngine`. A small adapter per front end (`FrontEnd`) builds its Trainer and
module and runs a fit; the same checks then run over every front end they apply to:

1. **Validation of k.** A bad schedule raises the pure core's own error, with its message, in both window-mode front
   ends: at construction where it can be known (``{0: 0}``, ``-1``), at the window that asks otherwise (a custom
   schedule whose ``accumulation_steps`` returns 0, 2.5 or True), and the Trainer is left as it was. Split mode has
   no schedule (its ``k`` follows from memory), so its validation of k is the validation of the micro-batch size it
   starts from: ``micro_batch_size=0`` or ``"big"`` raise the planner settings' error.
2. **Schedules** (window mode only, for the same reason): a step-keyed `StepwiseSchedule` and a sample-keyed
   `BatchSizeRamp`, whose changes land mid-epoch, and `AdaptiveBatchSize` give the same k at every step (for the fixed
   ones, the k their arithmetic gives), the same ``schedule_change`` events, the same learning rates and the same
   gradients in both window-mode front ends, each equal to a single-process full-window reference.
3. **State round trip through a real checkpoint** (all three): ``trainer.save_checkpoint`` mid-run (at an epoch's end,
   and mid-epoch with a loader Lightning can resume), then a fresh Trainer and a fresh front end resume with
   ``ckpt_path=`` and continue exactly as the uninterrupted run (k, consumed samples, learning rates, gradients, the
   final state and, for `AdaptiveBatchSize`, the noise-scale estimate); `ManualAccumulation` through the module hooks
   its docs describe. A version-1 state (the layout before the engine) continues alike, and a checkpoint without the
   front end's state loads and stays exact.
4. **Fit twice** (all three): the same front-end object and module in two fits, after a first fit that completes or
   that stops part-way (in a new Trainer, or the same one); both fits are exact and each leaves the Trainer, its
   loops, its strategy and the module as they were.
5. **DDP agreement** (all three, 2 gloo ranks): in window mode, ranks whose first micro-batches hold 4 and 2 samples
   still agree on k for a sample-keyed schedule (the engine agrees the micro-batch size with a max over ranks); in
   split mode, ranks whose step batches hold 8 and 4 samples run 2 and 1 micro-batches. Either way both ranks get the
   same update, equal to the full-batch reference over both ranks' samples.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric import Fabric
from torch.utils.data import DataLoader

import tests.helpers as h
from lightning_accum import (
    AccumulationScheduler,
    AutoMicroBatching,
    FabricAccumulation,
    FabricMicroBatching,
    ManualAccumulation,
)
from lightning_accum.callbacks._owner import find_owner
from lightning_accum.core.engine import AccumulationEngine, ScheduleDriver
from lightning_accum.schedules import AdaptiveBatchSize, BatchSizeRamp, Progress, StepwiseSchedule, as_schedule
from lightning_accum.split.planner.settings import PlannerSettings
from tests.test_uneven_ranks import RankBatches, rank_batches

LR = 0.1
N = 32  # samples per epoch
MICRO = 2  # samples per micro-batch in window mode: 16 micro-batches per epoch
STEP_BATCH = 8  # samples per step batch in split mode: 4 optimizer steps per epoch


# ---------------------------------------------------------------------------------------------------------------------
# the module every front end trains, and what it records at each optimizer step
# ---------------------------------------------------------------------------------------------------------------------
class Interrupted(Exception):
    """What `Recorder` raises to stop a fit part-way, as a crash or a KeyboardInterrupt would."""


class Recorder(h.TokenModel):
    """`tests.helpers.TokenModel` that records, at each optimizer step, what its front end's engine decided.

    With ``accumulation`` it runs under manual optimization, as the docs of `ManualAccumulation` show: ``backward``
    on every micro-batch, the optimizer step when it says the window is complete, and the helper's state in the
    checkpoint through ``on_save_checkpoint`` / ``on_load_checkpoint``.
    """

    def __init__(self, accumulation: ManualAccumulation | None = None, split: bool = False) -> None:
        super().__init__(lr=LR)
        self.accumulation = accumulation
        self.automatic_optimization = accumulation is None
        self.split_mode = split
        self.planned: list[int] = []  # the schedule's k for each step's window
        self.micro_batches: list[int] = []  # micro-batches in each step's window, this rank
        self.consumed: list[int] = []  # samples consumed (all ranks) once each step's window closed
        self.lrs: list[float] = []  # the learning rate each step was taken with
        self.interrupt_after: int | None = None  # micro-batches a fit runs before `Interrupted` stops it
        self._calls = 0

    @property
    def engine(self) -> AccumulationEngine:
        if self.accumulation is not None:
            return self.accumulation.engine
        owner = find_owner(self.trainer.callbacks)
        assert owner is not None
        return owner.engine

    def on_train_start(self) -> None:
        self._window_indices, self._calls = [], 0  # nothing from a fit that stopped part-way

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor | None:
        if self.interrupt_after is not None and self._calls == self.interrupt_after:
            raise Interrupted(f"stopped after {self._calls} micro-batches")
        self._calls += 1
        loss = super().training_step(batch, batch_idx)
        if self.accumulation is None:
            return loss
        optimizer = self.optimizers()
        if self.accumulation.backward(self, loss, batch):
            self.configure_gradient_clipping(optimizer)  # records the step, as Lightning calls it in automatic mode
            optimizer.step()
            optimizer.zero_grad()
        return None

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        engine = self.engine
        self.planned.append(engine.schedule.k)
        self.micro_batches.append(engine.normalizer.micro_batches)
        self.consumed.append(engine.consumed_samples)
        self.lrs.append(optimizer.param_groups[0]["lr"])

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.accumulation is not None:
            checkpoint["accumulation"] = self.accumulation.state_dict()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.accumulation is not None:
            self.accumulation.load_state_dict(checkpoint.get("accumulation", {}))


# ---------------------------------------------------------------------------------------------------------------------
# one adapter per front end
# ---------------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Run:
    """One fit through one front end."""

    front_end: Any  # the AccumulationScheduler, ManualAccumulation or AutoMicroBatching object
    trainer: pl.Trainer
    model: Recorder

    @property
    def engine(self) -> AccumulationEngine:
        return self.front_end.engine

    def changes(self) -> list[tuple[str, int, int, int, str]]:
        return [
            (e.kind, e.step, e.before, e.after, e.reason) for e in self.front_end.events if e.kind == "schedule_change"
        ]


class FrontEnd:
    """How a test builds one front end, the module and Trainer around it, and fits them."""

    name = ""
    window_mode = True  # False: split mode, where k follows from memory and there is no schedule
    batch_size = MICRO  # what the dataloader yields: micro-batches, or whole step batches in split mode
    # id: (setting, windows that run before it is refused; None: refused at construction)
    bad_settings: ClassVar[dict[str, tuple[Any, int | None]]]

    def __repr__(self) -> str:
        return self.name

    def build(self, setting: Any) -> Any:
        """The front end for a schedule (window mode) or a starting micro-batch size (split mode)."""
        raise NotImplementedError

    def core_error(self, setting: Any, windows: int | None) -> Exception:
        """The error the pure core raises for a bad ``setting``: what the front end must raise, word for word."""
        raise NotImplementedError

    def module(self, front_end: Any) -> Recorder:
        return Recorder()

    def callbacks(self, front_end: Any) -> list[pl.Callback]:
        return [front_end]

    def trainer(self, root: Path, front_end: Any, *extra: pl.Callback, ddp: bool = False, **kwargs: Any) -> pl.Trainer:
        if ddp:
            strategy = h.ddp_strategy()  # ranks that disagree fail in a collective (RANK_TIMEOUT), not hang
            kwargs.update(strategy=strategy, devices=2, use_distributed_sampler=False)
        return h.make_trainer(root, [*self.callbacks(front_end), *extra], **kwargs)

    def run(
        self,
        root: Path,
        front_end: Any,
        *extra: pl.Callback,
        epochs: int = 1,
        model: Recorder | None = None,
        loader: DataLoader | None = None,
        ckpt_path: Path | None = None,
        ddp: bool = False,
    ) -> Run:
        model = model if model is not None else self.module(front_end)
        trainer = self.trainer(root, front_end, *extra, max_epochs=epochs, ddp=ddp)
        trainer.fit(model, loader or self.loader(), ckpt_path=ckpt_path)
        return Run(front_end, trainer, model)

    def loader(self) -> DataLoader:
        return ResumableLoader(h.TokenDataset(N), batch_size=self.batch_size)


class ResumableLoader(DataLoader):
    """A DataLoader whose state says how many batches of the epoch the loop took, so a run resumes mid-epoch."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._taken, self._skip = 0, 0

    def __iter__(self):
        skip, self._skip = self._skip, 0
        self._taken = skip
        for i, batch in enumerate(super().__iter__()):
            if i >= skip:
                self._taken += 1
                yield batch

    def state_dict(self) -> dict[str, int]:
        # Lightning fetches no batch ahead from a loader of known length; after the epoch's last, the next starts anew.
        return {"taken": self._taken % len(self)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._skip = state["taken"]


class Returns:
    """A custom schedule whose ``accumulation_steps`` returns ``k``, from optimizer step ``start`` on (2 before)."""

    def __init__(self, k: Any, start: int = 0) -> None:
        self.k, self.start = k, start

    def accumulation_steps(self, progress: Progress) -> Any:
        return self.k if progress.optimizer_steps >= self.start else 2

    def __repr__(self) -> str:
        return f"Returns({self.k!r}, start={self.start})"


BAD_SCHEDULES: dict[str, tuple[Any, int | None]] = {
    "{0: 0}": ({0: 0}, None),
    "-1": (-1, None),
    "{0: True}": ({0: True}, None),
    "2.5": (2.5, None),
    "{3: 2, 1: 4}": ({3: 2, 1: 4}, None),
    "returns 0": (Returns(0), 0),
    "returns 2.5": (Returns(2.5), 0),
    "returns True": (Returns(True), 0),
    "returns 0 from step 2": (Returns(0, start=2), 2),  # every window is checked, not only the first
}


BAD_MICRO_BATCH_SIZES: dict[str, tuple[Any, int | None]] = {
    f"micro_batch_size={size!r}": (size, None) for size in (0, -1, "big", 2.5, True)
}


class WindowFrontEnd(FrontEnd):
    """The front ends that follow a schedule for ``k``."""

    bad_settings = BAD_SCHEDULES

    def core_error(self, setting: Any, windows: int | None) -> Exception:
        try:
            driver = ScheduleDriver(as_schedule(setting, "epoch"))
            for step in range(windows + 1 if windows is not None else 0):
                driver.plan(Progress(optimizer_steps=step), step)
        except (TypeError, ValueError) as err:
            return err
        raise AssertionError(f"the engine accepts {setting!r}")


class Scheduler(WindowFrontEnd):
    """Window mode: a callback of the Trainer; Lightning's loop runs the micro-batches."""

    name = "AccumulationScheduler"

    def build(self, setting: Any) -> AccumulationScheduler:
        return AccumulationScheduler(setting, count_items=h.count_tokens)


class Manual(WindowFrontEnd):
    """Manual optimization: the LightningModule holds the helper and calls its ``backward`` (see `Recorder`)."""

    name = "ManualAccumulation"

    def build(self, setting: Any) -> ManualAccumulation:
        return ManualAccumulation(setting, count_items=h.count_tokens)

    def module(self, front_end: ManualAccumulation) -> Recorder:
        return Recorder(accumulation=front_end)

    def callbacks(self, front_end: ManualAccumulation) -> list[pl.Callback]:
        return []  # the LightningModule holds it


class Split(FrontEnd):
    """Split mode: a callback that cuts each step batch into micro-batches whose size follows memory."""

    name = "AutoMicroBatching"
    window_mode = False
    batch_size = STEP_BATCH
    bad_settings = BAD_MICRO_BATCH_SIZES

    def build(self, setting: Any) -> AutoMicroBatching:
        # Halving and doubling (not the memory model, which CPU peaks would make jittery): from 2, the size doubles
        # after every 3 steps under the budget, up to the step batch.
        return AutoMicroBatching(setting, grow_patience=3, predictive=False, count_items=h.count_tokens)

    def core_error(self, setting: Any, windows: int | None) -> Exception:
        try:
            PlannerSettings(setting)
        except (TypeError, ValueError) as err:
            return err
        raise AssertionError(f"the planner accepts {setting!r}")

    def module(self, front_end: AutoMicroBatching) -> Recorder:
        return Recorder(split=True)


SCHEDULER, MANUAL, SPLIT = Scheduler(), Manual(), Split()
WINDOW_MODE = [SCHEDULER, MANUAL]
FRONT_ENDS = [SCHEDULER, MANUAL, SPLIT]


# ---------------------------------------------------------------------------------------------------------------------
# 1. validation of k
# ---------------------------------------------------------------------------------------------------------------------
def patched_methods(trainer: pl.Trainer, module: pl.LightningModule) -> dict[str, set[str]]:
    """Methods overridden on the objects a front end may patch: instance attributes that shadow a class's method."""
    loop = trainer.fit_loop.epoch_loop
    objects = {
        "trainer": trainer,
        "strategy": trainer.strategy,
        "fit_loop": trainer.fit_loop,
        "epoch_loop": loop,
        "automatic_optimization": loop.automatic_optimization,
        "manual_optimization": loop.manual_optimization,
        "precision": trainer.strategy.precision_plugin,
        "module": module,
    }
    return {name: {a for a in vars(obj) if callable(getattr(type(obj), a, None))} for name, obj in objects.items()}


def trainer_as_left(trainer: pl.Trainer, module: pl.LightningModule) -> dict[str, Any]:
    """What a fit must leave as it found it."""
    return {
        "class": type(trainer),
        "accumulate_grad_batches": trainer.accumulate_grad_batches,
        "patched": patched_methods(trainer, module),
    }


def bad_k_cases(front_ends: list[FrontEnd]) -> dict[str, list[Any]]:
    """``parametrize``'s values and ids for every bad setting of every front end in ``front_ends``."""
    cases = [(fe, case) for fe in front_ends for case in fe.bad_settings]
    return {"argvalues": cases, "ids": [f"{fe}-{case}" for fe, case in cases]}


def core_refusal(front_end: FrontEnd, case: str) -> tuple[Any, Any, Exception, Any]:
    """The bad setting, its windows (``None``: refused at construction), the core's own error, and a check for it."""
    setting, windows = front_end.bad_settings[case]
    expected = front_end.core_error(setting, windows)
    return setting, windows, expected, pytest.raises(type(expected), match=f"^{re.escape(str(expected))}$")


@pytest.mark.parametrize(("front_end", "case"), **bad_k_cases(FRONT_ENDS))
def test_a_bad_k_is_refused_with_the_cores_own_error(tmp_path, front_end, case):
    setting, windows, expected, refused = core_refusal(front_end, case)
    # The message names the argument (`schedule`, `micro_batch_size`) or the schedule, and shows the value.
    assert re.search(r"`schedule(\[0\])?`|`micro_batch_size`|The schedule Returns", str(expected)), expected
    if windows is None:  # known at construction
        with refused:
            front_end.build(setting)
        return
    built = front_end.build(setting)
    model = front_end.module(built)
    trainer = front_end.trainer(tmp_path, built)
    before = trainer_as_left(trainer, model)
    with refused:
        trainer.fit(model, front_end.loader())
    assert len(model.planned) == windows  # refused at the window that asked, not before or after
    assert trainer_as_left(trainer, model) == before


# ---------------------------------------------------------------------------------------------------------------------
# 2. schedules (window mode: split mode has none)
# ---------------------------------------------------------------------------------------------------------------------
EPOCHS = 3
SCHEDULES: dict[str, tuple[Callable[[], Any], list[int] | None]] = {
    # name: (the schedule, the k of every window of a 3-epoch run of 16 micro-batches per epoch; None: measured)
    # k=2 for 3 steps (6 micro-batches), then k=3 mid-epoch 0 (3, 3, 3 and the epoch's last micro-batch); k=4 from
    # step 7, epoch 1's first window; k=5 from step 9, mid-epoch 1 (5, and 3 left), then 5, 5, 5, 1 in epoch 2.
    "step-keyed StepwiseSchedule": (
        lambda: StepwiseSchedule({0: 2, 3: 3, 7: 4, 9: 5}, unit="step", lr_scaling="linear"),
        [2, 2, 2, 3, 3, 3, 3] + [4, 4, 5, 5] + [5] * 4,
    ),
    # The global batch is 4, 8, 12 and 16 samples from 0, 21.3, 42.7 and 64 consumed samples: k = global / 2.
    # Epoch 0: six windows of 2 (24 samples), one of 4; epoch 1 starts at 32: 4, 4, then 6 from 48 and 6 (2 left)
    # from 60; epoch 2 starts at 64: 8, 8.
    "sample-keyed BatchSizeRamp": (
        lambda: BatchSizeRamp(start=4, target=16, increment=4, ramp_samples=64, lr_scaling="sqrt"),
        [2] * 6 + [4] + [4, 4, 6, 6] + [8, 8],
    ),
    "AdaptiveBatchSize": (
        lambda: AdaptiveBatchSize(
            2,
            16,
            objective="noise_scale",
            factor=2.0,
            warmup_windows=2,
            beta=0.5,  # lr_scaling="sqrt_gain"
        ),
        None,
    ),
}


@pytest.fixture(scope="module")
def schedule_runs(tmp_path_factory) -> Callable[[FrontEnd, str], Run]:
    """One 3-epoch run per window-mode front end and schedule, shared by the tests that read it."""
    runs: dict[tuple[str, str], Run] = {}

    def run(front_end: FrontEnd, schedule: str) -> Run:
        key = (front_end.name, schedule)
        if key not in runs:
            root = tmp_path_factory.mktemp(f"{front_end.name}-{schedule.split()[-1]}")
            runs[key] = front_end.run(root, front_end.build(SCHEDULES[schedule][0]()), epochs=EPOCHS)
        return runs[key]

    return run


def windows_of(ks: list[int]) -> list[int]:
    """The micro-batches of each window when the schedule asks for ``ks``: a window never crosses an epoch's end."""
    windows, left = [], 0
    for k in ks:
        left = left or N // MICRO
        windows.append(min(k, left))
        left -= windows[-1]
    return windows


@pytest.mark.parametrize("front_end", WINDOW_MODE, ids=str)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_schedule_sets_k_window_by_window_and_every_window_is_exact(schedule_runs, front_end, schedule):
    run = schedule_runs(front_end, schedule)
    expected_k = SCHEDULES[schedule][1]
    if expected_k is None:  # adaptive: what it measured, but it must have moved for the test to bite
        assert len(set(run.model.planned)) >= 3, run.model.planned
    else:
        assert run.model.planned == expected_k
    assert run.model.micro_batches == windows_of(run.model.planned)
    # Every schedule's `lr_scaling` (issue 39): each change multiplies the rate by (k_new / k_old) or its square root,
    # so every step's rate is the first's times (k / k_first) or its square root.
    schedule = run.engine.schedule.schedule
    lrs, planned = run.model.lrs, run.model.planned
    if schedule.lr_scaling in ("linear", "sqrt"):
        exponent = 1.0 if schedule.lr_scaling == "linear" else 0.5
        assert lrs == pytest.approx([LR * (k / planned[0]) ** exponent for k in planned])
    else:  # AdaptiveBatchSize's default gain rule: the rate moves where k does, under the square-root rule's, and
        # ends at the multiplier the schedule applied (each factor is the schedule's own: tests/test_lr_gain.py)
        assert [i for i in range(1, len(lrs)) if lrs[i] != lrs[i - 1]] == [
            i for i in range(1, len(planned)) if planned[i] != planned[i - 1]
        ]
        assert all(LR < lr < LR * (k / planned[0]) ** 0.5 for lr, k in zip(lrs, planned, strict=True) if k > planned[0])
        assert lrs[-1] == pytest.approx(LR * schedule._lr.applied)
    assert run.model.consumed == list(itertools.accumulate(len(indices) for indices in run.model.step_indices))
    assert [change[1:4] for change in run.changes()] == [
        (step, before, after)
        for step, (before, after) in enumerate(zip(run.model.planned, run.model.planned[1:], strict=False), start=1)
        if before != after
    ]
    initial = Recorder()
    expected = h.replay_reference(
        initial, h.TokenDataset(N), run.model.step_indices, h.token_loss, lr=LR, lrs=run.model.lrs
    )
    h.assert_grads_close(run.model.step_grads, expected, **h.FP32)


# ---------------------------------------------------------------------------------------------------------------------
# 3. the state through a real checkpoint
# ---------------------------------------------------------------------------------------------------------------------
class SaveMidRun(pl.Callback):
    """``trainer.save_checkpoint`` in the middle of a run: at the end of epoch 0, or after epoch 1's second step."""

    def __init__(self, path: Path, where: str) -> None:
        self.path, self.where = path, where
        self.steps = -1  # optimizer steps taken when it saved
        self._steps_before_epoch = 0

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._steps_before_epoch = trainer.global_step

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.where == "epoch end" and trainer.current_epoch == 0:
            self._save(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        stepped_in_epoch = trainer.global_step - self._steps_before_epoch
        if self.where == "mid-epoch" and trainer.current_epoch == 1 and stepped_in_epoch == 2 and self.steps < 0:
            self._save(trainer)  # right after the window of step 2 closed: the next micro-batch opens one

    def _save(self, trainer: pl.Trainer) -> None:
        trainer.save_checkpoint(self.path)
        self.steps = trainer.global_step


def setting_for(front_end: FrontEnd, name: str) -> Any:
    """A schedule of `SCHEDULES` (window mode), or the micro-batch size split mode starts from."""
    return SCHEDULES[name][0]() if front_end.window_mode else 2


ROUND_TRIPS = [(fe, name) for fe in WINDOW_MODE for name in SCHEDULES] + [(SPLIT, "micro-batch size 2, growing")]
ROUND_TRIP_IDS = [f"{fe}-{name}" for fe, name in ROUND_TRIPS]


def state_key(front_end: Any) -> str | None:
    """Where the checkpoint holds the front end's state: a callback's state key; ``None`` for the module's hooks."""
    return None if isinstance(front_end, ManualAccumulation) else front_end.state_key


def rewrite_state(src: Path, dst: Path, front_end: Any, change: Callable[[dict[str, Any]], dict[str, Any] | None]):
    """A copy of the checkpoint at ``src`` whose front-end state is ``change(state)`` (``None``: no entry at all)."""
    checkpoint = torch.load(src, weights_only=False)
    key = state_key(front_end)
    entries = checkpoint if key is None else checkpoint["callbacks"]
    state = change(copy.deepcopy(entries.pop("accumulation" if key is None else key)))
    if state is not None:
        entries["accumulation" if key is None else key] = state
    torch.save(checkpoint, dst)
    return dst


def as_version_1(state: dict[str, Any]) -> dict[str, Any]:
    """The layout a front end's state had before the engine (the parent of commit 0f97670), from today's.

    The callbacks wrote ``version: 1``; `AutoMicroBatching` had no schedule, so no agreed micro-batch size.
    `ManualAccumulation` wrote no version, and agreed no micro-batch size either.
    """
    old = dict(state)
    if "optimizer_steps" in old:  # ManualAccumulation
        del old["version"], old["micro_batch_size"]
    else:
        old["version"] = 1
        if "planner" in old:
            del old["micro_batch_size"]
    return old


def without_measured_memory(state: dict[str, Any]) -> dict[str, Any]:
    """A front end's state without the peaks split mode's planner measured (this process's memory, run to run)."""
    if "planner" not in state:
        return state
    measured = ("last_peak", "model", "fitted", "swings")  # peaks, and the steps that fitted or swung by them
    planner = {k: v for k, v in state["planner"].items() if k not in measured}
    return {**state, "planner": planner}


LAYOUTS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "current": lambda state: state,
    "version 1": as_version_1,
}


def assert_resumed_continues_the_full_run(front_end: FrontEnd, full: Run, resumed: Run, done: int) -> None:
    """Asserts that ``resumed``, started from the checkpoint after ``done`` steps, is the rest of ``full``."""
    changing = full.model.planned if front_end.window_mode else full.model.micro_batches
    assert len(set(changing[done - 1 :])) > 1, "k must change after the checkpoint for this test to bite"
    for record in ("planned", "micro_batches", "consumed", "lrs", "step_indices"):
        assert getattr(resumed.model, record) == getattr(full.model, record)[done:], record
    assert resumed.changes() == [change for change in full.changes() if change[1] >= done]
    h.assert_grads_close(resumed.model.step_grads, full.model.step_grads[done:], **h.FP32)
    for name, value in full.model.state_dict().items():
        torch.testing.assert_close(resumed.model.state_dict()[name], value, **h.FP32)
    assert without_measured_memory(resumed.front_end.state_dict()) == without_measured_memory(
        full.front_end.state_dict()
    )


def assert_the_fit_is_exact(model: Recorder, start: Recorder, done: int) -> None:
    """Asserts that the steps ``model`` took after its first ``done`` are exact, from the weights ``start`` had."""
    steps = model.step_indices[done:]
    expected = h.replay_reference(start, h.TokenDataset(N), steps, h.token_loss, lr=LR, lrs=model.lrs[done:])
    h.assert_grads_close(model.step_grads[done:], expected, **h.FP32)


def assert_one_whole_epoch(front_end: FrontEnd, built: Any, model: Recorder, done: int, first_step: int) -> None:
    """Asserts that the steps after the first ``done`` ran one whole epoch, planned as a fit from ``first_step``."""
    assert sum(len(indices) for indices in model.step_indices[done:]) == N
    if front_end.window_mode:
        assert model.planned[done:] == planned_in_one_epoch(built.engine.schedule.schedule, first_step)
        assert model.micro_batches[done:] == windows_of(model.planned[done:])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("where", ["epoch end", "mid-epoch"])
@pytest.mark.parametrize(("front_end", "setting"), ROUND_TRIPS, ids=ROUND_TRIP_IDS)
def test_a_run_resumed_from_a_checkpoint_continues_as_the_uninterrupted_one(
    tmp_path, front_end, setting, where, layout
):
    save = SaveMidRun(tmp_path / "mid.ckpt", where)
    full = front_end.run(tmp_path / "full", front_end.build(setting_for(front_end, setting)), save, epochs=EPOCHS)
    ckpt = rewrite_state(save.path, tmp_path / "resume.ckpt", full.front_end, LAYOUTS[layout])
    fresh = front_end.build(setting_for(front_end, setting))
    resumed = front_end.run(tmp_path / "resumed", fresh, epochs=EPOCHS, ckpt_path=ckpt)

    done = save.steps
    assert 0 < done < len(full.model.planned)
    assert_resumed_continues_the_full_run(front_end, full, resumed, done)
    if isinstance(full.engine.schedule.schedule, AdaptiveBatchSize):
        assert full.engine.schedule.noise_scale.value().windows == len(full.model.planned)
        assert resumed.engine.schedule.noise_scale.value() == full.engine.schedule.noise_scale.value()


@pytest.mark.parametrize(("front_end", "setting"), ROUND_TRIPS, ids=ROUND_TRIP_IDS)
def test_a_checkpoint_without_the_front_ends_state_loads_and_the_run_stays_exact(tmp_path, front_end, setting):
    # A checkpoint from before the front end was added (or from before its state was saved): it starts over.
    save = SaveMidRun(tmp_path / "mid.ckpt", "mid-epoch")
    full = front_end.run(tmp_path / "full", front_end.build(setting_for(front_end, setting)), save, epochs=EPOCHS)
    ckpt = rewrite_state(save.path, tmp_path / "empty.ckpt", full.front_end, lambda state: None)
    fresh = front_end.build(setting_for(front_end, setting))
    resumed = front_end.run(tmp_path / "resumed", fresh, epochs=EPOCHS, ckpt_path=ckpt)

    assert resumed.trainer.global_step == resumed.trainer.global_step > save.steps
    assert resumed.model.consumed == list(itertools.accumulate(len(i) for i in resumed.model.step_indices))
    at_checkpoint = Recorder()
    at_checkpoint.load_state_dict(torch.load(ckpt, weights_only=False)["state_dict"])
    expected = h.replay_reference(
        at_checkpoint, h.TokenDataset(N), resumed.model.step_indices, h.token_loss, lr=LR, lrs=resumed.model.lrs
    )
    h.assert_grads_close(resumed.model.step_grads, expected, **h.FP32)


# ---------------------------------------------------------------------------------------------------------------------
# 4. fit twice
# ---------------------------------------------------------------------------------------------------------------------
FIRST_FITS: dict[str, tuple[int | None, bool]] = {
    # name: (micro-batches after which the first fit stops, whether the second fit runs in the same Trainer)
    "completes": (None, False),
    # Stops in window mode's third window (k=2), in split mode's second step (4 micro-batches of 2), as a crash or a
    # KeyboardInterrupt would; the second fit runs in a new Trainer, or again in the one that stopped.
    "stops mid-window": (5, False),
    "stops mid-window, same Trainer": (5, True),
}


def planned_in_one_epoch(schedule: StepwiseSchedule, first_step: int) -> list[int]:
    """The k of each window of an epoch of ``N / MICRO`` micro-batches whose first window is step ``first_step``."""
    ks, left = [], N // MICRO
    while left > 0:
        ks.append(schedule.accumulation_steps(Progress(optimizer_steps=first_step + len(ks))))
        left -= min(ks[-1], left)
    return ks


@pytest.mark.parametrize("first_fit", FIRST_FITS)
@pytest.mark.parametrize("front_end", FRONT_ENDS, ids=str)
def test_one_front_end_fits_twice_and_leaves_nothing_behind(tmp_path, front_end, first_fit):
    stop_after, same_trainer = FIRST_FITS[first_fit]
    built = front_end.build(setting_for(front_end, "step-keyed StepwiseSchedule"))
    model = front_end.module(built)
    trainer = None
    for fit in range(2):  # the same front end and module
        model.interrupt_after = stop_after if fit == 0 else None
        if trainer is None or not same_trainer:
            trainer = front_end.trainer(tmp_path / f"fit{fit}", built, max_epochs=1)
        before = trainer_as_left(trainer, model)
        start, done, first_step = copy.deepcopy(model), len(model.planned), trainer.global_step
        if model.interrupt_after is None:
            trainer.fit(model, front_end.loader())
        else:
            with pytest.raises(Interrupted, match=r"^stopped after 5 micro-batches$"):
                trainer.fit(model, front_end.loader())
        assert trainer_as_left(trainer, model) == before
        assert type(trainer) is pl.Trainer and trainer.accumulate_grad_batches == 1
        assert_the_fit_is_exact(model, start, done)
    # The second fit ran a whole epoch as a first one would, from the Trainer's step count.
    assert_one_whole_epoch(front_end, built, model, done, first_step)
    # Only complete windows count their samples, and the count goes on from one fit to the next.
    assert model.consumed == list(itertools.accumulate(len(indices) for indices in model.step_indices))
    assert built.engine.consumed_samples == model.consumed[-1]


# ---------------------------------------------------------------------------------------------------------------------
# 5. DDP agreement
# ---------------------------------------------------------------------------------------------------------------------
class SaveRank(pl.Callback):
    """Saves what the module recorded on each rank, and its final parameters, to ``out_dir/rank{r}.pt``."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir

    def on_train_end(self, trainer: pl.Trainer, pl_module: Recorder) -> None:
        records = ("planned", "micro_batches", "consumed", "lrs", "step_indices", "step_grads")
        figures = {record: getattr(pl_module, record) for record in records}
        figures["params"] = {n: p.detach().clone() for n, p in pl_module.named_parameters()}
        torch.save(figures, os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt"))


DDP_CASES: dict[str, tuple[Callable[[], Any], list[tuple[int, int]], list[list[int]]]] = {
    # name: (setting, samples per batch on (rank 0, rank 1), micro-batches of each step on each rank)
    # Micro-batches of 4 samples, but rank 1's first holds 2. Agreed on 4, k = 16 / (4 * 2) = 2 for the first two
    # windows (14 and 16 samples), then 32 / (4 * 2) = 4 from 30 consumed samples on; rank 1 alone would ask
    # 16 / (2 * 2) = 4 at once.
    "window": (
        lambda: BatchSizeRamp(start=16, target=32, increment=16, ramp_samples=28),
        [(4, 2)] + [(4, 4)] * 7,
        [[2, 2, 4], [2, 2, 4]],
    ),
    # Step batches of 8 and 4 samples from micro-batches of 4: rank 0 runs 2 micro-batches, rank 1 one.
    "split": (lambda: 4, [(8, 4)] * 3, [[2, 2, 2], [1, 1, 1]]),
}


@pytest.mark.ddp
@pytest.mark.timeout(240)
@pytest.mark.parametrize("front_end", FRONT_ENDS, ids=str)
def test_ranks_with_uneven_batches_agree_and_get_the_same_exact_update(tmp_path, front_end):
    setting, sizes, micro_batches = DDP_CASES["window" if front_end.window_mode else "split"]
    dataset = h.TokenDataset(sum(map(sum, sizes)))
    built = front_end.build(setting())
    model = front_end.module(built)
    initial = copy.deepcopy(model)
    loader = DataLoader(dataset, batch_sampler=RankBatches(rank_batches(sizes)))
    front_end.run(tmp_path, built, SaveRank(tmp_path), model=model, loader=loader, ddp=True)

    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert len(ranks[0]["step_indices"][0]) != len(ranks[1]["step_indices"][0]), "the ranks' first windows differ"
    assert [r["micro_batches"] for r in ranks] == micro_batches
    assert ranks[0]["planned"] == ranks[1]["planned"]
    assert ranks[0]["consumed"] == ranks[1]["consumed"]
    h.assert_grads_close(ranks[0]["step_grads"], ranks[1]["step_grads"], rtol=0, atol=0)
    for name, value in ranks[0]["params"].items():
        torch.testing.assert_close(ranks[1]["params"][name], value, rtol=0, atol=0, msg=f"the replicas differ: {name}")
    windows = [a + b for a, b in zip(ranks[0]["step_indices"], ranks[1]["step_indices"], strict=True)]
    assert ranks[0]["consumed"] == list(itertools.accumulate(map(len, windows)))
    expected = h.replay_reference(initial, dataset, windows, h.token_loss, lr=LR, lrs=ranks[0]["lrs"])
    h.assert_grads_close(ranks[0]["step_grads"], expected, **h.FP32)


# ---------------------------------------------------------------------------------------------------------------------
# 6. the Fabric front ends: the same checks, through a Fabric loop instead of Trainer.fit
# ---------------------------------------------------------------------------------------------------------------------
class FabricRecorder(Recorder):
    """`Recorder` in a Fabric loop: the loop calls its hooks where Lightning's would, and gives it the front end."""

    def __init__(self, split: bool = False) -> None:
        super().__init__(split=split)
        self.front_end: Any = None

    @property
    def engine(self) -> AccumulationEngine:
        return self.front_end.engine

    def clip_gradients(self, *args: Any, **kwargs: Any) -> None:
        """No clipping is configured (and a Fabric loop has no Trainer to clip through)."""


class FabricLoop:
    """What the checks use of a Trainer, for a Fabric loop: ``fit(model, loader, ckpt_path=)`` and ``global_step``.

    Window mode is the loop `docs/fabric.md` shows; split mode hands each loader batch to ``step``. ``save`` writes
    ``fabric.save`` where `SaveMidRun` would: at the end of epoch 0, or after epoch 1's second step.
    """

    def __init__(self, front_end: Any, max_epochs: int = 1, save: SaveMidRun | None = None) -> None:
        self.front_end, self.max_epochs, self.save = front_end, max_epochs, save
        self.epoch, self.batch_in_epoch = 0, 0  # split mode's position (window mode's is the front end's)

    @property
    def global_step(self) -> int:
        return int(self.front_end.optimizer_steps)

    def state(self) -> dict[str, Any]:
        acc = self.front_end
        return {"model": acc.model, "optimizer": acc.optimizer, "accumulation": acc, "loop": self}

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.batch_in_epoch = state["epoch"], state["batch_in_epoch"]

    def fit(self, model: FabricRecorder, loader: DataLoader, ckpt_path: Path | None = None) -> None:
        acc = self.front_end
        model.front_end = acc
        if ckpt_path is not None:
            acc.fabric.load(ckpt_path, self.state())
        model.on_train_start()
        window_mode = isinstance(acc, FabricAccumulation)
        first_epoch = acc.epoch if window_mode else self.epoch
        for epoch in range(first_epoch, first_epoch + self.max_epochs - (first_epoch if ckpt_path else 0)):
            steps_before = self.global_step
            batches = acc.batches(loader) if window_mode else self._split_batches(loader)
            for index, batch in enumerate(batches):
                if window_mode:
                    with acc.micro_batch(batch):
                        acc.backward(acc.model.training_step(batch, index))
                else:
                    model.on_train_batch_start(batch, index)
                    acc.step(batch, lambda module, micro, i=index: module.training_step(micro, i))
                if not window_mode or acc.should_step:
                    model.configure_gradient_clipping(acc.optimizer)
                    acc.optimizer.step()
                    acc.optimizer.zero_grad()
                    stepped = self.global_step - steps_before
                    if self._saves("mid-epoch", epoch == 1 and stepped == 2):
                        self._save()
            self.epoch, self.batch_in_epoch = epoch + 1, 0
            if self._saves("epoch end", epoch == 0):
                self._save()

    def _split_batches(self, loader: DataLoader) -> Any:
        for index, batch in enumerate(loader):
            if index >= self.batch_in_epoch:
                self.batch_in_epoch = index + 1
                yield batch

    def _saves(self, where: str, now: bool) -> bool:
        return self.save is not None and self.save.where == where and now and self.save.steps < 0

    def _save(self) -> None:
        assert self.save is not None
        self.front_end.fabric.save(self.save.path, self.state())
        self.save.steps = self.global_step


class FabricFrontEnd(FrontEnd):
    """A Fabric front end: built with its Fabric, module and optimizer; fitted by `FabricLoop`."""

    def module(self, front_end: Any) -> FabricRecorder:
        recorder: FabricRecorder = front_end.model.module
        recorder.front_end = front_end
        return recorder

    def setup(self, split: bool = False) -> tuple[Fabric, Any, Any]:
        fabric = Fabric(accelerator="cpu", devices=1)
        recorder = FabricRecorder(split=split)
        model, optimizer = fabric.setup(recorder, torch.optim.SGD(recorder.parameters(), lr=LR))
        return fabric, model, optimizer

    def trainer(self, root: Path, front_end: Any, *extra: Any, ddp: bool = False, **kwargs: Any) -> Any:
        assert not ddp, "Fabric's DDP runs in tests/test_fabric_ddp.py (a launched script)"
        save = next((e for e in extra if isinstance(e, SaveMidRun)), None)
        return FabricLoop(front_end, kwargs.get("max_epochs", 1), save)

    def run(self, root: Path, front_end: Any, *extra: Any, epochs: int = 1, model: Any = None, loader: Any = None,
            ckpt_path: Path | None = None, ddp: bool = False) -> Run:  # fmt: skip
        model = model if model is not None else self.module(front_end)
        loop = self.trainer(root, front_end, *extra, max_epochs=epochs, ddp=ddp)
        loop.fit(model, loader or self.loader(), ckpt_path=ckpt_path)
        return Run(front_end, loop, model)


class FabricWindow(FabricFrontEnd, WindowFrontEnd):
    name = "FabricAccumulation"

    def build(self, setting: Any) -> FabricAccumulation:
        return FabricAccumulation(*self.setup(), setting, count_items=h.count_tokens)


class FabricSplit(FabricFrontEnd, Split):
    name = "FabricMicroBatching"

    def build(self, setting: Any) -> FabricMicroBatching:
        fabric, model, optimizer = self.setup(split=True)
        return FabricMicroBatching(
            fabric, model, optimizer, setting, grow_patience=3, predictive=False, count_items=h.count_tokens
        )


FABRIC_WINDOW, FABRIC_SPLIT = FabricWindow(), FabricSplit()
FABRIC = [FABRIC_WINDOW, FABRIC_SPLIT]


@pytest.mark.parametrize(("front_end", "case"), **bad_k_cases(FABRIC))
def test_fabric_a_bad_k_is_refused_with_the_cores_own_error(tmp_path, front_end, case):
    setting, windows, _, refused = core_refusal(front_end, case)
    if windows is None:
        with refused:
            front_end.build(setting)
        return
    built = front_end.build(setting)
    model = front_end.module(built)
    with refused:
        front_end.run(tmp_path, built, model=model)
    assert len(model.planned) == windows


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("front_end", [MANUAL, FABRIC_WINDOW], ids=str)
def test_the_other_window_mode_front_ends_follow_a_schedule_as_the_scheduler_does(schedule_runs, front_end, schedule):
    # ManualAccumulation in a Trainer and FabricAccumulation in a Fabric loop, each against AccumulationScheduler.
    scheduler, other = schedule_runs(SCHEDULER, schedule), schedule_runs(front_end, schedule)
    for record in ("planned", "micro_batches", "consumed", "lrs", "step_indices"):
        assert getattr(other.model, record) == getattr(scheduler.model, record), record
    assert other.changes() == scheduler.changes()
    h.assert_grads_close(other.model.step_grads, scheduler.model.step_grads, **h.FP32)
    if isinstance(scheduler.engine.schedule.schedule, AdaptiveBatchSize):
        torch.testing.assert_close(
            dataclasses.astuple(other.engine.schedule.noise_scale.value()),
            dataclasses.astuple(scheduler.engine.schedule.noise_scale.value()),
        )


def test_fabric_split_mode_plans_as_the_trainer_does(tmp_path):
    trainer, fabric = (fe.run(tmp_path / fe.name, fe.build(2), epochs=EPOCHS) for fe in (SPLIT, FABRIC_SPLIT))
    assert len(set(trainer.model.micro_batches)) > 1, "the micro-batch size must grow for this test to bite"
    for record in ("micro_batches", "consumed", "lrs", "step_indices"):
        assert getattr(fabric.model, record) == getattr(trainer.model, record), record
    h.assert_grads_close(fabric.model.step_grads, trainer.model.step_grads, **h.FP32)


FABRIC_ROUND_TRIPS = [(FABRIC_WINDOW, name) for name in SCHEDULES] + [(FABRIC_SPLIT, "micro-batch size 2, growing")]


@pytest.mark.parametrize("where", ["epoch end", "mid-epoch"])
@pytest.mark.parametrize(
    ("front_end", "setting"), FABRIC_ROUND_TRIPS, ids=[f"{fe}-{name}" for fe, name in FABRIC_ROUND_TRIPS]
)
def test_fabric_a_run_resumed_from_fabric_load_continues_as_the_uninterrupted_one(tmp_path, front_end, setting, where):
    save = SaveMidRun(tmp_path / "mid.ckpt", where)
    full = front_end.run(tmp_path / "full", front_end.build(setting_for(front_end, setting)), save, epochs=EPOCHS)
    fresh = front_end.build(setting_for(front_end, setting))
    resumed = front_end.run(tmp_path / "resumed", fresh, epochs=EPOCHS, ckpt_path=save.path)

    done = save.steps
    assert 0 < done < len(full.model.micro_batches)
    assert_resumed_continues_the_full_run(front_end, full, resumed, done)
    if isinstance(full.engine.schedule.schedule, AdaptiveBatchSize):
        assert resumed.engine.schedule.noise_scale.value() == full.engine.schedule.noise_scale.value()


@pytest.mark.parametrize("front_end", FABRIC, ids=str)
def test_fabric_one_front_end_runs_two_loops_in_one_process(tmp_path, front_end):
    built = front_end.build(setting_for(front_end, "step-keyed StepwiseSchedule"))
    model = front_end.module(built)
    for fit in range(2):  # the same front end and module, one epoch each
        start, done, first_step = FabricRecorder(), len(model.micro_batches), built.optimizer_steps
        start.load_state_dict(model.state_dict())  # not a deepcopy: the recorder holds the front end, Fabric's objects
        front_end.run(tmp_path / f"fit{fit}", built, model=model)
        assert_the_fit_is_exact(model, start, done)
        assert_one_whole_epoch(front_end, built, model, done, first_step)
    assert model.consumed == list(itertools.accumulate(len(indices) for indices in model.step_indices))
    assert built.engine.consumed_samples == model.consumed[-1] == 2 * N
