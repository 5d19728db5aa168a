from __future__ import annotations

import math
from collections import OrderedDict, UserDict, defaultdict, namedtuple
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from lightning_accum.splitting import num_micro_batches, split_batch

B = 10


class Encoding(UserDict):
    """Stands in for transformers' BatchEncoding: a UserDict subclass with state besides its data."""

    def __init__(self, data: dict | None = None, tensor_type: str | None = None) -> None:
        super().__init__(data)
        self.tensor_type = tensor_type


Pair = namedtuple("Pair", ["x", "y"])


@dataclass
class Batch:
    x: torch.Tensor
    y: torch.Tensor
    note: str = "train"
    n_tokens: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.n_tokens = torch.tensor(int(self.x.numel()))


@dataclass(frozen=True)
class FrozenBatch:
    x: torch.Tensor
    texts: list[str]


def _x(n: int = B, *rest: int) -> torch.Tensor:
    return torch.arange(n * math.prod(rest), dtype=torch.float32).reshape(n, *rest)


def _concat(chunks: list[Any]) -> Any:
    """Reassemble chunks made of the same structure: tensors and per-sample lists are concatenated."""
    first = chunks[0]
    if isinstance(first, torch.Tensor):
        return first if first.ndim == 0 else torch.cat(chunks)
    if isinstance(first, Mapping):
        return {k: _concat([c[k] for c in chunks]) for k in first}
    if isinstance(first, tuple):
        return tuple(_concat([c[i] for c in chunks]) for i in range(len(first)))
    if isinstance(first, list):
        if all(isinstance(v, torch.Tensor) for v in first):
            return [_concat([c[i] for c in chunks]) for i in range(len(first))]
        return [v for c in chunks for v in c]  # one entry per sample
    return first


def _assert_same(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    elif isinstance(a, Mapping):
        assert list(a) == list(b)
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for u, v in zip(a, b, strict=True):
            _assert_same(u, v)
    else:
        assert a == b


# ---- num_micro_batches ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("step", "micro", "expected"), [(10, 4, 3), (8, 4, 2), (3, 8, 1), (1, 1, 1), (0, 4, 0)])
def test_num_micro_batches(step: int, micro: int, expected: int):
    assert num_micro_batches(step, micro) == expected == -(-step // micro)


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        ((10, 0), ValueError, r"`micro_batch_size` must be an int >= 1, got 0"),
        ((-1, 4), ValueError, r"`step_batch_size` must be an int >= 0, got -1"),
        ((10, 2.0), TypeError, r"`micro_batch_size` must be an int >= 1, got 2.0 of type float"),
        ((True, 2), TypeError, r"`step_batch_size` must be an int >= 0, got True of type bool"),
    ],
)
def test_num_micro_batches_validation(args: tuple, error: type[Exception], match: str):
    with pytest.raises(error, match=match):
        num_micro_batches(*args)


# ---- sizes and round trips ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("micro", [1, 3, 4, 5, 9, 10, 11, 64])
def test_chunk_sizes(micro: int):
    chunks = split_batch(_x(B, 2), micro)
    sizes = [len(c) for c in chunks]
    assert len(chunks) == num_micro_batches(B, micro)
    assert sizes == [min(micro, B - start) for start in range(0, B, micro)]
    torch.testing.assert_close(torch.cat(chunks), _x(B, 2), rtol=0, atol=0)


def test_chunks_are_views():
    x = _x(B, 3)
    chunk = split_batch(x, 4)[1]
    assert chunk.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()


def test_empty_batch_gives_no_micro_batches():
    assert split_batch(torch.zeros(0, 3), 4) == []


BATCHES = {
    "tensor": _x(B, 3),
    "dict": {"x": _x(B, 3), "y": _x(B)},
    "nested": {"inputs": {"ids": _x(B, 4), "mask": _x(B, 4)}, "labels": [_x(B), _x(B, 2)]},
    "tuple": (_x(B, 3), _x(B)),
    "list": [_x(B, 3), _x(B)],
    "ordered_dict": OrderedDict(x=_x(B, 2), y=_x(B)),
    "namedtuple": Pair(_x(B, 2), _x(B)),
    "texts": {"x": _x(B, 2), "text": [f"sample {i}" for i in range(B)]},
    "detection": (_x(B, 3, 4, 4), [{"boxes": _x(i % 3 + 1, 4), "labels": _x(i % 3 + 1)} for i in range(B)]),
}


@pytest.mark.parametrize("name", list(BATCHES))
@pytest.mark.parametrize("micro", [1, 3, 4, 10])
def test_round_trip(name: str, micro: int):
    batch = BATCHES[name]
    chunks = split_batch(batch, micro)
    assert len(chunks) == num_micro_batches(B, micro)
    for chunk in chunks:
        assert type(chunk) is type(batch)
    _assert_same(_concat(chunks), batch)


def test_namedtuple_keeps_its_type_and_fields():
    chunks = split_batch(Pair(_x(B, 2), _x(B)), 6)
    assert [type(c) for c in chunks] == [Pair, Pair]
    assert chunks[1].y.tolist() == [6.0, 7.0, 8.0, 9.0]


def test_userdict_subclass_keeps_its_type_and_attributes():
    batch = Encoding({"input_ids": _x(B, 5), "attention_mask": _x(B, 5)}, tensor_type="pt")
    chunks = split_batch(batch, 4)
    assert [type(c) for c in chunks] == [Encoding] * 3
    assert [c.tensor_type for c in chunks] == ["pt"] * 3
    assert [c["input_ids"].shape[0] for c in chunks] == [4, 4, 2]
    assert batch["input_ids"].shape[0] == B, "the input must not be modified"
    _assert_same(_concat(chunks), dict(batch))


def test_defaultdict_keeps_its_default_factory():
    batch: defaultdict[str, Any] = defaultdict(list, x=_x(B))
    chunks = split_batch(batch, 5)
    assert all(type(c) is defaultdict and c.default_factory is list for c in chunks)
    assert chunks[0]["missing"] == []


def test_dataclass_fields_are_cut_including_those_outside_init():
    chunks = split_batch(Batch(x=_x(B, 2), y=_x(B)), 4)
    assert [type(c) for c in chunks] == [Batch] * 3
    assert [c.x.shape[0] for c in chunks] == [4, 4, 2]
    assert [c.note for c in chunks] == ["train"] * 3
    # n_tokens is derived in __post_init__, which runs again on each chunk's x.
    assert [int(c.n_tokens) for c in chunks] == [8, 8, 4]


def test_frozen_dataclass():
    batch = FrozenBatch(x=_x(B), texts=list("abcdefghij"))
    chunks = split_batch(batch, 3)
    assert [c.texts for c in chunks] == [list("abc"), list("def"), list("ghi"), ["j"]]
    assert [type(c) for c in chunks] == [FrozenBatch] * 4


def test_shared_entries_are_replicated_not_copied():
    scale = torch.tensor(0.5)
    config = ["a", "b"]  # a list whose length is not the batch size: configuration, not per-sample data
    batch = {"x": _x(B), "scale": scale, "config": config, "lr": 0.1, "name": "step", "none": None}
    for chunk in split_batch(batch, 4):
        assert chunk["scale"] is scale
        assert chunk["config"] is config
        assert (chunk["lr"], chunk["name"], chunk["none"]) == (0.1, "step", None)


def test_per_sample_python_lists_are_cut():
    batch = {"x": _x(B), "ids": list(range(B)), "words": tuple("abcdefghij")}
    chunks = split_batch(batch, 4)
    assert [c["ids"] for c in chunks] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert chunks[2]["words"] == ("i", "j")


def test_numpy_arrays_are_cut_like_tensors():
    np = pytest.importorskip("numpy")
    batch = {"x": _x(B), "weights": np.arange(B), "table": np.zeros((3, 2))}
    with pytest.raises(ValueError, match=r"`batch\['table'\]`.*shape is \(3, 2\)"):
        split_batch(batch, 4)
    del batch["table"]
    assert [c["weights"].tolist() for c in split_batch(batch, 4)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


# ---- errors ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("batch", "match"),
    [
        ({"x": _x(B), "labels": _x(B + 1)}, r"Cannot split `batch\['labels'\]`.*shape is \(11,\).*batch size 10"),
        ({"inputs": [_x(B), _x(3, 2)]}, r"`batch\['inputs'\]\[1\]`.*shape is \(3, 2\)"),
        ((_x(B, 2), _x(B - 1)), r"`batch\[1\]`.*shape is \(9,\)"),
        (Pair(_x(B), _x(2, 2)), r"`batch.y`.*shape is \(2, 2\)"),
        (Batch(x=_x(B), y=_x(4)), r"`batch.y`.*shape is \(4,\)"),
        # Looks like B per-sample entries (len == B) but holds the batch on dim 0: a structure with an error.
        ({"pair": [_x(2), _x(3)], "x": _x(2)}, r"`batch\['pair'\]\[1\]`.*shape is \(3,\).*batch size 2"),
    ],
    ids=["dict", "nested-list", "tuple", "namedtuple", "dataclass", "structure-of-batch-length"],
)
def test_mismatched_first_dimension_names_the_element(batch: Any, match: str):
    with pytest.raises(ValueError, match=match):
        split_batch(batch, 4)


def test_error_says_how_to_fix():
    with pytest.raises(ValueError, match=r"Put the samples on dim 0, or pass a value shared by all samples"):
        split_batch({"x": _x(B), "y": _x(3)}, 4)


class ReadOnlyMapping(Mapping):
    def __init__(self) -> None:
        self._data = {"x": _x(B)}

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)


def test_mapping_that_cannot_be_rebuilt():
    with pytest.raises(TypeError, match=r"Cannot split `batch`: its mapping type ReadOnlyMapping can't be rebuilt"):
        split_batch(ReadOnlyMapping(), 4)


@pytest.mark.parametrize(
    ("micro", "error", "match"),
    [
        (0, ValueError, r"`micro_batch_size` must be an int >= 1, got 0"),
        (2.5, TypeError, r"`micro_batch_size` must be an int >= 1, got 2.5 of type float"),
        (True, TypeError, r"got True of type bool"),
    ],
)
def test_micro_batch_size_validation(micro: Any, error: type[Exception], match: str):
    with pytest.raises(error, match=match):
        split_batch(_x(B), micro)
