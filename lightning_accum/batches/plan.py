"""A batch read once into a plan, and cut by that plan: contiguous micro-batches, or any samples in any order.

`plan_batch` reads the batch (see `lightning_accum.batches` for the rules) into a `BatchPlan`, which knows what is
per-sample (tensors' rows, lists of entries) and what is shared. `BatchPlan.take` cuts any samples out of it with one
walker: a range gives views of the batch's tensors, any other list of indices gives copies (``index_select``), and a
`SequenceTrim` also shortens the sequence fields. `split_batch` and `batch_size_of` are the plan's two common uses.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import torch

from lightning_accum._util.validation import check_int
from lightning_accum.batches._reading import (
    Kind,
    Node,
    Reading,
    children_with_paths,
    declared_size,
    flat_size,
    is_structure,
    read_batch,
    walk,
)
from lightning_accum.batches._walk import Pick, RebuildError, RowOrder, as_selection, take
from lightning_accum.batches.trim import SequenceTrim

_NOT_CUT = (
    "Cannot split a batch of type {name}: the built-in rules cut tensors, mappings, sequences, namedtuples and"
    " dataclasses. Pass `split_batch=` (a function `split_batch(batch, micro_batch_size)` that returns a list of"
    " micro-batches) to the callback, or define `split_batch(self, batch, micro_batch_size)` on your LightningModule."
)


class MicroBatch(NamedTuple):
    """One micro-batch and its number of samples."""

    batch: Any
    size: int


class BatchPlan:
    """A batch read once: its number of samples, its per-sample parts and its shared ones, ready to be cut.

    Made by `plan_batch`. Every cut walks the plan, never the batch's structure again; the batch's tensors are cut
    along dim 0, its lists of entries (one per sample) by entry, and shared values are given as they are (the same
    object, not a copy). Containers are rebuilt with their own type (see `lightning_accum.batches`).

    Examples:
        >>> batch = {"x": torch.arange(10).view(5, 2), "text": list("abcde"), "lr": torch.tensor(0.1)}
        >>> plan = plan_batch(batch)
        >>> plan.size, plan.roles()
        (5, {"batch['x']": 'rows', "batch['text']": 'entries', "batch['lr']": 'shared'})
        >>> micro = plan.take([4, 1])
        >>> micro["x"].tolist(), micro["text"], micro["lr"] is batch["lr"]
        ([[8, 9], [2, 3]], ['e', 'b'], True)
        >>> [m.size for m in plan.split(2)]
        [2, 2, 1]
    """

    __slots__ = ("_batch", "_entries", "_root", "_size", "_trimmed")

    def __init__(self, batch: Any, reading: Reading) -> None:
        self._batch = batch
        self._size = reading.size
        self._root = reading.root
        self._entries = reading.entries
        self._trimmed: dict[frozenset[str], frozenset[Node]] = {}  # the nodes of a trim's named fields, found once

    @property
    def batch(self) -> Any:
        """The batch this plan cuts."""
        return self._batch

    @property
    def size(self) -> int:
        """The batch's number of samples."""
        return self._size

    def take(self, indices: slice | range | Sequence[int] | torch.Tensor, *, trim: SequenceTrim | None = None) -> Any:
        """The micro-batch of the samples at ``indices``, in that order, as the same structure as the batch.

        Args:
            indices: which samples: a ``slice`` or ``range``, a sequence of ints, or a 1-D integer tensor or array,
                each from 0 to ``size - 1``. Consecutive ascending indices give views of the batch's tensors; any
                others give copies.
            trim: shortens the sequence fields of the micro-batch (see `SequenceTrim`); ``None`` keeps them whole.

        Raises:
            TypeError: ``indices`` is not one of the above, or ``trim`` not a `SequenceTrim`, or a mapping type of the
                batch cannot be rebuilt from a dict.
            ValueError: an index is not from 0 to ``size - 1``.

        Examples:
            >>> x = torch.arange(6).view(3, 2)
            >>> plan = plan_batch({"x": x, "y": torch.arange(3)})
            >>> plan.take(range(1, 3))["x"].data_ptr() == x[1].data_ptr()  # consecutive samples: a view
            True
            >>> plan.take([2, 0])["y"].tolist()  # any others: a copy
            [2, 0]
        """
        if trim is not None and not isinstance(trim, SequenceTrim):
            raise TypeError(
                f"`trim` must be a SequenceTrim or None, got {trim!r} of type {type(trim).__name__}. Pass e.g."
                " `SequenceTrim(sequence_dim=1, from_length=padded_length, to_length=longest_taken)`."
            )
        return self._take(Pick(as_selection(indices, self._size), trim, trimmed=self._named_fields(trim)))

    def take_span(self, order: RowOrder, positions: range, *, trim: SequenceTrim | None = None) -> Any:
        """`take` of the samples ``order.indices[positions]``, from an order that several cuts share.

        The same micro-batch as ``take([order.indices[i] for i in positions], trim=trim)`` (views where those are
        consecutive and ascending), with the index tensor that ``order`` makes once per device, sliced, where they
        are not: no host-to-device copy per cut.
        """
        span = slice(positions.start, positions.stop)
        samples = as_selection(order.indices[span], self._size)
        trimmed = self._named_fields(trim)
        if isinstance(samples, slice):  # consecutive and ascending: views, as `take` gives them
            return self._take(Pick(samples, trim, trimmed=trimmed))
        return self._take(Pick(samples, trim, (order, span), trimmed=trimmed))

    def split(self, micro_batch_size: int) -> list[MicroBatch]:
        """Consecutive micro-batches of ``micro_batch_size`` samples (the last may be smaller): views, not copies.

        Raises:
            TypeError: ``micro_batch_size`` is not an int, or a mapping type cannot be rebuilt from a dict.
            ValueError: ``micro_batch_size < 1``.
        """
        check_int(micro_batch_size, "micro_batch_size", minimum=1)
        n = self._size
        return [
            MicroBatch(
                self._take(Pick(slice(start, min(start + micro_batch_size, n)), None)),
                min(micro_batch_size, n - start),
            )
            for start in range(0, n, micro_batch_size)
        ]

    def roles(self) -> dict[str, str]:
        """What each part of the batch is, by path.

        ``"rows"``: a tensor or array cut along dim 0; ``"entries"``: a list or tuple with one entry per sample, each
        entry taken whole; ``"shared"``: given as it is to every micro-batch.
        """
        return {path: role for path, role, _ in _parts(self._root, "batch", self._entries)}

    def row_tensors(self) -> list[Any]:
        """The tensors (and arrays) of the batch that are cut along dim 0, in the batch's order."""
        return [node.obj for _, role, node in _parts(self._root, "batch", self._entries) if role == "rows"]

    def row_paths(self) -> dict[str, Any]:
        """The tensors (and arrays) of the batch that are cut along dim 0, by path (``"batch['input_ids']"``)."""
        return {path: node.obj for path, role, node in _parts(self._root, "batch", self._entries) if role == "rows"}

    def sequence_fields(self, sequence_dim: int, length: int) -> list[str]:
        """The paths of the sequence fields: the tensors with rows whose dim ``sequence_dim`` has size ``length``.

        These are what a `SequenceTrim` of ``sequence_dim`` and ``from_length=length`` shortens.

        Raises:
            TypeError: an argument is not an int.
            ValueError: ``sequence_dim < 1`` or ``length < 0``.

        Examples:
            >>> plan = plan_batch({"ids": torch.zeros(3, 7), "mask": torch.ones(3, 7), "y": torch.zeros(3, 2)})
            >>> plan.sequence_fields(1, 7)
            ["batch['ids']", "batch['mask']"]
        """
        check_int(sequence_dim, "sequence_dim", 1, hint="Dim 0 holds the samples; the sequence is on another.")
        trim = SequenceTrim(sequence_dim, check_int(length, "length", 0), 0)
        return [
            path
            for path, role, node in _parts(self._root, "batch", self._entries)
            if role == "rows" and trim.applies_to(node.obj)
        ]

    def __repr__(self) -> str:
        return f"BatchPlan(size={self._size}, roles={self.roles()})"

    def _named_fields(self, trim: SequenceTrim | None) -> frozenset[Node] | None:
        """The nodes a trim with named ``fields`` shortens; ``None`` where it names none (every one of the length)."""
        if trim is None or trim.fields is None:
            return None
        nodes = self._trimmed.get(trim.fields)
        if nodes is None:
            nodes = frozenset(node for path, node in walk(self._root) if path in trim.fields)
            self._trimmed[trim.fields] = nodes
        return nodes

    def _take(self, pick: Pick) -> Any:
        try:
            return take(self._root, pick, self._entries)
        except RebuildError as error:
            path = next(path for path, node in walk(self._root) if node.obj is error.mapping)
            name = type(error.mapping).__name__
            raise TypeError(
                f"Cannot split `{path}`: its mapping type {name} can't be rebuilt as `{name}(dict)` ({error.cause})."
                " Convert it to a dict in your collate function."
            ) from error.cause


def plan_batch(batch: Any, *, batch_size: int | None = None, shared: frozenset[str] = frozenset()) -> BatchPlan:
    """Read ``batch`` once into a `BatchPlan`: its number of samples, and which of its parts are per-sample.

    Args:
        batch: the step batch: a tensor or any nesting of mappings, sequences, namedtuples and dataclasses.
        batch_size: the number of samples, when a hook already knows it; the batch is read to match it.
        shared: the paths of parts shared by all samples whatever their shape (``"batch['class_weights']"``): given
            whole to every micro-batch, and no evidence of the number of samples.

    Raises:
        TypeError: the batch is an object the built-in rules can't cut, or holds nothing that tells its size.
        ValueError: the batch's tensors disagree on their first dimension, or it reads as two different sizes
            equally well, or as none of ``batch_size`` samples (the message names the element and its shape).

    Examples:
        >>> plan = plan_batch([(torch.zeros(3, 8, 8), {"boxes": torch.zeros(i + 1, 4)}) for i in range(4)])
        >>> plan.size, plan.roles()
        (4, {'batch': 'entries'})
    """
    return _plan(batch, batch_size, "the `batch_size=` argument", "split", shared)


def num_micro_batches(step_batch_size: int, micro_batch_size: int) -> int:
    """How many micro-batches of at most ``micro_batch_size`` samples a batch of ``step_batch_size`` needs.

    Raises:
        TypeError: if an argument is not an int.
        ValueError: if ``step_batch_size < 0`` or ``micro_batch_size < 1``.

    Examples:
        >>> num_micro_batches(10, 4), num_micro_batches(8, 4), num_micro_batches(3, 8)
        (3, 2, 1)
    """
    check_int(step_batch_size, "step_batch_size", minimum=0)
    check_int(micro_batch_size, "micro_batch_size", minimum=1)
    return math.ceil(step_batch_size / micro_batch_size)


def batch_size_of(batch: Any) -> int:
    """Number of samples in a batch: the first dimension of its tensors that have one, or its number of entries.

    See `lightning_accum.batches` for how each kind of element is read; `split_batch` reads the batch the same way.

    Raises:
        ValueError: the batch's tensors disagree on their first dimension (the message names them and their
            shapes), or the batch reads as two different sizes equally well, or a batch object's ``batch_size`` is
            negative.
        TypeError: the batch holds no tensor with a batch dimension and no list, or is an object with neither a
            ``batch_size`` attribute nor ``__len__``, or that ``batch_size`` is not an int.

    Examples:
        >>> batch_size_of({"input_ids": torch.zeros(3, 7), "labels": torch.zeros(3, 7)})
        3
        >>> batch_size_of({"temperature": torch.tensor(0.7), "x": torch.zeros(5, 2)})
        5
        >>> batch_size_of([(torch.zeros(3, 8, 8), {"boxes": torch.zeros(2, 4)})] * 4)  # 4 (image, target) samples
        4
    """
    size = flat_size(batch)  # the common case needs no tree
    return size if size is not None else read_batch(batch, *declared_size(batch)).size


def split_batch(batch: Any, micro_batch_size: int, *, batch_size: int | None = None) -> list[Any]:
    """Cut ``batch`` into micro-batches of ``micro_batch_size`` samples (the last may be smaller).

    Concatenating the micro-batches' tensors along dim 0 gives back the batch's tensors. Their tensors are views of
    the batch's, not copies. An empty batch (0 samples) gives an empty list. See `lightning_accum.batches` for how
    each kind of element is treated; ``plan_batch(batch).split(micro_batch_size)`` does the same with the sizes.

    Args:
        batch: the step batch: a tensor or any nesting of mappings, sequences, namedtuples and dataclasses.
        micro_batch_size: the most samples in one micro-batch.
        batch_size: the number of samples, when a hook already knows it; the batch is read to match it.

    Raises:
        TypeError: if ``micro_batch_size`` is not an int, the batch is an object the built-in rules can't cut, or a
            mapping type cannot be rebuilt from a dict.
        ValueError: if ``micro_batch_size < 1``, or a tensor's first dimension is not the batch size (the message
            names the element, e.g. ``batch['labels']``).

    Examples:
        >>> batch = {"x": torch.arange(10).view(5, 2), "y": torch.arange(5), "lr": 0.1, "text": list("abcde")}
        >>> micro_batches = split_batch(batch, 2)
        >>> [m["y"].tolist() for m in micro_batches], [m["text"] for m in micro_batches], micro_batches[2]["lr"]
        ([[0, 1], [2, 3], [4]], [['a', 'b'], ['c', 'd'], ['e']], 0.1)
    """
    check_int(micro_batch_size, "micro_batch_size", minimum=1)
    return [micro.batch for micro in plan_batch(batch, batch_size=batch_size).split(micro_batch_size)]


def _plan(batch: Any, size: int | None, source: str, verb: str, shared: frozenset[str] = frozenset()) -> BatchPlan:
    """The plan of ``batch`` at ``size`` samples (from ``source``), or at the size the batch states or shows."""
    if size is not None:
        check_int(size, "batch_size", minimum=0)
    else:
        size, source = declared_size(batch)
    if not is_structure(batch):
        if verb == "count":
            read_batch(batch, size, source, verb)  # counting speaks first: why the batch has no size, if it has none
        raise TypeError(_NOT_CUT.format(name=type(batch).__name__))
    return BatchPlan(batch, read_batch(batch, size, source, verb, shared))


def _parts(node: Node, path: str, entries: frozenset[Node]) -> Iterator[tuple[str, str, Node]]:
    """The plan's leaves: each part that is cut or shared as a whole, with its path and role."""
    if node.kind is Kind.ROWS or node.kind is Kind.SHARED:
        yield path, node.kind.value, node
    elif node.kind is Kind.SEQUENCE and node in entries:
        yield path, "entries", node
    elif node.kind is Kind.SEQUENCE and not node.holds_rows:
        yield path, "shared", node
    else:
        for child_path, child in children_with_paths(node, path):
            yield from _parts(child, child_path, entries)
