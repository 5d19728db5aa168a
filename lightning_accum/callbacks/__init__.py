"""Lightning callbacks (the public path): `AccumulationScheduler`, `AutoMicroBatching` and `AccumulationMonitor`.

The callbacks live in `lightning_accum.front_ends`, beside the other front ends.
"""

from lightning_accum.front_ends.accumulation_monitor import AccumulationMonitor
from lightning_accum.front_ends.accumulation_scheduler import AccumulationScheduler
from lightning_accum.front_ends.auto_micro_batching import AutoMicroBatching

__all__ = ["AccumulationMonitor", "AccumulationScheduler", "AutoMicroBatching"]
