"""``preflight``: ``peak(b)`` of a split-mode step from fake-tensor traces, its fallback, and what it leaves alone."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from examples.char_lm.data import CharLMDataModule
from examples.char_lm.model import CharLM
from lightning_accum.memory.model import LinearPeakModel
from lightning_accum.memory.tracker import MemoryTracker
from lightning_accum.probe.measure import optimizers_of, train_step
from lightning_accum.probe.preflight import Preflight, preflight
from lightning_accum.probe.resolve import batch_factory
from lightning_accum.splitting import split_batch
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
