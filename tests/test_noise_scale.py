"""The noise-scale arithmetic against a problem whose |G|² and tr(Σ) are known exactly."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_accum.noise_scale import NoiseScaleEstimator, unbiased_estimates


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
