"""Lightning Fabric, seen as the split step and the sync policies see a ``Trainer``.

Depends on ``lightning/fabric/wrappers.py`` (lightning 2.2 to 2.6): ``_FabricModule._forward_module`` is the module
the strategy wrapped (``DistributedDataParallel`` under DDP, the ``fully_shard``-ed module under
``ModelParallelStrategy``), and ``_FabricModule.module`` the user's own; and on ``lightning/fabric/strategies/``:
``Strategy.all_reduce(tensor, reduce_op=...)``, ``Strategy.root_device`` and the strategy classes; and on
``_FabricDataLoader._num_iter_calls``, the epoch its ``__iter__`` gives its sampler's ``set_epoch`` (then counts up).
``tests/test_fabric.py`` and ``tests/test_fabric_balancing.py`` fail if one of them changes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Literal

from lightning.fabric import Fabric
from lightning.fabric.strategies.ddp import DDPStrategy
from lightning.fabric.strategies.deepspeed import DeepSpeedStrategy
from lightning.fabric.strategies.fsdp import FSDPStrategy
from lightning.fabric.strategies.model_parallel import ModelParallelStrategy
from lightning.fabric.strategies.single_device import SingleDeviceStrategy
from lightning.fabric.wrappers import _FabricDataLoader, _FabricModule
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from lightning_accum._compat._version import _check_version


def wrapped_module(model: Any) -> nn.Module:
    """What Fabric's strategy wrapped (DDP, or the FSDP2 module): the module gradients are synced through."""
    _check_version()
    if not isinstance(model, _FabricModule):
        raise TypeError(
            f"`model` must be the module `fabric.setup` returned, got {type(model).__name__}. Pass"
            " `model = fabric.setup(model)` (or `fabric.setup_module`)."
        )
    forward: nn.Module = model._forward_module
    return forward


class FabricStrategyView:
    """Fabric's strategy under the names the sync policies use of a Lightning ``Strategy``."""

    def __init__(self, fabric: Fabric, model: Any) -> None:
        self._strategy = fabric.strategy
        self.model = wrapped_module(model)
        self.world_size = fabric.world_size
        self.root_device = fabric.device

    @property
    def process_group_backend(self) -> str | None:
        backend: str | None = getattr(self._strategy, "_process_group_backend", None)
        return backend

    def reduce(self, tensor: Tensor, reduce_op: str = "sum") -> Tensor:
        reduced: Tensor = self._strategy.all_reduce(tensor, reduce_op=reduce_op)
        return reduced

    def block_backward_sync(self) -> contextlib.AbstractContextManager[Any]:
        """DDP's ``no_sync``, as Lightning's ``DDPStrategy.block_backward_sync`` does (FSDP2 is the policy's)."""
        if isinstance(self.model, DistributedDataParallel):
            return self.model.no_sync()
        return contextlib.nullcontext()


class FabricHost:
    """What `lightning_accum.split.step.SplitStepRunner` reads of a ``Trainer``, for a Fabric loop.

    ``global_step`` is the front end's count of optimizer steps, set before each step.
    """

    def __init__(self, fabric: Fabric, model: Any) -> None:
        self.strategy = FabricStrategyView(fabric, model)
        self.world_size = fabric.world_size
        self.global_rank = fabric.global_rank
        self.global_step = 0
        self.lightning_module: nn.Module = model.module  # the user's module: its parameters are the optimizer's


def sync_kind(fabric: Fabric, model: Any) -> Literal["single", "ddp", "fsdp2"]:
    """``"single"``, ``"ddp"`` or ``"fsdp2"``: how split mode syncs under Fabric's strategy.

    Raises:
        RuntimeError: a strategy split mode does not support (FSDP1, DeepSpeed, tensor parallelism, another one).
    """
    strategy = fabric.strategy
    if isinstance(strategy, (FSDPStrategy, DeepSpeedStrategy)):
        raise RuntimeError(
            f"`FabricMicroBatching` does not support Fabric's `{type(strategy).__name__}`. Use"
            " `ModelParallelStrategy` with `torch.distributed.fsdp.fully_shard` (FSDP2), or `strategy='ddp'`."
        )
    if isinstance(strategy, ModelParallelStrategy):
        if strategy.device_mesh["tensor_parallel"].size() > 1:
            raise RuntimeError(
                "`FabricMicroBatching` supports `ModelParallelStrategy` for data parallelism only (FSDP2): set"
                " `tensor_parallel_size=1`."
            )
        return "fsdp2"  # `lightning_accum.split.sync.sync_policy` checks that something is `fully_shard`-ed
    if isinstance(strategy, DDPStrategy):
        return "ddp" if fabric.world_size > 1 else "single"
    if isinstance(strategy, SingleDeviceStrategy):
        return "single"
    raise RuntimeError(
        f"`FabricMicroBatching` supports single-device, DDP and `ModelParallelStrategy` (FSDP2) strategies, got"
        f" {type(strategy).__name__}."
    )


def gradient_scale(fabric: Fabric) -> float:
    """The factor 16-bit mixed precision multiplies the gradients by (``MixedPrecision.scaler``), else 1."""
    scaler = getattr(fabric._precision, "scaler", None)
    if scaler is None or not scaler.is_enabled():
        return 1.0
    return float(scaler.get_scale())


def start_loader_epoch(loader: Any, epoch: int) -> None:
    """Make the next iteration of ``loader`` set its sampler's epoch to ``epoch``, where it is Fabric's loader.

    ``fabric.setup_dataloaders``' loader calls ``set_epoch`` with the number of times it was iterated before, which
    starts again at 0 in a resumed process: the first epoch after a resume would repeat epoch 0's order.
    """
    if isinstance(loader, _FabricDataLoader):
        loader._num_iter_calls = int(epoch)


FABRIC_BACKWARD_IN_A_WINDOW = (
    "`fabric.backward(loss)` ran inside `with acc.micro_batch(batch):`. Call `acc.backward(loss)` there instead: it"
    " weighs the micro-batch's loss by its exact share of the window, where `fabric.backward` would add its gradient"
    " unweighted and the update would be off, silently."
)
FABRIC_BACKWARD_IN_LOSS_FN = (
    "`loss_fn` called `fabric.backward`: under `FabricMicroBatching.step` it must only return the micro-batch's loss."
    " The step runs every micro-batch's backward itself, with its exact weight (a backward of its own would add the"
    " gradient again, or fail with 'backward through the graph a second time'). Return the loss from `loss_fn`, and"
    " remove its `fabric.backward(loss)`."
)


@contextlib.contextmanager
def backward_refused(fabric: Fabric, message: str) -> Iterator[None]:
    """Inside, ``fabric.backward`` raises ``RuntimeError(message)``: the user's loop must not back-propagate itself.

    The refusal shadows Fabric's method on this one instance (`backward_allowed` lifts it for the front end's own
    backward); ``lightning/fabric/fabric.py``'s ``Fabric.backward`` is a plain method (2.2 to 2.6).
    """

    def refused(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError(message)

    fabric.__dict__["backward"] = refused
    try:
        yield
    finally:
        if fabric.__dict__.get("backward") is refused:
            del fabric.__dict__["backward"]


@contextlib.contextmanager
def backward_allowed(fabric: Fabric) -> Iterator[None]:
    """Lift `backward_refused` for the front end's own ``fabric.backward`` of a weighted loss."""
    guard = fabric.__dict__.pop("backward", None)
    try:
        yield
    finally:
        if guard is not None:
            fabric.__dict__["backward"] = guard
