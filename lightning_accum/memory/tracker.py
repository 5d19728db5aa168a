"""``MemoryTracker``: the measured peak of live tensor storage, by category (parameters, gradients, ...).

Built on `torch.utils._python_dispatch.TorchDispatchMode`: every ATen op that runs while the tracker is
active reports its outputs, and every storage seen for the first time is counted until Python's weak reference to
it says it was freed. The same code works on CPU and CUDA, and on CPU it is the only measurement precise enough to
compare configurations: the resident set (``VmHWM``) moves in allocator-sized steps and includes the interpreter.

Torch ships a similar tool, ``torch.distributed._tools.mem_tracker.MemTracker``. It is private, lives under
``torch.distributed`` and attributes memory per module; here we need a per-category breakdown of one peak, so a
small tracker we own is the steadier base.

What is not seen: scratch memory an op allocates and frees inside its own kernel (cuBLAS workspaces, for example),
and allocator caching or fragmentation. On CUDA, compare with ``torch.cuda.max_memory_allocated``. Given a
`lightning_accum.memory.backends.MemoryBackend`, the tracker also reads that backend's peak over each phase
(`backend_phase_peaks`): on the CPU the process's peak resident set, what split mode's planner measures.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from lightning_accum._util.validation import check_int
from lightning_accum.memory.backends import MemoryBackend

Category = Literal["parameters", "gradients", "optimizer_state", "activations"]
CATEGORIES: tuple[Category, ...] = ("parameters", "gradients", "optimizer_state", "activations")


@dataclass(frozen=True)
class MemorySnapshot:
    """Live tensor bytes at one moment, by category.

    Attributes:
        total_bytes: all live tensor storage the tracker knows of.
        by_category: bytes per category; the values sum to ``total_bytes``.
        phase: the phase the tracker was in at that moment (see `MemoryTracker.phase`).
    """

    total_bytes: int
    by_category: dict[str, int] = field(default_factory=dict)
    phase: str = ""


class _Entry:
    __slots__ = ("category", "nbytes", "ref")

    def __init__(self, ref: weakref.ref[torch.UntypedStorage], nbytes: int, category: Category) -> None:
        self.ref = ref
        self.nbytes = nbytes
        self.category = category


class MemoryTracker(TorchDispatchMode):
    """Measures the peak of live tensor storage and what it was made of: a context manager.

    Categories:

    ============================  ==========================================================================
    category                      what is counted
    ============================  ==========================================================================
    ``parameters``                parameters and buffers of the tracked module
    ``gradients``                 ``param.grad`` storage, from the moment autograd accumulates into it
    ``optimizer_state``           tensors in ``optimizer.state``, from the end of the step that created them
    ``activations``               everything else: inputs, saved activations and temporaries
    ============================  ==========================================================================

    A storage created by an op is counted as ``activations`` until it takes another role: the gradient autograd
    produces becomes ``param.grad`` without a copy, and is moved to ``gradients`` by a post-accumulate-grad hook.
    Optimizer state that a step creates lazily is moved to ``optimizer_state`` by a step post-hook, so during the
    very first step it still shows as ``activations``. Measure after one warm-up step (then `reset_peak`) for
    a clean breakdown.

    Args:
        module: the model whose parameters, buffers and gradients to attribute.
        optimizers: optimizers whose state to attribute.
        device: count only storage on this device type (``"cpu"``, ``"cuda"``); ``None`` counts every device.
        block_bytes: count each storage rounded up to a multiple of this, as an allocator does: 512 predicts
            ``torch.cuda.memory_allocated`` (the caching allocator's block size); 1 counts exact bytes.
        backend: also read this backend's peak within each phase (`backend_phase_peaks`); its peak is reset at
            every phase boundary, so nothing else should read or reset it meanwhile.

    Raises:
        TypeError: if ``module`` is not an ``nn.Module``, an optimizer is not a ``torch.optim.Optimizer``, or
            ``block_bytes`` is not an int.
        ValueError: if ``block_bytes`` is below 1.

    Examples:
        >>> model = nn.Linear(256, 256)
        >>> opt = torch.optim.Adam(model.parameters())
        >>> weights = 4 * (256 * 256 + 256)  # float32 weight and bias
        >>> with MemoryTracker(model, [opt]) as tracker:
        ...     for _ in range(2):
        ...         model(torch.randn(8, 256)).sum().backward()
        ...         opt.step()
        ...         opt.zero_grad(set_to_none=True)
        >>> tracker.current.by_category["parameters"] == weights
        True
        >>> tracker.current.by_category["optimizer_state"] >= 2 * weights  # exp_avg and exp_avg_sq
        True
        >>> tracker.peak.by_category["gradients"] == weights
        True
    """

    def __init__(
        self,
        module: nn.Module | None = None,
        optimizers: Iterable[torch.optim.Optimizer] = (),
        *,
        device: str | torch.device | None = None,
        block_bytes: int = 1,
        backend: MemoryBackend | None = None,
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch's is unannotated
        self.block_bytes = check_int(block_bytes, "block_bytes", 1)
        if module is not None and not isinstance(module, nn.Module):
            raise TypeError(f"`module` must be a torch.nn.Module or None, got {type(module).__name__}.")
        self.module = module
        self.optimizers = list(optimizers)
        for opt in self.optimizers:
            if not isinstance(opt, torch.optim.Optimizer):
                raise TypeError(f"`optimizers` must hold torch.optim.Optimizer objects, got {type(opt).__name__}.")
        self.device_type = None if device is None else torch.device(device).type
        self._live: dict[int, _Entry] = {}
        self._totals: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
        self._total = 0
        self._phase = ""
        self._peak = MemorySnapshot(0, dict.fromkeys(CATEGORIES, 0), "")
        self._phase_peaks: dict[str, int] = {}
        self._handles: list[Any] = []
        self.backend = backend
        self._phases: list[str] = []  # the phases entered and not yet left, innermost last
        self._backend_phase_peaks: dict[str, int] = {}

    # ---- accounting -----------------------------------------------------------------------------------------------

    def _storage_of(self, tensor: torch.Tensor) -> torch.UntypedStorage | None:
        if self.device_type is not None and tensor.device.type != self.device_type:
            return None
        try:
            return tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse, nested or wrapper tensors have no plain storage
            return None

    def _on_free(self, key: int) -> Callable[[weakref.ref[torch.UntypedStorage]], None]:
        def callback(_: weakref.ref[torch.UntypedStorage]) -> None:
            entry = self._live.pop(key, None)
            if entry is not None:
                self._totals[entry.category] -= entry.nbytes
                self._total -= entry.nbytes

        return callback

    def track(self, tensors: Any, category: Category) -> None:
        """Count the storage of every tensor in ``tensors`` (any pytree) as ``category``, moving it if already counted.

        Raises:
            ValueError: if ``category`` is not one of the four categories.
        """
        if category not in CATEGORIES:
            raise ValueError(f"`category` must be one of {CATEGORIES}, got {category!r}.")
        for tensor in tree_flatten(tensors)[0]:
            if isinstance(tensor, torch.Tensor):
                self._count(tensor, category, move=True)
        self._update_peak()

    def _count(self, tensor: torch.Tensor, category: Category, move: bool) -> None:
        storage = self._storage_of(tensor)
        if storage is None:
            return
        key = storage._cdata  # the StorageImpl address: stable while the storage lives
        nbytes = -(-storage.nbytes() // self.block_bytes) * self.block_bytes
        entry = self._live.get(key)
        if entry is None:
            if nbytes == 0:
                return
            # Torch keeps a storage's Python object alive as long as the storage lives, so the weak reference dies
            # exactly when the memory is released.
            self._live[key] = _Entry(weakref.ref(storage, self._on_free(key)), nbytes, category)
            self._totals[category] += nbytes
            self._total += nbytes
            return
        if entry.nbytes != nbytes:  # resized in place (an out= op)
            self._totals[entry.category] += nbytes - entry.nbytes
            self._total += nbytes - entry.nbytes
            entry.nbytes = nbytes
        if move and entry.category != category:
            self._totals[entry.category] -= entry.nbytes
            self._totals[category] += entry.nbytes
            entry.category = category

    def _update_peak(self) -> None:
        if self._total > self._peak.total_bytes:
            self._peak = MemorySnapshot(self._total, dict(self._totals), self._phase)
        if self._total > self._phase_peaks.get(self._phase, -1):
            self._phase_peaks[self._phase] = self._total

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                self._count(tensor, "activations", move=False)
        self._update_peak()
        return out

    # ---- roles ----------------------------------------------------------------------------------------------------

    def _on_grad(self, param: torch.Tensor) -> None:
        if param.grad is not None:
            self._count(param.grad, "gradients", move=True)

    def _on_step(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        for state in optimizer.state.values():
            self.track(state, "optimizer_state")

    def _attach(self) -> None:
        if self.module is not None:
            self.track([*self.module.parameters(), *self.module.buffers()], "parameters")
            for param in self.module.parameters():
                if param.grad is not None:
                    self._count(param.grad, "gradients", move=True)
                if param.requires_grad:
                    self._handles.append(param.register_post_accumulate_grad_hook(self._on_grad))
        for opt in self.optimizers:
            self._on_step(opt)
            self._handles.append(opt.register_step_post_hook(self._on_step))
        self._update_peak()

    def __enter__(self) -> MemoryTracker:
        self._attach()
        super().__enter__()  # type: ignore[no-untyped-call]  # torch's is unannotated
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)  # type: ignore[no-untyped-call]  # torch's is unannotated
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # ---- results --------------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Label what runs inside as ``name`` (e.g. ``"forward"``), so the peak says when it happened."""
        previous, self._phase = self._phase, name
        self._update_peak()  # what is live on entering belongs to the phase too
        self._sample_backend()
        self._phases.append(name)
        try:
            yield
        finally:
            self._sample_backend()
            self._phases.pop()
            self._phase = previous

    def _sample_backend(self) -> None:
        """Give the backend's peak since the last boundary to every phase entered, then start a new one."""
        if self.backend is None:
            return
        peak = self.backend.peak_bytes()
        for name in self._phases:
            self._backend_phase_peaks[name] = max(self._backend_phase_peaks.get(name, 0), peak)
        self.backend.reset_peak()

    @property
    def current(self) -> MemorySnapshot:
        """Live tensor bytes now."""
        return MemorySnapshot(self._total, dict(self._totals), self._phase)

    @property
    def peak(self) -> MemorySnapshot:
        """The largest total seen since the tracker started or since `reset_peak`, with its breakdown."""
        return self._peak

    @property
    def phase_peaks(self) -> dict[str, int]:
        """The largest total seen in each phase (see `phase`) since the tracker started or since `reset_peak`.

        Examples:
            >>> with MemoryTracker() as tracker:
            ...     with tracker.phase("big"):
            ...         big = torch.zeros(1024)
            ...     with tracker.phase("small"):
            ...         del big
            ...         small = torch.zeros(16)
            >>> tracker.phase_peaks["big"], tracker.phase_peaks["small"]
            (4096, 4096)
        """
        return dict(self._phase_peaks)

    @property
    def backend_phase_peaks(self) -> dict[str, int]:
        """With a ``backend``, its peak within each phase since the tracker started or since `reset_peak`, else empty.

        Examples:
            >>> from lightning_accum.memory.backends import CPUBackend
            >>> with MemoryTracker(backend=CPUBackend()) as tracker, tracker.phase("step"):
            ...     x = torch.ones(1 << 20)
            >>> tracker.backend_phase_peaks["step"] >= x.nbytes
            True
        """
        return dict(self._backend_phase_peaks)

    def reset_peak(self) -> None:
        """Start a new peak from the current live bytes (e.g. after warm-up steps)."""
        self._peak = self.current
        self._phase_peaks = {self._phase: self._total}
        self._backend_phase_peaks = {}
        if self.backend is not None:
            self.backend.reset_peak()
