"""Built-in item counters for ``count_items``, usable from Python and from LightningCLI YAML.

A counter tells the accumulation callbacks what the loss averages over in a micro-batch. Lambdas work from Python
but cannot be written in a YAML config, nor pickled for ``ddp_spawn``; the small classes here can:

.. code-block:: yaml

    trainer:
      callbacks:
        - class_path: lightning_accum.AccumulationScheduler
          init_args:
            count_items:
              class_path: lightning_accum.items.CountTokens
              init_args: {key: labels, ignore_index: -100}

Counters return a tensor on the batch's device where they can, so counting never waits for the device. A counter of
your own may return an int, a float (a weighted count, e.g. the sum of a float loss mask), a NumPy number or a
single-element tensor; see `lightning_accum.normalization.count_items`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import Tensor

from lightning_accum._validation import check_int, import_object
from lightning_accum.normalization import batch_size_of


class CountTokens:
    """Counts loss-bearing tokens: the elements of ``batch[key]`` that differ from ``ignore_index``.

    Use it when ``training_step`` returns a mean over tokens, e.g. ``F.cross_entropy(..., ignore_index=-100)``, and
    micro-batches hold different numbers of loss-bearing tokens (padding, masking).

    Args:
        key: where the labels are: a mapping key (``"labels"``), a position in a tuple or list batch (``1``), or
            an attribute name of a batch object.
        ignore_index: the label value that carries no loss (PyTorch's ``cross_entropy`` default is ``-100``).

    Raises:
        TypeError: at construction, ``key`` is not a str or an int, or ``ignore_index`` is not an int; when called,
            ``batch[key]`` is not a tensor.
        KeyError: when called, the batch has nothing under ``key``.

    Examples:
        >>> import torch
        >>> count = CountTokens(key="labels")
        >>> count({"labels": torch.tensor([[5, 7, -100], [3, -100, -100]])})
        tensor(3)
        >>> CountTokens(key=1, ignore_index=0)((torch.zeros(2, 3), torch.tensor([[1, 0, 2]])))
        tensor(2)
    """

    def __init__(self, key: str | int = "labels", ignore_index: int = -100) -> None:
        if isinstance(key, bool) or not isinstance(key, (str, int)):
            raise TypeError(
                f"`key` must be a str (a mapping key or attribute name) or an int (a position in a tuple batch),"
                f" got {key!r} of type {type(key).__name__}."
            )
        self.key = key
        self.ignore_index = check_int(
            ignore_index, "ignore_index", hint="Pass the label value that carries no loss, such as -100."
        )

    def __call__(self, batch: Any) -> Tensor:
        labels = _lookup(batch, self.key)
        if not isinstance(labels, Tensor):
            raise TypeError(
                f"`CountTokens(key={self.key!r})` expects a tensor of labels at batch[{self.key!r}], got"
                f" {type(labels).__name__}. Point `key` at the label tensor."
            )
        # A tensor sum, not `.item()`: the count stays on the device and the callback reads it once per step.
        return (labels != self.ignore_index).sum()

    def __repr__(self) -> str:
        return f"CountTokens(key={self.key!r}, ignore_index={self.ignore_index})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CountTokens) and (self.key, self.ignore_index) == (other.key, other.ignore_index)

    def __hash__(self) -> int:
        return hash((CountTokens, self.key, self.ignore_index))


class CountSamples:
    """Counts samples, as the callbacks do by default: `lightning_accum.splitting.batch_size_of`.

    It exists so that a config can name the default explicitly, or a base class can override it.

    Examples:
        >>> import torch
        >>> CountSamples()({"input_ids": torch.zeros(4, 9), "labels": torch.zeros(4, 9)})
        4
    """

    def __call__(self, batch: Any) -> int:
        return batch_size_of(batch)

    def __repr__(self) -> str:
        return "CountSamples()"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CountSamples)

    def __hash__(self) -> int:
        return hash(CountSamples)


def resolve_counter(spec: Callable[[Any], Any] | str | None) -> Callable[[Any], Any] | None:
    """Turn what a user passes as ``count_items`` into a counter function (``None`` stays ``None``).

    Args:
        spec: a callable; an import path, ``"pkg.mod.func"`` or ``"pkg.mod:func"``; or ``None`` (count samples).
            An import path that names a class is instantiated with no arguments.

    Raises:
        TypeError: ``spec`` is neither callable, a string nor ``None``, or the import path names something that is
            not callable.
        ValueError: the import path is malformed or cannot be imported.

    Examples:
        >>> resolve_counter("lightning_accum.items:CountSamples")
        CountSamples()
        >>> resolve_counter("lightning_accum.items.CountTokens")
        CountTokens(key='labels', ignore_index=-100)
        >>> resolve_counter(None) is None
        True
    """
    if spec is None:
        return None
    if isinstance(spec, str):
        target = import_object(spec, "count_items")
        if inspect.isclass(target):
            target = target()
        if not callable(target):
            raise TypeError(
                f"`count_items={spec!r}` names {target!r}, which is not callable. Name a function of a batch or a"
                " class whose instances are, e.g. 'lightning_accum.items.CountTokens'."
            )
        return target  # type: ignore[no-any-return]
    if callable(spec):
        return spec
    raise TypeError(
        f"`count_items` must be a function of a batch, an import path such as 'lightning_accum.items.CountTokens',"
        f" or None, got {spec!r} of type {type(spec).__name__}."
    )


def _lookup(batch: Any, key: str | int) -> Any:
    if isinstance(batch, Mapping):
        if key not in batch:
            raise KeyError(f"`CountTokens(key={key!r})`: the batch has no {key!r}; its keys are {list(batch)}.")
        return batch[key]
    if isinstance(key, int) and isinstance(batch, Sequence) and not isinstance(batch, (str, bytes)):
        if not -len(batch) <= key < len(batch):
            raise KeyError(f"`CountTokens(key={key})`: the batch is a sequence of length {len(batch)}.")
        return batch[key]
    if isinstance(key, str) and hasattr(batch, key):
        return getattr(batch, key)
    raise KeyError(
        f"`CountTokens(key={key!r})` cannot find labels in a batch of type {type(batch).__name__}. Use a str key for"
        " a dict batch or an attribute, an int key for a tuple batch."
    )
