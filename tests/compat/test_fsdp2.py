"""Fails if torch's FSDP2 changes the private state that ``lightning_accum._compat.fsdp2`` reads and writes.

Each check runs a real ``fully_shard``-ed model on a one-process gloo group in this process: where a held-back
gradient lands (``_unsharded_param.grad``, ``unsharded_accumulated_grad``), that the next synced backward adds it in,
that dropping it and the final-callback flag leaves a clean state, which settings ``set_reshard_after_*`` change, and
what ``fully_shard`` does to the module's class, hooks and ``__dict__``.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.loops.utilities import _block_parallel_sync_behavior
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from lightning_accum import _compat
from lightning_accum._compat import fsdp2
from tests.helpers import FP32, fsdp2_strategy


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))


def _reference_and_sharded(root_policy: MixedPrecisionPolicy) -> tuple[nn.Sequential, nn.Sequential]:
    """A plain model and a copy sharded as a Lightning user does: the first layer, then the root (``root_policy``)."""
    mesh = init_device_mesh("cpu", (1,))
    reference = _model()
    model = copy.deepcopy(reference)
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh, mp_policy=root_policy)
    return reference, model


@pytest.fixture
def sharded(gloo_group: dist.ProcessGroup) -> Iterator[tuple[nn.Sequential, nn.Sequential]]:
    """A plain model and a copy sharded as a Lightning user does: the first layer, then the root."""
    yield _reference_and_sharded(MixedPrecisionPolicy())  # FSDP2's default policy


@pytest.fixture
def reduce_dtype_sharded(gloo_group: dist.ProcessGroup) -> Iterator[tuple[nn.Sequential, nn.Sequential]]:
    """The same, with a reduce dtype on the root: FSDP2 keeps the root's held-back gradient elsewhere then."""
    yield _reference_and_sharded(MixedPrecisionPolicy(reduce_dtype=torch.float64))


X = torch.randn(5, 3, generator=torch.Generator().manual_seed(1))


def _reference_grads(reference: nn.Module, times: int = 1) -> dict[tuple[int, ...], Tensor]:
    reference.zero_grad(set_to_none=True)
    reference(X).sum().backward()
    return {tuple(p.shape): times * p.grad for p in reference.parameters()}


def _fsdp_params(model: nn.Module) -> list[Any]:
    return [
        p for m in _compat.fsdp2_modules(model) for g in fsdp2._param_groups(m._get_fsdp_state()) for p in g.fsdp_params
    ]


# ---------------------------------------------------------------------------------------------------------------
# finding FSDP2's modules and state: `FSDPModule`, `_get_fsdp_state`, `_fsdp_param_groups`, `fsdp_params`
# ---------------------------------------------------------------------------------------------------------------
def test_the_fsdp2_modules_and_their_state_are_where_compat_expects(sharded):
    reference, model = sharded
    assert fsdp2._fsdp2_module_class() is FSDPModule
    assert _compat.fsdp2_modules(model) == [model, model[0]]  # outermost first
    assert _compat.fsdp2_modules(reference) == [] and _compat.fsdp2_modules(None) == []
    for module in (model, model[0]):
        state = module._get_fsdp_state()
        assert isinstance(state._fsdp_param_groups, list) and len(state._fsdp_param_groups) == 1
        assert fsdp2._param_groups(state) == state._fsdp_param_groups
        assert state._fsdp_param_group is state._fsdp_param_groups[0]  # the name before torch 2.12, same group
    # While sharded, the module's own parameters are FSDP2's sharded ones, named by their root-prefixed names.
    params = _fsdp_params(model)
    assert {id(p.sharded_param) for p in params} == {id(p) for p in model.parameters()}
    assert all(isinstance(p, DTensor) for p in model.parameters())
    model(X).sum().backward()  # the root's lazy initialisation names them
    assert {p._param_fqn for p in params} == {n for n, _ in model.named_parameters()}
    assert not hasattr(model, "no_sync")  # why Lightning's `block_backward_sync` does not hold FSDP2 back


def test_the_param_groups_of_a_state_from_before_torch_2_12_are_read_too():
    group = object()
    assert fsdp2._param_groups(SimpleNamespace(_fsdp_param_group=group)) == [group]
    assert fsdp2._param_groups(SimpleNamespace(_fsdp_param_group=None)) == []


# ---------------------------------------------------------------------------------------------------------------
# the held-back gradient: `reduce_grads`, `_unsharded_param.grad`, `unsharded_accumulated_grad`
# ---------------------------------------------------------------------------------------------------------------
def test_split_modes_fsdp2_policy_finds_the_modules_once_not_at_every_micro_batch(sharded, monkeypatch):
    from lightning_accum.split.sync import FSDP2

    reference, model = sharded
    expected = _reference_grads(reference)
    walks = []
    real = _compat.fsdp2_modules
    for where in (_compat, fsdp2):  # the package's name and the module's own
        monkeypatch.setattr(where, "fsdp2_modules", lambda m: walks.append(m) or real(m))
    policy = FSDP2(SimpleNamespace(model=model, block_backward_sync=contextlib.nullcontext), world_size=2)
    for _ in range(3):  # three micro-batches held back: each accumulates unsharded, none reduce-scatters
        with policy.hold_back():
            assert not any(g.reduce_grads for m in (model, model[0]) for g in m._get_fsdp_state()._fsdp_param_groups)
            (model(X).sum() / 3).backward()
    assert all(g.reduce_grads for m in (model, model[0]) for g in m._get_fsdp_state()._fsdp_param_groups)
    assert walks == [model]  # was a walk over every submodule per micro-batch: 3
    for p in _fsdp_params(model):
        torch.testing.assert_close(p._unsharded_param.grad, expected[tuple(p._unsharded_param.shape)], **FP32)


def test_a_held_back_gradient_lands_where_unsynced_gradients_reads_it(sharded):
    reference, model = sharded
    expected = _reference_grads(reference)
    with _compat.no_fsdp2_gradient_sync(model):
        assert [g.reduce_grads for m in (model, model[0]) for g in m._get_fsdp_state()._fsdp_param_groups] == [
            False
        ] * 2
        model(X).sum().backward()
    assert all(g.reduce_grads for m in (model, model[0]) for g in m._get_fsdp_state()._fsdp_param_groups)
    params = list(model.parameters())
    assert all(p.grad is None for p in params), "held back, the gradient is not on the sharded parameters"
    for p in _fsdp_params(model):  # without a reduce dtype: on the private unsharded parameter
        assert p.unsharded_accumulated_grad is None
        torch.testing.assert_close(p._unsharded_param.grad, expected[tuple(p._unsharded_param.shape)], **FP32)
    held = _compat.unsynced_gradients(model, params)
    assert sorted(tuple(g.shape) for g in held) == sorted(expected)
    assert sorted(_compat.fsdp2_unsynced_state(model)) == sorted(
        f"{n}: unsharded gradient" for n, _ in model.named_parameters()
    )
    # The next synced backward adds the held gradient in, and leaves a `DTensor`, which is no rank's own.
    model(X).sum().backward()
    for p in params:
        assert isinstance(p.grad, DTensor)
        torch.testing.assert_close(p.grad.to_local(), 2 * expected[tuple(p.shape)], **FP32)
    assert _compat.unsynced_gradients(model, params) == [] and _compat.fsdp2_unsynced_state(model) == []


def test_under_a_reduce_dtype_the_held_back_gradient_is_the_accumulated_one(reduce_dtype_sharded):
    reference, model = reduce_dtype_sharded
    expected = _reference_grads(reference)
    with _compat.no_fsdp2_gradient_sync(model):
        model(X).sum().backward()
    root = {id(p) for g in model._get_fsdp_state()._fsdp_param_groups for p in g.fsdp_params}
    for p in _fsdp_params(model):
        if id(p) in root:  # the root's: in the reduce dtype, apart from the unsharded parameter
            assert p.unsharded_accumulated_grad.dtype == torch.float64 and p._unsharded_param.grad is None
    held = _compat.unsynced_gradients(model, list(model.parameters()))
    assert sorted(str(g.dtype) for g in held) == ["torch.float32"] * 2 + ["torch.float64"] * 2
    for grad in held:
        torch.testing.assert_close(grad.float(), expected[tuple(grad.shape)], **FP32)
    model(X).sum().backward()
    for p in model.parameters():
        torch.testing.assert_close(p.grad.to_local(), 2 * expected[tuple(p.shape)], **FP32)


@pytest.mark.parametrize("fixture", ["sharded", "reduce_dtype_sharded"])
def test_a_discarded_held_back_gradient_is_not_added_in(request, fixture):
    reference, model = request.getfixturevalue(fixture)
    expected = _reference_grads(reference)
    with _compat.no_fsdp2_gradient_sync(model):
        model(X).sum().backward()
    _compat.discard_fsdp2_unsharded_grads(model)
    assert (
        _compat.fsdp2_unsynced_state(model) == [] and _compat.unsynced_gradients(model, list(model.parameters())) == []
    )
    model(X).sum().backward()
    for p in model.parameters():
        torch.testing.assert_close(p.grad.to_local(), expected[tuple(p.shape)], **FP32)


# ---------------------------------------------------------------------------------------------------------------
# a backward that raised: `_state_ctx.post_backward_final_callback_queued`
# ---------------------------------------------------------------------------------------------------------------
def _backward_that_raises(model: nn.Sequential) -> None:
    """A backward that fails between the root's pre-backward (which queues the final callback) and its end."""

    def fail(grad: Tensor) -> Tensor:
        raise RuntimeError("an out-of-memory stand-in")

    handle = model[1].register_forward_hook(lambda module, args, output: output.register_hook(fail) and None)
    try:
        with pytest.raises(RuntimeError, match="an out-of-memory stand-in"):
            model(X).sum().backward()
    finally:
        handle.remove()


def _zero_sharded_grads(model: nn.Module) -> list[Tensor]:
    """Zero what an optimizer holds, the sharded parameters, whatever is registered right now; return them."""
    sharded = [p.sharded_param for p in _fsdp_params(model)]
    for p in sharded:
        p.grad = None
    return sharded


def test_a_backward_that_raised_leaves_the_final_callback_flag_set_until_discarded(sharded):
    reference, model = sharded
    model(X).sum().backward()
    context = model._get_fsdp_state()._state_ctx
    assert model[0]._get_fsdp_state()._state_ctx is context  # since lazy initialisation: the root's, for the tree
    assert context.post_backward_final_callback_queued is False  # a backward that ends runs the callback
    _zero_sharded_grads(model)
    _backward_that_raises(model)
    assert context.post_backward_final_callback_queued is True
    _compat.discard_fsdp2_unsharded_grads(model)
    assert context.post_backward_final_callback_queued is False
    sharded_params = _zero_sharded_grads(model)
    model(X).sum().backward()
    assert context.post_backward_final_callback_queued is False  # queued and run again
    assert all(isinstance(p, DTensor) for p in model.parameters())  # the callback resharded the root
    expected = _reference_grads(reference)
    for p in sharded_params:
        torch.testing.assert_close(p.grad.to_local(), expected[tuple(p.shape)], **FP32)


def test_left_set_the_final_callback_flag_keeps_later_backwards_from_queueing_it(sharded):
    # Why `discard_fsdp2_unsharded_grads` clears it: FSDP2 itself never does after a backward that raised.
    _, model = sharded
    _backward_that_raises(model)
    context = model._get_fsdp_state()._state_ctx
    assert context.post_backward_final_callback_queued is True
    model(X).sum().backward()
    assert context.post_backward_final_callback_queued is True
    assert not all(isinstance(p, DTensor) for p in model.parameters())  # nothing resharded the root


# ---------------------------------------------------------------------------------------------------------------
# unsharded for a step: `_auto_reshard_after_forward`, `post_forward_mesh_info`, `reshard_after_backward`
# ---------------------------------------------------------------------------------------------------------------
def _settings(model: nn.Module) -> list[Any]:
    return [
        (
            m._get_fsdp_state()._auto_reshard_after_forward,
            [(g.post_forward_mesh_info, g.reshard_after_backward) for g in m._get_fsdp_state()._fsdp_param_groups],
        )
        for m in _compat.fsdp2_modules(model)
    ]


def test_the_reshard_setters_change_only_what_unsharded_for_step_restores(sharded):
    _, model = sharded
    model(X).sum().backward()  # lazy initialisation sets the root's settings
    restored = {"_auto_reshard_after_forward", "post_forward_mesh_info", "reshard_after_backward"}
    for module in (model, model[0]):
        state = module._get_fsdp_state()
        objects = [state, *state._fsdp_param_groups]
        before = [dict(vars(o)) for o in objects]
        module.set_reshard_after_forward(False, recurse=False)
        module.set_reshard_after_backward(False, recurse=False)
        changed = {
            k for o, old in zip(objects, before, strict=True) for k, v in vars(o).items() if old.get(k, k) is not v
        }
        assert changed <= restored, changed - restored


def test_unsharded_for_step_keeps_the_parameters_unsharded_and_restores_the_settings(sharded):
    reference, model = sharded
    model(X).sum().backward()
    model.zero_grad(set_to_none=True)
    settings = _settings(model)
    seen: list[bool] = []  # before each FSDP2 module's forward: are its parameters unsharded already?
    own = {id(model): model[2], id(model[0]): model[0]}  # a layer whose parameters each FSDP2 module manages
    for m in (model, model[0]):
        m.register_forward_pre_hook(
            lambda module, args: seen.append(not isinstance(own[id(module)].weight, DTensor)), prepend=True
        )
    with _compat.fsdp2_unsharded_for_step(model):
        assert not any(isinstance(p, DTensor) for p in model.parameters())  # all gathered on entry
        with _compat.no_fsdp2_gradient_sync(model):
            model(X).sum().backward()
        assert not any(isinstance(p, DTensor) for p in model.parameters())  # nothing resharded after backward
        # While unsharded, the module's parameters are FSDP2's private ones; `unsynced_gradients` counts each once.
        assert {id(p._unsharded_param) for p in _fsdp_params(model)} == {id(p) for p in model.parameters()}
        assert len(_compat.unsynced_gradients(model, list(model.parameters()))) == 4
        model(X).sum().backward()  # the step's last micro-batch, synced
        assert not any(isinstance(p, DTensor) for p in model.parameters())
    assert seen == [True, True, True, True]  # no forward in the block had anything to gather
    assert all(isinstance(p, DTensor) for p in model.parameters())  # resharded on exit
    assert _settings(model) == settings
    expected = _reference_grads(reference, times=2)
    for p in model.parameters():
        torch.testing.assert_close(p.grad.to_local(), expected[tuple(p.shape)], **FP32)


def test_unsharded_for_step_restores_the_settings_on_error(sharded):
    _, model = sharded
    model(X).sum().backward()
    settings = _settings(model)
    with pytest.raises(RuntimeError, match="an out-of-memory stand-in"), _compat.fsdp2_unsharded_for_step(model):
        raise RuntimeError("an out-of-memory stand-in")
    assert _settings(model) == settings and all(isinstance(p, DTensor) for p in model.parameters())


# ---------------------------------------------------------------------------------------------------------------
# Lightning's blocking under `ModelParallelStrategy`: `ParallelStrategy.block_backward_sync`
# ---------------------------------------------------------------------------------------------------------------
def test_the_strategys_blocking_holds_fsdp2_back_only_once_patched(sharded):
    _, model = sharded
    strategy = fsdp2_strategy()
    strategy.model = model
    with _block_parallel_sync_behavior(strategy, block=True):
        model(X).sum().backward()
    assert all(isinstance(p.grad, DTensor) for p in model.parameters())  # Lightning's own blocking: synced anyway
    model.zero_grad(set_to_none=True)
    undo = _compat.block_fsdp2_backward_sync(strategy)
    with _block_parallel_sync_behavior(strategy, block=True):
        model(X).sum().backward()
    assert all(p.grad is None for p in model.parameters()) and _compat.fsdp2_unsynced_state(model)
    undo()
    assert "block_backward_sync" not in vars(strategy)
    assert _compat.block_fsdp2_backward_sync(SimpleNamespace(model=nn.Linear(2, 2)))() is None  # no FSDP2: left alone


# ---------------------------------------------------------------------------------------------------------------
# a plain copy: the `FSDP<Class>` wrapper, FSDP2's forward hooks, `__composable_api_state_key*`
# ---------------------------------------------------------------------------------------------------------------
def test_what_fully_shard_adds_to_a_module_is_what_fsdp2_unwrapped_takes_away(sharded):
    reference, model = sharded
    unit = model[0]
    user_hook = unit.register_forward_hook(lambda module, args, output: None)
    with pytest.raises(AssertionError, match="FSDP does not support deepcopy"):
        copy.deepcopy(unit)  # why the pre-flight builds its copy from `fsdp2_unwrapped`
    assert type(unit).__bases__ == (FSDPModule, nn.Linear)
    assert any(key.startswith(fsdp2._COMPOSABLE_STATE_PREFIX) for key in vars(unit))
    hooks = [*unit._forward_pre_hooks.values(), *unit._forward_hooks.values()]
    assert sum(fsdp2._is_fsdp2_hook(h) for h in hooks) == 2  # FSDPState's `_pre_forward` and `_post_forward`
    cls, state = _compat.fsdp2_unwrapped(unit)
    assert cls is nn.Linear
    assert not any(key.startswith(fsdp2._COMPOSABLE_STATE_PREFIX) for key in state)
    assert list(state["_forward_hooks"]) == [user_hook.id] and not state["_forward_pre_hooks"]
    with _compat.fsdp2_unsharded_for_step(model):  # a copy of the gathered layer computes as the plain layer does
        cls, state = _compat.fsdp2_unwrapped(unit)
        plain = cls.__new__(cls)
        plain.__setstate__(state)
        torch.testing.assert_close(plain(X), reference[0](X), **FP32)
