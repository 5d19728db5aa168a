"""The one walker: it cuts a batch by its plan, for any samples, in any order, with its sequence fields trimmed.

`take` goes down the tree `lightning_accum.batches._reading.classify` made of the batch and rebuilds it from the
picked parts: rows of tensors (a slice gives views, indices give ``index_select`` copies), entries of per-sample lists,
and shared values as they are. It reads nothing of the batch that the tree doesn't already say.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import UserDict
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lightning_accum._util.validation import as_whole_number
from lightning_accum.batches._reading import Kind, Node, is_array

if TYPE_CHECKING:
    from lightning_accum.batches.trim import SequenceTrim


class RowOrder:
    """Sample indices in an order that several cuts take spans of: an index tensor made once per device.

    Split by tokens takes each micro-batch as a span of the step's samples sorted by length. Made per micro-batch, the
    index tensor is a host-to-device copy per micro-batch, which on CUDA waits for the work queued before it; made
    once, each micro-batch slices it (a view).
    """

    __slots__ = ("_on_device", "indices")

    def __init__(self, indices: list[int]) -> None:
        self.indices = indices
        self._on_device: dict[torch.device, Tensor] = {}

    def on(self, device: torch.device) -> Tensor:
        index = self._on_device.get(device)
        if index is None:
            index = self._on_device[device] = torch.tensor(self.indices, dtype=torch.long, device=device)
        return index


class Pick:
    """The samples one cut takes (a slice, or indices in order), and the trim of its sequence fields.

    ``span`` says that the indices are ``order.indices[span]``, whose index tensor ``order`` already holds.
    """

    __slots__ = ("_on_device", "samples", "span", "trim", "trimmed")

    def __init__(
        self,
        samples: slice | list[int],
        trim: SequenceTrim | None,
        span: tuple[RowOrder, slice] | None = None,
        trimmed: frozenset[Node] | None = None,
    ) -> None:
        self.samples = samples
        self.trim = trim
        self.span = span
        self.trimmed = trimmed  # the only nodes the trim shortens, where it names its fields
        self._on_device: dict[torch.device, Tensor] = {}  # the indices as a tensor, made once per device

    def of_rows(self, obj: Any, node: Node | None = None) -> Any:
        """The picked rows of a tensor or array with the batch on dim 0 (trimmed first: less to copy)."""
        trim = self.trim
        named = self.trimmed is None or node in self.trimmed
        if trim is not None and named and trim.to_length != trim.from_length and trim.applies_to(obj):
            if isinstance(obj, Tensor):
                obj = obj.narrow(trim.sequence_dim, 0, trim.to_length)
            else:
                obj = obj[(slice(None),) * trim.sequence_dim + (slice(0, trim.to_length),)]
        samples = self.samples
        if isinstance(samples, slice):
            return obj[samples]
        if not isinstance(obj, Tensor):
            return obj[samples]  # a NumPy array: fancy indexing
        if self.span is not None:
            order, positions = self.span
            return obj.index_select(0, order.on(obj.device)[positions])
        index = self._on_device.get(obj.device)
        if index is None:
            index = self._on_device[obj.device] = torch.tensor(samples, dtype=torch.long, device=obj.device)
        return obj.index_select(0, index)

    def of_entries(self, seq: list[Any] | tuple[Any, ...]) -> Any:
        """The picked entries of a list or tuple with one entry per sample, in a container of its type."""
        samples = self.samples
        # Subclasses of list and tuple (not namedtuples: never read as entries) take an iterable, like their base.
        return type(seq)(list(seq[samples]) if isinstance(samples, slice) else [seq[i] for i in samples])


def take(node: Node, pick: Pick, entries: frozenset[Node]) -> Any:
    """The part of ``node`` that ``pick`` takes: the one walker behind every cut."""
    kind = node.kind
    if kind is Kind.ROWS:
        return pick.of_rows(node.obj, node)
    if kind is Kind.SHARED:
        return node.obj
    if kind is Kind.SEQUENCE:
        if node in entries:
            return pick.of_entries(node.obj)
        if not node.holds_rows:
            return node.obj  # configuration, shared
        return type(node.obj)([take(child, pick, entries) for child in node.children])
    if kind is Kind.NAMEDTUPLE:
        return type(node.obj)(*(take(child, pick, entries) for child in node.children))
    if kind is Kind.MAPPING:
        values = {k: take(child, pick, entries) for k, child in zip(node.keys, node.children, strict=True)}
        return _rebuild_mapping(node.obj, values)
    return _take_dataclass(node, pick, entries)


class RebuildError(Exception):
    """A mapping type that can't be rebuilt from a dict; `BatchPlan` names where it is in the batch."""

    def __init__(self, mapping: Mapping[Any, Any], cause: Exception) -> None:
        super().__init__(str(cause))
        self.mapping = mapping
        self.cause = cause


def _rebuild_mapping(obj: Mapping[Any, Any], values: dict[Any, Any]) -> Any:
    if type(obj) is dict:
        return values
    if isinstance(obj, UserDict):
        # BatchEncoding & co. carry more than their data (encodings, tensor type); keep it, swap the data.
        new = copy.copy(obj)
        new.data = values
        return new
    if isinstance(obj, dict):
        # A shallow copy keeps what the constructor can't be given again (defaultdict's default_factory).
        new_dict = copy.copy(obj)
        new_dict.clear()
        new_dict.update(values)
        return new_dict
    try:
        return type(obj)(values)  # type: ignore[call-arg]  # a Mapping subclass's constructor is unknown; tried here
    except Exception as err:
        raise RebuildError(obj, err) from err


def _take_dataclass(node: Node, pick: Pick, entries: frozenset[Node]) -> Any:
    obj = node.obj
    fields = dataclasses.fields(obj)
    children = dict(zip(node.keys, node.children, strict=True))
    new = dataclasses.replace(obj, **{f.name: take(children[f.name], pick, entries) for f in fields if f.init})
    for f in fields:
        if not f.init and not hasattr(new, f.name):
            # A field outside __init__ is usually derived in __post_init__, which replace() just re-ran on the
            # micro-batch; only one that nothing set is cut from the original (object.__setattr__ works when frozen).
            object.__setattr__(new, f.name, take(children[f.name], pick, entries))
    return new


def as_selection(indices: Any, size: int) -> slice | list[int]:
    """``indices`` as a slice where they are consecutive and ascending (views), else as a list (copies)."""
    listed: list[int]
    if isinstance(indices, slice):
        start, stop, step = indices.indices(size)
        if step == 1:
            return slice(start, max(start, stop))
        indices = range(start, stop, step)
    if isinstance(indices, Tensor) or is_array(indices):
        if indices.ndim != 1 or not _is_integer_dtype(indices):
            raise TypeError(
                f"`indices` must be a 1-D integer tensor or array of sample indices, got one of shape"
                f" {tuple(indices.shape)} and dtype {indices.dtype}. For a mask, pass `mask.nonzero().flatten()`."
            )
        listed = indices.tolist()
    elif isinstance(indices, (Sequence, range)) and not isinstance(indices, (str, bytes)):
        listed = [i if type(i) is int else as_whole_number(i) for i in indices]
        odd = [i for i in listed if isinstance(i, bool) or not isinstance(i, int)]
        if odd:
            raise TypeError(
                f"`indices` must hold ints (sample indices), got {odd[0]!r} of type {type(odd[0]).__name__} in it."
            )
    else:
        raise TypeError(
            "`indices` must be a slice, a range, a sequence of ints, or a 1-D integer tensor or array of sample"
            f" indices, got {indices!r} of type {type(indices).__name__}."
        )
    outside = next((i for i in listed if not 0 <= i < size), None)
    if outside is not None:
        raise ValueError(
            f"`indices` holds {outside}, but the batch has {size} samples: every index must be from 0 to {size - 1}."
            " Negative indices are not read from the end."
        )
    if not listed:
        return slice(0, 0)
    first = listed[0]
    if listed[-1] - first == len(listed) - 1 and all(i == first + k for k, i in enumerate(listed)):
        return slice(first, first + len(listed))
    return listed


def _is_integer_dtype(array: Any) -> bool:
    if isinstance(array, Tensor):
        return not (array.is_floating_point() or array.is_complex() or array.dtype == torch.bool)
    return array.dtype.kind in "iu"
