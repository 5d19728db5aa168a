"""What a step costs on the clock, measured where the compute runs: `StepClock` on the host, `DeviceStepClock` on a GPU.

The goodput objective (`lightning_accum.core.batch_choice`) weighs ``c_mb``, a micro-batch's forward and backward, and
``s``, the step's fixed part. Both clocks mark each micro-batch as its backward starts (`AccumulationEngine.add`) and
split the time between marks into a window's micro-batches and its crossing into the next window (one micro-batch and
the step's fixed part).

On the CPU the host's times are the compute's. On a GPU they are not: the host queues kernels and runs ahead of the
device within a window, then waits where it must (a ``.item()``, the optimizer step's sync, a full queue). Its marks
then read a micro-batch short and the step long, and the goodput objective would choose too large a ``k``.
`DeviceStepClock` marks the device's stream instead, with an event recorded at each mark (the device stamps it when it
gets there), and reads a window's events once the device has reached the last of them, at a later window's close if
not yet at its own: it adds no sync. `clock_for` picks the clock for the parameters' device.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

PENDING_WINDOWS = 16
"""`DeviceStepClock` keeps at most this many windows the device has not reached yet; an older one is dropped unread."""


class StepClock:
    """One rank's host times between consecutive micro-batches, split into a window's and a step's.

    Between two micro-batches of one window lies one micro-batch (its data, forward and backward); between a window's
    last micro-batch and the next window's first lies one micro-batch and the step's fixed part (the sync in the last
    backward, the optimizer step, ``zero_grad``). `tick` at each backward, `take` at each window's close.
    ``restart`` forgets the last tick where the time up to the next one is not training (an epoch's end, a resume).

    Examples:
        >>> times = iter([0.0, 1.0, 2.0, 6.0, 7.0])  # windows of 3 and 2: micro-batches of 1 s, a step of 3 s
        >>> clock = StepClock(now=lambda: next(times))
        >>> for first in (True, False, False):
        ...     clock.tick(first)
        >>> clock.take()
        (2.0, 2.0, 0.0, 0.0)
        >>> for first in (True, False):
        ...     clock.tick(first)
        >>> clock.take()  # the crossing took 4 s, a micro-batch 1 s of it
        (1.0, 1.0, 3.0, 1.0)
    """

    def __init__(self, now: Callable[[], float] = time.perf_counter) -> None:
        self._now = now
        self._last: float | None = None
        self._inner, self._inner_count = 0.0, 0
        self._crossing: float | None = None

    def restart(self) -> None:
        """The time up to the next tick is not training: it measures nothing."""
        self._last = None

    def tick(self, first: bool) -> None:
        """A micro-batch's backward starts; ``first``: the window's first."""
        now = self._now()
        if self._last is not None:
            if first:
                self._crossing = now - self._last
            else:
                self._inner += now - self._last
                self._inner_count += 1
        self._last = now

    def take(self) -> tuple[float, float, float, float]:
        """This window's ``(micro-batch seconds, micro-batches, overhead seconds, steps)``, to sum over ranks."""
        inner, count, crossing = self._inner, self._inner_count, self._crossing
        self._inner, self._inner_count, self._crossing = 0.0, 0, None
        return _figures(inner, count, crossing)


def _figures(inner: float, count: int, crossing: float | None) -> tuple[float, float, float, float]:
    # A window's sums: its micro-batches' seconds and count, and the crossing less one micro-batch (the fixed part).
    if crossing is None or count == 0:
        return inner, float(count), 0.0, 0.0
    return inner, float(count), max(0.0, crossing - inner / count), 1.0


class DeviceEvent(Protocol):
    """A mark on a device's stream (``torch.cuda.Event(enable_timing=True)``, recorded)."""

    def query(self) -> bool: ...  # whether the device has reached it

    def elapsed_time(self, end: DeviceEvent) -> float: ...  # milliseconds from this mark to ``end``


@dataclass
class _Window:
    events: list[DeviceEvent] = field(default_factory=list)
    after: DeviceEvent | None = None  # the previous window's last mark, where the crossing starts (None: not a step)


class DeviceStepClock:
    """`StepClock` on the device's timeline: an event recorded on its stream at each tick, read without a sync.

    ``record`` returns a new event recorded on the stream where the device runs the micro-batches. `take` closes the
    window and returns the figures of every window whose last event the device has reached, oldest first, summed: a
    window the device is still behind on is returned by a later `take` (each window once). At most
    `PENDING_WINDOWS` wait; an older one is dropped unread.

    Examples:
        A device that runs 2 ms behind the host: each event is reached 2 ms after it is recorded.

        >>> host = [0.0]
        >>> class Event:
        ...     def __init__(self): self.at = host[0] + 2.0  # the device's time for this mark, in ms
        ...     def query(self): return host[0] >= self.at
        ...     def elapsed_time(self, end): return end.at - self.at
        >>> clock = DeviceStepClock(record=Event)
        >>> for first in (True, False):  # a window of two micro-batches of 1 ms
        ...     clock.tick(first); host[0] += 1.0
        >>> clock.take()  # the device is 1 ms short of the window's last mark: nothing yet
        (0.0, 0.0, 0.0, 0.0)
        >>> host[0] += 4.0  # a step of 4 ms
        >>> clock.tick(True); host[0] += 3.0
        >>> clock.tick(False)  # the next window's first two micro-batches; the device has reached the first window
        >>> clock.take()
        (0.001, 1.0, 0.0, 0.0)
        >>> host[0] += 2.0
        >>> clock.take()  # the second window: its micro-batch of 3 ms, and the crossing of 5 ms less a micro-batch
        (0.003, 1.0, 0.002, 1.0)
    """

    def __init__(self, record: Callable[[], DeviceEvent]) -> None:
        self._record = record
        self._current: _Window | None = None
        self._last: DeviceEvent | None = None
        self._pending: deque[_Window] = deque()

    def restart(self) -> None:
        """The time up to the next tick is not training: it measures nothing."""
        self._last = None

    def tick(self, first: bool) -> None:
        """A micro-batch's backward starts; ``first``: the window's first."""
        event = self._record()
        if first or self._current is None:
            self._close()
            self._current = _Window(after=self._last if first else None)
        self._current.events.append(event)
        self._last = event

    def take(self) -> tuple[float, float, float, float]:
        """The summed ``(micro-batch seconds, micro-batches, overhead seconds, steps)`` of the windows now read."""
        self._close()
        total = [0.0, 0.0, 0.0, 0.0]
        while self._pending and self._pending[0].events[-1].query():
            window = self._pending.popleft()
            events = window.events
            inner = sum(a.elapsed_time(b) for a, b in itertools.pairwise(events)) / 1e3
            crossing = None if window.after is None else window.after.elapsed_time(events[0]) / 1e3
            for i, value in enumerate(_figures(inner, len(events) - 1, crossing)):
                total[i] += value
        return total[0], total[1], total[2], total[3]

    def _close(self) -> None:
        if self._current is not None and self._current.events:
            self._pending.append(self._current)
            while len(self._pending) > PENDING_WINDOWS:
                self._pending.popleft()
        self._current = None


def clock_for(device: torch.device) -> StepClock | DeviceStepClock:
    """The clock for micro-batches computed on ``device``: its stream's events on a CUDA device, else the host's."""
    if device.type != "cuda":
        return StepClock()

    def record() -> DeviceEvent:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(device))
        return event  # type: ignore[return-value]  # torch.cuda.Event has query and elapsed_time, untyped

    return DeviceStepClock(record)
