"""How far micro-batching moves the gradient of a loss that couples a batch's samples (InfoNCE, in-batch negatives).

    OMP_NUM_THREADS=1 python examples/benchmarks/coupled_losses.py [--seeds 5]

Exact accumulation weights every micro-batch by its items, which gives the full-batch gradient whenever the loss is a
sum of per-sample terms. A contrastive loss with in-batch negatives is not: each query is scored against the keys of
its own batch, so a micro-batch of ``b`` gives each query ``b - 1`` negatives instead of ``B - 1``, and no weighting
can restore the ones it never saw. This prints, for a 32-pair step batch on a small two-tower encoder, the relative L2
distance between the accumulated gradient and the full-batch gradient at micro-batches of 16, 8, 6, 4 and 2 (median
over seeds; the step batch is cut into ``ceil(B / b)`` balanced micro-batches, as split mode cuts it), for:

- InfoNCE, micro-batched: what split mode (and window mode, and ``accumulate_grad_batches``) computes;
- InfoNCE with a gradient cache (Gao et al. 2021, "GradCache"): every micro-batch's embeddings are computed first
  without a graph, the loss and its gradient with respect to the embeddings on the whole batch, then each
  micro-batch's encoder backward from those gradients; exact, at the cost of a second forward pass;
- a per-pair loss on the same encoders (the squared distance between a query's and its key's embeddings), which
  accumulation makes exact.

The figures in docs/concepts.md and docs/troubleshooting.md come from this script.
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Callable

import torch
from torch import Tensor, nn

STEP_BATCH, DIM, HIDDEN, EMBEDDING, TEMPERATURE = 32, 16, 32, 16, 0.1


def make_towers(seed: int) -> nn.ModuleDict:
    torch.manual_seed(seed)

    def tower() -> nn.Module:
        return nn.Sequential(nn.Linear(DIM, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, EMBEDDING))

    return nn.ModuleDict({"query": tower(), "key": tower()})


def info_nce(q: Tensor, k: Tensor) -> Tensor:
    """The mean over queries of the cross-entropy of each query against every key of the batch (its own is right)."""
    q, k = nn.functional.normalize(q, dim=-1), nn.functional.normalize(k, dim=-1)
    return nn.functional.cross_entropy(q @ k.T / TEMPERATURE, torch.arange(len(q)))


def per_pair(q: Tensor, k: Tensor) -> Tensor:
    return (q - k).square().sum(-1).mean()


def gradient(towers: nn.ModuleDict) -> Tensor:
    return torch.cat([p.grad.flatten() for p in towers.parameters()])


def accumulated(towers: nn.ModuleDict, xq: Tensor, xk: Tensor, k: int, loss_fn: Callable[..., Tensor]) -> Tensor:
    """The gradient of the step's mean loss, accumulated over ``k`` micro-batches weighted by their size."""
    towers.zero_grad(set_to_none=True)
    for q_in, k_in in zip(xq.tensor_split(k), xk.tensor_split(k), strict=True):
        loss = loss_fn(towers["query"](q_in), towers["key"](k_in)) * len(q_in) / len(xq)
        loss.backward()
    return gradient(towers)


def gradient_cached(towers: nn.ModuleDict, xq: Tensor, xk: Tensor, k: int) -> Tensor:
    """InfoNCE's full-batch gradient, one micro-batch of encoder activations at a time (two forward passes)."""
    towers.zero_grad(set_to_none=True)
    with torch.no_grad():
        q = torch.cat([towers["query"](chunk) for chunk in xq.tensor_split(k)])
        keys = torch.cat([towers["key"](chunk) for chunk in xk.tensor_split(k)])
    q.requires_grad_(True)
    keys.requires_grad_(True)
    info_nce(q, keys).backward()  # the gradient with respect to every embedding, from the whole batch
    for q_in, k_in, dq, dk in zip(
        xq.tensor_split(k), xk.tensor_split(k), q.grad.tensor_split(k), keys.grad.tensor_split(k), strict=True
    ):
        ((towers["query"](q_in) * dq).sum() + (towers["key"](k_in) * dk).sum()).backward()
    return gradient(towers)


def relative_distances(micro_batch_size: int, seed: int) -> tuple[float, float, float]:
    towers = make_towers(seed)
    g = torch.Generator().manual_seed(seed)
    xq = torch.randn(STEP_BATCH, DIM, generator=g)
    xk = xq + 0.5 * torch.randn(STEP_BATCH, DIM, generator=g)  # a positive pair: two noisy views of one sample
    k = math.ceil(STEP_BATCH / micro_batch_size)
    figures = []
    for loss_fn, micro in [
        (info_nce, lambda: accumulated(towers, xq, xk, k, info_nce)),
        (info_nce, lambda: gradient_cached(towers, xq, xk, k)),
        (per_pair, lambda: accumulated(towers, xq, xk, k, per_pair)),
    ]:
        full = accumulated(towers, xq, xk, 1, loss_fn)
        figures.append(float((micro() - full).norm() / full.norm()))
    return figures[0], figures[1], figures[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    args = parser.parse_args()
    print(
        f"Step batch {STEP_BATCH} pairs, temperature {TEMPERATURE}; relative L2 distance from the full-batch"
        f" gradient, median of {args.seeds} seeds"
    )
    print(f"{'micro-batch':>11}  {'k':>2}  {'InfoNCE':>8}  {'InfoNCE, gradient cache':>23}  {'per-pair loss':>13}")
    for micro_batch_size in (16, 8, 6, 4, 2):
        runs = [relative_distances(micro_batch_size, seed) for seed in range(args.seeds)]
        nce, cached, pair = (statistics.median(column) for column in zip(*runs, strict=True))
        k = math.ceil(STEP_BATCH / micro_batch_size)
        print(f"{micro_batch_size:>11}  {k:>2}  {nce:>8.1%}  {cached:>23.1e}  {pair:>13.1e}")


if __name__ == "__main__":
    main()
