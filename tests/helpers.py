"""Small models, data and reference computations shared by the tests, and the one way the tests start ranks."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.multiprocessing as mp
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from torch import Tensor, nn
from torch.utils.data import Dataset

FP32 = {"rtol": 1e-5, "atol": 1e-6}
"""`torch.testing.assert_close` tolerances for float32 results that differ only in summation order."""

# ---- starting ranks ----------------------------------------------------------------------------------------------
# Every multi-rank test goes through `ddp_strategy`, `fsdp2_strategy` or `start_ranks` (tests/test_codebase.py checks
# it). Ranks that disagree wait in mismatched collectives; with the default 30-minute process-group timeout they
# would outlive pytest's timeout, which does not end spawned processes. Under RANK_TIMEOUT gloo raises in the waiting
# rank instead, the launcher stops the others, and the test fails. The `no_process_left` fixture (conftest.py) kills
# whatever a test still leaves behind.

RANK_TIMEOUT = timedelta(seconds=float(os.environ.get("LIGHTNING_ACCUM_TEST_RANK_TIMEOUT_S", "60")))
"""The tests' process-group timeout: how long a rank waits in one collective for its peers before it fails.

Far above the skew between two ranks on a loaded 2-core machine (a few seconds), far below pytest's timeout (120 s
and up for the multi-rank tests). ``LIGHTNING_ACCUM_TEST_RANK_TIMEOUT_S`` changes it (a very slow machine).
"""


START_METHOD = os.environ.get("LIGHTNING_ACCUM_TEST_START_METHOD", "fork")
"""How a test's Trainer starts its 2 ranks: forked (``ddp_fork``: no rank imports torch and Lightning again, 63 s ->
4 s for tests/test_uneven_ranks.py here), unless ``LIGHTNING_ACCUM_TEST_START_METHOD`` says ``spawn``. The tests
that users' ``ddp_spawn`` needs (callbacks pickled into fresh processes) ask for ``start_method="spawn"`` themselves."""


def ddp_strategy(**kwargs: Any) -> DDPStrategy:
    """``DDPStrategy`` for a test: 2 ranks (`START_METHOD`) on gloo under `RANK_TIMEOUT`; ``kwargs`` override."""
    return DDPStrategy(
        **{"start_method": START_METHOD, "process_group_backend": "gloo", "timeout": RANK_TIMEOUT, **kwargs}
    )


def fsdp2_strategy(world_size: int = 2, **kwargs: Any) -> ModelParallelStrategy:
    """``ModelParallelStrategy`` (FSDP2, data parallel only) for a test's ranks: gloo under `RANK_TIMEOUT`."""
    defaults = {"data_parallel_size": world_size, "tensor_parallel_size": 1, "process_group_backend": "gloo"}
    return ModelParallelStrategy(**{**defaults, "timeout": RANK_TIMEOUT, **kwargs})


def fabric_strategy(parallelize_fn: Callable[..., Any] | None = None) -> Any:
    """Fabric's ``DDPStrategy`` on gloo, or its ``ModelParallelStrategy`` (FSDP2) with ``parallelize_fn``, under
    `RANK_TIMEOUT`: the Fabric front end's ranks fail, not hang, when they disagree."""
    from lightning.fabric.strategies import DDPStrategy as FabricDDP
    from lightning.fabric.strategies import ModelParallelStrategy as FabricModelParallel

    if parallelize_fn is None:
        return FabricDDP(process_group_backend="gloo", timeout=RANK_TIMEOUT)
    return FabricModelParallel(
        parallelize_fn=parallelize_fn, data_parallel_size=2, tensor_parallel_size=1, timeout=RANK_TIMEOUT
    )


def start_ranks(
    fn: Callable[..., None], args: tuple[Any, ...] = (), nprocs: int = 2, start_method: str = START_METHOD
) -> None:
    """Run ``fn(rank, *args)`` in ``nprocs`` processes (`START_METHOD`) and wait for them all (``mp.start_processes``).

    One rank that fails stops the others (torch's join does), and the error of the rank that failed *first* is raised
    here: torch raises the error of whichever failed rank its wait returns first, and a peer that fails because the
    first one closed its connection ("Connection closed by peer") can come before the cause. When the wait itself is
    interrupted (pytest's timeout, Ctrl-C), every rank is killed before the exception goes on: torch leaves them
    running, and pytest would then wait for them at exit.
    """
    with tempfile.TemporaryDirectory(prefix="lightning-accum-ranks-") as failed_at:
        context = mp.start_processes(
            _rank_that_stamps_its_failure,
            args=(fn, failed_at, args),
            nprocs=nprocs,
            start_method=start_method,
            join=False,
        )
        try:
            while not context.join():
                pass
        except mp.ProcessRaisedException as error:
            first = _first_to_fail(failed_at)
            if first is None or first == error.error_index:
                raise
            with open(context.error_files[first], "rb") as f:
                trace = pickle.load(f)
            raise mp.ProcessRaisedException(
                f"\n\n-- Process {first} failed first (process {error.error_index} after it), with the following"
                f" error:\n{trace}",
                first,
                context.processes[first].pid,
            ) from error
        except BaseException:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            for process in context.processes:
                process.join(timeout=10)
            raise


def _rank_that_stamps_its_failure(rank: int, fn: Callable[..., None], failed_at: str, args: tuple[Any, ...]) -> None:
    try:
        fn(rank, *args)
    except Exception:
        # CLOCK_MONOTONIC is one clock for every process on the machine: the ranks' stamps compare.
        Path(failed_at, str(rank)).write_text(repr(time.monotonic()))
        raise


def _first_to_fail(failed_at: str) -> int | None:
    """The rank whose failure was stamped first, or None when none was (a rank killed, not raising)."""
    stamps = {int(p.name): float(p.read_text()) for p in Path(failed_at).iterdir()}
    return min(stamps, key=stamps.__getitem__) if stamps else None


SESSION_HELPERS = (
    "multiprocessing.resource_tracker",
    "multiprocessing.forkserver",
    # A local Ray cluster (tests/test_ray_train.py) lives for its module and is shut down by its fixture: its daemons
    # and workers outlive each test on purpose.
    "raylet",
    "gcs_server",
    "ray::",
    "/ray/",
)
"""Processes started once and kept past one test: multiprocessing's, for the session; a Ray cluster, for its module."""


def descendants(pid: int) -> dict[int, str]:
    """Every live process under ``pid`` (children, grandchildren, ...) and its command line, read from ``/proc``."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # gone meanwhile
            continue
        # `pid (comm) state ppid ...`: comm may hold spaces and parentheses, so split after the last ')'.
        state, ppid = stat[stat.rindex(")") + 2 :].split()[:2]
        if state != "Z":  # a zombie is dead already, only not yet reaped
            children.setdefault(int(ppid), []).append(int(entry))
    found: dict[int, str] = {}
    todo = list(children.get(pid, []))
    while todo:
        child = todo.pop()
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                found[child] = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        todo.extend(children.get(child, []))
    return found


def stray_processes(before: set[int], grace_s: float = 5.0) -> dict[int, str]:
    """Kill what runs under this process now and did not at ``before`` (session helpers aside); what was killed.

    ``grace_s`` lets a process that was already told to stop (a rank its launcher terminated) exit by itself first.
    The whole tree is read before any kill, so that grandchildren are found before their parent dies.
    """

    def stray() -> dict[int, str]:
        now = descendants(os.getpid())
        return {p: c for p, c in now.items() if p not in before and not any(s in c for s in SESSION_HELPERS)}

    deadline, found = time.monotonic() + grace_s, stray()
    while found and time.monotonic() < deadline:
        time.sleep(0.1)
        found = stray()
    for pid in found:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return found


def run_process_group(
    command: list[str], *, cwd: Any, env: dict[str, str], timeout: float, what: str
) -> subprocess.CompletedProcess[str]:
    """Run ``command`` in a session of its own, stdout and stderr together; kill the whole group at ``timeout`` (the
    test fails, naming ``what``) and in any case at the end, so that no rank it started outlives the test."""
    proc = subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"{what} ran past {timeout} s and was killed with its ranks:\n{output[-4000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(command, proc.returncode, output)


def run_quick_benchmark(name: str, timeout: float) -> tuple[str, dict[str, Any]]:
    """Runs ``examples/benchmarks/{name}.py --quick`` in a subprocess: its output, and its ``RESULT`` line's JSON."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    script = root / "examples" / "benchmarks" / f"{name}.py"
    done = subprocess.run(
        [sys.executable, str(script), "--quick"], capture_output=True, text=True, env=env, cwd=root, timeout=timeout
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    return done.stdout, json.loads(line[len("RESULT ") :])


@contextlib.contextmanager
def rank_error_written(out_dir: str, rank: int) -> Iterator[None]:
    """Writes the error that ends the block to ``error{rank}.txt`` in ``out_dir``, then raises it on.

    For a step in a ``ddp_spawn`` worker: the workers call no ``on_exception`` hook, and the launcher reports only the
    first worker that failed.
    """
    try:
        yield
    except BaseException as err:
        # Written whole or not at all: the launcher may stop this rank (SIGTERM) at any moment once another failed.
        path = os.path.join(out_dir, f"error{rank}")
        for suffix, text in ((".where", _raised_in(err)), (".txt", f"{type(err).__name__}: {err}")):
            with open(path + suffix + ".part", "w") as f:
                f.write(text)
            os.replace(path + suffix + ".part", path + suffix)
        raise


def _raised_in(err: BaseException) -> str:
    """The functions the error passed through, outermost first: one per line."""
    return "\n".join(frame.name for frame in traceback.extract_tb(err.__traceback__))


def raised_in(out_dir: str, rank: int) -> list[str]:
    """The functions the error `rank_error_written` wrote for ``rank`` passed through, outermost first."""
    with open(os.path.join(out_dir, f"error{rank}.where")) as f:
        return f.read().splitlines()


class ReadOnlyMapping(Mapping[str, Tensor]):
    """A mapping whose constructor takes no dict, so a split cannot rebuild it: ``{key: arange(size)}``."""

    key = "x"
    size = 10

    def __init__(self) -> None:
        self._data = {self.key: torch.arange(self.size, dtype=torch.float32)}

    def __getitem__(self, key: str) -> Tensor:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)


class IndexedDataset(Dataset):
    """Regression samples that carry their own index, so a test can tell which samples a step saw."""

    def __init__(self, n: int = 40, dim: int = 6, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, dim, generator=g)
        self.y = torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {"x": self.x[i], "y": self.y[i], "index": torch.tensor(i)}


class RegressionModel(pl.LightningModule):
    """A linear model with a mean-squared-error loss; records the gradient seen at each optimizer step."""

    def __init__(self, dim: int = 6, lr: float = 0.1, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.layer = nn.Linear(dim, 1)
        self.lr = lr
        self.step_grads: list[dict[str, Tensor | None]] = []  # gradient at each optimizer step, after clipping
        self.step_indices: list[list[int]] = []  # sample indices in each optimizer step (this rank)
        self.step_lrs: list[float] = []  # the learning rate of each optimizer step (a schedule may scale it)
        self._window_indices: list[int] = []
        self.split_mode = False

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        self._record(batch)
        return nn.functional.mse_loss(self.layer(batch["x"]), batch["y"])

    def _record(self, batch: dict[str, Tensor]) -> None:
        if not self.split_mode:
            self._window_indices.extend(batch["index"].tolist())

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # In split mode a step is one dataloader batch, whatever micro-batches (and retries) ran it.
        if self.split_mode:
            self._window_indices = batch["index"].tolist()

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
        self.step_grads.append(
            {n: None if p.grad is None else p.grad.detach().clone() for n, p in self.named_parameters()}
        )
        self.step_indices.append(self._window_indices)
        self.step_lrs.append(optimizer.param_groups[0]["lr"])
        self._window_indices = []

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def quiet_trainer_kwargs(**kwargs: Any) -> dict[str, Any]:
    """`pl.Trainer` arguments for a run that writes nothing: no logger, checkpoint, progress bar or model summary."""
    quiet = {
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    return {**quiet, **kwargs}


def make_trainer(tmp_path: Any, callbacks: Sequence[pl.Callback] = (), **kwargs: Any) -> pl.Trainer:
    defaults: dict[str, Any] = {
        "default_root_dir": tmp_path,
        "accelerator": "cpu",
        "devices": 1,
        "max_epochs": 1,
        **quiet_trainer_kwargs(),
        "num_sanity_val_steps": 0,
        "log_every_n_steps": 1,  # tiny runs: log (and let AccumulationMonitor log) every optimizer step
    }
    defaults.update(kwargs)
    return pl.Trainer(callbacks=list(callbacks), **defaults)


def reference_grads(
    model: nn.Module, batches: Sequence[Any], loss_fn: Callable[[nn.Module, Any], Tensor]
) -> dict[str, Tensor]:
    """The exact gradient: the loss of one pass over the concatenated window, on a copy of ``model``."""
    ref = copy.deepcopy(model)
    ref.zero_grad(set_to_none=True)
    loss_fn(ref, concat(batches)).backward()
    return {n: p.grad.detach().clone() for n, p in ref.named_parameters()}


def concat(batches: Sequence[Any]) -> Any:
    first = batches[0]
    if isinstance(first, Tensor):
        return torch.cat(list(batches))
    if isinstance(first, dict):
        return {k: concat([b[k] for b in batches]) for k in first}
    if isinstance(first, (list, tuple)):
        return type(first)(concat([b[i] for b in batches]) for i in range(len(first)))
    raise TypeError(type(first))


def assert_same(actual: Any, expected: Any) -> None:
    """``actual`` holds ``expected``'s values to the bit: the same tensors, keys in the same order, entries in turn."""
    if isinstance(expected, Tensor):
        torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    elif isinstance(expected, Mapping):
        assert list(actual) == list(expected)
        for key in expected:
            assert_same(actual[key], expected[key])
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected, strict=True):
            assert_same(a, e)
    else:
        assert actual == expected


def grad_ratio(actual: dict[str, Tensor], expected: dict[str, Tensor]) -> float:
    """How many times the exact gradient ``actual`` is (least squares over all entries)."""
    a = torch.cat([actual[n].flatten() for n in expected])
    e = torch.cat([expected[n].flatten() for n in expected])
    return float((a @ e) / (e @ e))


class TokenDataset(Dataset):
    """Sequences of ``seq_len`` tokens of which only the first ``lengths[i]`` carry a loss (the rest is padding)."""

    def __init__(
        self, n: int = 32, seq_len: int = 8, dim: int = 5, seed: int = 0, lengths: Sequence[int] | None = None
    ):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, seq_len, dim, generator=g)
        self.y = torch.randn(n, seq_len, generator=g)
        if lengths is None:
            lengths = torch.randint(1, seq_len + 1, (n,), generator=g).tolist()
        self.mask = torch.zeros(n, seq_len, dtype=torch.bool)
        for i, length in enumerate(lengths):
            self.mask[i, :length] = True

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {"x": self.x[i], "y": self.y[i], "mask": self.mask[i], "index": torch.tensor(i)}


def count_tokens(batch: dict[str, Tensor]) -> Tensor:
    """Loss-bearing tokens of a micro-batch (module level, so ``ddp_spawn`` can pickle it)."""
    return batch["mask"].sum()


def token_loss(model: nn.Module, batch: dict[str, Tensor], reduction: str = "mean") -> Tensor:
    per_token = (model.layer(batch["x"]).squeeze(-1) - batch["y"]) ** 2
    total = (per_token * batch["mask"]).sum()
    if reduction == "sum":
        return total
    # The usual masked mean; `clamp` keeps an all-padding micro-batch finite.
    return total / batch["mask"].sum().clamp(min=1)


def mse_loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    return nn.functional.mse_loss(model.layer(batch["x"]), batch["y"])


class TokenModel(RegressionModel):
    """Per-token regression whose loss is the mean (or sum) over loss-bearing tokens."""

    def __init__(self, dim: int = 5, lr: float = 0.1, reduction: str = "mean", seed: int = 0) -> None:
        super().__init__(dim=dim, lr=lr, seed=seed)
        self.reduction = reduction

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        self._record(batch)
        return token_loss(self, batch, self.reduction)


def replay_reference(
    initial: nn.Module,
    dataset: Dataset,
    step_indices: Sequence[Sequence[int]],
    loss_fn: Callable[[nn.Module, Any], Tensor],
    lr: float,
    clip_norm: float | None = None,
    lrs: Sequence[float] | None = None,
) -> list[dict[str, Tensor]]:
    """Exact gradients along the run: at each step, one pass over the step's samples, then plain SGD.

    ``lrs`` gives each step's learning rate where it changes during the run (a schedule that scales it with ``k``);
    otherwise every step uses ``lr``.
    """
    ref = copy.deepcopy(initial)
    grads = []
    for step, indices in enumerate(step_indices):
        if lrs is not None:
            lr = lrs[step]
        window = [dataset[i] for i in indices]
        batch = {k: torch.stack([s[k] for s in window]) for k in window[0]}
        expected = reference_grads(ref, [batch], loss_fn)
        if clip_norm is not None:
            norm = torch.cat([g.flatten() for g in expected.values()]).norm()
            scale = min(1.0, clip_norm / (float(norm) + 1e-6))
            expected = {n: g * scale for n, g in expected.items()}
        grads.append(expected)
        with torch.no_grad():
            for name, p in ref.named_parameters():
                p -= lr * expected[name]
    return grads


def assert_grads_close(
    actual: Sequence[dict[str, Tensor]], expected: Sequence[dict[str, Tensor]], **tolerance: float
) -> None:
    assert len(actual) == len(expected), f"{len(actual)} optimizer steps, expected {len(expected)}"
    for step, (a, e) in enumerate(zip(actual, expected, strict=False)):
        for name in e:
            torch.testing.assert_close(
                a[name], e[name], msg=lambda m, s=step, n=name: f"step {s}, {n}: {m}", **tolerance
            )


DASHBOARD_SECTIONS = ["Batch", "Tokens", "Ranks", "Noise scale", "Schedule", "Memory", "Recovery", "Throughput"]
"""The dashboard's sections, in order (the user's own metrics' section comes after them)."""
