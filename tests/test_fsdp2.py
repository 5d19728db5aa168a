"""Real FSDP2 on CPU: ``ModelParallelStrategy`` with ``fully_shard``, 2 processes, gloo.

Window mode is exact against a single-process reference when the ranks hold different token counts, with the
gradient sync deferred to a window's last micro-batch (the default: one reduce-scatter per FSDP unit per optimizer
step) and with ``sync_every_micro_batch=True`` (one per micro-batch).

``ModelParallelStrategy`` launches its processes by re-running the command (``_SubprocessScriptLauncher``), which
cannot work inside pytest. The test starts the two processes itself, with the variables torchrun sets
(``LOCAL_RANK``, ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), so that Lightning sees an external
launcher and starts nothing.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

import tests.helpers as h
from lightning_accum import AccumulationScheduler

pytestmark = [pytest.mark.ddp, pytest.mark.timeout(180)]  # about 30 s each on 2 cores

WORLD_SIZE = 2
LR = 0.05
FSDP_UNITS = 2  # `layer.0` and the root `layer` (which holds `layer.2`): one reduce-scatter each per synced backward


class ShardedTokenModel(h.TokenModel):
    """Per-token regression through two layers, each sharded by FSDP2 in ``configure_model``.

    Records the full (unsharded) gradient of every optimizer step, gathered from the shards.
    """

    def __init__(self) -> None:
        super().__init__(lr=LR)
        torch.manual_seed(0)
        self.layer = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1))

    def configure_model(self) -> None:
        if self.device_mesh is None:  # the single-process reference
            return
        mesh = self.device_mesh["data_parallel"]
        fully_shard(self.layer[0], mesh=mesh)
        fully_shard(self.layer, mesh=mesh)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        # After the callback's rescale (`on_before_optimizer_step`), before the optimizer: the gradient it applies.
        # `full_tensor()` all-gathers, on every rank alike (this hook runs at every optimizer step on every rank).
        self.step_grads.append(
            {
                n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad.clone()
                for n, p in self.named_parameters()
            }
        )
        self.step_indices.append(self._window_indices)
        self._window_indices = []


class _CollectiveCounter:
    """Counts calls of ``torch.distributed`` collectives in this process, by wrapping the module's functions."""

    def __init__(self, *names: str) -> None:
        self.counts = dict.fromkeys(names, 0)
        for name in names:
            original = getattr(dist, name)

            def counted(*args: Any, _name: str = name, _original: Any = original, **kwargs: Any) -> Any:
                self.counts[_name] += 1
                return _original(*args, **kwargs)

            setattr(dist, name, counted)


class _SaveRun(pl.Callback):
    """Saves what this rank saw to ``out_dir/rank{r}.pt``, with the collectives counted during training."""

    def __init__(self, out_dir: str, counter: _CollectiveCounter) -> None:
        self.out_dir = out_dir
        self.counter = counter
        self.at_start: dict[str, int] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.at_start = dict(self.counter.counts)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        during = {name: n - self.at_start[name] for name, n in self.counter.counts.items()}
        torch.save(
            {
                "optimizer_steps": trainer.global_step,
                "collectives": during,
                "step_grads": pl_module.step_grads,
                "step_indices": pl_module.step_indices,
                "sharded": all(isinstance(p, DTensor) for p in pl_module.parameters()),
            },
            os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt"),
        )


def start_worker(rank: int, port: int) -> tuple[_CollectiveCounter, ModelParallelStrategy]:
    """Make this spawned process rank ``rank`` of a torchrun-style launch; its collective counter and strategy.

    With what torchrun sets, Lightning's `LightningEnvironment` launches nothing and reads the ranks from here.
    """
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(WORLD_SIZE),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        NODE_RANK="0",
    )
    torch.set_num_threads(1)
    # `reduce_scatter_single` is what FSDP2's default reduce-scatter calls (`_fsdp_collectives.DefaultReduceScatter`),
    # `reduce_scatter_tensor` what older releases called; `all_reduce` carries the item counts.
    counter = _CollectiveCounter("reduce_scatter_single", "reduce_scatter_tensor", "all_reduce")
    strategy = h.fsdp2_strategy(WORLD_SIZE)
    return counter, strategy


def _worker(rank: int, port: int, out_dir: str, k: int, sync_every_micro_batch: bool, max_epochs: int) -> None:
    counter, strategy = start_worker(rank, port)
    model = ShardedTokenModel()
    scheduler = AccumulationScheduler(k, count_items=h.count_tokens, sync_every_micro_batch=sync_every_micro_batch)
    trainer = h.make_trainer(
        out_dir,
        [scheduler, _SaveRun(out_dir, counter)],
        strategy=strategy,
        devices=WORLD_SIZE,
        max_epochs=max_epochs,
    )
    trainer.fit(model, DataLoader(h.TokenDataset(30), batch_size=4))
    if dist.is_initialized():
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_fsdp2(out_dir: Any, k: int, sync_every_micro_batch: bool, max_epochs: int = 1) -> list[dict[str, Any]]:
    args = (_free_port(), str(out_dir), k, sync_every_micro_batch, max_epochs)
    h.start_ranks(_worker, args, WORLD_SIZE)
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(WORLD_SIZE)]


def reduce_scatters(run: dict[str, Any]) -> int:
    return run["collectives"]["reduce_scatter_single"] + run["collectives"]["reduce_scatter_tensor"]


@pytest.mark.parametrize(
    ("sync_every_micro_batch", "reduce_scatters_per_micro_batch"),
    [
        pytest.param(False, 0, id="deferred"),  # only the window's last micro-batch reduce-scatters
        pytest.param(True, 1, id="every-micro-batch"),
    ],
)
def test_window_mode_under_fsdp2_is_exact_and_reduce_scatters_as_chosen(
    tmp_path, sync_every_micro_batch, reduce_scatters_per_micro_batch
):
    # 30 sequences with random token counts: 15 per rank, micro-batches of 4, so 4 micro-batches per rank per epoch;
    # k=3 gives a full window and a 1-batch tail each epoch. The ranks hold different token counts in every window.
    k, epochs = 3, 2
    ranks = run_fsdp2(tmp_path, k, sync_every_micro_batch, max_epochs=epochs)

    assert all(r["sharded"] for r in ranks), "the parameters must be FSDP2 DTensors for this test to bite"
    steps = ranks[0]["optimizer_steps"]
    assert steps == 2 * epochs
    windows = [a + b for a, b in zip(ranks[0]["step_indices"], ranks[1]["step_indices"], strict=True)]
    dataset = h.TokenDataset(30)
    tokens = [[int(dataset.mask[i].sum()) for i in r["step_indices"][0]] for r in ranks]
    assert sum(tokens[0]) != sum(tokens[1]), "the ranks must hold different token counts for this test to bite"

    # Each optimizer step's full gradient: the same on both ranks, and the token mean over the union of the window.
    h.assert_grads_close(ranks[0]["step_grads"], ranks[1]["step_grads"], rtol=0, atol=0)
    expected = h.replay_reference(ShardedTokenModel(), dataset, windows, h.token_loss, lr=LR)
    h.assert_grads_close(ranks[0]["step_grads"], expected, **h.FP32)

    # One reduce-scatter per FSDP unit at each synced backward: per step, 1 when deferred, one per micro-batch else.
    # Lightning 2.6 alone reduce-scatters every micro-batch either way (FSDP2 modules have no `no_sync`).
    micro_batches = 4 * epochs
    synced_backwards = steps + reduce_scatters_per_micro_batch * (micro_batches - steps)
    assert [reduce_scatters(r) for r in ranks] == [FSDP_UNITS * synced_backwards] * WORLD_SIZE
    # The item counts cross ranks in one small all-reduce per step; the first window also agrees the micro-batch size.
    assert [r["collectives"]["all_reduce"] for r in ranks] == [steps + 1] * WORLD_SIZE
