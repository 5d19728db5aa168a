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
