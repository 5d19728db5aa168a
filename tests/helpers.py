"""Small models, data and reference computations shared by the tests."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.utils.data import Dataset

FP32 = {"rtol": 1e-5, "atol": 1e-6}
"""`torch.testing.assert_close` tolerances for float32 results that differ only in summation order."""


class IndexedDataset(Dataset):
    """Regression samples that carry their own index, so a test can tell which samples a step saw."""

    def __init__(self, n: int = 40, dim: int = 6, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, dim, generator=g)
        self.y = torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {"x": self.x[i], "y": self.y[i], "index": torch.tensor(i)}


class RegressionModel(pl.LightningModule):
    """A linear model with a mean-squared-error loss; records the gradient seen at each optimizer step."""

    def __init__(self, dim: int = 6, lr: float = 0.1, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.layer = nn.Linear(dim, 1)
        self.lr = lr
        self.step_grads: list[dict[str, Tensor | None]] = []  # gradient at each optimizer step, after clipping
        self.step_indices: list[list[int]] = []  # sample indices in each optimizer step (this rank)
        self._window_indices: list[int] = []
        self.split_mode = False

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        self._record(batch)
        return nn.functional.mse_loss(self.layer(batch["x"]), batch["y"])

    def _record(self, batch: dict[str, Tensor]) -> None:
        if not self.split_mode:
            self._window_indices.extend(batch["index"].tolist())

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # In split mode a step is one dataloader batch, whatever micro-batches (and retries) ran it.
        if self.split_mode:
            self._window_indices = batch["index"].tolist()

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
        self.step_grads.append(
            {n: None if p.grad is None else p.grad.detach().clone() for n, p in self.named_parameters()}
        )
        self.step_indices.append(self._window_indices)
        self._window_indices = []

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def quiet_trainer_kwargs(**kwargs: Any) -> dict[str, Any]:
    """`pl.Trainer` arguments for a run that writes nothing: no logger, checkpoint, progress bar or model summary."""
    quiet = {
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    return {**quiet, **kwargs}


def make_trainer(tmp_path: Any, callbacks: Sequence[pl.Callback] = (), **kwargs: Any) -> pl.Trainer:
    defaults: dict[str, Any] = {
        "default_root_dir": tmp_path,
        "accelerator": "cpu",
        "devices": 1,
        "max_epochs": 1,
        **quiet_trainer_kwargs(),
        "num_sanity_val_steps": 0,
        "log_every_n_steps": 1,  # tiny runs: log (and let AccumulationMonitor log) every optimizer step
    }
    defaults.update(kwargs)
    return pl.Trainer(callbacks=list(callbacks), **defaults)


def reference_grads(
    model: nn.Module, batches: Sequence[Any], loss_fn: Callable[[nn.Module, Any], Tensor]
) -> dict[str, Tensor]:
    """The exact gradient: the loss of one pass over the concatenated window, on a copy of ``model``."""
    ref = copy.deepcopy(model)
    ref.zero_grad(set_to_none=True)
    loss_fn(ref, concat(batches)).backward()
    return {n: p.grad.detach().clone() for n, p in ref.named_parameters()}


def concat(batches: Sequence[Any]) -> Any:
    first = batches[0]
    if isinstance(first, Tensor):
        return torch.cat(list(batches))
    if isinstance(first, dict):
        return {k: concat([b[k] for b in batches]) for k in first}
    if isinstance(first, (list, tuple)):
        return type(first)(concat([b[i] for b in batches]) for i in range(len(first)))
    raise TypeError(type(first))


def grad_ratio(actual: dict[str, Tensor], expected: dict[str, Tensor]) -> float:
    """How many times the exact gradient ``actual`` is (least squares over all entries)."""
    a = torch.cat([actual[n].flatten() for n in expected])
    e = torch.cat([expected[n].flatten() for n in expected])
    return float((a @ e) / (e @ e))


class TokenDataset(Dataset):
    """Sequences of ``seq_len`` tokens of which only the first ``lengths[i]`` carry a loss (the rest is padding)."""

    def __init__(
        self, n: int = 32, seq_len: int = 8, dim: int = 5, seed: int = 0, lengths: Sequence[int] | None = None
    ):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, seq_len, dim, generator=g)
        self.y = torch.randn(n, seq_len, generator=g)
        if lengths is None:
            lengths = torch.randint(1, seq_len + 1, (n,), generator=g).tolist()
        self.mask = torch.zeros(n, seq_len, dtype=torch.bool)
        for i, length in enumerate(lengths):
            self.mask[i, :length] = True

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {"x": self.x[i], "y": self.y[i], "mask": self.mask[i], "index": torch.tensor(i)}


def count_tokens(batch: dict[str, Tensor]) -> Tensor:
    """Loss-bearing tokens of a micro-batch (module level, so ``ddp_spawn`` can pickle it)."""
    return batch["mask"].sum()


def token_loss(model: nn.Module, batch: dict[str, Tensor], reduction: str = "mean") -> Tensor:
    per_token = (model.layer(batch["x"]).squeeze(-1) - batch["y"]) ** 2
    total = (per_token * batch["mask"]).sum()
    if reduction == "sum":
        return total
    # The usual masked mean; `clamp` keeps an all-padding micro-batch finite.
    return total / batch["mask"].sum().clamp(min=1)


def mse_loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    return nn.functional.mse_loss(model.layer(batch["x"]), batch["y"])


class TokenModel(RegressionModel):
    """Per-token regression whose loss is the mean (or sum) over loss-bearing tokens."""

    def __init__(self, dim: int = 5, lr: float = 0.1, reduction: str = "mean", seed: int = 0) -> None:
        super().__init__(dim=dim, lr=lr, seed=seed)
        self.reduction = reduction

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        self._record(batch)
        return token_loss(self, batch, self.reduction)


def replay_reference(
    initial: nn.Module,
    dataset: Dataset,
    step_indices: Sequence[Sequence[int]],
    loss_fn: Callable[[nn.Module, Any], Tensor],
    lr: float,
    clip_norm: float | None = None,
    lrs: Sequence[float] | None = None,
) -> list[dict[str, Tensor]]:
    """Exact gradients along the run: at each step, one pass over the step's samples, then plain SGD.

    ``lrs`` gives each step's learning rate where it changes during the run (a schedule that scales it with ``k``);
    otherwise every step uses ``lr``.
    """
    ref = copy.deepcopy(initial)
    grads = []
    for step, indices in enumerate(step_indices):
        if lrs is not None:
            lr = lrs[step]
        window = [dataset[i] for i in indices]
        batch = {k: torch.stack([s[k] for s in window]) for k in window[0]}
        expected = reference_grads(ref, [batch], loss_fn)
        if clip_norm is not None:
            norm = torch.cat([g.flatten() for g in expected.values()]).norm()
            scale = min(1.0, clip_norm / (float(norm) + 1e-6))
            expected = {n: g * scale for n, g in expected.items()}
        grads.append(expected)
        with torch.no_grad():
            for name, p in ref.named_parameters():
                p -= lr * expected[name]
    return grads


def assert_grads_close(
    actual: Sequence[dict[str, Tensor]], expected: Sequence[dict[str, Tensor]], **tolerance: float
) -> None:
    assert len(actual) == len(expected), f"{len(actual)} optimizer steps, expected {len(expected)}"
    for step, (a, e) in enumerate(zip(actual, expected, strict=False)):
        for name in e:
            torch.testing.assert_close(
                a[name], e[name], msg=lambda m, s=step, n=name: f"step {s}, {n}: {m}", **tolerance
            )
