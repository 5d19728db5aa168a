"""A Hugging Face causal LM in a ``LightningModule``: built from a transformers config (GPT-2 unless the YAML names
another, such as ``transformers.LlamaConfig``), or loaded from a local checkpoint."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

# Set before transformers is imported: this example never reaches the Hugging Face Hub (``checkpoint`` is a path).
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import lightning.pytorch as pl
import torch
from torch import Tensor
from transformers import AutoModelForCausalLM, GPT2Config, PreTrainedConfig, PreTrainedModel

from examples.hf_finetune.data import EOS_ID, PAD_ID


class HFCausalLM(pl.LightningModule):
    """Wraps a causal LM and returns its own loss: the mean over ``labels[..., 1:] != -100`` (it shifts inside).

    Without ``checkpoint``, the model is built from ``config`` (random weights, nothing downloaded): any causal LM's
    transformers config, named in YAML by its ``class_path`` (``transformers.LlamaConfig``, ``transformers.GPT2Config``,
    ...) with its sizes as ``init_args``. Its vocabulary and positions are set from ``vocab_size`` and ``n_positions``
    (the data's, linked by the CLI), and its padding, BOS and EOS ids from the data's. Without a ``config``, a small
    GPT-2 of ``n_layer``, ``n_embd`` and ``n_head`` is built, dropout off by default (GPT-2's config defaults to 0.1):
    with dropout, two runs that cut the same step batch into different micro-batches draw different masks, so the docs'
    comparisons of split against full-batch steps would not hold.

    Args:
        vocab_size: the vocabulary of the model built from a config (the data's, linked by the CLI).
        n_positions: its positions (the data's ``max_length``, linked by the CLI).
        n_layer: the GPT-2's transformer blocks, without ``config`` (default 2).
        n_embd: its width (default 64).
        n_head: its attention heads (default 4).
        dropout: its residual, embedding and attention dropout (default 0.0).
        checkpoint: a local directory written by ``save_pretrained`` (a fine-tuned or a downloaded model), loaded with
            ``from_pretrained(checkpoint, local_files_only=True)`` instead of building from a config.
        lr: AdamW's learning rate.
        weight_decay: AdamW's weight decay.
        config: the architecture to build, a transformers config of a causal LM.

    Raises:
        ValueError: ``checkpoint`` is not a directory, or its vocabulary or positions are too small for the data;
            ``config`` is given with a GPT-2 size, or with ``checkpoint``.
    """

    def __init__(
        self,
        vocab_size: int = 256,
        n_positions: int = 128,
        n_layer: int | None = None,
        n_embd: int | None = None,
        n_head: int | None = None,
        dropout: float | None = None,
        checkpoint: str | None = None,
        lr: float = 3e-3,
        weight_decay: float = 0.0,
        config: PreTrainedConfig | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.lr, self.weight_decay = lr, weight_decay
        self.model: PreTrainedModel
        gpt2_sizes = {"n_layer": n_layer, "n_embd": n_embd, "n_head": n_head, "dropout": dropout}
        if checkpoint is not None:
            if config is not None:
                raise ValueError(
                    f"`config` ({type(config).__name__}) and `checkpoint`={checkpoint!r} were both given: a checkpoint "
                    "holds its own config. Drop one of them."
                )
            self.model = _load_checkpoint(checkpoint, vocab_size, n_positions)
            return
        if config is None:
            config = _gpt2(**gpt2_sizes)
        elif given := {k: v for k, v in gpt2_sizes.items() if v is not None}:
            raise ValueError(
                f"{given!r} set the sizes of the GPT-2 built without `config`, but `config` is a "
                f"{type(config).__name__}: set its sizes in its init_args instead, and drop {', '.join(given)}."
            )
        self.model = AutoModelForCausalLM.from_config(_for_the_data(config, vocab_size, n_positions))

    def forward(self, input_ids: Tensor, attention_mask: Tensor, labels: Tensor | None = None) -> Any:
        return self.model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        # Called once per micro-batch under AutoMicroBatching, which weights each micro-batch's mean by its
        # `count_items` so that the step is the mean over every scored token of the step batch, on all ranks.
        loss: Tensor = self(batch["input_ids"], batch["attention_mask"], batch["labels"]).loss
        # This micro-batch's loss, on this rank (rank 0's in the logs). The loss optimized, over every micro-batch of
        # both ranks' step batches, is AccumulationMonitor's `accum/window_loss`: the progress bar shows that one.
        self.log("train/loss", loss, on_step=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=self.weight_decay)


def _gpt2(n_layer: int | None, n_embd: int | None, n_head: int | None, dropout: float | None) -> GPT2Config:
    dropout = 0.0 if dropout is None else dropout
    return GPT2Config(
        n_layer=2 if n_layer is None else n_layer,
        n_embd=64 if n_embd is None else n_embd,
        n_head=4 if n_head is None else n_head,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
    )


def _for_the_data(config: PreTrainedConfig, vocab_size: int, n_positions: int) -> PreTrainedConfig:
    # A copy: the same config object may build several models (the probe builds one per configuration).
    config = copy.deepcopy(config)
    config.vocab_size = vocab_size
    config.max_position_embeddings = n_positions  # GPT-2's `n_positions`, through its attribute map
    config.bos_token_id = config.eos_token_id = EOS_ID
    config.pad_token_id = PAD_ID
    return config


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
