"""The noise-scale arithmetic against a problem whose |G|² and tr(Σ) are known exactly."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from lightning_accum.core import noise_scale
from lightning_accum.core.noise_scale import NoiseScaleEstimator, WindowNoiseMeter, unbiased_estimates


def test_unbiased_estimates_invert_the_expected_norms():
    # E|G_B|² = |G|² + tr(Σ)/B, written out for |G|² = 3 and tr(Σ) = 24 at 4 and 32 items.
    g2, trace = 3.0, 24.0
    small, big = g2 + trace / 4, g2 + trace / 32
    assert unbiased_estimates(small, 4, big, 32) == pytest.approx((g2, trace))


@pytest.mark.parametrize(("small", "big"), [(8, 8), (0, 8), (9, 8)])
def test_two_different_batch_sizes_are_needed(small, big):
    with pytest.raises(ValueError, match=r"two batch sizes 0 < small < big"):
        unbiased_estimates(1.0, small, 1.0, big)


def sampled_pair(generator, mean, std, small, big):
    """Squared norms of the mean of ``small`` and of ``big`` per-item gradients ~ N(mean, diag(std²)); nested."""
    items = mean + std * torch.randn(big, mean.numel(), generator=generator, dtype=torch.float64)
    return items[:small].mean(0).square().sum().item(), items.mean(0).square().sum().item()


@pytest.mark.parametrize("uneven", [False, True])
def test_smoothed_estimate_converges_to_the_true_noise_scale(uneven):
    # |G|² = 0.25 · 50 = 12.5, tr(Σ) = 50 · 2² = 200: B_simple = 16 items.
    generator = torch.Generator().manual_seed(0)
    mean, std = torch.full((50,), 0.5, dtype=torch.float64), 2.0
    estimator = NoiseScaleEstimator(beta=0.99)
    for window in range(400):
        small = 1 + window % 7 if uneven else 4  # micro-batches of uneven item counts
        big = small + 12
        estimator.update(*_interleave(sampled_pair(generator, mean, std, small, big), small, big))
    estimate = estimator.value()
    assert estimate.windows == 400
    assert estimate.grad_sq_norm == pytest.approx(12.5, rel=0.1)
    assert estimate.trace_cov == pytest.approx(200.0, rel=0.1)
    assert estimate.gradient_noise_scale == pytest.approx(16.0, rel=0.1)


def _interleave(pair, small, big):
    small_sq, big_sq = pair
    return small_sq, small, big_sq, big


def test_a_non_finite_estimate_is_skipped_and_counted():
    estimator = NoiseScaleEstimator(beta=0.5)
    estimator.add_estimates(2.0, 10.0)
    for bad in ((math.nan, 10.0), (2.0, math.inf), (-math.inf, math.nan)):
        estimator.add_estimates(*bad)
    estimator.add_estimates(4.0, 10.0)
    clean = NoiseScaleEstimator(beta=0.5)
    clean.add_estimates(2.0, 10.0)
    clean.add_estimates(4.0, 10.0)
    assert dataclasses.replace(estimator.value(), skipped=0) == clean.value()
    assert estimator.value().skipped == 3
    restored = NoiseScaleEstimator(beta=0.5)
    restored.load_state_dict(estimator.state_dict())
    assert restored.value() == estimator.value()


def test_bias_correction_and_state_round_trip():
    estimator = NoiseScaleEstimator(beta=0.5)
    assert math.isnan(estimator.value().gradient_noise_scale)
    estimator.add_estimates(2.0, 10.0)
    assert (estimator.value().grad_sq_norm, estimator.value().trace_cov) == (2.0, 10.0)  # not 1.0 and 5.0
    estimator.add_estimates(4.0, 10.0)
    assert estimator.value().grad_sq_norm == pytest.approx((0.5 * 0.5 * 2 + 0.5 * 4) / (1 - 0.25))
    clone = NoiseScaleEstimator(beta=0.5)
    clone.load_state_dict(estimator.state_dict())
    assert clone.value() == estimator.value()


@pytest.mark.parametrize(("beta", "error"), [(1.0, ValueError), (-0.1, ValueError), ("0.9", TypeError)])
def test_bad_beta_is_refused(beta, error):
    with pytest.raises(error, match="`beta` must be"):
        NoiseScaleEstimator(beta=beta)


def test_the_meters_one_all_reduce_averages_the_ranks_own_estimates():
    # Two ranks whose first micro-batches held 3 and 5 of the window's 16 items; the window's gradient is replicated.
    # The meter sends six numbers per rank; their sum must give the mean of the ranks' own `unbiased_estimates`.
    firsts = [(torch.tensor([3.0, -1.0]), 3.0), (torch.tensor([0.5, 2.0]), 5.0)]
    window = torch.tensor([1.0, 0.25])
    meters = [WindowNoiseMeter() for _ in firsts]
    sent = []
    for meter, (gradient, items) in zip(meters, firsts, strict=True):
        meter.request()
        meter.capture(step=0, window=1, gradients=[gradient * items / 8.0], items=items, divisor=8.0)
    meters[1].measure(
        0, 1, [window], items=16.0, micro_batches=2, world_size=2, sum_across_ranks=lambda t: sent.append(t) or t
    )
    estimate = meters[0].measure(
        0, 1, [window], items=16.0, micro_batches=2, world_size=2, sum_across_ranks=lambda t: t + sent[0]
    )
    big = float(window.square().sum())
    pairs = [unbiased_estimates(float(g.square().sum()), n, big, 16.0) for g, n in firsts]
    assert estimate == pytest.approx(tuple(sum(p[i] for p in pairs) / 2 for i in range(2)), rel=1e-6)
    assert (meters[0].windows, meters[0].last_step) == (1, 0)


def test_a_window_of_one_micro_batch_on_one_process_reads_nothing_back(monkeypatch):
    # Split mode runs a window of one micro-batch whenever the step batch fits: no pair of batch sizes. The meter still
    # took the window's squared norm and read it back to the host (waiting for the device), then measured nothing.
    meter = WindowNoiseMeter()
    meter.request()
    norms = []
    real = noise_scale._shared_squared_norm
    monkeypatch.setattr(noise_scale, "_shared_squared_norm", lambda *a: norms.append(a) or real(*a))
    last_step = meter.last_step
    meter.capture(step=0, window=0, gradients=[torch.tensor([2.0])], items=4, divisor=4.0)
    assert meter.measure(0, 0, [torch.tensor([2.0])], items=4.0, micro_batches=1) is None
    assert (norms, meter.windows, meter.last_step) == ([], 0, last_step)
    meter.capture(step=1, window=1, gradients=[torch.tensor([2.0])], items=1, divisor=1.0)  # a window of two
    assert meter.measure(1, 1, [torch.tensor([1.0])], items=2.0, micro_batches=2) is not None and len(norms) == 1


def test_the_measured_windows_and_their_weights_follow_the_step_count():
    meter = WindowNoiseMeter()
    meter.request(every=4)
    meter.request(every=3)  # the most frequent consumer wins
    assert [step for step in range(10) if meter.wants(step)] == [0, 3, 6, 9]

    def measured_at(meter, step):
        meter.capture(step, step, [torch.tensor([2.0])], items=1, divisor=1.0)
        meter.measure(step, step, [torch.tensor([1.0])], items=2.0, micro_batches=2)
        return meter.windows

    assert [measured_at(meter, step) for step in (0, 3, 6)] == [1, 3, 3]
    resumed = WindowNoiseMeter()
    resumed.request(every=3)
    resumed.load_state_dict(meter.state_dict())
    assert measured_at(resumed, 9) == 3  # as if uninterrupted
    old_checkpoint = WindowNoiseMeter()
    old_checkpoint.request(every=3)
    old_checkpoint.load_state_dict({})  # saved before the meter had state: the interval stands in
    assert measured_at(old_checkpoint, 9) == 3


# ---------------------------------------------------------------------------------------------------------------
# end to end: AccumulationMonitor(gradient_noise_scale=True) against the exact value of a fixed problem
# ---------------------------------------------------------------------------------------------------------------
import lightning.pytorch as pl  # noqa: E402
from torch import Tensor, nn  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from lightning_accum import AccumulationMonitor, AccumulationScheduler, AutoMicroBatching, keys  # noqa: E402
from tests.helpers import make_trainer  # noqa: E402

DIM, SEQ = 32, 8


class TokenRegression(Dataset):
    """Rows ("tokens") x ~ N(0, I), y = x·w* + ε, grouped in samples of 1 to 8 loss-bearing tokens (or all 8)."""

    def __init__(self, n: int, uneven: bool, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, SEQ, DIM, generator=g)
        self.y = self.x @ torch.ones(DIM) + torch.randn(n, SEQ, generator=g)
        lengths = torch.randint(1, SEQ + 1, (n,), generator=g) if uneven else torch.full((n,), SEQ)
        self.mask = torch.arange(SEQ)[None, :] < lengths[:, None]

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {"x": self.x[i], "y": self.y[i], "mask": self.mask[i]}

    def exact_noise_scale(self, w: Tensor) -> tuple[float, float]:
        """|G|² and tr(Σ) of the per-token gradients 2 (x·w - y) x over every loss-bearing token of the dataset."""
        x, y = self.x[self.mask].double(), self.y[self.mask].double()
        per_token = 2 * (x @ w.double() - y)[:, None] * x
        mean = per_token.mean(0)
        return float(mean.square().sum()), float((per_token - mean).square().sum(1).mean())


def count_loss_tokens(batch: dict[str, Tensor]) -> Tensor:
    return batch["mask"].sum()


class FixedRegression(pl.LightningModule):
    """A linear model that never moves (lr 0), so the true gradient and its covariance are fixed."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(DIM, 1, bias=False)
        with torch.no_grad():
            self.layer.weight.fill_(0.0)  # w - w* = -1 per coordinate: |G|² = 128, B_simple ≈ 34 tokens

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        mask = batch["mask"]
        per_token = (self.layer(batch["x"]).squeeze(-1) - batch["y"]) ** 2
        return (per_token * mask).sum() / mask.sum().clamp(min=1)  # the mean over loss-bearing tokens

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


@pytest.mark.parametrize(("mode", "uneven"), [("window", False), ("window", True), ("split", False), ("split", True)])
def test_the_logged_noise_scale_is_within_10_percent_of_the_truth(tmp_path, mode, uneven):
    dataset = TokenRegression(12288, uneven)
    model = FixedRegression()
    if mode == "window":  # micro-batches of 4 samples, 4 per window: 768 windows
        owner, batch_size = AccumulationScheduler(4, count_items=count_loss_tokens), 4
    else:  # step batches of 16 samples cut into micro-batches of 4
        owner, batch_size = AutoMicroBatching(4, count_items=count_loss_tokens, pin_micro_batch_size=True), 16
    monitor = AccumulationMonitor(gradient_noise_scale=True, noise_scale_beta=0.998)
    trainer = make_trainer(tmp_path, [owner, monitor])
    trainer.fit(model, DataLoader(dataset, batch_size=batch_size))

    grad_sq_norm, trace_cov = dataset.exact_noise_scale(model.layer.weight.detach()[0])
    metrics = trainer.callback_metrics
    assert monitor.noise_scale.value().windows == 12288 // 16
    assert float(metrics[keys.GRAD_SQ_NORM]) == pytest.approx(grad_sq_norm, rel=0.1)
    assert float(metrics[keys.GRAD_TRACE_COV]) == pytest.approx(trace_cov, rel=0.1)
    assert float(metrics[keys.GRADIENT_NOISE_SCALE]) == pytest.approx(trace_cov / grad_sq_norm, rel=0.1)


class CountMeasuredWindows(pl.Callback):
    """Counts the optimizer steps whose report carries a noise measurement."""

    def __init__(self, owner: AccumulationScheduler) -> None:
        self.owner, self.measured, self._last = owner, 0, None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        report = self.owner.last_step_report  # a new one after each optimizer step
        if report is not self._last:
            self._last = report
            self.measured += report is not None and report.noise is not None


def test_measuring_every_fourth_window_costs_a_quarter_and_stays_within_10_percent(tmp_path):
    dataset = TokenRegression(12288, uneven=True)
    owner = AccumulationScheduler(4, count_items=count_loss_tokens)
    monitor = AccumulationMonitor(gradient_noise_scale=True, noise_scale_beta=0.998, noise_scale_interval=4)
    counter = CountMeasuredWindows(owner)
    trainer = make_trainer(tmp_path, [owner, monitor, counter])
    trainer.fit(FixedRegression(), DataLoader(dataset, batch_size=4))

    assert counter.measured == 768 // 4  # windows 1, 5, 9, ...: a quarter of the norms and host reads
    # Each measurement weighs the windows since the one before: 1 for the first, 4 for the others (765); the last 3
    # windows wait for the next measurement.
    assert monitor.noise_scale.value().windows == 1 + 4 * (768 // 4 - 1)
    grad_sq_norm, trace_cov = dataset.exact_noise_scale(torch.zeros(DIM))
    metrics = trainer.callback_metrics
    assert float(metrics[keys.GRADIENT_NOISE_SCALE]) == pytest.approx(trace_cov / grad_sq_norm, rel=0.1)


class RecordMeasurements(pl.Callback):
    """Each measured step with the windows it stands for, averaged as a monitor weighing by `noise_windows` would.

    Its average is callback state, so it survives a checkpoint as the monitor's does.
    """

    def __init__(self) -> None:
        self.measured: list[tuple[int, int]] = []
        self.estimator = NoiseScaleEstimator(beta=0.9)
        self._last = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        owner = trainer.callbacks[0]
        report = owner.last_step_report
        if report is not self._last:
            self._last = report
            if report.noise is not None:
                self.measured.append((trainer.global_step - 1, owner.noise_windows))
                self.estimator.add_estimates(*report.noise, windows=owner.noise_windows)

    def state_dict(self):
        return self.estimator.state_dict()

    def load_state_dict(self, state_dict):
        self.estimator.load_state_dict(state_dict)


def test_a_resumed_run_measures_the_windows_an_uninterrupted_one_does(tmp_path):
    # 10 windows per epoch, every 4th measured: steps 0, 4, 8, 12, ... Before, a run resumed at step 10 measured
    # 10, 14, 18, ... (the count restarted with the run), and its estimate drifted away from the uninterrupted one.
    from tests.helpers import IndexedDataset, RegressionModel

    def run(root, epochs, ckpt=None):
        record = RecordMeasurements()
        monitor = AccumulationMonitor(gradient_noise_scale=True, noise_scale_interval=4)
        trainer = make_trainer(root, [AccumulationScheduler(2), monitor, record], max_epochs=epochs)
        trainer.fit(RegressionModel(lr=0.05), DataLoader(IndexedDataset(80), batch_size=4), ckpt_path=ckpt)
        return trainer, record, monitor

    _, uninterrupted, monitor = run(tmp_path / "full", 3)
    assert [step for step, _ in uninterrupted.measured] == list(range(0, 30, 4))
    assert [windows for _, windows in uninterrupted.measured] == [1] + [4] * 7
    trainer, first, _ = run(tmp_path / "first", 1)
    trainer.save_checkpoint(tmp_path / "mid.ckpt")
    _, resumed, resumed_monitor = run(tmp_path / "resumed", 3, tmp_path / "mid.ckpt")
    assert first.measured + resumed.measured == uninterrupted.measured  # steps, and the windows each stands for
    for estimator, reference in (
        (resumed.estimator, uninterrupted.estimator),
        (resumed_monitor.noise_scale, monitor.noise_scale),
    ):
        # The monitor's own average too: it weighs each measurement by the owner's count (3-4% off before).
        torch.testing.assert_close(
            torch.tensor([estimator.value().grad_sq_norm, estimator.value().trace_cov]),
            torch.tensor([reference.value().grad_sq_norm, reference.value().trace_cov]),
        )


def test_the_noise_scale_interval_is_checked():
    with pytest.raises(ValueError, match=r"`noise_scale_interval` must be an int >= 1, got 0"):
        AccumulationMonitor(gradient_noise_scale=True, noise_scale_interval=0)


def test_the_noise_scale_needs_an_owner(tmp_path):
    trainer = make_trainer(tmp_path, [AccumulationMonitor(gradient_noise_scale=True)], accumulate_grad_batches=2)
    with pytest.raises(
        RuntimeError, match=r"gradient_noise_scale=True.*`AccumulationScheduler` or `AutoMicroBatching`"
    ):
        trainer.fit(FixedRegression(), DataLoader(TokenRegression(16, False), batch_size=4))


@pytest.mark.ddp
@pytest.mark.timeout(300)
def test_on_two_ranks_with_uneven_token_counts(tmp_path):
    # Each rank's first micro-batch gives its own pair with the global window; the ranks' estimates are averaged.
    from tests.test_ddp import ddp_trainer

    dataset = TokenRegression(12288, uneven=True)
    monitor = AccumulationMonitor(gradient_noise_scale=True, noise_scale_beta=0.998)
    trainer = ddp_trainer(tmp_path, [AccumulationScheduler(4, count_items=count_loss_tokens), monitor])
    trainer.fit(FixedRegression(), DataLoader(dataset, batch_size=4))

    grad_sq_norm, trace_cov = dataset.exact_noise_scale(torch.zeros(DIM))
    metrics = trainer.callback_metrics  # rank zero's, handed back by the spawn launcher
    assert float(metrics[keys.GRAD_SQ_NORM]) == pytest.approx(grad_sq_norm, rel=0.1)
    assert float(metrics[keys.GRAD_TRACE_COV]) == pytest.approx(trace_cov, rel=0.1)
    assert float(metrics[keys.GRADIENT_NOISE_SCALE]) == pytest.approx(trace_cov / grad_sq_norm, rel=0.1)
