"""``FakeTarget``: run a training step on fake tensors (shapes and dtypes, no memory) as it would run on a target.

Tracing on fake tensors answers "how much memory would this step need?" for models that don't fit the machine: a
`lightning_accum.memory.tracker.MemoryTracker` counts their storages as if they were real. The fake tensors live on
the CPU device of a ``FakeTensorMode``, so every op dispatches exactly as on the CPU: the same kernels, the same
saved tensors, the same temporaries. That is why this is not the ``meta`` device: on ``meta``, scaled dot-product
attention takes the math path (it materializes the ``L x L`` attention matrix and its softmax, where the CPU and CUDA
use flash attention), and ``Module.to("meta")`` unties tied weights; both made the old ``--device meta`` probe
overestimate.

For a CUDA target (``target="cuda"``) on any machine, three CUDA behaviours are reproduced:

- scaled dot-product attention runs the kernel CUDA would pick (flash attention for fp16/bf16 without a mask,
  memory-efficient attention otherwise, math as the last resort; an Ampere or newer GPU is assumed);
- optimizers that default to a ``foreach`` implementation on CUDA use it (its temporaries are whole lists of
  tensors, where the CPU's per-parameter loop has one at a time);
- the tracker counts storages in the CUDA caching allocator's 512-byte blocks, as ``torch.cuda.memory_allocated``
  does.

What it cannot see on CUDA: the CUDA context (hundreds of MiB per process, outside PyTorch's allocator), cuBLAS and
cuBLASLt workspaces, NCCL buffers, and fragmentation (``memory_reserved - memory_allocated``); and under
``*-mixed`` precision it follows the CPU's autocast op lists, not CUDA's. `CUDA_HEADROOM` is the share of a budget
the probe keeps free for them.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterable
from typing import Any, Literal

import torch
import torch.nn.functional as F
from lightning.fabric.utilities.apply_func import apply_to_collection
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.overrides import TorchFunctionMode

from lightning_accum.memory.precision import replace_tensors

Target = Literal["cpu", "cuda"]
TARGETS: tuple[str, ...] = ("cpu", "cuda")
CUDA_BLOCK_BYTES = 512
"""The CUDA caching allocator rounds every block up to a multiple of 512 bytes (``kMinBlockSize``)."""
CUDA_HEADROOM = 0.10
"""Share of a CUDA budget kept free for what fake tensors can't see (workspaces, fragmentation); a judgment call."""


class FakeTarget:
    """A context in which tensors are fake and a training step allocates nothing, dispatched as on ``target``.

    Inside it, every tensor created is a ``FakeTensor`` on the CPU device. `module`, `copy_module` and `tensors`
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

    def __init__(self, target: str = "cpu") -> None:
        if target not in TARGETS:
            raise ValueError(f"`target` must be one of {', '.join(TARGETS)}, got {target!r}.")
        self.target = target
        self.device = torch.device("cpu")
        self.block_bytes = CUDA_BLOCK_BYTES if target == "cuda" else 1
        # One mode for the object's life: it can be entered again (tensors of two fake modes must not meet).
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        self._stacks: list[contextlib.ExitStack] = []

    def __enter__(self) -> FakeTarget:
        stack = contextlib.ExitStack()
        stack.enter_context(self.mode)
        if self.target == "cuda":
            stack.enter_context(_CudaAttention())
        self._stacks.append(stack)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stacks.pop().close()

    # ---- real -> fake -------------------------------------------------------------------------------------------

    def fake(self, tensor: torch.Tensor, shared: dict[int, Any] | None = None) -> torch.Tensor:
        """A fake tensor like ``tensor`` on the fake device (a fake one is returned as is).

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

    def copy_module(self, module: nn.Module) -> nn.Module:
        """A deep copy of ``module`` whose tensors are fake: the real weights are never copied.

        Raises:
            Exception: whatever ``copy.deepcopy`` raises for an attribute that cannot be copied.
        """
        memo: dict[int, Any] = {}
        shared: dict[int, Any] = {}
        for sub in module.modules():
            for param in sub._parameters.values():
                if param is not None and id(param) not in memo:
                    fake = self.fake(param.detach(), shared)
                    memo[id(param)] = nn.Parameter(fake, requires_grad=param.requires_grad)
            for value in [*sub._buffers.values(), *vars(sub).values()]:
                if isinstance(value, torch.Tensor) and id(value) not in memo:
                    memo[id(value)] = self.fake(value.detach(), shared)
        return copy.deepcopy(module, memo)

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


class _CudaAttention(TorchFunctionMode):
    """Route ``F.scaled_dot_product_attention`` to the kernel CUDA would choose, on fake CPU tensors."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return _cuda_attention(*args, **kwargs)
        return func(*args, **kwargs)


def _cuda_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    kernel = cuda_attention_kernel(query, key, value, attn_mask)
    if kernel == "flash":
        return torch.ops.aten._scaled_dot_product_flash_attention(
            query, key, value, dropout_p, is_causal, False, scale=scale
        )[0]
    if kernel == "efficient":
        if attn_mask is not None and attn_mask.dtype == torch.bool:  # as SDPA does: a boolean mask becomes a bias
            attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill_(~attn_mask, float("-inf"))
        log_sumexp = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, attn_mask, log_sumexp, dropout_p, is_causal, scale=scale
        )[0]
    return torch.ops.aten._scaled_dot_product_attention_math(
        query, key, value, attn_mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa
    )[0]


def cuda_attention_kernel(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None
) -> Literal["flash", "efficient", "math"]:
    """The SDPA kernel CUDA picks on an Ampere or newer GPU: flash, then memory-efficient, then math.

    A simplification of ``select_sdp_backend`` in ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``: both
    fused kernels need 4-D inputs with the same number of heads and the same head size in query and key; flash
    attention needs fp16/bf16, no mask and a head size up to 256; memory-efficient attention takes fp32 too, and a
    mask, with the head size aligned to 8 (16-bit) or 4 (fp32) elements.

    Examples:
        >>> q = torch.empty(1, 8, 16, 64, dtype=torch.bfloat16)
        >>> cuda_attention_kernel(q, q, q, None), cuda_attention_kernel(q.float(), q.float(), q.float(), None)
        ('flash', 'efficient')
    """
    same_shape = query.dim() == key.dim() == value.dim() == 4 and query.size(1) == key.size(1) == value.size(1)
    head = query.size(-1)
    if not same_shape or key.size(-1) != head:
        return "math"
    if query.dtype in (torch.float16, torch.bfloat16) and attn_mask is None and head <= 256 and value.size(-1) == head:
        return "flash"
    alignment = 4 if query.dtype == torch.float32 else 8
    if query.dtype in (torch.float16, torch.bfloat16, torch.float32) and head % alignment == 0:
        return "efficient"
    return "math"
