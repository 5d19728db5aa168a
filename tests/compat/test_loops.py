"""Fails if Lightning changes the loop internals that ``lightning_accum._compat.loops`` replaces or calls.

Each internal is checked where Lightning's source says it is, and on a real Trainer's loop that it does what the
patches assume: Lightning consults the replaced decisions, builds the closure from the pieces split mode calls,
divides the loss as the divisor says, logs on the step ``logging_step`` reads, and sees the last batch there.
"""

from __future__ import annotations

import inspect
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import Logger
from lightning.pytorch.loops.optimization.automatic import Closure, ClosureResult, _AutomaticOptimization
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
from lightning.pytorch.loops.utilities import _block_parallel_sync_behavior
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from lightning_accum import _compat
from lightning_accum._compat import _version, loops
from tests.helpers import FP32, IndexedDataset, RegressionModel, ddp_strategy, make_trainer, mse_loss, reference_grads


class _Recorder(RegressionModel):
    """Records, by batch index, where the optimizer stepped, where gradients were zeroed, and the step outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.batch = -1
        self.steps: list[int] = []
        self.zeroed: list[int] = []
        self.losses: list[Tensor] = []
        self.outputs: list[Any] = []
        self.last: list[bool] = []

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        self.batch = batch_idx

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = super().training_step(batch, batch_idx)
        self.losses.append(loss.detach())
        self.last.append(_compat.is_last_training_batch(self.trainer))
        return loss

    def on_before_zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        self.zeroed.append(self.batch)

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        self.steps.append(batch_idx)
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.outputs.append(outputs)


def _fit(tmp_path: Any, model: pl.LightningModule, n: int = 7, batch_size: int = 2, **kwargs: Any) -> pl.Trainer:
    trainer = make_trainer(tmp_path, **kwargs)
    trainer.fit(model, DataLoader(IndexedDataset(n * batch_size), batch_size=batch_size))
    return trainer


# ---------------------------------------------------------------------------------------------------------------
# window control: `_accumulated_batches_reached` and `_make_zero_grad_fn`
# ---------------------------------------------------------------------------------------------------------------
def test_lightning_still_decides_windows_where_compat_expects():
    should_accumulate = inspect.getsource(_TrainingEpochLoop._should_accumulate)
    assert "self._accumulated_batches_reached()" in should_accumulate
    assert "self._num_ready_batches_reached()" in should_accumulate
    assert "accumulate_grad_batches" in inspect.getsource(_TrainingEpochLoop._accumulated_batches_reached)
    zero_grad = inspect.getsource(_AutomaticOptimization._make_zero_grad_fn)
    assert "batch_idx % self.trainer.accumulate_grad_batches == 0" in zero_grad


def test_lightning_steps_and_zeroes_by_the_two_decisions_window_mode_replaces(tmp_path):
    # 7 batches at k=3: steps where `ready % 3 == 0` and at the last batch; zeroes where `batch_idx % 3 == 0`.
    model = _Recorder()
    _fit(tmp_path, model, accumulate_grad_batches=3)
    assert model.steps == [2, 5, 6]
    assert model.zeroed == [0, 3, 6]


@pytest.mark.parametrize("k", [1, 3])  # the Trainer's own `accumulate_grad_batches` no longer decides anything
def test_window_control_moves_the_steps_and_the_zeroing_of_a_real_fit(tmp_path, k):
    model = _Recorder()
    trainer = make_trainer(tmp_path, accumulate_grad_batches=k)
    undo = _compat.install_window_control(
        trainer, window_complete=lambda: model.batch in (1, 2, 4), window_start=lambda: model.batch in (0, 2, 4, 5)
    )
    trainer.fit(model, DataLoader(IndexedDataset(14), batch_size=2))
    assert model.steps == [1, 2, 4, 6]  # the epoch's last batch steps anyway (`_num_ready_batches_reached`)
    assert model.zeroed == [0, 2, 4, 5]  # through Lightning's own `on_before_zero_grad`, whatever `batch_idx % k`
    # The window of batches 0 and 1 was zeroed once, at 0: its step saw the sum of both batches' gradients (each
    # divided by the Trainer's `k`, as Lightning divides every loss).
    data = IndexedDataset(14)
    first, second = (reference_grads(RegressionModel(), [_batch(data, i)], mse_loss) for i in (0, 1))
    for name, grad in model.step_grads[0].items():
        torch.testing.assert_close(grad, (first[name] + second[name]) / k, **FP32)
    undo()
    assert "_accumulated_batches_reached" not in vars(trainer.fit_loop.epoch_loop)
    assert "_make_zero_grad_fn" not in vars(trainer.fit_loop.epoch_loop.automatic_optimization)
    assert trainer.accumulate_grad_batches == k  # set to 1 only while Lightning built a zero-grad function


def _batch(data: IndexedDataset, index: int, size: int = 2) -> dict[str, Tensor]:
    samples = [data[i] for i in range(index * size, (index + 1) * size)]
    return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}


def test_install_and_uninstall_touch_only_the_instances(tmp_path):
    trainer = make_trainer(tmp_path)
    epoch_loop = trainer.fit_loop.epoch_loop
    undo = _compat.install_window_control(trainer, window_complete=lambda: True, window_start=lambda: False)
    assert epoch_loop._accumulated_batches_reached() is True
    assert epoch_loop.automatic_optimization._make_zero_grad_fn(0, None) is None
    assert make_trainer(tmp_path).fit_loop.epoch_loop._accumulated_batches_reached is not None
    undo()
    assert "_accumulated_batches_reached" not in vars(epoch_loop)
    assert _TrainingEpochLoop._accumulated_batches_reached is not None
    assert _compat._LIGHTNING_OK


@pytest.mark.parametrize(
    ("owner", "name", "call", "message"),
    [
        (_TrainingEpochLoop, "_accumulated_batches_reached", "window", "which window mode replaces"),
        (_AutomaticOptimization, "_make_zero_grad_fn", "window", "which window mode replaces"),
        (_AutomaticOptimization, "_make_closure", "split", "which split mode uses"),
        (_AutomaticOptimization, "_training_step", "split", "which split mode uses"),
        (
            _TrainingEpochLoop,
            "_num_ready_batches_reached",
            "last",
            "which lightning_accum uses to find the epoch's last batch",
        ),
    ],
)
def test_a_lightning_without_the_internal_is_refused_by_name(tmp_path, monkeypatch, owner, name, call, message):
    trainer = make_trainer(tmp_path)
    monkeypatch.delattr(owner, name)
    calls = {
        "window": lambda: _compat.install_window_control(trainer, lambda: True, lambda: True),
        "split": lambda: _compat.install_split_closure(trainer, lambda context: None),
        "last": lambda: _compat.is_last_training_batch(trainer),
    }
    with pytest.raises(
        RuntimeError, match=rf"has no `{owner.__name__}.{name}`, {message}\. Use lightning>=2\.4,<2\.7\."
    ):
        calls[call]()


def test_an_unsupported_lightning_is_refused_before_anything_is_patched(tmp_path, monkeypatch):
    trainer = make_trainer(tmp_path)
    monkeypatch.setattr(_version, "_LIGHTNING_OK", False)
    for install in (
        lambda: _compat.install_window_control(trainer, lambda: True, lambda: True),
        lambda: _compat.install_split_closure(trainer, lambda context: None),
    ):
        with pytest.raises(RuntimeError, match=r"lightning_accum supports lightning>=2\.4,<2\.7, found "):
            install()
    assert not {"_make_zero_grad_fn", "_make_closure"} & set(vars(trainer.fit_loop.epoch_loop.automatic_optimization))


# ---------------------------------------------------------------------------------------------------------------
# the epoch's last batch: `_num_ready_batches_reached`
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("n", "limit", "expected"), [(5, None, [False] * 4 + [True]), (7, 3, [False, False, True])])
def test_the_last_batch_is_the_datas_or_the_limits(tmp_path, n, limit, expected):
    model = _Recorder()
    kwargs = {} if limit is None else {"limit_train_batches": limit}
    _fit(tmp_path, model, n=n, **kwargs)
    assert model.last == expected
    assert callable(_TrainingEpochLoop._num_ready_batches_reached)


# ---------------------------------------------------------------------------------------------------------------
# the logging step: `_batches_that_stepped`
# ---------------------------------------------------------------------------------------------------------------
class _StepLogger(Logger):
    """Keeps every ``log_metrics`` call's step and keys."""

    name = "steps"  # plain values meet `Logger`'s abstract `name` and `version`
    version = 0

    def __init__(self) -> None:
        super().__init__()
        self.logged: list[tuple[int, set[str]]] = []

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.logged.append((step, set(metrics)))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


class _LoggingRecorder(_Recorder):
    def __init__(self) -> None:
        super().__init__()
        self.at_batch_end: list[tuple[int, int]] = []  # (logging_step, global_step) after each stepping batch

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        self.log("seen", float(batch_idx))
        return super().training_step(batch, batch_idx)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.steps and self.steps[-1] == batch_idx:
            self.at_batch_end.append((_compat.logging_step(self.trainer), self.trainer.global_step))


def test_logging_step_is_the_step_lightnings_loggers_file_the_optimizer_step_under(tmp_path):
    assert _compat.logging_step(make_trainer(tmp_path)) == 0
    model, logger = _LoggingRecorder(), _StepLogger()
    _fit(tmp_path, model, n=6, accumulate_grad_batches=2, logger=logger)
    assert model.at_batch_end == [(0, 1), (1, 2), (2, 3)]  # `global_step` has counted the step already
    assert [step for step, keys in logger.logged if "seen" in keys] == [0, 1, 2]
    assert "_batches_that_stepped += 1" in inspect.getsource(_TrainingEpochLoop.on_advance_end)


# ---------------------------------------------------------------------------------------------------------------
# the loss divisor: `ClosureResult.from_training_step_output(..., normalize=accumulate_grad_batches)`
# ---------------------------------------------------------------------------------------------------------------
def test_the_outputs_loss_times_the_divisor_is_the_training_step_loss(tmp_path):
    model = _Recorder()
    trainer = _fit(tmp_path, model, n=4, accumulate_grad_batches=2)
    assert _compat.lightning_loss_divisor(trainer) == 2
    assert len(model.outputs) == len(model.losses) == 4
    for outputs, loss in zip(model.outputs, model.losses, strict=True):
        torch.testing.assert_close(outputs["loss"] * _compat.lightning_loss_divisor(trainer), loss)


# ---------------------------------------------------------------------------------------------------------------
# the split-mode closure: `_make_closure`, `_training_step`, `_make_backward_fn`, `Closure`, `ClosureResult`
# ---------------------------------------------------------------------------------------------------------------
def test_split_mode_internals_are_where_compat_expects():
    # Split mode builds Lightning's closure itself from these pieces (see `_compat.install_split_closure`).
    for name in ("_make_closure", "_training_step", "_make_backward_fn", "_make_zero_grad_fn"):
        assert callable(getattr(_AutomaticOptimization, name)), name
    assert {"closure_loss", "extra"} <= set(ClosureResult.__dataclass_fields__)
    assert list(inspect.signature(Closure.__init__).parameters)[1:4] == ["step_fn", "backward_fn", "zero_grad_fn"]
    # The loss reaching the hooks is divided by `accumulate_grad_batches` (what `lightning_loss_divisor` undoes).
    assert "normalize" in inspect.signature(ClosureResult.from_training_step_output).parameters
    assert "from_training_step_output(training_step_output, trainer.accumulate_grad_batches)" in inspect.getsource(
        _AutomaticOptimization._training_step
    )
    # Why split mode builds the closure: Lightning's runs `training_step`, then `zero_grad`, then `backward`.
    closure = inspect.getsource(Closure.closure)
    assert (
        closure.index("self._step_fn()") < closure.index("self._zero_grad_fn()") < closure.index("self._backward_fn(")
    )


class _SplitRecorder(_Recorder):
    """Returns its loss with an extra output; counts the samples each ``training_step`` call saw."""

    def __init__(self) -> None:
        super().__init__()
        self.micro_sizes: list[int] = []

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> dict[str, Any]:
        self.micro_sizes.append(len(batch["x"]))
        return {"loss": nn.functional.mse_loss(self.layer(batch["x"]), batch["y"]), "size": len(batch["x"])}


def _run_in_two_halves(context: loops.SplitStepContext) -> Any:
    """One split-mode step: zero, then two micro-batches' forward and backward, each weighted by its share."""
    context.zero_grad()
    total = torch.zeros(())
    n = len(context.batch["x"])
    for part in (slice(0, n // 2), slice(n // 2, n)):
        micro = {k: v[part] for k, v in context.batch.items()}
        loss, extra = context.training_step(micro)
        weighted = loss * (len(micro["x"]) / n)
        assert context.backward is not None
        context.backward(weighted)
        total += weighted.detach()
    return context.make_result(total, extra)


def test_the_split_closure_runs_lightnings_pieces_in_its_own_order(tmp_path):
    model = _SplitRecorder()
    model.split_mode = True
    trainer = make_trainer(tmp_path)
    undo = _compat.install_split_closure(trainer, _run_in_two_halves)
    initial = RegressionModel()
    trainer.fit(model, DataLoader(IndexedDataset(8), batch_size=4))
    assert model.micro_sizes == [2, 2, 2, 2]  # `training_step` ran through the strategy on each micro-batch
    assert model.zeroed == [0, 1] and model.steps == [0, 1]
    # The first step's gradient is the full batch's: nothing zeroed between or after the two backwards.
    expected = reference_grads(initial, [_batch(IndexedDataset(8), 0, size=4)], mse_loss)
    for name, grad in model.step_grads[0].items():
        torch.testing.assert_close(grad, expected[name], **FP32)
    assert [set(outputs) for outputs in model.outputs] == [{"loss", "size"}] * 2  # what `make_result` built
    assert model.outputs[0]["size"] == 2
    undo()
    assert "_make_closure" not in vars(trainer.fit_loop.epoch_loop.automatic_optimization)


# ---------------------------------------------------------------------------------------------------------------
# backward-sync blocking: `_block_parallel_sync_behavior` calls `strategy.block_backward_sync()`
# ---------------------------------------------------------------------------------------------------------------
def test_disabling_the_blocking_lets_the_loops_blocked_micro_batches_sync(gloo_group):
    strategy = ddp_strategy()
    strategy.model = ddp = DistributedDataParallel(nn.Linear(2, 1))
    with _block_parallel_sync_behavior(strategy, block=True):
        assert ddp.require_backward_grad_sync is False  # Lightning's blocking is DDP's `no_sync`
    undo = _compat.disable_backward_sync_blocking(strategy)
    with _block_parallel_sync_behavior(strategy, block=True):
        assert ddp.require_backward_grad_sync is True
    undo()
    with _block_parallel_sync_behavior(strategy, block=True):
        assert ddp.require_backward_grad_sync is False
    assert _compat.disable_backward_sync_blocking(object())() is None  # a strategy without blocking: left alone
