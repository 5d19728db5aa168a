from __future__ import annotations

import math
from collections import OrderedDict, UserDict, defaultdict, namedtuple
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from lightning_accum.batches import batch_size_of, num_micro_batches, split_batch
from tests.helpers import ReadOnlyMapping, assert_same

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


def _concat(micro_batches: list[Any]) -> Any:
    """Reassemble micro-batches made of the same structure: tensors and per-sample lists are concatenated."""
    first = micro_batches[0]
    if isinstance(first, torch.Tensor):
        return first if first.ndim == 0 else torch.cat(micro_batches)
    if isinstance(first, Mapping):
        return {k: _concat([c[k] for c in micro_batches]) for k in first}
    if isinstance(first, tuple):
        return tuple(_concat([c[i] for c in micro_batches]) for i in range(len(first)))
    if isinstance(first, list):
        if all(isinstance(v, torch.Tensor) for v in first):
            return [_concat([c[i] for c in micro_batches]) for i in range(len(first))]
        return [v for c in micro_batches for v in c]  # one entry per sample
    return first


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
def test_micro_batch_sizes(micro: int):
    micro_batches = split_batch(_x(B, 2), micro)
    sizes = [len(c) for c in micro_batches]
    assert len(micro_batches) == num_micro_batches(B, micro)
    assert sizes == [min(micro, B - start) for start in range(0, B, micro)]
    torch.testing.assert_close(torch.cat(micro_batches), _x(B, 2), rtol=0, atol=0)


def test_micro_batches_are_views():
    x = _x(B, 3)
    micro_batch = split_batch(x, 4)[1]
    assert micro_batch.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()


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
    micro_batches = split_batch(batch, micro)
    assert len(micro_batches) == num_micro_batches(B, micro)
    for micro_batch in micro_batches:
        assert type(micro_batch) is type(batch)
    assert_same(_concat(micro_batches), batch)


def test_namedtuple_keeps_its_type_and_fields():
    micro_batches = split_batch(Pair(_x(B, 2), _x(B)), 6)
    assert [type(c) for c in micro_batches] == [Pair, Pair]
    assert micro_batches[1].y.tolist() == [6.0, 7.0, 8.0, 9.0]


def test_userdict_subclass_keeps_its_type_and_attributes():
    batch = Encoding({"input_ids": _x(B, 5), "attention_mask": _x(B, 5)}, tensor_type="pt")
    micro_batches = split_batch(batch, 4)
    assert [type(c) for c in micro_batches] == [Encoding] * 3
    assert [c.tensor_type for c in micro_batches] == ["pt"] * 3
    assert [c["input_ids"].shape[0] for c in micro_batches] == [4, 4, 2]
    assert batch["input_ids"].shape[0] == B, "the input must not be modified"
    assert_same(_concat(micro_batches), dict(batch))


def test_defaultdict_keeps_its_default_factory():
    batch: defaultdict[str, Any] = defaultdict(list, x=_x(B))
    micro_batches = split_batch(batch, 5)
    assert all(type(c) is defaultdict and c.default_factory is list for c in micro_batches)
    assert micro_batches[0]["missing"] == []


def test_dataclass_fields_are_cut_including_those_outside_init():
    micro_batches = split_batch(Batch(x=_x(B, 2), y=_x(B)), 4)
    assert [type(c) for c in micro_batches] == [Batch] * 3
    assert [c.x.shape[0] for c in micro_batches] == [4, 4, 2]
    assert [c.note for c in micro_batches] == ["train"] * 3
    # n_tokens is derived in __post_init__, which runs again on each micro-batch's x.
    assert [int(c.n_tokens) for c in micro_batches] == [8, 8, 4]


def test_frozen_dataclass():
    batch = FrozenBatch(x=_x(B), texts=list("abcdefghij"))
    micro_batches = split_batch(batch, 3)
    assert [c.texts for c in micro_batches] == [list("abc"), list("def"), list("ghi"), ["j"]]
    assert [type(c) for c in micro_batches] == [FrozenBatch] * 4


def test_shared_entries_are_replicated_not_copied():
    scale = torch.tensor(0.5)
    config = ["a", "b"]  # a list whose length is not the batch size: configuration, not per-sample data
    batch = {"x": _x(B), "scale": scale, "config": config, "lr": 0.1, "name": "step", "none": None}
    for micro_batch in split_batch(batch, 4):
        assert micro_batch["scale"] is scale
        assert micro_batch["config"] is config
        assert (micro_batch["lr"], micro_batch["name"], micro_batch["none"]) == (0.1, "step", None)


def test_per_sample_python_lists_are_cut():
    batch = {"x": _x(B), "ids": list(range(B)), "words": tuple("abcdefghij")}
    micro_batches = split_batch(batch, 4)
    assert [c["ids"] for c in micro_batches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert micro_batches[2]["words"] == ("i", "j")


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


# ---- per-sample batches: detection and other list collates -----------------------------------------------------------


def _image(i: int) -> torch.Tensor:
    return torch.full((3, 4, 4), float(i))


def _target(i: int, n_boxes: int | None = None) -> dict[str, torch.Tensor]:
    n = i % 4 + 1 if n_boxes is None else n_boxes
    return {"boxes": torch.full((n, 4), float(i)), "labels": torch.full((n,), i)}


def _samples(n: int = B, n_boxes: int | None = None) -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """What ``DataLoader(collate_fn=list)`` yields for a torchvision detection dataset."""
    return [(_image(i), _target(i, n_boxes)) for i in range(n)]


def _zipped(n: int = B, n_boxes: int | None = None) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """torchvision's detection collate, ``tuple(zip(*batch))``: a tuple of images and a tuple of targets."""
    return tuple(zip(*_samples(n, n_boxes), strict=True))  # type: ignore[return-value]


def _ids(micro_batch: Any) -> list[int]:
    """The sample ids in a micro-batch of any of the detection forms (every tensor of sample i is filled with i)."""
    if isinstance(micro_batch, list) and micro_batch and isinstance(micro_batch[0], tuple):
        return [int(image[0, 0, 0]) for image, _ in micro_batch]
    images, targets = micro_batch
    ids = [int(image[0, 0, 0]) for image in images]
    assert ids == [int(t["labels"][0]) for t in targets]
    return ids


DETECTION_FORMS = {
    "samples": _samples,
    "zip": _zipped,
    "zip-lists": lambda n=B, n_boxes=None: [list(part) for part in _zipped(n, n_boxes)],
    "stacked-images": lambda n=B, n_boxes=None: (torch.stack(_zipped(n, n_boxes)[0]), list(_zipped(n, n_boxes)[1])),
}


@pytest.mark.parametrize("form", list(DETECTION_FORMS))
@pytest.mark.parametrize("n_boxes", [None, 1, 3, 4], ids=["varying-boxes", "1-box", "3-boxes", "4-boxes"])
@pytest.mark.parametrize(("n", "micro"), [(B, 4), (B, 3), (5, 2), (4, 4), (3, 2), (2, 1), (1, 1), (1, 4)])
def test_detection_batches_are_cut_by_sample(form: str, n_boxes: int | None, n: int, micro: int):
    # 3 boxes per image matches the 3 image channels and 4 boxes the 4 box coordinates: neither may be read as the
    # batch dimension, and neither may the channels when the batch has 3 images.
    batch = DETECTION_FORMS[form](n, n_boxes)
    assert batch_size_of(batch) == n
    micro_batches = split_batch(batch, micro)
    assert [_ids(c) for c in micro_batches] == [list(range(s, min(s + micro, n))) for s in range(0, n, micro)]
    for micro_batch in micro_batches:
        assert type(micro_batch) is type(batch)
        assert batch_size_of(micro_batch) == len(_ids(micro_batch))


def test_detection_targets_keep_their_boxes_whole():
    batch = _zipped(6)
    micro_batches = split_batch(batch, 4)
    assert [t["boxes"].shape[0] for t in micro_batches[1][1]] == [1, 2]  # samples 4 and 5: boxes are never cut
    assert all(
        a is b for a, b in zip(micro_batches[0][1] + micro_batches[1][1], batch[1], strict=True)
    )  # the same dicts


def test_per_sample_dicts_under_a_batched_tensor_are_cut_by_entry_even_when_box_counts_equal_the_batch_size():
    # Each of the 4 images has 4 boxes: cutting the boxes' rows would also "fit", but the list holds one dict per image.
    batch = {"images": torch.zeros(4, 3, 8, 8), "targets": [_target(i, n_boxes=4) for i in range(4)]}
    micro_batches = split_batch(batch, 2)
    assert [[int(t["labels"][0]) for t in c["targets"]] for c in micro_batches] == [[0, 1], [2, 3]]
    assert all(t["boxes"].shape == (4, 4) for c in micro_batches for t in c["targets"])


def test_a_list_of_per_sample_dicts_is_a_batch_of_samples():
    batch = [{"image": _image(i), "label": torch.tensor(i)} for i in range(5)]  # DataLoader(collate_fn=list)
    assert batch_size_of(batch) == 5
    assert [[int(s["label"]) for s in c] for c in split_batch(batch, 2)] == [[0, 1], [2, 3], [4]]


def test_a_list_of_0_dim_labels_is_per_sample():
    batch = {"x": _x(4, 2), "labels": [torch.tensor(i) for i in range(4)]}
    assert [[int(v) for v in c["labels"]] for c in split_batch(batch, 3)] == [[0, 1, 2], [3]]


def test_fields_of_equal_shape_stay_fields():
    # (input_ids, attention_mask): two tensors of one shape are fields of one batch, not two samples.
    ids, mask = _x(B, 6), _x(B, 6)
    assert batch_size_of((ids, mask)) == B
    assert [c[0].shape[0] for c in split_batch((ids, mask), 4)] == [4, 4, 2]
    assert batch_size_of([_x(2, 5), _x(2, 5)]) == 2  # also when the batch size equals their number


def test_a_0_dim_tensor_first_does_not_set_the_batch_size():
    batch = {"temperature": torch.tensor(0.5), "x": _x(B, 2), "y": _x(B)}
    micro_batches = split_batch(batch, 4)
    assert [c["x"].shape[0] for c in micro_batches] == [4, 4, 2]
    assert all(c["temperature"] is batch["temperature"] for c in micro_batches)


def test_a_known_batch_size_chooses_the_reading():
    # A list of 2 entries of one structure, each a batch of 6 rows: 2 samples, or 2 fields of 6 samples?
    # Read alone it is 2 samples; a batch size of 6 from a hook makes it 2 fields.
    batches = [(_x(6, 2), _x(6)), (_x(6, 2), _x(6))]
    assert batch_size_of(batches) == 2
    micro_batches = split_batch(batches, 4, batch_size=6)
    assert [[part[0].shape[0] for part in c] for c in micro_batches] == [[4, 4], [2, 2]]
    with pytest.raises(ValueError, match=r"batch size 5.*`batch_size=`"):
        split_batch(batches, 4, batch_size=5)


def test_a_batch_with_two_readings_of_equal_standing_is_refused():
    # Two views of 8 samples and their names: 2 views of 8 samples, or 2 samples (each a view and a name)?
    batch = {"views": [_x(8, 3), _x(8, 3)], "names": ["crop", "flip"]}
    readings = r"2 samples \(`batch\['names'\]`, `batch\['views'\]` one entry per sample\) or as 8 samples"
    with pytest.raises(ValueError, match=rf"can be read as {readings}.*`batch_size_of=`"):
        batch_size_of(batch)
    assert [c["views"][0].shape[0] for c in split_batch(batch, 4, batch_size=8)] == [4, 4]


@pytest.mark.parametrize(
    "batch",
    [BATCHES[name] for name in BATCHES]
    + [_samples(), _zipped(), {"x": _x(B), "ids": list(range(B))}, {"s": torch.tensor(1.0), "x": _x(B, 2)}],
)
def test_batch_size_of_and_split_batch_agree(batch: Any):
    micro_batches = split_batch(batch, 3)
    assert sum(batch_size_of(c) for c in micro_batches) == batch_size_of(batch) == B


class Custom:
    def __init__(self) -> None:
        self.x = _x(B)
        self.batch_size = B


def test_a_custom_batch_object_cannot_be_cut_by_the_built_in_rules():
    with pytest.raises(TypeError, match=r"Cannot split a batch of type Custom.*`split_batch=`.*LightningModule"):
        split_batch(Custom(), 4)
