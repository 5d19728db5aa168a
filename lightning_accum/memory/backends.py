"""How much memory a device has and how much a step used: one backend per kind of memory accounting.

Every backend answers the same six questions (`MemoryBackend`) so that the planner and the monitor never
branch on the device. CUDA and XPU share one implementation, `DeviceBackend`, over ``torch.get_device_module``;
the CPU (the process's resident set) and MPS (no peak counter) have their own. Nothing here synchronizes a device
beyond what the underlying ``torch.<device>`` call does.

What "peak" means differs by device, and the metric docs say so:

* CUDA / XPU: the peak of memory *allocated* by PyTorch's caching allocator since the last reset.
* CPU: the peak resident set size of the whole process (``VmHWM``), reset through ``/proc/self/clear_refs``.
* MPS: PyTorch keeps no peak counter, so the peak is the largest *sampled* current allocation since the reset.
"""

from __future__ import annotations

import os
import resource
from typing import Any, Protocol, runtime_checkable

import torch

from lightning_accum._util.validation import check_int
from lightning_accum.memory.host import cgroup_limit, physical_memory, proc_kib, ru_maxrss_bytes

_KIB = 1024
# The device types `DeviceBackend` serves, as its messages name them.
_ALLOCATOR_DEVICES = {"cuda": "a CUDA device", "xpu": "an XPU device"}
# `memory/peak_reserved_gib` is promised for CUDA only (docs/wandb.md), though torch.xpu keeps the figure too.
_RESERVED_PEAK_TYPES = ("cuda",)
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


class DeviceBackend:
    """Peak *allocated* memory of one accelerator with a caching allocator (CUDA, XPU), through its torch module.

    Every call goes through ``torch.get_device_module(device)`` (``torch.cuda``, ``torch.xpu``), which offers the
    same memory API for each; with no device, ``torch.accelerator`` names the current one. A call the module lacks
    (an older torch) falls back: no peak reset, the current allocation as the peak, no reserved peak, no allocator
    retries. The reserved peak is reported on CUDA only.

    Args:
        device: the device; without an index it means the current device of its type. ``None`` means the current
            accelerator (``torch.accelerator``). An int is an index on this class's device type.
        device_module: the module to ask instead of ``torch.get_device_module(device)``, e.g. a fake in tests.

    Raises:
        ValueError: the device type has no caching allocator (supported: cuda, xpu), or it is not this class's.
        TypeError: ``device`` is not a torch.device, a str, an int or ``None``.

    Examples:
        >>> from types import SimpleNamespace
        >>> fake = SimpleNamespace(memory_allocated=lambda index: 1024, current_device=lambda: 0)
        >>> backend = DeviceBackend("cuda:1", device_module=fake)
        >>> backend.name, backend.current_bytes(), backend.peak_bytes(), backend.peak_reserved_bytes(), backend
        ('cuda', 1024, 1024, None, DeviceBackend(device=cuda:1))
    """

    device_type: str | None = None  # the one type a subclass serves; None: whatever `device` says

    def __init__(self, device: torch.device | str | int | None = None, *, device_module: Any = None) -> None:
        device = self._resolve(device)
        self.name: str = device.type
        # Resolved lazily: asking for the current device initializes CUDA, which a constructor should not do.
        self._index = device.index
        self._module = _device_module(device.type) if device_module is None else device_module

    @classmethod
    def _resolve(cls, device: torch.device | str | int | None) -> torch.device:
        device_type = cls.device_type
        if device is None or isinstance(device, int):
            if device_type is None:
                device_type = _current_accelerator_type()
            if device_type is None:
                raise ValueError(
                    f"`device={device!r}` means the current accelerator, but torch finds none. Pass the device, e.g."
                    " 'cuda:0', or use `backend_for(device)`, which also serves the CPU."
                )
            device = torch.device(device_type) if device is None else _as_device(device, default_type=device_type)
        else:
            device = _as_device(device, default_type=device_type or "")
        if device.type not in _ALLOCATOR_DEVICES or cls.device_type not in (None, device.type):
            wanted = _ALLOCATOR_DEVICES.get(cls.device_type or "", "a device with a caching allocator (cuda, xpu)")
            raise ValueError(f"`device` must be {wanted} for {cls.__name__}, got {device}. Use `backend_for(device)`.")
        return device

    @property
    def index(self) -> int:
        return int(self._module.current_device()) if self._index is None else self._index

    def _call(self, name: str, default: Any) -> Any:
        fn = getattr(self._module, name, None)
        return default if fn is None else fn(self.index)

    def reset_peak(self) -> None:
        self._call("reset_peak_memory_stats", None)

    def current_bytes(self) -> int:
        return int(self._call("memory_allocated", 0))

    def peak_bytes(self) -> int:
        peak = self._call("max_memory_allocated", None)
        return self.current_bytes() if peak is None else int(peak)

    def peak_reserved_bytes(self) -> int | None:
        if self.name not in _RESERVED_PEAK_TYPES:
            return None
        peak = self._call("max_memory_reserved", None)
        return None if peak is None else int(peak)

    def capacity_bytes(self) -> int:
        """The device's memory, times the allocator's per-process fraction where one is set (CUDA)."""
        properties = getattr(self._module, "get_device_properties", None)
        if properties is not None:
            total = int(properties(self.index).total_memory)
        else:
            total = int(self._module.mem_get_info(self.index)[1])
        fraction = self._call("get_per_process_memory_fraction", 1.0)
        return int(total * fraction) if 0 < fraction < 1 else total

    def alloc_retries(self) -> int:
        return int(self._call("memory_stats", {}).get("num_alloc_retries", 0))

    def free_bytes(self) -> int | None:
        """What can still be allocated.

        That is the driver's free memory plus the allocator's cached, unused blocks, and no more than the
        per-process fraction leaves (`capacity_bytes` minus what is allocated).
        """
        mem_get_info = getattr(self._module, "mem_get_info", None)
        if mem_get_info is None:
            return None
        free, _ = mem_get_info(self.index)
        allocated = self.current_bytes()
        cached = max(0, int(self._call("memory_reserved", 0)) - allocated)
        return max(0, min(int(free) + cached, self.capacity_bytes() - allocated))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={self.name}:{'current' if self._index is None else self._index})"


class CUDABackend(DeviceBackend):
    """`DeviceBackend` on a CUDA device (``cuda`` without an index: the current one).

    Raises:
        ValueError: if ``device`` is not a CUDA device.
    """

    device_type = "cuda"


class XPUBackend(DeviceBackend):
    """`DeviceBackend` on an Intel XPU device (``xpu`` without an index: the current one).

    Raises:
        ValueError: if ``device`` is not an XPU device.
    """

    device_type = "xpu"


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
        return int(fn()) if fn is not None else physical_memory()

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
        TypeError: if ``capacity_bytes`` is not an int or None.
        ValueError: if ``capacity_bytes < 1``.

    Examples:
        >>> backend = CPUBackend()
        >>> backend.reset_peak()
        >>> backend.peak_bytes() >= backend.current_bytes() > 0
        True
        >>> from lightning_accum.memory.budget import GIB
        >>> CPUBackend(capacity_bytes=8 * GIB).capacity_bytes() == 8 * GIB
        True
    """

    name = "cpu"

    def __init__(
        self,
        capacity_bytes: int | None = None,
        *,
        proc_dir: str = "/proc/self",
        cgroup_root: str = "/sys/fs/cgroup",
    ) -> None:
        if capacity_bytes is not None:
            check_int(capacity_bytes, "capacity_bytes", 1, alternative="None to detect it")
        self._capacity = capacity_bytes
        self._proc_dir = proc_dir
        self._cgroup_root = cgroup_root
        self.exact_peak = True
        self._sampled_peak = 0

    def _status_kib(self, field: str) -> int | None:
        return proc_kib(os.path.join(self._proc_dir, "status"), field)

    def current_bytes(self) -> int:
        kib = self._status_kib("VmRSS")
        if kib is None:
            # No /proc (macOS): ru_maxrss is the best figure the standard library offers.
            current = ru_maxrss_bytes()
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

    def free_bytes(self) -> int | None:
        """What the process can still allocate before an allocation fails, where the OS says.

        Under a soft ``RLIMIT_AS`` that is the limit minus the address space in use (``VmSize``, which counts far
        more than the resident set: every mapped library and reserved heap). Otherwise it is the system's
        ``MemAvailable``. ``None`` where neither is known (no ``/proc``). A cgroup limit is not read here: the budget
        against the resident set covers it.
        """
        candidates = []
        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        vm_size = self._status_kib("VmSize")
        if soft != resource.RLIM_INFINITY and soft > 0 and vm_size is not None:
            candidates.append(max(0, int(soft) - vm_size * _KIB))
        available = proc_kib("/proc/meminfo", "MemAvailable")
        if available is not None:
            candidates.append(available * _KIB)
        return min(candidates) if candidates else None

    def capacity_bytes(self) -> int:
        if self._capacity is not None:
            return self._capacity
        limits = [physical_memory()]
        cgroup = cgroup_limit(self._cgroup_root, os.path.join(self._proc_dir, "cgroup"))
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


def _device_module(device_type: str) -> Any:
    # `torch.get_device_module` arrived in torch 2.3; before it, `torch.<type>` is the same module.
    get_device_module = getattr(torch, "get_device_module", None)
    return getattr(torch, device_type) if get_device_module is None else get_device_module(device_type)


def _current_accelerator_type() -> str | None:
    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6
    if accelerator is not None:
        current = accelerator.current_accelerator()
        return None if current is None else str(current.type)
    return next((t for t in _ALLOCATOR_DEVICES if hasattr(torch, t) and getattr(torch, t).is_available()), None)


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


def free_bytes(backend: MemoryBackend) -> int | None:
    """``backend.free_bytes()`` where the backend has it (CPU, CUDA, XPU), else ``None``."""
    method = getattr(backend, "free_bytes", None)
    return None if method is None else method()
