"""Combining ``self.log`` calls of a split step: a micro-batch without items contributes nothing."""

from __future__ import annotations

import math

import lightning.pytorch as pl
import pytest
import torch

from lightning_accum.step_logs import StepLogCombiner


def combined(values_and_items: list[tuple[float, int]], reduce_fx: str) -> float:
    module = pl.LightningModule()
    logged: dict[str, float] = {}
    module.log = lambda name, value, **kw: logged.update({name: float(value)})
    combiner = StepLogCombiner(module)
    for value, items in values_and_items:
        with combiner.capture(weight=torch.tensor(items)):
            module.log("loss", torch.tensor(value), reduce_fx=reduce_fx)
    combiner.replay(batch_size=12)
    return logged["loss"]


@pytest.mark.parametrize(
    ("reduce_fx", "expected"),
    [("mean", (1.0 * 3 + 4.0 * 1) / 4), ("sum", 1.0 + 4.0), ("max", 4.0), ("min", 1.0)],
)
def test_a_micro_batch_without_items_is_left_out(reduce_fx: str, expected: float):
    # The middle micro-batch has no loss-bearing items: its mean over none is 0/0 = NaN.
    assert combined([(1.0, 3), (math.nan, 0), (4.0, 1)], reduce_fx) == pytest.approx(expected)


def test_a_finite_value_without_items_still_counts_where_items_do_not_weight_it():
    # Only a mean weights by items; a sum of something else (e.g. samples seen) keeps the item-less micro-batch.
    assert combined([(1.0, 3), (2.0, 0)], "sum") == pytest.approx(3.0)
    assert combined([(1.0, 3), (2.0, 0)], "mean") == pytest.approx(1.0)


def test_a_step_without_any_item_logs_nan_as_the_unsplit_batch_would():
    assert math.isnan(combined([(math.nan, 0), (math.nan, 0)], "mean"))
    assert math.isnan(combined([(math.nan, 0), (math.nan, 0)], "max"))
