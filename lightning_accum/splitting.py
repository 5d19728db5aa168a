"""Reading a batch (how many samples it holds) and cutting it into micro-batches along the samples. Pure: no Trainer.

`batch_size_of` and `split_batch` share one reading of the batch, so the sizes they see always agree. For a batch
of ``B`` samples:

========================================================  ==============================================
element                                                   in each micro-batch
========================================================  ==============================================
tensor (or NumPy array) with ``shape[0] == B``            its rows
0-dim tensor, ``None``, numbers, strings, other objects   the same object (shared, not copied)
tensor with ``dim() >= 1`` and ``shape[0] != B``          error: ``ValueError`` naming the element
list / tuple holding no tensor of ``dim() >= 1``,         its entries (e.g. the raw texts, or 0-dim label
``len == B``                                              tensors)
list / tuple holding no tensor of ``dim() >= 1``,         the same object
``len != B``
list / tuple / namedtuple of fields                       the same container type, each element cut
(``(x, y)``, ``(input_ids, attention_mask)``)
list / tuple of ``B`` per-sample structures               its entries (e.g. detection samples
(tuples, dicts, dataclasses of one structure)             ``(image, target)``, or one dict of boxes per
                                                          image, any number of boxes)
tuple of ``B`` images next to a tuple of ``B`` targets    each tuple cut by entry (torchvision's detection
                                                          collate, ``tuple(zip(*samples))``)
dict, ``OrderedDict``, ``UserDict`` (``BatchEncoding``),  the same type, each value cut; ``UserDict``
other ``Mapping``                                         subclasses keep their other attributes
dataclass                                                 the same type, each field cut (``__init__`` and
                                                          ``__post_init__`` run again on the micro-batch)
any other object                                          not cut: pass ``split_batch=`` (see below)
========================================================  ==============================================

``B`` is read from the batch. Tensors count only when they have a batch dimension (``dim() >= 1``); a 0-dim tensor
is a value shared by all samples. A list or tuple is either a list of *fields* (each element holds ``B`` rows) or a
list of *samples* (one entry per sample). The reading is the one under which every tensor of the batch has ``B``
rows, preferring, where two would fit:

- fields, for a list of tensors: ``(x, y)`` and ``(input_ids, attention_mask)`` are fields, also when ``B`` equals
  their number. A list of per-sample tensors (images of different sizes) is read as samples when its length is the
  ``B`` that the rest of the batch shows, e.g. next to a list of per-sample targets;
- samples, for a list of tuples, dicts or dataclasses of one structure: a list holding one structure per sample is
  what ``DataLoader(collate_fn=list)`` yields. Return a dict of batches, not a list, to have each of them cut.

When the tensors disagree (``B`` can't be read) the error names them and their shapes. When two readings with
different ``B`` fit equally well, the error says so. A batch object that is not a tensor, mapping, sequence or
dataclass says its size itself: a ``batch_size`` attribute or property (an int, or a ``torch.Size`` whose first
entry is ``B``) or ``__len__``.

Where the built-in rules don't fit, a user hook replaces them (`resolve_batch_hooks`): ``split_batch(batch,
micro_batch_size)`` and ``batch_size_of(batch)``, given to the callback or defined as methods on the
LightningModule. A mismatched tensor is an error rather than something shared: silently giving every micro-batch
the full tensor of another length is how a label tensor ends up paired with the wrong samples.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import sys
from collections import Counter, UserDict
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Any, NamedTuple

import torch
from torch import Tensor

from lightning_accum._validation import as_whole_number, check_int, import_object

# A user hook `split_batch(batch, micro_batch_size) -> list of micro-batches`, and `batch_size_of(batch) -> int`.
# Typed loosely on purpose: jsonargparse (LightningCLI) must accept them given as import paths in YAML.
SplitBatchFn = Callable[[Any, int], Any]
BatchSizeFn = Callable[[Any], Any]

_BUILT_IN = "the built-in rules"
_HOW_TO_FIX = (
    "Put the samples on dim 0, or pass a value shared by all samples as a 0-dim tensor or a Python object. For a"
    " batch the built-in rules can't read, pass `batch_size_of=` (a function of the batch that returns its number of"
    " samples; in split mode also `split_batch=`) to the callback, or define these methods on your LightningModule."
)


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

    See the module docstring for how each kind of element is read; `split_batch` reads the batch the same way.

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
    return _read_batch(batch, *_declared_size(batch)).size


def split_batch(batch: Any, micro_batch_size: int, *, batch_size: int | None = None) -> list[Any]:
    """Cut ``batch`` into micro-batches of ``micro_batch_size`` samples (the last may be smaller).

    Concatenating the micro-batches' tensors along dim 0 gives back the batch's tensors. Their tensors are views of
    the batch's, not copies. An empty batch (0 samples) gives an empty list. See the module docstring for how each kind
    of element is treated.

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
    return [micro.batch for micro in _split(batch, micro_batch_size, batch_size, "the `batch_size=` argument")]


class MicroBatch(NamedTuple):
    """One micro-batch and its number of samples."""

    batch: Any
    size: int


@dataclasses.dataclass(frozen=True)
class BatchHooks:
    """How a callback counts and cuts batches: the user's hooks where given, the built-in rules otherwise.

    Build it with `resolve_batch_hooks`; the defaults are the built-in rules.

    Args:
        split_batch: the user's ``split_batch(batch, micro_batch_size)``, or ``None`` for `split_batch`.
        batch_size_of: the user's ``batch_size_of(batch)``, or ``None`` for `batch_size_of`.
        split_batch_source: where ``split_batch`` came from, for messages.
        batch_size_of_source: where ``batch_size_of`` came from, for messages.

    Examples:
        >>> hooks = resolve_batch_hooks(None)
        >>> hooks.batch_size({"x": torch.zeros(5, 2)})
        5
        >>> [m.size for m in hooks.split({"x": torch.zeros(5, 2)}, 2)]
        [2, 2, 1]
    """

    split_batch: SplitBatchFn | None = None
    batch_size_of: BatchSizeFn | None = None
    split_batch_source: str = _BUILT_IN
    batch_size_of_source: str = _BUILT_IN

    def batch_size(self, batch: Any) -> int:
        """The number of samples in ``batch``, from the user's ``batch_size_of`` hook or the built-in rules.

        Raises:
            TypeError: the hook returned something that is not an int (a NumPy or single-element tensor integer
                is accepted).
            ValueError: the hook returned a negative number.
        """
        if self.batch_size_of is None:
            return batch_size_of(batch)
        return _check_count(self.batch_size_of(batch), f"`batch_size_of` ({self.batch_size_of_source})")

    def split(self, batch: Any, micro_batch_size: int) -> list[MicroBatch]:
        """Cut ``batch`` into micro-batches of at most ``micro_batch_size`` samples, with their sizes.

        The user's ``split_batch`` hook must return a list (or tuple) of micro-batches, each holding 1 to
        ``micro_batch_size`` samples, whose sizes add up to the step batch's: no sample dropped or repeated. Their
        sizes are read with `batch_size`.

        Raises:
            TypeError: the hook returned something other than a list or tuple.
            ValueError: the micro-batches' sizes break the contract above (the message shows them).
        """
        check_int(micro_batch_size, "micro_batch_size", minimum=1)
        total = self.batch_size(batch)
        if self.split_batch is None:
            return _split(batch, micro_batch_size, total, f"`batch_size_of` ({self.batch_size_of_source})")
        name = f"`split_batch` ({self.split_batch_source})"
        result = self.split_batch(batch, micro_batch_size)
        if not isinstance(result, (list, tuple)):
            raise TypeError(
                f"{name} must return a list of micro-batches, got {type(result).__name__}. Return e.g."
                " `[batch[i : i + micro_batch_size] for i in range(0, len(batch), micro_batch_size)]`."
            )
        sizes = [self.batch_size(micro) for micro in result]
        for index, size in enumerate(sizes):
            if not 1 <= size <= micro_batch_size:
                raise ValueError(
                    f"{name}: micro-batch {index} holds {size} samples, more than `micro_batch_size={micro_batch_size}`"
                    if size > micro_batch_size
                    else f"{name}: micro-batch {index} holds {size} samples; every micro-batch must hold 1 to"
                    f" `micro_batch_size={micro_batch_size}` samples, so that memory planning holds."
                )
        if sum(sizes) != total:
            raise ValueError(
                f"{name} returned micro-batches of {' + '.join(map(str, sizes)) or '0'} = {sum(sizes)} samples for a"
                f" step batch of {total} samples. They must add up to the step batch: no sample dropped or repeated."
            )
        return [MicroBatch(micro, size) for micro, size in zip(result, sizes, strict=True)]


def resolve_batch_hooks(
    module: object | None = None,
    *,
    split_batch: SplitBatchFn | str | None = None,
    batch_size_of: BatchSizeFn | str | None = None,
) -> BatchHooks:
    """The hooks that count and cut batches: an argument, else a method of ``module``, else the built-in rules.

    Args:
        module: the LightningModule (or ``None``); a ``split_batch(self, batch, micro_batch_size)`` or
            ``batch_size_of(self, batch)`` method on it is used where the argument is ``None``.
        split_batch: a function ``split_batch(batch, micro_batch_size)`` returning a list of micro-batches, or its
            import path (``"package.module.function"``).
        batch_size_of: a function ``batch_size_of(batch)`` returning the number of samples, or its import path.

    Raises:
        TypeError: a hook is not callable (as an argument, or as an attribute of ``module``).
        ValueError: an import path is malformed or cannot be imported.

    Examples:
        >>> def by_len(batch):
        ...     return len(batch["ids"])
        >>> hooks = resolve_batch_hooks(None, batch_size_of=by_len)
        >>> hooks.batch_size({"ids": [3, 1, 4]}), hooks.batch_size_of_source
        (3, 'the `batch_size_of=` argument (by_len)')
    """
    split_fn, split_source = _pick_hook("split_batch", "split_batch(batch, micro_batch_size)", split_batch, module)
    size_fn, size_source = _pick_hook("batch_size_of", "batch_size_of(batch)", batch_size_of, module)
    return BatchHooks(split_fn, size_fn, split_source, size_source)


def _pick_hook(name: str, signature: str, given: Any, module: object | None) -> tuple[Any, str]:
    if given is not None:
        if isinstance(given, str):
            target = import_object(given, name)
            if not callable(target):
                raise TypeError(
                    f"`{name}={given!r}` names {target!r}, which is not callable. Name a function {signature}."
                )
            return target, f"the `{name}=` argument ({given})"
        if not callable(given):
            raise TypeError(f"`{name}` must be a function `{signature}`, got {given!r} of type {type(given).__name__}.")
        return given, f"the `{name}=` argument ({getattr(given, '__name__', repr(given))})"
    if module is None:
        return None, _BUILT_IN
    # The instance's own attributes and the class's; never `nn.Module.__getattr__`, which would return a submodule.
    found = vars(module).get(name, getattr(type(module), name, None))
    if found is None:
        return None, _BUILT_IN
    if not callable(found):
        raise TypeError(
            f"`{type(module).__name__}.{name}` must be a method `{signature.replace('(', '(self, ', 1)}`, got"
            f" {found!r}. Rename the attribute, or make it that method."
        )
    hook = found if name in vars(module) else getattr(module, name)
    return hook, f"`{type(module).__name__}.{name}`"


def _check_count(value: Any, name: str) -> int:
    count = as_whole_number(value)
    if isinstance(count, bool) or not isinstance(count, int):
        raise TypeError(
            f"{name} must return an int >= 0 (the number of samples in the batch), got {value!r} of type"
            f" {type(value).__name__}. Count samples, not items: a weighted count belongs in `count_items`."
        )
    if count < 0:
        raise ValueError(f"{name} must return an int >= 0 (the number of samples in the batch), got {count}.")
    return count


# ----------------------------------------------------------------------------------------------------------------------
# reading a batch
# ----------------------------------------------------------------------------------------------------------------------


class _Option(NamedTuple):
    """One consistent reading of a node: the samples it implies, and which of its lists hold one entry per sample.

    ``cost`` counts the lists read against their kind's preference (see the module docstring); the cheapest reading
    wins. The other fields describe a list read as samples, for the rule that pairs it with a sibling of its length.
    """

    size: int | None  # None: the node implies no size (it is shared)
    cost: int = 0
    sample_lists: frozenset[int] = frozenset()  # id() of every list/tuple read as one entry per sample
    samples_len: int | None = None  # this node is a list read as samples, of this length
    waivable: int = 0  # ... whose cost is waived next to another list of samples of its length
    needs_sibling: bool = False  # ... valid only next to another list of samples of its length


_SHARED = _Option(None)


class _Reading(NamedTuple):
    size: int
    sample_lists: frozenset[int]


def _declared_size(batch: Any) -> tuple[int | None, str]:
    """The size a batch object states itself (``batch_size``, ``__len__``), and where it came from."""
    if isinstance(batch, (Tensor, Mapping, list, tuple, str, bytes)) or _is_array(batch):
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


def _read_batch(batch: Any, size: int | None = None, source: str = "", verb: str = "count") -> _Reading:
    """The reading of ``batch`` with the most preferred lists, of ``size`` samples if given."""
    flat = _flat_size(batch)
    if flat is not None and size in (None, flat):
        return _Reading(flat, frozenset())
    paths: dict[int, str] = {}
    options = _combine([_read(batch, "batch", paths)])
    if size is not None:
        at_size = [o for o in options if o.size == size]
        if not at_size and not _is_structure(batch):
            at_size = options  # an object that states its size and isn't cut by the built-in rules
        if not at_size:
            raise ValueError(_disagreement(batch, verb, size, source))
        return _Reading(size, min(at_size, key=lambda o: o.cost).sample_lists)
    sized = [o for o in options if o.size is not None]
    if not sized:
        if options:
            raise TypeError(
                f"Cannot tell how many samples are in a batch of type {type(batch).__name__}: it holds no tensor with"
                " a batch dimension (dim >= 1) and no list of samples. " + _HOW_TO_FIX
            )
        raise ValueError(_disagreement(batch, verb, None, ""))
    cheapest = min(o.cost for o in sized)
    best = [o for o in sized if o.cost == cheapest]
    if len(best) > 1:
        readings = " or as ".join(_describe(o, paths) for o in sorted(best, key=lambda o: o.size or 0))
        raise ValueError(
            f"The batch can be read as {readings}: the built-in rules can't tell which. Pass `batch_size_of=` (a"
            " function of the batch that returns its number of samples) to the callback, or define"
            " `batch_size_of(self, batch)` on your LightningModule."
        )
    return _Reading(best[0].size, best[0].sample_lists)  # type: ignore[arg-type]


def _flat_size(batch: Any) -> int | None:
    """The common case without lists to read: a tensor, or a flat structure of tensors and values that agree."""
    if isinstance(batch, Tensor):
        return int(batch.shape[0]) if batch.ndim > 0 else None
    if isinstance(batch, Mapping):
        values: Iterable[Any] = batch.values()
    elif isinstance(batch, (list, tuple)) and batch:  # namedtuples too
        values = batch
    else:
        return None
    sizes = set()
    for value in values:
        if isinstance(value, Tensor):
            if value.ndim > 0:
                sizes.add(value.shape[0])
        elif isinstance(value, (Mapping, list, tuple)) or _is_array(value) or _is_dataclass_instance(value):
            return None
    return int(sizes.pop()) if len(sizes) == 1 else None


def _describe(option: _Option, paths: dict[int, str]) -> str:
    lists = sorted(paths[i] for i in option.sample_lists)
    return f"{option.size} samples" + (f" ({', '.join(f'`{p}`' for p in lists)} one entry per sample)" if lists else "")


def _read(obj: Any, path: str, paths: dict[int, str]) -> list[_Option]:
    if isinstance(obj, Tensor) or _is_array(obj):
        return [_Option(int(obj.shape[0]))] if obj.ndim > 0 else [_SHARED]
    if isinstance(obj, Mapping):
        return _combine(_read(v, f"{path}[{k!r}]", paths) for k, v in obj.items())
    if _is_namedtuple(obj):
        return _combine(_read(v, f"{path}.{name}", paths) for name, v in zip(obj._fields, obj, strict=True))
    if isinstance(obj, (list, tuple)):
        paths[id(obj)] = path
        return _read_sequence(obj, path, paths)
    if _is_dataclass_instance(obj):
        return _combine(_read(getattr(obj, f.name), f"{path}.{f.name}", paths) for f in dataclasses.fields(obj))
    return [_SHARED]


def _read_sequence(seq: list[Any] | tuple[Any, ...], path: str, paths: dict[int, str]) -> list[_Option]:
    n = len(seq)
    if not _holds_batch_tensor(seq):
        # Per-sample Python data (texts, ids, 0-dim labels) when its length is the batch size; else shared.
        return [_Option(n, sample_lists=frozenset({id(seq)}), samples_len=n), _SHARED]
    fields = _combine(_read(v, f"{path}[{i}]", paths) for i, v in enumerate(seq))
    tensors = all((isinstance(v, Tensor) or _is_array(v)) and v.ndim > 0 for v in seq)
    containers = all(isinstance(v, (Mapping, list, tuple)) or _is_dataclass_instance(v) for v in seq)
    of_samples = (tensors or containers) and len({_signature(v) for v in seq}) == 1
    # A list of containers of one structure prefers to be a list of samples: reading it as fields costs one.
    extra = 1 if containers and of_samples else 0
    options = [_Option(f.size, f.cost + extra, f.sample_lists) for f in fields]
    if of_samples:
        as_samples = frozenset({id(seq)})
        if tensors:
            # A tensor with the batch on dim 0 means this is a structure like (x, y) with an error in it, unless a
            # sibling list of samples shows the transposed form (images next to targets).
            needs_sibling = any(v.shape[0] == n for v in seq)
            options.append(_Option(n, 1, as_samples, n, waivable=1, needs_sibling=needs_sibling))
        else:
            options.append(_Option(n, 0, as_samples, n))
    return options


def _combine(lazy_children: Iterable[list[_Option]]) -> list[_Option]:
    """The readings of a structure whose children must agree on the number of samples (one per size).

    Children are read one at a time, so that a structure which can't agree stops at the first conflict (a list of
    detection samples is not read as fields element by element).
    """
    children: list[list[_Option]] = []
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


def _combine_at(children: list[list[_Option]], n: int | None) -> _Option | None:
    picks = [[o for o in options if o.size == n] or [o for o in options if o.size is None] for options in children]
    if any(not p for p in picks):
        return None
    if n is None:
        return _Option(None, sum(min(o.cost for o in p) for p in picks))
    # Transposed per-sample batches, e.g. torchvision's (images, targets): a list that is read as samples on its own
    # lets its siblings of the same length be read as samples too.
    on_its_own = [min(p, key=lambda o: o.cost).samples_len == n for p in picks]
    lists_of_samples = sum(on_its_own)
    cost, lists = 0, frozenset[int]()
    for p, own in zip(picks, on_its_own, strict=True):
        sibling = lists_of_samples - own > 0

        def key(o: _Option, sibling: bool = sibling) -> tuple[int, int]:
            as_samples = o.samples_len is not None
            return (o.cost - (o.waivable if as_samples and sibling else 0), 0 if as_samples == sibling else 1)

        valid = [o for o in p if sibling or not o.needs_sibling]
        if not valid:
            return None
        best = min(valid, key=key)
        cost += key(best)[0]
        lists |= best.sample_lists
    return _Option(n, cost, lists)


def _signature(obj: Any) -> Hashable:
    """What entries of one list of samples share: their structure and tensor ranks, not their sizes."""
    if isinstance(obj, Tensor) or _is_array(obj):
        return ("tensor", obj.ndim)
    if isinstance(obj, Mapping):
        return (type(obj), frozenset((k, _signature(v)) for k, v in obj.items()))
    if _is_namedtuple(obj) or _is_dataclass_instance(obj):
        values = obj if _is_namedtuple(obj) else (getattr(obj, f.name) for f in dataclasses.fields(obj))
        return (type(obj), tuple(_signature(v) for v in values))
    if isinstance(obj, (list, tuple)):
        return (type(obj), frozenset(_signature(v) for v in obj))
    return "value"


def _disagreement(batch: Any, verb: str, size: int | None, source: str) -> str:
    """Name the first element whose sample count differs from the batch size (``size``, or the most common one)."""
    evidence: list[tuple[str, str, int, bool]] = []  # (path, shape or length, samples, is a tensor)
    _evidence(batch, "batch", evidence)
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
        return f"{cannot}: no reading of it gives all its tensors {needed}. " + _HOW_TO_FIX
    path, what, n, is_tensor = odd
    if not is_tensor:
        return f"{cannot}: `{path}` is a list of {n} entries, but it must hold one entry per sample: {needed}. " + (
            _HOW_TO_FIX
        )
    if verb == "split":
        return (
            f"Cannot split `{path}` into micro-batches: its shape is {what}, but its first dimension must be {needed}. "
            + (_HOW_TO_FIX)
        )
    return f"{cannot}: `{path}` has shape {what}, but its first dimension must be {needed}. " + _HOW_TO_FIX


def _evidence(obj: Any, path: str, out: list[tuple[str, str, int, bool]]) -> None:
    """Every element's claim on the batch size: tensors with a batch dimension, and lists of samples."""
    if isinstance(obj, Tensor) or _is_array(obj):
        if obj.ndim > 0:
            out.append((path, str(tuple(obj.shape)), int(obj.shape[0]), True))
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            _evidence(v, f"{path}[{k!r}]", out)
    elif _is_namedtuple(obj):
        for name, v in zip(obj._fields, obj, strict=True):
            _evidence(v, f"{path}.{name}", out)
    elif isinstance(obj, (list, tuple)):
        containers = all(isinstance(v, (Mapping, list, tuple)) or _is_dataclass_instance(v) for v in obj)
        if containers and _holds_batch_tensor(obj) and len({_signature(v) for v in obj}) == 1:
            out.append((path, str(len(obj)), len(obj), False))
        else:
            for i, v in enumerate(obj):
                _evidence(v, f"{path}[{i}]", out)
    elif _is_dataclass_instance(obj):
        for f in dataclasses.fields(obj):
            _evidence(getattr(obj, f.name), f"{path}.{f.name}", out)


# ----------------------------------------------------------------------------------------------------------------------
# cutting a batch
# ----------------------------------------------------------------------------------------------------------------------


def _split(batch: Any, micro_batch_size: int, size: int | None, source: str) -> list[MicroBatch]:
    check_int(micro_batch_size, "micro_batch_size", minimum=1)
    if size is not None:
        check_int(size, "batch_size", minimum=0)
    else:
        size, source = _declared_size(batch)
    if not _is_structure(batch):
        raise TypeError(
            f"Cannot split a batch of type {type(batch).__name__}: the built-in rules cut tensors, mappings,"
            " sequences, namedtuples and dataclasses. Pass `split_batch=` (a function `split_batch(batch,"
            " micro_batch_size)` that returns a list of micro-batches) to the callback, or define"
            " `split_batch(self, batch, micro_batch_size)` on your LightningModule."
        )
    reading = _read_batch(batch, size, source, verb="split")
    n = reading.size
    return [
        MicroBatch(
            _cut(batch, start, min(start + micro_batch_size, n), n, "batch", reading.sample_lists),
            min(start + micro_batch_size, n) - start,
        )
        for start in range(0, n, micro_batch_size)
    ]


def _is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_fields")


def _is_dataclass_instance(obj: Any) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def _is_array(obj: Any) -> bool:
    # NumPy is optional; only look for it if the caller already imported it.
    np = sys.modules.get("numpy")
    return np is not None and isinstance(obj, np.ndarray)


def _is_structure(obj: Any) -> bool:
    return isinstance(obj, (Tensor, Mapping, list, tuple)) or _is_array(obj) or _is_dataclass_instance(obj)


def _holds_batch_tensor(obj: Any) -> bool:
    if isinstance(obj, Tensor) or _is_array(obj):
        return obj.ndim > 0
    if isinstance(obj, Mapping):
        return any(_holds_batch_tensor(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_holds_batch_tensor(v) for v in obj)
    if _is_dataclass_instance(obj):
        return any(_holds_batch_tensor(getattr(obj, f.name)) for f in dataclasses.fields(obj))
    return False


def _cut(obj: Any, start: int, stop: int, size: int, path: str, sample_lists: frozenset[int]) -> Any:
    if isinstance(obj, Tensor) or _is_array(obj):
        if obj.ndim == 0:
            return obj
        if obj.shape[0] != size:  # unreachable after a reading of this size; kept as the last line of defence
            raise ValueError(
                f"Cannot split `{path}` into micro-batches: its shape is {tuple(obj.shape)}, but its first dimension"
                f" must be the batch size {size}. " + _HOW_TO_FIX
            )
        return obj[start:stop]
    if isinstance(obj, Mapping):
        return _cut_mapping(obj, start, stop, size, path, sample_lists)
    if _is_namedtuple(obj):
        return type(obj)(
            *(
                _cut(v, start, stop, size, f"{path}.{name}", sample_lists)
                for name, v in zip(obj._fields, obj, strict=True)
            )
        )
    if isinstance(obj, (list, tuple)):
        if id(obj) in sample_lists:
            return _rebuild_sequence(obj, list(obj[start:stop]))
        if not _holds_batch_tensor(obj):
            return obj  # configuration, shared
        return _rebuild_sequence(
            obj, [_cut(v, start, stop, size, f"{path}[{i}]", sample_lists) for i, v in enumerate(obj)]
        )
    if _is_dataclass_instance(obj):
        return _cut_dataclass(obj, start, stop, size, path, sample_lists)
    return obj


def _rebuild_sequence(obj: list[Any] | tuple[Any, ...], items: list[Any]) -> Any:
    # Subclasses of list and tuple (other than namedtuples, handled apart) take an iterable, like their base.
    return type(obj)(items)


def _cut_mapping(
    obj: Mapping[Any, Any], start: int, stop: int, size: int, path: str, sample_lists: frozenset[int]
) -> Any:
    values = {k: _cut(v, start, stop, size, f"{path}[{k!r}]", sample_lists) for k, v in obj.items()}
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
        return type(obj)(values)
    except Exception as err:
        raise TypeError(
            f"Cannot split `{path}`: its mapping type {type(obj).__name__} can't be rebuilt as"
            f" `{type(obj).__name__}(dict)` ({err}). Convert it to a dict in your collate function."
        ) from err


def _cut_dataclass(obj: Any, start: int, stop: int, size: int, path: str, sample_lists: frozenset[int]) -> Any:
    fields = dataclasses.fields(obj)
    new = dataclasses.replace(
        obj,
        **{
            f.name: _cut(getattr(obj, f.name), start, stop, size, f"{path}.{f.name}", sample_lists)
            for f in fields
            if f.init
        },
    )
    for f in fields:
        if not f.init and not hasattr(new, f.name):
            # A field outside __init__ is usually derived in __post_init__, which replace() just re-ran on the
            # micro-batch; only one that nothing set is cut from the original (object.__setattr__ works when frozen).
            value = _cut(getattr(obj, f.name), start, stop, size, f"{path}.{f.name}", sample_lists)
            object.__setattr__(new, f.name, value)
    return new
