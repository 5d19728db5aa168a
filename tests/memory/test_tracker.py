"""``MemoryTracker``: exact live-tensor bytes by category, the peak and its phase, agreement with CUDA's allocator."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_accum.memory.tracker import MemoryTracker
from tests.probe.models import _Stack, grad_bytes


def test_tracker_counts_exact_bytes_by_category():
    model = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 128))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    weights = 4 * (128 * 256 + 256 + 256 * 128 + 128)
    with MemoryTracker(model, [opt]) as tracker:
        assert tracker.current.by_category == {
            "parameters": weights,
            "gradients": 0,
            "optimizer_state": 0,
            "activations": 0,
        }
        x = torch.ones(32, 128)  # created inside: an input, counted as activation
        loss = model(x).sum()
        # the input and the ReLU output are saved for backward; the last Linear's output only lives until the sum
        assert tracker.current.by_category["activations"] == 4 * 32 * (128 + 256) + 4
        loss.backward()
        del loss, x
        assert tracker.current.by_category["gradients"] == weights
        assert tracker.current.by_category["activations"] == 0  # everything of the pass has been freed
        opt.step()
        assert tracker.current.by_category["optimizer_state"] == weights  # one momentum buffer per parameter
        opt.zero_grad(set_to_none=True)
        assert tracker.current.total_bytes == 2 * weights
    assert tracker.peak.total_bytes >= 2 * weights + 4 * 32 * 256


def test_tracker_reset_peak_and_phases():
    model = nn.Linear(64, 64)
    with MemoryTracker(model) as tracker:
        with tracker.phase("big"):
            big = torch.zeros(1024, 1024)
        del big
        assert tracker.peak.phase == "big"
        tracker.reset_peak()
        assert tracker.peak.total_bytes == tracker.current.total_bytes == 4 * (64 * 64 + 64)
    with pytest.raises(ValueError, match=r"`category` must be one of"):
        tracker.track(torch.ones(1), "weights")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; none is present here")
def test_tracker_agrees_with_cuda_allocator():
    model = _Stack(width=256, depth=8).cuda()
    opt = torch.optim.Adam(model.parameters())

    def step() -> None:
        model.net(torch.randn(256, 256, device="cuda")).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # warm-up: optimizer state and cuBLAS workspaces exist from here on, outside what we compare
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with MemoryTracker(model, [opt], device="cuda") as tracker:
        start = tracker.current.total_bytes
        step()
    torch.cuda.synchronize()
    allocator_rise = torch.cuda.max_memory_allocated() - base
    tracker_rise = tracker.peak.total_bytes - start
    assert tracker.peak.by_category["parameters"] == grad_bytes(model)
    # The allocator rounds every block up to 512 bytes and sees scratch memory inside kernels; the tracker does not.
    assert tracker_rise == pytest.approx(allocator_rise, rel=0.1, abs=256 * 1024)


def test_tracker_counts_allocator_blocks():
    model = nn.Linear(3, 3)  # a 36-byte weight and a 12-byte bias
    with MemoryTracker(model, block_bytes=512) as tracker:
        x = torch.ones(1000)  # 4000 bytes -> 8 blocks
        assert tracker.current.by_category == {
            "parameters": 2 * 512,
            "gradients": 0,
            "optimizer_state": 0,
            "activations": 8 * 512,
        }
        del x
    with pytest.raises(ValueError, match=r"`block_bytes` must be an int >= 1, got 0"):
        MemoryTracker(block_bytes=0)


def test_tracker_peak_per_phase():
    model = nn.Linear(256, 256)
    opt = torch.optim.Adam(model.parameters())
    weights = 4 * (256 * 256 + 256)
    with MemoryTracker(model, [opt]) as tracker:
        for step in range(2):
            if step == 1:  # after the warm-up step
                tracker.reset_peak()
            with tracker.phase("forward"):
                loss = model(torch.ones(64, 256)).sum()
            with tracker.phase("backward"):
                loss.backward()
            del loss
            with tracker.phase("optimizer"):
                opt.step()
            opt.zero_grad(set_to_none=True)
        peaks = tracker.phase_peaks
    assert set(peaks) == {"", "forward", "backward", "optimizer"}
    assert peaks["optimizer"] >= 4 * weights  # parameters, gradients, exp_avg, exp_avg_sq
    assert max(peaks.values()) == tracker.peak.total_bytes


class _ScriptedBackend:
    """A memory backend whose peak since each reset is read from a script: the phases' boundaries are the readings."""

    name = "cpu"

    def __init__(self, peaks):
        self.peaks, self.resets = list(peaks), 0

    def reset_peak(self):
        self.resets += 1

    def peak_bytes(self):
        return self.peaks.pop(0)


def test_a_backend_is_read_over_each_phase_and_a_nested_phase_counts_for_the_outer_one_too():
    # Before "step", in "step" before "inner", in "inner", in "step" after it, between the phases, in "after".
    backend = _ScriptedBackend([5, 7, 30, 9, 1, 11])
    with MemoryTracker(backend=backend) as tracker:
        with tracker.phase("step"):
            with tracker.phase("inner"):
                pass
        with tracker.phase("after"):
            pass
    # The readings outside every phase belong to none; "inner"'s 30 is also "step"'s peak.
    assert tracker.backend_phase_peaks == {"step": 30, "inner": 30, "after": 11}
    tracker.reset_peak()
    assert tracker.backend_phase_peaks == {} and backend.resets == 7
