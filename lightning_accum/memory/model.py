"""A linear model of peak memory as a function of the micro-batch size: ``peak(b) ~= fixed + per_sample * b``.

Pure: no device, no Trainer. The planner feeds it measured peaks and asks it which micro-batch fits a budget,
so that it can *predict* the fitting size instead of probing for it with out-of-memory errors.

Why linear: parameters, gradients and optimizer state do not depend on ``b`` (the intercept), while activations
and most temporaries grow in proportion to the samples in flight (the slope). Attention without a fused kernel is
quadratic in the *sequence length*, not in ``b``, so at a fixed sequence length it is still linear in ``b``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, overload

import torch

from lightning_accum._util.validation import check_int, check_number

_STATE_VERSION = 1


class _FitTerm(property):
    """A read-only property: one coefficient of a peak model's fit (``model._fit[index]``), or ``None`` before a fit.

    A `property` itself, so that it reads, documents and refuses assignment as one written with ``@property`` does.
    """

    def __init__(self, index: int, doc: str) -> None:
        def term(model: Any) -> float | None:
            fit: tuple[float, ...] | None = model._fit
            return None if fit is None else fit[index]

        super().__init__(term)
        self.__doc__ = doc  # on the instance: a subclass's own docstring would shadow `property(doc=...)`

    # Typed, where `property.__get__` returns Any: the models' coefficients stay `float | None` to mypy.
    @overload
    def __get__(self, instance: None, owner: type | None = None, /) -> _FitTerm: ...

    @overload
    def __get__(self, instance: object, owner: type | None = None, /) -> float | None: ...

    def __get__(self, instance: object, owner: type | None = None, /) -> _FitTerm | float | None:
        return super().__get__(instance, owner)  # type: ignore[no-any-return]  # `property.__get__` returns Any


class LinearPeakModel:
    """Least-squares fit of ``peak(b) = fixed_bytes + per_sample_bytes * b`` over observed peaks.

    History is bounded: the model keeps only the most recent peak for each micro-batch size, and at most
    ``max_sizes`` sizes (the least recently observed size is dropped first). Keeping the latest peak per size
    lets the model follow drift (allocator fragmentation, a longer sequence) without letting the many
    observations at the current size outweigh the few at other sizes.

    The fit is clamped so that ``per_sample_bytes >= 0``: memory that *falls* with more samples is measurement
    noise, and a negative slope would make `largest_fitting` answer "any size fits". When the unclamped
    slope is negative, the model falls back to a flat line at the mean observed peak.

    Args:
        max_sizes: how many distinct micro-batch sizes to remember (>= 2).

    Raises:
        TypeError: if ``max_sizes`` is not an int.
        ValueError: if ``max_sizes < 2``.

    Examples:
        >>> model = LinearPeakModel()
        >>> model.observe(2, 1_000 + 2 * 100)
        >>> model.fitted()
        False
        >>> model.observe(8, 1_000 + 8 * 100)
        >>> model.fitted(), model.fixed_bytes, model.per_sample_bytes
        (True, 1000.0, 100.0)
        >>> model.predict(4)
        1400.0
        >>> model.largest_fitting(budget_bytes=1_650, upper=64)
        6
        >>> model.largest_fitting(budget_bytes=500, upper=64) is None
        True
    """

    def __init__(self, max_sizes: int = 16) -> None:
        self.max_sizes = check_int(max_sizes, "max_sizes", 2, hint="A line needs two sizes to fit.")
        # micro-batch size -> most recent peak; dict order is recency order (oldest first).
        self._peaks: dict[int, float] = {}
        self._fit: tuple[float, float] | None = None

    # ---- observations -------------------------------------------------------------------------------------------

    def observe(self, micro_batch_size: int, peak_bytes: float) -> None:
        """Record the peak measured for one micro-batch size, replacing any earlier peak for that size."""
        b = check_int(micro_batch_size, "micro_batch_size", 1)
        peak = check_number(peak_bytes, "peak_bytes", 0, kind="number of bytes")
        self._peaks.pop(b, None)  # re-insert so that the dict order stays recency order
        self._peaks[b] = peak
        while len(self._peaks) > self.max_sizes:
            del self._peaks[next(iter(self._peaks))]
        self._fit = self._solve()

    @property
    def observations(self) -> dict[int, float]:
        """A copy of the remembered ``{micro_batch_size: peak_bytes}``, sorted by size."""
        return dict(sorted(self._peaks.items()))

    def fitted(self) -> bool:
        """Whether at least two distinct micro-batch sizes have been observed, so a line is defined."""
        return self._fit is not None

    def _solve(self) -> tuple[float, float] | None:
        if len(self._peaks) < 2:
            return None
        xs = list(self._peaks)
        ys = list(self._peaks.values())
        n = len(xs)
        mean_x = sum(xs) / n
        mean_y = sum(ys) / n
        sxx = sum((x - mean_x) ** 2 for x in xs)
        sxy = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True))
        slope = sxy / sxx  # sxx > 0: the keys are distinct
        if slope < 0:
            # Least squares with slope fixed at 0 is the mean; see the class docstring for why we clamp.
            return mean_y, 0.0
        return mean_y - slope * mean_x, slope

    # ---- the fit --------------------------------------------------------------------------------------------------

    fixed_bytes = _FitTerm(
        0, "The intercept: memory that does not depend on the micro-batch size, or ``None`` before a fit."
    )
    per_sample_bytes = _FitTerm(1, "The slope (>= 0): memory per sample of the micro-batch, or ``None`` before a fit.")

    def _require_fit(self, what: str) -> tuple[float, float]:
        if self._fit is None:
            raise RuntimeError(
                f"`LinearPeakModel.{what}` needs a fit, but only {len(self._peaks)} distinct micro-batch size(s) "
                f"were observed ({sorted(self._peaks)}). Call `observe` with at least two different sizes first."
            )
        return self._fit

    def predict(self, micro_batch_size: int) -> float:
        """Predicted peak bytes for ``micro_batch_size``.

        Raises:
            RuntimeError: if the model is not fitted yet.
        """
        b = check_int(micro_batch_size, "micro_batch_size", 1)
        fixed, per_sample = self._require_fit("predict")
        return fixed + per_sample * b

    def largest_fitting(self, budget_bytes: float, upper: int) -> int | None:
        """The largest ``b`` in ``[1, upper]`` with ``predict(b) <= budget_bytes``, or ``None`` if even 1 doesn't fit.

        Raises:
            RuntimeError: if the model is not fitted yet.
        """
        budget = check_number(budget_bytes, "budget_bytes", 0, kind="number of bytes")
        upper = check_int(upper, "upper", 1)
        fixed, per_sample = self._require_fit("largest_fitting")
        if fixed + per_sample > budget:
            return None
        if per_sample == 0:
            return upper
        b = min(upper, math.floor((budget - fixed) / per_sample))
        # Guard against float rounding at the boundary: the answer must satisfy predict(b) <= budget.
        while b > 1 and fixed + per_sample * b > budget:
            b -= 1
        while b < upper and fixed + per_sample * (b + 1) <= budget:
            b += 1
        return max(b, 1)

    def relative_error(self, observations: Iterable[tuple[int, float]] | Mapping[int, float]) -> float:
        """Mean of ``|predict(b) - peak| / peak`` over ``(b, peak)`` pairs, e.g. peaks held out of the fit.

        Raises:
            RuntimeError: if the model is not fitted yet.
            ValueError: if ``observations`` is empty or holds a peak of 0 bytes.

        Examples:
            >>> model = LinearPeakModel()
            >>> model.observe(1, 110.0); model.observe(3, 130.0)
            >>> model.relative_error({2: 100.0, 4: 140.0})
            0.1
        """
        pairs = list(observations.items() if isinstance(observations, Mapping) else observations)
        if not pairs:
            raise ValueError("`observations` must hold at least one (micro_batch_size, peak_bytes) pair, got none.")
        errors = []
        for b, peak in pairs:
            peak = check_number(peak, "peak_bytes", 0, kind="number of bytes")
            if peak == 0:
                raise ValueError(
                    f"`observations` holds a peak of 0 bytes for micro-batch size {b}; a relative error is undefined "
                    "there. Drop that pair."
                )
            errors.append(abs(self.predict(b) - peak) / peak)
        return sum(errors) / len(errors)

    # ---- checkpointing --------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The remembered peaks, in recency order, as plain Python values."""
        peaks = [[b, p] for b, p in self._peaks.items()]
        return {"version": _STATE_VERSION, "max_sizes": self.max_sizes, "peaks": peaks}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from `state_dict`; missing keys keep their defaults so older checkpoints still load.

        Examples:
            >>> a = LinearPeakModel(); a.observe(1, 10.0); a.observe(2, 12.0)
            >>> b = LinearPeakModel(); b.load_state_dict(a.state_dict())
            >>> b.predict(3)
            14.0
        """
        self.max_sizes = check_int(state.get("max_sizes", self.max_sizes), "state['max_sizes']", 2)
        self._peaks = {}
        self._fit = None
        for b, peak in state.get("peaks", []):
            self.observe(int(b), float(peak))

    def __repr__(self) -> str:
        if self._fit is None:
            return f"LinearPeakModel(unfitted, sizes={sorted(self._peaks)})"
        return f"LinearPeakModel(fixed_bytes={self._fit[0]:.4g}, per_sample_bytes={self._fit[1]:.4g})"


class SequencePeakModel:
    """Peak memory of a micro-batch of ``T`` padded tokens whose sequences are ``L`` long: ``fixed + T (a + c L)``.

    Split mode by tokens sizes micro-batches by their padded tokens ``T`` (samples x longest length). Most of what a
    micro-batch adds grows with ``T`` (``a`` per token); attention without a fused kernel also holds scores for every
    pair of positions, ``samples x L²`` = ``T x L``, which the ``c`` term carries. The length is the step's longest
    sequence, which the planner sets (`length`) before it observes or asks: its micro-batch costs the most per token.

    Fitted by least squares on the latest peak of each ``(T, L)`` seen (at most ``max_sizes`` of them). While every
    observation shares one length, ``c`` cannot be told from ``a`` and is 0: the per-token cost is the one measured
    at that length. Both coefficients are kept >= 0 (memory that falls with more tokens is noise). The interface is
    `LinearPeakModel`'s, in tokens, so the planner uses either alike.

    Args:
        max_sizes: how many distinct ``(T, L)`` to remember (>= 2).

    Examples:
        Peaks of ``1000 + T (2 + 0.5 L)`` bytes at three shapes:

        >>> model = SequencePeakModel()
        >>> for tokens, length in ((64, 8), (128, 8), (128, 32)):
        ...     model.length = length
        ...     model.observe(tokens, 1000 + tokens * (2 + 0.5 * length))
        >>> model.length = 16
        >>> round(model.predict(100)), model.largest_fitting(budget_bytes=2000, upper=4096)
        (2000, 100)
    """

    def __init__(self, max_sizes: int = 16) -> None:
        self.max_sizes = check_int(max_sizes, "max_sizes", 2, hint="A line needs two sizes to fit.")
        self.length = 1  # the sequence length observations and predictions are for
        self._peaks: dict[tuple[int, int], float] = {}  # (tokens, length) -> latest peak, in recency order
        self._fit: tuple[float, float, float] | None = None  # fixed, a, c

    def observe(self, tokens: int, peak_bytes: float) -> None:
        """Record the peak of a micro-batch of ``tokens`` padded tokens at the current `length`."""
        key = (check_int(tokens, "tokens", 1), check_int(self.length, "length", 1))
        self._peaks.pop(key, None)
        self._peaks[key] = check_number(peak_bytes, "peak_bytes", 0, kind="number of bytes")
        while len(self._peaks) > self.max_sizes:
            del self._peaks[next(iter(self._peaks))]
        self._fit = _fit_sequence_peaks(self._peaks)

    def fitted(self) -> bool:
        """Whether two different token counts have been observed, so that a line is defined."""
        return self._fit is not None

    fixed_bytes = _FitTerm(0, "Memory that does not depend on the micro-batch, or ``None`` before a fit.")

    @property
    def per_sample_bytes(self) -> float | None:
        """Memory per padded token at the current `length` (the planner's per-unit cost), or ``None``."""
        return None if self._fit is None else self._fit[1] + self._fit[2] * self.length

    per_token_bytes = _FitTerm(
        1, "``a``: memory per padded token that does not depend on the length, or ``None`` before a fit."
    )
    per_token_length_bytes = _FitTerm(
        2, "``c``: memory per padded token and position of length (attention's ``T x L`` term), or ``None``."
    )

    def predict(self, tokens: int, length: int | None = None) -> float:
        """Predicted peak of a micro-batch of ``tokens`` padded tokens of sequences ``length`` long.

        ``length``: the current `length` by default.

        Raises:
            RuntimeError: if the model is not fitted yet.
        """
        fixed, a, c = self._require_fit()
        return fixed + check_int(tokens, "tokens", 1) * (a + c * (self.length if length is None else length))

    def largest_fitting(self, budget_bytes: float, upper: int, length: int | None = None) -> int | None:
        """The largest token count in ``[1, upper]`` predicted to fit ``budget_bytes``, sequences ``length`` long.

        ``length``: the current `length` by default.

        Raises:
            RuntimeError: if the model is not fitted yet.
        """
        budget = check_number(budget_bytes, "budget_bytes", 0, kind="number of bytes")
        upper = check_int(upper, "upper", 1)
        fixed, a, c = self._require_fit()
        per_token = a + c * (self.length if length is None else length)
        if fixed + per_token > budget:
            return None
        if per_token == 0:
            return upper
        tokens = min(upper, math.floor((budget - fixed) / per_token))
        while tokens > 1 and fixed + per_token * tokens > budget:  # float rounding at the boundary
            tokens -= 1
        return max(tokens, 1)

    def _require_fit(self) -> tuple[float, float, float]:
        if self._fit is None:
            raise RuntimeError(
                "`SequencePeakModel` needs a fit: observe micro-batches of at least two different token counts first."
            )
        return self._fit

    def state_dict(self) -> dict[str, Any]:
        """The remembered peaks, in recency order, as plain Python values."""
        peaks = [[t, length, p] for (t, length), p in self._peaks.items()]
        return {"version": _STATE_VERSION, "max_sizes": self.max_sizes, "peaks": peaks, "length": self.length}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from `state_dict` (missing keys keep their defaults)."""
        self.max_sizes = check_int(state.get("max_sizes", self.max_sizes), "state['max_sizes']", 2)
        self._peaks, self._fit = {}, None
        length = int(state.get("length", 1))
        for entry in state.get("peaks", []):
            tokens, self.length, peak = (
                (int(entry[0]), int(entry[1]), float(entry[2]))
                if len(entry) == 3
                else (int(entry[0]), length, float(entry[1]))
            )
            self.observe(tokens, peak)
        self.length = length

    def __repr__(self) -> str:
        if self._fit is None:
            return f"SequencePeakModel(unfitted, shapes={sorted(self._peaks)})"
        fixed, a, c = self._fit
        return f"SequencePeakModel(fixed_bytes={fixed:.4g}, per_token_bytes={a:.4g}, per_token_length_bytes={c:.4g})"


def _fit_sequence_peaks(peaks: Mapping[tuple[int, int], float]) -> tuple[float, float, float] | None:
    """Least squares ``peak = fixed + a T + c T L`` with ``a, c >= 0``; ``c = 0`` where the lengths can't tell."""
    if len({tokens for tokens, _ in peaks}) < 2:
        return None
    points = [(float(t), float(t * length), float(p)) for (t, length), p in peaks.items()]
    full = _least_squares([(1.0, x, z) for x, z, _ in points], [y for _, _, y in points])
    if full is not None and full[1] >= 0 and full[2] >= 0:
        return full[0], full[1], full[2]
    # One length only, or a negative coefficient: the best fit with one of them at 0.
    by_tokens = _least_squares([(1.0, x) for x, _, _ in points], [y for _, _, y in points])
    by_area = _least_squares([(1.0, z) for _, z, _ in points], [y for _, _, y in points])
    candidates = []
    if by_tokens is not None and by_tokens[1] >= 0:
        candidates.append((by_tokens[0], by_tokens[1], 0.0))
    if by_area is not None and by_area[1] >= 0 and full is not None:  # `full` defined: the lengths differ
        candidates.append((by_area[0], 0.0, by_area[1]))
    if not candidates:
        mean = sum(y for _, _, y in points) / len(points)
        return mean, 0.0, 0.0
    return min(candidates, key=lambda fit: _squared_error(fit, points))


def _least_squares(rows: list[tuple[float, ...]], ys: list[float]) -> tuple[float, ...] | None:
    """The solution of the normal equations, or ``None`` where they are singular (columns that can't be told apart)."""
    design = torch.tensor(rows, dtype=torch.float64)
    target = torch.tensor(ys, dtype=torch.float64)
    gram = design.T @ design
    scale = gram.diagonal().clamp(min=1e-300).sqrt()
    normalized = gram / scale[:, None] / scale[None, :]
    if torch.linalg.matrix_rank(normalized, rtol=1e-9) < len(rows[0]):
        return None
    solution = torch.linalg.solve(gram, design.T @ target)
    return tuple(float(v) for v in solution)


def _squared_error(fit: tuple[float, float, float], points: list[tuple[float, float, float]]) -> float:
    fixed, a, c = fit
    return sum((fixed + a * x + c * z - y) ** 2 for x, z, y in points)
