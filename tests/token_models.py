"""A small causal language model and padded variable-length data, shared by the split-by-tokens tests."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from examples.benchmarks import token_split

VOCAB = 40


class TokenSequences(token_split.TokenSequences):
    """Token sequences of the given lengths (random ids, the benchmark's), one dict per sample, for `pad_right`."""

    def __init__(self, lengths: Sequence[int], seed: int = 0) -> None:
        super().__init__(lengths, seed, vocab=VOCAB)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {"input_ids": self.samples[i], "index": torch.tensor(i)}


def lognormal_lengths(n: int, seed: int = 0, median: float = 12.0, cap: int = 48) -> list[int]:
    """Lengths of very different sizes: log-normal around ``median``, between 2 and ``cap``."""
    g = torch.Generator().manual_seed(seed)
    lengths = (torch.randn(n, generator=g) * 0.8 + torch.log(torch.tensor(median))).exp()
    return [int(v) for v in lengths.round().clamp(2, cap)]


def pad_right(samples: list[dict[str, Tensor]], pad_to: int | None = None) -> dict[str, Tensor]:
    """Right-padded ``input_ids``, ``attention_mask`` and ``labels`` (-100 on padding), as a tokenizer gives them."""
    length = pad_to or max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(len(samples), length, dtype=torch.long)
    mask = torch.zeros(len(samples), length, dtype=torch.long)
    for row, sample in enumerate(samples):
        n = len(sample["input_ids"])
        ids[row, :n] = sample["input_ids"]
        mask[row, :n] = 1
    labels = ids.masked_fill(mask == 0, -100)
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "labels": labels,
        "index": torch.stack([s["index"] for s in samples]),
    }


class TinyCausalLM(pl.LightningModule):
    """One causal self-attention block over token and position embeddings; it shifts its labels inside, as Hugging
    Face causal LMs do, and averages the cross-entropy over the loss-bearing tokens of its micro-batch.

    Records the gradient and the sample indices of every optimizer step (this rank's).
    """

    def __init__(self, dim: int = 16, heads: int = 2, max_length: int = 64, lr: float = 0.1, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.heads, self.lr = heads, lr
        self.embed = nn.Embedding(VOCAB, dim)
        self.position = nn.Embedding(max_length, dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.mix = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, VOCAB)
        self.step_grads: list[dict[str, Tensor]] = []
        self.step_indices: list[list[int]] = []
        self.micro_batch_shapes: list[tuple[int, int]] = []
        self._indices: list[int] = []

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        batch, length = input_ids.shape
        x = self.embed(input_ids) + self.position(torch.arange(length, device=input_ids.device))
        q, k, v = self.qkv(x).view(batch, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
        allowed = causal[None, None] & attention_mask.bool()[:, None, None, :]
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        x = x + self.mix(attended.transpose(1, 2).reshape(batch, length, -1))
        return self.head(torch.tanh(x))

    def loss(self, batch: dict[str, Tensor]) -> Tensor:
        logits = self(batch["input_ids"], batch["attention_mask"])
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), batch["labels"][:, 1:].reshape(-1), ignore_index=-100)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        self.micro_batch_shapes.append(tuple(batch["input_ids"].shape))
        return self.loss(batch)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._indices = batch["index"].tolist()

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.step_grads.append({n: p.grad.detach().clone() for n, p in self.named_parameters() if p.grad is not None})
        self.step_indices.append(self._indices)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def full_batch_reference(
    initial: TinyCausalLM,
    dataset: TokenSequences,
    steps: Sequence[Sequence[int]],
    lr: float,
    collate: Callable[[list[dict[str, Tensor]]], dict[str, Tensor]] = pad_right,
) -> list[dict[str, Tensor]]:
    """The exact gradients along the run: each step's samples in one padded batch (``collate``), one pass, then SGD."""
    model = copy.deepcopy(initial)
    grads = []
    for indices in steps:
        batch = collate([dataset[i] for i in indices])
        model.zero_grad(set_to_none=True)
        model.loss(batch).backward()
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name in grads[-1]:
                    p -= lr * grads[-1][name]
    return grads


class SavedTokenRun(pl.Callback):
    """Writes what a split-by-tokens fit did on this rank to ``out_dir/rank{r}.pt``, with `record`'s additions."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def record(self, pl_module: Any) -> dict[str, Any]:
        return {}

    def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        from lightning_accum import AutoMicroBatching

        callback = next(cb for cb in trainer.callbacks if isinstance(cb, AutoMicroBatching))
        run = {
            "step_grads": pl_module.step_grads,
            "step_indices": pl_module.step_indices,
            "shapes": pl_module.micro_batch_shapes,
            "planner": callback.planner.state_dict(),
            "oom_retries": callback.oom_retries,
            "fired": callback.fault_injector.fired if callback.fault_injector else [],
            "reports": callback.last_step_report,
        }
        torch.save(run | self.record(pl_module), os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt"))
