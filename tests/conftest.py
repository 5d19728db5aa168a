"""Fixtures every test module shares: no process outlives its test, an offline W&B sandbox, and a network that
refuses every connection."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

import tests.helpers as h


@pytest.fixture(autouse=True)
def no_process_left() -> Iterator[None]:
    """A process the test started and left running (a rank waiting in a collective after pytest's timeout, a
    subprocess never waited for) is killed, and the test errors with its command line.

    pytest-timeout (``timeout_method = "signal"``) fails the test in its main thread, which runs the fixtures'
    teardown: this one is set up first of all (autouse), so it runs last, after the test's own cleanup.
    """
    before = set(h.descendants(os.getpid()))
    yield
    stray = h.stray_processes(before)
    if stray:
        listed = "\n".join(f"  {pid}: {cmd[:200]}" for pid, cmd in sorted(stray.items()))
        pytest.fail(f"the test left {len(stray)} process(es) running; killed them:\n{listed}", pytrace=False)


@pytest.fixture
def wandb_offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """W&B runs offline, with every directory it writes under ``tmp_path``; finished and torn down afterwards."""
    wandb = pytest.importorskip("wandb", reason="the `wandb` extra is not installed")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path))
    yield tmp_path
    wandb.finish()
    wandb.teardown()


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any attempt to open a connection fails the test."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"network access attempted: {args!r}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
