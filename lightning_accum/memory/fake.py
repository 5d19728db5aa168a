"""``FakeTarget``: run a training step on fake tensors (shapes and dtypes, no memory) as it would run on a target.

Tracing on fake tensors answers "how much memory would this step need?" for models that don't fit the machine: a
`lightning_accum.memory.tracker.MemoryTracker` counts their storages as if they were real. The fake tensors live on
the CPU device of a ``FakeTensorMode``, so every op dispatches exactly as on the CPU: the same kernels, the same
saved tensors, the same temporaries. That is why this is not the ``meta`` device: on ``meta``, scaled dot-product
attention takes the math path (it materializes the ``L x L`` attention matrix and its softmax, where the CPU and CUDA
use flash attention), and ``Module.to("meta")`` unties tied weights; both made the old ``--device meta`` probe
overestimate.

For a CUDA target (``target="cuda"``) on any machine, two CUDA behaviours are reproduced:

- optimizers that default to a ``foreach`` implementation on CUDA use it (its temporaries are whole lists of
  tensors, where the CPU's per-parameter loop has one at a time);
- the tracker counts storages in the CUDA caching allocator's 512-byte blocks, as ``torch.cuda.memory_allocated``
  does.

The kernels are the CPU's. For attention that is close: the CPU's flash attention saves what CUDA's flash and
memory-efficient kernels save (the output and a float32 log-sum-exp per query). Where CUDA cannot use a fused kernel
and falls back to the math path (head sizes over 256 in fp16/bf16, unaligned head sizes) the prediction is low.
(Routing attention to CUDA's kernels with a ``TorchFunctionMode`` is not an option: function modes are off during
the backward pass, so activation checkpointing would recompute with other kernels than its forward pass used.)

What it cannot see on CUDA: the CUDA context (hundreds of MiB per process, outside PyTorch's allocator), cuBLAS and
cuBLASLt workspaces, NCCL buffers, fragmentation (``memory_reserved - memory_allocated``), and under ``*-mixed``
precision CUDA's autocast op lists (the CPU's are used). `CUDA_HEADROOM` is the share of a budget the probe keeps
free for them.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeGuard

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from lightning_accum import _compat
from lightning_accum.memory.precision import replace_tensors

Target = Literal["cpu", "cuda"]
TARGETS: tuple[str, ...] = ("cpu", "cuda")
CUDA_BLOCK_BYTES = 512
"""The CUDA caching allocator rounds every block up to a multiple of 512 bytes (``kMinBlockSize``)."""
CUDA_HEADROOM = 0.10
"""Share of a CUDA budget kept free for what fake tensors can't see (workspaces, fragmentation); a judgment call."""
SharedStorages = dict[int, tuple[torch.Tensor, torch.Tensor]]
"""Storage address -> (the real tensor, keeping the address unique, and its fake storage): see `FakeTarget.fake`."""

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


class FakeTarget:
    """A context in which tensors are fake and a training step allocates nothing, dispatched as on ``target``.

    Inside it, every tensor created is a ``FakeTensor`` on the CPU device. `module`, `copy_step` and `tensors`
    turn real modules and batches into fake ones (same shapes, dtypes, strides and shared storages);
    `optimizers` gives optimizers the implementation they would have on the target. It can be entered again, e.g.
    to build real batches in between; the fake tensors made inside stay valid for the object's life.

    Args:
        target: the device to predict for: ``"cpu"`` or ``"cuda"``.

    Raises:
        ValueError: if ``target`` is neither.

    Examples:
        >>> from lightning_accum.memory.tracker import MemoryTracker
        >>> with FakeTarget("cpu") as fake:
        ...     model = nn.Linear(1024, 1024)  # 4 MiB of weights that are never allocated
        ...     with MemoryTracker(model) as tracker:
        ...         model(torch.randn(64, 1024)).sum().backward()
        >>> type(model.weight).__name__, tracker.current.by_category["gradients"] == 4 * (1024 * 1024 + 1024)
        ('FakeTensor', True)
    """

    def __init__(self, target: Target = "cpu") -> None:
        if target not in TARGETS:
            raise ValueError(f"`target` must be one of {', '.join(TARGETS)}, got {target!r}.")
        self.target = target
        self.device = torch.device("cpu")
        self.block_bytes = CUDA_BLOCK_BYTES if target == "cuda" else 1
        # One mode for the object's life: it can be entered again (tensors of two fake modes must not meet).
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)

    def __enter__(self) -> FakeTarget:
        self.mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.mode.__exit__(*exc)

    # ---- real -> fake -------------------------------------------------------------------------------------------

    def fake(self, tensor: torch.Tensor, shared: SharedStorages | None = None) -> torch.Tensor:
        """A fake tensor like ``tensor`` on the fake device (a fake one is returned as is).

        Only the real tensor's metadata is read: running an op on it inside the mode would convert it with the fake
        mode's own converter, which keeps its device (``meta``, ``cuda``).

        Tensors converted with the same ``shared`` dict that share a storage get views of one fake storage, as a
        batch's ``input_ids`` and ``labels`` cut from one tensor do. The dict holds the fake storages: drop it when
        the conversion is done, or they stay alive (and counted).
        """
        if isinstance(tensor, FakeTensor):
            return tensor
        shared = {} if shared is None else shared
        storage = tensor.untyped_storage()
        if storage._cdata not in shared:  # holding the real tensor too keeps the key unique while the dict lives
            shared[storage._cdata] = (tensor, torch.empty(storage.nbytes(), dtype=torch.uint8, device=self.device))
        base = shared[storage._cdata][1]
        size = base.numel() // tensor.element_size() * tensor.element_size()
        out = base[:size].view(tensor.dtype).as_strided(tensor.shape, tensor.stride(), tensor.storage_offset())
        return out.requires_grad_(tensor.requires_grad) if tensor.is_floating_point() else out

    def tensors(self, batch: Any) -> Any:
        """``batch`` (any collection) with every real tensor replaced by a fake one, shared storages kept shared."""
        shared: SharedStorages = {}
        return apply_to_collection(batch, torch.Tensor, lambda t: self.fake(t, shared))

    def module(self, module: nn.Module) -> nn.Module:
        """Make every parameter and buffer of ``module`` fake, in place (tied parameters stay tied)."""
        shared: SharedStorages = {}
        return replace_tensors(module, lambda t: self.fake(t, shared))

    def copy_step(self, module: nn.Module, optimizers: Iterable[torch.optim.Optimizer] = ()) -> FakeStep:
        """Deep copies of ``module`` and ``optimizers`` whose tensors are fake: no real weight or state is copied.

        The copies share their fake parameters as the originals share theirs (tied weights, param groups), and
        the optimizers keep any state they already hold (a resumed run), as fake tensors. It enters the context
        itself, once it has read a sharded model's local shards; for a sharded model, call it outside the context.

        A model sharded with FSDP2 (``fully_shard``) is copied without ``copy.deepcopy``, which FSDP2 refuses: each
        FSDP2 module becomes a plain module of the class it wrapped, without FSDP2's hooks, that computes with fake
        unsharded parameters, while the optimizers' copies step fake shards of this rank's size (see `FakeStep`).

        Raises:
            ValueError: if a parameter is a ``DTensor`` that FSDP2 does not manage alone (tensor parallelism).
            Exception: whatever ``copy.deepcopy`` raises for an attribute that cannot be copied.
        """
        optimizers = list(optimizers)
        units = _compat.fsdp2_modules(module)
        with torch.no_grad():  # DTensor methods run on the real tensors: before the mode is on
            shards = _local_shards(module, units)
            local_state = {
                id(v): v.to_local()
                for opt in optimizers
                for s in opt.state.values()
                for v in s.values()
                if _is_dtensor(v)
            }
        with self:
            memo: dict[int, Any] = {}
            shared: SharedStorages = {}
            sharded = self._fake_parameters(module, units, shards, memo, shared)
            for opt in optimizers:
                for state in opt.state.values():
                    for value in state.values():
                        if isinstance(value, torch.Tensor) and id(value) not in memo:
                            memo[id(value)] = self._state_tensor(local_state.get(id(value), value), shared)
            plain = {id(unit): _compat.fsdp2_unwrapped(unit) for unit in units}
            for unit in units:  # FSDP2 modules are built by hand; `deepcopy` finds them in the memo
                memo[id(unit)] = plain[id(unit)][0].__new__(plain[id(unit)][0])
            module_copy = copy.deepcopy(module, memo)
            for unit in units:
                memo[id(unit)].__setstate__(copy.deepcopy(plain[id(unit)][1], memo))
            for key, (_, shard) in sharded.items():  # the optimizers step the shards
                memo[key] = shard
            optimizers_copy = copy.deepcopy(optimizers, memo)
        return FakeStep(module_copy, optimizers_copy, _units_of(units, sharded))

    def _fake_parameters(
        self,
        module: nn.Module,
        units: list[nn.Module],
        shards: dict[int, torch.Tensor],
        memo: dict[int, Any],
        shared: SharedStorages,
    ) -> dict[int, tuple[nn.Parameter, nn.Parameter]]:
        """Fill ``memo`` with fake parameters and tensor attributes; return each sharded one's (unsharded, shard)."""
        sharded: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}
        for sub in module.modules():
            for param in sub._parameters.values():
                if param is None or id(param) in memo:
                    continue
                if id(param) in shards:
                    grad = param.requires_grad
                    full = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device=self.device), grad)
                    sharded[id(param)] = (full, nn.Parameter(self.fake(shards[id(param)], shared), grad))
                    memo[id(param)] = full
                else:
                    memo[id(param)] = nn.Parameter(self.fake(param, shared), requires_grad=param.requires_grad)
            for value in [*sub._buffers.values(), *vars(sub).values()]:
                if isinstance(value, torch.Tensor) and id(value) not in memo:
                    memo[id(value)] = self.fake(value, shared)
                elif _is_distributed_handle(value):  # a LightningModule's `device_mesh`: shared, not copied
                    memo[id(value)] = value
        return sharded

    def _state_tensor(self, value: torch.Tensor, shared: SharedStorages) -> torch.Tensor:
        # FSDP2's optimizer state is sharded as its parameters are: `value` is then this rank's local shard.
        # A one-element state (Adam's `step`) is read with `.item()`: it must keep its value, which a fake tensor
        # made inside the mode from a Python number does. `tolist` reads the real tensor without dispatching.
        if value.numel() == 1:
            return torch.tensor(value.tolist(), dtype=value.dtype, device=self.device)
        return self.fake(value, shared)

    def optimizers(self, optimizers: Iterable[torch.optim.Optimizer]) -> list[torch.optim.Optimizer]:
        """``optimizers``, set to the implementation they would pick on the target (in place).

        On CUDA, ``torch.optim`` picks ``foreach`` for every optimizer that has it unless told otherwise
        (``_default_to_fused_or_foreach``); on fake CPU tensors it would pick the per-parameter loop.
        """
        optimizers = list(optimizers)
        if self.target == "cuda":
            for opt in optimizers:
                for group in opt.param_groups:
                    if "foreach" in group and group["foreach"] is None and not group.get("fused"):
                        group["foreach"] = True
        return optimizers


@dataclass
class FakeStep:
    """What `FakeTarget.copy_step` made: fake copies of a module and its optimizers, and their FSDP2 shards.

    Without FSDP2 the optimizers step the module's own (fake) parameters. With FSDP2 the module computes with fake
    unsharded parameters, as FSDP2's unsharded parameters during a step, and the optimizers step fake shards of this
    rank's size. Inside `sharding`, each FSDP2 module's gradients are reduce-scattered into its shards' gradients as
    soon as its unsharded gradients are complete in a backward with `sync_gradients` on, as FSDP2's post-backward
    does. FSDP2's own hooks don't run: no all-gather, no collective. A ``MixedPrecisionPolicy`` is not modelled: the
    copy computes in the parameters' dtype.

    Attributes:
        module: the fake module.
        optimizers: the fake optimizers.
        sharded: per FSDP2 module, innermost first, the (unsharded, shard) pair of each parameter it manages.
        sync_gradients: whether the next backward reduce-scatters (FSDP2's ``set_requires_gradient_sync``).
    """

    module: nn.Module
    optimizers: list[torch.optim.Optimizer]
    sharded: list[list[tuple[nn.Parameter, nn.Parameter]]] = field(default_factory=list)
    sync_gradients: bool = True
    _waiting: list[set[int]] = field(default_factory=list, repr=False)
    _in_flight: list[torch.Tensor] = field(default_factory=list, repr=False)

    @property
    def shards(self) -> list[nn.Parameter]:
        """The fake shards the optimizers step (empty without FSDP2)."""
        return [shard for unit in self.sharded for _, shard in unit]

    def unsharded_bytes(self, block_bytes: int = 1) -> int:
        """The unsharded parameters' bytes, each rounded up to ``block_bytes``: FSDP2 holds them only in a step."""
        sizes = (full.untyped_storage().nbytes() for unit in self.sharded for full, _ in unit)
        return sum(-(-n // block_bytes) * block_bytes for n in sizes)

    @contextlib.contextmanager
    def sharding(self) -> Iterator[None]:
        """Reduce-scatter each FSDP2 module's gradients when they are complete, and before any optimizer step."""
        handles = [opt.register_step_pre_hook(self._before_step) for opt in self.optimizers if self.sharded]
        for index, unit in enumerate(self.sharded):
            for full, _ in unit:
                if full.requires_grad:
                    handles.append(full.register_post_accumulate_grad_hook(functools.partial(self._on_grad, index)))
        self._waiting = [set() for _ in self.sharded]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _on_grad(self, index: int, param: torch.Tensor) -> None:
        if not self.sync_gradients:
            return
        waiting = self._waiting[index]
        if not waiting:  # the first gradient of this backward: wait for all of the module's
            waiting.update(id(full) for full, _ in self.sharded[index] if full.requires_grad)
        waiting.discard(id(param))
        if not waiting:
            self.reduce_scatter(self.sharded[index])

    def _before_step(self, *_: Any) -> None:
        for unit in self.sharded:  # a module whose parameters were not all used: FSDP2 reduce-scatters it at the end
            self.reduce_scatter(unit)
        self._waiting = [set() for _ in self.sharded]
        self._in_flight.clear()  # FSDP2's final callback of the backward releases the last input

    def reduce_scatter(self, unit: list[tuple[nn.Parameter, nn.Parameter]]) -> None:
        """Move one FSDP2 module's unsharded gradients to its shards, with the allocations of FSDP2's reduce-scatter.

        FSDP2 (``FSDPParamGroup.post_backward``, ``foreach_reduce``) frees the previous module's reduce-scatter
        input, copies the unsharded gradients into a new flat one, frees them, and reduce-scatters into a buffer of
        the shards' size, whose views become the shards' gradients; the input stays alive until the next module's
        reduce-scatter (one in flight) or the end of the backward. The same allocations run here on fake tensors.
        """
        grads = [full.grad for full, _ in unit if full.grad is not None]
        if not grads:
            return
        self._in_flight.clear()
        flat = torch.empty(sum(g.numel() for g in grads), dtype=grads[0].dtype, device=grads[0].device)
        del grads
        for full, _ in unit:
            full.grad = None
        output = torch.empty(sum(s.numel() for _, s in unit), dtype=unit[0][1].dtype, device=flat.device)
        offset = 0
        for _, shard in unit:
            shard.grad = output[offset : offset + shard.numel()].view_as(shard)
            offset += shard.numel()
        self._in_flight.append(flat)


def _is_dtensor(value: object) -> TypeGuard[DTensor]:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed support has no DTensor
        return False
    return isinstance(value, DTensor)


def _is_distributed_handle(value: Any) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.device_mesh import DeviceMesh

    return isinstance(value, (DeviceMesh, torch.distributed.ProcessGroup))


def _local_shards(module: nn.Module, units: list[nn.Module]) -> dict[int, torch.Tensor]:
    """This rank's local shard of each ``DTensor`` parameter of ``module``, by the parameter's id.

    Raises:
        ValueError: if a ``DTensor`` parameter is not managed by an FSDP2 module, or is sharded over more than one
            mesh dimension: tensor parallelism, whose ``DTensor`` ops a trace on plain fake tensors cannot run.
    """
    managed = {id(p) for unit in units for p in unit.parameters()}
    shards: dict[int, torch.Tensor] = {}
    for name, param in module.named_parameters(remove_duplicate=True):
        if not _is_dtensor(param):
            continue
        dims = sum(placement.is_shard() for placement in param.placements)
        if id(param) not in managed or dims > 1:
            raise ValueError(
                f"The parameter `{name}` is a DTensor sharded as {param.placements} over a mesh of shape"
                f" {tuple(param.device_mesh.shape)}, which is more than FSDP2's sharding over data-parallel ranks"
                " (tensor parallelism): the trace on fake tensors cannot run DTensor ops."
            )
        shards[id(param)] = param.to_local()
    return shards


def _units_of(
    units: list[nn.Module], sharded: dict[int, tuple[nn.Parameter, nn.Parameter]]
) -> list[list[tuple[nn.Parameter, nn.Parameter]]]:
    """Each FSDP2 module's (unsharded, shard) pairs, innermost first: a parameter is its innermost module's."""
    seen: set[int] = set()
    grouped = []
    for unit in reversed(units):
        pairs = [sharded[id(p)] for p in unit.parameters() if id(p) in sharded and id(p) not in seen]
        seen.update(id(p) for p in unit.parameters())
        if pairs:
            grouped.append(pairs)
    return grouped
