"""Batches users really have, end to end: each step's gradient equals the full-batch reference.

Window mode (`AccumulationScheduler`) reads every micro-batch's sample count with `batch_size_of` and its item count
with `count_items`; split mode (`AutoMicroBatching`) also cuts the step batch with `split_batch`. These tests feed
those functions batches that broke them: a 0-dim tensor placed first, a float loss mask, a custom batch object, and
per-sample detection batches.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset
from torch.utils.data._utils.collate import default_collate

import tests.helpers as h
from lightning_accum import AccumulationScheduler, AutoMicroBatching

# ---- a 0-dim tensor first in a dict batch (window mode) -------------------------------------------------------------


def _with_shared_scalar_first(samples: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    # A value shared by the whole micro-batch, placed before the per-sample tensors (dicts keep insertion order).
    return {"temperature": torch.tensor(0.5), **default_collate(samples)}


def test_a_0_dim_tensor_first_in_the_batch_does_not_set_the_batch_size(tmp_path):
    # 10 samples in micro-batches of 4, 4 and 2, one window of k=3: reading each micro-batch as 1 sample would
    # weight the 2-sample micro-batch like the others (a mean of means) and count 3 consumed samples.
    dataset = h.IndexedDataset(10)
    model = h.RegressionModel()
    initial = copy.deepcopy(model)
    scheduler = AccumulationScheduler(3)
    loader = DataLoader(dataset, batch_size=4, collate_fn=_with_shared_scalar_first)
    h.make_trainer(tmp_path, [scheduler]).fit(model, loader)

    assert model.step_indices == [list(range(10))]
    assert scheduler.consumed_samples == 10
    assert scheduler.last_step_report.effective_batch_size == 10
    expected = h.replay_reference(initial, dataset, model.step_indices, h.mse_loss, lr=0.1)
    h.assert_grads_close(model.step_grads, expected, **h.FP32)


# ---- float item counts (window mode) --------------------------------------------------------------------------------


def _float_weights(dataset: h.TokenDataset, kind: str) -> h.TokenDataset:
    if kind == "megatron-mask":
        dataset.mask = dataset.mask.float()  # Megatron's loss mask: 0.0 / 1.0
    else:
        g = torch.Generator().manual_seed(1)
        dataset.mask = dataset.mask.float() * torch.empty(dataset.mask.shape).uniform_(0.25, 2.0, generator=g)
    return dataset


@pytest.mark.parametrize("mode", ["window", "split"])
@pytest.mark.parametrize("kind", ["megatron-mask", "sample-weights"])
def test_float_item_counts_give_the_exact_weighted_mean(tmp_path, kind, mode):
    # `count_items` returns `mask.sum()` over a float mask; the loss is sum(w * l) / sum(w) per micro-batch, and the
    # window's gradient must be that of sum(w * l) / sum(w) over the whole window, not a mean of the ratios.
    dataset = _float_weights(h.TokenDataset(30), kind)
    model = h.TokenModel(lr=0.05)
    initial = copy.deepcopy(model)
    if mode == "window":  # 8 micro-batches of 4: windows of 3, 3, 2
        scheduler = AccumulationScheduler(3, count_items=h.count_tokens)
        loader = DataLoader(dataset, batch_size=4)
    else:  # step batches of 12, 12, 6 in micro-batches of 4: 3, 3, 2
        model.split_mode = True
        scheduler = AutoMicroBatching(4, count_items=h.count_tokens)
        loader = DataLoader(dataset, batch_size=12)
    h.make_trainer(tmp_path, [scheduler]).fit(model, loader)

    assert [len(indices) for indices in model.step_indices] == [12, 12, 6]
    if mode == "split":  # the last step batch of 6 is cut into balanced halves
        assert scheduler.last_step_report.accumulation_steps == 2 and scheduler.last_step_report.micro_batch_size == 3
    expected = h.replay_reference(initial, dataset, model.step_indices, h.token_loss, lr=0.05)
    h.assert_grads_close(model.step_grads, expected, **h.FP32)
    last_window = dataset.mask[model.step_indices[-1]]
    assert scheduler.last_step_report.items == pytest.approx(float(last_window.double().sum()), rel=1e-6)


def test_float_item_counts_are_not_a_mean_of_means(tmp_path):
    # Guard that the float test can fail: weighting each micro-batch by its sample count gives another gradient.
    dataset = _float_weights(h.TokenDataset(30), "sample-weights")
    model = h.TokenModel(lr=0.05)
    initial = copy.deepcopy(model)
    h.make_trainer(tmp_path, [AccumulationScheduler(3)]).fit(model, DataLoader(dataset, batch_size=4))
    expected = h.replay_reference(initial, dataset, model.step_indices, h.token_loss, lr=0.05)
    with pytest.raises(AssertionError):
        h.assert_grads_close(model.step_grads, expected, **h.FP32)


# ---- custom batch objects (window mode) -----------------------------------------------------------------------------


class RegressionBatch:
    """A custom batch object, as some codebases use: attributes, no mapping or sequence interface."""

    def __init__(self, x: Tensor, y: Tensor, index: Tensor) -> None:
        self.x, self.y, self.index = x, y, index

    @property
    def batch_size(self) -> int:
        return len(self.x)


class SizedRegressionBatch(RegressionBatch):
    batch_size = None  # type: ignore[assignment]  # no `batch_size`: the count comes from `len`

    def __len__(self) -> int:
        return len(self.x)


def _collate_into(cls: type[RegressionBatch]):
    def collate(samples: list[dict[str, Tensor]]) -> RegressionBatch:
        batch = default_collate(samples)
        return cls(batch["x"], batch["y"], batch["index"])

    return collate


class AttributeRegressionModel(h.RegressionModel):
    def training_step(self, batch: RegressionBatch, batch_idx: int) -> Tensor:
        self._window_indices.extend(batch.index.tolist())
        return nn.functional.mse_loss(self.layer(batch.x), batch.y)


@pytest.mark.parametrize("batch_cls", [RegressionBatch, SizedRegressionBatch], ids=["batch_size", "len"])
@pytest.mark.parametrize("count_items", [None, lambda b: b.x.shape[0]], ids=["samples", "count_items"])
def test_custom_batch_objects_count_their_samples(tmp_path, batch_cls, count_items):
    dataset = h.IndexedDataset(10)
    model = AttributeRegressionModel()
    initial = copy.deepcopy(model)
    scheduler = AccumulationScheduler(3, count_items=count_items)
    loader = DataLoader(dataset, batch_size=4, collate_fn=_collate_into(batch_cls))
    h.make_trainer(tmp_path, [scheduler]).fit(model, loader)

    assert scheduler.consumed_samples == 10
    expected = h.replay_reference(initial, dataset, model.step_indices, h.mse_loss, lr=0.1)
    h.assert_grads_close(model.step_grads, expected, **h.FP32)


class OpaqueBatch:
    def __init__(self, x: Tensor, y: Tensor) -> None:
        self.x, self.y = x, y


def test_a_custom_batch_without_a_sample_count_names_the_hooks(tmp_path):
    def collate(samples):
        batch = default_collate(samples)
        return OpaqueBatch(batch["x"], batch["y"])

    class Model(h.RegressionModel):
        def training_step(self, batch, batch_idx):
            return nn.functional.mse_loss(self.layer(batch.x), batch.y)

    scheduler = AccumulationScheduler(2, count_items=lambda b: b.x.shape[0])
    trainer = h.make_trainer(tmp_path, [scheduler])
    with pytest.raises(TypeError, match=r"OpaqueBatch.*`batch_size` attribute.*`__len__`.*`batch_size_of=`") as info:
        trainer.fit(Model(), DataLoader(h.IndexedDataset(8), batch_size=4, collate_fn=collate))
    assert "pass `count_items`" not in str(info.value).lower()


# ---- per-sample detection batches (split mode) ----------------------------------------------------------------------

IMAGE = (3, 4, 4)


class DetectionDataset(Dataset):
    """torchvision-style detection samples: an image and a dict of boxes and labels, 1 to 4 boxes per image."""

    def __init__(self, n: int = 10, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.samples = []
        for i in range(n):
            n_boxes = 1 + i % 4
            target = {"boxes": torch.rand(n_boxes, 4, generator=g), "labels": torch.arange(n_boxes)}
            self.samples.append((torch.randn(*IMAGE, generator=g), target))

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[Tensor, dict[str, Tensor]]:
        return self.samples[i]


def detection_loss(model: nn.Module, images: Any, targets: Any) -> Tensor:
    """Mean over images of each image's mean squared box error: a per-sample loss, averaged over samples."""
    losses = []
    for image, target in zip(images, targets, strict=True):
        predicted = model.layer(image.flatten())
        losses.append(((predicted - target["boxes"]) ** 2).mean())
    return torch.stack(losses).mean()


class DetectionModel(h.RegressionModel):
    def __init__(self, form: str) -> None:
        super().__init__(dim=3 * 4 * 4)
        self.layer = nn.Linear(3 * 4 * 4, 4)
        self.form = form
        self.split_mode = True
        self.micro_batch_sizes: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        images, targets = zip(*batch, strict=True) if self.form == "samples" else batch
        self.micro_batch_sizes.append(len(images))
        return detection_loss(self, images, targets)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        pass


def _collate(form: str):
    if form == "samples":
        return list  # a list of (image, target) samples
    return lambda samples: tuple(zip(*samples, strict=True))  # torchvision's detection collate: (images, targets)


@pytest.mark.parametrize("form", ["samples", "zip"])
def test_detection_batches_are_split_into_exact_micro_batches(tmp_path, form):
    dataset = DetectionDataset(10)
    model = DetectionModel(form)
    initial = copy.deepcopy(model)
    callback = AutoMicroBatching(2)
    loader = DataLoader(dataset, batch_size=5, collate_fn=_collate(form))
    h.make_trainer(tmp_path, [callback]).fit(model, loader)

    assert model.micro_batch_sizes == [2, 2, 1, 2, 2, 1]  # two steps of 5 images
    assert callback.last_step_report.effective_batch_size == 5
    expected = []
    reference = copy.deepcopy(initial)
    for step in range(2):
        images, targets = zip(*[dataset[i] for i in range(5 * step, 5 * step + 5)], strict=True)
        reference.zero_grad(set_to_none=True)
        detection_loss(reference, images, targets).backward()
        grads = {n: p.grad.detach().clone() for n, p in reference.named_parameters()}
        expected.append(grads)
        with torch.no_grad():
            for name, p in reference.named_parameters():
                p -= 0.1 * grads[name]
    h.assert_grads_close(model.step_grads, expected, **h.FP32)


# ---- the user's own hooks, wired into the callbacks ------------------------------------------------------------------


class PairBatch:
    """A batch the built-in rules can't read: samples live in a private list of (x, y) pairs."""

    def __init__(self, pairs: list[tuple[Tensor, Tensor]]) -> None:
        self._pairs = pairs

    def stacked(self) -> tuple[Tensor, Tensor]:
        xs, ys = zip(*self._pairs, strict=True)
        return torch.stack(xs), torch.stack(ys)


def split_pairs(batch: PairBatch, micro_batch_size: int) -> list[PairBatch]:
    pairs = batch._pairs
    return [PairBatch(pairs[i : i + micro_batch_size]) for i in range(0, len(pairs), micro_batch_size)]


def count_pairs(batch: PairBatch) -> int:
    return len(batch._pairs)


def collate_pairs(samples: list[dict[str, Tensor]]) -> PairBatch:
    return PairBatch([(s["x"], s["y"]) for s in samples])


class PairModel(h.RegressionModel):
    def __init__(self) -> None:
        super().__init__()
        self.split_mode = True
        self.micro_batch_sizes: list[int] = []

    def training_step(self, batch: PairBatch, batch_idx: int) -> Tensor:
        x, y = batch.stacked()
        self.micro_batch_sizes.append(len(x))
        return nn.functional.mse_loss(self.layer(x), y)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        pass


class PairModelWithHooks(PairModel):
    def split_batch(self, batch: PairBatch, micro_batch_size: int) -> list[PairBatch]:
        return split_pairs(batch, micro_batch_size)

    def batch_size_of(self, batch: PairBatch) -> int:
        return count_pairs(batch)


def _pair_reference(initial: nn.Module, dataset: h.IndexedDataset, step_batch: int, steps: int) -> list[dict]:
    reference, expected = copy.deepcopy(initial), []
    for step in range(steps):
        rows = slice(step * step_batch, (step + 1) * step_batch)
        reference.zero_grad(set_to_none=True)
        nn.functional.mse_loss(reference.layer(dataset.x[rows]), dataset.y[rows]).backward()
        grads = {n: p.grad.detach().clone() for n, p in reference.named_parameters()}
        expected.append(grads)
        with torch.no_grad():
            for name, p in reference.named_parameters():
                p -= 0.1 * grads[name]
    return expected


@pytest.mark.parametrize("where", ["arguments", "import-paths", "module-methods"])
def test_split_mode_uses_the_users_hooks(tmp_path, where):
    dataset = h.IndexedDataset(12)
    if where == "module-methods":
        model, callback = PairModelWithHooks(), AutoMicroBatching(4)
    elif where == "arguments":
        model, callback = PairModel(), AutoMicroBatching(4, split_batch=split_pairs, batch_size_of=count_pairs)
    else:
        paths = {name: f"tests.test_batch_inputs:{name}" for name in ("split_pairs", "count_pairs")}
        model = PairModel()
        callback = AutoMicroBatching(4, split_batch=paths["split_pairs"], batch_size_of=paths["count_pairs"])
    initial = copy.deepcopy(model)
    h.make_trainer(tmp_path, [callback]).fit(model, DataLoader(dataset, batch_size=6, collate_fn=collate_pairs))

    assert model.micro_batch_sizes == [3, 3, 3, 3]  # two step batches of 6, cut by the hook into 2 balanced halves
    assert callback.last_step_report.effective_batch_size == 6
    h.assert_grads_close(model.step_grads, _pair_reference(initial, dataset, 6, 2), **h.FP32)
    settings = callback.settings()
    expected_source = "PairModelWithHooks." if where == "module-methods" else "argument"
    assert expected_source in settings["split_batch"] and expected_source in settings["batch_size_of"]


def test_without_hooks_the_opaque_batch_is_a_clear_error(tmp_path):
    trainer = h.make_trainer(tmp_path, [AutoMicroBatching(4)])
    loader = DataLoader(h.IndexedDataset(12), batch_size=6, collate_fn=collate_pairs)
    with pytest.raises(TypeError, match=r"PairBatch.*pass `batch_size_of=`"):
        trainer.fit(PairModel(), loader)


def test_window_mode_counts_samples_with_the_modules_batch_size_of(tmp_path):
    class Model(PairModelWithHooks):
        def __init__(self) -> None:
            super().__init__()
            self.split_mode = False

    scheduler = AccumulationScheduler(2)
    model = Model()
    h.make_trainer(tmp_path, [scheduler]).fit(
        model, DataLoader(h.IndexedDataset(12), batch_size=3, collate_fn=collate_pairs)
    )
    assert scheduler.consumed_samples == 12
    assert scheduler.last_step_report.effective_batch_size == 6
