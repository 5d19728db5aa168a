"""What a change of ``k`` does to the learning rate: the one rule every schedule and front end shares. Pure.

A schedule with an ``lr_scaling`` (`lightning_accum.schedules.StepwiseSchedule`,
`lightning_accum.schedules.BatchSizeRamp`, `lightning_accum.schedules.AdaptiveBatchSize`) names the rule;
`lightning_accum.core.engine.ScheduleDriver` turns a change of ``k`` into a factor (`lr_factor`, or an adaptive
schedule's `LearningRateRule`), and each front end hands that factor to `scale_learning_rates` with the optimizers
and LR schedulers it owns: the ``Trainer``'s all of them, ``ManualAccumulation`` its own optimizer's and its
schedulers, the Fabric front end its optimizer.

The rules: ``"linear"`` multiplies the learning rate by ``k_new / k_old``, ``"sqrt"`` by its square root. The two
gain rules follow the gradient noise scale, so only `lightning_accum.schedules.AdaptiveBatchSize` (which measures it)
takes them: ``"gain"`` keeps the learning rate at AdaScale's gain ratio (Johnson et al., ICML 2020) of the present
global batch over the smallest one, ``r = (b / k_min + 1) / (b / k + 1)`` with ``b`` the noise scale in micro-steps,
which is ``k / k_min`` while the batch is far under the noise scale and levels off above it, as a batch's worth in
samples does; ``"sqrt_gain"`` keeps it at the square root of that ratio, AdaptDL's rule for Adam, AdamW and RMSProp
(Pollux, OSDI 2021).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, Literal, get_args

from torch.optim import Optimizer

from lightning_accum._util.validation import check_choice

LRScaling = Literal["linear", "sqrt"]
GainScaling = Literal["gain", "sqrt_gain"]
AdaptiveLRScaling = Literal["linear", "sqrt", "gain", "sqrt_gain"]
_FIXED_RULES: tuple[LRScaling, ...] = get_args(LRScaling)
_GAIN_RULES: tuple[GainScaling, ...] = get_args(GainScaling)


def check_lr_scaling(value: Any, *, noise_scale: bool = False) -> Any:
    """``value`` if it is a rule this schedule can apply, or ``None``.

    ``"linear"`` and ``"sqrt"`` fit every schedule; ``"gain"`` and ``"sqrt_gain"`` only one that measures the noise
    scale (``noise_scale``).

    Raises:
        ValueError: any other value; a gain rule on a schedule that does not measure the noise scale.

    Examples:
        >>> check_lr_scaling("sqrt"), check_lr_scaling("sqrt_gain", noise_scale=True)
        ('sqrt', 'sqrt_gain')
    """
    if value is None:
        return None
    if value in _GAIN_RULES and not noise_scale:
        raise ValueError(
            f"`lr_scaling={value!r}` follows the gradient noise scale, which only AdaptiveBatchSize measures. Use"
            " 'linear' or 'sqrt' on this schedule, or None to leave the learning rate alone."
        )
    choices = _FIXED_RULES + (_GAIN_RULES if noise_scale else ())
    return check_choice(value, "lr_scaling", choices, hint="Or None to leave the learning rate alone.")


def lr_factor(scaling: LRScaling | None, before: int, after: int) -> float:
    """What the learning rate is multiplied by when ``k`` goes from ``before`` to ``after`` under ``scaling``.

    Examples:
        >>> lr_factor("linear", 2, 6), lr_factor("sqrt", 2, 8), lr_factor(None, 2, 8)
        (3.0, 2.0, 1.0)
    """
    if scaling is None or before == after:
        return 1.0
    ratio = after / before
    return ratio if scaling == "linear" else math.sqrt(ratio)


def gain_multiplier(scaling: GainScaling, k: float, base_k: float, noise_steps: float | None) -> float:
    """The learning rate at ``k`` micro-steps over the one at ``base_k`` under a gain rule.

    ``noise_steps`` is the noise scale in micro-steps (items over items per micro-step, all ranks); while it is
    unknown (``None``) the multiplier is 1.

    Examples:
        >>> [gain_multiplier(rule, 8, 2, 8.0) for rule in ("gain", "sqrt_gain")], gain_multiplier("gain", 8, 2, 0.0)
        ([2.5, 1.5811388300841898], 1.0)
    """
    if noise_steps is None:
        return 1.0
    ratio = (noise_steps / base_k + 1.0) / (noise_steps / k + 1.0)
    return ratio if scaling == "gain" else math.sqrt(ratio)


class LearningRateRule:
    """The learning-rate factor of each change of ``k`` under ``scaling``, the multiplier applied so far kept.

    For a gain rule, the factor brings the learning rate from the multiplier applied so far to the rule's multiplier
    of the new ``k`` at the present noise scale: the noise scale moves between changes, so each change corrects the
    last. The fixed rules need no memory (`lr_factor`).

    Args:
        scaling: ``"linear"``, ``"sqrt"``, ``"gain"``, ``"sqrt_gain"`` or ``None``.
        base_k: the ``k`` the learning rate was set for (a gain rule's multiplier is 1 there).

    Examples:
        >>> rule = LearningRateRule("gain", base_k=2)
        >>> rule.factor(2, 4, noise_steps=None), rule.factor(4, 8, noise_steps=8.0)  # unknown: 1; then (4+1)/(1+1)
        (1.0, 2.5)
        >>> round(rule.factor(8, 16, noise_steps=2.0), 4)  # a smaller noise scale: a gain of 2 / 1.125, under 2.5
        0.7111
    """

    def __init__(self, scaling: AdaptiveLRScaling | None, base_k: int) -> None:
        self.fixed: LRScaling | None = scaling if scaling == "linear" or scaling == "sqrt" else None
        self.gain: GainScaling | None = scaling if scaling == "gain" or scaling == "sqrt_gain" else None
        self.base_k = base_k
        self.applied = 1.0  # the gain rule's multiplier the learning rate holds now

    def factor(self, before: int, after: int, noise_steps: float | None) -> float:
        """What the learning rate is multiplied by when ``k`` goes from ``before`` to ``after``."""
        if self.gain is None:
            return lr_factor(self.fixed, before, after)
        wanted = gain_multiplier(self.gain, after, self.base_k, noise_steps)
        factor, self.applied = wanted / self.applied, wanted
        return factor

    def state_dict(self) -> dict[str, float]:
        return {"applied": self.applied}

    def load_state_dict(self, state: Mapping[str, Any], k: int, noise_steps: float | None) -> None:
        """Restore; a checkpoint without the multiplier takes the learning rate it finds as right for ``k``."""
        if "applied" in state:
            self.applied = float(state["applied"])
        elif self.gain is not None:
            self.applied = gain_multiplier(self.gain, k, self.base_k, noise_steps)


def scale_learning_rates(optimizers: Iterable[Optimizer], schedulers: Iterable[Any], factor: float) -> None:
    """Multiply every param group's learning rate in ``optimizers`` by ``factor``, and their schedulers' base rates.

    A scheduler recomputes the rate from its base rates, so those follow too (``schedulers`` holds the LR schedulers
    of those optimizers; others are the caller's to leave out).
    """
    if factor == 1.0:
        return
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["lr"] *= factor
    for scheduler in schedulers:
        if hasattr(scheduler, "base_lrs"):
            scheduler.base_lrs = [lr * factor for lr in scheduler.base_lrs]
