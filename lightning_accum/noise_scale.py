"""The gradient noise scale from two batch sizes that accumulation already has. Pure: no Trainer.

McCandlish et al. (2018), "An Empirical Model of Large-Batch Training", define the simple noise scale
``B_simple = tr(Σ) / |G|²``: ``G`` is the true gradient and ``Σ`` the per-item gradient covariance. A gradient
estimated on ``B`` items has ``E|G_B|² = |G|² + tr(Σ) / B``. Two batch sizes ``B_small < B_big`` therefore give
unbiased estimates of both (their appendix A.1):

* ``|G|² ≈ (B_big · |G_big|² - B_small · |G_small|²) / (B_big - B_small)``
* ``tr(Σ) ≈ (|G_small|² - |G_big|²) / (1 / B_small - 1 / B_big)``

A window of accumulation holds both: the first micro-batch's gradient (``B_small`` = its items), read before the
other micro-batches are added, and the whole window's gradient (``B_big`` = the window's items, all ranks). Each
estimate is noisy, and the ratio of two noisy estimates is biased, so the paper smooths numerator and denominator
separately and divides the smoothed values. Here the smoothing is an exponential moving average with Adam-style bias
correction, so that the first windows are not pulled towards zero and an old regime is forgotten at a known rate
(``1 / (1 - beta)`` windows) as the noise scale grows during training.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lightning_accum._validation import check_int, check_number


def unbiased_estimates(
    small_sq_norm: float, small_items: float, big_sq_norm: float, big_items: float
) -> tuple[float, float]:
    """``(|G|², tr(Σ))`` from one pair of gradient norms at two batch sizes (McCandlish et al., appendix A.1).

    Args:
        small_sq_norm: ``|G_small|²``, the squared norm of the mean gradient over ``small_items`` items.
        small_items: the items behind it.
        big_sq_norm: ``|G_big|²``, the squared norm of the mean gradient over ``big_items`` items.
        big_items: the items behind it; must exceed ``small_items``.

    Raises:
        ValueError: ``big_items <= small_items`` or ``small_items <= 0``: two different batch sizes are needed.

    Examples:
        With ``|G|² = 1`` and ``tr(Σ) = 8``, the expected squared norms at 2 and 8 items are 5 and 2:

        >>> unbiased_estimates(small_sq_norm=5.0, small_items=2, big_sq_norm=2.0, big_items=8)
        (1.0, 8.0)
    """
    if small_items <= 0 or big_items <= small_items:
        raise ValueError(
            f"The noise scale needs two batch sizes 0 < small < big, got small={small_items} and big={big_items}."
            " It is measured from windows of at least two micro-batches (or two ranks)."
        )
    grad_sq_norm = (big_items * big_sq_norm - small_items * small_sq_norm) / (big_items - small_items)
    trace_cov = (small_sq_norm - big_sq_norm) / (1.0 / small_items - 1.0 / big_items)
    return grad_sq_norm, trace_cov


@dataclass(frozen=True)
class NoiseScale:
    """The smoothed estimates after some windows.

    Attributes:
        grad_sq_norm: the smoothed estimate of ``|G|²``.
        trace_cov: the smoothed estimate of ``tr(Σ)``.
        windows: how many windows went into them.
    """

    grad_sq_norm: float
    trace_cov: float
    windows: int

    @property
    def gradient_noise_scale(self) -> float:
        """``B_simple = tr(Σ) / |G|²`` in items; ``nan`` while ``|G|²`` is not yet estimated as positive."""
        if not self.grad_sq_norm > 0:
            return math.nan
        return self.trace_cov / self.grad_sq_norm


class NoiseScaleEstimator:
    """Smooths the two unbiased estimates over windows and divides them.

    Args:
        beta: the moving average's decay per window, in ``[0, 1)``; ``0`` keeps only the last window.

    Raises:
        TypeError: ``beta`` is not a number.
        ValueError: ``beta`` is outside ``[0, 1)``.

    Examples:
        >>> estimator = NoiseScaleEstimator(beta=0.9)
        >>> for _ in range(3):
        ...     estimator.update(small_sq_norm=5.0, small_items=2, big_sq_norm=2.0, big_items=8)
        >>> estimate = estimator.value()
        >>> estimate.grad_sq_norm, estimate.trace_cov, estimate.gradient_noise_scale, estimate.windows
        (1.0, 8.0, 8.0, 3)
    """

    def __init__(self, beta: float = 0.99) -> None:
        self.beta = check_number(
            beta,
            "beta",
            0,
            1,
            max_inclusive=False,
            hint="It is the moving average's decay per window: 0.99 averages over about 100 windows.",
        )
        self._grad_sq_norm = 0.0
        self._trace_cov = 0.0
        self._windows = 0

    def update(self, small_sq_norm: float, small_items: float, big_sq_norm: float, big_items: float) -> None:
        """Add one window's pair of squared norms (see `unbiased_estimates`)."""
        grad_sq_norm, trace_cov = unbiased_estimates(small_sq_norm, small_items, big_sq_norm, big_items)
        self.add_estimates(grad_sq_norm, trace_cov)

    def add_estimates(self, grad_sq_norm: float, trace_cov: float, windows: int = 1) -> None:
        """Add already-unbiased estimates (e.g. the mean over ranks of each rank's own) covering ``windows``."""
        check_int(windows, "windows", minimum=1)
        decay = self.beta**windows
        self._grad_sq_norm = decay * self._grad_sq_norm + (1.0 - decay) * grad_sq_norm
        self._trace_cov = decay * self._trace_cov + (1.0 - decay) * trace_cov
        self._windows += windows

    def value(self) -> NoiseScale:
        """The bias-corrected moving averages (``nan`` before the first window)."""
        if self._windows == 0:
            return NoiseScale(math.nan, math.nan, 0)
        correction = 1.0 - self.beta**self._windows
        return NoiseScale(self._grad_sq_norm / correction, self._trace_cov / correction, self._windows)

    def state_dict(self) -> dict[str, Any]:
        return {
            "beta": self.beta,
            "grad_sq_norm": self._grad_sq_norm,
            "trace_cov": self._trace_cov,
            "windows": self._windows,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._grad_sq_norm = float(state.get("grad_sq_norm", 0.0))
        self._trace_cov = float(state.get("trace_cov", 0.0))
        self._windows = int(state.get("windows", 0))
