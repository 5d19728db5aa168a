"""Text that ships with Python (``pydoc_data.topics``), cut into byte sequences of varying length."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

PAD_ID = 256  # one past the last byte value, so padding can never be mistaken for text
VOCAB_SIZE = 257
IGNORE_INDEX = -100  # F.cross_entropy's default: labels with this value carry no loss


def load_sequences(min_length: int, max_length: int) -> list[Tensor]:
    """Paragraphs of the pydoc topics as byte tensors of ``min_length + 1`` to ``max_length + 1`` bytes.

    A paragraph longer than ``max_length + 1`` bytes is cut into consecutive pieces; pieces that are too short are
    dropped. Each sequence holds one more byte than the model reads, because the labels are the inputs shifted by one.
    """
    from pydoc_data.topics import topics  # imported late: it is ~0.5 MB of text that only the data needs

    sequences: list[Tensor] = []
    for name in sorted(topics):  # sorted: the split must not depend on dict order
        for paragraph in topics[name].split("\n\n"):
            data = paragraph.strip().encode("utf-8")
            for start in range(0, len(data), max_length + 1):
                piece = data[start : start + max_length + 1]
                if len(piece) >= min_length + 1:
                    sequences.append(torch.tensor(list(piece), dtype=torch.uint8))
    return sequences


class ByteSequences(Dataset):
    """A list of byte sequences; item ``i`` is the ``uint8`` tensor of sequence ``i``."""

    def __init__(self, sequences: list[Tensor]) -> None:
        self.sequences = sequences

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, index: int) -> Tensor:
        return self.sequences[index]


def collate_padded(sequences: list[Tensor]) -> dict[str, Tensor]:
    """Right-pad a list of byte sequences into ``input_ids`` and next-byte ``labels`` (``-100`` on padding).

    Example:
        >>> batch = collate_padded([torch.tensor([1, 2, 3]), torch.tensor([4, 5])])
        >>> batch["input_ids"].tolist(), batch["labels"].tolist()
        ([[1, 2], [4, 256]], [[2, 3], [5, -100]])
    """
    width = max(len(s) for s in sequences) - 1
    input_ids = torch.full((len(sequences), width), PAD_ID, dtype=torch.long)
    labels = torch.full((len(sequences), width), IGNORE_INDEX, dtype=torch.long)
    for row, seq in enumerate(sequences):
        seq = seq.long()
        input_ids[row, : len(seq) - 1] = seq[:-1]
        labels[row, : len(seq) - 1] = seq[1:]
    return {"input_ids": input_ids, "labels": labels}


class CharLMDataModule(pl.LightningDataModule):
    """Paragraphs of Python's documentation topics as padded next-byte prediction batches.

    Sequences are paragraphs (cut at ``max_length``), so their lengths vary and every micro-batch holds a different
    number of loss-bearing tokens. Nothing is downloaded: the text ships with Python.

    Args:
        batch_size: sequences per micro-batch (per device).
        min_length: shortest sequence the model reads, in bytes; shorter paragraphs are dropped.
        max_length: longest sequence the model reads, in bytes; longer paragraphs are cut into pieces.
        val_fraction: share of the sequences held out for validation (0 disables validation).
        max_sequences: use only the first this many sequences after shuffling (``None``: all), for quick runs.
        seed: seeds the train/validation split and the training shuffle.
        num_workers: ``DataLoader`` worker processes.

    Raises:
        ValueError: a size is < 1, ``min_length > max_length`` or ``val_fraction`` is outside ``[0, 1)``.
    """

    def __init__(
        self,
        batch_size: int = 16,
        min_length: int = 16,
        max_length: int = 128,
        val_fraction: float = 0.05,
        max_sequences: int | None = None,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        for name, value in (("batch_size", batch_size), ("min_length", min_length), ("max_length", max_length)):
            if value < 1:
                raise ValueError(f"`{name}` must be >= 1, got {value}.")
        if min_length > max_length:
            raise ValueError(f"`min_length` ({min_length}) must be <= `max_length` ({max_length}).")
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"`val_fraction` must be in [0, 1), got {val_fraction}. Use 0 to skip validation.")
        if max_sequences is not None and max_sequences < 2:
            raise ValueError(f"`max_sequences` must be >= 2 or None, got {max_sequences}.")
        self.save_hyperparameters()
        self.batch_size = batch_size
        self.min_length, self.max_length, self.max_sequences = min_length, max_length, max_sequences
        self.val_fraction, self.seed, self.num_workers = val_fraction, seed, num_workers
        self.train_set: ByteSequences | None = None
        self.val_set: ByteSequences | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        sequences = load_sequences(self.min_length, self.max_length)
        order = torch.randperm(len(sequences), generator=torch.Generator().manual_seed(self.seed)).tolist()
        if self.max_sequences is not None:
            order = order[: self.max_sequences]
        n_val = int(len(order) * self.val_fraction)
        self.val_set = ByteSequences([sequences[i] for i in order[:n_val]])
        self.train_set = ByteSequences([sequences[i] for i in order[n_val:]])

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(
            _ready(self.train_set),
            batch_size=self.batch_size,
            shuffle=True,
            collate_fn=collate_padded,
            num_workers=self.num_workers,
            generator=torch.Generator().manual_seed(self.seed),
        )

    def val_dataloader(self) -> DataLoader[Any] | list[DataLoader[Any]]:
        val_set = _ready(self.val_set)
        if len(val_set) == 0:
            return []
        return DataLoader(val_set, batch_size=self.batch_size, collate_fn=collate_padded, num_workers=self.num_workers)


def _ready(dataset: ByteSequences | None) -> ByteSequences:
    if dataset is None:
        raise RuntimeError("`CharLMDataModule.setup()` must run before its dataloaders are requested.")
    return dataset
