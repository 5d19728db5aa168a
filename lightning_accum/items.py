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
              # shift: 1 for a Hugging Face causal LM, which scores labels[..., 1:] (it shifts them inside);
              # shift: 0 where the data already holds next-token labels
              init_args: {key: labels, ignore_index: -100, shift: 1}

Counters return a tensor on the batch's device where they can, so counting never waits for the device (a
`CountTokens` without ``shift`` reads one value back, once, to check its first batch for a model that shifts its
labels). A counter of your own may return an int, a float (a weighted count, e.g. the sum of a float loss mask), a
NumPy number or a single-element tensor; see `lightning_accum.core.normalization.count_items`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import Tensor

from lightning_accum._util.cli_types import NonNegativeInt
from lightning_accum._util.validation import check_int, import_object
from lightning_accum.core.normalization import batch_size_of


class CountTokens:
    """Counts loss-bearing tokens: the elements of ``batch[key]`` that differ from ``ignore_index``.

    Use it when ``training_step`` returns a mean over tokens, e.g. ``F.cross_entropy(..., ignore_index=-100)``, and
    micro-batches hold different numbers of loss-bearing tokens (padding, masking).

    A model that shifts its labels inside, as every Hugging Face causal LM does (``AutoModelForCausalLM``,
    ``GPT2LMHeadModel``, Llama, ...), scores position ``t`` against label ``t + 1``: its loss averages over
    ``labels[..., 1:]``, one label fewer per sequence than the batch holds. Count with ``shift=1`` there, or every
    micro-batch is weighted by a count its loss did not use and the window gradient is off (up to 6.9% on a small GPT-2,
    see the docs' "Hugging Face models" page). Without ``shift``, the first call warns once if the labels equal
    the batch's ``input_ids`` wherever they are not ``ignore_index`` (the sign of such a model); ``shift=0`` says
    the loss uses every label and silences the warning.

    Args:
        key: where the labels are: a mapping key (``"labels"``), a position in a tuple or list batch (``1``), or
            an attribute name of a batch object.
        ignore_index: the label value that carries no loss (PyTorch's ``cross_entropy`` default is ``-100``).
        shift: how many leading positions of the last (sequence) dimension the loss drops, as a model that shifts
            its labels inside does: ``1`` for Hugging Face causal LMs, ``0`` for a loss that uses every label (labels
            shifted in the data, token classification, seq2seq decoders). ``None`` (the default) counts as ``0``
            and checks the first batch for a model that shifts.

    Raises:
        TypeError: at construction, ``key`` is not a str or an int, or ``ignore_index`` or ``shift`` is not an int;
            when called, ``batch[key]`` is not a tensor.
        ValueError: at construction, ``shift`` is negative; when called with a ``shift``, the labels are a 0-dim
            tensor (they have no sequence dimension).
        KeyError: when called, the batch has nothing under ``key``.

    Examples:
        >>> import torch
        >>> count = CountTokens(key="labels")
        >>> count({"labels": torch.tensor([[5, 7, -100], [3, -100, -100]])})
        tensor(3)
        >>> CountTokens(key=1, ignore_index=0)((torch.zeros(2, 3), torch.tensor([[1, 0, 2]])))
        tensor(2)

        A Hugging Face causal LM's loss skips each sequence's first label:

        >>> CountTokens("labels", shift=1)({"labels": torch.tensor([[5, 7, -100], [3, -100, -100]])})
        tensor(1)
    """

    def __init__(
        self, key: str | int = "labels", ignore_index: int = -100, shift: NonNegativeInt | None = None
    ) -> None:
        if isinstance(key, bool) or not isinstance(key, (str, int)):
            raise TypeError(
                f"`key` must be a str (a mapping key or attribute name) or an int (a position in a tuple batch),"
                f" got {key!r} of type {type(key).__name__}."
            )
        self.key = key
        self.ignore_index = check_int(
            ignore_index, "ignore_index", hint="Pass the label value that carries no loss, such as -100."
        )
        self.shift = (
            None
            if shift is None
            else check_int(
                shift,
                "shift",
                0,
                alternative="None",
                hint="Pass 1 for a model that shifts its labels inside (Hugging Face causal LMs), 0 for one that"
                " does not.",
            )
        )
        # The check for a shifting model reads one value back from the device, so it runs on one batch only.
        self._shift_checked = shift is not None

    def __call__(self, batch: Any) -> Tensor:
        labels = lookup(batch, self.key, f"CountTokens(key={self.key!r})", "labels")
        if not isinstance(labels, Tensor):
            raise TypeError(
                f"`CountTokens(key={self.key!r})` expects a tensor of labels at batch[{self.key!r}], got"
                f" {type(labels).__name__}. Point `key` at the label tensor."
            )
        if not self._shift_checked:
            self._warn_if_the_model_shifts(batch, labels)
        if self.shift:
            if labels.dim() == 0:
                raise ValueError(
                    f"`{self!r}` drops the first {self.shift} label(s) of each sequence, but batch[{self.key!r}] is"
                    " a 0-dim tensor. Point `key` at labels of shape (batch, sequence), or pass `shift=0`."
                )
            # The last dimension is the sequence, as in Hugging Face's `labels[..., 1:]`.
            labels = labels[..., self.shift :]
        # A tensor sum, not `.item()`: the count stays on the device and the callback reads it once per step.
        return (labels != self.ignore_index).sum()

    def _warn_if_the_model_shifts(self, batch: Any, labels: Tensor) -> None:
        if labels.device.type == "meta" or type(labels) is not Tensor:
            return  # no values to read (meta, fake tensors of a trace): look at the next batch
        self._shift_checked = True
        input_ids = batch.get("input_ids") if isinstance(batch, Mapping) else getattr(batch, "input_ids", None)
        if not isinstance(input_ids, Tensor) or input_ids.shape != labels.shape or input_ids.device != labels.device:
            return
        loss_bearing = labels != self.ignore_index
        # Equal where a label carries a loss (padding and masked prompts hold `ignore_index`), and not all padding.
        if bool((loss_bearing.any() & (~loss_bearing | (labels == input_ids)).all()).item()):
            from lightning.fabric.utilities import rank_zero_warn  # here: the counters import without Lightning

            rank_zero_warn(
                f"`{self!r}` sees labels equal to the batch's `input_ids` (wherever they are not"
                f" {self.ignore_index}): the sign of a model that shifts its labels inside, as Hugging Face causal"
                " LMs do. Such a model's loss averages over `labels[..., 1:]`, one label fewer per sequence than"
                " this counter counts, and the accumulated gradient is then not the full-batch one. Pass `shift=1`"
                f" (`CountTokens({self.key!r}, shift=1)`), or `shift=0` if your loss does use every label."
            )

    def __repr__(self) -> str:
        shift = "" if self.shift is None else f", shift={self.shift}"
        return f"CountTokens(key={self.key!r}, ignore_index={self.ignore_index}{shift})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CountTokens) and self._config() == other._config()

    def __hash__(self) -> int:
        return hash((CountTokens, *self._config()))

    def _config(self) -> tuple[str | int, int, int | None]:
        return (self.key, self.ignore_index, self.shift)


class CountSamples:
    """Counts samples, as the callbacks do by default: `lightning_accum.batches.batch_size_of`.

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
        target: object = import_object(spec, "count_items")
        if inspect.isclass(target):
            target = target()
        if not callable(target):
            raise TypeError(
                f"`count_items={spec!r}` names {target!r}, which is not callable. Name a function of a batch or a"
                " class whose instances are, e.g. 'lightning_accum.items.CountTokens'."
            )
        return target
    if callable(spec):
        return spec
    raise TypeError(
        f"`count_items` must be a function of a batch, an import path such as 'lightning_accum.items.CountTokens',"
        f" or None, got {spec!r} of type {type(spec).__name__}."
    )


def lookup(batch: Any, key: str | int, who: str, what: str) -> Any:
    """``batch[key]`` for a mapping, a tuple (an int key) or an attribute (a str key) of a batch object.

    ``who`` names the argument in the errors (e.g. ``"CountTokens(key='labels')"``), ``what`` the thing looked for.

    Raises:
        KeyError: the batch has nothing under ``key``; the message names ``who`` and shows what the batch has.
    """
    if isinstance(batch, Mapping):
        if key not in batch:
            raise KeyError(f"`{who}`: the batch has no {key!r}; its keys are {list(batch)}.")
        return batch[key]
    if isinstance(key, int) and isinstance(batch, Sequence) and not isinstance(batch, (str, bytes)):
        if not -len(batch) <= key < len(batch):
            raise KeyError(f"`{who}`: the batch is a sequence of length {len(batch)}.")
        return batch[key]
    if isinstance(key, str) and hasattr(batch, key):
        return getattr(batch, key)
    raise KeyError(
        f"`{who}` cannot find {what} in a batch of type {type(batch).__name__}. Use a str key for a dict batch or an"
        " attribute, an int key for a tuple batch."
    )
