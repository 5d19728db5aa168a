"""`split_batch` and `batch_size_of` before and after splitting became one plan and one walker, side by side.

    OMP_NUM_THREADS=1 python examples/benchmarks/split_batch_overhead.py [--baseline REV] [--repeats 15]

The one-file ``lightning_accum/batches.py`` of the git revision ``--baseline`` is loaded next to the working tree's
``lightning_accum.batches``, in the same process, and both are timed on the same batches, interleaved call block by
call block: a flat dict of tensors (a tokenized step batch), a flat ``(x, y)`` tuple (what window mode counts every
micro-batch), a nested batch (dicts, a list of fields, raw texts, shared values) and a detection batch (a list of
``(image, target)`` samples). It prints each one's microseconds per call in its fastest block (the one the machine
disturbed least) and after / before (below 1: faster), of the fastest blocks and as the median over the paired blocks.
Ratios, not times, are the result: the machine is shared.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

import lightning_accum.batches as after

ROOT = Path(__file__).resolve().parents[2]


def _baseline(revision: str, folder: str) -> ModuleType:
    """The one-file splitting module of ``revision``, loaded under another name (its imports are the package's)."""
    source = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{revision}:lightning_accum/batches.py"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    path = Path(folder) / "splitting_baseline.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("splitting_baseline", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def _cases() -> dict[str, tuple[Any, int]]:
    b = 64
    return {
        "flat dict, 64 -> 8 x 8": ({k: torch.zeros(b, 128, dtype=torch.long) for k in ("ids", "mask", "labels")}, 8),
        "flat (x, y), 4 -> 4 x 1": ((torch.zeros(4, 6), torch.zeros(4, 1)), 1),
        "nested, 64 -> 8 x 8": (
            {
                "inputs": {"ids": torch.zeros(b, 128), "mask": torch.ones(b, 128)},
                "labels": [torch.zeros(b), torch.zeros(b, 2)],
                "text": [f"sample {i}" for i in range(b)],
                "meta": {"lr": 0.1, "step": torch.tensor(3)},
            },
            8,
        ),
        "detection, 16 samples -> 4 x 4": (
            [
                (torch.zeros(3, 8, 8), {"boxes": torch.zeros(i % 3 + 1, 4), "labels": torch.zeros(i % 3 + 1)})
                for i in range(16)
            ],
            4,
        ),
    }


def _call(module: ModuleType, what: str, batch: Any, micro: int) -> Callable[[], Any]:
    if what == "split_batch":
        return lambda: module.split_batch(batch, micro)
    return lambda: module.batch_size_of(batch)


def _per_call(call: Callable[[], Any], number: int) -> float:
    start = time.perf_counter()
    for _ in range(number):
        call()
    return (time.perf_counter() - start) / number * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", default="1f5356b", help="a revision whose lightning_accum/batches.py is one file")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--only", default="", help="run only the cases whose name contains this, e.g. nested")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        before = _baseline(args.baseline, folder)
        print(
            f"lightning_accum/batches.py of {args.baseline} vs the working tree: microseconds per call, fastest block"
        )
        for name, (batch, micro) in _cases().items():
            if args.only not in name:
                continue
            for what in ("split_batch", "batch_size_of"):
                calls = {module: _call(module, what, batch, micro) for module in (before, after)}
                number = max(1, int(0.02 / (_per_call(calls[after], 20) * 1e-6)))  # blocks of about 20 ms
                times: dict[ModuleType, list[float]] = {before: [], after: []}
                for repeat in range(args.repeats):
                    for module in (before, after) if repeat % 2 == 0 else (after, before):
                        times[module].append(_per_call(calls[module], number))
                paired = statistics.median(a / b for a, b in zip(times[after], times[before], strict=True))
                print(
                    f"  {name + ': ' + what:<48} before {min(times[before]):7.1f}  after {min(times[after]):7.1f}"
                    f"  after/before {min(times[after]) / min(times[before]):.2f} (of the fastest blocks),"
                    f" {paired:.2f} (median of the paired blocks)"
                )


if __name__ == "__main__":
    main()
