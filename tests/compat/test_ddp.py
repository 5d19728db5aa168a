"""Fails if torch's DDP (or Lightning's DDP strategies) change what ``lightning_accum._compat.ddp`` drives by hand.

Each check runs a real ``DistributedDataParallel`` module on a one-process gloo group in this process: the reducer
calls that arm a backward whose forward ran under ``no_sync``, the buffer-broadcast flag, the process group, and the
strategies' timeout.
"""

from __future__ import annotations

import copy
import inspect
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.plugins.environments import LightningEnvironment
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from torch import nn
from torch._C._distributed_c10d import Reducer
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from lightning_accum import _compat
from tests.helpers import FP32


def test_ddp_reducer_calls_split_mode_drives_by_hand_exist():
    for name in ("will_sync_module_buffers", "_sync_buffers"):
        assert callable(getattr(DistributedDataParallel, name)), name
    for name in ("prepare_for_forward", "prepare_for_backward", "_rebuild_buckets"):
        assert callable(getattr(Reducer, name)), name


class _TwoHeads(nn.Module):
    """A model whose second head is left unused when ``use_both`` is off (``find_unused_parameters``)."""

    def __init__(self, use_both: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(3, 2)
        self.head = nn.Linear(2, 1)
        self.use_both = use_both

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.body(x)
        return self.head(hidden).sum() if self.use_both else hidden.pow(2).sum()


def _counted(model: nn.Module, **ddp_kwargs: Any) -> tuple[DistributedDataParallel, list[int]]:
    """``model`` under DDP, with a comm hook that counts the gradient buckets all-reduced."""
    ddp = DistributedDataParallel(model, **ddp_kwargs)
    buckets: list[int] = []

    # Unannotated: DDP checks a hook's annotations, which `from __future__ import annotations` turns into strings.
    def hook(state, bucket):
        buckets.append(bucket.index())
        return default_hooks.allreduce_hook(None, bucket)

    ddp.register_comm_hook(None, hook)
    return ddp, buckets


@pytest.mark.parametrize("find_unused_parameters", [False, True])
def test_a_backward_armed_by_hand_after_a_no_sync_forward_is_all_reduced(gloo_group, find_unused_parameters):
    # With `find_unused_parameters`, the head is unused: the reducer must be told which outputs the loss came from.
    reference = _TwoHeads(use_both=not find_unused_parameters)
    ddp, buckets = _counted(copy.deepcopy(reference), find_unused_parameters=find_unused_parameters)
    x = torch.randn(4, 3)
    for _ in range(3):  # a round left unfinished would fail the next forward ("Expected to have finished reduction")
        ddp.zero_grad(set_to_none=True)
        with ddp.no_sync():
            loss = ddp(x)
        assert ddp.require_forward_param_sync is False  # DDP's forward under `no_sync` clears it
        before = len(buckets)
        _compat.prepare_ddp_backward(ddp, loss)
        assert ddp.require_forward_param_sync is True
        loss.backward()
        assert len(buckets) > before  # the reducer, armed by hand, all-reduced this backward
    reference(x).backward()
    for name, param in reference.named_parameters():
        actual = ddp.module.get_parameter(name).grad
        if param.grad is None:
            assert actual is None or not actual.any(), name
        else:
            torch.testing.assert_close(actual, param.grad, **FP32)


def test_without_arming_a_no_sync_forwards_backward_is_not_all_reduced(gloo_group):
    ddp, buckets = _counted(_TwoHeads())
    x = torch.randn(4, 3)
    with ddp.no_sync():
        loss = ddp(x)
    loss.backward()
    assert buckets == []  # why split mode arms the reducer itself before a synced backward
    ddp(x).backward()
    assert buckets  # a synced forward arms it: what `prepare_ddp_backward` does by hand
    source = inspect.getsource(DistributedDataParallel._post_forward)
    assert "self.require_forward_param_sync = True" in source
    assert "self.reducer.prepare_for_backward(" in source
    assert "self.reducer.prepare_for_forward()" in inspect.getsource(DistributedDataParallel._pre_forward)
    assert {"find_unused_parameters", "static_graph"} <= set(vars(ddp))


def test_the_buckets_are_rebuilt_once_from_the_first_armed_backward(gloo_group):
    # `_rebuild_buckets` answers whether it rebuilt: only once, from the gradient order an armed backward recorded.
    ddp = DistributedDataParallel(_TwoHeads())
    x = torch.randn(4, 3)
    with ddp.no_sync():
        loss = ddp(x)
    assert ddp.reducer._rebuild_buckets() is False  # no backward recorded an order yet
    _compat.prepare_ddp_backward(ddp, loss)
    loss.backward()
    assert ddp.reducer._rebuild_buckets() is True
    assert ddp.reducer._rebuild_buckets() is False


class _WithBatchNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x).sum()


def _counting_buffer_syncs(ddp: DistributedDataParallel) -> list[int]:
    calls: list[int] = []
    original = ddp._sync_buffers

    def sync() -> None:
        calls.append(1)
        original()

    ddp._sync_buffers = sync  # DDP's forward calls it through the instance
    return calls


def test_the_buffer_broadcast_happens_once_at_the_step_start_and_no_forward_repeats_it(gloo_group):
    ddp = DistributedDataParallel(_WithBatchNorm())
    calls = _counting_buffer_syncs(ddp)
    x = torch.randn(4, 3)
    assert ddp.will_sync_module_buffers()  # a fresh DDP module broadcasts at its first forward
    ddp(x).backward()
    assert len(calls) == 1 and ddp.require_forward_param_sync is True  # a synced forward sets it again
    _compat.broadcast_ddp_buffers(SimpleNamespace(model=ddp, world_size=1))
    assert len(calls) == 1 and ddp.require_forward_param_sync is True  # one rank: nothing to broadcast
    _compat.broadcast_ddp_buffers(SimpleNamespace(model=ddp, world_size=2))
    assert len(calls) == 2 and ddp.require_forward_param_sync is False and not ddp.will_sync_module_buffers()
    with ddp.no_sync():
        ddp(x).backward()
    ddp(x).backward()  # the step's last micro-batch, synced: its forward broadcasts nothing either
    assert len(calls) == 2
    _compat.broadcast_ddp_buffers(SimpleNamespace(model=nn.Linear(2, 2), world_size=2))  # not DDP: left alone


def test_after_the_deferred_sync_the_next_step_start_broadcasts_the_buffers_again(gloo_group):
    ddp = DistributedDataParallel(_WithBatchNorm())
    calls = _counting_buffer_syncs(ddp)
    strategy = SimpleNamespace(model=ddp, world_size=2)
    for _ in range(3):  # split mode's deferred step: broadcast, forwards and backwards under no_sync, all-reduce
        _compat.broadcast_ddp_buffers(strategy)
        with ddp.no_sync():
            ddp(torch.randn(4, 3)).backward()
        assert not ddp.will_sync_module_buffers()  # what DDP leaves after a forward under no_sync
        _compat.mark_ddp_synced(strategy)
        assert ddp.will_sync_module_buffers()  # as after its own synced backward
    assert len(calls) == 3  # one broadcast per step, at its start
    _compat.mark_ddp_synced(SimpleNamespace(model=nn.Linear(2, 2)))  # not DDP: left alone


def test_the_process_group_is_the_one_ddp_reduces_over(gloo_group):
    assert _compat.ddp_process_group(SimpleNamespace(model=DistributedDataParallel(nn.Linear(2, 1)))) is gloo_group
    group = dist.new_group([0], backend="gloo")
    ddp = DistributedDataParallel(nn.Linear(2, 1), process_group=group)
    assert _compat.ddp_process_group(SimpleNamespace(model=ddp)) is group
    assert _compat.ddp_process_group(SimpleNamespace(model=nn.Linear(2, 1))) is None


@pytest.mark.parametrize("strategy_class", [DDPStrategy, ModelParallelStrategy])
def test_the_timeout_is_the_one_the_strategy_gives_its_process_group(strategy_class, monkeypatch):
    timeout = timedelta(minutes=7)
    strategy = strategy_class(timeout=timeout)
    assert _compat.process_group_timeout(strategy) == timeout
    # What the strategy's setup hands `init_process_group`, seen by running that setup with the connection recorded:
    # not its source text, which Lightning 2.2-2.4 (`timeout=self._timeout`) and 2.5+ (`kwargs = {"timeout": ...}`)
    # spell differently for the same call.
    given: dict[str, Any] = {}
    module = inspect.getmodule(strategy_class)
    monkeypatch.setattr(module, "_init_dist_connection", lambda env, backend, **kwargs: given.update(kwargs))
    strategy.accelerator = CPUAccelerator()
    strategy.parallel_devices = [torch.device("cpu")]
    strategy.cluster_environment = LightningEnvironment()
    strategy.setup_distributed() if strategy_class is DDPStrategy else strategy._setup_distributed()
    assert given["timeout"] == timeout
    assert _compat.process_group_timeout(object()) is None
