"""The balanced sampler's slips (issue 35, items 11 to 13 and 15) on 2 real gloo ranks: refused or warned on every
rank alike, and never a rank left waiting (each test fails within its timeout if the ranks disagree).

Without Lightning where the slip is the sampler's own: a process group, the sampler, and the package's gathering
(`refuse_ranks_that_deal_apart`, `measure_step_cost`); the docs' Fabric example runs as the user runs it.
"""

from __future__ import annotations

import os
import re
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

import tests.helpers as h
from lightning_accum.sequences import BalancedBatchSampler, measure_step_cost
from lightning_accum.sequences.balanced_sampler import UNWEIGHED_SHARES
from lightning_accum.sequences.loaders import weigh_shares
from lightning_accum.sequences.pass_timing import fit_step_cost, pass_shapes, time_passes
from lightning_accum.split.session import refuse_ranks_that_deal_apart
from tests.test_fsdp2 import _free_port
from tests.test_pass_timing import LENGTHS as TIMED_LENGTHS
from tests.test_pass_timing import Machine

pytestmark = [pytest.mark.ddp, pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parents[1]
LENGTHS = [30, 2, 3, 25, 4, 5, 20, 6, 1, 1, 40, 2]  # skewed: the deal by cost gives the ranks unequal counts


def _in_group(rank: int, port: int, out: str, case: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=h.RANK_TIMEOUT)
    try:
        result = CASES[case](rank)
        torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _run(case: str, tmp_path: Path) -> list:
    h.start_ranks(_in_group, (_free_port(), str(tmp_path), case), 2)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]


# ---- 11: the docs' old line pasted into a 2-rank script, and a num_replicas that is not the world size ---------------
def _refused(sampler: BalancedBatchSampler) -> str:
    try:
        refuse_ranks_that_deal_apart(DataLoader(list(range(len(LENGTHS))), batch_sampler=sampler), 2)
    except RuntimeError as err:
        return str(err)
    return "not refused"


CASES = {
    "rank=0 on both": lambda rank: _refused(BalancedBatchSampler(LENGTHS, 4, num_replicas=2, rank=0)),
    "num_replicas=3": lambda rank: _refused(BalancedBatchSampler(LENGTHS, 4, num_replicas=3, rank=rank)),
    "own rank": lambda rank: _refused(BalancedBatchSampler(LENGTHS, 4, num_replicas=2, rank=rank)),
}


def test_two_ranks_that_hold_one_rank_are_refused_on_both(tmp_path):
    errors = _run("rank=0 on both", tmp_path)
    assert errors[0] == errors[1]
    assert errors[0].startswith("`BalancedBatchSampler(rank=0)` on ranks 0, 1: they would train the same share")


def test_a_num_replicas_other_than_the_world_size_is_refused_on_both(tmp_path):
    errors = _run("num_replicas=3", tmp_path)
    assert errors[0] == errors[1]
    assert errors[0].startswith("`BalancedBatchSampler(num_replicas=3)` on rank 0, but 2 ranks train")


def test_each_rank_its_own_rank_is_taken(tmp_path):
    assert _run("own rank", tmp_path) == ["not refused", "not refused"]


# ---- 12: unequal shares that no front end weighs (plain DDP) warn once -----------------------------------------------
def _epoch_warnings(weighed: bool) -> tuple[list[str], list[int]]:
    loader = DataLoader(list(range(len(LENGTHS))), batch_sampler=BalancedBatchSampler(LENGTHS, 4))
    if weighed:
        weigh_shares(loader, "a test's front end")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        counts = [len(batch) for _ in range(2) for batch in loader]  # two epochs: warned once
    return [str(w.message) for w in caught], counts


CASES["unweighed"] = lambda rank: _epoch_warnings(weighed=False)
CASES["weighed"] = lambda rank: _epoch_warnings(weighed=True)


def test_a_sampler_that_no_front_end_weighs_warns_once_on_rank_0_that_split_mode_is_exact(tmp_path):
    ranks = _run("unweighed", tmp_path)
    assert ranks[0][0] == [UNWEIGHED_SHARES] and ranks[1][0] == []  # once, on rank 0: every rank decided alike
    assert any(a != b for a, b in zip(ranks[0][1], ranks[1][1], strict=True))  # the shares were unequal
    assert "add `lightning_accum.AutoMicroBatching`" in UNWEIGHED_SHARES
    assert _run("weighed", tmp_path)[0][0] == []


# ---- 13: measure_step_cost with each rank's own shard's lengths ------------------------------------------------------
def _machine(rank: int) -> Machine:
    return Machine(a=(150e-6, 200e-6)[rank], b=1e-6, c=1e-6 / 400, seed=rank)


def _timed_on_shards(rank: int):
    shard = TIMED_LENGTHS[rank::2]  # each rank's own shard: different lengths, so different shapes drawn
    machine = _machine(rank)
    return measure_step_cost(machine.run_pass, shard, 1024, clock=machine.clock)


CASES["shards"] = _timed_on_shards


def test_ranks_that_pass_their_own_shards_lengths_time_rank_0s_shapes_and_agree(tmp_path):
    assert pass_shapes(TIMED_LENGTHS[0::2], 1024) != pass_shapes(TIMED_LENGTHS[1::2], 1024)
    costs = _run("shards", tmp_path)
    assert costs[0] == costs[1]  # the same floats on both: the deals agree
    shapes = pass_shapes(TIMED_LENGTHS[0::2], 1024)  # rank 0's, timed on both
    machines = [_machine(r) for r in range(2)]
    times = [time_passes(m.run_pass, shapes, clock=m.clock) for m in machines]
    mean = fit_step_cost(shapes, [(a + b) / 2 for a, b in zip(*times, strict=True)], 1024)
    assert costs[0].pass_cost_tokens == pytest.approx(mean.pass_cost_tokens, rel=1e-9)


def _empty_shard_on_rank_1(rank: int) -> str:
    machine = _machine(rank)
    try:
        measure_step_cost(machine.run_pass, TIMED_LENGTHS if rank == 0 else [], 1024, clock=machine.clock)
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


CASES["empty shard"] = _empty_shard_on_rank_1


def test_a_rank_whose_lengths_draw_no_shapes_fails_every_rank_and_none_waits(tmp_path):
    errors = _run("empty shard", tmp_path)
    assert errors[1].startswith("ValueError: `lengths` is empty")
    assert errors[0] == (
        "RuntimeError: Rank 1 failed to draw the shapes to time from its `lengths`, so no rank times its passes: "
        + errors[1]
    )


# ---- 15: the docs' balanced Fabric example, run on 2 ranks as the page says it runs ----------------------------------
def _docs_block() -> str:
    page = (ROOT / "docs" / "fabric.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page, flags=re.S)
    block = next(b for b in blocks if "BalancedBatchSampler(lengths" in b)
    one = 'Fabric(accelerator="cpu", devices=1)'
    assert one in block
    return block.replace(one, 'Fabric(accelerator="cpu", devices=2, strategy=h.fabric_strategy())')


@pytest.mark.timeout(300)
def test_the_fabric_pages_balanced_example_runs_on_two_ranks(tmp_path):
    script = tmp_path / "example.py"
    done_line = 'print(f"DONE rank {fabric.global_rank} at epoch {acc.epoch}", flush=True)\n'
    script.write_text("import tests.helpers as h\n" + _docs_block() + done_line)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = h.run_process_group([sys.executable, str(script)], cwd=tmp_path, env=env, timeout=240, what="example")
    assert done.returncode == 0, done.stdout[-4000:]
    assert sorted(re.findall(r"DONE rank (\d) at epoch 2", done.stdout)) == ["0", "1"], done.stdout[-2000:]
