from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lightning_accum.memory.backends import (
    CPUBackend,
    CUDABackend,
    DeviceBackend,
    MemoryBackend,
    MPSBackend,
    XPUBackend,
    backend_for,
)
from lightning_accum.memory.budget import GIB

MiB = 2**20
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _touch(nbytes: int) -> torch.Tensor:
    # torch.ones writes every page, so the whole allocation becomes resident.
    return torch.ones(nbytes // 4, dtype=torch.float32)


# ---- CPU ------------------------------------------------------------------------------------------------------------


def test_cpu_peak_grows_with_a_touched_tensor_and_drops_after_reset():
    backend = CPUBackend()
    backend.reset_peak()
    assert backend.exact_peak, "writing 5 to /proc/self/clear_refs is expected to work on Linux"
    before = backend.peak_bytes()

    big = _touch(512 * MiB)
    grown = backend.peak_bytes()
    assert grown >= before + 450 * MiB
    del big
    # Still the peak: freeing doesn't lower a high-water mark.
    assert backend.peak_bytes() >= before + 450 * MiB

    backend.reset_peak()
    assert backend.peak_bytes() < before + 100 * MiB
    assert backend.current_bytes() < before + 100 * MiB


def test_cpu_peak_falls_back_to_sampled_rss_when_clear_refs_is_refused(tmp_path: Path):
    status = tmp_path / "status"
    (tmp_path / "clear_refs").mkdir()  # opening a directory for writing fails like a refused write

    def write_status(rss_kib: int, hwm_kib: int = 10_000) -> None:
        status.write_text(f"Name:\tpython\nVmHWM:\t{hwm_kib} kB\nVmRSS:\t{rss_kib} kB\n")

    write_status(1000)
    backend = CPUBackend(proc_dir=str(tmp_path))
    backend.reset_peak()
    assert not backend.exact_peak
    # VmHWM (10000 kB) is the peak since process start, not since the reset, so it must not be used.
    assert backend.peak_bytes() == 1000 * 1024
    write_status(3000)
    assert backend.peak_bytes() == 3000 * 1024
    write_status(2000)
    assert backend.peak_bytes() == 3000 * 1024
    backend.reset_peak()
    assert backend.peak_bytes() == 2000 * 1024


def test_cpu_peak_uses_vmhwm_when_clear_refs_works(tmp_path: Path):
    (tmp_path / "status").write_text("VmHWM:\t8000 kB\nVmRSS:\t1000 kB\n")
    backend = CPUBackend(proc_dir=str(tmp_path))
    backend.reset_peak()  # writes tmp_path/clear_refs, which succeeds
    assert backend.exact_peak
    assert (tmp_path / "clear_refs").read_text() == "5"
    assert backend.peak_bytes() == 8000 * 1024
    assert backend.current_bytes() == 1000 * 1024


def test_cpu_capacity_is_positive_and_at_most_physical_memory():
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    capacity = CPUBackend().capacity_bytes()
    assert 0 < capacity <= physical


def test_cpu_capacity_respects_rlimit_as_in_a_subprocess():
    limit = 7 * GIB + 3 * MiB  # an odd number, so it can't come from anywhere else
    script = textwrap.dedent(
        f"""
        import resource
        from lightning_accum.memory import CPUBackend
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, ({limit}, hard))
        print(CPUBackend().capacity_bytes())
        """
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert int(out.stdout.strip()) == min(limit, physical)


def _fake_cgroups(tmp_path: Path, proc_cgroup: str, files: dict[str, str]) -> CPUBackend:
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "status").write_text("VmHWM:\t1 kB\nVmRSS:\t1 kB\n")
    (proc / "cgroup").write_text(proc_cgroup)
    root = tmp_path / "cgroup"
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return CPUBackend(proc_dir=str(proc), cgroup_root=str(root))


@pytest.mark.parametrize(
    ("proc_cgroup", "files", "expected"),
    [
        pytest.param("0::/job\n", {"memory.max": "max\n", "job/memory.max": f"{GIB}\n"}, GIB, id="v2-own-cgroup"),
        pytest.param("0::/job/step\n", {"job/memory.max": f"{2 * GIB}\n"}, 2 * GIB, id="v2-parent-limit"),
        # Containers mount their own cgroup as the root, so /proc/self/cgroup names a path that isn't there.
        pytest.param("0::/elsewhere\n", {"memory.max": f"{3 * GIB}\n"}, 3 * GIB, id="v2-namespace-root"),
        pytest.param(
            "4:memory:/a\n",
            {"memory/memory.limit_in_bytes": "9223372036854771712\n", "memory/a/memory.limit_in_bytes": f"{GIB}\n"},
            GIB,
            id="v1-huge-root-ignored",
        ),
        pytest.param(
            "4:cpu,memory:/a\n0::/\n",
            {"memory/a/memory.limit_in_bytes": f"{2 * GIB}\n", "memory.max": f"{GIB}\n"},
            GIB,
            id="v1-and-v2-smallest-wins",
        ),
    ],
)
def test_cpu_capacity_reads_cgroup_limits(tmp_path: Path, proc_cgroup: str, files: dict[str, str], expected: int):
    assert _fake_cgroups(tmp_path, proc_cgroup, files).capacity_bytes() == expected


def test_cpu_capacity_without_cgroup_limit_is_physical_or_rlimit(tmp_path: Path):
    backend = _fake_cgroups(tmp_path, "0::/\n", {"memory.max": "max\n"})
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert 0 < backend.capacity_bytes() <= physical


def test_cpu_capacity_override():
    assert CPUBackend(capacity_bytes=3 * GIB).capacity_bytes() == 3 * GIB


@pytest.mark.parametrize(
    ("bad", "error"), [(0, ValueError), (-1, ValueError), (1.5, TypeError), (True, TypeError), ("1GiB", TypeError)]
)
def test_cpu_capacity_override_is_validated(bad: object, error: type[Exception]):
    with pytest.raises(error, match=r"`capacity_bytes` must be an int >= 1 or None to detect it, got"):
        CPUBackend(capacity_bytes=bad)  # type: ignore[arg-type]


def test_cpu_backend_reports_no_reserved_peak_and_no_retries():
    backend = CPUBackend()
    assert backend.peak_reserved_bytes() is None
    assert backend.alloc_retries() == 0
    assert backend.name == "cpu"


# ---- backend_for and the protocol -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("device", "cls"),
    [
        (torch.device("cpu"), CPUBackend),
        ("cpu", CPUBackend),
        ("cuda:1", CUDABackend),  # constructing must not initialise CUDA, so this works without a GPU
        (torch.device("cuda"), CUDABackend),
        ("mps", MPSBackend),
        ("xpu:0", XPUBackend),
    ],
)
def test_backend_for_picks_the_device_type(device: object, cls: type):
    backend = backend_for(device)  # type: ignore[arg-type]
    assert type(backend) is cls
    assert isinstance(backend, MemoryBackend)
    assert backend.name == torch.device(device).type  # type: ignore[arg-type]


def test_backend_for_does_not_initialise_cuda():
    initialised = torch.cuda.is_initialized()
    backend_for("cuda")
    CUDABackend()
    assert torch.cuda.is_initialized() == initialised


def test_backend_for_unknown_device_type():
    with pytest.raises(ValueError, match=r"`device` of type 'meta' has no memory backend.*cuda, cpu, mps, xpu"):
        backend_for("meta")


def test_backend_for_wrong_type():
    with pytest.raises(TypeError, match=r"`device` must be a torch.device, a str or an int, got 1.5"):
        backend_for(1.5)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("cls", "device", "match"),
    [
        (CUDABackend, "cpu", r"`device` must be a CUDA device for CUDABackend, got cpu"),
        (CUDABackend, "xpu:0", r"`device` must be a CUDA device for CUDABackend, got xpu:0"),
        (XPUBackend, "cuda", r"`device` must be an XPU device for XPUBackend, got cuda"),
        (DeviceBackend, "mps", r"`device` must be a device with a caching allocator \(cuda, xpu\) for DeviceBackend"),
    ],
)
def test_device_backends_refuse_other_device_types(cls: type, device: str, match: str):
    with pytest.raises(ValueError, match=match):
        cls(device)


# ---- CUDA and XPU through a fake device module ----------------------------------------------------------------------


class FakeDeviceModule:
    """The memory calls of ``torch.cuda`` / ``torch.xpu``, answering from plain numbers and recording the indexes."""

    def __init__(self, current: int = 0, missing: tuple[str, ...] = ()) -> None:
        self.current = current
        self.missing = missing  # calls this module lacks, as in an older torch
        self.asked: list[tuple[str, int]] = []
        self.answers: dict[str, Any] = {
            "memory_allocated": 3 * MiB,
            "max_memory_allocated": 5 * MiB,
            "max_memory_reserved": 8 * MiB,
            "reset_peak_memory_stats": None,
            "memory_stats": {"num_alloc_retries": 2},
            "get_device_properties": SimpleNamespace(total_memory=80 * GIB),
            "mem_get_info": (48 * GIB, 64 * GIB),  # (free, total)
        }

    def current_device(self) -> int:
        return self.current

    def __getattr__(self, name: str) -> Any:
        if name in self.missing or name not in self.answers:
            raise AttributeError(name)

        def call(index: int) -> Any:
            self.asked.append((name, index))
            if name == "reset_peak_memory_stats":
                self.answers["max_memory_allocated"] = self.answers["memory_allocated"]
            return self.answers[name]

        return call


@pytest.mark.parametrize("cls", [CUDABackend, XPUBackend])
def test_device_backend_asks_the_device_module_of_its_device(cls: type[DeviceBackend]):
    fake = FakeDeviceModule()
    backend = cls(f"{cls.device_type}:1", device_module=fake)
    assert isinstance(backend, MemoryBackend) and backend.name == cls.device_type
    assert fake.asked == []  # constructing asks nothing (CUDA would initialise)
    figures = (backend.current_bytes(), backend.peak_bytes(), backend.peak_reserved_bytes())
    # The reserved peak is part of the metrics contract on CUDA only (docs/wandb.md).
    assert figures == (3 * MiB, 5 * MiB, 8 * MiB if cls is CUDABackend else None)
    assert (backend.capacity_bytes(), backend.alloc_retries()) == (80 * GIB, 2)
    backend.reset_peak()
    assert backend.peak_bytes() == 3 * MiB
    assert {index for _, index in fake.asked} == {1}
    assert repr(backend) == f"{cls.__name__}(device={cls.device_type}:1)"


def test_device_backend_without_an_index_follows_the_current_device():
    fake = FakeDeviceModule(current=2)
    backend = CUDABackend("cuda", device_module=fake)
    backend.current_bytes()
    fake.current = 3
    backend.current_bytes()
    assert fake.asked == [("memory_allocated", 2), ("memory_allocated", 3)]
    assert repr(backend) == "CUDABackend(device=cuda:current)"


@pytest.mark.parametrize("cls", [CUDABackend, XPUBackend])
def test_device_backend_falls_back_where_the_module_lacks_a_call(cls: type[DeviceBackend]):
    missing = ("max_memory_allocated", "max_memory_reserved", "reset_peak_memory_stats", "memory_stats")
    fake = FakeDeviceModule(missing=(*missing, "get_device_properties"))
    backend = cls(0, device_module=fake)
    backend.reset_peak()  # nothing to reset
    assert backend.peak_bytes() == backend.current_bytes() == 3 * MiB
    assert backend.peak_reserved_bytes() is None
    assert backend.alloc_retries() == 0
    assert backend.capacity_bytes() == 64 * GIB  # the total of mem_get_info
    assert [name for name, _ in fake.asked] == ["memory_allocated", "memory_allocated", "mem_get_info"]


def test_device_backend_capacity_and_free_bytes_respect_the_per_process_fraction():
    fake = FakeDeviceModule()
    fake.answers["memory_reserved"] = 10 * MiB
    backend = CUDABackend(0, device_module=fake)
    # No fraction call (an older torch): the whole device; free is the driver's plus the allocator's cached 7 MiB.
    assert backend.capacity_bytes() == 80 * GIB
    assert backend.free_bytes() == 48 * GIB + 7 * MiB
    # `set_per_process_memory_fraction(0.25)`: the allocator refuses past 20 GiB, whatever the driver has free.
    fake.answers["get_per_process_memory_fraction"] = 0.25
    assert backend.capacity_bytes() == 20 * GIB
    assert backend.free_bytes() == 20 * GIB - 3 * MiB


def test_cpu_free_bytes_is_the_room_left_under_an_address_space_limit(tmp_path, monkeypatch):
    import resource

    import lightning_accum.memory.backends as backends

    backend = CPUBackend(proc_dir=str(tmp_path))
    (tmp_path / "status").write_text("VmSize:\t 1048576 kB\nVmRSS:\t 4096 kB\n")
    free = backend.free_bytes()
    assert free is not None and free > 0  # no limit here: the system's MemAvailable
    # A soft limit of 1 GiB + 300 MiB (not set for real: this process maps far more than 1 GiB).
    limit = (1024**3 + 300 * MiB, resource.RLIM_INFINITY)
    monkeypatch.setattr(backends.resource, "getrlimit", lambda which: limit if which == resource.RLIMIT_AS else (0, 0))
    assert backend.free_bytes() == 300 * MiB  # the limit minus VmSize (1 GiB), not minus the resident set


@pytest.mark.parametrize("device_type", ["cuda", "xpu"])
def test_device_backend_uses_torchs_own_module_by_default(device_type: str):
    backend = backend_for(device_type)
    assert backend._module is torch.get_device_module(device_type)  # type: ignore[attr-defined]


@pytest.mark.parametrize("device_type", ["cuda", "xpu"])
def test_device_backend_before_torch_had_get_device_module(monkeypatch: pytest.MonkeyPatch, device_type: str):
    monkeypatch.delattr(torch, "get_device_module")  # torch < 2.3, which the package still supports
    assert backend_for(device_type)._module is getattr(torch, device_type)  # type: ignore[attr-defined]


def test_generic_device_backend_takes_the_type_from_the_device():
    fake = FakeDeviceModule()
    backend = DeviceBackend(torch.device("xpu", 0), device_module=fake)
    assert (type(backend), backend.name, backend.current_bytes()) == (DeviceBackend, "xpu", 3 * MiB)


def test_generic_device_backend_without_a_device_needs_an_accelerator(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: None)
    with pytest.raises(ValueError, match=r"`device=None` means the current accelerator, but torch finds none"):
        DeviceBackend()
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: torch.device("cuda"))
    assert DeviceBackend(1, device_module=FakeDeviceModule()).name == "cuda"
    monkeypatch.delattr(torch, "accelerator")  # torch < 2.6: the first available device type
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.xpu, "is_available", lambda: True)
    assert DeviceBackend(device_module=FakeDeviceModule()).name == "xpu"


# ---- CUDA -----------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_cuda
def test_cuda_peak_grows_and_resets():
    backend = backend_for("cuda")
    torch.cuda.synchronize()
    backend.reset_peak()
    before = backend.peak_bytes()
    big = torch.ones(256 * MiB // 4, device="cuda")
    assert backend.peak_bytes() >= before + 256 * MiB
    assert backend.current_bytes() >= 256 * MiB
    reserved = backend.peak_reserved_bytes()
    assert reserved is not None and reserved >= 256 * MiB
    del big
    backend.reset_peak()
    assert backend.peak_bytes() < before + 256 * MiB


@pytest.mark.gpu
@needs_cuda
def test_cuda_capacity_and_retries():
    backend = CUDABackend(torch.device("cuda", 0))
    assert backend.capacity_bytes() == torch.cuda.get_device_properties(0).total_memory
    assert backend.alloc_retries() >= 0
