"""Split mode by tokens: where a batch's padded sequences are, and how a step batch is cut by a token budget. Pure.

A language-model step batch holds sequences of very different lengths, right-padded to the longest. Memory and
compute follow the *padded tokens* of a micro-batch (samples x longest length), not its number of samples. With
`PaddedSequences`, `lightning_accum.AutoMicroBatching` cuts each step batch as
`lightning_accum.sequences.token_cut.TokenCut` does:

1. the samples are ordered by length, longest first (a stable sort: equal lengths keep their order), so that a
   micro-batch holds sequences of similar length, and the longest sequences run first, where an out-of-memory error
   is still recoverable on every rank;
2. consecutive samples share a micro-batch whose padded size stays within the token budget, cut where the step
   computes the fewest padded tokens, each micro-batch counted as
   `lightning_accum.sequences.token_cut.MICRO_BATCH_COST`'s share of the budget more (`TokenCut.groups`); a sequence
   longer than the budget gets a micro-batch of its own;
3. each micro-batch is trimmed to its own longest sequence in every *sequence field*: the fields named in
   ``fields``, or by default every tensor with the batch on dim 0 whose dim ``sequence_dim`` has the padded length
   (`lightning_accum.batches.SequenceTrim`).

Sorting is exact for losses that treat samples independently. Trimming is exact for right-padded models whose real
positions do not attend to padding (causal LMs, and models that mask padding), and whose loss scores no padding: the
step checks that the trimmed micro-batches hold as many items as the step batch
(`lightning_accum.sequences.token_cut.check_items_kept`). Left padding
is refused: trimming it would move every real token to another position.

Examples:
    >>> batch = {"input_ids": torch.tensor([[5, 6, 0, 0], [7, 8, 9, 4], [3, 0, 0, 0]]),
    ...          "attention_mask": torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])}
    >>> cut = PaddedSequences(mask="attention_mask").cut(batch)
    >>> cut.order, cut.lengths, cut.padded_length
    ([1, 0, 2], [4, 2, 1], 4)
    >>> [m.batch["input_ids"].tolist() for m in cut.split(batch, 4)]  # at most 4 padded tokens per micro-batch
    [[[7, 8, 9, 4]], [[5, 6]], [[3]]]
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_accum._util.cli_types import ImportPath, PositiveInt
from lightning_accum._util.validation import check_int, import_object
from lightning_accum.batches import (
    BatchHooks,
    BatchPlan,
    resolve_batch_hooks,
)
from lightning_accum.batches._reading import name_paths
from lightning_accum.items import lookup
from lightning_accum.sequences.masks import mask_lengths, real_positions
from lightning_accum.sequences.token_cut import TokenCut

LengthsFn = Callable[[Any], Any]
"""``lengths(batch)``: each sample's length, a 1-D integer tensor, array or list of ints."""

FieldName = str | int
"""A part of the batch: a mapping key or attribute (``"labels"``), a position in a tuple batch, or a whole path."""

_SEQUENCE_NAMES = frozenset(
    {
        "input_ids",
        "attention_mask",
        "labels",
        "position_ids",
        "token_type_ids",
        "loss_mask",
        "special_tokens_mask",
        "inputs_embeds",
        "decoder_input_ids",
        "decoder_attention_mask",
    }
)  # Hugging Face's names of sequence fields: trimming them by their length is never a surprise


class PaddedSequences:
    """Where a batch's right-padded sequences are, so that split mode can sort, trim and size micro-batches by tokens.

    Give either ``mask`` (each sample's length is its last real position, plus one) or ``lengths`` (a function of
    the batch). With ``mask``, the padded length is the mask's size along ``sequence_dim``; with ``lengths``, it is
    the size along ``sequence_dim`` of the named ``fields``, or else the one that most of the batch's per-sample
    tensors share, among those at least as long as the longest sequence.

    Both mean right padding: each sample's tokens at positions 0 to its length - 1, padding after. A mask shows left
    padding, and it is refused. With ``lengths``, the step batch is checked where it can tell: positions past a
    sample's length must hold padding in its ``attention_mask`` (if the batch has one) and in the ``padding`` fields.

    By default every tensor with the batch on dim 0 whose dim ``sequence_dim`` has the padded length is a sequence
    field (trimmed), and every other tensor whose dim 0 is the number of samples is cut per sample. Where that could
    be read two ways (a tensor of another name than Hugging Face's that has the padded length, a 1-D float tensor as
    long as the batch), the first step batch warns once with how each was treated; ``fields`` and ``shared`` settle
    it.

    Args:
        mask: where the mask is: a mapping key (``"attention_mask"``, the default when ``lengths`` is not given),
            a position in a tuple batch, or an attribute name of a batch object. Read are
            `lightning_accum.sequences.masks.MASK_FORMS`.
        lengths: ``lengths(batch)`` returns each sample's length (a 1-D integer tensor, array or list), or the import
            path of such a function; instead of ``mask``.
        sequence_dim: the dimension that holds the sequence in the sequence fields (1 for ``(batch, sequence)``).
        fields: the sequence fields, the only tensors trimmed (``["input_ids", "attention_mask", "labels"]``; the
            mask is always one): keys, attribute names, positions, or paths such as ``"batch['inputs']['ids']"``.
        shared: parts shared by all samples, given whole to every micro-batch whatever their shape (a ``[vocab]``
            weight tensor whose length may equal the number of samples).
        padding: what the padding holds, by field (``{"input_ids": 0, "labels": -100}``): positions past a sample's
            length must hold it, or the step batch is refused (it is left-padded, or the lengths are too short).

    Raises:
        TypeError: ``mask`` is not a str or an int, ``lengths`` is not callable, or an argument has the wrong type.
        ValueError: both ``mask`` and ``lengths`` are given, ``sequence_dim < 1``, or a field is both in ``fields``
            and ``shared``.

    Examples:
        >>> sequences = PaddedSequences(mask="attention_mask")
        >>> sequences.lengths({"attention_mask": torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])}).tolist()
        [2, 3, 1]
        >>> PaddedSequences(lengths=lambda batch: batch["n"]).lengths({"n": [4, 2]}).tolist()
        [4, 2]
    """

    def __init__(
        self,
        mask: str | int | None = None,
        *,
        lengths: LengthsFn | ImportPath | None = None,
        sequence_dim: PositiveInt = 1,
        fields: Sequence[str | int] | None = None,
        shared: Sequence[str | int] | None = None,
        padding: Mapping[str, int] | None = None,
    ) -> None:
        if mask is not None and lengths is not None:
            raise ValueError(
                f"`PaddedSequences` takes `mask` or `lengths`, not both (got mask={mask!r} and lengths={lengths!r})."
                " Pass the mask's key, or a function that returns each sample's length."
            )
        if lengths is None and mask is None:
            mask = "attention_mask"
        if mask is not None and (isinstance(mask, bool) or not isinstance(mask, (str, int))):
            raise TypeError(
                f"`mask` must be a str (a mapping key or attribute name) or an int (a position in a tuple batch),"
                f" got {mask!r} of type {type(mask).__name__}."
            )
        self.mask = mask
        self._lengths_given = lengths
        self.lengths_fn: LengthsFn | None = _resolve_lengths(lengths)
        self.sequence_dim = check_int(sequence_dim, "sequence_dim", 1, hint="Dim 0 holds the samples.")
        self.fields = _names(fields, "fields")
        self.shared = _names(shared, "shared")
        both = sorted(set(self.fields or ()) & set(self.shared or ()), key=repr)
        if both:
            raise ValueError(
                f"`PaddedSequences`: {both} is in both `fields` (trimmed as sequences) and `shared` (given whole to"
                " every micro-batch). Name each part in one of them."
            )
        self.padding = _padding(padding)
        self._field_paths = (
            None
            if self.fields is None
            else frozenset().union(*(name_paths(n) for n in (*self.fields, *([] if mask is None else [mask]))))
        )
        self._shared_paths = frozenset[str]().union(*(name_paths(n) for n in self.shared or ()))
        self._warned = False  # the default rules' reading is told once

    def lengths(self, batch: Any) -> Tensor:
        """Each sample's length, a 1-D int64 tensor on the CPU (one host read per step batch).

        Raises:
            KeyError: the batch has no mask under ``mask``.
            TypeError: the mask is not a tensor, or ``lengths`` returned something that is not a list of lengths.
            ValueError: a sample is left-padded (its mask starts with 0 and has a 1 later), or a length is negative.
        """
        if self.lengths_fn is not None:
            return _checked_lengths(self.lengths_fn(batch), self._lengths_given)
        mask = self._mask(batch)
        return mask_lengths(mask, self.mask, self.sequence_dim)

    def padded_length(self, batch: Any, plan: BatchPlan, lengths: Tensor) -> int:
        """The length the batch's sequence fields are padded to (see the class docstring).

        Raises:
            ValueError: no per-sample tensor of the batch is as long as its longest sequence along ``sequence_dim``.
        """
        if self.lengths_fn is None:
            return int(self._mask(batch).shape[self.sequence_dim])
        longest = int(lengths.max()) if len(lengths) else 0
        candidates = plan.row_tensors() if self.fields is None else [t for _, t in self._named(plan)]
        sizes = Counter(
            int(node.shape[self.sequence_dim])
            for node in candidates
            if node.ndim > self.sequence_dim and node.shape[self.sequence_dim] >= longest
        )
        if not sizes:
            raise ValueError(
                f"`PaddedSequences(lengths=...)` says the longest sequence has {longest} tokens, but no tensor of the"
                f" batch is that long along `sequence_dim={self.sequence_dim}`. Return each sample's real length, and"
                " check `sequence_dim`."
            )
        return max(sizes, key=lambda size: (sizes[size], size))

    def cut(self, batch: Any, hooks: BatchHooks | None = None) -> TokenCut:
        """Read ``batch`` once: its plan, its samples ordered by length (longest first) and its padded length.

        Raises:
            KeyError: the batch has no field named in ``padding``, or no mask under ``mask``.
            ValueError: as `lengths` does; a part named in ``fields`` or ``shared`` is not in the batch, or a named
                field is not a sequence of the padded length; positions past a sample's length hold real tokens
                (left padding, or lengths too short).
        """
        try:
            plan = (hooks or resolve_batch_hooks(None)).plan(batch, self._shared_paths)
        except ValueError as err:
            if self.shared is not None:
                raise
            raise ValueError(
                f"{err} A tensor shared by all samples (not cut per sample) is named in"
                " `PaddedSequences(shared=[...])`."
            ) from err
        self._check_shared(plan)
        lengths = self.lengths(batch)
        if len(lengths) != plan.size:
            raise ValueError(
                f"`PaddedSequences` found {len(lengths)} sequence lengths in a batch of {plan.size} samples. The mask"
                " (or `lengths`) must hold one entry per sample, with the samples on dim 0."
            )
        padded = self.padded_length(batch, plan, lengths)
        if len(lengths) and int(lengths.max()) > padded:
            raise ValueError(
                f"`PaddedSequences(lengths=...)` returned a length of {int(lengths.max())} for a batch padded to"
                f" {padded}: a sequence cannot be longer than its padding. Return each sample's real length."
            )
        if self.fields is not None:
            self._check_fields(plan, padded)
        self._check_padding(batch, plan, lengths, padded)
        if not self._warned:
            self._tell_the_reading(plan, padded)
        ordered, order = torch.sort(lengths, descending=True, stable=True)
        return TokenCut(
            plan, order.tolist(), ordered.tolist(), padded, self.sequence_dim, self._field_paths, self._shared_paths
        )

    def _named(self, plan: BatchPlan) -> list[tuple[str, Any]]:
        """The named sequence fields' ``(path, tensor)``; a name that is no tensor of rows is refused."""
        rows = plan.row_paths()
        found = []
        for name in (*(self.fields or ()), *([] if self.mask is None else [self.mask])):
            paths = [p for p in sorted(name_paths(name)) if p in rows]
            if not paths:
                roles = plan.roles()
                held = next((f"{p!s} ({roles[p]})" for p in sorted(name_paths(name)) if p in roles), None)
                raise ValueError(
                    f"`PaddedSequences(fields=...)` names {name!r}, but "
                    + (f"{held} is not a tensor cut per sample" if held else "the batch has no such part")
                    + f"; the batch's tensors are {sorted(rows)}. Name the sequence fields as they are in the batch."
                )
            found.append((paths[0], rows[paths[0]]))
        return found

    def _check_fields(self, plan: BatchPlan, padded: int) -> None:
        dim = self.sequence_dim
        for path, tensor in self._named(plan):
            if tensor.ndim <= dim or tensor.shape[dim] != padded:
                raise ValueError(
                    f"`PaddedSequences(fields=...)` names `{path}`, of shape {tuple(tensor.shape)}, but a sequence"
                    f" field has the padded length {padded} on `sequence_dim={dim}`. Name only the sequence fields; a"
                    " per-sample tensor of another length is cut per sample without being named."
                )

    def _check_shared(self, plan: BatchPlan) -> None:
        roles = plan.roles()
        for name in self.shared or ():
            if not any(p in roles for p in name_paths(name)):
                raise ValueError(
                    f"`PaddedSequences(shared=...)` names {name!r}, but the batch has no such part; its parts are"
                    f" {sorted(roles)}. Name the parts shared by all samples as they are in the batch."
                )

    def _check_padding(self, batch: Any, plan: BatchPlan, lengths: Tensor, padded: int) -> None:
        """Refuse a step batch whose positions past a sample's length hold real tokens, where the batch shows it."""
        past = torch.arange(padded)[None, :] >= lengths[:, None]  # [samples, positions]: what the trim may cut
        checks: list[tuple[str, Tensor]] = []  # (what was seen, where it holds a real token past a length)
        if self.lengths_fn is not None and "attention_mask" not in self.padding:
            mask = _find(batch, "attention_mask")
            if isinstance(mask, Tensor) and mask.ndim > self.sequence_dim and mask.shape[self.sequence_dim] == padded:
                real = real_positions(mask, "attention_mask", self.sequence_dim)
                if real.shape[0] == len(lengths):
                    checks.append(("`batch['attention_mask']` marks a real token", real & past))
        for key, value in self.padding.items():
            field = lookup(batch, key, f"PaddedSequences(padding={{{key!r}: {value}}})", "the field")
            if not isinstance(field, Tensor) or field.ndim <= self.sequence_dim or field.shape[0] != len(lengths):
                raise ValueError(
                    f"`PaddedSequences(padding={{{key!r}: {value}}})`: batch[{key!r}] must be a tensor of shape"
                    f" (samples, sequence, ...), got {getattr(field, 'shape', type(field).__name__)}."
                )
            if field.shape[self.sequence_dim] != padded:
                continue  # not padded to the batch's length: the trim leaves it whole
            held = (field.detach() != value).movedim(self.sequence_dim, 1).reshape(len(lengths), padded, -1).any(-1)
            checks.append((f"`batch[{key!r}]` holds a value other than its padding {value}", held.cpu() & past))
        for what, bad in checks:
            rows = bad.any(dim=1)
            if bool(rows.any()):
                row = int(rows.nonzero()[0, 0])
                position = int(bad[row].nonzero()[0, 0])
                source = "`lengths=`" if self.lengths_fn is not None else f"the mask `{self.mask!r}`"
                raise ValueError(
                    f"`{self!r}`: sample {row} of the step batch has length {int(lengths[row])} by {source}, but"
                    f" {what} at position {position}: trimming to the longest length would drop it. `PaddedSequences`"
                    " reads right padding: each sample's tokens at positions 0 to its length - 1, padding after."
                    " Pad on the right (Hugging Face: `tokenizer.padding_side = 'right'`), or return lengths that"
                    " cover every real token."
                )

    def _tell_the_reading(self, plan: BatchPlan, padded: int) -> None:
        """Warn once where the default rules read a part by its shape alone, and it could have been the other thing."""
        self._warned = True
        dim, size = self.sequence_dim, plan.size
        mask_paths = frozenset() if self.mask is None else name_paths(self.mask)
        trimmed, per_sample = [], []
        for path, tensor in plan.row_paths().items():
            if not isinstance(tensor, Tensor):
                continue  # a NumPy array: read by the same rules, rare enough not to be told
            key = path[len("batch['") : -2] if path.startswith("batch['") and path.count("[") == 1 else None
            if self.fields is None and tensor.ndim > dim and tensor.shape[dim] == padded:
                if path not in mask_paths and key not in _SEQUENCE_NAMES:
                    trimmed.append(f"`{path}` {tuple(tensor.shape)}")
            elif self.shared is None and tensor.ndim == 1 and size > 1 and tensor.is_floating_point():
                # Float, as weights shared by all samples are; a per-sample index, label or length is an integer.
                per_sample.append(f"`{path}` {tuple(tensor.shape)}")
        if not trimmed and not per_sample:
            return
        told = []
        if trimmed:
            told.append(
                f"trimmed as sequence fields (their dim {dim} has the padded length {padded}): {', '.join(trimmed)}"
            )
        if per_sample:
            told.append(f"cut per sample (their length is the {size} samples): {', '.join(per_sample)}")
        warnings.warn(
            f"`{self!r}` read parts of the step batch by their shape alone, and they could be the other thing: "
            + "; ".join(told)
            + ". Name them to be sure: `PaddedSequences(fields=[...])` lists the sequence fields (only those are"
            " trimmed), `shared=[...]` the parts shared by all samples (given whole to every micro-batch; `shared=[]`"
            " says there are none).",
            UserWarning,
            stacklevel=3,
        )

    def _mask(self, batch: Any) -> Any:
        assert self.mask is not None
        return lookup(batch, self.mask, f"PaddedSequences(mask={self.mask!r})", "a mask (or pass `lengths=`)")

    def __repr__(self) -> str:
        extra = "".join(
            f", {name}={value!r}"
            for name, value in (("fields", self.fields), ("shared", self.shared), ("padding", self.padding or None))
            if value is not None
        )
        if self.lengths_fn is not None:
            source = self._lengths_given if isinstance(self._lengths_given, str) else _name(self.lengths_fn)
            return f"PaddedSequences(lengths={source!r}, sequence_dim={self.sequence_dim}{extra})"
        return f"PaddedSequences(mask={self.mask!r}, sequence_dim={self.sequence_dim}{extra})"

    def _key(self) -> tuple[Any, ...]:
        # The function itself, not its name: two lambdas both read `<lambda>`; an import path and the function it
        # names are the same.
        padding = tuple(sorted(self.padding.items(), key=repr))
        return (self.mask, self.lengths_fn, self.sequence_dim, self.fields, self.shared, padding)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PaddedSequences) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())


def _find(batch: Any, key: str) -> Any:
    """``batch[key]`` or ``batch.key`` where the batch has it; ``None`` otherwise."""
    if isinstance(batch, Mapping):
        return batch.get(key)
    return getattr(batch, key, None) if not isinstance(batch, (list, tuple, Tensor)) else None


def _names(names: Any, argument: str) -> tuple[FieldName, ...] | None:
    if names is None:
        return None
    if isinstance(names, (str, int)) or not isinstance(names, Sequence):
        raise TypeError(
            f"`{argument}` must be a list of the batch's keys, attribute names or positions (e.g. ['input_ids',"
            f" 'labels']), got {names!r} of type {type(names).__name__}."
        )
    odd = next((n for n in names if isinstance(n, bool) or not isinstance(n, (str, int))), None)
    if odd is not None:
        raise TypeError(f"`{argument}` must hold str keys or int positions, got {odd!r} of type {type(odd).__name__}.")
    return tuple(names)


def _padding(padding: Any) -> dict[FieldName, int | float]:
    if padding is None:
        return {}
    if not isinstance(padding, Mapping):
        raise TypeError(
            f"`padding` must map fields to the value their padding holds (e.g. {{'input_ids': 0}}), got {padding!r}"
            f" of type {type(padding).__name__}."
        )
    for key, value in padding.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"`padding[{key!r}]` must be the number padding holds there, got {value!r}.")
    return dict(padding)


def _checked_lengths(value: Any, given: Any) -> Tensor:
    try:
        lengths = torch.as_tensor(value.tolist() if hasattr(value, "tolist") else value, dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError) as err:
        raise TypeError(
            f"`PaddedSequences(lengths={_name(given)})` must return each sample's length (a 1-D integer tensor, array"
            f" or list), got {type(value).__name__}: {err}."
        ) from None
    if lengths.ndim != 1 or not bool((lengths == lengths.round()).all()):
        raise TypeError(
            f"`PaddedSequences(lengths={_name(given)})` must return one whole length per sample (a 1-D integer"
            f" tensor or list), got shape {tuple(lengths.shape)}."
        )
    if bool((lengths < 0).any()):
        raise ValueError(f"`PaddedSequences(lengths={_name(given)})` returned a negative length: {value!r}.")
    return lengths.to(torch.int64)


def _resolve_lengths(lengths: Any) -> LengthsFn | None:
    if lengths is None:
        return None
    target: object = import_object(lengths, "lengths") if isinstance(lengths, str) else lengths
    if not callable(target):
        raise TypeError(
            f"`lengths` must be a function of the batch that returns each sample's length, or its import path, got"
            f" {lengths!r} of type {type(lengths).__name__}."
        )
    return target


def _name(fn: Any) -> str:
    return str(getattr(fn, "__qualname__", None) or repr(fn))
