"""``preflight``: ``peak(b)`` of a split-mode step from fake-tensor traces, its fallback, and what it leaves alone."""

from __future__ import annotations

import threading
from typing import ClassVar

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from examples.char_lm.data import CharLMDataModule
from examples.char_lm.model import CharLM
from lightning_accum import AutoMicroBatching
from lightning_accum.batches import split_batch
from lightning_accum.memory.model import LinearPeakModel
from lightning_accum.memory.tracker import MemoryTracker
from lightning_accum.memory.training_step import optimizers_of, train_step
from lightning_accum.probe.resolve import batch_factory
from lightning_accum.split.preflight import TRACED_TRAINING_STEPS, Preflight, in_preflight, preflight
from tests.helpers import make_trainer
from tests.probe.models import _Stack

CHAR_LM = {"max_length": 128, "d_model": 64, "n_layers": 2, "n_heads": 4}


def _step_batch(size: int = 16) -> dict:
    data = CharLMDataModule(batch_size=size, min_length=64, max_length=128, max_sequences=200)
    return batch_factory(data, None, size)(0, size)


def _real_peak(batch: dict, b: int) -> int:
    """The live-tensor peak of a real accumulating step of two micro-batches of ``b``, after a warm-up step."""
    torch.manual_seed(0)
    model = CharLM(**CHAR_LM)
    optimizers = optimizers_of(model.configure_optimizers())
    with MemoryTracker(model, optimizers) as tracker:
        tracker.track(batch, "activations")
        train_step(model, optimizers, split_batch(batch, b)[:2], tracker)
        tracker.reset_peak()
        train_step(model, optimizers, split_batch(batch, b)[:2], tracker)
    return tracker.peak.total_bytes


def test_preflight_predicts_the_real_step_at_both_sizes():
    batch = _step_batch()
    found = preflight(CharLM(**CHAR_LM), batch, (4, 8))
    assert found.reason is None and found.peak_model is not None
    for b in (4, 8):
        real = _real_peak(batch, b)
        print(f"b={b}: traced {found.peaks[b]}, real {real}, in {found.seconds:.2f} s")
        assert found.peaks[b] == pytest.approx(real, rel=0.01)
    assert found.peak_model.predict(4) == found.peaks[4] and found.peak_model.predict(8) == found.peaks[8]


def test_preflight_leaves_the_real_module_its_optimizer_and_the_rng_alone():
    model = _Stack(width=32, depth=3, optimizer="adam")
    optimizer = torch.optim.Adam(model.parameters())
    model.net(torch.randn(4, 32)).sum().backward()
    optimizer.step()  # state exists, as in a resumed run
    optimizer.zero_grad(set_to_none=True)
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    state_bytes = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values())
    batch = (torch.randn(8, 32), torch.randn(8, 1))
    rng = torch.get_rng_state()

    found = preflight(model, batch, (2, 4), optimizers=[optimizer])

    assert found.reason is None
    for name, p in model.named_parameters():
        assert torch.equal(p, weights[name]) and p.grad is None and type(p) is nn.Parameter
    assert len(optimizer.state) == 6 and torch.equal(torch.get_rng_state(), rng)
    weight_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    batch_bytes = 8 * 32 * 4 + 8 * 4
    assert found.baseline_bytes == weight_bytes + state_bytes + batch_bytes  # the copied state is counted


class _DataDependentShape(_Stack):
    def training_step(self, batch, batch_idx):
        x, y = batch
        keep = int((y > 0).sum())  # a number read from the data: fake tensors have none
        return self.net(x[:keep]).sum()


class _DynamicShape(_Stack):
    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.net(x[torch.nonzero(y[:, 0] > 0)[:, 0]]).sum()  # an output shape that depends on the data


class _Uncopyable(_Stack):
    def __init__(self) -> None:
        super().__init__(width=32, depth=2)
        self.lock = threading.Lock()


@pytest.mark.parametrize(
    ("module", "reason"),
    [
        (lambda: _DataDependentShape(width=32, depth=2), "DataDependentOutputException"),
        (lambda: _DynamicShape(width=32, depth=2), "DynamicOutputShapeException"),
        (_Uncopyable, "TypeError: cannot pickle '_thread.lock' object"),
    ],
)
def test_preflight_falls_back_with_a_reason_when_tracing_fails(module, reason):
    found = preflight(module(), (torch.randn(8, 32), torch.randn(8, 1)), (2, 4))
    assert found.peak_model is None and found.reason.startswith(reason), found.reason
    assert found.starting_micro_batch_size(budget_bytes=2**30, upper=8) is None  # the caller probes as before


def test_starting_micro_batch_size_fits_what_a_step_adds_into_the_free_memory_less_a_margin():
    model = LinearPeakModel()
    model.observe(1, 1000 + 100)
    model.observe(2, 1000 + 200)
    found = Preflight(model, peaks={1: 1100, 2: 1200}, baseline_bytes=500)
    # A step adds peak(b) - 500 = 500 + 100 b. Room: (2000 - 700) * 0.9 = 1170 -> b = 6.
    assert found.starting_micro_batch_size(2000, upper=64, current_bytes=700, margin=0.1) == 6
    assert found.starting_micro_batch_size(2000, upper=4, current_bytes=700, margin=0.1) == 4
    # Less free than the budget says (an address-space limit): room 900 * 0.9 = 810 -> b = 3.
    assert found.starting_micro_batch_size(2000, upper=64, current_bytes=700, free_bytes=900, margin=0.1) == 3
    assert found.starting_micro_batch_size(1000, upper=64, current_bytes=700) is None  # not even 1 fits
    with pytest.raises(ValueError, match=r"`margin` must be a fraction in \[0, 1\), got 1.5"):
        found.starting_micro_batch_size(2000, upper=64, margin=1.5)


@pytest.mark.parametrize(
    ("sizes", "error", "match"), [((4, 4), ValueError, "two different sizes"), ((0, 4), ValueError, ">= 1")]
)
def test_preflight_checks_the_sizes(sizes, error, match):
    with pytest.raises(error, match=match):
        preflight(_Stack(width=8, depth=1), torch.randn(8, 8), sizes)


# ---- issue 18, item 9: a `training_step` that reads the Trainer is traced, sees its progress, and cannot change it --


class _ReadsTheTrainer(_Stack):
    """Reads what schedules and curricula read in `training_step`; records what the traced copy saw."""

    seen: ClassVar[list[tuple]] = []  # on the class: the traced copy's own attributes die with it

    def __init__(self) -> None:
        super().__init__(width=16, depth=2)

    def training_step(self, batch, batch_idx):
        lr = self.optimizers().param_groups[0]["lr"]
        warm = min(1.0, (self.global_step + 1) / self.trainer.max_steps)
        if in_preflight():
            type(self).seen.append((self.global_step, self.current_epoch, self.trainer.global_step, lr))
            self.log("only_in_the_trace", 1.0)
        return warm * super().training_step(batch, batch_idx)


class _TraceAtStep(pl.Callback):
    """Calls the pre-flight by hand at one optimizer step, with the real progress then."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.found: Preflight | None = None
        self.trainer_changed: dict[str, tuple] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            before = _trainer_state(trainer)
            self.found = preflight(pl_module, batch, (2, 4), optimizers=trainer.optimizers)
            after = _trainer_state(trainer)
            self.trainer_changed = {k: (before[k], after[k]) for k in before if before[k] != after[k]}


def _trainer_state(trainer: pl.Trainer) -> dict:
    return {
        "global_step": trainer.global_step,
        "batches": trainer.fit_loop.epoch_loop.batch_progress.total.completed,
        "should_stop": trainer.should_stop,
        "callback_metrics": dict(trainer.callback_metrics),
    }


def _regression_loader(n: int = 32, batch_size: int = 8) -> DataLoader:
    data = TensorDataset(torch.randn(n, 16), torch.randn(n, 1))
    return DataLoader(data, batch_size=batch_size)


def test_the_trace_reads_the_real_trainers_progress_and_logs_nothing(tmp_path):
    _ReadsTheTrainer.seen = []
    tracer = _TraceAtStep(step=3)
    trainer = make_trainer(tmp_path, [tracer], max_steps=5, max_epochs=2)
    trainer.fit(_ReadsTheTrainer(), _regression_loader())  # 4 steps an epoch: step 3 is the last of epoch 0
    assert tracer.found is not None and tracer.found.reason is None, tracer.found
    assert _ReadsTheTrainer.seen == [(3, 0, 3, 0.1)] * TRACED_TRAINING_STEPS
    assert tracer.trainer_changed == {}
    assert "only_in_the_trace" not in trainer.callback_metrics and "train_loss" in trainer.callback_metrics


def test_auto_micro_batching_traces_a_training_step_that_reads_the_trainer(tmp_path):
    _ReadsTheTrainer.seen = []
    callback = AutoMicroBatching("auto")
    make_trainer(tmp_path, [callback], max_steps=2).fit(_ReadsTheTrainer(), _regression_loader(batch_size=16))
    found = callback.preflight_result
    assert found is not None and found.reason is None and sorted(found.peaks) == [4, 8]
    assert _ReadsTheTrainer.seen == [(0, 0, 0, 0.1)] * TRACED_TRAINING_STEPS


class _StopsTheRun(_Stack):
    def training_step(self, batch, batch_idx):
        self.trainer.should_stop = True
        return super().training_step(batch, batch_idx)


def test_the_trace_cannot_change_the_trainer(tmp_path):
    tracer = _TraceAtStep(step=0)
    make_trainer(tmp_path, [tracer], max_steps=3).fit(_StopsTheRun(width=16, depth=2), _regression_loader())
    assert tracer.found.peak_model is None
    assert tracer.found.reason.startswith(
        "RuntimeError: `training_step` set `trainer.should_stop` while the pre-flight"
    )
    assert "lightning_accum.in_preflight()" in tracer.found.reason
    assert tracer.trainer_changed == {}  # the real step 0 stops the run afterwards, not the trace


def test_in_preflight_is_true_for_each_traced_training_step_and_false_outside():
    calls = []

    class Records(_Stack):
        def training_step(self, batch, batch_idx):
            calls.append(in_preflight())
            return super().training_step(batch, batch_idx)

    model = Records(width=16, depth=2)
    found = preflight(model, (torch.randn(16, 16), torch.randn(16, 1)), (4, 8))
    assert found.reason is None and calls == [True] * TRACED_TRAINING_STEPS == [True] * 5
    model.training_step((torch.randn(4, 16), torch.randn(4, 1)), 0)
    assert calls[-1] is False and not in_preflight()


def test_in_preflight_is_false_again_after_a_trace_that_failed():
    found = preflight(_DataDependentShape(width=32, depth=2), (torch.randn(8, 32), torch.randn(8, 1)), (2, 4))
    assert found.reason.startswith("DataDependentOutputException") and not in_preflight()
    assert "`.item()`, `int(t)`" in found.reason  # what that usually means in `training_step`


def test_in_preflight_is_public():
    import lightning_accum

    assert lightning_accum.in_preflight is in_preflight and "in_preflight" in lightning_accum.__all__


class _MakesTensorsOnItsDevice(_Stack):
    """InfoNCE's way of making its labels: on ``self.device``, ``arange(n, device=self.device)``."""

    def training_step(self, batch, batch_idx):
        x, _ = batch
        labels = torch.arange(len(x), device=self.device)
        return nn.functional.cross_entropy(self.net(x), labels)


def test_the_trace_runs_a_training_step_that_makes_tensors_on_self_device():
    model = _MakesTensorsOnItsDevice(width=16, depth=2)  # 16 classes: the labels of an 8-sample batch
    # As if on CUDA: `self.device` reads what `.to()` set, so the copy made its tensors there, not on the fake
    # tensors' CPU, and the trace fell back (FakeTensorDeviceMismatchError: cuda:0 and cpu).
    model._device = torch.device("cuda", 0)
    found = preflight(model, (torch.randn(8, 16), torch.randn(8, 1)), (2, 4))
    assert found.reason is None, found.reason
    assert model.device == torch.device("cuda", 0)  # the real module's, untouched
