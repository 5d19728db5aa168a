"""`BalancedBatchSampler` in a Fabric loop, through `FabricMicroBatching.batches` (issue 27, the Fabric front end).

What a Fabric user has: a ``DataLoader`` with the sampler, ``fabric.setup_dataloaders`` (which puts Fabric's
``DistributedSampler`` into it, as the Trainer does), and ``for batch in acc.batches(loader): acc.step(...)``. Checked:
on 1 process, a mid-epoch resume through ``fabric.save``/``fabric.load`` trains on the step batches, and ends at the
weights, of the uninterrupted run (Fabric's own loader would restart a resumed process at epoch 0's order); on 2
real gloo ranks, every step's update is the full-batch token mean of the step's global batch, the ranks' shares are
that batch with no sample lost or twice, the replicas agree, a resumed run continues the same global batches, and
ranks whose samplers would deal apart are refused on both ranks before a step.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

import tests.helpers as h
from tests.test_fabric import Net, loss_fn

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 240


def _collate(samples):
    return {k: torch.stack([s[k] for s in samples]) for k in ("x", "y", "mask", "index")}


def _lengths(data: h.TokenDataset) -> list[int]:
    return [int(m.sum()) for m in data.mask]


def _setup(fabric, data, batch_sampler=None):
    """The user's objects: model, optimizer, loader through Fabric, and the split front end by tokens."""
    from lightning_accum import FabricMicroBatching
    from lightning_accum.sequences import PaddedSequences

    net = Net()
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    if batch_sampler is None:
        loader = DataLoader(data, batch_size=4, collate_fn=_collate)
    else:
        loader = DataLoader(data, batch_sampler=batch_sampler, collate_fn=_collate)
    sequences = PaddedSequences(mask="mask", fields=["x", "y", "mask"])
    acc = FabricMicroBatching(
        fabric, model, optimizer, sequences=sequences, micro_batch_tokens=16, count_items=h.count_tokens,
        preflight=False,
    )  # fmt: skip
    return model, optimizer, fabric.setup_dataloaders(loader), acc


def _train(fabric, data, make_sampler, seen, stop=None, state_path=None, resume_from=None):
    """Up to 2 epochs; each step's sample indices into ``seen``; ``stop=(epoch, steps)`` saves there and returns."""
    model, optimizer, loader, acc = _setup(fabric, data, make_sampler())
    if resume_from is not None:
        fabric.load(resume_from, {"model": model, "optimizer": optimizer, "accumulation": acc})
    while acc.epoch < 2:
        for batch in acc.batches(loader):
            acc.step(batch, loss_fn)
            optimizer.step()
            optimizer.zero_grad()
            seen.append(sorted(int(i) for i in batch["index"]))
            if stop is not None and (acc.epoch, acc.batch_in_epoch) == stop:
                fabric.save(state_path, {"model": model, "optimizer": optimizer, "accumulation": acc})
                return model
    return model


@pytest.mark.parametrize("balanced", [True, False], ids=["BalancedBatchSampler", "plain DataLoader"])
def test_a_resume_mid_epoch_trains_on_the_uninterrupted_runs_step_batches_and_weights(tmp_path, balanced):
    from lightning.fabric import Fabric

    from lightning_accum.sequences import BalancedBatchSampler

    data = h.TokenDataset(22, seq_len=8, dim=5, seed=1)

    def make_sampler():
        return BalancedBatchSampler(_lengths(data), 4, micro_batch_tokens=16, seed=7) if balanced else None

    fabric = Fabric(accelerator="cpu", devices=1)
    whole: list[list[int]] = []
    uninterrupted = _train(fabric, data, make_sampler, whole)
    before: list[list[int]] = []
    _train(fabric, data, make_sampler, before, stop=(1, 2), state_path=tmp_path / "state.ckpt")
    after: list[list[int]] = []
    again = Fabric(accelerator="cpu", devices=1)
    resumed = _train(again, data, make_sampler, after, resume_from=tmp_path / "state.ckpt")

    assert len(whole) == 12 and before + after == whole  # 6 step batches an epoch, the 3rd of epoch 1 next
    if balanced:  # the sampler's own order: epoch 1 is drawn with seed + 1, not epoch 0's again
        assert whole[6:] != whole[:6]
    for a, b in zip(resumed.parameters(), uninterrupted.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_batches_state_is_saved_with_the_front_ends_state():
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1)
    _, _, _, acc = _setup(fabric, h.TokenDataset(8, seq_len=8, dim=5))
    acc.load_state_dict({**acc.state_dict(), "epoch": 3, "batch_in_epoch": 2})
    assert (acc.epoch, acc.batch_in_epoch) == (3, 2)
    assert {"epoch": 3, "batch_in_epoch": 2}.items() <= acc.state_dict().items()


# ---------------------------------------------------------------------------------------------------------------------
# 2 real gloo ranks (Fabric's `ddp` launches its ranks by re-running the script: each case is a script run)
# ---------------------------------------------------------------------------------------------------------------------
def run_ranks(case: str, tmp_path: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "FABRIC_CASE": case}
    done = h.run_process_group([sys.executable, __file__], cwd=tmp_path, env=env, timeout=TIMEOUT, what=case)
    assert done.returncode == 0, done.stdout[-4000:]
    return done.stdout


@pytest.mark.ddp
@pytest.mark.timeout(TIMEOUT + 60)
def test_two_ranks_dealt_by_cost_are_exact_whole_identical_and_resume_on_the_same_global_batches(tmp_path):
    out = run_ranks("balanced", tmp_path)
    assert "OK rank 0" in out and "OK rank 1" in out, out[-3000:]


@pytest.mark.ddp
@pytest.mark.timeout(TIMEOUT + 60)
def test_ranks_whose_samplers_deal_apart_are_refused_on_both_before_a_step(tmp_path):
    out = run_ranks("apart", tmp_path)
    for rank in (0, 1):
        assert f"REFUSED rank {rank}:" in out, out[-3000:]
    assert "lengths" in out and "no step ran" in out, out[-3000:]


def _main(case: str) -> None:
    import torch.distributed as dist
    from lightning.fabric import Fabric

    from lightning_accum.sequences import BalancedBatchSampler

    fabric = Fabric(accelerator="cpu", devices=2, strategy=h.fabric_strategy())
    fabric.launch()
    rank = fabric.global_rank
    data = h.TokenDataset(30, seq_len=8, dim=5, seed=2)
    lengths = _lengths(data)
    if case == "apart":
        mine = lengths if rank == 0 else [*lengths[:-1], lengths[-1] % 8 + 1]  # one sample's length differs on rank 1
        _, _, loader, acc = _setup(fabric, data, BalancedBatchSampler(mine, 6, micro_batch_tokens=16))
        try:
            for batch in acc.batches(loader):
                acc.step(batch, loss_fn)
        except RuntimeError as error:
            print(f"REFUSED rank {rank}: {error}; no step ran: {acc.optimizer_steps == 0}", flush=True)
        dist.barrier()
        dist.destroy_process_group()
        return

    def make_sampler():
        return BalancedBatchSampler(lengths, 6, micro_batch_tokens=16, seed=5)

    # The uninterrupted run, each step checked against one full-batch pass over the step's global batch.
    reference, sampler = Net(), make_sampler()
    model, optimizer, loader, acc = _setup(fabric, data, sampler)
    uneven, whole = 0, []
    while acc.epoch < 2:
        epoch = acc.epoch
        for step, batch in enumerate(acc.batches(loader)):
            acc.step(batch, loss_fn)
            shares: list = [None, None]
            dist.all_gather_object(shares, sorted(int(i) for i in batch["index"]))
            global_batch = sampler.global_batches(epoch)[step]
            assert sorted(shares[0] + shares[1]) == sorted(global_batch), (shares, global_batch)  # none lost or twice
            uneven += len(shares[0]) != len(shares[1])
            whole.append(shares)
            ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
            ref_opt.zero_grad()
            loss_fn(reference, _collate([data[i] for i in global_batch])).backward()
            for p, r in zip(model.module.parameters(), reference.parameters(), strict=True):
                torch.testing.assert_close(p.grad, r.grad, rtol=1e-5, atol=1e-6)
            ref_opt.step()
            optimizer.step()
            optimizer.zero_grad()
    assert len(whole) == 10 and uneven > 0, (len(whole), uneven)  # the deal by cost gave the ranks unequal counts
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = fabric.all_gather(flat)
    torch.testing.assert_close(gathered[0], gathered[1], rtol=0, atol=0)

    # Interrupted after 2 steps of epoch 1 (Fabric's save and load), then resumed with new objects.
    path = Path.cwd() / "state.ckpt"  # the ranks' working directory, the same for both
    first: list[list[int]] = []
    rest: list[list[int]] = []
    _train(fabric, data, make_sampler, first, stop=(1, 2), state_path=path)
    model = _train(fabric, data, make_sampler, rest, resume_from=path)
    assert first + rest == [shares[rank] for shares in whole], (first, rest)
    for p, r in zip(model.module.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)
    print(f"OK rank {rank}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    _main(os.environ["FABRIC_CASE"])
