"""The micro-batch planner's settings, each written once with its default and its check: `PlannerSettings`.

`lightning_accum.split.planner.MicroBatchPlanner` reads every setting through a `PlannerSettings`. `AutoMicroBatching`
takes the same settings as keyword arguments (LightningCLI reads a callback's signature, so they stay explicit
there) with their defaults read from here, builds a `PlannerSettings` from them, and records
`PlannerSettings.run_config` in the run config.
"""

from __future__ import annotations

import dataclasses
from dataclasses import KW_ONLY, dataclass
from typing import Literal

from lightning_accum._util.validation import check_bool, check_int, check_number


@dataclass(frozen=True)
class PlannerSettings:
    """How the split-mode planner chooses the micro-batch size ``b``; checked once, when built.

    The class attributes are the defaults (``PlannerSettings.grow_patience == 20``): a signature that repeats a
    setting as a keyword takes its default from here.

    Attributes:
        micro_batch_size: ``"auto"`` starts from the whole step batch (or from the memory model's answer when it is
            already fitted, e.g. after a pre-flight trace or a probe); an int starts there.
        min_micro_batch_size: never go below this; an OOM at this size raises
            `lightning_accum.split.planner.messages.MicroBatchOOMError` with the memory figures.
        pin_micro_batch_size: treat the int ``micro_batch_size`` as fixed: no shrinking on memory pressure and no
            growing past it. An OOM still shrinks it (the alternative is a crash), and it grows back to it after the
            cool-down.
        low_watermark: the fraction of the budget the peak must stay below for the planner to grow ``b``; once the
            memory model is fitted, the fraction of the budget left after the fixed memory.
        grow_patience: consecutive steps under the low watermark before growing.
        oom_cooldown: steps before a size that failed (an OOM, a peak over the budget, allocator retries), or any
            larger one, may be tried again.
        predictive: predict sizes from the memory model fitted to the measured peaks (``peak(b) = fixed + per_sample
            * b``; by tokens, ``fixed + T (a + c L)``); ``False`` halves and doubles.
        refit_tolerance: a measured peak further than this fraction from the model's prediction starts a new model
            (a new phase of training, such as longer sequences).

    Raises:
        TypeError: a setting has the wrong type.
        ValueError: a setting is out of range, ``micro_batch_size`` is below ``min_micro_batch_size``, or
            ``pin_micro_batch_size=True`` comes with ``micro_batch_size="auto"``.

    Examples:
        >>> settings = PlannerSettings(16, grow_patience=5)
        >>> settings.grow_patience, settings.oom_cooldown, PlannerSettings.oom_cooldown
        (5, 200, 200)
        >>> settings.run_config()["micro_batch_size"]
        16
        >>> PlannerSettings(grow_patience=0)
        Traceback (most recent call last):
            ...
        ValueError: `grow_patience` must be an int >= 1, got 0.
    """

    micro_batch_size: int | Literal["auto"] = "auto"
    _: KW_ONLY
    min_micro_batch_size: int = 1
    pin_micro_batch_size: bool = False
    low_watermark: float = 0.7
    grow_patience: int = 20
    oom_cooldown: int = 200
    predictive: bool = True
    refit_tolerance: float = 0.25

    def __post_init__(self) -> None:
        # The checks run in the order the planner checked its arguments before these settings existed, so that
        # a value with two faults is still refused for the same one.
        if self.micro_batch_size != "auto":
            check_int(self.micro_batch_size, "micro_batch_size", 1, alternative='"auto"')
        check_int(self.min_micro_batch_size, "min_micro_batch_size", 1)
        if isinstance(self.micro_batch_size, int) and self.micro_batch_size < self.min_micro_batch_size:
            raise ValueError(
                f"`micro_batch_size={self.micro_batch_size}` is below"
                f" `min_micro_batch_size={self.min_micro_batch_size}`. Lower `min_micro_batch_size` or raise"
                " `micro_batch_size`."
            )
        low_watermark = check_number(
            self.low_watermark,
            "low_watermark",
            0,
            1,
            min_inclusive=False,
            max_inclusive=False,
            kind="fraction of the budget",
            hint="For example 0.7 grows the micro-batch after the peak stayed under 70% of the budget.",
        )
        check_int(self.grow_patience, "grow_patience", 1)
        check_int(self.oom_cooldown, "oom_cooldown", 0)
        check_bool(self.predictive, "predictive")
        check_bool(self.pin_micro_batch_size, "pin_micro_batch_size")
        if self.pin_micro_batch_size and self.micro_batch_size == "auto":
            raise ValueError(
                '`pin_micro_batch_size=True` needs an int `micro_batch_size` to pin, got "auto". Pass e.g.'
                " `micro_batch_size=8`, or leave the size unpinned."
            )
        refit_tolerance = check_number(self.refit_tolerance, "refit_tolerance", 0, min_inclusive=False)
        # Stored as floats, as the checks return them (an int 1 becomes 1.0); frozen, hence `object.__setattr__`.
        object.__setattr__(self, "low_watermark", low_watermark)
        object.__setattr__(self, "refit_tolerance", refit_tolerance)

    def run_config(self) -> dict[str, int | float | bool | str]:
        """Every setting by name, for the run config (plain values: W&B and YAML take them as they are)."""
        return dataclasses.asdict(self)
