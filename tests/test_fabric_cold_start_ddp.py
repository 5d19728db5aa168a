"""Issue 34: Fabric's split mode has every guard the Trainer's has, because both run one split session.

On 2 real gloo ranks, one rank's first step batch cannot be cut (it is left-padded): its cold-start trace fails. The
session's guard makes every rank fall back together (one agreement), and the step's own check then stops every rank
with a clear error: the failing rank raises its own, the other names it, and none waits. Fabric's ``ddp`` launcher
re-runs this file as a script, in a process group killed at the timeout (a hang fails the test, leaving no rank).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

import tests.helpers as h

pytestmark = [pytest.mark.ddp, pytest.mark.timeout(240)]
ROOT = Path(__file__).resolve().parents[1]


def test_a_first_cut_that_fails_on_one_rank_stops_every_rank_none_waits(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = h.run_process_group([sys.executable, __file__], cwd=tmp_path, env=env, timeout=180, what="cold start")
    out = done.stdout
    assert "RAISED rank 1 ValueError: `PaddedSequences(mask='mask')`: sample 0 of the step batch is left-padded" in out
    assert "RAISED rank 0 RuntimeError: Another rank failed with an error that is not an out-of-memory error" in out
    assert "pre-flight fell back" in out  # the trace's failure on rank 1 was caught and agreed, with the warning
    assert done.returncode == 0, out[-4000:]


def _main() -> None:
    from lightning.fabric import Fabric

    from lightning_accum import FabricMicroBatching
    from lightning_accum.sequences import PaddedSequences

    fabric = Fabric(accelerator="cpu", devices=2, strategy=h.fabric_strategy())
    fabric.launch()
    rank = fabric.global_rank
    torch.manual_seed(0)
    net = torch.nn.Linear(5, 1)
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    mask = torch.ones(8, 6, dtype=torch.long)
    if rank == 1:
        mask[0, :2] = 0  # left padding: this rank's cut fails, in the cold start's trace and in the step
    batch = {"x": torch.randn(8, 6, 5), "y": torch.randn(8, 6), "mask": mask}

    def loss_fn(model, micro):
        per_token = (model(micro["x"]).squeeze(-1) - micro["y"]) ** 2
        return (per_token * micro["mask"]).sum() / micro["mask"].sum()

    acc = FabricMicroBatching(
        fabric, model, optimizer, sequences=PaddedSequences(mask="mask", fields=["x", "y", "mask"]),
        count_items=lambda b: b["mask"].sum(), max_memory="8GiB",
    )  # fmt: skip
    try:
        acc.step(batch, loss_fn)
    except Exception as err:
        print(f"RAISED rank {rank} {type(err).__name__}: {err}", flush=True)
        return
    print(f"NO ERROR rank {rank}", flush=True)


if __name__ == "__main__":
    _main()
