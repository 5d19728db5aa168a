"""The step's timings where the compute runs (`lightning_accum.core.step_clock`): a GPU that runs behind the host.

No GPU here: `FakeGPU` is one, as the host sees it. The host queues work and runs on; the device runs it in order, and
an event recorded on its stream is reached when the work queued before it is done. The host waits only where it must
(here, at each optimizer step, as a ``loss.item()`` or a gradient clip's norm makes it). That is what reads wrong on
the host's clock (a micro-batch short, the step long) and what `DeviceStepClock` reads right.
"""

from __future__ import annotations

import pytest
import torch

import lightning_accum.core.engine as engine_module
from lightning_accum.core import step_clock
from lightning_accum.core.engine import AccumulationEngine
from lightning_accum.core.step_clock import DeviceStepClock, StepClock, clock_for
from lightning_accum.schedules import AdaptiveBatchSize

MICRO_BATCH, STEP, QUEUE = 0.010, 0.030, 0.001
"""A micro-batch's forward and backward and the step's fixed part on the device, and what queuing a micro-batch costs
the host (seconds)."""


class FakeGPU:
    """The host's time and the device's queue: work runs in order, from when it is queued or the device is free."""

    def __init__(self) -> None:
        self.host = 0.0
        self.free_at = 0.0  # when the device has done everything queued so far
        self.events = 0

    def queue(self, seconds: float) -> None:
        self.free_at = max(self.free_at, self.host) + seconds
        self.host += QUEUE

    def sync(self) -> None:
        self.host = max(self.host, self.free_at)

    def record(self) -> FakeEvent:
        self.events += 1
        return FakeEvent(self, max(self.free_at, self.host))


class FakeEvent:
    def __init__(self, gpu: FakeGPU, at: float) -> None:
        self.gpu, self.at = gpu, at

    def query(self) -> bool:
        return self.gpu.host >= self.at

    def elapsed_time(self, end: FakeEvent) -> float:
        return (end.at - self.at) * 1e3  # milliseconds, as torch.cuda.Event's


def train(gpu: FakeGPU, clock: StepClock | DeviceStepClock, windows: int, k: int) -> list[tuple[float, ...]]:
    """``windows`` windows of ``k`` micro-batches: each window's ``take``, the host waiting at each step."""
    taken = []
    for _ in range(windows):
        for i in range(k):
            clock.tick(first=i == 0)  # as the backward starts (AccumulationEngine.add)
            gpu.queue(MICRO_BATCH)
        taken.append(clock.take())  # the window's close, before the step
        gpu.queue(STEP)
        gpu.sync()
    return taken


def means(taken: list[tuple[float, ...]]) -> tuple[float, float]:
    """The micro-batch's and the step's mean seconds over the windows (as `StepCostAverage` weighs the sums)."""
    inner, count, overhead, steps = (sum(column) for column in zip(*taken, strict=True))
    return inner / count, overhead / steps


def test_the_device_clock_reads_the_devices_times_where_the_hosts_read_a_micro_batch_short_and_the_step_long():
    gpu = FakeGPU()
    host = means(train(gpu, StepClock(now=lambda: gpu.host), windows=10, k=4))
    gpu = FakeGPU()
    device = means(train(gpu, DeviceStepClock(gpu.record), windows=10, k=4))
    assert device == pytest.approx((MICRO_BATCH, STEP), rel=1e-9)
    # On the host: the queuing time for a micro-batch, and everything the device was behind on for the step.
    assert host[0] == pytest.approx(QUEUE) and host[1] > 2 * STEP


def test_a_window_the_device_has_not_reached_is_read_at_a_later_close_once():
    gpu = FakeGPU()
    clock = DeviceStepClock(gpu.record)
    taken = []
    for _ in range(6):  # no sync at all: the host runs ever further ahead of the device
        for i in range(3):
            clock.tick(first=i == 0)
            gpu.queue(MICRO_BATCH)
        taken.append(clock.take())
        gpu.queue(STEP)
    assert taken[0] == (0.0, 0.0, 0.0, 0.0)  # not reached yet: nothing, and nothing lost
    gpu.sync()
    taken.append(clock.take())
    inner, count, overhead, steps = (sum(column) for column in zip(*taken, strict=True))
    assert (count, steps) == (12.0, 5.0)  # 6 windows of 2 gaps each, 5 crossings: each read once
    assert inner / count == pytest.approx(MICRO_BATCH) and overhead / steps == pytest.approx(STEP)
    assert clock.take() == (0.0, 0.0, 0.0, 0.0)


def test_after_a_restart_the_time_up_to_the_next_window_is_no_step():
    gpu = FakeGPU()
    clock = DeviceStepClock(gpu.record)
    train(gpu, clock, windows=2, k=2)
    assert clock.take()[3] == 1.0  # the second window, read now: its crossing from the first is a step
    clock.restart()  # an epoch's end: validation, a new loader
    gpu.queue(5.0)
    gpu.sync()
    taken = train(gpu, clock, windows=1, k=2)
    gpu.sync()
    taken.append(clock.take())
    assert sum(t[3] for t in taken) == 0.0  # no crossing measured across the restart


def test_windows_the_device_never_reaches_are_dropped_not_kept_for_ever():
    gpu = FakeGPU()
    clock = DeviceStepClock(gpu.record)
    for _ in range(step_clock.PENDING_WINDOWS + 10):
        clock.tick(first=True)
        gpu.queue(MICRO_BATCH)
        clock.tick(first=False)
        gpu.queue(MICRO_BATCH)
        clock.take()
    assert len(clock._pending) == step_clock.PENDING_WINDOWS


def test_the_clock_for_a_cpu_is_the_hosts():
    assert isinstance(clock_for(torch.device("cpu")), StepClock)


def test_the_engine_times_a_gpus_windows_on_its_stream_from_the_second_window(monkeypatch):
    # The engine learns the parameters' device at the first window's close and takes that device's clock; with a GPU
    # (faked: its device and its events) the goodput schedule then weighs the device's times, not the host's.
    gpu = FakeGPU()
    monkeypatch.setattr(engine_module, "_device_of", lambda parameters: torch.device("cuda", 0))
    monkeypatch.setattr(engine_module, "clock_for", lambda device: DeviceStepClock(gpu.record))
    schedule = AdaptiveBatchSize(2, 16, warmup_windows=1000)  # measures, never moves within the test
    engine = AccumulationEngine(None, "mean", schedule=schedule)
    engine.clock = StepClock(now=lambda: gpu.host)
    w = torch.nn.Parameter(torch.zeros(1))
    for step in range(40):
        engine.plan_window(epoch=0, step=step, n_samples=4)
        for _ in range(2):
            engine.add(4, 4)
            gpu.queue(MICRO_BATCH)
            (w * 1.0).sum().backward()
        engine.close_window(step, [w])
        gpu.queue(STEP)
        gpu.sync()
        w.grad = None
    assert isinstance(engine.clock, DeviceStepClock) and gpu.events > 0
    cost = schedule.step_cost.value()
    assert cost is not None
    assert cost.micro_batch_seconds == pytest.approx(MICRO_BATCH, rel=0.05)
    assert cost.overhead_seconds == pytest.approx(STEP, rel=0.05)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="a device's own timeline needs a CUDA device")
def test_on_a_real_gpu_the_device_clock_reads_what_a_synchronized_timing_reads():
    # Windows of 4 matmul micro-batches and a step of 3 more, queued without a sync as training queues them. The
    # device clock must read a micro-batch and the step as timing each one with a sync does; the host clock is kept
    # beside it for the record (it reads what the host spent queuing).
    device = torch.device("cuda", 0)
    a = torch.randn(2048, 2048, device=device)

    def work(n: int) -> None:
        for _ in range(n):
            a.matmul(a)

    torch.cuda.synchronize(device)
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    work(10)
    end.record()
    end.synchronize()
    one = start.elapsed_time(end) / 10 / 1e3  # one matmul, in seconds
    clock, host = clock_for(device), StepClock()
    taken, host_taken = [], []
    for _ in range(30):
        for i in range(4):
            clock.tick(first=i == 0)
            host.tick(first=i == 0)
            work(1)  # the micro-batch
        taken.append(clock.take())
        host_taken.append(host.take())
        work(3)  # the step's fixed part
        torch.cuda.synchronize(device)  # as a loss.item() at the step would
    taken.append(clock.take())
    micro, step = means(taken)
    print(
        f"one matmul {one * 1e3:.3f} ms; device clock {micro * 1e3:.3f} / {step * 1e3:.3f} ms;"
        f" host clock {means(host_taken)[0] * 1e3:.3f} / {means(host_taken)[1] * 1e3:.3f} ms"
    )
    assert micro == pytest.approx(one, rel=0.2)
    assert step == pytest.approx(3 * one, rel=0.2)
