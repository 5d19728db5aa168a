"""``StepPrecision``: Lightning's precision settings as module, input and forward conversions."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_accum.memory.precision import StepPrecision


@pytest.mark.parametrize(
    ("given", "name", "weights", "inputs", "forward"),
    [
        ("32-true", "32-true", torch.float32, torch.float32, torch.float32),
        (32, "32-true", torch.float32, torch.float32, torch.float32),
        ("bf16-true", "bf16-true", torch.bfloat16, torch.bfloat16, torch.bfloat16),
        ("bf16-mixed", "bf16-mixed", torch.float32, torch.float32, torch.bfloat16),
        ("bf16", "bf16-mixed", torch.float32, torch.float32, torch.bfloat16),
        ("64-true", "64-true", torch.float64, torch.float64, torch.float64),
    ],
)
def test_precision_converts_as_lightning_does(given, name, weights, inputs, forward):
    precision = StepPrecision(given)
    model = precision.convert_module(nn.Linear(4, 4))
    x = precision.convert_input({"x": torch.ones(2, 4), "ids": torch.ones(2, dtype=torch.long)})
    with precision.forward_context("cpu"):
        out = model(x["x"])
    assert (precision.name, model.weight.dtype, x["x"].dtype, x["ids"].dtype, out.dtype) == (
        name,
        weights,
        inputs,
        torch.long,
        forward,
    )


def test_unknown_precision_is_named():
    with pytest.raises(ValueError, match=r"`precision` must be one of 64-true, 32-true.*got 'fp8'"):
        StepPrecision("fp8")
