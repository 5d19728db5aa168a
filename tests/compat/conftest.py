"""A process group of one, in this process: enough for a real DDP module or a real ``fully_shard``-ed one."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist


@pytest.fixture
def gloo_group(tmp_path: Path) -> Iterator[dist.ProcessGroup]:
    """The default process group: gloo, one rank (this process), a ``FileStore`` under ``tmp_path``; destroyed after."""
    assert not dist.is_initialized(), "a test left a process group behind"
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "gloo_store"), 1), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
