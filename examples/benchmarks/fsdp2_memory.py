"""Peak tensor memory per rank under FSDP2 (2 CPU processes, gloo): deferred vs per-micro-batch gradient sync.

    OMP_NUM_THREADS=1 python examples/benchmarks/fsdp2_memory.py [--steps 2] [--json OUT.json]

Each rank shards a 4-block residual MLP over 32-token sequences (``fully_shard`` per block and at the root, 8.0 MiB
of parameters per block) and trains it with Adam on the same effective batch of 8 sequences per rank, cut into
``b x k``: 8 x 1, 2 x 4, 1 x 8 (and 2 x 1, 1 x 1, for the probe's comparison with the same micro-batch without
accumulation). Each accumulating configuration runs twice:

* ``deferred``: what ``AccumulationScheduler(k)`` does by default under ``ModelParallelStrategy``: every micro-batch
  but the last runs inside ``lightning_accum._compat.no_fsdp2_gradient_sync`` (FSDP2's
  ``set_requires_gradient_sync(False)``), so each FSDP unit reduce-scatters once per optimizer step;
* ``every``: ``AccumulationScheduler(k, sync_every_micro_batch=True)``: a reduce-scatter after every micro-batch;
* ``split``: what ``AutoMicroBatching`` does under FSDP2: the parameters are all-gathered once for the step
  (``lightning_accum._compat.fsdp2_unsharded_for_step``) and the sync is deferred to the last micro-batch, so that no
  forward or backward holds a collective an OOM on another rank could leave waiting.

The loop is the probe's (``lightning_accum.probe.measure.train_step``: loss / k, phases labelled, one warm-up step,
gradients set to None after the step), and the peak is the probe's live-tensor tracker
(``lightning_accum.memory.tracker.MemoryTracker``), on each rank, printed in the probe's table format. Two things the
tracker does not see by itself under FSDP2 are added here, in ``FSDP2MemoryTracker``:

* DTensors (sharded parameters, their gradients and Adam state) are wrapper tensors without storage: their local
  shard is counted;
* FSDP2 frees and re-allocates the unsharded parameters with ``UntypedStorage.resize_``, which no dispatch mode sees
  (``torch.distributed._tools.mem_tracker`` patches it for the same reason): it is patched while the tracker runs.

Categories: ``parameters`` are this rank's shards plus the unsharded parameters while FSDP2 has them all-gathered;
``gradients`` are the sharded gradients plus the unsharded gradients autograd accumulates before a reduce-scatter
(for the whole window when deferred); ``optimizer_state`` is Adam's state on the shards; ``activations`` is the rest,
FSDP2's all-gather and reduce-scatter buffers included.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn

from lightning_accum import _compat
from lightning_accum.memory.model import LinearPeakModel
from lightning_accum.memory.tracker import CATEGORIES, MemoryTracker
from lightning_accum.probe import table
from lightning_accum.probe.result import ProbeMeasurement, ProbeResult

WORLD_SIZE = 2
BATCH = 8  # sequences per rank per optimizer step
ACCUMULATION_STEPS = (4, 8)
CONFIGS = [(8, 1), (2, 4), (2, 1), (1, 8), (1, 1)]  # the probe's grid for B=8, k in (4, 8)
SEQ, DIM, HIDDEN, BLOCKS = 32, 512, 2048, 4
SYNC_MODES = ("deferred", "every", "split")
_MiB = 2**20


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))


class ResidualMLP(nn.Module):
    """A transformer's MLP half, stacked: the parameters and activations of a small language model without attention."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block() for _ in range(BLOCKS)))
        self.head = nn.Linear(DIM, 1)

    def forward(self, batch: dict[str, Tensor]) -> Tensor:
        # The loss inside `forward`: FSDP2 unshards the root's own parameters (`head`) in the root's forward hook.
        return nn.functional.mse_loss(self.head(self.blocks(batch["x"])).squeeze(-1), batch["y"])


class FSDP2MemoryTracker(MemoryTracker):
    """The probe's tracker, seeing DTensor shards, ``UntypedStorage.resize_`` and FSDP2's unsharded parameters."""

    def __init__(self, module: nn.Module, optimizers: list[torch.optim.Optimizer]) -> None:
        super().__init__(module, optimizers, device="cpu")
        self._hooked: set[int] = set()  # ids of the unsharded parameters (FSDP2 keeps them for the model's life)

    def _storage_of(self, tensor: Tensor) -> torch.UntypedStorage | None:
        if isinstance(tensor, torch.distributed.tensor.DTensor):
            tensor = tensor._local_tensor  # the shard this rank holds
        return super()._storage_of(tensor)

    def _resized(self, storage: torch.UntypedStorage) -> None:
        # Storage first seen later (FSDP2 allocates, then an all-gather copy-out op writes into it) is counted then.
        entry = self._live.get(storage._cdata)
        if entry is not None and entry.nbytes != storage.nbytes():
            self._totals[entry.category] += storage.nbytes() - entry.nbytes
            self._total += storage.nbytes() - entry.nbytes
            entry.nbytes = storage.nbytes()
            self._update_peak()

    def _unsharded(self, module: nn.Module, *_: Any) -> None:
        """After FSDP2's own pre-forward hook: the module's parameters are the unsharded ones now."""
        unsharded = [p for p in module.parameters() if not isinstance(p, torch.distributed.tensor.DTensor)]
        self.track(unsharded, "parameters")
        for p in unsharded:
            if id(p) not in self._hooked:  # autograd accumulates into the unsharded parameter's `.grad`
                self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))
                self._hooked.add(id(p))

    def track_gradients(self) -> None:
        """The sharded gradients FSDP2 assigned after a reduce-scatter (assigned, so no hook sees them)."""
        assert self.module is not None
        self.track([p.grad for p in self.module.parameters() if p.grad is not None], "gradients")

    @contextlib.contextmanager
    def watching(self) -> Iterator[FSDP2MemoryTracker]:
        original_resize = torch.UntypedStorage.resize_

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            out = original_resize(storage, size)
            self._resized(storage)
            return out

        assert self.module is not None
        hooks = [m.register_forward_pre_hook(self._unsharded) for m in _compat.fsdp2_modules(self.module)]
        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        try:
            with self:
                yield self
        finally:
            torch.UntypedStorage.resize_ = original_resize  # type: ignore[method-assign]
            for hook in hooks:
                hook.remove()


def _build(mesh: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = ResidualMLP()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=1e-4)


def _train_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, batches: list[Any], sync: str, tracker: FSDP2MemoryTracker
) -> int:
    """The probe's ``train_step`` with window mode's FSDP2 sync choice around each micro-batch.

    Returns the gradient bytes held after the first micro-batch, i.e. through the rest of the window.
    """
    gathered = _compat.fsdp2_unsharded_for_step(model) if sync == "split" else contextlib.nullcontext()
    with gathered:  # split mode: the closure's span; the optimizer step runs after it, on the shards
        held = _micro_batches(model, batches, sync, tracker)
    with tracker.phase("optimizer"):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return held


def _micro_batches(model: nn.Module, batches: list[Any], sync: str, tracker: FSDP2MemoryTracker) -> int:
    k = len(batches)
    held = 0
    for i in range(k):
        batch = batches[i]
        batches[i] = None
        tracker.track(batch, "activations")
        deferred = sync in ("deferred", "split") and i < k - 1  # what `block_fsdp2_backward_sync` does in window mode
        with _compat.no_fsdp2_gradient_sync(model) if deferred else contextlib.nullcontext():
            with tracker.phase(f"forward {i + 1}/{k}"):
                loss = model(batch)
            with tracker.phase(f"backward {i + 1}/{k}"):
                (loss / k).backward()
        tracker.track_gradients()
        if i == 0:
            held = tracker.current.by_category["gradients"]
        del loss, batch
    return held


def _measure(mesh: Any, b: int, k: int, sync: str, steps: int, rank: int) -> dict[str, Any]:
    model, optimizer = _build(mesh)
    g = torch.Generator().manual_seed(1000 * rank + b)
    n = (1 + steps) * k
    batches = [{"x": torch.randn(b, SEQ, DIM, generator=g), "y": torch.randn(b, SEQ, generator=g)} for _ in range(n)]
    tracker = FSDP2MemoryTracker(model, [optimizer])
    with tracker.watching():
        for step in range(1 + steps):
            if step == 1:  # after the warm-up step, which creates Adam's state
                tracker.reset_peak()
            held = _train_step(model, optimizer, [batches.pop(0) for _ in range(k)], sync, tracker)
    phases: dict[str, int] = {}
    for label, total in tracker.phase_peaks.items():
        if label:
            phases[label.split()[0]] = max(phases.get(label.split()[0], 0), total)
    peak = tracker.peak
    shard_bytes = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    return {
        "micro_batch_size": b,
        "accumulation_steps": k,
        "peak_bytes": peak.total_bytes,
        "breakdown": dict(peak.by_category),
        "peak_phase": peak.phase,
        "phase_peak_bytes": phases,
        "shard_bytes": shard_bytes,
        "gradients_held_bytes": held,
    }


def _worker(rank: int, port: int, steps: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    try:
        mesh = init_device_mesh("cpu", (WORLD_SIZE,))
        runs = []
        for sync in SYNC_MODES:
            for b, k in CONFIGS:
                if k > 1 or sync == SYNC_MODES[0]:  # one micro-batch has nothing to defer: measured once
                    runs.append({"sync": sync, **_measure(mesh, b, k, sync, steps, rank)})
        with open(f"{out}.rank{rank}", "w") as f:
            json.dump(runs, f)
    finally:
        dist.destroy_process_group()  # gloo's threads must not outlive the interpreter (see docs/scaling-out.md)


# ---- the report -----------------------------------------------------------------------------------------------------


def probe_result(runs: list[dict[str, Any]], rank: int, sync: str) -> ProbeResult:
    """One rank's measurements for one sync choice, as the probe's `ProbeResult` (its table and findings)."""
    measurements = [
        ProbeMeasurement(
            r["micro_batch_size"],
            r["accumulation_steps"],
            r["peak_bytes"],
            r["breakdown"],
            r["peak_phase"],
            None,
            r["phase_peak_bytes"],
        )
        for b, k in CONFIGS
        for r in [_run(runs, sync if k > 1 else SYNC_MODES[0], b, k)]
    ]
    shard = runs[0]["shard_bytes"]
    device = f"cpu, rank {rank} of {WORLD_SIZE} (FSDP2, gloo), {sync} gradient sync"
    return ProbeResult(BATCH, device, measurements, shard, shard, list(ACCUMULATION_STEPS), LinearPeakModel())


def markdown(ranks: list[list[dict[str, Any]]]) -> str:
    """Both ranks and both sync choices in one table (MiB): the probe's columns, with the breakdown of rank 0.

    ``grads held``: rank 0's gradient bytes after a window's first micro-batch, which it holds through the rest.
    """
    headers = ["b", "k", "b*k", "gradient sync", "peak rank 0", "peak rank 1", "params", "grads", "optim", "activ."]
    headers.append("grads held")
    lines = ["| " + " | ".join(headers) + " | peak phase |", "|" + "---:|" * len(headers) + "---|"]
    for b, k in CONFIGS:
        for sync in SYNC_MODES[:1] if k == 1 else SYNC_MODES:
            runs = [_run(rank, sync, b, k) for rank in ranks]
            cells = [str(b), str(k), str(b * k), "(one micro-batch)" if k == 1 else sync]
            cells += [f"{r['peak_bytes'] / _MiB:.2f}" for r in runs]
            cells += [f"{runs[0]['breakdown'][c] / _MiB:.2f}" for c in CATEGORIES]
            cells.append("" if k == 1 else f"{runs[0]['gradients_held_bytes'] / _MiB:.2f}")
            lines.append("| " + " | ".join(cells) + f" | {runs[0]['peak_phase']} |")
    return "\n".join(lines)


def _run(runs: list[dict[str, Any]], sync: str, b: int, k: int) -> dict[str, Any]:
    return next(r for r in runs if (r["sync"], r["micro_batch_size"], r["accumulation_steps"]) == (sync, b, k))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2, help="measured optimizer steps per configuration")
    parser.add_argument("--json", help="also write every measurement to this file")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = os.path.abspath(args.json or "fsdp2_memory.json")
    mp.start_processes(_worker, args=(port, args.steps, out), nprocs=WORLD_SIZE, start_method="spawn")
    ranks = []
    for rank in range(WORLD_SIZE):
        with open(f"{out}.rank{rank}") as f:
            ranks.append(json.load(f))
        os.remove(f"{out}.rank{rank}")
    if args.json:
        Path(args.json).write_text(json.dumps({"ranks": ranks}, indent=2) + "\n")
    for rank, runs in enumerate(ranks):
        for sync in SYNC_MODES:
            print(table(probe_result(runs, rank, sync)), end="\n\n")
    print(markdown(ranks))


if __name__ == "__main__":
    main()
