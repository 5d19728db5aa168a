"""Synthetic instruction/response pairs of token ids, and the collate a tokenizer-based pipeline would use.

Nothing here needs a tokenizer: a sample is a prompt of random ids, a separator, and a response that counts on from the
prompt's first id (``first + 1, first + 2, ...``, wrapping around the vocabulary), then an end-of-sequence id: a rule a
2-layer model picks up within a minute, so the loss visibly falls. Prompt and response lengths are log-normal, so a step
batch holds sequences of very different lengths, and only the response carries a loss: the prompt is masked with
``-100`` as supervised fine-tuning does.
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

PAD_ID, EOS_ID, SEP_ID = 0, 1, 2
FIRST_TOKEN_ID = 3  # prompt ids are drawn from [FIRST_TOKEN_ID, vocab_size)
IGNORE_INDEX = -100  # what a Hugging Face model's loss (and F.cross_entropy) skips


class InstructionPairs(Dataset):
    """``n`` prompt/response pairs of token ids, the same for the same ``seed``.

    Item ``i`` is ``{"input_ids": prompt + [SEP] + response + [EOS], "labels": the same with -100 on prompt and SEP}``,
    unpadded; `collate_right_padded` pads a list of them.

    Args:
        n: number of pairs.
        vocab_size: ids are below this.
        max_length: longest sequence (prompt, separator, response and end-of-sequence together).
        median_prompt: median prompt length; lengths are log-normal (sigma 0.6), at least 1.
        median_response: median response length, likewise.
        seed: seeds the lengths and the ids.
    """

    def __init__(
        self,
        n: int,
        vocab_size: int,
        max_length: int,
        median_prompt: float = 24.0,
        median_response: float = 16.0,
        seed: int = 0,
    ) -> None:
        g = torch.Generator().manual_seed(seed)
        longest_part = (max_length - 2) // 2  # so that prompt + SEP + response + EOS always fits

        def lengths(median: float) -> Tensor:
            drawn = (torch.randn(n, generator=g) * 0.6 + math.log(median)).exp()
            return drawn.round().clamp(1, longest_part).long()

        prompts, responses = lengths(median_prompt), lengths(median_response)
        self.samples: list[dict[str, Tensor]] = []
        for p, r in zip(prompts.tolist(), responses.tolist(), strict=True):
            prompt = torch.randint(FIRST_TOKEN_ID, vocab_size, (p,), generator=g)
            span = vocab_size - FIRST_TOKEN_ID
            response = FIRST_TOKEN_ID + (prompt[0] - FIRST_TOKEN_ID + torch.arange(1, r + 1)) % span
            ids = torch.cat([prompt, torch.tensor([SEP_ID]), response, torch.tensor([EOS_ID])])
            labels = ids.clone()
            labels[: p + 1] = IGNORE_INDEX  # the prompt and the separator carry no loss
            self.samples.append({"input_ids": ids, "labels": labels})

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return self.samples[index]


def collate_right_padded(samples: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Right padding to the longest sample: ``input_ids``, ``attention_mask`` (1 on tokens), ``labels`` (-100 on pads).

    The labels stay aligned with the inputs: a Hugging Face causal LM shifts them inside (position ``t`` is scored
    against label ``t + 1``), hence ``CountTokens("labels", shift=1)`` in the configs.

    Example:
        >>> batch = collate_right_padded([
        ...     {"input_ids": torch.tensor([5, 2, 5, 1]), "labels": torch.tensor([-100, -100, 5, 1])},
        ...     {"input_ids": torch.tensor([7, 2, 1]), "labels": torch.tensor([-100, -100, 1])},
        ... ])
        >>> batch["attention_mask"].tolist(), batch["labels"].tolist()
        ([[1, 1, 1, 1], [1, 1, 1, 0]], [[-100, -100, 5, 1], [-100, -100, 1, -100]])
    """
    longest = max(len(s["input_ids"]) for s in samples)
    input_ids = torch.full((len(samples), longest), PAD_ID, dtype=torch.long)
    attention_mask = torch.zeros(len(samples), longest, dtype=torch.long)
    labels = torch.full((len(samples), longest), IGNORE_INDEX, dtype=torch.long)
    for row, sample in enumerate(samples):
        n = len(sample["input_ids"])
        input_ids[row, :n] = sample["input_ids"]
        attention_mask[row, :n] = 1
        labels[row, :n] = sample["labels"]
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


class InstructionDataModule(pl.LightningDataModule):
    """`InstructionPairs` in step batches: each device's whole step batch, for `lightning_accum.AutoMicroBatching`.

    Args:
        batch_size: sequences per step batch, per device (split mode cuts it into micro-batches).
        num_samples: pairs in the training set.
        vocab_size: ids are below this (the model's vocabulary must hold them).
        max_length: longest sequence; the model's positions must cover it.
        median_prompt: median prompt length (log-normal).
        median_response: median response length (log-normal).
        seed: seeds the data and the shuffle.
        num_workers: ``DataLoader`` worker processes.

    Raises:
        ValueError: a size is too small for a pair to fit.
    """

    def __init__(
        self,
        batch_size: int = 32,
        num_samples: int = 4096,
        vocab_size: int = 256,
        max_length: int = 128,
        median_prompt: float = 24.0,
        median_response: float = 16.0,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        for name, value, least in (
            ("batch_size", batch_size, 1),
            ("num_samples", num_samples, 1),
            ("vocab_size", vocab_size, FIRST_TOKEN_ID + 1),
            ("max_length", max_length, 4),
        ):
            if value < least:
                raise ValueError(f"`{name}` must be >= {least}, got {value}.")
        self.save_hyperparameters()
        self.batch_size, self.num_samples, self.vocab_size, self.max_length = (
            batch_size,
            num_samples,
            vocab_size,
            max_length,
        )
        self.median_prompt, self.median_response = median_prompt, median_response
        self.seed, self.num_workers = seed, num_workers
        self.train_set: InstructionPairs | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is None:
            self.train_set = InstructionPairs(
                self.num_samples,
                self.vocab_size,
                self.max_length,
                self.median_prompt,
                self.median_response,
                seed=self.seed,
            )

    def train_dataloader(self) -> DataLoader[Any]:
        if self.train_set is None:
            raise RuntimeError("`InstructionDataModule.setup()` must run before its dataloader is requested.")
        # Under DDP, Lightning replaces the sampler with a DistributedSampler that shuffles with the run's seed.
        return DataLoader(
            self.train_set,
            batch_size=self.batch_size,
            shuffle=True,
            collate_fn=collate_right_padded,
            num_workers=self.num_workers,
            generator=torch.Generator().manual_seed(self.seed),
        )
