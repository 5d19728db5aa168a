"""A small byte-level causal transformer (GPT-style, pre-norm) as a LightningModule."""

from __future__ import annotations

import math

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from examples.char_lm.data import IGNORE_INDEX, VOCAB_SIZE


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention (SDPA), then an MLP, each with dropout on its output.

    Args:
        d_model: the width of the residual stream.
        n_heads: attention heads; must divide ``d_model``.
        dropout: dropout probability in attention and after each sublayer.
    """

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.dropout = dropout
        self.norm1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor, allowed: Tensor | None = None) -> Tensor:
        """``x`` through the block; ``allowed`` (boolean, broadcast to ``(batch, heads, length, length)``) says which
        positions each one attends to, in place of the causal mask (e.g. causal and not padding)."""
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=-1)
        q, k, v = (t.view(batch, length, self.n_heads, -1).transpose(1, 2) for t in (q, k, v))
        # Without `allowed`, causal attention needs no padding mask: padding sits on the right, so no real byte ever
        # attends to it.
        attn = F.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed, is_causal=allowed is None, dropout_p=self.dropout if self.training else 0.0
        )
        x = x + self.drop(self.proj(attn.transpose(1, 2).reshape(batch, length, width)))
        return x + self.drop(self.mlp(self.norm2(x)))


class CharLM(pl.LightningModule):
    """A byte-level causal transformer language model; the loss is the mean over loss-bearing (non-padding) bytes.

    ``training_step`` returns ``F.cross_entropy(..., ignore_index=-100)``, a mean over the micro-batch's own tokens.
    Pair it with ``AccumulationScheduler(count_items=CountTokens(key="labels"))`` so that an optimizer step averages
    over every token of the window rather than averaging the micro-batch means.

    Args:
        vocab_size: embedding rows: 256 byte values plus the padding id.
        max_length: longest input sequence (positions), in bytes.
        d_model: width of the residual stream.
        n_layers: transformer blocks.
        n_heads: attention heads; must divide ``d_model``.
        dropout: dropout probability in attention and after each block's sublayers.
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay on matrices (not on biases, norms or embeddings).

    Raises:
        ValueError: ``n_heads`` does not divide ``d_model``, or a size is < 1.
    """

    def __init__(
        self,
        vocab_size: int = VOCAB_SIZE,
        max_length: int = 128,
        d_model: int = 128,
        n_layers: int = 4,
        n_heads: int = 4,
        dropout: float = 0.0,
        lr: float = 3e-3,
        weight_decay: float = 0.01,
    ) -> None:
        super().__init__()
        for name, value in (
            ("vocab_size", vocab_size),
            ("max_length", max_length),
            ("d_model", d_model),
            ("n_layers", n_layers),
            ("n_heads", n_heads),
        ):
            if value < 1:
                raise ValueError(f"`{name}` must be >= 1, got {value}.")
        if d_model % n_heads:
            raise ValueError(
                f"`n_heads` ({n_heads}) must divide `d_model` ({d_model}); e.g. n_heads={math.gcd(d_model, 4)}."
            )
        self.save_hyperparameters()
        self.lr = lr
        self.weight_decay = weight_decay
        self.token_embedding = nn.Embedding(vocab_size, d_model)
        self.position_embedding = nn.Embedding(max_length, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, dropout) for _ in range(n_layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.head.weight = self.token_embedding.weight  # tied: fewer parameters, better small-data perplexity
        self.apply(_init_weights)

    def forward(self, input_ids: Tensor) -> Tensor:
        """Next-byte logits of shape ``(batch, length, vocab_size)``."""
        length = input_ids.shape[1]
        if length > self.position_embedding.num_embeddings:
            raise ValueError(
                f"An input of {length} bytes is longer than `max_length={self.position_embedding.num_embeddings}`."
                " Raise the model's `max_length` or lower the data's."
            )
        positions = torch.arange(length, device=input_ids.device)
        x = self.token_embedding(input_ids) + self.position_embedding(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def loss(self, batch: dict[str, Tensor]) -> Tensor:
        """Mean cross-entropy over the loss-bearing labels of ``batch``."""
        logits = self(batch["input_ids"])
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE_INDEX)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = self.loss(batch)
        self.log("train/loss", loss, prog_bar=True, batch_size=batch["labels"].shape[0])
        return loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        loss = self.loss(batch)
        # Weighting by tokens makes each rank's epoch value its exact per-token loss (sync_dist then averages the
        # ranks); one host read per validation batch is cheap next to the forward pass.
        n_tokens = int((batch["labels"] != IGNORE_INDEX).sum())
        self.log("val/loss", loss, prog_bar=True, batch_size=n_tokens, sync_dist=True)
        self.log("val/bits_per_byte", loss / math.log(2), batch_size=n_tokens, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        decay = [p for n, p in self.named_parameters() if p.dim() >= 2 and "embedding" not in n]
        no_decay = [p for n, p in self.named_parameters() if p.dim() < 2 or "embedding" in n]
        return torch.optim.AdamW(
            [{"params": decay, "weight_decay": self.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=self.lr,
        )


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
