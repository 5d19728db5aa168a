"""FSDP2 (``fully_shard``, under Lightning's ``ModelParallelStrategy``): its gradient sync, unsharded state and wrapper.

Upstream (torch 2.4 to 2.13, read on 2.13; ``FSDPModule`` moved to ``torch.distributed.fsdp`` in 2.6, and a state
holds several parameter groups, ``_fsdp_param_groups``, from 2.12):

- ``torch/distributed/fsdp/_fully_shard/_fully_shard.py``: ``FSDPModule`` (``_get_fsdp_state``,
  ``set_requires_gradient_sync``, ``set_reshard_after_forward``, ``set_reshard_after_backward``, ``unshard``,
  ``reshard``);
- ``_fsdp_state.py``: ``FSDPState._fsdp_param_groups`` (``_fsdp_param_group`` before 2.12),
  ``_auto_reshard_after_forward``, ``_state_ctx.post_backward_final_callback_queued``, and the forward hooks that
  ``FSDPState.init`` registers as its own methods;
- ``_fsdp_param_group.py``: ``FSDPParamGroup.fsdp_params``, ``reduce_grads``, ``reshard_after_backward``,
  ``post_forward_mesh_info`` and ``post_backward`` (where a held-back gradient is kept);
- ``_fsdp_param.py``: ``FSDPParam.sharded_param``, ``_unsharded_param``, ``unsharded_accumulated_grad``,
  ``_param_fqn``;
- ``_fsdp_init.py`` and ``torch/distributed/_composable/contract.py``: the ``FSDP<Class>`` wrapper class and the
  module state kept under ``__composable_api_state_key*`` keys;
- ``lightning/pytorch/strategies/parallel.py`` (lightning 2.2 to 2.6): ``ParallelStrategy.block_backward_sync``,
  which enters ``model.no_sync()`` only for a model that has one (FSDP2 modules don't).

``tests/compat/test_fsdp2.py`` fails if torch renames or changes any of these, on a real ``fully_shard``-ed module.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
from torch import Tensor, nn

# ---------------------------------------------------------------------------------------------------------------
# Finding FSDP2's modules and state
# ---------------------------------------------------------------------------------------------------------------


def _fsdp2_module_class() -> type | None:
    for home in ("torch.distributed.fsdp", "torch.distributed._composable.fsdp"):  # torch >= 2.6; torch 2.4, 2.5
        try:
            fsdp_module: type = importlib.import_module(home).FSDPModule
        except (ImportError, AttributeError):
            continue
        return fsdp_module
    return None


def fsdp2_modules(module: Any) -> list[Any]:
    """The FSDP2 modules (``fully_shard``-ed) inside ``module``, outermost first; empty without FSDP2."""
    fsdp_module = _fsdp2_module_class()
    if fsdp_module is None or not isinstance(module, torch.nn.Module):
        return []
    return [m for m in module.modules() if isinstance(m, fsdp_module)]


def _param_groups(state: Any) -> list[Any]:
    groups = getattr(state, "_fsdp_param_groups", None)  # torch >= 2.12: several per module
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [] if group is None else [group]
    return list(groups)


def _is_dtensor(tensor: Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch < 2.4
        return False
    return isinstance(tensor, DTensor)


# ---------------------------------------------------------------------------------------------------------------
# A plain copy of a sharded module (the pre-flight's fake copy)
# ---------------------------------------------------------------------------------------------------------------
# `fully_shard` swaps a module's class for `FSDP<Class>(FSDPModule, Class)`, whose `__deepcopy__` raises
# (`_apply_to_module` in `fsdp/_fully_shard/_fsdp_init.py`); it registers the module's forward hooks as methods of its
# `FSDPState` (`FSDPState.init`, `_register_group_forward_hooks` in `_fsdp_state.py`) and keeps that state in the
# module's `__dict__` under keys from `generate_state_key` (`_composable/contract.py`): torch 2.6 to 2.13.
# `tests/test_fsdp2_preflight.py` traces a sharded model and fails if this stops holding.
_COMPOSABLE_STATE_PREFIX = "__composable_api_state_key"


def fsdp2_unwrapped(module: Any) -> tuple[type[nn.Module], dict[str, Any]]:
    """The class ``fully_shard`` wrapped in ``module``'s, and ``module``'s state without FSDP2's hooks and state.

    What a plain copy of one FSDP2 module is made of: the pre-flight's fake copy of a sharded model runs it without
    FSDP2 (no all-gather, no reduce-scatter). The state is the one ``__getstate__`` gives (a LightningModule's drops
    its Trainer); the values are the module's own, not copies.
    """
    wrapper = type(module)
    fsdp_module = _fsdp2_module_class()
    cls = next((c for c in wrapper.__bases__ if fsdp_module is None or not issubclass(c, fsdp_module)), wrapper)
    # The class's own `__getstate__`, called with the instance (a LightningModule's drops its Trainer); seen as a
    # `type`, mypy would take `cls.__getstate__` for object's, bound to the class.
    unwrapped: Any = cls
    state = dict(unwrapped.__getstate__(module))
    hook_dicts = {n: v for n, v in state.items() if n.startswith("_") and "hooks" in n and isinstance(v, dict)}
    fsdp_hooks = {key for hooks in hook_dicts.values() for key, hook in hooks.items() if _is_fsdp2_hook(hook)}
    plain: dict[str, Any] = {}
    for name, value in state.items():
        if name.startswith(_COMPOSABLE_STATE_PREFIX):
            continue
        if name in hook_dicts:  # the `*_with_kwargs` and `*_always_called` dicts are keyed by the same handle ids
            value = type(value)((key, hook) for key, hook in value.items() if key not in fsdp_hooks)
        plain[name] = value
    # `fully_shard` made the wrapper class from (FSDPModule, the module's class): `cls` is that nn.Module class.
    return cast(type[nn.Module], cls), plain


def _is_fsdp2_hook(hook: Any) -> bool:
    return callable(hook) and str(getattr(hook, "__module__", "")).startswith("torch.distributed.fsdp")


# ---------------------------------------------------------------------------------------------------------------
# Holding back the gradient sync
# ---------------------------------------------------------------------------------------------------------------
# Lightning wraps every micro-batch but a window's last in `strategy.block_backward_sync()`
# (`_block_parallel_sync_behavior` in `loops/utilities.py`, called from `_AutomaticOptimization._run_optimization`).
# `ParallelStrategy.block_backward_sync` (`strategies/parallel.py`) enters `self.model.no_sync()` only when the model
# matches the `DistributedDataParallel` protocol, i.e. has `no_sync`: DDP and FSDP1 do, FSDP2 modules don't, so under
# `ModelParallelStrategy` every micro-batch reduce-scatters. Fabric's `ModelParallelStrategy` blocks it with
# `FSDPModule.set_requires_gradient_sync(False)` (`_FSDPNoSync` in `fabric/strategies/model_parallel.py`); window mode
# does the same for the Trainer. `tests/test_fsdp2.py` counts the reduce-scatters and fails if this stops holding.


@contextlib.contextmanager
def no_fsdp2_gradient_sync(module: Any, modules: list[Any] | None = None) -> Iterator[None]:
    """Hold back FSDP2's gradient reduce-scatter for the backward passes inside the block (FSDP1's ``no_sync``).

    Each FSDP2 module then accumulates its gradients unsharded, as large as its unsharded parameters, and the next
    backward outside the block reduce-scatters the sum once. The modules sync again when the block ends, also on
    error. Does nothing when ``module`` holds no FSDP2 module. ``modules``: ``fsdp2_modules(module)``, when the
    caller found them once (a walk over every submodule, per micro-batch otherwise).
    """
    with _gradient_sync_off(fsdp2_modules(module) if modules is None else modules):
        yield


@contextlib.contextmanager
def _gradient_sync_off(modules: list[Any]) -> Iterator[None]:
    for m in modules:
        m.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        for m in modules:
            m.set_requires_gradient_sync(True, recurse=False)


def block_fsdp2_backward_sync(strategy: Any) -> Callable[[], None]:
    """Make ``strategy.block_backward_sync()`` hold back FSDP2's reduce-scatter as well as DDP's all-reduce.

    Window mode's default under ``ModelParallelStrategy``: one reduce-scatter per FSDP2 module per optimizer step
    instead of one per micro-batch. Call it once the model is sharded (``configure_model`` has run, e.g. in
    ``on_train_start``); without FSDP2 modules the strategy is left alone. The strategy's own blocking still runs
    inside. Returns a function that undoes it.
    """
    modules = fsdp2_modules(getattr(strategy, "model", None))
    original = getattr(strategy, "block_backward_sync", None)
    if not modules or not callable(original):
        return lambda: None

    @contextlib.contextmanager
    def block_backward_sync() -> Iterator[None]:
        with _gradient_sync_off(modules), original():
            yield

    strategy.block_backward_sync = block_backward_sync
    return lambda: strategy.__dict__.pop("block_backward_sync", None)


# ---------------------------------------------------------------------------------------------------------------
# The gradients FSDP2 holds back
# ---------------------------------------------------------------------------------------------------------------
# Under `set_requires_gradient_sync(False)`, FSDP2's post-backward keeps each gradient unsharded on the module's
# private unsharded parameter (`FSDPParam._unsharded_param.grad`, or `unsharded_accumulated_grad` with a reduce dtype:
# `FSDPParamGroup.post_backward` in `fsdp/_fully_shard/_fsdp_param_group.py`, torch 2.4 to 2.13), and the next synced
# backward adds it in. The optimizer's `zero_grad` only reaches the sharded `DTensor` parameters. The root's
# "final callback queued" flag (`FSDPState._state_ctx`, `_fsdp_state.py`) stays set when a backward raised before
# the callback ran, and would keep every later backward from queueing it.
def discard_fsdp2_unsharded_grads(module: Any) -> None:
    """Drop the unsharded gradients FSDP2 accumulated without syncing, as an abandoned split-mode attempt must.

    Does nothing when ``module`` holds no FSDP2 module.
    """
    for fsdp_module in fsdp2_modules(module):
        state = fsdp_module._get_fsdp_state()
        for fsdp_param in (p for group in _param_groups(state) for p in group.fsdp_params):
            fsdp_param.unsharded_accumulated_grad = None
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            if unsharded is not None:
                unsharded.grad = None
        context = getattr(state, "_state_ctx", None)
        if context is not None and hasattr(context, "post_backward_final_callback_queued"):
            context.post_backward_final_callback_queued = False


def unsynced_gradients(module: Any, parameters: list[Tensor]) -> list[Tensor]:
    """The gradients this rank holds of ``parameters`` for its own micro-batches since the last sync.

    That is each parameter's ``.grad``, except where FSDP2 holds the sync back: the gradient then sits unsharded on
    FSDP2's private parameter (``_unsharded_param.grad``, or ``unsharded_accumulated_grad`` under a reduce dtype,
    see above), and the sharded parameter's ``.grad`` stays ``None``. A ``.grad`` that is a ``DTensor`` is already
    reduce-scattered over the ranks, not this rank's own, and is left out. The gradient noise scale reads this after
    a window's first micro-batch. ``parameters`` may be the sharded ones (an optimizer's) or, while FSDP2 keeps them
    unsharded for a split-mode step, the unsharded ones.
    """
    wanted = {id(p) for p in parameters}
    held: list[Tensor] = []
    for fsdp_module in fsdp2_modules(module):
        for fsdp_param in (p for group in _param_groups(fsdp_module._get_fsdp_state()) for p in group.fsdp_params):
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            if id(fsdp_param.sharded_param) not in wanted and id(unsharded) not in wanted:
                continue
            grad = fsdp_param.unsharded_accumulated_grad
            if grad is None and unsharded is not None:
                grad = unsharded.grad
            if grad is not None:
                held.append(grad)
    seen = {id(g) for g in held}  # while unsharded, FSDP2's private parameters are the module's own
    plain = [p.grad for p in parameters if p.grad is not None and id(p.grad) not in seen and not _is_dtensor(p.grad)]
    return plain + held


def fsdp2_unsharded_params(module: Any) -> list[Tensor]:
    """FSDP2's unsharded parameters in ``module`` (``FSDPParam._unsharded_param``, once it was unsharded).

    While a split-mode step keeps the modules unsharded they are the module's own parameters, and autograd adds each
    backward's gradients to them; empty without FSDP2.
    """
    found = (
        getattr(fsdp_param, "_unsharded_param", None)
        for fsdp_module in fsdp2_modules(module)
        for group in _param_groups(fsdp_module._get_fsdp_state())
        for fsdp_param in group.fsdp_params
    )
    return [p for p in found if p is not None]


def fsdp2_unsynced_state(module: Any) -> list[str]:
    """What FSDP2 holds back in ``module`` right now: modules with gradient sync off, unsharded gradients left over.

    Empty when its state is clean (as between two optimizer steps); for tests and assertions.
    """
    found: list[str] = []
    for group in (g for m in fsdp2_modules(module) for g in _param_groups(m._get_fsdp_state())):
        if not group.reduce_grads:
            found.append("a module with gradient sync off")
        for fsdp_param in group.fsdp_params:
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            if fsdp_param.unsharded_accumulated_grad is not None or (
                unsharded is not None and unsharded.grad is not None
            ):
                found.append(f"{fsdp_param._param_fqn}: unsharded gradient")
    return found


# ---------------------------------------------------------------------------------------------------------------
# Keeping the parameters unsharded for a split-mode step
# ---------------------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def fsdp2_unsharded_for_step(module: Any) -> Iterator[None]:
    """Gather every FSDP2 module's parameters once, on entry, and keep them unsharded until the block ends.

    Inside the block the forwards and backwards all-gather nothing, so a rank that fails in one of them leaves no
    other rank waiting in an all-gather: the only collective left is the reduce-scatter of a synced backward. Costs
    the memory of the unsharded parameters for the block (FSDP2's ``reshard_after_forward=False``,
    ``set_reshard_after_backward(False)``). On exit, also on error, the parameters are resharded (no collective) and
    the modules' reshard settings restored. Does nothing when ``module`` holds no FSDP2 module.
    """
    modules = fsdp2_modules(module)
    saved: list[tuple[Any, bool | None, list[tuple[Any, bool]]]] = []
    for m in modules:
        state = m._get_fsdp_state()
        groups = _param_groups(state)
        saved.append(
            (
                state,
                getattr(state, "_auto_reshard_after_forward", None),
                [(g.post_forward_mesh_info, g.reshard_after_backward) for g in groups],
            )
        )
        m.set_reshard_after_forward(False, recurse=False)
        m.set_reshard_after_backward(False, recurse=False)
    try:
        for m in modules:
            m.unshard()  # all-gathers, on every rank alike, before anything in the block can fail
        yield
    finally:
        for m, (state, auto, settings) in zip(modules, saved, strict=True):
            m.reshard()
            if auto is not None:
                state._auto_reshard_after_forward = auto
            for g, (mesh_info, after_backward) in zip(_param_groups(state), settings, strict=True):
                g.post_forward_mesh_info = mesh_info
                g.reshard_after_backward = after_backward
