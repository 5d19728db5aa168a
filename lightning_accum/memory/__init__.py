"""Device memory: backends that measure it, a model of peak(b), and out-of-memory classification and injection."""

from lightning_accum.memory.backends import (
    CPUBackend,
    CUDABackend,
    MemoryBackend,
    MPSBackend,
    XPUBackend,
    backend_for,
)
from lightning_accum.memory.model import LinearPeakModel
from lightning_accum.memory.oom import OOMFault, OOMInjector, is_oom_error, oom_error, release_memory

__all__ = [
    "CPUBackend",
    "CUDABackend",
    "LinearPeakModel",
    "MPSBackend",
    "MemoryBackend",
    "OOMFault",
    "OOMInjector",
    "XPUBackend",
    "backend_for",
    "is_oom_error",
    "oom_error",
    "release_memory",
]
