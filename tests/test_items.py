"""Built-in item counters and ``resolve_counter``."""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import Tensor

from lightning_accum.items import CountSamples, CountTokens, resolve_counter
from lightning_accum.normalization import count_items

LABELS = torch.tensor([[5, 7, -100, -100], [3, 4, 9, -100], [-100, -100, -100, -100]])


@dataclass
class _Batch:
    input_ids: Tensor
    labels: Tensor


@pytest.mark.parametrize(
    ("batch", "counter"),
    [
        ({"input_ids": torch.zeros(3, 4), "labels": LABELS}, CountTokens()),
        ((torch.zeros(3, 4), LABELS), CountTokens(key=1)),
        ([torch.zeros(3, 4), LABELS], CountTokens(key=-1)),
        (_Batch(torch.zeros(3, 4), LABELS), CountTokens(key="labels")),
    ],
    ids=["dict", "tuple", "list-negative-index", "attribute"],
)
def test_count_tokens_counts_loss_bearing_labels(batch: Any, counter: CountTokens) -> None:
    n = counter(batch)
    assert isinstance(n, Tensor) and n.dim() == 0 and not n.is_floating_point()
    assert int(n) == 2 + 3 + 0


def test_count_tokens_honours_ignore_index() -> None:
    labels = torch.tensor([[0, 1, 0], [2, 0, 0]])
    assert int(CountTokens(key="y", ignore_index=0)({"y": labels})) == 2


def test_count_tokens_stays_on_the_device() -> None:
    # On the meta device no value can be read back: the count must be a lazy tensor, never a host int.
    labels = torch.empty(4, 16, dtype=torch.long, device="meta")
    n = CountTokens()({"labels": labels})
    assert n.device.type == "meta" and n.dtype == torch.int64


def test_count_tokens_passes_the_callbacks_checks() -> None:
    n = count_items({"labels": LABELS}, CountTokens())
    assert isinstance(n, Tensor) and n.shape == () and int(n) == 5


@pytest.mark.parametrize(
    ("batch", "error", "match"),
    [
        ({"targets": LABELS}, KeyError, r"the batch has no 'labels'; its keys are \['targets'\]"),
        ({"labels": [1, 2]}, TypeError, r"expects a tensor of labels at batch\['labels'\], got list"),
        (LABELS, KeyError, "cannot find labels in a batch of type Tensor"),
    ],
)
def test_count_tokens_explains_a_batch_it_cannot_read(batch: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        CountTokens()(batch)


def test_count_tokens_rejects_an_out_of_range_position() -> None:
    with pytest.raises(KeyError, match="the batch is a sequence of length 2"):
        CountTokens(key=2)((LABELS, LABELS))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"key": 1.5}, r"`key` must be a str .* got 1.5 of type float"),
        ({"key": True}, "`key` must be a str"),
        ({"ignore_index": "-100"}, r"`ignore_index` must be an int, got '-100' of type str\. .* such as -100"),
    ],
)
def test_count_tokens_rejects_bad_arguments(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(TypeError, match=match):
        CountTokens(**kwargs)


def test_count_samples_counts_the_first_dimension() -> None:
    assert CountSamples()({"input_ids": torch.zeros(3, 4), "labels": LABELS}) == 3
    assert count_items((torch.zeros(7, 2),), CountSamples()) == 7


def test_counters_pickle_and_compare() -> None:
    # `ddp_spawn` pickles callbacks, and with them their counters: lambdas would fail here.
    counter = CountTokens(key="targets", ignore_index=0)
    restored = pickle.loads(pickle.dumps(counter))
    assert restored == counter and hash(restored) == hash(counter) and restored != CountTokens()
    assert pickle.loads(pickle.dumps(CountSamples())) == CountSamples()
    assert repr(counter) == "CountTokens(key='targets', ignore_index=0)"


def _count_rows(batch: Any) -> int:
    return len(batch)


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (None, None),
        ("lightning_accum.items.CountTokens", CountTokens()),
        ("lightning_accum.items:CountSamples", CountSamples()),
        ("lightning_accum.normalization.batch_size_of", None),  # a function: checked by identity below
        ("lightning_accum.normalization:batch_size_of", None),
    ],
)
def test_resolve_counter_imports_paths(spec: str | None, expected: Any) -> None:
    from lightning_accum.normalization import batch_size_of

    resolved = resolve_counter(spec)
    if spec is not None and spec.endswith("batch_size_of"):
        assert resolved is batch_size_of
    else:
        assert resolved == expected


def test_resolve_counter_passes_callables_through() -> None:
    counter = CountTokens()
    assert resolve_counter(counter) is counter
    assert resolve_counter(_count_rows) is _count_rows


@pytest.mark.parametrize(
    ("spec", "error", "match"),
    [
        ("batch_size_of", ValueError, r"`count_items='batch_size_of'` is not an import path"),
        ("no_such_package.count", ValueError, r"cannot import module 'no_such_package'"),
        ("lightning_accum.items.CountWords", ValueError, r"'lightning_accum.items' has no attribute 'CountWords'"),
        ("math:pi", TypeError, r"`count_items='math:pi'` names 3.14.*, which is not callable"),
        (42, TypeError, r"`count_items` must be a function of a batch, .* got 42 of type int"),
    ],
)
def test_resolve_counter_explains_bad_specs(spec: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        resolve_counter(spec)


def test_count_samples_reads_the_batch_as_the_callbacks_do() -> None:
    # A 0-dim value first, and a list of (image, target) samples: the count is the samples, not 1 or the channels.
    assert CountSamples()({"temperature": torch.tensor(0.5), "x": torch.zeros(6, 2)}) == 6
    detection = [(torch.zeros(3, 8, 8), {"boxes": torch.zeros(i + 1, 4)}) for i in range(5)]
    assert CountSamples()(detection) == 5
