"""The byte-level LM example: its data, its model, and exact token-normalized accumulation on it."""

from __future__ import annotations

import copy
import itertools
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from examples.char_lm.data import IGNORE_INDEX, PAD_ID, CharLMDataModule, collate_padded
from examples.char_lm.model import CharLM
from lightning_accum import AccumulationScheduler
from lightning_accum.items import CountTokens
from tests.helpers import make_trainer

TINY_MODEL: dict[str, Any] = {"max_length": 48, "d_model": 32, "n_layers": 1, "n_heads": 2}


def tiny_data(**kwargs: Any) -> CharLMDataModule:
    settings: dict[str, Any] = {"batch_size": 8, "min_length": 8, "max_length": 48, "max_sequences": 400}
    settings.update(kwargs)
    dm = CharLMDataModule(**settings)
    dm.setup("fit")
    return dm


def tiny_trainer(tmp_path: Any, callbacks: list[pl.Callback], **kwargs: Any) -> pl.Trainer:
    return make_trainer(tmp_path, callbacks, limit_val_batches=0, **kwargs)


class _GradRecorder(pl.Callback):
    """Copies the gradient each optimizer step sees (after AccumulationScheduler, which runs first, rescaled it)."""

    def __init__(self) -> None:
        self.grads: list[dict[str, Tensor]] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.grads.append({n: p.grad.detach().clone() for n, p in pl_module.named_parameters() if p.grad is not None})


class _RecordingCharLM(CharLM):
    """Keeps a copy of every training batch, so a reference can be computed on exactly what the Trainer fed."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.seen: list[dict[str, Tensor]] = []

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        self.seen.append({k: v.clone() for k, v in batch.items()})
        return super().training_step(batch, batch_idx)


# ---------------------------------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------------------------------
def test_collate_shifts_labels_and_masks_padding() -> None:
    batch = collate_padded(
        [torch.tensor([10, 11, 12, 13], dtype=torch.uint8), torch.tensor([20, 21], dtype=torch.uint8)]
    )
    assert batch["input_ids"].tolist() == [[10, 11, 12], [20, PAD_ID, PAD_ID]]
    assert batch["labels"].tolist() == [[11, 12, 13], [21, IGNORE_INDEX, IGNORE_INDEX]]
    assert batch["input_ids"].dtype == batch["labels"].dtype == torch.long


def test_batches_are_padded_with_varying_token_counts() -> None:
    dm = tiny_data()
    batches = list(itertools.islice(dm.train_dataloader(), 10))
    tokens = [int((b["labels"] != IGNORE_INDEX).sum()) for b in batches]
    for batch in batches:
        labels, inputs = batch["labels"], batch["input_ids"]
        assert labels.shape == inputs.shape and labels.shape[0] == 8 and labels.shape[1] <= 48
        # Padding is exactly where the labels are ignored, and there is padding to ignore.
        torch.testing.assert_close(inputs == PAD_ID, labels == IGNORE_INDEX)
        assert bool((labels[:, 0] != IGNORE_INDEX).all()), "every sequence holds at least one loss-bearing byte"
    assert any((b["labels"] == IGNORE_INDEX).any() for b in batches)
    assert len(set(tokens)) > 1, f"micro-batches should hold different numbers of tokens, got {tokens}"
    lengths = [len(s) - 1 for s in dm.train_set.sequences]  # type: ignore[union-attr]
    assert min(lengths) >= 8 and max(lengths) <= 48 and len(set(lengths)) > 10


def test_split_is_seeded() -> None:
    def train_bytes(dm: CharLMDataModule) -> list[list[int]]:
        return [s.tolist() for s in dm.train_set.sequences]  # type: ignore[union-attr]

    first, again, other = tiny_data(seed=1), tiny_data(seed=1), tiny_data(seed=2)
    assert len(first.val_set) == int(400 * 0.05)  # type: ignore[arg-type]
    assert train_bytes(first) == train_bytes(again)
    assert train_bytes(first) != train_bytes(other)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"batch_size": 0}, "`batch_size` must be >= 1, got 0"),
        ({"min_length": 64, "max_length": 32}, r"`min_length` \(64\) must be <= `max_length` \(32\)"),
        ({"val_fraction": 1.0}, r"`val_fraction` must be in \[0, 1\), got 1.0"),
    ],
)
def test_datamodule_rejects_bad_settings(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        CharLMDataModule(**kwargs)


# ---------------------------------------------------------------------------------------------------------------
# model
# ---------------------------------------------------------------------------------------------------------------
def test_model_is_causal() -> None:
    torch.manual_seed(0)
    model = CharLM(**TINY_MODEL).eval()
    x = torch.randint(0, 256, (2, 12))
    changed = x.clone()
    changed[:, 7:] = (changed[:, 7:] + 1) % 256
    with torch.no_grad():
        logits, logits_changed = model(x), model(changed)
    assert logits.shape == (2, 12, 257)
    torch.testing.assert_close(logits[:, :7], logits_changed[:, :7])
    assert not torch.allclose(logits[:, 7:], logits_changed[:, 7:])


def test_model_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match=r"`n_heads` \(3\) must divide `d_model` \(32\)"):
        CharLM(d_model=32, n_heads=3)
    with pytest.raises(ValueError, match="longer than `max_length=48`"):
        CharLM(**TINY_MODEL)(torch.zeros(1, 49, dtype=torch.long))


# ---------------------------------------------------------------------------------------------------------------
# training with lightning_accum
# ---------------------------------------------------------------------------------------------------------------
def test_window_gradient_is_the_token_mean_over_the_window(tmp_path: Any) -> None:
    pl.seed_everything(0)
    model = _RecordingCharLM(**TINY_MODEL)
    initial = copy.deepcopy(model)
    recorder = _GradRecorder()
    scheduler = AccumulationScheduler(3, count_items=CountTokens(key="labels"))
    trainer = tiny_trainer(tmp_path, [scheduler, recorder], limit_train_batches=3, max_steps=1)
    trainer.fit(model, datamodule=tiny_data())

    window = model.seen
    tokens = [int((b["labels"] != IGNORE_INDEX).sum()) for b in window]
    assert len(window) == 3 and len(set(tokens)) > 1
    exact = copy.deepcopy(initial)
    summed = sum(
        F.cross_entropy(exact(b["input_ids"]).flatten(0, 1), b["labels"].flatten(), reduction="sum") for b in window
    )
    (summed / sum(tokens)).backward()
    mean_of_means = copy.deepcopy(initial)
    (sum(mean_of_means.loss(b) for b in window) / len(window)).backward()

    got = recorder.grads[0]
    for name, param in exact.named_parameters():
        torch.testing.assert_close(got[name], param.grad, rtol=1e-4, atol=1e-6)
    naive = dict(mean_of_means.named_parameters())["token_embedding.weight"].grad  # tied with the head
    assert not torch.allclose(got["token_embedding.weight"], naive, rtol=1e-3), "exact and mean of means must differ"


def test_training_lowers_the_loss(tmp_path: Any) -> None:
    pl.seed_everything(0)
    dm = tiny_data()
    model = CharLM(**TINY_MODEL, lr=1e-2)
    probe = collate_padded(dm.val_set.sequences)  # type: ignore[union-attr]
    with torch.no_grad():
        before = float(model.loss(probe))
    scheduler = AccumulationScheduler(2, count_items=CountTokens(key="labels"))
    trainer = tiny_trainer(tmp_path, [scheduler], limit_train_batches=30)
    trainer.fit(model, datamodule=dm)
    with torch.no_grad():
        after = float(model.eval().loss(probe))
    assert trainer.global_step == 15
    assert after < before - 1.0, f"validation loss went from {before:.3f} to {after:.3f}"
