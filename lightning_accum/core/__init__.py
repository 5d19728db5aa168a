"""The accumulation core every front end holds: windows, their exact weights, the noise scale and the step record.

Pure: no Trainer. ``engine`` drives a window (plan, count, weigh, close), ``hand_window`` is the window a hand-written
loop runs (manual optimization, Fabric), ``normalization`` holds the exactness arithmetic, ``noise_scale`` the gradient
noise scale, and ``step_report`` the record of one optimizer step that an owner publishes and the monitor reads. The
front ends import the core through this face.
"""

from lightning_accum.core.engine import AccumulationEngine, ClosedWindow, HoldsEngine, Ranks, WindowPlan
from lightning_accum.core.hand_window import HandWindow
from lightning_accum.core.normalization import ItemCounter, LossReduction, WindowTotals
from lightning_accum.core.step_report import AccumulationEvent, LossSum, Mode, StepReport

__all__ = [
    "AccumulationEngine",
    "AccumulationEvent",
    "ClosedWindow",
    "HandWindow",
    "HoldsEngine",
    "ItemCounter",
    "LossReduction",
    "LossSum",
    "Mode",
    "Ranks",
    "StepReport",
    "WindowPlan",
    "WindowTotals",
]
