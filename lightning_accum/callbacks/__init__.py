"""Lightning callbacks (the public path): the accumulation callbacks, and `BalancedSamplerState` for the sampler.

`AccumulationScheduler`, `AutoMicroBatching` and `AccumulationMonitor` live in `lightning_accum.front_ends`, beside the
other front ends.
"""

from lightning_accum.front_ends.accumulation_monitor import AccumulationMonitor
from lightning_accum.front_ends.accumulation_scheduler import AccumulationScheduler
from lightning_accum.front_ends.auto_micro_batching import AutoMicroBatching
from lightning_accum.front_ends.balanced_sampler_state import BalancedSamplerState

__all__ = ["AccumulationMonitor", "AccumulationScheduler", "AutoMicroBatching", "BalancedSamplerState"]
