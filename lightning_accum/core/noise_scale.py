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
(``1 / (1 - beta)`` windows) as the noise scale grows during training. A measurement that is not finite (a window
whose gradient overflowed, which a user's guard then skips) is left out and counted, never averaged in: one NaN would
make the average NaN for the rest of the run.

`WindowNoiseMeter` takes the two squared norms from a front end (window mode, split mode, manual optimization) and
turns them into one window's estimates, also when the gradients are sharded (FSDP2) or averaged over ranks (DDP).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_accum._util.validation import check_int, check_number

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch < 2.4: no sharded gradients to meet
    DTensor = None  # type: ignore[assignment, misc]  # the fallback where torch has no DTensor: mypy reads 2.13


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
        skipped: how many measurements were left out because they were not finite.
    """

    grad_sq_norm: float
    trace_cov: float
    windows: int
    skipped: int = 0

    @property
    def gradient_noise_scale(self) -> float:
        """``B_simple = tr(Σ) / |G|²`` in items; ``nan`` while ``|G|²`` is not yet estimated as positive."""
        if not self.grad_sq_norm > 0:
            return math.nan
        return self.trace_cov / self.grad_sq_norm


class NoiseScaleEstimator:
    """Smooths the two unbiased estimates over windows and divides them.

    A measurement whose ``|G|²`` or ``tr(Σ)`` is NaN or infinite is skipped and counted in ``skipped``.

    Args:
        beta: the moving average's decay per window, in ``[0, 1)``; ``0`` keeps only the last window.

    Raises:
        TypeError: ``beta`` is not a number.
        ValueError: ``beta`` is outside ``[0, 1)``.

    Examples:
        >>> estimator = NoiseScaleEstimator(beta=0.9)
        >>> for _ in range(3):
        ...     estimator.update(small_sq_norm=5.0, small_items=2, big_sq_norm=2.0, big_items=8)
        >>> estimator.add_estimates(float("nan"), 8.0)  # a window whose gradient overflowed
        >>> estimate = estimator.value()
        >>> estimate.grad_sq_norm, estimate.trace_cov, estimate.gradient_noise_scale, estimate.windows
        (1.0, 8.0, 8.0, 3)
        >>> estimate.skipped
        1
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
        self.skipped = 0  # measurements left out because they were not finite

    def update(self, small_sq_norm: float, small_items: float, big_sq_norm: float, big_items: float) -> None:
        """Add one window's pair of squared norms (see `unbiased_estimates`)."""
        grad_sq_norm, trace_cov = unbiased_estimates(small_sq_norm, small_items, big_sq_norm, big_items)
        self.add_estimates(grad_sq_norm, trace_cov)

    def add_estimates(self, grad_sq_norm: float, trace_cov: float, windows: int = 1) -> None:
        """Add already-unbiased estimates (e.g. the mean over ranks of each rank's own) covering ``windows``.

        Estimates that are not finite are skipped (and counted in ``skipped``): they would stay in the average for good.
        """
        check_int(windows, "windows", minimum=1)
        if not (math.isfinite(grad_sq_norm) and math.isfinite(trace_cov)):
            self.skipped += 1
            return
        decay = self.beta**windows
        self._grad_sq_norm = decay * self._grad_sq_norm + (1.0 - decay) * grad_sq_norm
        self._trace_cov = decay * self._trace_cov + (1.0 - decay) * trace_cov
        self._windows += windows

    def value(self) -> NoiseScale:
        """The bias-corrected moving averages (``nan`` before the first window)."""
        if self._windows == 0:
            return NoiseScale(math.nan, math.nan, 0, self.skipped)
        correction = 1.0 - self.beta**self._windows
        return NoiseScale(self._grad_sq_norm / correction, self._trace_cov / correction, self._windows, self.skipped)

    def state_dict(self) -> dict[str, Any]:
        return {
            "beta": self.beta,
            "grad_sq_norm": self._grad_sq_norm,
            "trace_cov": self._trace_cov,
            "windows": self._windows,
            "skipped": self.skipped,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._grad_sq_norm = float(state.get("grad_sq_norm", 0.0))
        self._trace_cov = float(state.get("trace_cov", 0.0))
        self._windows = int(state.get("windows", 0))
        self.skipped = int(state.get("skipped", 0))


@dataclass(frozen=True)
class _FirstMicroBatch:
    window: int  # the front end's window counter, so that a capture is only ever paired with its own window
    sq_norm: Tensor  # of the gradient buffer, on the device (no host read yet)
    items: float | Tensor
    divisor: float  # the buffer holds `items / divisor` times the mean gradient over the micro-batch's items
    loss_scale: float


class WindowNoiseMeter:
    """One window's estimates ``(|G|², tr(Σ))`` from the two squared norms a window of accumulation has for free.

    A front end (window mode, split mode, manual optimization) calls `capture` after the backward of a window's first
    micro-batch, before any other is added and before the gradients are synced, and `measure` once the window's
    gradient is exact, at the optimizer step. Which windows are measured follows from the optimizer step count
    (`wants`), so a resumed run measures the windows an uninterrupted one does. No Trainer: the front end hands in
    the gradients, the counts and a sum over ranks.

    Each rank's first micro-batch gives its own pair with the window's gradient over all ranks, and the ranks'
    estimates are averaged. The window's gradient may be replicated (DDP: every rank holds all of it) or sharded
    (FSDP2's ``DTensor`` gradients: every rank its shard); each rank adds its local part, weighted by the share of the
    gradient it holds, so that the sum over ranks is the whole squared norm. That sum and the ranks' estimates travel
    in one all-reduce of six numbers per measured window.

    Examples:
        A window of two micro-batches of one item each; ``divisor=1.0``: the first buffer holds that micro-batch's
        gradient itself (``|G_small|² = 4``), and the window's mean gradient is ``(1.5, 0)``:

        >>> meter = WindowNoiseMeter()
        >>> meter.request(every=1)
        >>> meter.capture(step=0, window=1, gradients=[torch.tensor([2.0, 0.0])], items=1, divisor=1.0)
        >>> meter.measure(step=0, window=1, gradients=[torch.tensor([1.5, 0.0])], items=2.0, micro_batches=2)
        (0.5, 3.5)
        >>> unbiased_estimates(small_sq_norm=4.0, small_items=1, big_sq_norm=2.25, big_items=2)
        (0.5, 3.5)
    """

    def __init__(self) -> None:
        self.requested = False
        self.every = 1  # measure the windows whose optimizer step is a multiple of this
        self.last_step: int | None = -1  # the optimizer step of the last measurement; None: unknown (old checkpoint)
        self.windows = 0  # windows the last `measure` call's estimate stands for; 0 when it gave none
        self._first: _FirstMicroBatch | None = None

    def request(self, every: int = 1) -> None:
        """Measure every ``every``-th window; when several consumers ask, the most frequent wins."""
        every = check_int(every, "every", 1)
        self.every = min(self.every, every) if self.requested else every
        self.requested = True

    def wants(self, step: int) -> bool:
        """Whether the window of optimizer step ``step`` (counted from 0, the same on every rank) is measured."""
        return self.requested and step % self.every == 0

    def capture(
        self,
        step: int,
        window: int,
        gradients: list[Tensor],
        items: float | Tensor,
        divisor: float,
        loss_scale: float = 1.0,
    ) -> None:
        """Remember the squared norm of the window's first micro-batch's gradient (on the device: no host read).

        Args:
            step: the optimizer step the window belongs to.
            window: the front end's window counter, the same at `measure` for the same window.
            gradients: this rank's gradient buffers of that micro-batch alone, not synced across ranks.
            items: the micro-batch's items on this rank.
            divisor: the buffers hold ``items / divisor`` times the mean gradient over the micro-batch's items.
            loss_scale: the factor 16-bit mixed precision multiplied the gradients by (1 without it).

        Raises:
            RuntimeError: a gradient is a ``DTensor`` (tensor parallelism): this rank does not hold its own gradient.
        """
        if not self.wants(step) or not gradients:
            return
        if DTensor is not None and any(isinstance(g, DTensor) for g in gradients):
            raise RuntimeError(
                "The gradient noise scale needs each rank's own gradient of its first micro-batch, but here it is a"
                " `DTensor` spread over several ranks (tensor parallelism). Measure it with `tensor_parallel_size=1`,"
                " or turn it off (`AccumulationMonitor(gradient_noise_scale=False)`, a schedule other than"
                " `AdaptiveBatchSize`)."
            )
        self._first = _FirstMicroBatch(window, _squared_norm(gradients), items, divisor, loss_scale)

    def measure(
        self,
        step: int,
        window: int,
        gradients: list[Tensor],
        *,
        items: float,
        micro_batches: int,
        world_size: int = 1,
        sum_across_ranks: Callable[[Tensor], Tensor] | None = None,
    ) -> tuple[float, float] | None:
        """This window's ``(|G|², tr(Σ))``, averaged over the ranks that could measure it; ``None`` where none could.

        Call it at every optimizer step, after the gradient is exact, on every rank alike: on measured steps it holds
        one all-reduce. A rank whose window has one micro-batch has one batch size only and gives no pair of its own.
        The estimate is NaN where a gradient was (`NoiseScaleEstimator` skips it).

        Args:
            step: the optimizer step (as at `capture`).
            window: the front end's window counter (as at `capture`).
            gradients: the window's exact gradients on this rank: whole (replicated) tensors or ``DTensor`` shards.
            items: the window's items, all ranks.
            micro_batches: this rank's micro-batches in the window.
            world_size: the ranks the gradient is replicated or sharded over.
            sum_across_ranks: sums a small tensor over all ranks; ``None`` on a single process.
        """
        first, self._first = self._first, None
        self.windows = 0
        if not self.wants(step):
            return None
        if first is not None and first.window != window:
            first = None  # from an attempt that was abandoned (split mode retries a step after an OOM)
        if sum_across_ranks is None and (first is None or micro_batches < 2):
            return None  # alone, with no pair of batch sizes: nothing to measure (and no norm to read back)
        terms = _rank_terms(first, gradients, items, micro_batches, world_size)
        if sum_across_ranks is not None:
            terms = sum_across_ranks(torch.tensor(terms, dtype=torch.float64)).tolist()
        a, b, c, d, ranks, big_sq = terms
        if ranks <= 0:
            return None
        # A checkpoint from before the meter had state doesn't say: the interval is the best guess.
        self.windows = self.every if self.last_step is None else step - self.last_step
        self.last_step = step
        return (big_sq * a - b) / ranks, (d - big_sq * c) / ranks

    def state_dict(self) -> dict[str, Any]:
        return {"last_step": self.last_step}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        last_step = state.get("last_step")
        self.last_step = None if last_step is None else int(last_step)


def _rank_terms(
    first: _FirstMicroBatch | None, gradients: list[Tensor], items: float, micro_batches: int, world_size: int
) -> list[float]:
    """This rank's six addends: ``[a, b, c, d, 1, big]``, or ``[0, 0, 0, 0, 0, big]`` without a pair of its own.

    Summed over ranks, ``big`` is ``|G_big|²``, and the mean of the ranks' `unbiased_estimates` is
    ``((big·Σa - Σb) / R, (Σd - big·Σc) / R)``: ``a = B/(B - n)``, ``b = n·s/(B - n)``, ``c = 1/(1/n - 1/B)`` and
    ``d = s·c`` for a rank whose first micro-batch held ``n`` of the window's ``B`` items, at squared norm ``s``.
    """
    big = _shared_squared_norm(gradients, world_size)
    if first is None or micro_batches < 2:
        return [0.0, 0.0, 0.0, 0.0, 0.0, float(big)]
    device = first.sq_norm.device
    read = torch.stack(
        [first.sq_norm.double(), torch.as_tensor(first.items, dtype=torch.float64, device=device), big.to(device)]
    )
    small_sq, n_small, big_part = read.tolist()  # the one host read of a measured window
    if not 0 < n_small < items:
        return [0.0, 0.0, 0.0, 0.0, 0.0, big_part]
    small_sq *= (first.divisor / n_small) ** 2 / first.loss_scale**2
    c = 1.0 / (1.0 / n_small - 1.0 / items)
    return [items / (items - n_small), n_small * small_sq / (items - n_small), c, small_sq * c, 1.0, big_part]


def _shared_squared_norm(gradients: list[Tensor], world_size: int) -> Tensor:
    """This rank's part of the squared norm of ``gradients``: summed over the ``world_size`` ranks, the whole of it.

    A plain tensor is replicated on every rank, so each adds ``1 / world_size`` of its squared norm. A ``DTensor``
    (FSDP2) adds its local shard, weighted by the number of distinct shards over ``world_size``: 1 when every rank
    holds its own shard, less when shards are replicated too (HSDP).
    """
    shares: dict[float, list[Tensor]] = {}
    for grad in gradients:
        share, local = 1.0 / world_size, grad
        if DTensor is not None and isinstance(grad, DTensor):
            mesh = grad.device_mesh
            shards = math.prod(mesh.size(dim) for dim, p in enumerate(grad.placements) if p.is_shard())
            share, local = shards / world_size, grad.to_local()
        shares.setdefault(share, []).append(local)
    if not shares:
        return torch.zeros((), dtype=torch.float64)
    return torch.stack([share * _squared_norm(tensors).double() for share, tensors in shares.items()]).sum()


def _squared_norm(tensors: list[Tensor]) -> Tensor:
    """The squared L2 norm of all ``tensors`` together, as a tensor (no host read)."""
    norms = torch._foreach_norm(tensors)  # one fused kernel per device and dtype
    return torch.stack([n.float() for n in norms]).square().sum()
