"""What a change of ``k`` does to the learning rate: the one rule every schedule and front end shares. Pure.

A schedule with an ``lr_scaling`` (`lightning_accum.schedules.StepwiseSchedule`,
`lightning_accum.schedules.BatchSizeRamp`, `lightning_accum.schedules.AdaptiveBatchSize`) names the rule;
`lightning_accum.core.engine.ScheduleDriver` turns a change of ``k`` into a factor (`lr_factor`), and each front end
hands that factor to `scale_learning_rates` with the optimizers and LR schedulers it owns: the ``Trainer``'s all of
them, ``ManualAccumulation`` its own optimizer's and its schedulers, the Fabric front end its optimizer.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Literal

from torch.optim import Optimizer

from lightning_accum._util.validation import check_choice

LRScaling = Literal["linear", "sqrt"]


def check_lr_scaling(value: Any) -> LRScaling | None:
    """``value`` if it is ``"linear"``, ``"sqrt"`` or ``None``.

    Raises:
        ValueError: any other value.

    Examples:
        >>> check_lr_scaling("sqrt")
        'sqrt'
    """
    if value is None:
        return None
    scaling: LRScaling = check_choice(
        value, "lr_scaling", ("linear", "sqrt"), hint="Or None to leave the learning rate alone."
    )
    return scaling


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
