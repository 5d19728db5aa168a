"""Composer's ``tests/test_split_batch.py`` cases, ported as the floor for `split_batch`.

Composer splits into a given number of micro-batches; `split_batch` takes the largest micro-batch size, so each case
asks for ``ceil(B / 3)`` samples per micro-batch where Composer asked for 3 micro-batches. Composer refuses a batch
smaller than the number of micro-batches; a size-based split has nothing to refuse there and gives one micro-batch
holding the whole batch, which is what its last case checks instead. The batches are rebuilt here, not copied:

========================  ====================================================================================
case                      batch of ``B`` samples
========================  ====================================================================================
tensor                    one ``(B, 3, 32, 32)`` tensor
tuple                     ``[image, target]`` (default collate turns tuples into lists)
tuple_long                ``[image_1, image_2, image_3, target]``
tuple_list                ``[[image_1, image_2, image_3], target]``
dict                      ``{"image": ..., "target": ...}``
dict_with_metadata        the dict plus ``meta`` (B strings) and ``index`` (B lists of 3 ints)
maskrcnn                  a list of B ``(image, {"boxes", "labels", "masks"})`` samples, 1 to 5 detections each
========================  ====================================================================================
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import pytest
import torch

from lightning_accum.batches import batch_size_of, split_batch
from tests.helpers import assert_same


def _tensor(b: int) -> torch.Tensor:
    return torch.randn(b, 3, 32, 32)


def _target(b: int) -> torch.Tensor:
    return torch.randint(10, (b,))


def _tuple(b: int) -> list[torch.Tensor]:
    return [_tensor(b), _target(b)]


def _tuple_long(b: int) -> list[torch.Tensor]:
    return [_tensor(b), _tensor(b), _tensor(b), _target(b)]


def _tuple_list(b: int) -> list[Any]:
    return [[_tensor(b), _tensor(b), _tensor(b)], _target(b)]


def _dict(b: int) -> dict[str, torch.Tensor]:
    return {"image": _tensor(b), "target": _target(b)}


def _dict_with_metadata(b: int) -> dict[str, Any]:
    return {**_dict(b), "meta": ["a tag"] * b, "index": [[1, 2, 3] for _ in range(b)]}


def _maskrcnn(b: int, size: int = 12) -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(b)
    samples = []
    for n in torch.randint(1, 6, (b,), generator=g).tolist():
        target = {
            "boxes": torch.randint(0, size, (n, 4), generator=g).float(),
            "labels": torch.randint(0, 81, (n,), generator=g),
            "masks": torch.randint(0, 2, (n, size, size), generator=g, dtype=torch.uint8),
        }
        samples.append((torch.randn(3, size, size, generator=g), target))
    return samples


BATCHES: dict[str, Callable[[int], Any]] = {
    "tensor": _tensor,
    "tuple": _tuple,
    "tuple_long": _tuple_long,
    "tuple_list": _tuple_list,
    "dict": _dict,
    "dict_with_metadata": _dict_with_metadata,
}


def _micro(b: int, num_micro_batches: int = 3) -> int:
    return math.ceil(b / num_micro_batches)


def _first_dim(chunk: Any) -> int:
    """The number of samples in a micro-batch of one of the forms above."""
    if isinstance(chunk, torch.Tensor):
        return chunk.shape[0]
    if isinstance(chunk, Mapping):
        return len(chunk["target"])
    return len(chunk[-1]) if isinstance(chunk[-1], torch.Tensor) else len(chunk)


def _reassemble(batch: Any, chunks: list[Any]) -> Any:
    """The batch back from its micro-batches, in order.

    The batch says how: each element of a list of fields comes back from its own parts, a list of entries (where the
    micro-batches hold fewer) from its entries.
    """
    if isinstance(batch, torch.Tensor):
        return torch.cat(chunks)
    if isinstance(batch, Mapping):
        return {key: _reassemble(value, [c[key] for c in chunks]) for key, value in batch.items()}
    if isinstance(batch, list) and all(len(c) == len(batch) for c in chunks):
        return [_reassemble(value, [c[i] for c in chunks]) for i, value in enumerate(batch)]
    return [entry for c in chunks for entry in c]


# Composer: test_split_without_error (6 cases). Composer's test only checks that nothing raises; here the micro-batches
# must also be of the batch's own structure and give back the batch, every sample once and in order.
@pytest.mark.parametrize("name", list(BATCHES))
def test_split_without_error(name: str):
    batch = BATCHES[name](12)
    chunks = split_batch(batch, _micro(12))
    assert [type(c) for c in chunks] == [type(batch)] * 3
    assert_same(_reassemble(batch, chunks), batch)


# Composer: test_split_tuple (1 case)
def test_split_tuple():
    chunks = split_batch(_tuple(12), _micro(12))
    assert [len(c) for c in chunks] == [2, 2, 2]  # each micro-batch is an (x, y) pair
    assert [c[0].shape[0] for c in chunks] == [4, 4, 4]


# Composer: test_split_tuple_long (1 case)
def test_split_tuple_long():
    chunks = split_batch(_tuple_long(12), _micro(12))
    assert [len(c) for c in chunks] == [4, 4, 4]
    assert all(t.shape[0] == 4 for c in chunks for t in c)


# Composer: test_split_maskrcnn (1 case)
def test_split_maskrcnn():
    batch = _maskrcnn(12)
    chunks = split_batch(batch, _micro(12))
    assert len(chunks) == 3
    assert [len(c) for c in chunks] == [4, 4, 4]
    assert [id(s) for c in chunks for s in c] == [id(s) for s in batch]  # whole samples, in order, boxes untouched


# Composer: test_num_micro_batches (6 cases)
@pytest.mark.parametrize("name", list(BATCHES))
def test_num_micro_batches(name: str):
    chunks = split_batch(BATCHES[name](12), _micro(12))
    assert len(chunks) == 3
    assert [_first_dim(c) for c in chunks] == [4, 4, 4]


# Composer: test_odd_batch_sizes (6 cases): 5 samples in 3 micro-batches of at most 2
@pytest.mark.parametrize("name", list(BATCHES))
def test_odd_batch_sizes(name: str):
    batch = BATCHES[name](5)
    chunks = split_batch(batch, _micro(5))
    assert len(chunks) == 3
    assert [_first_dim(c) for c in chunks] == [2, 2, 1]
    last = chunks[-1]
    if isinstance(last, Mapping):
        assert len(last["image"]) == len(last["target"]) == 1
    if name == "dict_with_metadata":
        assert last["meta"] == ["a tag"] and last["index"] == [[1, 2, 3]]


# Composer: test_batch_size_less_than_num_microbatches (6 cases). Composer raises there, because 3 micro-batches
# can't be made of 1 sample; a size-based split of 1 sample gives one micro-batch equal to the batch.
@pytest.mark.parametrize("name", list(BATCHES))
def test_batch_of_size_1(name: str):
    batch = BATCHES[name](1)
    assert batch_size_of(batch) == 1
    chunks = split_batch(batch, _micro(12))
    assert len(chunks) == 1
    assert _first_dim(chunks[0]) == 1


# Beyond Composer: the maskrcnn batch at the other sizes Composer tries for the rest.
@pytest.mark.parametrize(("b", "sizes"), [(5, [2, 2, 1]), (1, [1])])
def test_split_maskrcnn_odd_and_single(b: int, sizes: list[int]):
    batch = _maskrcnn(b)
    assert batch_size_of(batch) == b
    chunks = split_batch(batch, _micro(b))
    assert [len(c) for c in chunks] == sizes
    assert [id(s) for c in chunks for s in c] == [id(s) for s in batch]
