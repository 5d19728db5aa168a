"""One simulated node of a 2-node x 1-process run (started by tests/test_multinode.py, once per node).

Usage: python tests/scripts/multinode_worker.py {window,split} OUT_DIR [--count-items {tokens,none}]

The launcher's environment says which node this process is and where the rank-0 node listens, exactly as on a real
cluster: ``MASTER_ADDR``/``MASTER_PORT``/``NODE_RANK``/``WORLD_SIZE``/``LOCAL_RANK`` (Lightning's own launch
protocol), the variables ``torchrun`` exports, or those ``srun`` exports. Lightning picks the matching cluster
environment from them; this script only builds ``Trainer(num_nodes=2, devices=1)`` and trains.

``window`` trains `AccumulationScheduler` on micro-batches with a token ``count_items``; ``split`` trains
`AutoMicroBatching` on whole step batches with an OOM injected on global rank 1 (node 1) only. Each process saves
what it saw to ``OUT_DIR/rank{global_rank}.pt``: the cluster environment Lightning picked, its ranks, every optimizer
step's gradient and sample indices, the step reports (items and samples, summed over all ranks) and, in split mode,
the micro-batch sizes, events and injected faults.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable for `tests.helpers`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from lightning_accum import AccumulationScheduler, AutoMicroBatching
from lightning_accum.callbacks._owner import find_owner
from lightning_accum.memory.oom import OOMFault, OOMInjector
from tests.helpers import TokenDataset, TokenModel, count_tokens, ddp_strategy, quiet_trainer_kwargs

NUM_NODES = 2
LR = 0.05

# Window mode: 30 sequences, 15 per node, micro-batches of 4 (4 per node per epoch); k=3 gives a full window and a
# 1-micro-batch tail each epoch, 4 optimizer steps over 2 epochs.
WINDOW_SAMPLES, WINDOW_MICRO_BATCH, WINDOW_K, WINDOW_EPOCHS = 30, 4, 3, 2

# Split mode: step batches of 16 per node, micro-batches of 4, 4 steps. Node 1 runs out of memory in step 1's second
# forward pass and in step 3's last backward pass (both above size 2, so the retry in halves goes through).
SPLIT_STEP_BATCH, SPLIT_MICRO, SPLIT_STEPS = 16, 4, 4
SPLIT_FAULTS = (
    OOMFault(step=1, micro_batch=1, phase="forward", rank=1, when_size_above=SPLIT_MICRO // 2),
    OOMFault(step=3, micro_batch=3, phase="backward", rank=1, when_size_above=SPLIT_MICRO // 2),
)


def make_dataset(mode: str) -> TokenDataset:
    """The data every node loads (Lightning's DistributedSampler hands each node its share)."""
    if mode == "window":
        return TokenDataset(WINDOW_SAMPLES)
    return TokenDataset(NUM_NODES * SPLIT_STEP_BATCH * SPLIT_STEPS, seed=1)


def make_model(mode: str) -> TokenModel:
    """The model every node starts from (seeded, so the test's single-process reference starts from the same one)."""
    model = MultiNodeModel(LR)
    model.split_mode = mode == "split"
    return model


class MultiNodeModel(TokenModel):
    """A token model that also records each optimizer step's report and, in split mode, its micro-batch size."""

    def __init__(self, lr: float) -> None:
        super().__init__(lr=lr)
        self.reports: list[dict[str, Any]] = []
        self._last_report: object = None

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        owner = find_owner(self.trainer.callbacks)
        report = owner.last_step_report if owner is not None else None
        # Window mode publishes a report at the end of a window's last micro-batch; split mode after every batch.
        if report is not None and report is not self._last_report:
            self._last_report = report
            self.reports.append(
                {
                    "items": float(report.items),
                    "effective_batch_size": report.effective_batch_size,
                    "micro_batch_size": report.micro_batch_size,
                    "accumulation_steps": report.accumulation_steps,
                    "consumed_samples": report.consumed_samples,
                }
            )


class SaveFigures(pl.Callback):
    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_train_end(self, trainer: pl.Trainer, pl_module: MultiNodeModel) -> None:
        owner = find_owner(trainer.callbacks)
        injector = getattr(owner, "fault_injector", None)
        env = trainer.strategy.cluster_environment
        figures = {
            "cluster_environment": type(env).__name__,
            "node_rank": trainer.node_rank,
            "global_rank": trainer.global_rank,
            "local_rank": trainer.local_rank,
            "world_size": trainer.world_size,
            "num_nodes": trainer.num_nodes,
            "optimizer_steps": trainer.global_step,
            "step_grads": pl_module.step_grads,
            "step_indices": pl_module.step_indices,
            "reports": pl_module.reports,
            "events": [(e.kind, e.step, e.before, e.after) for e in owner.events],
            "oom_retries": owner.oom_retries,
            "fired": list(injector.fired) if injector is not None else [],
            "gradient_allreduces": getattr(owner, "gradient_allreduces", None),
        }
        torch.save(figures, os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt"))


def make_callback(mode: str, count_items: Any) -> pl.Callback:
    if mode == "window":
        return AccumulationScheduler(WINDOW_K, count_items=count_items)
    return AutoMicroBatching(
        SPLIT_MICRO,
        pin_micro_batch_size=True,  # no memory-driven changes: only the injected OOMs move the size
        oom_cooldown=1,
        grow_patience=1,
        count_items=count_items,
        fault_injector=OOMInjector(SPLIT_FAULTS),
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["window", "split"])
    parser.add_argument("out_dir")
    parser.add_argument("--count-items", choices=["tokens", "none"], default="tokens")
    args = parser.parse_args(argv)

    dataset = make_dataset(args.mode)
    model = make_model(args.mode)
    count_items = count_tokens if args.count_items == "tokens" else None
    # A short collective timeout: if the other node dies, this one fails instead of waiting 30 minutes.
    strategy = ddp_strategy(start_method="popen")
    trainer = pl.Trainer(
        **quiet_trainer_kwargs(
            accelerator="cpu",
            devices=1,
            num_nodes=NUM_NODES,
            strategy=strategy,
            max_epochs=WINDOW_EPOCHS if args.mode == "window" else 1,
            default_root_dir=args.out_dir,
            num_sanity_val_steps=0,
            callbacks=[make_callback(args.mode, count_items), SaveFigures(args.out_dir)],
        )
    )
    batch_size = WINDOW_MICRO_BATCH if args.mode == "window" else SPLIT_STEP_BATCH
    trainer.fit(model, DataLoader(dataset, batch_size=batch_size))


if __name__ == "__main__":
    main()
