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

import copy
from collections.abc import Iterable
from typing import Any, Literal

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from lightning_accum.memory.precision import replace_tensors

Target = Literal["cpu", "cuda"]
TARGETS: tuple[str, ...] = ("cpu", "cuda")
CUDA_BLOCK_BYTES = 512
"""The CUDA caching allocator rounds every block up to a multiple of 512 bytes (``kMinBlockSize``)."""
CUDA_HEADROOM = 0.10
"""Share of a CUDA budget kept free for what fake tensors can't see (workspaces, fragmentation); a judgment call."""


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

    def fake(self, tensor: torch.Tensor, shared: dict[int, Any] | None = None) -> torch.Tensor:
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
        shared: dict[int, Any] = {}
        return apply_to_collection(batch, torch.Tensor, lambda t: self.fake(t, shared))

    def module(self, module: nn.Module) -> nn.Module:
        """Make every parameter and buffer of ``module`` fake, in place (tied parameters stay tied)."""
        shared: dict[int, Any] = {}
        return replace_tensors(module, lambda t: self.fake(t, shared))

    def copy_step(
        self, module: nn.Module, optimizers: Iterable[torch.optim.Optimizer] = ()
    ) -> tuple[nn.Module, list[torch.optim.Optimizer]]:
        """Deep copies of ``module`` and ``optimizers`` whose tensors are fake: no real weight or state is copied.

        The copies share their fake parameters as the originals share theirs (tied weights, param groups), and
        the optimizers keep any state they already hold (a resumed run), as fake tensors.

        Raises:
            Exception: whatever ``copy.deepcopy`` raises for an attribute that cannot be copied.
        """
        optimizers = list(optimizers)
        memo: dict[int, Any] = {}
        shared: dict[int, Any] = {}
        for sub in module.modules():
            for param in sub._parameters.values():
                if param is not None and id(param) not in memo:
                    fake = self.fake(param, shared)
                    memo[id(param)] = nn.Parameter(fake, requires_grad=param.requires_grad)
            for value in [*sub._buffers.values(), *vars(sub).values()]:
                if isinstance(value, torch.Tensor) and id(value) not in memo:
                    memo[id(value)] = self.fake(value, shared)
        for opt in optimizers:
            for state in opt.state.values():
                for value in state.values():
                    if isinstance(value, torch.Tensor) and id(value) not in memo:
                        memo[id(value)] = self._state_tensor(value, shared)
        module_copy, optimizers_copy = copy.deepcopy((module, optimizers), memo)
        return module_copy, optimizers_copy

    def _state_tensor(self, value: torch.Tensor, shared: dict[int, Any]) -> torch.Tensor:
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
