"""A real out-of-memory error on CPU: training under an address-space limit (RLIMIT_AS) in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
HEADROOM_MIB = 100  # the 2048-sample step batch needs several 64 MiB activations; 256 samples fit


def train(out: Path, *flags: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "tests.scripts.real_oom", str(out), str(HEADROOM_MIB), *flags],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc are Linux features")
@pytest.mark.timeout(480)
def test_real_oom_is_recovered_and_the_update_equals_the_full_batch_update(tmp_path):
    plain = train(tmp_path / "plain.pt", "--plain")
    assert plain.returncode != 0 and "can't allocate memory" in plain.stderr, "the limit must bite without the callback"

    constrained = train(tmp_path / "split.pt", "--no-preflight")  # cold: from the whole step batch, by halving
    assert constrained.returncode == 0, constrained.stderr[-3000:]
    reference = train(tmp_path / "reference.pt", "--plain", "--no-limit")
    assert reference.returncode == 0, reference.stderr[-3000:]

    split = torch.load(tmp_path / "split.pt")
    full = torch.load(tmp_path / "reference.pt")
    assert split["oom_retries"] >= 1
    assert all(kind == "oom_recovered" for _, kind, _, _ in split["events"])
    settled = split["sizes"][-1]
    assert settled < 2048, split["sizes"]
    for name, value in full["params"].items():
        torch.testing.assert_close(split["params"][name], value, rtol=1e-5, atol=1e-6)

    # A `bytearray` that doesn't fit raises `MemoryError()` with no message at all; recovery must not trip over it.
    scratch = train(tmp_path / "bytearray.pt", "--bytearray", "--no-preflight")
    assert scratch.returncode == 0, scratch.stderr[-3000:]
    scratch_run = torch.load(tmp_path / "bytearray.pt")
    assert any("(MemoryError (no message))" in line for line in scratch_run["log"]), scratch_run["log"]
    for name, value in full["params"].items():
        torch.testing.assert_close(scratch_run["params"][name], value, rtol=1e-5, atol=1e-6)

    # The pre-flight traces the first step on fake tensors and starts where it fits: no OOM at all. glibc's default
    # mmap threshold rises as large blocks are freed, and the heap then holds up to 3x the live tensors of address
    # space (RLIMIT_AS counts it): a fixed threshold keeps the address space to what the tensors use.
    fixed_threshold = {"MALLOC_MMAP_THRESHOLD_": str(2**20)}
    traced = train(tmp_path / "preflight.pt", env=fixed_threshold)
    assert traced.returncode == 0, traced.stderr[-3000:]
    traced_run = torch.load(tmp_path / "preflight.pt")
    assert traced_run["preflight_seconds"] is not None
    assert traced_run["oom_retries"] == 0, traced_run["events"]
    assert 1 < traced_run["sizes"][0] < 2048  # the whole step batch does not fit (the plain run showed it)
    for name, value in full["params"].items():
        torch.testing.assert_close(traced_run["params"][name], value, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="a real CUDA out-of-memory error needs a CUDA device")
@pytest.mark.timeout(600)
def test_real_cuda_oom_is_recovered_and_the_update_equals_the_full_batch_update(tmp_path):
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_accum import AutoMicroBatching
    from tests.helpers import quiet_trainer_kwargs
    from tests.scripts.real_oom import Wide

    step_batch = 16384  # one (16384 x 8192) fp32 activation is 512 MiB
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(2 * step_batch, 64, generator=g), torch.randn(2 * step_batch, 1, generator=g))

    def fit(callbacks):
        model = Wide()
        trainer = pl.Trainer(**quiet_trainer_kwargs(accelerator="cuda", devices=1, max_epochs=1, callbacks=callbacks))
        trainer.fit(model, DataLoader(data, batch_size=step_batch))
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}, model.sizes

    reference, _ = fit([])
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    # The caching allocator refuses to reserve past this: about 1.5 GiB above what is in use now.
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + 1.5 * 2**30) / total)
    try:
        callback = AutoMicroBatching("auto", max_memory=1.0, preflight=False)  # cold: from the whole step batch
        params, sizes = fit([callback])
        torch.cuda.empty_cache()
        # The pre-flight sees the per-process fraction (the backend's capacity) and starts where the trace fits.
        traced = AutoMicroBatching("auto", max_memory=1.0)
        traced_params, traced_sizes = fit([traced])
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert callback.oom_retries >= 1
    assert sizes[-1] < step_batch
    assert traced.preflight_result is not None and traced.preflight_result.reason is None
    assert traced.oom_retries == 0 and traced_sizes[0] < step_batch, (traced.events, traced_sizes[:4])
    for name, value in reference.items():
        torch.testing.assert_close(params[name], value, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(traced_params[name], value, rtol=1e-4, atol=1e-5)
