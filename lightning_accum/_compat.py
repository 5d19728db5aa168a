"""The one place that touches Lightning internals.

Lightning decides the accumulation window with modular arithmetic on its own counters
(``lightning/pytorch/loops/training_epoch_loop.py``, ``_TrainingEpochLoop._accumulated_batches_reached``:
``batch_progress.current.ready % trainer.accumulate_grad_batches == 0``) and zeroes gradients when
``batch_idx % trainer.accumulate_grad_batches == 0`` (``loops/optimization/automatic.py``,
``_AutomaticOptimization._make_zero_grad_fn``). Both are wrong as soon as ``k`` changes mid-epoch. Window mode
therefore replaces these two decisions, on the trainer's own loop instances only, with the callback's window plan.
Everything else (the final-batch step, DDP's ``no_sync``, LR schedulers, ``global_step``) keeps flowing through
Lightning's ``_should_accumulate``, which calls the first of them.

``tests/test_compat.py`` fails if Lightning renames or changes either method.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import lightning
import lightning.pytorch as pl
import torch
from lightning_utilities.core.imports import RequirementCache
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

SUPPORTED_LIGHTNING = ">=2.2,<2.7"
_LIGHTNING_OK = bool(RequirementCache(f"lightning{SUPPORTED_LIGHTNING}"))


def _check_version() -> None:
    if not _LIGHTNING_OK:
        raise RuntimeError(
            f"lightning_accum supports lightning{SUPPORTED_LIGHTNING}, found {lightning.__version__}."
            " Install a supported version, e.g. `pip install 'lightning>=2.2,<2.7'`."
        )


def install_window_control(
    trainer: pl.Trainer, window_complete: Callable[[], bool], window_start: Callable[[], bool]
) -> Callable[[], None]:
    """Let the callback decide where windows end and start. Returns a function that undoes it.

    Args:
        trainer: the trainer whose fit loop is patched (instance attributes only; the classes are untouched).
        window_complete: ``True`` when the current micro-batch is the last of its window (the epoch's last batch
            always steps, as in Lightning).
        window_start: ``True`` when the current micro-batch is the first of its window (gradients are zeroed).
    """
    _check_version()
    epoch_loop = trainer.fit_loop.epoch_loop
    automatic = epoch_loop.automatic_optimization
    for owner, name in ((epoch_loop, "_accumulated_batches_reached"), (automatic, "_make_zero_grad_fn")):
        if not callable(getattr(owner, name, None)):
            raise RuntimeError(
                f"lightning {lightning.__version__} has no `{type(owner).__name__}.{name}`, which window mode"
                f" replaces. Use lightning{SUPPORTED_LIGHTNING}."
            )
    original_make_zero_grad_fn = automatic._make_zero_grad_fn

    def _make_zero_grad_fn(batch_idx: int, optimizer: Optimizer) -> Callable[[], None] | None:
        if not window_start():
            return None
        # Lightning's own builder, told this batch is a window start (k=1 makes `batch_idx % k == 0` true). It keeps
        # Lightning's hooks (`on_before_zero_grad`, `optimizer_zero_grad`) and its skip-backward handling.
        with _attribute(trainer, "accumulate_grad_batches", 1):
            return original_make_zero_grad_fn(batch_idx, optimizer)

    epoch_loop._accumulated_batches_reached = window_complete  # type: ignore[method-assign]
    automatic._make_zero_grad_fn = _make_zero_grad_fn  # type: ignore[method-assign]

    def uninstall() -> None:
        for owner, name in ((epoch_loop, "_accumulated_batches_reached"), (automatic, "_make_zero_grad_fn")):
            owner.__dict__.pop(name, None)

    return uninstall


def disable_backward_sync_blocking(strategy: Any) -> Callable[[], None]:
    """Make ``strategy.block_backward_sync()`` a no-op, so every micro-batch syncs (FSDP's memory-saving choice).

    Returns a function that undoes it.
    """
    if not hasattr(strategy, "block_backward_sync"):
        return lambda: None
    strategy.block_backward_sync = contextlib.nullcontext
    return lambda: strategy.__dict__.pop("block_backward_sync", None)


# ---------------------------------------------------------------------------------------------------------------
# FSDP2 (``fully_shard`` under ``ModelParallelStrategy``)
# ---------------------------------------------------------------------------------------------------------------
# Lightning wraps every micro-batch but a window's last in `strategy.block_backward_sync()`
# (`_block_parallel_sync_behavior` in `loops/utilities.py`, called from `_AutomaticOptimization._run_optimization`).
# `ParallelStrategy.block_backward_sync` (`strategies/parallel.py`) enters `self.model.no_sync()` only when the model
# matches the `DistributedDataParallel` protocol, i.e. has `no_sync`: DDP and FSDP1 do, FSDP2 modules don't, so under
# `ModelParallelStrategy` every micro-batch reduce-scatters. Fabric's `ModelParallelStrategy` blocks it with
# `FSDPModule.set_requires_gradient_sync(False)` (`_FSDPNoSync` in `fabric/strategies/model_parallel.py`); window mode
# does the same for the Trainer. `tests/test_fsdp2.py` counts the reduce-scatters and fails if this stops holding.


def _fsdp2_module_class() -> type | None:
    try:
        from torch.distributed.fsdp import FSDPModule  # torch >= 2.6
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import FSDPModule  # type: ignore[no-redef]  # torch 2.4, 2.5
        except ImportError:
            return None
    return FSDPModule


def fsdp2_modules(module: Any) -> list[Any]:
    """The FSDP2 modules (``fully_shard``-ed) inside ``module``, outermost first; empty without FSDP2."""
    fsdp_module = _fsdp2_module_class()
    if fsdp_module is None or not isinstance(module, torch.nn.Module):
        return []
    return [m for m in module.modules() if isinstance(m, fsdp_module)]


# `fully_shard` swaps a module's class for `FSDP<Class>(FSDPModule, Class)`, whose `__deepcopy__` raises
# (`_apply_to_module` in `fsdp/_fully_shard/_fsdp_init.py`); it registers the module's forward hooks as methods of its
# `FSDPState` (`FSDPState.init`, `_register_group_forward_hooks` in `_fsdp_state.py`) and keeps that state in the
# module's `__dict__` under keys from `generate_state_key` (`_composable/contract.py`): torch 2.6 to 2.13.
# `tests/test_fsdp2_preflight.py` traces a sharded model and fails if this stops holding.
_COMPOSABLE_STATE_PREFIX = "__composable_api_state_key"


def fsdp2_unwrapped(module: Any) -> tuple[type, dict[str, Any]]:
    """The class ``fully_shard`` wrapped in ``module``'s, and ``module``'s state without FSDP2's hooks and state.

    What a plain copy of one FSDP2 module is made of: the pre-flight's fake copy of a sharded model runs it without
    FSDP2 (no all-gather, no reduce-scatter). The state is the one ``__getstate__`` gives (a LightningModule's drops
    its Trainer); the values are the module's own, not copies.
    """
    wrapper = type(module)
    fsdp_module = _fsdp2_module_class()
    cls = next((c for c in wrapper.__bases__ if fsdp_module is None or not issubclass(c, fsdp_module)), wrapper)
    state = dict(cls.__getstate__(module))
    hook_dicts = {n: v for n, v in state.items() if n.startswith("_") and "hooks" in n and isinstance(v, dict)}
    fsdp_hooks = {key for hooks in hook_dicts.values() for key, hook in hooks.items() if _is_fsdp2_hook(hook)}
    plain = {}
    for name, value in state.items():
        if name.startswith(_COMPOSABLE_STATE_PREFIX):
            continue
        if name in hook_dicts:  # the `*_with_kwargs` and `*_always_called` dicts are keyed by the same handle ids
            value = type(value)((key, hook) for key, hook in value.items() if key not in fsdp_hooks)
        plain[name] = value
    return cls, plain


def _is_fsdp2_hook(hook: Any) -> bool:
    return callable(hook) and str(getattr(hook, "__module__", "")).startswith("torch.distributed.fsdp")


@contextlib.contextmanager
def no_fsdp2_gradient_sync(module: Any) -> Iterator[None]:
    """Hold back FSDP2's gradient reduce-scatter for the backward passes inside the block (FSDP1's ``no_sync``).

    Each FSDP2 module then accumulates its gradients unsharded, as large as its unsharded parameters, and the next
    backward outside the block reduce-scatters the sum once. The modules sync again when the block ends, also on
    error. Does nothing when ``module`` holds no FSDP2 module.
    """
    with _gradient_sync_off(fsdp2_modules(module)):
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


def _is_dtensor(tensor: Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch < 2.4
        return False
    return isinstance(tensor, DTensor)


def fsdp2_unsynced_state(module: Any) -> list[str]:
    """What FSDP2 holds back in ``module`` right now: modules with gradient sync off, unsharded gradients left over.

    Empty when its state is clean (as between two optimizer steps); for tests and assertions.
    """
    found = []
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


@contextlib.contextmanager
def _attribute(obj: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def is_last_training_batch(trainer: pl.Trainer) -> bool:
    """Whether the batch being processed is the epoch's last, as Lightning's own step decision sees it.

    That is ``_TrainingEpochLoop._num_ready_batches_reached``: the last batch of the data, or of
    ``limit_train_batches``.
    """
    epoch_loop = trainer.fit_loop.epoch_loop
    if not callable(getattr(epoch_loop, "_num_ready_batches_reached", None)):
        raise RuntimeError(
            f"lightning {lightning.__version__} has no `_TrainingEpochLoop._num_ready_batches_reached`, which"
            f" lightning_accum uses to find the epoch's last batch. Use lightning{SUPPORTED_LIGHTNING}."
        )
    return bool(epoch_loop._num_ready_batches_reached())


def lightning_loss_divisor(trainer: pl.Trainer) -> int:
    """What Lightning divided the ``training_step`` loss by before its backward and the ``outputs`` hooks.

    ``ClosureResult.from_training_step_output(..., normalize=trainer.accumulate_grad_batches)`` in
    ``loops/optimization/automatic.py`` divides the closure loss by ``k`` under automatic optimization. Window mode
    replaces that factor by the exact window weight, and the window loss multiplies it back.
    """
    return int(trainer.accumulate_grad_batches)


def gradient_scale(trainer: pl.Trainer) -> float:
    """The factor 16-bit mixed precision multiplies the gradients by until the optimizer step unscales them (else 1).

    ``MixedPrecision.scaler`` (``plugins/precision/amp.py``) is a ``torch.amp.GradScaler``; reading its scale syncs
    the device, so it is read only where a gradient norm is read anyway.
    """
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if scaler is None or not scaler.is_enabled():
        return 1.0
    return float(scaler.get_scale())


def set_callback_metrics(trainer: pl.Trainer, metrics: dict[str, float | Tensor]) -> None:
    """Make ``metrics`` part of ``trainer.callback_metrics``, where ModelCheckpoint and EarlyStopping look.

    ``self.log(..., logger=False)`` does the same but costs about 2 ms per key from a callback hook (each key is a
    ``_ResultMetric`` update); the property returns the connector's own dict
    (``_LoggerConnector.callback_metrics`` in ``trainer/connectors/logger_connector/logger_connector.py``), which
    keeps what is put into it until the next stage resets it. A tensor goes in as it is (no host read).
    """
    trainer.callback_metrics.update(
        {key: value if isinstance(value, Tensor) else torch.tensor(float(value)) for key, value in metrics.items()}
    )


def checkpoint_step_schedule(checkpoint: Any) -> tuple[int, bool]:
    """A ``ModelCheckpoint``'s ``every_n_train_steps`` (0: not by steps) and whether it also saves by training time.

    Lightning keeps both only as private attributes (``ModelCheckpoint._every_n_train_steps`` and
    ``_train_time_interval`` in ``callbacks/model_checkpoint.py``); ``tests/callbacks/test_monitor.py`` fails if
    they go.
    """
    every = getattr(checkpoint, "_every_n_train_steps", 0)
    return (every if isinstance(every, int) else 0), getattr(checkpoint, "_train_time_interval", None) is not None


def set_progress_bar_metrics(trainer: pl.Trainer, metrics: dict[str, float | int | str]) -> None:
    """Show ``metrics`` in Lightning's progress bar (TQDM or Rich), as ``self.log(..., prog_bar=True)`` would.

    Both bars read ``trainer.progress_bar_metrics`` (``ProgressBar.get_metrics``), which returns the connector's own
    dict (``_LoggerConnector.progress_bar_metrics``); updating it costs nothing per step, unlike ``self.log``.
    """
    trainer.progress_bar_metrics.update(metrics)


def logging_step(trainer: pl.Trainer) -> int:
    """The step Lightning's loggers file the current optimizer step under (the first step is 0).

    ``self.log``, ``LearningRateMonitor`` and ``ThroughputMonitor`` all use
    ``_TrainingEpochLoop._batches_that_stepped``, which is incremented in ``on_advance_end``, after the batch's
    ``on_train_batch_end`` hooks, whereas ``trainer.global_step`` already counts the step at that point.
    """
    epoch_loop = trainer.fit_loop.epoch_loop
    if not isinstance(getattr(epoch_loop, "_batches_that_stepped", None), int):
        raise RuntimeError(
            f"lightning {lightning.__version__} has no `_TrainingEpochLoop._batches_that_stepped`, which"
            f" `AccumulationMonitor` logs against. Use lightning{SUPPORTED_LIGHTNING}."
        )
    return epoch_loop._batches_that_stepped


def override_estimated_stepping_batches(trainer: pl.Trainer, estimate: Callable[[int], Any]) -> Callable[[], None]:
    """Make ``trainer.estimated_stepping_batches`` return ``estimate(num_training_batches)``. Returns the undo.

    Lightning computes it as ``ceil(batches / accumulate_grad_batches) * max_epochs``
    (``Trainer.estimated_stepping_batches`` in ``trainer/trainer.py``), with the ``k`` the Trainer holds before the
    first batch, so it ignores a ``k`` set by a callback or a schedule. The property lives on the class, so the
    instance gets a subclass of its own class that overrides it; other Trainers are untouched. Lightning's own
    property still runs first: it loads the train dataloader when nobody has yet, and answers for infinite runs.
    """
    original_class = type(trainer)
    original_property = original_class.estimated_stepping_batches

    def estimated_stepping_batches(self: pl.Trainer) -> int | float:
        lightning_estimate = original_property.fget(self)  # type: ignore[attr-defined]
        total_batches = self.num_training_batches
        if self.max_epochs == -1 or total_batches == float("inf"):
            return lightning_estimate
        return estimate(int(total_batches))

    patched = type(original_class.__name__, (original_class,), {})
    patched.estimated_stepping_batches = property(estimated_stepping_batches, doc=original_property.__doc__)
    patched.__module__ = original_class.__module__
    patched.__qualname__ = original_class.__qualname__
    trainer.__class__ = patched

    def undo() -> None:
        if type(trainer) is patched:
            trainer.__class__ = original_class

    return undo


# ---------------------------------------------------------------------------------------------------------------
# Split mode: the closure of one optimizer step
# ---------------------------------------------------------------------------------------------------------------
# Lightning's automatic closure runs `training_step`, then `zero_grad`, then `backward` (`Closure.closure` in
# `loops/optimization/automatic.py`), so passes made from inside `training_step` would be zeroed. Split mode therefore
# builds the whole closure itself: Lightning's own pieces (`_training_step` through the strategy, so DDP's forward and
# autocast apply; `_make_backward_fn`; `_make_zero_grad_fn`) are called in the order split mode needs. The optimizer
# step, `on_before_optimizer_step`, clipping and GradScaler stay Lightning's.


@dataclass
class SplitStepContext:
    """Lightning's pieces of one automatic-optimization step, for a split-mode runner to call in its own order."""

    batch: Any
    batch_idx: int
    optimizer: Optimizer
    training_step: Callable[[Any], tuple[Any, dict[str, Any]]]
    """Runs the user's ``training_step`` on a micro-batch via the strategy; returns its ``(loss, extra outputs)``.

    The loss is the user's own (Lightning divides it by ``accumulate_grad_batches``, which split mode keeps at 1);
    ``None`` when ``training_step`` returned ``None``."""
    backward: Callable[[Any], None] | None
    """Back-propagates a loss through the strategy (precision scaling, ``on_before_backward``); None to skip."""
    zero_grad: Callable[[], None]
    """Zeroes the gradients through Lightning's ``optimizer_zero_grad`` hook."""
    make_result: Callable[[Any, dict[str, Any]], Any]
    """Builds the ClosureResult Lightning expects from a detached loss and extra outputs."""


def install_split_closure(trainer: pl.Trainer, run_step: Callable[[SplitStepContext], Any]) -> Callable[[], None]:
    """Make every automatic-optimization step call ``run_step`` as its closure. Returns a function that undoes it."""
    _check_version()
    from lightning.pytorch.loops.optimization.automatic import Closure, ClosureResult

    automatic = trainer.fit_loop.epoch_loop.automatic_optimization
    for name in ("_make_closure", "_training_step", "_make_backward_fn", "_make_zero_grad_fn"):
        if not callable(getattr(automatic, name, None)):
            raise RuntimeError(
                f"lightning {lightning.__version__} has no `_AutomaticOptimization.{name}`, which split mode uses."
                f" Use lightning{SUPPORTED_LIGHTNING}."
            )

    def _make_closure(kwargs: OrderedDict, optimizer: Optimizer, batch_idx: int) -> Closure:
        def zero_grad() -> None:
            with _attribute(trainer, "accumulate_grad_batches", 1):
                fn = automatic._make_zero_grad_fn(batch_idx, optimizer)
            if fn is not None:
                fn()

        def training_step(micro_batch: Any) -> tuple[Any, dict[str, Any]]:
            micro_kwargs = OrderedDict(kwargs)
            micro_kwargs["batch"] = micro_batch
            result = automatic._training_step(micro_kwargs)
            return result.closure_loss, result.extra

        context = SplitStepContext(
            batch=kwargs["batch"],
            batch_idx=batch_idx,
            optimizer=optimizer,
            training_step=training_step,
            backward=automatic._make_backward_fn(optimizer),
            zero_grad=zero_grad,
            make_result=lambda loss, extra: ClosureResult(loss, extra=extra),
        )
        return Closure(step_fn=lambda: run_step(context), backward_fn=None, zero_grad_fn=None)

    automatic._make_closure = _make_closure  # type: ignore[method-assign]
    return lambda: automatic.__dict__.pop("_make_closure", None)


def process_group_timeout(strategy: Any) -> timedelta | None:
    """The timeout the strategy gives its process group (``DDPStrategy(timeout=)``, ``ModelParallelStrategy``'s)."""
    timeout = getattr(strategy, "_timeout", None)
    return timeout if isinstance(timeout, timedelta) else None


def ddp_process_group(strategy: Any) -> Any:
    """The process group DDP reduces gradients over (the default group when the strategy doesn't say)."""
    return getattr(getattr(strategy, "model", None), "process_group", None)


@contextlib.contextmanager
def hook_context(module: pl.LightningModule, name: str | None = None) -> Iterator[None]:
    """Run as if inside the hook ``name`` (``None``: keep the current one), and restore it afterwards, also on error.

    ``LightningModule._current_fx_name`` is what ``trainer/call.py`` sets around every hook, without a
    ``try/finally``: an exception inside a hook (an OOM in ``backward``) leaves it pointing at that hook, and later
    ``self.log`` calls would be filed under it.
    """
    previous = getattr(module, "_current_fx_name", None)
    module._current_fx_name = previous if name is None else name
    try:
        yield
    finally:
        module._current_fx_name = previous


# ---------------------------------------------------------------------------------------------------------------
# Split mode under DDP: torch's reducer, driven by hand (``torch/nn/parallel/distributed.py``, torch 2.1 to 2.13)
# ---------------------------------------------------------------------------------------------------------------
def prepare_ddp_backward(model: DistributedDataParallel, loss: Tensor) -> None:
    """Arm DDP's reducer for a backward whose forward ran under ``no_sync``, as DDP's own forward would have.

    The end of ``DistributedDataParallel.forward`` (``_post_forward`` in ``torch/nn/parallel/distributed.py``) does
    this when gradients are to be synced; Lightning does the same for manual optimization
    (``lightning.pytorch.overrides.distributed.prepare_for_backward``). Arming it only after every rank agreed that
    its forwards succeeded means that an attempt abandoned because of another rank's fault never leaves the reducer
    expecting a backward: the retry's first micro-batch would otherwise start an all-reduce on this rank alone.
    """
    model.require_forward_param_sync = True
    reducer = model.reducer
    reducer.prepare_for_forward()  # counts the iteration, as the synced forward would have
    reducer._rebuild_buckets()  # Lightning: avoids "INTERNAL ASSERT FAILED" with `find_unused_parameters=False`
    reducer.prepare_for_backward([loss] if model.find_unused_parameters and not model.static_graph else [])


def broadcast_ddp_buffers(strategy: Any) -> None:
    """Do DDP's buffer broadcast (batch-norm statistics, from rank 0) at the start of the step, not in a forward.

    DDP broadcasts buffers at the start of a forward when ``require_forward_param_sync`` is set (after a synced
    backward), and clears the flag at the end of a forward under ``no_sync``. Inside an attempt that collective is a
    trap: a rank that fails before its first forward leaves the others alone in the broadcast, and a rank whose
    forward raised keeps the flag and alone broadcasts again at the retry. Here, before anything can fail, every rank
    is at the same point; with the flag cleared, no forward of the step broadcasts.
    """
    model = getattr(strategy, "model", None)
    if not isinstance(model, DistributedDataParallel) or getattr(strategy, "world_size", 1) <= 1:
        return
    if model.will_sync_module_buffers():
        model._sync_buffers()
    model.require_forward_param_sync = False


def _param_groups(state: Any) -> list[Any]:
    groups = getattr(state, "_fsdp_param_groups", None)  # torch >= 2.12: several per module
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [] if group is None else [group]
    return list(groups)


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
    saved = []
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


# A LightningModule's `device` property reads `_device`, which `.to()` updates without looking at the parameters
# (`_DeviceDtypeModuleMixin` and `_update_properties` in `lightning/fabric/utilities/device_dtype_mixin.py`, 2.0 to
# 2.6). `tests/probe/test_preflight.py` fails if a traced copy's `self.device` stops reading what is set here.
def report_device(module: torch.nn.Module, device: torch.device) -> None:
    """Make ``module.device`` (and its sub-LightningModules') read ``device``, without moving anything.

    The pre-flight's fake copy of a module on CUDA computes on fake CPU tensors: a tensor that ``training_step`` makes
    on ``self.device`` must be made there too.
    """
    from lightning.fabric.utilities.device_dtype_mixin import _DeviceDtypeModuleMixin

    for sub in module.modules():
        if isinstance(sub, _DeviceDtypeModuleMixin):
            sub._device = device
