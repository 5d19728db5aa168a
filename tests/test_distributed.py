"""The small collectives: `all_reduce_gradients` sums in flat buckets, fills missing gradients, counts its calls."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist

import tests.helpers as h
from lightning_accum._util.distributed import all_reduce_gradients

pytestmark = [pytest.mark.ddp, pytest.mark.timeout(120)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=h.RANK_TIMEOUT)
    try:
        params = [
            torch.zeros(3, requires_grad=True),
            torch.zeros(2, 2, requires_grad=True),
            torch.zeros(5, dtype=torch.float64, requires_grad=True),
        ]
        for i, p in enumerate(params):
            p.grad = torch.full_like(p, float(rank + 1) * (i + 1))
        params[1].grad = None if rank == 0 else params[1].grad  # a gradient only one rank produced
        # 16-byte buckets: the two float32 tensors (12 + 16 bytes) fill one, the float64 one gets its own by dtype.
        calls = all_reduce_gradients(params, bucket_bytes=16)
        torch.save({"grads": [p.grad for p in params], "calls": calls}, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_all_reduce_gradients_sums_every_gradient_in_buckets(tmp_path):
    h.start_ranks(_worker, (_free_port(), str(tmp_path)), 2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for result in ranks:
        grads = result["grads"]
        torch.testing.assert_close(grads[0], torch.full((3,), 1.0 + 2.0))  # ranks contribute 1 and 2
        torch.testing.assert_close(grads[1], torch.full((2, 2), 0.0 + 4.0))  # rank 0 had none: it counted as zero
        torch.testing.assert_close(grads[2], torch.full((5,), 3.0 + 6.0, dtype=torch.float64))
        assert result["calls"] == 2  # a bucket is flushed once it holds >= 16 bytes; dtypes never share one
