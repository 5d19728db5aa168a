"""Cutting a per-device step batch into micro-batches along the sample dimension (dim 0). Pure: no Trainer.

What is cut and what is shared, for a batch of ``B`` samples (``B`` comes from
`lightning_accum.normalization.batch_size_of`):

========================================================  ==============================================
element                                                   in each micro-batch
========================================================  ==============================================
tensor (or NumPy array) with ``shape[0] == B``            its rows of the chunk
0-dim tensor, ``None``, numbers, strings, other objects   the same object (shared, not copied)
tensor with ``dim() >= 1`` and ``shape[0] != B``          error: ``ValueError`` naming the element
list / tuple holding no tensor, ``len == B``              its entries of the chunk (e.g. the raw texts)
list / tuple holding no tensor, ``len != B``              the same object
list / tuple / namedtuple holding tensors                 the same container type, each element cut
list / tuple of ``B`` per-sample structures               its entries of the chunk (e.g. detection targets:
                                                          one dict of boxes per image, any number of boxes)
dict, ``OrderedDict``, ``UserDict`` (``BatchEncoding``),  the same type, each value cut; ``UserDict``
other ``Mapping``                                         subclasses keep their other attributes
dataclass                                                 the same type, each field cut (``__init__`` and
                                                          ``__post_init__`` run again on the chunk)
========================================================  ==============================================

A mismatched tensor is an error rather than something shared: silently giving every micro-batch the full tensor of
another length is how a label tensor ends up paired with the wrong samples.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import sys
from collections import UserDict
from collections.abc import Mapping
from typing import Any

from torch import Tensor

from lightning_accum._validation import check_int
from lightning_accum.normalization import batch_size_of


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


def split_batch(batch: Any, micro_batch_size: int) -> list[Any]:
    """Cut ``batch`` along dim 0 into micro-batches of ``micro_batch_size`` samples (the last may be smaller).

    Concatenating the chunks' tensors along dim 0 gives back the batch's tensors. Chunks are views of the batch's
    tensors, not copies. An empty batch (0 samples) gives an empty list. See the module docstring for how each kind
    of element is treated.

    Args:
        batch: the step batch: a tensor or any nesting of mappings, sequences, namedtuples and dataclasses.
        micro_batch_size: the most samples in one micro-batch.

    Raises:
        TypeError: if ``micro_batch_size`` is not an int, or a mapping type cannot be rebuilt from a dict.
        ValueError: if ``micro_batch_size < 1``, or a tensor's first dimension is not the batch size (the message
            names the element, e.g. ``batch['labels']``).

    Examples:
        >>> import torch
        >>> batch = {"x": torch.arange(10).view(5, 2), "y": torch.arange(5), "lr": 0.1, "text": list("abcde")}
        >>> chunks = split_batch(batch, 2)
        >>> [c["y"].tolist() for c in chunks], [c["text"] for c in chunks], chunks[2]["lr"]
        ([[0, 1], [2, 3], [4]], [['a', 'b'], ['c', 'd'], ['e']], 0.1)
    """
    check_int(micro_batch_size, "micro_batch_size", minimum=1)
    size = batch_size_of(batch)
    return [
        _cut(batch, start, min(start + micro_batch_size, size), size, "batch")
        for start in range(0, size, micro_batch_size)
    ]


def _is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_fields")


def _is_dataclass_instance(obj: Any) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def _is_array(obj: Any) -> bool:
    # NumPy is optional; only look for it if the caller already imported it.
    np = sys.modules.get("numpy")
    return np is not None and isinstance(obj, np.ndarray)


def _holds_tensor(obj: Any) -> bool:
    if isinstance(obj, Tensor) or _is_array(obj):
        return True
    if isinstance(obj, Mapping):
        return any(_holds_tensor(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_holds_tensor(v) for v in obj)
    if _is_dataclass_instance(obj):
        return any(_holds_tensor(getattr(obj, f.name)) for f in dataclasses.fields(obj))
    return False


def _cut(obj: Any, start: int, stop: int, size: int, path: str) -> Any:
    if isinstance(obj, Tensor) or _is_array(obj):
        if obj.ndim == 0:
            return obj
        if obj.shape[0] != size:
            raise ValueError(
                f"Cannot split `{path}` into micro-batches: its shape is {tuple(obj.shape)}, but its first dimension"
                f" must be the batch size {size} (the first dimension of the batch's first tensor). Put the samples"
                " on dim 0, or pass a value shared by all samples as a 0-dim tensor or a Python object."
            )
        return obj[start:stop]
    if isinstance(obj, Mapping):
        return _cut_mapping(obj, start, stop, size, path)
    if _is_namedtuple(obj):
        return type(obj)(
            *(_cut(v, start, stop, size, f"{path}.{name}") for name, v in zip(obj._fields, obj, strict=True))
        )
    if isinstance(obj, (list, tuple)):
        return _cut_sequence(obj, start, stop, size, path)
    if _is_dataclass_instance(obj):
        return _cut_dataclass(obj, start, stop, size, path)
    return obj


def _rebuild_sequence(obj: list[Any] | tuple[Any, ...], items: list[Any]) -> Any:
    # Subclasses of list and tuple (other than namedtuples, handled apart) take an iterable, like their base.
    return type(obj)(items)


def _cut_sequence(obj: list[Any] | tuple[Any, ...], start: int, stop: int, size: int, path: str) -> Any:
    if not _holds_tensor(obj):
        # Per-sample Python data (raw texts, ids) is cut; anything else is configuration, shared.
        return _rebuild_sequence(obj, list(obj[start:stop])) if len(obj) == size else obj
    try:
        return _rebuild_sequence(obj, [_cut(v, start, stop, size, f"{path}[{i}]") for i, v in enumerate(obj)])
    except ValueError:
        # `B` per-sample structures of their own sizes (one dict of boxes per image) can't be cut element-wise,
        # but are cut by entry. A direct element with the batch on dim 0 means this is a structure like (x, y)
        # with a real error in it, so the error stands.
        batch_shaped = any(isinstance(v, Tensor) and v.ndim > 0 and v.shape[0] == size for v in obj)
        if len(obj) == size and not batch_shaped:
            return _rebuild_sequence(obj, list(obj[start:stop]))
        raise


def _cut_mapping(obj: Mapping[Any, Any], start: int, stop: int, size: int, path: str) -> Any:
    values = {k: _cut(v, start, stop, size, f"{path}[{k!r}]") for k, v in obj.items()}
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


def _cut_dataclass(obj: Any, start: int, stop: int, size: int, path: str) -> Any:
    fields = dataclasses.fields(obj)
    new = dataclasses.replace(
        obj, **{f.name: _cut(getattr(obj, f.name), start, stop, size, f"{path}.{f.name}") for f in fields if f.init}
    )
    for f in fields:
        if not f.init and not hasattr(new, f.name):
            # A field outside __init__ is usually derived in __post_init__, which replace() just re-ran on the
            # chunk; only one that nothing set is cut from the original. object.__setattr__ works on frozen classes.
            object.__setattr__(new, f.name, _cut(getattr(obj, f.name), start, stop, size, f"{path}.{f.name}"))
    return new
