"""Out-of-memory errors: recognising them, cleaning up after them, and injecting them on purpose.

Recovery (re-running a batch in smaller micro-batches) is only safe for errors that really are allocation failures,
so `is_oom_error` matches the exact messages PyTorch's allocators and libraries raise and nothing else: a
shape error retried at half size would just fail again, more slowly, and hide the bug.

`OOMInjector` raises a realistic OOM at a chosen rank, optimizer step, micro-batch and phase, so that the
recovery path can be tested deterministically on any machine.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from lightning_accum.memory.budget import GIB
from lightning_accum.memory.host import trim_cpu_heap

Phase = Literal["forward", "backward"]
OOMFlavor = Literal["cpu", "cuda"]

# Substrings of the messages PyTorch raises when an allocation fails, lower-cased. Each names its source so that a
# new one is easy to audit.
_OOM_MESSAGES: tuple[str, ...] = (
    "cuda out of memory",  # c10/cuda/CUDACachingAllocator.cpp (older torch raises a plain RuntimeError)
    "cuda error: out of memory",  # cudaErrorMemoryAllocation surfaced by C10_CUDA_CHECK (context, NCCL buffers)
    "hip out of memory",  # ROCm builds of the caching allocator
    "defaultcpuallocator: can't allocate memory",  # c10/core/impl/alloc_cpu.cpp
    "cublas_status_alloc_failed",  # cuBLAS could not allocate its workspace
    "cudnn_status_alloc_failed",  # cuDNN could not allocate its workspace
    "cudnn error: cudnn_status_alloc_failed",
    "mps backend out of memory",  # aten/src/ATen/mps/MPSAllocator.mm
    "xpu out of memory",  # c10/xpu/XPUCachingAllocator.cpp
)


def is_oom_error(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised ``from``) is a failed memory allocation.

    True for ``torch.OutOfMemoryError`` (also reachable as ``torch.cuda.OutOfMemoryError``), Python's
    ``MemoryError``, and ``RuntimeError`` messages of the CUDA, ROCm, CPU, MPS and XPU allocators and of the
    cuBLAS and cuDNN workspace allocations. False for anything else.

    Examples:
        >>> is_oom_error(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
        True
        >>> is_oom_error(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 4x3)"))
        False
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if _is_oom(current):
            return True
        # Only explicit chaining (`raise X from oom`); implicit __context__ would match errors raised while
        # *handling* an OOM, which are not OOMs themselves.
        current = current.__cause__
    return False


def _is_oom(exc: BaseException) -> bool:
    oom_types = tuple(
        t
        for t in (getattr(torch, "OutOfMemoryError", None), getattr(torch.cuda, "OutOfMemoryError", None))
        if isinstance(t, type)
    )
    if oom_types and isinstance(exc, oom_types):
        return True
    if isinstance(exc, MemoryError):
        return True
    if not isinstance(exc, RuntimeError) or not exc.args:
        return False
    message = str(exc.args[0]).lower()
    return any(pattern in message for pattern in _OOM_MESSAGES)


def describe_error(exc: BaseException, limit: int = 200) -> str:
    r"""The first line of ``exc``'s message (cut to ``limit`` characters), or its type name when it has none.

    Allocation failures often carry no message at all: ``bytearray`` raises a bare ``MemoryError()`` when ``malloc``
    fails, and so does code that re-raises a ``torch.OutOfMemoryError()`` it built itself.

    Examples:
        >>> describe_error(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail"))
        'CUDA out of memory. Tried to allocate 2.00 GiB'
        >>> describe_error(MemoryError())
        'MemoryError (no message)'
    """
    lines = str(exc).strip().splitlines()
    if not lines or not lines[0].strip():
        return f"{type(exc).__name__} (no message)"
    line = lines[0].strip()
    return line if len(line) <= limit else line[: limit - 3] + "..."


def release_memory() -> None:
    """Free what an OOM left behind: unreachable Python objects, then the device caches that are initialised.

    Call it after dropping every reference to the failed step's tensors (the exception's traceback holds its
    frames, so let the ``except`` block end first). It never initialises a device that isn't in use yet. On CPU it
    returns freed heap pages to the OS, so the resident set measures the new working set; that is the CPU's
    ``empty_cache`` and, like it, costs page faults afterwards, so call it when the working set changed, not every
    step.
    """
    gc.collect()
    release_cached_memory()


def release_cached_memory() -> None:
    """Return memory that is free but still held (CUDA's cache, the CPU heap's pages) to the device or the OS.

    `release_memory` without the ``gc.collect()``, which costs about half a second in a process that has imported
    torch and Lightning: after a planned shrink the larger step's tensors are already freed by reference counting.
    """
    trim_cpu_heap()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and getattr(xpu, "is_initialized", lambda: False)() and hasattr(xpu, "empty_cache"):
        xpu.empty_cache()
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available() and hasattr(torch, "mps") and hasattr(torch.mps, "empty_cache"):
        torch.mps.empty_cache()


def oom_error(flavor: OOMFlavor = "cpu", nbytes: int = 2 * GIB, detail: str = "") -> RuntimeError:
    """An exception that looks exactly like the one the ``flavor`` allocator raises when ``nbytes`` don't fit.

    Args:
        flavor: ``"cpu"`` gives the CPU allocator's ``RuntimeError``, ``"cuda"`` a ``torch.OutOfMemoryError``.
        nbytes: the size of the allocation that "failed".
        detail: appended to the message, e.g. to say that the error was injected.

    Raises:
        ValueError: if ``flavor`` is unknown.

    Examples:
        >>> is_oom_error(oom_error("cuda")), is_oom_error(oom_error("cpu"))
        (True, True)
    """
    tail = f" {detail}" if detail else ""
    if flavor == "cpu":
        return RuntimeError(
            f"[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you tried to"
            f" allocate {nbytes} bytes. Error code 12 (Cannot allocate memory){tail}"
        )
    if flavor == "cuda":
        gib = nbytes / GIB
        return torch.OutOfMemoryError(
            f"CUDA out of memory. Tried to allocate {gib:.2f} GiB. GPU 0 has a total capacity of 79.11 GiB of which"
            f" {gib / 2:.2f} GiB is free.{tail}"
        )
    raise ValueError(f"`flavor` must be 'cpu' or 'cuda', got {flavor!r}.")


@dataclass(frozen=True)
class OOMFault:
    """Where an injected OOM strikes. ``None`` in a field means "any".

    Attributes:
        step: the optimizer step (``trainer.global_step``) at which to fail.
        micro_batch: the index of the micro-batch within the step (0 for the first).
        phase: ``"forward"`` (before the model runs) or ``"backward"`` (inside autograd).
        rank: the global rank that fails; ``None`` fails on every rank.
        when_size_above: only fail while the micro-batch size is larger than this, which imitates a real memory
            limit; the caller must then pass ``micro_batch_size`` to `OOMInjector.check`.
        times: how often this fault fires before it is spent; ``None`` fires forever. A recovery re-runs the step
            from micro-batch 0, so ``times=1`` fails once and lets the retry through.
    """

    step: int | None = 0
    micro_batch: int | None = 0
    phase: Phase = "forward"
    rank: int | None = None
    when_size_above: int | None = None
    times: int | None = 1

    def __post_init__(self) -> None:
        if self.phase not in ("forward", "backward"):
            raise ValueError(f"`phase` must be 'forward' or 'backward', got {self.phase!r}.")
        if self.times is not None and self.times < 1:
            raise ValueError(f"`times` must be >= 1, or None to fire forever, got {self.times!r}.")


class OOMInjector:
    """Raises a realistic out-of-memory error at chosen (rank, step, micro-batch, phase) points.

    The split-mode callback calls `check` before each forward pass, and `arm_backward` on the loss (or on
    an intermediate activation, to fail half-way through autograd after some gradients were already accumulated).
    Firing is a deterministic function of the calls made, so a test can predict every retry.

    Args:
        faults: one `OOMFault` or several.
        flavor: which allocator's error to imitate: ``"cpu"`` (a ``RuntimeError``) or ``"cuda"`` (a
            ``torch.OutOfMemoryError``).

    Raises:
        TypeError: if a fault is not an `OOMFault`.
        ValueError: if ``flavor`` is unknown.

    Examples:
        >>> injector = OOMInjector(OOMFault(step=3, micro_batch=1, phase="forward"))
        >>> injector.check(rank=0, step=3, micro_batch=0, phase="forward")  # not this one
        >>> try:
        ...     injector.check(rank=0, step=3, micro_batch=1, phase="forward")
        ... except RuntimeError as err:
        ...     print(is_oom_error(err), injector.fired)
        True [(0, 3, 1, 'forward')]
        >>> injector.check(rank=0, step=3, micro_batch=1, phase="forward")  # spent: the retry goes through
    """

    def __init__(self, faults: OOMFault | Iterable[OOMFault], flavor: OOMFlavor = "cpu") -> None:
        faults = [faults] if isinstance(faults, OOMFault) else list(faults)
        for fault in faults:
            if not isinstance(fault, OOMFault):
                raise TypeError(f"`faults` must hold OOMFault objects, got {fault!r} of type {type(fault).__name__}.")
        if flavor not in ("cpu", "cuda"):
            raise ValueError(f"`flavor` must be 'cpu' or 'cuda', got {flavor!r}.")
        self.faults: tuple[OOMFault, ...] = tuple(faults)
        self.flavor: OOMFlavor = flavor
        self._remaining: list[int | None] = [f.times for f in self.faults]
        self.fired: list[tuple[int, int, int, Phase]] = []  # (rank, step, micro_batch, phase) of each injected OOM

    def _match(self, rank: int, step: int, micro_batch: int, phase: Phase, micro_batch_size: int | None) -> int | None:
        for i, fault in enumerate(self.faults):
            if self._remaining[i] == 0:
                continue
            if fault.phase != phase:
                continue
            if fault.rank is not None and fault.rank != rank:
                continue
            if fault.step is not None and fault.step != step:
                continue
            if fault.micro_batch is not None and fault.micro_batch != micro_batch:
                continue
            if fault.when_size_above is not None:
                if micro_batch_size is None:
                    raise ValueError(
                        "An OOMFault with `when_size_above` needs `micro_batch_size=` in `OOMInjector.check`, got None."
                    )
                if micro_batch_size <= fault.when_size_above:
                    continue
            return i
        return None

    def check(
        self, *, rank: int, step: int, micro_batch: int, phase: Phase, micro_batch_size: int | None = None
    ) -> None:
        """Raise an OOM error if a fault that isn't spent matches this point; otherwise do nothing."""
        i = self._match(rank, step, micro_batch, phase, micro_batch_size)
        if i is None:
            return
        remaining = self._remaining[i]
        if remaining is not None:
            self._remaining[i] = remaining - 1
        self.fired.append((rank, step, micro_batch, phase))
        raise oom_error(
            self.flavor,
            detail=f"(injected by lightning_accum.OOMInjector: rank {rank}, step {step}, micro-batch {micro_batch},"
            f" {phase})",
        )

    def arm_backward(
        self, tensor: Tensor, *, rank: int, step: int, micro_batch: int, micro_batch_size: int | None = None
    ) -> Tensor:
        """Make a matching ``"backward"`` fault fire inside autograd when the gradient reaches ``tensor``.

        The check happens when autograd computes the gradient of ``tensor``: at the very start of the backward pass
        for the loss, or midway for an intermediate activation. Returns ``tensor`` unchanged; does nothing to a
        tensor that doesn't require grad.
        """
        if not tensor.requires_grad:
            return tensor

        def hook(grad: Tensor) -> None:
            self.check(
                rank=rank, step=step, micro_batch=micro_batch, phase="backward", micro_batch_size=micro_batch_size
            )

        tensor.register_hook(hook)
        return tensor
