"""The micro-batch planner of split mode: which size (samples, or a token budget) the next step runs at.

``micro_batch_planner`` decides (shrink before memory runs out, recover from an OOM, grow back), ``settings`` holds
its settings with their checks, ``units`` what its sizes count, ``history`` what past steps left for its next
decision, ``messages`` what it says when shrinking cannot help, and ``simulation`` runs it against a synthetic
device. Pure: no Trainer, no device.
"""

from lightning_accum.split.planner.micro_batch_planner import MicroBatchPlanner, PlannerEvent
from lightning_accum.split.planner.settings import PlannerSettings
from lightning_accum.split.planner.simulation import simulate
from lightning_accum.split.planner.units import Samples, Tokens

__all__ = ["MicroBatchPlanner", "PlannerEvent", "PlannerSettings", "Samples", "Tokens", "simulate"]
