"""`plan_batch`: a batch read once, then cut by any samples in any order, with its sequence fields trimmed.

The references are built by hand from the batch with plain indexing (``tensor[indices]``, list comprehensions), not
with the plan: they say what a micro-batch of those samples must be.
"""

from __future__ import annotations

import dataclasses
from collections import namedtuple
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import pytest
import torch

import tests.helpers as h
from lightning_accum.batches import (
    BatchPlan,
    MicroBatch,
    SequenceTrim,
    plan_batch,
    resolve_batch_hooks,
    split_batch,
)

B, L = 6, 5
Pair = namedtuple("Pair", ["x", "y"])


@dataclasses.dataclass
class Batch:
    ids: torch.Tensor
    texts: list[str]
    note: str = "train"
    n_tokens: torch.Tensor = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.n_tokens = torch.tensor(int(self.ids.numel()))


def _x(*shape: int) -> torch.Tensor:
    return torch.arange(int(np.prod(shape)), dtype=torch.float32).reshape(shape)


def _ids() -> torch.Tensor:
    return torch.arange(B * L).reshape(B, L)


def _encoding() -> Any:
    from transformers import BatchEncoding

    return BatchEncoding({"input_ids": _ids(), "attention_mask": torch.ones(B, L, dtype=torch.long)}, tensor_type="pt")


TEMPERATURE = torch.tensor(0.7)
CONFIG = ["a", "b"]  # not B entries: configuration, shared
TEXTS = [f"sample {i}" for i in range(B)]
FLAT = {"input_ids": _ids(), "attention_mask": torch.ones(B, L), "labels": _x(B)}
NESTED = {
    "inputs": {"ids": _ids(), "mask": _x(B, L)},
    "labels": [_x(B), _x(B, 2)],
    "text": TEXTS,
    "temperature": TEMPERATURE,
    "config": CONFIG,
    "lr": 0.1,
}
SAMPLES = [{"image": torch.full((3, 2, 2), float(i)), "label": torch.tensor(i)} for i in range(B)]
ZIPPED = (
    tuple(torch.full((3, i + 1, 2), float(i)) for i in range(B)),
    tuple({"boxes": torch.zeros(i % 3 + 1, 4), "labels": torch.full((i % 3 + 1,), i)} for i in range(B)),
)
DATACLASS = Batch(ids=_ids(), texts=TEXTS)
WITH_ARRAY = {"x": _x(B, 2), "weights": np.arange(B, dtype=np.float64)}


def _pick(seq: Any, indices: list[int]) -> list[Any]:
    return [seq[i] for i in indices]


# name: (batch, the micro-batch of `indices` built by hand, the plan's roles)
CASES: dict[str, tuple[Callable[[], Any], Callable[[Any, list[int]], Any], dict[str, str]]] = {
    "tensor": (lambda: _x(B, 3), lambda b, i: b[i], {"batch": "rows"}),
    "flat dict": (
        lambda: FLAT,
        lambda b, i: {k: v[i] for k, v in b.items()},
        {"batch['input_ids']": "rows", "batch['attention_mask']": "rows", "batch['labels']": "rows"},
    ),
    "nested": (
        lambda: NESTED,
        lambda b, i: {
            "inputs": {"ids": b["inputs"]["ids"][i], "mask": b["inputs"]["mask"][i]},
            "labels": [b["labels"][0][i], b["labels"][1][i]],
            "text": _pick(b["text"], i),
            "temperature": TEMPERATURE,
            "config": CONFIG,
            "lr": 0.1,
        },
        {
            "batch['inputs']['ids']": "rows",
            "batch['inputs']['mask']": "rows",
            "batch['labels'][0]": "rows",
            "batch['labels'][1]": "rows",
            "batch['text']": "entries",
            "batch['temperature']": "shared",
            "batch['config']": "shared",
            "batch['lr']": "shared",
        },
    ),
    "tuple": (lambda: (_x(B, 2), _x(B)), lambda b, i: (b[0][i], b[1][i]), {"batch[0]": "rows", "batch[1]": "rows"}),
    "namedtuple": (
        lambda: Pair(_x(B, 2), _x(B)),
        lambda b, i: Pair(b.x[i], b.y[i]),
        {"batch.x": "rows", "batch.y": "rows"},
    ),
    "dataclass": (
        lambda: DATACLASS,
        lambda b, i: Batch(ids=b.ids[i], texts=_pick(b.texts, i)),
        {"batch.ids": "rows", "batch.texts": "entries", "batch.note": "shared", "batch.n_tokens": "shared"},
    ),
    "list of samples": (lambda: SAMPLES, lambda b, i: _pick(b, i), {"batch": "entries"}),
    "zipped detection": (
        lambda: ZIPPED,
        lambda b, i: (tuple(_pick(b[0], i)), tuple(_pick(b[1], i))),
        {"batch[0]": "entries", "batch[1]": "entries"},
    ),
    "BatchEncoding": (
        _encoding,
        lambda b, i: {"input_ids": b["input_ids"][i], "attention_mask": b["attention_mask"][i]},
        {"batch['input_ids']": "rows", "batch['attention_mask']": "rows"},
    ),
    "numpy": (
        lambda: WITH_ARRAY,
        lambda b, i: {"x": b["x"][i], "weights": b["weights"][i]},
        {"batch['x']": "rows", "batch['weights']": "rows"},
    ),
}


def _assert_same(actual: Any, expected: Any, path: str = "batch") -> None:
    """Equal values in the same structure; containers of the batch's own type (a dict stands for any mapping)."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), path
        torch.testing.assert_close(actual, expected, rtol=0, atol=0, msg=path)
    elif isinstance(expected, np.ndarray):
        np.testing.assert_array_equal(actual, expected, err_msg=path)
    elif isinstance(expected, Mapping):
        assert isinstance(actual, Mapping) and list(actual) == list(expected), path
        for key in expected:
            _assert_same(actual[key], expected[key], f"{path}[{key!r}]")
    elif dataclasses.is_dataclass(expected):
        assert type(actual) is type(expected), path
        for f in dataclasses.fields(expected):
            _assert_same(getattr(actual, f.name), getattr(expected, f.name), f"{path}.{f.name}")
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected) and len(actual) == len(expected), path
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            _assert_same(a, e, f"{path}[{i}]")
    else:
        assert actual == expected, path


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for v in obj.values():
            yield from _tensors(v)
    elif dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            yield from _tensors(getattr(obj, f.name))
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


# ---- what a plan is -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_the_plan_says_what_is_per_sample_and_what_is_shared(name: str):
    make, _, roles = CASES[name]
    plan = plan_batch(make())
    assert plan.size == B
    assert plan.roles() == roles


@pytest.mark.parametrize("indices", [[4, 1, 5], [0, 2], [5, 4, 3, 2, 1, 0], [3]], ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_take_gives_the_samples_in_the_order_asked(name: str, indices: list[int]):
    make, expected, _ = CASES[name]
    batch = make()
    micro = plan_batch(batch).take(indices)
    assert type(micro) is type(batch)
    _assert_same(micro, expected(batch, indices))


def test_shared_values_are_given_as_they_are_and_the_batch_is_not_changed():
    before = {k: v.clone() for k, v in NESTED["inputs"].items()}
    micro = plan_batch(NESTED).take([5, 0])
    assert micro["temperature"] is TEMPERATURE and micro["config"] is CONFIG and micro["lr"] == 0.1
    assert micro["text"] is not TEXTS and NESTED["text"] == TEXTS
    for key, value in before.items():
        torch.testing.assert_close(NESTED["inputs"][key], value, rtol=0, atol=0)


def test_a_batch_encoding_keeps_its_type_and_state():
    batch = _encoding()
    micro = plan_batch(batch).take([3, 1])
    assert type(micro) is type(batch)
    assert micro.n_sequences == batch.n_sequences and micro.encodings == batch.encodings
    assert micro["input_ids"].tolist() == [batch["input_ids"][3].tolist(), batch["input_ids"][1].tolist()]


def test_a_dataclass_runs_its_post_init_again():
    micro = plan_batch(DATACLASS).take([0, 4, 2])
    assert int(micro.n_tokens) == 3 * L  # derived from the micro-batch's own ids
    assert micro.note == "train"


# ---- views and copies -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("indices", [range(2, 5), slice(2, 5), [2, 3, 4], torch.tensor([2, 3, 4])], ids=repr)
def test_consecutive_ascending_samples_are_views(indices: Any):
    micro = plan_batch(FLAT).take(indices)
    for key, value in FLAT.items():
        assert micro[key].data_ptr() == value[2].data_ptr(), key  # the same memory: no copy
        torch.testing.assert_close(micro[key], value[2:5], rtol=0, atol=0)


def test_any_other_samples_are_copies():
    micro = plan_batch(FLAT).take([4, 2])
    micro["input_ids"].zero_()
    assert FLAT["input_ids"][4].sum() > 0, "a copy: the batch is untouched"


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("micro_batch_size", [1, 4, B])
def test_split_is_take_of_consecutive_ranges(name: str, micro_batch_size: int):
    batch = CASES[name][0]()
    plan = plan_batch(batch)
    starts = range(0, B, micro_batch_size)
    ranges = [range(s, min(s + micro_batch_size, B)) for s in starts]
    split = plan.split(micro_batch_size)
    assert [m.size for m in split] == [len(r) for r in ranges]
    assert all(isinstance(m, MicroBatch) for m in split)
    for micro, samples, old in zip(split, ranges, split_batch(batch, micro_batch_size), strict=True):
        _assert_same(micro.batch, old)
        _assert_same(plan.take(samples), old)
        _assert_same(plan.take(list(samples)), old)
        for a, b in zip(_tensors(micro.batch), _tensors(plan.take(list(samples))), strict=True):
            assert a.ndim == 0 or a.data_ptr() == b.data_ptr()  # both views of the same rows


@pytest.mark.parametrize(
    "indices",
    [[1, 3], (1, 3), range(1, 4, 2), slice(1, 4, 2), torch.tensor([1, 3]), np.array([1, 3]), [np.int64(1), 3]],
    ids=repr,
)
def test_every_form_of_indices_gives_the_same_micro_batch(indices: Any):
    micro = plan_batch(NESTED).take(indices)
    _assert_same(micro, CASES["nested"][1](NESTED, [1, 3]))


def test_no_samples_give_an_empty_micro_batch():
    micro = plan_batch(NESTED).take([])
    assert micro["inputs"]["ids"].shape == (0, L) and micro["labels"][1].shape == (0, 2)
    assert micro["text"] == [] and micro["temperature"] is TEMPERATURE


# ---- trimming the sequence fields -----------------------------------------------------------------------------------


def _padded(lengths: list[int]) -> dict[str, Any]:
    """A right-padded step batch: token ids (0 is padding), its mask, labels (-100 on padding), per-sample values."""
    mask = torch.tensor([[1] * n + [0] * (L - n) for n in lengths])
    ids = torch.arange(1, len(lengths) * L + 1).reshape(len(lengths), L) * mask
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "labels": ids.masked_fill(mask == 0, -100),
        "hidden": torch.randn(len(lengths), L, 3),  # a sequence field with a feature dim after the sequence
        "weight": torch.rand(len(lengths)),  # per-sample, no sequence
        "spans": torch.zeros(len(lengths), L + 1),  # rows of another length on dim 1: not a sequence field
        "text": [f"sample {i}" for i in range(len(lengths))],
        "step": torch.tensor(7),
    }


def test_the_sequence_fields_are_the_tensors_of_the_padded_length():
    plan = plan_batch(_padded([2, 5, 1]))
    fields = ["batch['input_ids']", "batch['attention_mask']", "batch['labels']", "batch['hidden']"]
    assert plan.sequence_fields(sequence_dim=1, length=L) == fields
    assert plan.sequence_fields(sequence_dim=1, length=L + 1) == ["batch['spans']"]
    assert plan.sequence_fields(sequence_dim=2, length=3) == ["batch['hidden']"]


@pytest.mark.parametrize("indices", [[2, 0], range(0, 2)], ids=repr)
def test_take_trims_only_the_sequence_fields(indices: Any):
    batch = _padded([2, 5, 1])
    picked = list(indices)
    micro = plan_batch(batch).take(indices, trim=SequenceTrim(sequence_dim=1, from_length=L, to_length=2))
    for key in ("input_ids", "attention_mask", "labels", "hidden"):
        torch.testing.assert_close(micro[key], batch[key][picked][:, :2], rtol=0, atol=0, msg=key)
    for key in ("weight", "spans"):
        torch.testing.assert_close(micro[key], batch[key][picked], rtol=0, atol=0, msg=key)
    assert micro["text"] == [batch["text"][i] for i in picked] and micro["step"] is batch["step"]


def test_a_trim_of_consecutive_samples_is_a_view():
    batch = _padded([2, 5, 1])
    micro = plan_batch(batch).take(range(1, 3), trim=SequenceTrim(1, L, 3))
    assert micro["input_ids"].data_ptr() == batch["input_ids"][1].data_ptr()
    assert micro["input_ids"].shape == (2, 3)


def test_a_trim_to_the_padded_length_changes_nothing():
    batch = _padded([2, 5, 1])
    _assert_same(plan_batch(batch).take([2, 1], trim=SequenceTrim(1, L, L)), plan_batch(batch).take([2, 1]))


def test_a_trim_leaves_the_entries_of_per_sample_lists_whole():
    batch = {"ids": _ids(), "tokens": [torch.arange(L) for _ in range(B)]}  # a list of per-sample sequences
    micro = plan_batch(batch).take([1, 0], trim=SequenceTrim(1, L, 2))
    assert micro["ids"].shape == (2, 2) and [t.shape for t in micro["tokens"]] == [(L,), (L,)]


def test_a_trim_of_numpy_arrays():
    batch = {"ids": np.arange(B * L).reshape(B, L), "y": np.arange(B)}
    micro = plan_batch(batch).take([3, 0], trim=SequenceTrim(1, L, 2))
    np.testing.assert_array_equal(micro["ids"], batch["ids"][[3, 0], :2])
    np.testing.assert_array_equal(micro["y"], batch["y"][[3, 0]])


def test_sorted_by_length_and_trimmed_micro_batches_lose_no_token():
    # What split mode by tokens does with a step batch: order its samples by length, cut micro-batches of samples
    # that are not consecutive in the batch, and trim each to its own longest sequence. Pad each micro-batch back
    # and put its samples back in place: that must give the step batch again, every real token where it was.
    lengths = [3, 1, 5, 2, 4, 1]
    batch = _padded(lengths)
    plan = plan_batch(batch)
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    rebuilt = {key: torch.full_like(batch[key], -1) for key in ("input_ids", "attention_mask", "labels")}
    for group in (order[i : i + 2] for i in range(0, len(order), 2)):
        longest = max(lengths[i] for i in group)
        micro = plan.take(group, trim=SequenceTrim(1, L, longest))
        assert micro["input_ids"].shape == (len(group), longest)
        assert micro["text"] == [batch["text"][i] for i in group]
        for key, out in rebuilt.items():
            out[group, :longest] = micro[key]
            out[group, longest:] = batch[key][group, longest:]
            assert bool((batch["attention_mask"][group, longest:] == 0).all()), "only padding is trimmed"
    for key, out in rebuilt.items():
        torch.testing.assert_close(out, batch[key], rtol=0, atol=0, msg=key)


# ---- a known size, and the hooks ------------------------------------------------------------------------------------


def test_a_known_batch_size_chooses_the_reading():
    # Two entries of one structure, each a batch of 6 rows: 2 samples on their own, 2 fields of 6 samples when told.
    batches = [(_x(6, 2), _x(6)), (_x(6, 2), _x(6))]
    assert plan_batch(batches).roles() == {"batch": "entries"}
    plan = plan_batch(batches, batch_size=6)
    assert plan.size == 6 and set(plan.roles().values()) == {"rows"}
    assert [part[0].shape[0] for part in plan.take([5, 0, 1])] == [3, 3]


def test_hooks_plan_at_the_count_of_the_users_batch_size_of():
    batches = [(_x(6, 2), _x(6)), (_x(6, 2), _x(6))]
    assert resolve_batch_hooks(None).plan(batches).size == 2
    hooks = resolve_batch_hooks(None, batch_size_of=lambda batch: 6)
    plan = hooks.plan(batches)
    assert isinstance(plan, BatchPlan) and plan.size == 6
    torch.testing.assert_close(plan.take([4])[1][1], batches[1][1][[4]], rtol=0, atol=0)


def test_repr_shows_the_size_and_the_roles():
    assert repr(plan_batch({"x": _x(3, 2), "lr": 0.1})) == (
        "BatchPlan(size=3, roles={\"batch['x']\": 'rows', \"batch['lr']\": 'shared'})"
    )


# ---- errors ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("indices", "error", "match"),
    [
        ([B], ValueError, r"`indices` holds 6, but the batch has 6 samples: every index must be from 0 to 5"),
        ([0, -1], ValueError, r"`indices` holds -1.*Negative indices are not read from the end"),
        ([0.0, 1.0], TypeError, r"`indices` must hold ints \(sample indices\), got 0.0 of type float"),
        ([True], TypeError, r"`indices` must hold ints.*got True of type bool"),
        (torch.tensor([[0, 1]]), TypeError, r"`indices` must be a 1-D integer tensor.*shape \(1, 2\)"),
        (torch.tensor([0.0]), TypeError, r"`indices` must be a 1-D integer tensor.*dtype torch.float32"),
        (torch.tensor([True, False]), TypeError, r"dtype torch.bool.*`mask.nonzero\(\).flatten\(\)`"),
        ("01", TypeError, r"`indices` must be a slice, a range, a sequence of ints.*got '01' of type str"),
        (None, TypeError, r"`indices` must be a slice.*got None of type NoneType"),
    ],
    ids=repr,
)
def test_bad_indices_are_refused(indices: Any, error: type[Exception], match: str):
    with pytest.raises(error, match=match):
        plan_batch(FLAT).take(indices)


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        ((0, L, 2), ValueError, r"`sequence_dim` must be an int >= 1, got 0. Dim 0 holds the samples"),
        ((1, L, L + 1), ValueError, r"`to_length` must be at most `from_length=5` \(a trim only shortens\), got 6"),
        ((1, L, -1), ValueError, r"`to_length` must be an int >= 0, got -1"),
        ((1, 5.0, 2), TypeError, r"`from_length` must be an int >= 0, got 5.0 of type float"),
    ],
)
def test_bad_trims_are_refused(args: tuple[Any, ...], error: type[Exception], match: str):
    with pytest.raises(error, match=match):
        SequenceTrim(*args)


def test_a_trim_must_be_a_sequence_trim():
    with pytest.raises(TypeError, match=r"`trim` must be a SequenceTrim or None, got \(1, 5, 2\) of type tuple"):
        plan_batch(FLAT).take([0], trim=(1, 5, 2))  # type: ignore[arg-type]  # the wrong type, on purpose


def test_bad_sequence_field_arguments_are_refused():
    with pytest.raises(ValueError, match=r"`length` must be an int >= 0, got -1"):
        plan_batch(FLAT).sequence_fields(1, -1)
    with pytest.raises(ValueError, match=r"`sequence_dim` must be an int >= 1, got 0"):
        plan_batch(FLAT).sequence_fields(0, L)


def test_plan_batch_refuses_what_split_batch_refuses():
    with pytest.raises(ValueError, match=r"Cannot split `batch\['labels'\]`.*shape is \(7,\).*batch size 6"):
        plan_batch({"x": _x(B), "labels": _x(B + 1)})
    with pytest.raises(TypeError, match=r"Cannot split a batch of type Sized: the built-in rules cut tensors"):
        plan_batch(Sized())
    with pytest.raises(TypeError, match=r"Cannot tell how many samples are in a batch of type object"):
        plan_batch(object())
    with pytest.raises(ValueError, match=r"batch size 5 \(from the `batch_size=` argument\)"):
        plan_batch({"x": _x(B)}, batch_size=5)


class Sized:
    batch_size = B


class ReadOnly(h.ReadOnlyMapping):
    """A mapping whose constructor takes no dict."""

    key, size = "y", B


def test_a_mapping_that_cannot_be_rebuilt_is_named_where_it_is():
    plan = plan_batch({"x": _x(B), "inner": ReadOnly()})
    with pytest.raises(TypeError, match=r"Cannot split `batch\['inner'\]`: its mapping type ReadOnly can't be rebuilt"):
        plan.take([1, 0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="indices taken on a CUDA device need one")
def test_take_on_a_cuda_batch():
    batch = {"ids": _ids().cuda(), "cpu": _x(B), "text": TEXTS}
    micro = plan_batch(batch).take([4, 1], trim=SequenceTrim(1, L, 3))
    assert micro["ids"].device == batch["ids"].device and micro["cpu"].device.type == "cpu"
    torch.testing.assert_close(micro["ids"].cpu(), _ids()[[4, 1], :3], rtol=0, atol=0)
    torch.testing.assert_close(micro["cpu"], _x(B)[[4, 1]], rtol=0, atol=0)
