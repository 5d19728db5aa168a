"""``StepPrecision``: what a Lightning ``precision`` setting does to a training step's tensors, without a Trainer.

Memory tools that drive ``training_step`` themselves (the probe, the pre-flight trace) must allocate what Lightning's
precision plugin would: ``"bf16-true"`` converts the module and the floating inputs to bfloat16 (``HalfPrecision``),
``"bf16-mixed"`` keeps float32 weights and runs the forward pass under ``torch.autocast`` (``MixedPrecision``). The
gradient scaler of ``"16-mixed"`` is left out: it adds a few scalars, not memory that matters.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Literal, cast

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn

PrecisionName = Literal["64-true", "32-true", "16-true", "bf16-true", "16-mixed", "bf16-mixed"]
PRECISIONS: tuple[str, ...] = ("64-true", "32-true", "16-true", "bf16-true", "16-mixed", "bf16-mixed")
# Lightning's short forms (``Trainer(precision=16)`` is "16-mixed").
_ALIASES = {"64": "64-true", "32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed", "half": "16-true"}
_DTYPES = {"64": torch.float64, "32": torch.float32, "16": torch.float16, "bf16": torch.bfloat16}


class StepPrecision:
    """A Lightning precision setting as three operations: convert the module, convert the inputs, run the forward.

    Args:
        precision: one of ``"64-true"``, ``"32-true"``, ``"16-true"``, ``"bf16-true"``, ``"16-mixed"``,
            ``"bf16-mixed"``, or Lightning's short forms (``32``, ``16``, ``"bf16"``, ``64``).

    Raises:
        ValueError: if ``precision`` is none of these.

    Examples:
        >>> p = StepPrecision("bf16-true")
        >>> model = p.convert_module(nn.Linear(4, 4))
        >>> model.weight.dtype, p.convert_input(torch.ones(2, 4)).dtype, p.convert_input(torch.ones(2).long()).dtype
        (torch.bfloat16, torch.bfloat16, torch.int64)
        >>> with StepPrecision("bf16-mixed").forward_context("cpu"):
        ...     nn.Linear(4, 4)(torch.ones(2, 4)).dtype
        torch.bfloat16
    """

    def __init__(self, precision: PrecisionName | str | int = "32-true") -> None:
        name = _ALIASES.get(str(precision), str(precision))
        if name not in PRECISIONS:
            raise ValueError(
                f"`precision` must be one of {', '.join(PRECISIONS)} (as for `Trainer(precision=...)`), got "
                f"{precision!r}."
            )
        self.name = name
        bits, _, kind = name.partition("-")
        self.dtype = _DTYPES[bits]
        self.mixed = kind == "mixed"

    @property
    def parameter_dtype(self) -> torch.dtype:
        """The dtype of the trained weights: the precision's own for ``*-true``, float32 for ``*-mixed``."""
        return torch.float32 if self.mixed else self.dtype

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Cast floating parameters and buffers to the parameter dtype, in place, keeping tied parameters tied.

        Unlike ``Module.to(dtype)`` this also works on fake tensors (see `replace_tensors`).
        """
        if self.parameter_dtype == torch.float32:
            return module
        dtype = self.parameter_dtype
        return replace_tensors(module, lambda t: t.to(dtype) if t.is_floating_point() else t)

    def convert_input(self, batch: Any) -> Any:
        """Cast the floating tensors of ``batch`` to the precision's dtype (``*-true`` only), as Lightning does."""
        if self.mixed or self.dtype == torch.float32:
            return batch
        return apply_to_collection(batch, torch.Tensor, lambda t: t.to(self.dtype) if t.is_floating_point() else t)

    @contextlib.contextmanager
    def forward_context(self, device_type: str) -> Iterator[None]:
        """``torch.autocast(device_type, dtype)`` for ``*-mixed``; nothing for ``*-true``."""
        if not self.mixed:
            yield
            return
        with torch.autocast(device_type, dtype=self.dtype):
            yield

    def __repr__(self) -> str:
        return f"StepPrecision({self.name!r})"


def replace_tensors(module: nn.Module, convert: Callable[[torch.Tensor], torch.Tensor]) -> nn.Module:
    """Replace every parameter and buffer of ``module`` with ``convert(tensor)``, in place; return ``module``.

    A tensor that several modules share (tied weights) is converted once and stays shared. ``Module.to`` does not
    keep ties when the new tensor cannot share the old one's storage type (``.to("meta")`` unties them), and cannot
    swap fake tensors at all; this works for both.
    """
    done: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(old) -> (old, new); holding `old` keeps its id unique
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is not None and id(param) not in done:
                with torch.no_grad():  # the new parameter is a leaf, as the old one was
                    new = convert(param)
                done[id(param)] = (param, nn.Parameter(new, requires_grad=param.requires_grad))
            if param is not None:  # a parameter's entry holds the new Parameter
                sub._parameters[name] = cast(nn.Parameter, done[id(param)][1])
        for name, buffer in list(sub._buffers.items()):
            if buffer is not None and id(buffer) not in done:
                with torch.no_grad():
                    done[id(buffer)] = (buffer, convert(buffer))
            if buffer is not None:
                sub._buffers[name] = done[id(buffer)][1]
    return module
