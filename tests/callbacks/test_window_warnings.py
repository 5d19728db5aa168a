"""What `AccumulationScheduler` (window mode) says about batches it cannot make exact alone, and the sampler it weighs.

Issue 36, item 5: labels that hold -100 with the default sample count and a mean loss warn once, naming
``CountTokens("labels", shift=1)`` and its YAML form, and stay quiet where the update is exact. Issue 35, item 12: a
`BalancedBatchSampler` under window mode is weighed (each rank's loss by its count), so it does not warn.
"""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

import tests.helpers as h
from lightning_accum import AccumulationScheduler
from lightning_accum.callbacks._window_checks import SAMPLE_COUNT_WITH_IGNORED_LABELS, holds_ignored_labels
from lightning_accum.items import CountSamples, CountTokens
from lightning_accum.sequences import BalancedBatchSampler

VOCAB, LENGTH = 7, 5


class TokenTagger(pl.LightningModule):
    """A per-token classifier whose loss is the mean over the labels that are not -100."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, VOCAB)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        logits = self.embed(batch["input_ids"])
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch["labels"].reshape(-1), ignore_index=-100)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _samples(ignored: bool) -> list[dict[str, Tensor]]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (12, LENGTH), generator=g)
    labels = ids.clone()
    if ignored:  # padding of every length: the micro-batches hold different numbers of loss-bearing tokens
        labels[torch.arange(LENGTH)[None, :] >= torch.arange(1, 13)[:, None] % LENGTH + 1] = -100
    return [{"input_ids": i, "labels": y} for i, y in zip(ids, labels, strict=True)]


def _warnings_of_a_fit(tmp_path: Any, callback: AccumulationScheduler, ignored: bool) -> list[str]:
    trainer = h.make_trainer(tmp_path, [callback], max_epochs=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(TokenTagger(), DataLoader(_samples(ignored), batch_size=3))
    return [str(w.message) for w in caught if "count_items" in str(w.message)]


def test_labels_that_hold_minus_100_with_the_sample_count_warn_once_with_the_token_count_and_its_yaml(tmp_path):
    assert _warnings_of_a_fit(tmp_path, AccumulationScheduler(2), ignored=True) == [SAMPLE_COUNT_WITH_IGNORED_LABELS]
    assert 'count_items=CountTokens("labels", shift=1)' in SAMPLE_COUNT_WITH_IGNORED_LABELS
    assert (
        "`count_items: {class_path: lightning_accum.items.CountTokens, init_args: {key: labels, shift: 1}}`"
        in SAMPLE_COUNT_WITH_IGNORED_LABELS
    )


@pytest.mark.parametrize(
    ("callback", "ignored"),
    [
        (AccumulationScheduler(2), False),
        (AccumulationScheduler(2, count_items=CountTokens("labels", shift=0)), True),
        (AccumulationScheduler(2, count_items=CountSamples()), True),
        (AccumulationScheduler(2, loss_reduction="sum"), True),
    ],
    ids=["no -100", "tokens counted", "samples said", "a summed loss"],
)
def test_where_the_update_is_exact_it_stays_quiet(tmp_path, callback, ignored):
    assert _warnings_of_a_fit(tmp_path, callback, ignored) == []


def test_only_integer_labels_under_labels_are_read():
    assert holds_ignored_labels({"labels": torch.tensor([[1, -100]])})
    assert not holds_ignored_labels({"labels": torch.tensor([[1.0, -100.0]])})  # regression targets, not labels
    assert not holds_ignored_labels({"target": torch.tensor([-100])})
    assert not holds_ignored_labels((torch.tensor([-100]), torch.tensor([-100])))


def test_the_scheduler_weighs_a_balanced_samplers_shares(tmp_path):
    data = h.IndexedDataset(12)
    loader = DataLoader(data, batch_sampler=BalancedBatchSampler([3, 9, 1, 4] * 3, 4))
    trainer = h.make_trainer(tmp_path, [AccumulationScheduler(1)], max_epochs=1)
    trainer.fit(h.RegressionModel(), loader)
    assert trainer.train_dataloader.batch_sampler.weighed_by == "AccumulationScheduler"
