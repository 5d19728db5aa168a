"""A Hugging Face causal LM in a ``LightningModule``: built from a ``GPT2Config``, or loaded from a local checkpoint."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

# Set before transformers is imported: this example never reaches the Hugging Face Hub (``checkpoint`` is a path).
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import lightning.pytorch as pl
import torch
from torch import Tensor
from transformers import AutoModelForCausalLM, GPT2Config, PreTrainedModel

from examples.hf_finetune.data import EOS_ID, PAD_ID


class HFCausalLM(pl.LightningModule):
    """Wraps a causal LM and returns its own loss: the mean over ``labels[..., 1:] != -100`` (it shifts inside).

    Without ``checkpoint``, a small GPT-2 is built from a config (random weights, nothing downloaded). Its dropout is
    off by default (GPT-2's config defaults to 0.1): with dropout, two runs that cut the same step batch into different
    micro-batches draw different masks, so the docs' comparisons of split against full-batch steps would not hold.

    Args:
        vocab_size: the vocabulary of the model built from a config (the data's, linked by the CLI).
        n_positions: its positions (the data's ``max_length``, linked by the CLI).
        n_layer: its transformer blocks.
        n_embd: its width.
        n_head: its attention heads.
        dropout: its residual, embedding and attention dropout.
        checkpoint: a local directory written by ``save_pretrained`` (a fine-tuned or a downloaded model), loaded with
            ``from_pretrained(checkpoint, local_files_only=True)`` instead of building from a config.
        lr: AdamW's learning rate.
        weight_decay: AdamW's weight decay.

    Raises:
        ValueError: ``checkpoint`` is not a directory, or its vocabulary or positions are too small for the data.
    """

    def __init__(
        self,
        vocab_size: int = 256,
        n_positions: int = 128,
        n_layer: int = 2,
        n_embd: int = 64,
        n_head: int = 4,
        dropout: float = 0.0,
        checkpoint: str | None = None,
        lr: float = 3e-3,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.lr, self.weight_decay = lr, weight_decay
        self.model: PreTrainedModel
        if checkpoint is None:
            config = GPT2Config(
                vocab_size=vocab_size,
                n_positions=n_positions,
                n_layer=n_layer,
                n_embd=n_embd,
                n_head=n_head,
                resid_pdrop=dropout,
                embd_pdrop=dropout,
                attn_pdrop=dropout,
                bos_token_id=EOS_ID,
                eos_token_id=EOS_ID,
                pad_token_id=PAD_ID,
            )
            self.model = AutoModelForCausalLM.from_config(config)
        else:
            self.model = _load_checkpoint(checkpoint, vocab_size, n_positions)

    def forward(self, input_ids: Tensor, attention_mask: Tensor, labels: Tensor | None = None) -> Any:
        return self.model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        # Called once per micro-batch under AutoMicroBatching, which weights each micro-batch's mean by its
        # `count_items` so that the step is the mean over every scored token of the step batch, on all ranks.
        loss: Tensor = self(batch["input_ids"], batch["attention_mask"], batch["labels"]).loss
        self.log("train/loss", loss, on_step=True, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=self.weight_decay)


def _load_checkpoint(checkpoint: str, vocab_size: int, n_positions: int) -> PreTrainedModel:
    path = Path(checkpoint)
    if not path.is_dir():
        raise ValueError(
            f"`checkpoint` must be a local directory written by `save_pretrained`, got {checkpoint!r}, which is not"
            " one. This example never downloads: save a model there first (`model.save_pretrained(path)`), or leave"
            " `checkpoint` out to build a small GPT-2 from a config."
        )
    model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    have_vocab = model.config.vocab_size
    have_positions = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", 0)
    if have_vocab < vocab_size:
        raise ValueError(
            f"The checkpoint's vocabulary holds {have_vocab} ids, but the data's `vocab_size` is {vocab_size}."
            f" Pass `--data.vocab_size={have_vocab}` (or less)."
        )
    if have_positions and have_positions < n_positions:
        raise ValueError(
            f"The checkpoint has {have_positions} positions, but the data's `max_length` is {n_positions}."
            f" Pass `--data.max_length={have_positions}` (or less)."
        )
    return model
