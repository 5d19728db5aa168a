"""``ManualAccumulation`` under manual optimization: exact windows, one helper per optimizer (the GAN case)."""

from __future__ import annotations

import dataclasses

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import tests.helpers as h
from lightning_accum import AccumulationScheduler, ManualAccumulation
from lightning_accum.schedules import AdaptiveBatchSize
from tests.helpers import (
    FP32,
    IndexedDataset,
    RegressionModel,
    TokenDataset,
    count_tokens,
    make_trainer,
    mse_loss,
)


def token_mean_loss(layer: nn.Module, batch) -> torch.Tensor:
    """Mean squared error over the loss-bearing tokens of a token batch (padding carries no loss)."""
    mask = batch["mask"]
    prediction = layer(batch["x"]).squeeze(-1)
    return ((prediction - batch["y"]) ** 2 * mask).sum() / mask.sum().clamp(min=1)


class TwoOptimizers(pl.LightningModule):
    """A generator and a discriminator, each with its own optimizer and its own accumulation helper.

    The two windows have different lengths and the micro-batches hold uneven token counts, so each helper's
    end-of-window factor differs from 1 and from the other's: a helper that rescaled every parameter of the module
    would corrupt the other optimizer's accumulating gradient.
    """

    def __init__(self, k_gen: int, k_disc: int) -> None:
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(0)
        self.gen = nn.Linear(5, 1)
        self.disc = nn.Linear(5, 1)
        self.gen_accumulation = ManualAccumulation(k_gen, count_items=count_tokens)
        self.disc_accumulation = ManualAccumulation(k_disc, count_items=count_tokens)
        self.windows: dict[str, list[int]] = {"gen": [], "disc": []}
        self.grads: dict[str, list[dict[str, torch.Tensor]]] = {"gen": [], "disc": []}
        self._open: dict[str, list[int]] = {"gen": [], "disc": []}

    def training_step(self, batch, batch_idx):
        gen_opt, disc_opt = self.optimizers()
        for name, layer, helper, opt in (
            ("disc", self.disc, self.disc_accumulation, disc_opt),
            ("gen", self.gen, self.gen_accumulation, gen_opt),
        ):
            self._open[name].append(batch_idx)
            loss = token_mean_loss(layer, batch)
            if helper.backward(self, loss, batch, optimizer=opt):
                self.grads[name].append({n: p.grad.clone() for n, p in layer.named_parameters()})
                self.windows[name].append(self._open[name])
                self._open[name] = []
                opt.step()
                opt.zero_grad()

    def configure_optimizers(self):
        # lr 0: parameters stay at their initial values, so every window's reference gradient is at those values.
        return torch.optim.SGD(self.gen.parameters(), lr=0.0), torch.optim.SGD(self.disc.parameters(), lr=0.0)


def test_one_helper_per_optimizer_touches_only_its_own_parameters(tmp_path):
    dataset = TokenDataset(24, lengths=[1, 5, 2, 6, 3, 4] * 4)
    model = TwoOptimizers(k_gen=2, k_disc=3)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    loader = DataLoader(dataset, batch_size=4)
    make_trainer(tmp_path).fit(model, loader)
    batches = list(loader)

    assert model.windows["gen"] == [[0, 1], [2, 3], [4, 5]]
    assert model.windows["disc"] == [[0, 1, 2], [3, 4, 5]]
    for name in ("gen", "disc"):
        layer = nn.Linear(5, 1)
        layer.load_state_dict({k.split(".", 1)[1]: v for k, v in initial.items() if k.startswith(name + ".")})
        for window, grads in zip(model.windows[name], model.grads[name], strict=True):
            layer.zero_grad()
            window_batch = {key: torch.cat([batches[i][key] for i in window]) for key in batches[0]}
            token_mean_loss(layer, window_batch).backward()
            for param_name, param in layer.named_parameters():
                torch.testing.assert_close(grads[param_name], param.grad, **FP32)


def test_several_optimizers_without_optimizer_is_a_clear_error(tmp_path):
    class Unnamed(TwoOptimizers):
        def training_step(self, batch, batch_idx):
            self.gen_accumulation.backward(self, token_mean_loss(self.gen, batch), batch)

    with pytest.raises(ValueError, match=r"needs `optimizer=`: this LightningModule has 2 optimizers"):
        make_trainer(tmp_path).fit(Unnamed(2, 2), DataLoader(TokenDataset(8, lengths=[2] * 8), batch_size=4))


def test_the_former_argument_name_still_works_with_a_deprecation():
    with pytest.deprecated_call(match=r"`ManualAccumulation\(accumulation_steps=...\)` is now `schedule=`"):
        helper = ManualAccumulation(accumulation_steps=3)
    assert repr(helper.schedule) == repr(ManualAccumulation(schedule=3).schedule) == "ConstantSchedule(3)"


# ---------------------------------------------------------------------------------------------------------------
# AdaptiveBatchSize under manual optimization: the same adaptation as in window mode
# ---------------------------------------------------------------------------------------------------------------
def adaptive_schedule() -> AdaptiveBatchSize:
    return AdaptiveBatchSize(2, 16, objective="noise_scale", warmup_windows=5, beta=0.8, lr_scaling="linear")


class ManualRegression(RegressionModel):
    """`tests.helpers.RegressionModel` under manual optimization, accumulating with `ManualAccumulation`."""

    def __init__(self, schedule: AdaptiveBatchSize) -> None:
        super().__init__(lr=0.2)
        self.automatic_optimization = False
        self.accumulation = ManualAccumulation(schedule)

    def training_step(self, batch, batch_idx):
        self._record(batch)
        optimizer = self.optimizers()
        if self.accumulation.backward(self, mse_loss(self, batch), batch):
            self.configure_gradient_clipping(optimizer)  # records the step's gradient and samples
            optimizer.step()
            optimizer.zero_grad()

    def on_save_checkpoint(self, checkpoint):
        checkpoint["accumulation"] = self.accumulation.state_dict()

    def on_load_checkpoint(self, checkpoint):
        self.accumulation.load_state_dict(checkpoint["accumulation"])


def fit_both(tmp_path, epochs: int = 4, n: int = 256):
    """The same data and initial weights, through `AccumulationScheduler` and through `ManualAccumulation`."""
    auto_schedule, manual_schedule = adaptive_schedule(), adaptive_schedule()
    auto = RegressionModel(lr=0.2)
    make_trainer(tmp_path / "auto", [AccumulationScheduler(auto_schedule)], max_epochs=epochs).fit(
        auto, DataLoader(IndexedDataset(n), batch_size=4)
    )
    manual = ManualRegression(manual_schedule)
    make_trainer(tmp_path / "manual", max_epochs=epochs).fit(manual, DataLoader(IndexedDataset(n), batch_size=4))
    return (auto, auto_schedule), (manual, manual_schedule)


def test_manual_accumulation_adapts_k_as_window_mode_does(tmp_path):
    # Before: `ManualAccumulation(AdaptiveBatchSize(...))` measured 0 windows and stayed at k=2 for 128 steps, while
    # `AccumulationScheduler` went through k = 2, 4, 6, 10, 12, 16 in 37.
    (auto, auto_schedule), (manual, manual_schedule) = fit_both(tmp_path)
    windows = [len(indices) // 4 for indices in manual.step_indices]
    assert windows == [len(indices) // 4 for indices in auto.step_indices]
    assert max(windows) > 2 and manual.step_indices == auto.step_indices  # it adapted, as window mode did
    assert manual_schedule.estimator.value().windows == len(windows)
    torch.testing.assert_close(
        torch.tensor(dataclasses.astuple(manual_schedule.estimator.value())[:2]),
        torch.tensor(dataclasses.astuple(auto_schedule.estimator.value())[:2]),
    )
    changes = [(e.before, e.after) for e in manual.accumulation.events]
    assert changes and all(after > before for before, after in changes)
    # lr_scaling="linear": the rate followed k, from 0.2 at k=2
    assert manual.optimizers().param_groups[0]["lr"] == pytest.approx(0.2 * windows[-1] / 2)
    h.assert_grads_close(manual.step_grads, auto.step_grads, **FP32)


def test_manual_adaptation_resumes_from_the_helpers_state(tmp_path):
    full = ManualRegression(adaptive_schedule())
    make_trainer(tmp_path / "full", max_epochs=2).fit(full, DataLoader(IndexedDataset(128), batch_size=4))
    first = ManualRegression(adaptive_schedule())
    trainer = make_trainer(tmp_path / "a", max_epochs=1)
    trainer.fit(first, DataLoader(IndexedDataset(128), batch_size=4))
    trainer.save_checkpoint(tmp_path / "mid.ckpt")
    resumed = ManualRegression(adaptive_schedule())
    make_trainer(tmp_path / "b", max_epochs=2).fit(
        resumed, DataLoader(IndexedDataset(128), batch_size=4), ckpt_path=tmp_path / "mid.ckpt"
    )
    assert full.accumulation.events, "k must change during the run for this test to bite"
    assert first.step_indices + resumed.step_indices == full.step_indices
    assert resumed.accumulation.schedule.state_dict() == full.accumulation.schedule.state_dict()
    for name, value in full.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[name], value)
