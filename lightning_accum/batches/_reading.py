"""Reading a batch: one walk that classifies its parts, then the choice of how many samples it holds.

`classify` walks the batch once and builds a tree of `Node`, one per part: a tensor with rows, a shared value, a
mapping, a namedtuple, a dataclass, or a list/tuple. Only a list or tuple is ambiguous: it can be a list of *fields*
(each element holds the samples' rows), a list of *entries* (one per sample), or shared configuration. `readings_of`
then weighs the tree (not the batch): an `Option` is one way of reading a part, for one number of samples. A reading
of the whole batch is the sizes of all its parts agreeing; its ``cost`` counts the lists read against their kind's
preference (`lightning_accum.batches` says which), and the cheapest reading wins. What `read_batch` returns, the
size, the tree and the set of lists that hold one entry per sample, is all a `BatchPlan` needs to cut the batch.
"""

from __future__ import annotations

import dataclasses
import enum
import sys
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, NamedTuple

import torch
from torch import Tensor

from lightning_accum._util.validation import as_whole_number, check_int

HOW_TO_FIX = (
    "Put the samples on dim 0, or pass a value shared by all samples as a 0-dim tensor or a Python object. For a"
    " batch the built-in rules can't read, pass `batch_size_of=` (a function of the batch that returns its number of"
    " samples; in split mode also `split_batch=`) to the callback, or define these methods on your LightningModule."
)


class Kind(enum.Enum):
    """What a part of a batch is, for cutting it."""

    ROWS = "rows"  # a tensor or NumPy array with a batch dimension: each micro-batch takes its rows
    SHARED = "shared"  # a 0-dim tensor, None, a number, a string, any other object: given whole to every micro-batch
    SEQUENCE = "sequence"  # a list or tuple: fields, entries or shared, as the reading says (`Reading.entries`)
    MAPPING = "mapping"
    NAMEDTUPLE = "namedtuple"
    DATACLASS = "dataclass"


_CONTAINERS = (Kind.SEQUENCE, Kind.MAPPING, Kind.NAMEDTUPLE, Kind.DATACLASS)


@dataclasses.dataclass(eq=False)
class Node:
    """One part of a batch. Hashed by identity: a reading names its lists of entries by their nodes."""

    __slots__ = ("children", "holds_rows", "keys", "kind", "obj")

    kind: Kind
    obj: Any
    # A list or tuple of plain values (texts, ids) has no children: nothing in it is read entry by entry.
    children: tuple[Node, ...]
    keys: tuple[Any, ...]  # a mapping's keys, a namedtuple's or dataclass's field names; () for a list or tuple
    holds_rows: bool  # a tensor with a batch dimension is in it (or it is one)


class Reading(NamedTuple):
    """How a batch is read: its number of samples, its tree, and the lists that hold one entry per sample."""

    size: int
    root: Node
    entries: frozenset[Node]


class Option(NamedTuple):
    """One consistent reading of a node: the samples it implies, and which of its lists hold one entry per sample.

    ``cost`` counts the lists read against their kind's preference; the cheapest reading wins. The other fields
    describe a list read as entries, for the rule that pairs it with a sibling of its length.
    """

    size: int | None  # None: the node implies no size (it is shared)
    cost: int = 0
    entries: frozenset[Node] = frozenset()  # every list/tuple read as one entry per sample
    samples_len: int | None = None  # this node is a list read as entries, of this length
    waivable: int = 0  # ... whose cost is waived next to another list of entries of its length
    needs_sibling: bool = False  # ... valid only next to another list of entries of its length


_SHARED = Option(None)
_PLAIN = (str, int, float, bool, bytes, type(None))


# ----------------------------------------------------------------------------------------------------------------------
# the reading
# ----------------------------------------------------------------------------------------------------------------------


def read_batch(
    batch: Any, size: int | None = None, source: str = "", verb: str = "count", shared: frozenset[str] = frozenset()
) -> Reading:
    """The reading of ``batch`` with the most preferred lists, of ``size`` samples if given (from ``source``).

    ``verb`` (``"count"`` or ``"split"``) says what the caller was doing, for the error messages. The parts at the
    paths in ``shared`` (``"batch['weights']"``, see `name_paths`) are read as shared, whatever their shape.
    """
    flat = flat_size(batch) if not shared else None
    if flat is not None and size in (None, flat):
        return Reading(flat, classify(batch), frozenset())
    root = classify(batch)
    if shared:
        root = mark_shared(root, shared)
    readings = combine([readings_of(root)])
    if size is not None:
        at_size = [o for o in readings if o.size == size]
        if not at_size and not is_structure(batch):
            at_size = readings  # an object that states its size and isn't cut by the built-in rules
        if not at_size:
            raise ValueError(_disagreement(root, verb, size, source))
        return Reading(size, root, min(at_size, key=lambda o: o.cost).entries)
    sized = [(o.size, o) for o in readings if o.size is not None]
    if not sized:
        if readings:
            raise TypeError(
                f"Cannot tell how many samples are in a batch of type {type(batch).__name__}: it holds no tensor with"
                " a batch dimension (dim >= 1) and no list of samples. " + HOW_TO_FIX
            )
        raise ValueError(_disagreement(root, verb, None, ""))
    cheapest = min(o.cost for _, o in sized)
    best = [(n, o) for n, o in sized if o.cost == cheapest]
    if len(best) > 1:
        paths = {node: path for path, node in walk(root)}
        described = " or as ".join(_describe(n, o, paths) for n, o in sorted(best, key=lambda b: b[0]))
        raise ValueError(
            f"The batch can be read as {described}: the built-in rules can't tell which. Pass `batch_size_of=` (a"
            " function of the batch that returns its number of samples) to the callback, or define"
            " `batch_size_of(self, batch)` on your LightningModule."
        )
    return Reading(best[0][0], root, best[0][1].entries)


def flat_size(batch: Any) -> int | None:
    """The size of the common case, a tensor or a flat structure of tensors and values that agree; else ``None``.

    Such a batch has no list to weigh: its reading is its tensors' first dimension.
    """
    if isinstance(batch, Tensor):
        return int(batch.shape[0]) if batch.ndim > 0 else None
    if isinstance(batch, Mapping):
        values: Iterable[Any] = batch.values()
    elif isinstance(batch, (list, tuple)) and batch:  # namedtuples too
        values = batch
    else:
        return None
    size = None
    for value in values:
        if isinstance(value, Tensor):
            if value.ndim > 0:
                if size is not None and value.shape[0] != size:
                    return None
                size = value.shape[0]
        elif isinstance(value, (Mapping, list, tuple)) or is_array(value) or _is_dataclass_instance(value):
            return None
    return None if size is None else int(size)


def classify(obj: Any) -> Node:
    """The tree of ``obj``: the one walk over the batch.

    What the tree doesn't settle, how many samples there are and so how to read each list, `readings_of` weighs on
    the tree, without going back to the batch.
    """
    if isinstance(obj, Tensor):
        return Node(Kind.ROWS, obj, (), (), True) if obj.ndim > 0 else Node(Kind.SHARED, obj, (), (), False)
    exact = type(obj)  # the built-in containers first: the abstract checks below cost more
    if exact is dict:
        return _container(Kind.MAPPING, obj, tuple(obj), obj.values())
    if exact is list or exact is tuple:
        return _sequence(obj)
    if is_array(obj):
        return Node(Kind.ROWS, obj, (), (), True) if obj.ndim > 0 else Node(Kind.SHARED, obj, (), (), False)
    if isinstance(obj, Mapping):
        return _container(Kind.MAPPING, obj, tuple(obj), obj.values())
    if _is_namedtuple(obj):
        return _container(Kind.NAMEDTUPLE, obj, obj._fields, obj)
    if isinstance(obj, (list, tuple)):
        return _sequence(obj)
    if _is_dataclass_instance(obj):
        names = tuple(f.name for f in dataclasses.fields(obj))
        return _container(Kind.DATACLASS, obj, names, [getattr(obj, name) for name in names])
    return Node(Kind.SHARED, obj, (), (), False)


def name_paths(name: str | int) -> frozenset[str]:
    """The paths a user's name of a part of the batch can mean, as `walk` writes them.

    A str is a mapping key or an attribute at the top of the batch (``"labels"``), or a whole path that starts with
    ``batch`` (``"batch['inputs']['ids']"``); an int is a position in a tuple batch.

    Examples:
        >>> sorted(name_paths("labels"))
        ['batch.labels', "batch['labels']"]
        >>> sorted(name_paths(1)), sorted(name_paths("batch['inputs']['ids']"))
        (['batch[1]'], ["batch['inputs']['ids']"])
    """
    if isinstance(name, int):
        return frozenset({f"batch[{name}]"})
    if name == "batch" or name.startswith(("batch[", "batch.")):
        return frozenset({name})
    return frozenset({f"batch[{name!r}]", f"batch.{name}"})


def mark_shared(root: Node, shared: frozenset[str], path: str = "batch") -> Node:
    """The tree with its parts at the paths in ``shared`` read as shared values: given whole to every micro-batch."""
    if path in shared:
        return Node(Kind.SHARED, root.obj, (), (), False)
    if not root.children:
        return root
    children = tuple(mark_shared(child, shared, child_path) for child_path, child in children_with_paths(root, path))
    if all(new is old for new, old in zip(children, root.children, strict=True)):
        return root
    return Node(root.kind, root.obj, children, root.keys, any(child.holds_rows for child in children))


def _sequence(obj: list[Any] | tuple[Any, ...]) -> Node:
    if all(type(v) in _PLAIN or not is_structure(v) for v in obj):
        return Node(Kind.SEQUENCE, obj, (), (), False)  # texts, ids: no node per entry
    return _container(Kind.SEQUENCE, obj, (), obj)


def _container(kind: Kind, obj: Any, keys: tuple[Any, ...], values: Iterable[Any]) -> Node:
    children = tuple([classify(v) for v in values])
    return Node(kind, obj, children, keys, any([child.holds_rows for child in children]))


def readings_of(node: Node) -> list[Option]:
    """The readings of ``node``, one per number of samples it can hold (and one for shared, where it can be)."""
    if node.kind is Kind.ROWS:
        return [Option(int(node.obj.shape[0]))]
    if node.kind is Kind.SHARED:
        return [_SHARED]
    if node.kind is Kind.SEQUENCE:
        return _sequence_options(node)
    return combine(readings_of(child) for child in node.children)


def _sequence_options(node: Node) -> list[Option]:
    n = len(node.obj)
    if not node.holds_rows:
        # Per-sample Python data (texts, ids, 0-dim labels) when its length is the batch size; else shared.
        return [Option(n, entries=frozenset({node}), samples_len=n), _SHARED]
    fields = combine(readings_of(child) for child in node.children)
    tensors = all(child.kind is Kind.ROWS for child in node.children)
    containers = all(child.kind in _CONTAINERS for child in node.children)
    of_samples = (tensors or containers) and len({signature(child) for child in node.children}) == 1
    # A list of containers of one structure prefers to be a list of samples: reading it as fields costs one.
    extra = 1 if containers and of_samples else 0
    options = [Option(f.size, f.cost + extra, f.entries) for f in fields]
    if of_samples:
        as_samples = frozenset({node})
        if tensors:
            # A tensor with the batch on dim 0 means this is a structure like (x, y) with an error in it, unless a
            # sibling list of samples shows the transposed form (images next to targets).
            needs_sibling = any(child.obj.shape[0] == n for child in node.children)
            options.append(Option(n, 1, as_samples, n, waivable=1, needs_sibling=needs_sibling))
        else:
            options.append(Option(n, 0, as_samples, n))
    return options


def combine(lazy_children: Iterable[list[Option]]) -> list[Option]:
    """The readings of a structure whose children must agree on the number of samples (one per size).

    It stops at the first conflict: a list of detection samples is not weighed as fields past its first sample.
    """
    children: list[list[Option]] = []
    candidates: set[int] | None = None
    for options in lazy_children:
        children.append(options)
        if any(o.size is None for o in options):
            continue  # a child that can be shared takes any size
        sizes = {o.size for o in options if o.size is not None}
        candidates = sizes if candidates is None else candidates & sizes
        if not candidates:
            return []
    if candidates is None:
        candidates = {o.size for options in children for o in options if o.size is not None}
    combined = [_combine_at(children, n) for n in sorted(candidates)]
    if all(any(o.size is None for o in options) for options in children):
        combined.append(_combine_at(children, None))
    return [o for o in combined if o is not None]


def _combine_at(children: list[list[Option]], n: int | None) -> Option | None:
    picks = [[o for o in options if o.size == n] or [o for o in options if o.size is None] for options in children]
    if any(not p for p in picks):
        return None
    if n is None:
        return Option(None, sum(min(o.cost for o in p) for p in picks))
    # Transposed per-sample batches, e.g. torchvision's (images, targets): a list that is read as entries on its own
    # lets its siblings of the same length be read as entries too.
    on_its_own = [min(p, key=lambda o: o.cost).samples_len == n for p in picks]
    lists_of_samples = sum(on_its_own)
    cost, entries = 0, frozenset[Node]()
    for p, own in zip(picks, on_its_own, strict=True):
        sibling = lists_of_samples - own > 0

        def key(o: Option, sibling: bool = sibling) -> tuple[int, int]:
            as_samples = o.samples_len is not None
            return (o.cost - (o.waivable if as_samples and sibling else 0), 0 if as_samples == sibling else 1)

        valid = [o for o in p if sibling or not o.needs_sibling]
        if not valid:
            return None
        best = min(valid, key=key)
        cost += key(best)[0]
        entries |= best.entries
    return Option(n, cost, entries)


def signature(node: Node) -> Any:
    """What entries of one list of samples share: their structure and tensor ranks, not their sizes."""
    obj = node.obj
    if node.kind is Kind.ROWS or isinstance(obj, Tensor) or is_array(obj):
        return ("tensor", obj.ndim)
    if node.kind is Kind.MAPPING:
        return (type(obj), frozenset((k, signature(c)) for k, c in zip(node.keys, node.children, strict=True)))
    if node.kind in (Kind.NAMEDTUPLE, Kind.DATACLASS):
        return (type(obj), tuple(signature(c) for c in node.children))
    if node.kind is Kind.SEQUENCE:
        if not node.children:  # plain values, or empty
            return (type(obj), frozenset({"value"}) if obj else frozenset())
        return (type(obj), frozenset(signature(c) for c in node.children))
    return "value"


# ----------------------------------------------------------------------------------------------------------------------
# paths and messages
# ----------------------------------------------------------------------------------------------------------------------


def walk(node: Node, path: str = "batch") -> Iterator[tuple[str, Node]]:
    """Every node under ``node`` (itself first), with its path as the user would write it (``batch['x'][0]``)."""
    yield path, node
    for child_path, child in children_with_paths(node, path):
        yield from walk(child, child_path)


def children_with_paths(node: Node, path: str) -> Iterator[tuple[str, Node]]:
    if node.kind is Kind.MAPPING:
        yield from ((f"{path}[{k!r}]", c) for k, c in zip(node.keys, node.children, strict=True))
    elif node.kind in (Kind.NAMEDTUPLE, Kind.DATACLASS):
        yield from ((f"{path}.{name}", c) for name, c in zip(node.keys, node.children, strict=True))
    else:
        yield from ((f"{path}[{i}]", c) for i, c in enumerate(node.children))


def _describe(size: int, option: Option, paths: dict[Node, str]) -> str:
    lists = sorted(paths[node] for node in option.entries)
    return f"{size} samples" + (f" ({', '.join(f'`{p}`' for p in lists)} one entry per sample)" if lists else "")


def _disagreement(root: Node, verb: str, size: int | None, source: str) -> str:
    """Name the first element whose sample count differs from the batch size (``size``, or the most common one)."""
    evidence: list[tuple[str, str, int, bool]] = []  # (path, shape or length, samples, is a tensor)
    _evidence(root, "batch", evidence)
    if size is None and evidence:
        counts = Counter(e[2] for e in evidence)
        path, what, size, is_tensor = max(evidence, key=lambda e: (counts[e[2]], -evidence.index(e)))
        source = f"`{path}`, " + (f"shape {what}" if is_tensor else f"a list of {what} entries")
    cannot = (
        "Cannot split the batch into micro-batches"
        if verb == "split"
        else "Cannot tell how many samples are in the batch"
    )
    needed = f"the batch size {size} (from {source})"
    odd = next((e for e in evidence if e[2] != size), None)
    if odd is None:
        return f"{cannot}: no reading of it gives all its tensors {needed}. " + HOW_TO_FIX
    path, what, n, is_tensor = odd
    if not is_tensor:
        return f"{cannot}: `{path}` is a list of {n} entries, but it must hold one entry per sample: {needed}. " + (
            HOW_TO_FIX
        )
    if verb == "split":
        return (
            f"Cannot split `{path}` into micro-batches: its shape is {what}, but its first dimension must be {needed}. "
            + HOW_TO_FIX
        )
    return f"{cannot}: `{path}` has shape {what}, but its first dimension must be {needed}. " + HOW_TO_FIX


def _evidence(node: Node, path: str, out: list[tuple[str, str, int, bool]]) -> None:
    """Every element's claim on the batch size: tensors with a batch dimension, and lists of samples."""
    if node.kind is Kind.ROWS:
        out.append((path, str(tuple(node.obj.shape)), int(node.obj.shape[0]), True))
        return
    if node.kind is Kind.SEQUENCE and node.holds_rows:
        containers = all(child.kind in _CONTAINERS for child in node.children)
        if containers and len({signature(child) for child in node.children}) == 1:
            out.append((path, str(len(node.obj)), len(node.obj), False))
            return
    for child_path, child in children_with_paths(node, path):
        _evidence(child, child_path, out)


# ----------------------------------------------------------------------------------------------------------------------
# what a batch is
# ----------------------------------------------------------------------------------------------------------------------


def declared_size(batch: Any) -> tuple[int | None, str]:
    """The size a batch object states itself (``batch_size``, ``__len__``), and where it came from."""
    if isinstance(batch, (Tensor, Mapping, list, tuple, str, bytes)) or is_array(batch):
        return None, ""
    name = type(batch).__name__
    declared = getattr(batch, "batch_size", None)
    if declared is not None:
        if isinstance(declared, torch.Size) and len(declared) > 0:
            declared = declared[0]
        hint = "It is the number of samples in the batch."
        return check_int(as_whole_number(declared), f"{name}.batch_size", 0, hint=hint), f"`{name}.batch_size`"
    if hasattr(type(batch), "__len__"):
        return len(batch), f"`len({name})`"
    if _is_dataclass_instance(batch):
        return None, ""
    raise TypeError(
        f"Cannot tell how many samples are in a batch of type {name}: it is not a tensor, mapping, sequence or"
        f" dataclass, and it has neither a `batch_size` attribute nor `__len__`. Give {name} a `batch_size` property"
        " (or `__len__`) that returns its number of samples, or pass `batch_size_of=` (a function of the batch) to the"
        " callback, or define `batch_size_of(self, batch)` on your LightningModule."
    )


def is_structure(obj: Any) -> bool:
    """Whether the built-in rules look inside ``obj``: a tensor or array, mapping, list, tuple or dataclass."""
    return isinstance(obj, (Tensor, Mapping, list, tuple)) or is_array(obj) or _is_dataclass_instance(obj)


def is_array(obj: Any) -> bool:
    """Whether ``obj`` is a NumPy array. NumPy is optional: only look for it if the caller already imported it."""
    np = sys.modules.get("numpy")
    return np is not None and isinstance(obj, np.ndarray)


def _is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_fields")


def _is_dataclass_instance(obj: Any) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)
