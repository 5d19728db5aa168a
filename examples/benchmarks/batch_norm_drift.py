"""How far micro-batching moves the gradient of a model with batch norm, and that layer norm is unaffected.

    OMP_NUM_THREADS=1 python examples/benchmarks/batch_norm_drift.py [--seeds 5]

Split mode (like window mode and ``accumulate_grad_batches``) runs a step batch as micro-batches. Each micro-batch is
exactly weighted, but ``BatchNorm`` normalizes it over its own samples, so the gradient is not the full batch's. This
prints, for a 64-sample step batch on a small MLP, the relative L2 distance between the accumulated gradient and the
full-batch gradient at micro-batches of 32, 16, 8 and 4 (median over seeds), with ``BatchNorm1d`` and with
``LayerNorm`` in the same place. The figures in docs/concepts.md and docs/troubleshooting.md come from this script.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from torch import nn

STEP_BATCH, DIM, HIDDEN = 64, 16, 32


def make_model(norm: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    layer = nn.BatchNorm1d(HIDDEN) if norm == "batch" else nn.LayerNorm(HIDDEN)
    return nn.Sequential(nn.Linear(DIM, HIDDEN), layer, nn.ReLU(), nn.Linear(HIDDEN, 1))


def step_gradient(model: nn.Module, x: torch.Tensor, y: torch.Tensor, micro_batch_size: int) -> torch.Tensor:
    """The gradient of the mean loss over the step batch, accumulated over micro-batches weighted by their size."""
    model.zero_grad(set_to_none=True)
    for xs, ys in zip(x.split(micro_batch_size), y.split(micro_batch_size), strict=True):
        loss = nn.functional.mse_loss(model(xs), ys) * len(xs) / len(x)
        loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def relative_distance(norm: str, micro_batch_size: int, seed: int) -> float:
    model = make_model(norm, seed).train()
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(STEP_BATCH, DIM, generator=g), torch.randn(STEP_BATCH, 1, generator=g)
    full = step_gradient(model, x, y, STEP_BATCH)
    micro = step_gradient(model, x, y, micro_batch_size)
    return float((micro - full).norm() / full.norm())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    args = parser.parse_args()
    print(f"Step batch {STEP_BATCH}; relative L2 distance from the full-batch gradient, median of {args.seeds} seeds")
    print(f"{'micro-batch':>11}  {'BatchNorm1d':>11}  {'LayerNorm':>9}")
    for micro_batch_size in (32, 16, 8, 4):
        figures = [
            statistics.median(relative_distance(norm, micro_batch_size, seed) for seed in range(args.seeds))
            for norm in ("batch", "layer")
        ]
        print(f"{micro_batch_size:>11}  {figures[0]:>11.1%}  {figures[1]:>9.1e}")


if __name__ == "__main__":
    main()
