"""What the operating system says about this process's memory: ``/proc``, cgroup limits, ``malloc_trim``. Pure reads.

The CPU backend (`lightning_accum.memory.backends.CPUBackend`) reads its figures here.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import resource
import sys
from collections.abc import Sequence
from typing import Any

_KIB = 1024
_NO_LIMIT = 1 << 60


@functools.lru_cache(maxsize=1)
def malloc_trim() -> Any:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None  # not glibc (musl, macOS): nothing to trim


def trim_cpu_heap() -> None:
    """Return freed heap pages to the OS (glibc's ``malloc_trim``; a no-op elsewhere).

    Freed tensors stay resident in glibc's heap, so without a trim the resident set does not fall when the working
    set shrinks, e.g. after a smaller micro-batch size was chosen.
    """
    trim = malloc_trim()
    if trim is not None:
        trim(0)


def proc_kib(path: str, field: str) -> int | None:
    """``field`` of a ``/proc`` file of ``Name:  value kB`` lines (``status``, ``meminfo``), in KiB, or ``None``."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def physical_memory() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        # No sysconf names (Windows): the peak RSS so far is a useless capacity, so report "unknown" as huge.
        return _NO_LIMIT


def ru_maxrss_bytes() -> int:
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS reports bytes.
    return int(maxrss if sys.platform == "darwin" else maxrss * _KIB)


def read_limit(path: str) -> int | None:
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


def cgroup_paths(cgroup_file: str) -> tuple[str | None, str | None]:
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


def ancestors(path: str | None) -> Sequence[str]:
    """``/a/b`` -> ``["a/b", "a", ""]``: a limit on any ancestor cgroup also bounds this process."""
    parts = [p for p in (path or "").split("/") if p]
    return ["/".join(parts[:i]) for i in range(len(parts), -1, -1)]


def cgroup_limit(root: str, cgroup_file: str) -> int | None:
    v2_path, v1_path = cgroup_paths(cgroup_file)
    candidates = [os.path.join(root, rel, "memory.max") for rel in ancestors(v2_path)]
    candidates += [os.path.join(root, "memory", rel, "memory.limit_in_bytes") for rel in ancestors(v1_path)]
    # Inside a container the paths in /proc/self/cgroup often don't exist (the namespace root is mounted instead),
    # so a missing file is skipped and the root files above are still read.
    limits = [limit for limit in (read_limit(p) for p in dict.fromkeys(candidates)) if limit is not None]
    return min(limits) if limits else None
