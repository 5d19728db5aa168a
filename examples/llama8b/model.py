"""A Llama-3-shaped causal LM as a LightningModule: the 8B configuration, buildable on the meta device at any depth.

The architecture follows Meta's Llama 3 (the public ``config.json`` of ``meta-llama/Meta-Llama-3-8B``): pre-norm
RMSNorm, grouped-query attention with rotary position embeddings (``rope_theta`` 500000), a SwiGLU MLP and untied
input and output embeddings (tied in the small Llama 3.2 models, as in `TINY`). Attention repeats the key/value
heads and calls ``F.scaled_dot_product_attention``, as the Hugging Face implementation does; the loss upcasts the
logits to float32, as it does too.

Nothing here allocates at construction beyond the parameters themselves, so ``with torch.device("meta"):`` builds
the 8B model in milliseconds, and the probe's fake tensors trace a training step of it without memory.
"""

from __future__ import annotations

import dataclasses

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """The shape of a Llama model. The defaults are Llama-3-8B's (``meta-llama/Meta-Llama-3-8B``, ``config.json``)."""

    vocab_size: int = 128_256
    hidden_size: int = 4096
    intermediate_size: int = 14_336
    num_layers: int = 32
    num_heads: int = 32
    num_kv_heads: int = 8
    rope_theta: float = 500_000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False  # Llama 3.2 1B/3B tie them; 8B does not

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def parameter_count(self) -> int:
        """Parameters by arithmetic: embeddings and head, and per layer four projections, an MLP and two norms."""
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        attention = h * h + 2 * h * kv + h * h
        mlp = 3 * h * self.intermediate_size
        embeddings = (1 if self.tie_word_embeddings else 2) * self.vocab_size * h
        return embeddings + self.num_layers * (attention + mlp + 2 * h) + h


LLAMA3_8B = LlamaConfig()
TINY = LlamaConfig(
    vocab_size=8192,
    hidden_size=128,
    intermediate_size=512,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    tie_word_embeddings=True,
)
"""A parameter-heavy miniature for tests on real tensors: a large tied vocabulary, narrow layers (Llama 3.2 style)."""


class RMSNorm(nn.Module):
    """Root-mean-square layer norm, computed in float32 as Llama does."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _rotate_half(x: Tensor) -> Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class Attention(nn.Module):
    """Grouped-query self-attention with rotary embeddings; causal.

    ``implementation="sdpa"`` calls ``F.scaled_dot_product_attention`` (a fused kernel: its memory grows with the
    tokens); ``"eager"`` computes the scores of every pair of positions and their softmax in float32, as Hugging
    Face's ``attn_implementation="eager"`` does, and keeps them for the backward pass (memory that grows with
    ``tokens x length``).
    """

    def __init__(self, config: LlamaConfig, implementation: str = "sdpa") -> None:
        super().__init__()
        if implementation not in ("sdpa", "eager"):
            raise ValueError(f"`attention` must be 'sdpa' or 'eager', got {implementation!r}.")
        self.implementation = implementation
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, config.num_heads * config.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.num_kv_heads * config.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.num_kv_heads * config.head_dim, bias=False)
        self.o_proj = nn.Linear(config.num_heads * config.head_dim, config.hidden_size, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        groups = self.num_heads // self.num_kv_heads
        k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
        out = (
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
            if self.implementation == "sdpa"
            else _eager(q, k, v)
        )
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


def _eager(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    length = q.shape[-2]
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    future = torch.ones(length, length, dtype=torch.bool, device=q.device).triu(1)
    probabilities = scores.masked_fill(future, float("-inf")).softmax(-1, dtype=torch.float32).to(q.dtype)
    return probabilities @ v


class DecoderLayer(nn.Module):
    """Pre-norm attention and SwiGLU MLP, each in a residual branch."""

    def __init__(self, config: LlamaConfig, attention: str = "sdpa") -> None:
        super().__init__()
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attention = Attention(config, attention)
        self.post_attention_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.attention(self.input_norm(x), cos, sin)
        h = self.post_attention_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class LlamaLM(pl.LightningModule):
    """A Llama-3-shaped causal language model; the loss is the mean next-token cross-entropy.

    Args:
        config: the model's shape; `LLAMA3_8B` by default, or a `LlamaConfig` field dict (e.g. from YAML).
        activation_checkpointing: recompute each decoder layer in the backward pass (non-reentrant
            ``torch.utils.checkpoint``), keeping only its input alive between the passes.
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
        attention: ``"sdpa"`` (a fused kernel) or ``"eager"`` (the scores of every pair of positions, kept), see
            `Attention`.
    """

    def __init__(
        self,
        config: LlamaConfig | dict | None = None,
        activation_checkpointing: bool = False,
        lr: float = 1e-5,
        weight_decay: float = 0.0,
        attention: str = "sdpa",
    ) -> None:
        super().__init__()
        config = LlamaConfig(**config) if isinstance(config, dict) else (config or LLAMA3_8B)
        self.config = config
        self.activation_checkpointing = activation_checkpointing
        self.lr, self.weight_decay = lr, weight_decay
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, attention) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def _rotary(self, length: int, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        dim = self.config.head_dim
        inv_freq = 1.0 / self.config.rope_theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
        angles = torch.outer(torch.arange(length, device=device, dtype=torch.float32), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def forward(self, input_ids: Tensor) -> Tensor:
        """Next-token logits of shape ``(batch, length, vocab_size)``."""
        x = self.embed_tokens(input_ids)
        cos, sin = self._rotary(input_ids.shape[1], x.device, x.dtype)
        for layer in self.layers:
            if self.activation_checkpointing and self.training:
                x = checkpoint(layer, x, cos, sin, use_reentrant=False)
            else:
                x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        logits = self(batch["input_ids"])
        return F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=self.weight_decay)


def random_tokens(micro_batch_size: int, seq_len: int = 2048, vocab_size: int = LLAMA3_8B.vocab_size) -> dict:
    """A batch of random token ids: ``input_ids`` and next-token ``labels``, each ``(micro_batch_size, seq_len)``."""
    tokens = torch.randint(0, vocab_size, (micro_batch_size, seq_len + 1))
    return {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}


def tiny_tokens(micro_batch_size: int, seq_len: int = 32) -> dict:
    """`random_tokens` for the `TINY` configuration."""
    return random_tokens(micro_batch_size, seq_len, TINY.vocab_size)


def log_normal_lengths(
    count: int, median: float, sigma: float, shortest: int, longest: int, generator: torch.Generator
) -> Tensor:
    """``count`` sequence lengths, log-normal around ``median`` (``sigma`` the spread of its log), rounded and clamped
    to ``[shortest, longest]``: a skewed distribution, as real fine-tuning sets have. Drawn from ``generator``."""
    drawn = (torch.randn(count, generator=generator) * sigma).exp() * median
    return drawn.round().clamp(shortest, longest).long()


def padded_tokens(
    micro_batch_size: int,
    seq_len: int = 2048,
    vocab_size: int = LLAMA3_8B.vocab_size,
    median_length: int | None = None,
    sigma: float = 0.8,
    min_length: int = 16,
    seed: int = 0,
) -> dict:
    """Right-padded random sequences, as a tokenizer pads a batch: ``input_ids``, ``attention_mask`` and ``labels``.

    Each is ``(micro_batch_size, seq_len)``. Every sequence is ``seq_len`` long, or with ``median_length`` its length
    is log-normal around it (``sigma`` the spread of its log), between ``min_length`` and ``seq_len``, drawn from
    ``seed``. ``labels`` are the next tokens, -100 past each sequence's last one, as `LlamaLM.training_step` reads them.
    """
    g = torch.Generator().manual_seed(seed)
    if median_length is None:
        lengths = torch.full((micro_batch_size,), seq_len)
    else:
        lengths = log_normal_lengths(micro_batch_size, median_length, sigma, min(min_length, seq_len), seq_len, g)
    tokens = torch.randint(0, vocab_size, (micro_batch_size, seq_len + 1), generator=g)
    positions = torch.arange(seq_len + 1)[None, :]
    tokens = tokens.masked_fill(positions >= lengths[:, None], 0)
    mask = (positions[:, :-1] < lengths[:, None]).long()
    labels = tokens[:, 1:].masked_fill(positions[:, 1:] >= lengths[:, None], -100)
    return {"input_ids": tokens[:, :-1], "attention_mask": mask, "labels": labels}
