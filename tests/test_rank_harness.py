"""Issue 25, item 15: ranks that disagree make the test fail within its timeout, and leave no process behind.

Two layers, both tested here on 2 real gloo ranks. The process-group timeout the helpers give every strategy
(`tests.helpers.RANK_TIMEOUT`) makes a rank that waits in a mismatched collective raise, so the launcher stops the
others and the test fails. Where a test hangs anyway, pytest's timeout fails it, and the `no_process_left` fixture
(conftest.py) kills the ranks it left, which pytest would otherwise wait for at exit: the run would hang until killed.
"""

from __future__ import annotations

import atexit
import os
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import DataLoader

import tests.helpers as h
from lightning_accum import _compat

pytestmark = [pytest.mark.ddp, pytest.mark.timeout(300)]  # spawned ranks start slowly on a loaded 2-core machine

ROOT = Path(__file__).resolve().parents[1]
SHORT = timedelta(seconds=10)  # the wait these tests allow a mismatched collective, instead of RANK_TIMEOUT's


def waited_in(out_dir: str, rank: int, collective: Callable[[], object]) -> None:
    """Run ``collective`` and write how long it waited before it raised to ``out_dir/waited{rank}.txt``.

    The time the ranks take to start is the loaded machine's; the wait is what the process-group timeout bounds.
    ``out_dir/entered{rank}.txt`` says that the rank has come this far: it is about to wait in ``collective``.
    """
    Path(out_dir, f"entered{rank}.txt").write_text("")
    start = time.monotonic()
    try:
        collective()
    finally:
        with open(os.path.join(out_dir, f"waited{rank}.txt"), "w") as f:
            f.write(f"{time.monotonic() - start:.1f}")


def waits(out_dir: Path) -> list[float]:
    return [float((out_dir / f"waited{rank}.txt").read_text()) for rank in range(2)]


class DisagreeingModel(h.RegressionModel):
    """Rank 0 waits for a message rank 1 never sends, while rank 1 all-reduces: collectives that never match."""

    def __init__(self, out_dir: str) -> None:
        super().__init__()
        self.out_dir = out_dir

    def training_step(self, batch, batch_idx):
        if self.global_rank == 0:
            waited_in(self.out_dir, 0, lambda: dist.recv(torch.zeros(1), src=1))
        else:
            waited_in(self.out_dir, 1, lambda: dist.all_reduce(torch.ones(3)))
        return super().training_step(batch, batch_idx)


def test_every_strategy_the_helpers_build_has_the_test_timeout():
    assert _compat.process_group_timeout(h.ddp_strategy()) == h.RANK_TIMEOUT
    assert _compat.process_group_timeout(h.fsdp2_strategy()) == h.RANK_TIMEOUT
    # Far below the multi-rank tests' pytest timeouts (120 s and up), so that the collective fails first.
    assert h.RANK_TIMEOUT <= timedelta(seconds=60)


def test_ranks_in_mismatched_collectives_under_ddp_spawn_fail_in_bounded_time_and_leave_no_process(tmp_path):
    before = set(h.descendants(os.getpid()))
    trainer = h.make_trainer(
        tmp_path, strategy=h.ddp_strategy(timeout=SHORT, start_method="spawn"), devices=2, max_steps=2
    )
    with pytest.raises(Exception, match=r"(?i)timed out"):  # gloo: "Timed out waiting 10000ms for recv operation"
        trainer.fit(DisagreeingModel(str(tmp_path)), DataLoader(h.IndexedDataset(8), batch_size=2))
    assert_bounded(waits(tmp_path))
    assert h.stray_processes(before) == {}  # what would be left, killed


def assert_bounded(waited: list[float]) -> None:
    # Each rank gave up after the timeout, not 30 minutes later (the slack: a loaded machine).
    assert all(SHORT.total_seconds() - 1 <= w < SHORT.total_seconds() + 30 for w in waited), waited


def _mismatched(rank: int, port: int, seconds: float, out_dir: str) -> None:
    """Rank 0 all-reduces, rank 1 waits to receive from rank 0: neither collective can complete."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=seconds)
    )
    if rank == 0:
        waited_in(out_dir, rank, lambda: dist.all_reduce(torch.ones(3)))
    else:
        waited_in(out_dir, rank, lambda: dist.recv(torch.zeros(1), src=0))


def test_ranks_started_by_start_ranks_fail_in_bounded_time_and_leave_no_process(tmp_path):
    before = set(h.descendants(os.getpid()))
    # The rank whose wait times out first closes its connections as it fails; the other, timing out at the same
    # moment, may then stamp "Connection closed by peer" a hair before the first stamps its own timeout (seen in a
    # full run). Either way each rank waited the timeout and no longer, which `assert_bounded` checks.
    with pytest.raises(Exception, match=r"(?i)timed out|connection closed by peer"):
        h.start_ranks(_mismatched, (_free_port(), SHORT.total_seconds(), str(tmp_path)), 2)
    assert_bounded(waits(tmp_path))
    assert h.stray_processes(before) == {}  # what would be left, killed


def _fails_first_and_exits_last(rank: int, out_dir: str) -> None:
    """Rank 1 raises first but its process ends last (an exit that takes time, as a process group's teardown can);
    rank 0 raises 0.5 s later and ends at once: torch's launcher sees rank 0 end first and raises its error."""
    failing = Path(out_dir, "rank1_failing")
    if rank == 1:
        atexit.register(time.sleep, 3.0)
        failing.touch()
        raise RuntimeError("rank 1 failed first: the cause")
    # Spawned ranks start seconds apart on a loaded machine: wait for rank 1's failure, not a fixed time from start.
    deadline = time.monotonic() + 120
    while not failing.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    raise RuntimeError("rank 0 failed after it: a consequence")


def test_start_ranks_raises_the_error_of_the_rank_that_failed_first_not_of_the_first_to_exit(tmp_path):
    # Before, `start_ranks` raised whichever failed rank torch's wait returned first: here rank 0's consequence.
    with pytest.raises(mp.ProcessRaisedException, match="failed first: the cause") as raised:
        # spawned: a forked rank ends without its `atexit` handlers, so none would exit last
        h.start_ranks(_fails_first_and_exits_last, (str(tmp_path),), 2, start_method="spawn")
    assert raised.value.error_index == 1
    assert "Process 1 failed first (process 0 after it)" in str(raised.value)


INNER_TEST = """
import time
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from tests.test_rank_harness import _mismatched


@pytest.fixture
def ranks_in_their_collectives():
    # Torch's own spawn with the default 30-minute process-group timeout. Waited for (outside the test's timeout,
    # however long the loaded machine takes to start them) until both ranks are in their mismatched collectives.
    args = ({port}, 1800.0, {out!r})
    context = mp.start_processes(_mismatched, args=args, nprocs=2, start_method="spawn", join=False)
    deadline = time.monotonic() + 120
    while not all(Path({out!r}, f"entered{{rank}}.txt").exists() for rank in range(2)):
        assert time.monotonic() < deadline, "the ranks did not reach their collectives in 120 s"
        time.sleep(0.1)
    return context


@pytest.mark.timeout({pytest_timeout}, func_only=True)
def test_hangs(ranks_in_their_collectives):
    # What `mp.start_processes(..., join=True)` does: only pytest's timeout ends the wait.
    while not ranks_in_their_collectives.join():
        pass
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def processes_with(marker: str, grace_s: float = 10.0) -> list[int]:
    """Live processes whose environment holds ``marker`` (a rank inherits it from the pytest that spawned it).

    ``grace_s`` lets the session's resource tracker, which ends when the pytest that started it has exited, go.
    """
    deadline = time.monotonic() + grace_s
    while True:
        found = []
        for entry in os.listdir("/proc"):
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(entry))
            except (OSError, ValueError):
                continue
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def test_a_hang_past_pytests_timeout_fails_and_the_fixture_kills_the_ranks(tmp_path):
    # The backstop alone: a pytest run of a test that hangs in mismatched collectives without the helpers' timeout.
    # The timeout counts from the moment both ranks wait in their collectives (the ranks' start is not timed): a few
    # seconds prove the hang as well as more would.
    pytest_timeout = 3
    (tmp_path / "test_inner.py").write_text(
        textwrap.dedent(INNER_TEST.format(pytest_timeout=pytest_timeout, port=_free_port(), out=str(tmp_path)))
    )
    marker = f"HARNESS_PROBE_{uuid.uuid4().hex}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HARNESS_PROBE": marker, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", str(ROOT / "pyproject.toml")]
    command += ["--rootdir", str(ROOT), "-p", "tests.conftest", str(tmp_path / "test_inner.py")]
    # Before the fixture, this run hung at exit (pytest waits for the ranks it left) until the `timeout` here.
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out[-3000:]
    assert "Timeout (>3.0s)" in out and "the test left 2 process(es) running; killed them" in out, out[-3000:]
    # Both ranks were waiting in their mismatched collectives when the timeout struck, and neither got past them.
    assert all((tmp_path / f"entered{rank}.txt").exists() for rank in range(2)), sorted(os.listdir(tmp_path))
    assert not any((tmp_path / f"waited{rank}.txt").exists() for rank in range(2)), sorted(os.listdir(tmp_path))
    assert processes_with(marker) == []
