"""Reading a batch (how many samples it holds) and cutting it into micro-batches along the samples. Pure: no Trainer.

A batch is read once, into a plan (`plan_batch` returns a `BatchPlan`): its number of samples, which of its parts
are per-sample (tensors' rows, lists of one entry per sample) and which are shared. One walker then cuts it by that
plan. `batch_size_of` and `split_batch` use the same reading, so the sizes they see always agree. For a batch of
``B`` samples:

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

Beyond consecutive micro-batches, `BatchPlan.take` cuts any samples in any order, e.g. a step batch sorted by
sequence length: ``plan.take(indices)`` gives their rows of every tensor (views for consecutive ascending indices,
``index_select`` copies otherwise), their entries of every per-sample list, and the shared values as they are. With
``trim=SequenceTrim(sequence_dim, from_length, to_length)`` it also cuts the sequence fields (the tensors with rows
whose ``sequence_dim`` is the padded length ``from_length``) to ``to_length`` positions:

>>> import torch
>>> batch = {"input_ids": torch.arange(12).view(3, 4), "labels": torch.arange(12).view(3, 4), "id": ["a", "b", "c"]}
>>> plan = plan_batch(batch)
>>> plan.sequence_fields(sequence_dim=1, length=4)
["batch['input_ids']", "batch['labels']"]
>>> micro = plan.take([2, 0], trim=SequenceTrim(sequence_dim=1, from_length=4, to_length=2))
>>> micro["input_ids"].tolist(), micro["id"]
([[8, 9], [0, 1]], ['c', 'a'])
"""

from lightning_accum.batches._walk import RowOrder
from lightning_accum.batches.hooks import BatchHooks, BatchSizeFn, SplitBatchFn, resolve_batch_hooks
from lightning_accum.batches.plan import (
    BatchPlan,
    MicroBatch,
    batch_size_of,
    num_micro_batches,
    plan_batch,
    split_batch,
)
from lightning_accum.batches.trim import SequenceTrim

__all__ = [
    "BatchHooks",
    "BatchPlan",
    "BatchSizeFn",
    "MicroBatch",
    "RowOrder",
    "SequenceTrim",
    "SplitBatchFn",
    "batch_size_of",
    "num_micro_batches",
    "plan_batch",
    "resolve_batch_hooks",
    "split_batch",
]
