"""Models and data for the probe's tests, at opposite ends of the memory question; import paths point here.

``ParamHeavy`` (wide Linear layers, tiny batch, SGD): parameters and gradients dominate the peak.
``ActHeavy`` (deep narrow network, large batch): activations dominate the peak.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import Tensor, nn


class _Stack(pl.LightningModule):
    def __init__(self, width: int, depth: int, optimizer: str = "sgd") -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(width, width)]
        for _ in range(depth - 1):
            layers += [nn.Tanh(), nn.Linear(width, width)]
        self.net = nn.Sequential(*layers)
        self.optimizer = optimizer

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        self.log("train_loss", 0.0)  # must not need a Trainer
        return nn.functional.mse_loss(self.net(x)[:, :1], y)

    def configure_optimizers(self):
        if self.optimizer == "adam":
            return {"optimizer": torch.optim.Adam(self.parameters(), lr=1e-3)}
        return torch.optim.SGD(self.parameters(), lr=0.1)


class ParamHeavy(_Stack):
    def __init__(self, optimizer: str = "sgd") -> None:
        super().__init__(width=1024, depth=3, optimizer=optimizer)


class ActHeavy(_Stack):
    def __init__(self, optimizer: str = "sgd") -> None:
        super().__init__(width=64, depth=24, optimizer=optimizer)


def regression_batch(micro_batch_size: int, dim: int = 64) -> tuple[Tensor, Tensor]:
    return torch.randn(micro_batch_size, dim), torch.randn(micro_batch_size, 1)


def grad_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


class _Dataset(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        return torch.randn(64), torch.randn(1)


class RegressionData(pl.LightningDataModule):
    def __init__(self, batch_size: int = 32) -> None:
        super().__init__()
        self.batch_size = batch_size

    def train_dataloader(self):
        return torch.utils.data.DataLoader(_Dataset(), batch_size=self.batch_size)


# ---- sequences: the probe in tokens ---------------------------------------------------------------------------------

VOCAB = 64


class TokenLM(pl.LightningModule):
    """A one-block causal LM over right-padded ``input_ids``/``attention_mask``/``labels`` batches.

    ``attention="eager"`` materializes the scores of every pair of positions, as Hugging Face's eager attention does:
    memory that grows with ``n x L²`` = ``T x L``. ``"sdpa"`` calls the fused kernel, whose memory grows with ``T``.
    """

    def __init__(self, dim: int = 32, heads: int = 4, attention: str = "eager", optimizer: str = "sgd") -> None:
        super().__init__()
        self.heads, self.attention, self.optimizer = heads, attention, optimizer
        self.embed = nn.Embedding(VOCAB, dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, input_ids: Tensor) -> Tensor:
        batch, length = input_ids.shape
        x = self.embed(input_ids)
        q, k, v = self.qkv(x).view(batch, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        if self.attention == "eager":
            scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
            future = torch.ones(length, length, dtype=torch.bool, device=x.device).triu(1)
            attended = scores.masked_fill(future, float("-inf")).softmax(-1) @ v
        else:
            attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attended.transpose(1, 2).reshape(batch, length, -1))
        return self.head(torch.tanh(x))

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        logits = self(batch["input_ids"])
        return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten())

    def configure_optimizers(self):
        if self.optimizer == "adam":
            return torch.optim.Adam(self.parameters(), lr=1e-3)
        return torch.optim.SGD(self.parameters(), lr=0.1)


def token_batch(batch_size: int, seq_len: int = 64, lengths: list[int] | None = None) -> dict[str, Tensor]:
    """Right-padded random sequences, ``seq_len`` long each unless ``lengths`` (cycled over the batch) says less."""
    g = torch.Generator().manual_seed(batch_size)
    ids = torch.randint(1, VOCAB, (batch_size, seq_len), generator=g)
    real = torch.tensor([(lengths or [seq_len])[i % len(lengths or [seq_len])] for i in range(batch_size)])
    mask = (torch.arange(seq_len)[None, :] < real[:, None]).long()
    ids = ids * mask
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
