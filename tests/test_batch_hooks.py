"""The user's hooks for counting and cutting batches: ``split_batch`` and ``batch_size_of``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_accum.batches import BatchHooks, MicroBatch, batch_size_of, resolve_batch_hooks, split_batch


class Packed:
    """A custom batch: samples packed into one flat tensor, with their lengths (no sample dimension to cut)."""

    def __init__(self, lengths: list[int]) -> None:
        self.lengths = lengths
        self.tokens = torch.arange(sum(lengths))

    def __len__(self) -> int:
        return len(self.lengths)


def split_packed(batch: Packed, micro_batch_size: int) -> list[Packed]:
    chunks = []
    for start in range(0, len(batch.lengths), micro_batch_size):
        chunks.append(Packed(batch.lengths[start : start + micro_batch_size]))
    return chunks


def count_packed(batch: Packed) -> int:
    return len(batch.lengths)


class WithHooks(nn.Module):
    def split_batch(self, batch: Any, micro_batch_size: int) -> list[Any]:
        return split_packed(batch, micro_batch_size)

    def batch_size_of(self, batch: Any) -> int:
        return count_packed(batch)


class Plain(nn.Module):
    pass


# ---- precedence -----------------------------------------------------------------------------------------------------


def test_built_in_rules_when_nothing_is_given():
    hooks = resolve_batch_hooks(Plain())
    assert hooks == BatchHooks()
    assert hooks.split_batch_source == hooks.batch_size_of_source == "the built-in rules"
    batch = {"x": torch.zeros(5, 2)}
    assert hooks.batch_size(batch) == 5 == batch_size_of(batch)
    assert [(m.batch["x"].shape[0], m.size) for m in hooks.split(batch, 2)] == [(2, 2), (2, 2), (1, 1)]


def test_module_methods_are_used():
    module = WithHooks()
    hooks = resolve_batch_hooks(module)
    assert hooks.split_batch_source == "`WithHooks.split_batch`"
    assert hooks.batch_size_of_source == "`WithHooks.batch_size_of`"
    micro = hooks.split(Packed([3, 1, 2, 5, 4]), 2)
    assert [m.size for m in micro] == [2, 2, 1]
    assert [m.batch.lengths for m in micro] == [[3, 1], [2, 5], [4]]


def test_arguments_take_precedence_over_module_methods():
    calls: list[str] = []

    def my_split(batch: Packed, micro_batch_size: int) -> list[Packed]:
        calls.append("split")
        return split_packed(batch, micro_batch_size)

    def my_count(batch: Packed) -> int:
        calls.append("count")
        return count_packed(batch)

    hooks = resolve_batch_hooks(WithHooks(), split_batch=my_split, batch_size_of=my_count)
    assert hooks.split_batch_source == "the `split_batch=` argument (my_split)"
    assert hooks.batch_size_of_source == "the `batch_size_of=` argument (my_count)"
    hooks.split(Packed([1, 1, 1]), 2)
    assert calls[0] == "count" and "split" in calls and "count" in calls[2:]


def test_one_hook_from_each_place():
    hooks = resolve_batch_hooks(WithHooks(), batch_size_of=count_packed)
    assert hooks.batch_size_of_source.startswith("the `batch_size_of=` argument")
    assert hooks.split_batch_source == "`WithHooks.split_batch`"


def test_no_module():
    assert resolve_batch_hooks(None) == BatchHooks()
    assert resolve_batch_hooks(None, split_batch=split_packed).split_batch is split_packed


def test_hooks_can_be_given_as_import_paths():
    # LightningCLI YAML and `ddp_spawn` can't carry lambdas; an import path works in both.
    hooks = resolve_batch_hooks(
        None, split_batch="tests.test_batch_hooks:split_packed", batch_size_of="tests.test_batch_hooks.count_packed"
    )
    assert hooks.split_batch is split_packed and hooks.batch_size_of is count_packed


def test_a_submodule_named_like_a_hook_is_not_a_hook():
    module = nn.Module()
    module.split_batch = nn.Linear(2, 2)  # registered as a submodule, not a method
    assert resolve_batch_hooks(module) == BatchHooks()


def test_a_hook_set_on_the_instance_is_used():
    module = Plain()
    module.batch_size_of = count_packed
    assert resolve_batch_hooks(module).batch_size_of is count_packed


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"split_batch": 3}, TypeError, r"`split_batch` must be a function `split_batch\(batch, micro_batch_size\)`"),
        ({"batch_size_of": "not a path"}, ValueError, r"`batch_size_of='not a path'` is not an import path"),
        ({"batch_size_of": "math:pi"}, TypeError, r"`batch_size_of='math:pi'` names 3.14.*not callable"),
    ],
)
def test_bad_hook_arguments(kwargs: dict[str, Any], error: type[Exception], match: str):
    with pytest.raises(error, match=match):
        resolve_batch_hooks(None, **kwargs)


def test_a_non_callable_module_attribute_is_refused():
    class Odd(nn.Module):
        split_batch = 4

    with pytest.raises(
        TypeError, match=r"`Odd.split_batch` must be a method `split_batch\(self, batch, micro_batch_size\)`"
    ):
        resolve_batch_hooks(Odd())


# ---- the split hook's contract --------------------------------------------------------------------------------------


def _hooks(split: Any, count: Any = count_packed) -> BatchHooks:
    return resolve_batch_hooks(None, split_batch=split, batch_size_of=count)


@pytest.mark.parametrize(
    ("split", "error", "match"),
    [
        (
            lambda b, m: split_packed(b, m)[:-1],
            ValueError,
            r"returned micro-batches of 2 \+ 2 = 4 samples for a step batch of 5",
        ),
        (
            lambda b, m: [*split_packed(b, m), Packed([1])],
            ValueError,
            r"of 2 \+ 2 \+ 1 \+ 1 = 6 samples for a step batch of 5",
        ),
        (lambda b, m: [b], ValueError, r"micro-batch 0 holds 5 samples, more than `micro_batch_size=2`"),
        (lambda b, m: [Packed([]), *split_packed(b, m)], ValueError, r"micro-batch 0 holds 0 samples"),
        (lambda b, m: iter(split_packed(b, m)), TypeError, r"must return a list of micro-batches, got list_iterator"),
        (lambda b, m: None, TypeError, r"must return a list of micro-batches, got NoneType"),
    ],
    ids=["drops-a-micro-batch", "adds-one", "too-large", "empty-micro-batch", "iterator", "none"],
)
def test_a_split_that_breaks_the_contract_is_refused(split: Any, error: type[Exception], match: str):
    with pytest.raises(error, match=r"`split_batch` \(the `split_batch=` argument.*" + match):
        _hooks(split).split(Packed([1, 2, 3, 4, 5]), 2)


def test_a_tuple_of_micro_batches_is_accepted():
    micro = _hooks(lambda b, m: tuple(split_packed(b, m))).split(Packed([1, 2, 3]), 2)
    assert micro == [MicroBatch(micro[0].batch, 2), MicroBatch(micro[1].batch, 1)]


def test_an_empty_step_batch_splits_into_nothing():
    assert _hooks(split_packed).split(Packed([]), 4) == []
    assert resolve_batch_hooks(None).split({"x": torch.zeros(0, 3)}, 4) == []


@pytest.mark.parametrize(
    ("count", "error", "match"),
    [
        (
            lambda b: 2.5,
            TypeError,
            r"`batch_size_of` \(the `batch_size_of=` argument.*must return an int >= 0 .*got 2.5 of type float",
        ),
        (
            lambda b: -1,
            ValueError,
            r"`batch_size_of` \(the `batch_size_of=` argument.*must return an int >= 0 .*got -1",
        ),
    ],
)
def test_a_batch_size_hook_must_return_a_count(count: Any, error: type[Exception], match: str):
    with pytest.raises(error, match=match):
        resolve_batch_hooks(None, batch_size_of=count).batch_size({"x": torch.zeros(3)})


def test_a_batch_size_hook_may_return_numpy_or_tensor_integers():
    np = pytest.importorskip("numpy")
    assert resolve_batch_hooks(None, batch_size_of=lambda b: np.int64(3)).batch_size(None) == 3
    assert resolve_batch_hooks(None, batch_size_of=lambda b: torch.tensor(4)).batch_size(None) == 4


def test_a_batch_size_hook_guides_the_built_in_split():
    # The built-in rules read this list of two (x, y) batches as 2 samples; the hook says each has 6 rows.
    batch = [(torch.zeros(6, 2), torch.zeros(6)), (torch.zeros(6, 2), torch.zeros(6))]
    micro = resolve_batch_hooks(None, batch_size_of=lambda b: len(b[0][0])).split(batch, 4)
    assert [m.size for m in micro] == [4, 2]
    assert [[part[0].shape[0] for part in m.batch] for m in micro] == [[4, 4], [2, 2]]


def test_built_in_split_matches_split_batch():
    batch = {"x": torch.arange(10), "ids": list(range(10))}
    micro = resolve_batch_hooks(None).split(batch, 4)
    assert [m.batch["ids"] for m in micro] == [c["ids"] for c in split_batch(batch, 4)]
    assert [m.size for m in micro] == [4, 4, 2]
