"""Combining ``self.log`` calls of a split step: a micro-batch without items contributes nothing, and nothing of an
earlier micro-batch is kept alive until the step ends."""

from __future__ import annotations

import gc
import math
import weakref

import lightning.pytorch as pl
import pytest
import torch

from lightning_accum.split.step_logs import StepLogCombiner


def combined(values_and_items: list[tuple[float, int]], reduce_fx: str, weights_as_tensors: bool = True) -> float:
    module = pl.LightningModule()
    logged: dict[str, float] = {}
    module.log = lambda name, value, **kw: logged.update({name: float(value)})
    combiner = StepLogCombiner(module)
    for value, items in values_and_items:
        with combiner.capture(weight=torch.tensor(items) if weights_as_tensors else items):
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


@pytest.mark.parametrize("reduce_fx", ["mean", "sum", "max", "min"])
def test_counts_on_the_host_are_moved_to_the_values_device_once_not_once_per_micro_batch(monkeypatch, reduce_fx):
    # Samples, the default count, are Python ints: each went to the values' device on its own (on CUDA a blocking
    # copy per micro-batch and logged name); now the step's counts go in one.
    steps = [(1.0, 3), (math.nan, 0), (4.0, 1), (2.5, 2)]
    from_tensors = combined(steps, reduce_fx)
    converted = []
    real_as_tensor = torch.as_tensor
    monkeypatch.setattr(torch, "as_tensor", lambda *a, **kw: converted.append(a) or real_as_tensor(*a, **kw))
    assert combined(steps, reduce_fx, weights_as_tensors=False) == from_tensors
    assert converted == []  # was one per micro-batch: 4


def test_a_finite_value_without_items_still_counts_where_items_do_not_weight_it():
    # Only a mean weights by items; a sum of something else (e.g. samples seen) keeps the item-less micro-batch.
    assert combined([(1.0, 3), (2.0, 0)], "sum") == pytest.approx(3.0)
    assert combined([(1.0, 3), (2.0, 0)], "mean") == pytest.approx(1.0)


def test_a_step_without_any_item_logs_nan_as_the_unsplit_batch_would():
    assert math.isnan(combined([(math.nan, 0), (math.nan, 0)], "mean"))
    assert math.isnan(combined([(math.nan, 0), (math.nan, 0)], "max"))


# ----------------------------------------------------------------------------------------------------------------
# memory: nothing of an earlier micro-batch stays alive until the step ends (issue 18, item 8)
# ----------------------------------------------------------------------------------------------------------------
def test_a_logged_value_does_not_keep_its_graph_alive():
    # `self.log("train/loss", loss)` without `.detach()`: Lightning detaches what it logs. A graph that is never
    # back-propagated (here, one that saves its input) keeps what it saved for as long as the value lives.
    module = pl.LightningModule()
    module.log = lambda name, value, **kw: None
    combiner = StepLogCombiner(module)
    saved: list[weakref.ref] = []
    for i in range(4):
        with combiner.capture(weight=1):
            hidden = torch.full((1024,), float(i), requires_grad=True) * 2.0
            saved.append(weakref.ref(hidden))
            module.log("aux", hidden.pow(2).mean())  # `pow` saves `hidden` for its backward
            del hidden
        gc.collect()
        assert [ref() is None for ref in saved] == [True] * (i + 1), f"micro-batch {i}: graphs kept alive"
    combiner.replay(batch_size=4)


def test_no_value_of_an_earlier_micro_batch_is_kept():
    # Even detached, one small tensor per micro-batch kept until the step ends fragments the CPU heap: a step of 1024
    # micro-batches grew the resident set by hundreds of MiB. The combiner reduces as the values come.
    module = pl.LightningModule()
    logged: dict[str, float] = {}
    module.log = lambda name, value, **kw: logged.update({name: float(value)})
    combiner = StepLogCombiner(module)
    values: list[weakref.ref] = []
    for i in range(5):
        with combiner.capture(weight=torch.tensor(i + 1)):
            value = torch.tensor(float(i))
            values.append(weakref.ref(value))
            module.log("loss", value)
            module.log("most", value, reduce_fx="max")
            del value
        gc.collect()
        assert sum(ref() is not None for ref in values[:-1]) == 0, f"micro-batch {i}: earlier values kept"
    combiner.replay(batch_size=15)
    assert logged == pytest.approx({"loss": sum(i * (i + 1) for i in range(5)) / 15, "most": 4.0})


def test_enable_graph_keeps_the_graph_as_lightning_does():
    module = pl.LightningModule()
    logged: dict[str, torch.Tensor] = {}
    module.log = lambda name, value, **kw: logged.update({name: value})
    combiner = StepLogCombiner(module)
    x = torch.ones(2, requires_grad=True)
    with combiner.capture(weight=1):
        module.log("kept", x.sum(), enable_graph=True)
        module.log("detached", x.sum())
    combiner.replay(batch_size=2)
    assert logged["kept"].requires_grad and not logged["detached"].requires_grad


def test_a_value_that_cannot_be_reduced_is_the_last_one():
    # A torchmetrics Metric (or anything not a number) is logged as the last micro-batch's, as before.
    module = pl.LightningModule()
    logged: dict[str, object] = {}
    module.log = lambda name, value, **kw: logged.update({name: value})
    combiner = StepLogCombiner(module)
    metrics = [object(), object()]
    for metric in metrics:
        with combiner.capture(weight=1):
            module.log("metric", metric)
    combiner.replay(batch_size=2)
    assert logged["metric"] is metrics[-1]


@pytest.mark.parametrize("detach", [False, True])
def test_split_mode_keeps_no_graph_of_an_earlier_micro_batch(tmp_path, detach):
    # The real idiom under AutoMicroBatching: `self.log` of a loss with its graph, in every micro-batch.
    from torch.utils.data import DataLoader

    from lightning_accum import AutoMicroBatching
    from tests.helpers import IndexedDataset, RegressionModel, make_trainer

    class LogsWithGraphs(RegressionModel):
        def __init__(self) -> None:
            super().__init__()
            self.split_mode = True
            self.hidden: list[weakref.ref] = []
            self.alive_earlier: list[int] = []

        def training_step(self, batch, batch_idx):
            gc.collect()
            self.alive_earlier.append(sum(ref() is not None for ref in self.hidden))
            hidden = self.layer(batch["x"])
            self.hidden.append(weakref.ref(hidden))
            loss = torch.nn.functional.mse_loss(hidden, batch["y"])
            aux = hidden.pow(2).mean()  # logged, never back-propagated: its graph holds `hidden`
            self.log("train/loss", loss.detach() if detach else loss)
            self.log("train/aux", aux.detach() if detach else aux)
            return loss

    model = LogsWithGraphs()
    trainer = make_trainer(tmp_path, [AutoMicroBatching(2, max_memory=0.9)])
    trainer.fit(model, DataLoader(IndexedDataset(16), batch_size=16))  # one step of 8 micro-batches
    assert model.alive_earlier == [0] * 8
