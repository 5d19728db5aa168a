"""How much memory a device has and how much a step used: one small backend per device type.

Every backend answers the same six questions (`MemoryBackend`) so that the planner and the monitor never
branch on the device. Nothing here synchronizes a device beyond what the underlying ``torch.<device>`` call does.

What "peak" means differs by device, and the metric docs say so:

* CUDA / XPU: the peak of memory *allocated* by PyTorch's caching allocator since the last reset.
* CPU: the peak resident set size of the whole process (``VmHWM``), reset through ``/proc/self/clear_refs``.
* MPS: PyTorch keeps no peak counter, so the peak is the largest *sampled* current allocation since the reset.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import resource
import sys
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch

_KIB = 1024
# A cgroup limit at or above this is the kernel's way of saying "no limit" (v1 writes PAGE_COUNTER_MAX pages).
_NO_LIMIT = 1 << 60


@runtime_checkable
class MemoryBackend(Protocol):
    """Memory figures of one device, in bytes.

    Attributes:
        name: the device type, e.g. ``"cuda"`` or ``"cpu"``.
    """

    name: str

    def reset_peak(self) -> None:
        """Start a new peak measurement: `peak_bytes` then reports the peak since this call."""
        ...

    def peak_bytes(self) -> int:
        """The peak memory in use since the last `reset_peak` (or since the process started)."""
        ...

    def peak_reserved_bytes(self) -> int | None:
        """The peak memory reserved by the caching allocator since the last reset; ``None`` where that isn't kept."""
        ...

    def capacity_bytes(self) -> int:
        """The memory this process may use on the device."""
        ...

    def alloc_retries(self) -> int:
        """Cumulative count of allocations that had to free cached memory and retry (0 where not tracked)."""
        ...

    def current_bytes(self) -> int:
        """The memory in use now."""
        ...


class CUDABackend:
    """Peak *allocated* memory of one CUDA device, from PyTorch's caching allocator statistics.

    Args:
        device: the CUDA device; ``cuda`` without an index means the current device.

    Raises:
        ValueError: if ``device`` is not a CUDA device.
    """

    name = "cuda"

    def __init__(self, device: torch.device | str | int | None = None) -> None:
        device = torch.device("cuda") if device is None else _as_device(device, default_type="cuda")
        if device.type != "cuda":
            raise ValueError(
                f"`device` must be a CUDA device for CUDABackend, got {device}. Use `backend_for(device)`."
            )
        # Resolved lazily: asking for the current device initializes CUDA, which a constructor should not do.
        self._index = device.index

    @property
    def index(self) -> int:
        return torch.cuda.current_device() if self._index is None else self._index

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.index)

    def peak_bytes(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.index))

    def peak_reserved_bytes(self) -> int | None:
        return int(torch.cuda.max_memory_reserved(self.index))

    def capacity_bytes(self) -> int:
        return int(torch.cuda.get_device_properties(self.index).total_memory)

    def alloc_retries(self) -> int:
        return int(torch.cuda.memory_stats(self.index).get("num_alloc_retries", 0))

    def current_bytes(self) -> int:
        return int(torch.cuda.memory_allocated(self.index))

    def __repr__(self) -> str:
        return f"CUDABackend(device=cuda:{self._index if self._index is not None else 'current'})"


class XPUBackend:
    """Peak allocated memory of one Intel XPU device (best effort: it uses whatever ``torch.xpu`` exposes).

    Args:
        device: the XPU device; ``xpu`` without an index means the current device.
    """

    name = "xpu"

    def __init__(self, device: torch.device | str | int | None = None) -> None:
        device = torch.device("xpu") if device is None else _as_device(device, default_type="xpu")
        if device.type != "xpu":
            raise ValueError(f"`device` must be an XPU device for XPUBackend, got {device}. Use `backend_for(device)`.")
        self._index = device.index

    @property
    def index(self) -> int:
        return torch.xpu.current_device() if self._index is None else self._index

    def reset_peak(self) -> None:
        fn = getattr(torch.xpu, "reset_peak_memory_stats", None)
        if fn is not None:
            fn(self.index)

    def peak_bytes(self) -> int:
        fn = getattr(torch.xpu, "max_memory_allocated", None)
        return int(fn(self.index)) if fn is not None else self.current_bytes()

    def peak_reserved_bytes(self) -> int | None:
        return None

    def capacity_bytes(self) -> int:
        return int(torch.xpu.get_device_properties(self.index).total_memory)

    def alloc_retries(self) -> int:
        fn = getattr(torch.xpu, "memory_stats", None)
        return int(fn(self.index).get("num_alloc_retries", 0)) if fn is not None else 0

    def current_bytes(self) -> int:
        fn = getattr(torch.xpu, "memory_allocated", None)
        return int(fn(self.index)) if fn is not None else 0


class MPSBackend:
    """Memory of the Apple MPS device (best effort).

    ``torch.mps`` has no peak counter, so the peak is the largest current allocation seen by any call to this
    backend since `reset_peak`; it undercounts short spikes between calls. Capacity is Metal's recommended
    working set when torch exposes it, else the physical memory (MPS shares it with the CPU).
    """

    name = "mps"

    def __init__(self) -> None:
        self._peak = 0

    def current_bytes(self) -> int:
        fn = getattr(torch.mps, "current_allocated_memory", None)
        current = int(fn()) if fn is not None else 0
        self._peak = max(self._peak, current)
        return current

    def reset_peak(self) -> None:
        self._peak = 0
        self.current_bytes()

    def peak_bytes(self) -> int:
        self.current_bytes()
        return self._peak

    def peak_reserved_bytes(self) -> int | None:
        return None

    def capacity_bytes(self) -> int:
        fn = getattr(torch.mps, "recommended_max_memory", None)
        return int(fn()) if fn is not None else _physical_memory()

    def alloc_retries(self) -> int:
        return 0


class CPUBackend:
    """Peak resident set of this process, and the memory it may use: the CPU's view of "device memory".

    The peak is ``VmHWM`` from ``/proc/self/status``. Writing ``5`` to ``/proc/self/clear_refs`` resets it to the
    current resident set (Linux >= 4.0). Where that write is refused (a read-only ``/proc``, another OS), the
    backend falls back to the largest resident set it sampled itself since the reset, which misses spikes between
    calls; ``exact_peak`` says which one is in use. The resident set includes freed memory that the heap keeps for
    reuse: call `trim_cpu_heap` (or `lightning_accum.memory.release_memory`) when the working set has shrunk.

    Capacity is the smallest of: the cgroup memory limit (v2 ``memory.max``, v1 ``memory.limit_in_bytes``,
    including those of parent cgroups), the soft ``RLIMIT_AS`` when one is set, and the physical memory.

    Args:
        capacity_bytes: report this capacity instead of detecting it, e.g. to share a machine with other jobs.
        proc_dir: where this process's ``status``, ``clear_refs`` and ``cgroup`` files live.
        cgroup_root: where the cgroup file systems are mounted.

    Raises:
        ValueError: if ``capacity_bytes`` is not a positive int.

    Examples:
        >>> backend = CPUBackend()
        >>> backend.reset_peak()
        >>> backend.peak_bytes() >= backend.current_bytes() > 0
        True
        >>> CPUBackend(capacity_bytes=2**30).capacity_bytes()
        1073741824
    """

    name = "cpu"

    def __init__(
        self,
        capacity_bytes: int | None = None,
        *,
        proc_dir: str = "/proc/self",
        cgroup_root: str = "/sys/fs/cgroup",
    ) -> None:
        if capacity_bytes is not None and (
            isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes <= 0
        ):
            raise ValueError(
                f"`capacity_bytes` must be a positive int (bytes) or None to detect it, got {capacity_bytes!r}."
            )
        self._capacity = capacity_bytes
        self._proc_dir = proc_dir
        self._cgroup_root = cgroup_root
        self.exact_peak = True
        self._sampled_peak = 0

    def _status_kib(self, field: str) -> int | None:
        try:
            with open(os.path.join(self._proc_dir, "status")) as f:
                for line in f:
                    if line.startswith(field + ":"):
                        return int(line.split()[1])
        except (OSError, ValueError, IndexError):
            pass
        return None

    def current_bytes(self) -> int:
        kib = self._status_kib("VmRSS")
        if kib is None:
            # No /proc (macOS): ru_maxrss is the best figure the standard library offers.
            current = _ru_maxrss_bytes()
        else:
            current = kib * _KIB
        self._sampled_peak = max(self._sampled_peak, current)
        return current

    def reset_peak(self) -> None:
        try:
            with open(os.path.join(self._proc_dir, "clear_refs"), "w") as f:
                f.write("5")
            self.exact_peak = self._status_kib("VmHWM") is not None
        except OSError:
            self.exact_peak = False
        self._sampled_peak = 0
        self.current_bytes()

    def peak_bytes(self) -> int:
        current = self.current_bytes()
        if self.exact_peak:
            kib = self._status_kib("VmHWM")
            if kib is not None:
                return max(kib * _KIB, current)
        return self._sampled_peak

    def peak_reserved_bytes(self) -> int | None:
        return None

    def capacity_bytes(self) -> int:
        if self._capacity is not None:
            return self._capacity
        limits = [_physical_memory()]
        cgroup = _cgroup_limit(self._cgroup_root, os.path.join(self._proc_dir, "cgroup"))
        if cgroup is not None:
            limits.append(cgroup)
        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft != resource.RLIM_INFINITY and soft > 0:
            limits.append(int(soft))
        return min(limits)

    def alloc_retries(self) -> int:
        return 0

    def __repr__(self) -> str:
        return f"CPUBackend(capacity_bytes={self._capacity})"


@functools.lru_cache(maxsize=1)
def _malloc_trim() -> Any:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None  # not glibc (musl, macOS): nothing to trim


def trim_cpu_heap() -> None:
    """Return freed heap pages to the OS (glibc's ``malloc_trim``; a no-op elsewhere).

    Freed tensors stay resident in glibc's heap, so without a trim the resident set does not fall when the working
    set shrinks, e.g. after a smaller micro-batch size was chosen.
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def backend_for(device: torch.device | str) -> MemoryBackend:
    """The memory backend for ``device``.

    Raises:
        ValueError: if the device type has no backend (supported: cuda, cpu, mps, xpu).

    Examples:
        >>> backend_for(torch.device("cpu")).name
        'cpu'
    """
    device = _as_device(device, default_type="cpu")
    if device.type == "cuda":
        return CUDABackend(device)
    if device.type == "cpu":
        return CPUBackend()
    if device.type == "mps":
        return MPSBackend()
    if device.type == "xpu":
        return XPUBackend(device)
    raise ValueError(
        f"`device` of type {device.type!r} has no memory backend (got {device}); supported: cuda, cpu, mps, xpu."
        " Pass a `MemoryBackend` of your own where the API accepts one."
    )


def _as_device(device: torch.device | str | int, default_type: str) -> torch.device:
    if isinstance(device, torch.device):
        return device
    if isinstance(device, int) and not isinstance(device, bool):
        return torch.device(default_type, device)
    if isinstance(device, str):
        return torch.device(device)
    raise TypeError(
        f"`device` must be a torch.device, a str or an int, got {device!r} of type {type(device).__name__}."
    )


def _physical_memory() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        # No sysconf names (Windows): the peak RSS so far is a useless capacity, so report "unknown" as huge.
        return _NO_LIMIT


def _ru_maxrss_bytes() -> int:
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS reports bytes.
    return int(maxrss if sys.platform == "darwin" else maxrss * _KIB)


def _read_limit(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    if not text or text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return value if 0 < value < _NO_LIMIT else None


def _cgroup_paths(cgroup_file: str) -> tuple[str | None, str | None]:
    """This process's (v2, v1 memory controller) cgroup paths from ``/proc/self/cgroup``."""
    v2 = v1 = None
    try:
        with open(cgroup_file) as f:
            for line in f:
                parts = line.rstrip("\n").split(":", 2)
                if len(parts) != 3:
                    continue
                _, controllers, path = parts
                if controllers == "":
                    v2 = path
                elif "memory" in controllers.split(","):
                    v1 = path
    except OSError:
        pass
    return v2, v1


def _ancestors(path: str | None) -> Sequence[str]:
    """``/a/b`` -> ``["a/b", "a", ""]``: a limit on any ancestor cgroup also bounds this process."""
    parts = [p for p in (path or "").split("/") if p]
    return ["/".join(parts[:i]) for i in range(len(parts), -1, -1)]


def _cgroup_limit(root: str, cgroup_file: str) -> int | None:
    v2_path, v1_path = _cgroup_paths(cgroup_file)
    candidates = [os.path.join(root, rel, "memory.max") for rel in _ancestors(v2_path)]
    candidates += [os.path.join(root, "memory", rel, "memory.limit_in_bytes") for rel in _ancestors(v1_path)]
    # Inside a container the paths in /proc/self/cgroup often don't exist (the namespace root is mounted instead),
    # so a missing file is skipped and the root files above are still read.
    limits = [limit for limit in (_read_limit(p) for p in dict.fromkeys(candidates)) if limit is not None]
    return min(limits) if limits else None
