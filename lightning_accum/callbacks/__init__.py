"""The Trainer callbacks, each in a module of its own at its public path (as Lightning lays out its own).

`AccumulationScheduler` (window mode), `AutoMicroBatching` (split mode), `AccumulationMonitor` (the figures), and
`BalancedSamplerState` (a `lightning_accum.sequences.BalancedBatchSampler` resumed mid-epoch).
"""

from lightning_accum.callbacks.accumulation_monitor import AccumulationMonitor
from lightning_accum.callbacks.accumulation_scheduler import AccumulationScheduler
from lightning_accum.callbacks.auto_micro_batching import AutoMicroBatching
from lightning_accum.callbacks.balanced_sampler_state import BalancedSamplerState

__all__ = ["AccumulationMonitor", "AccumulationScheduler", "AutoMicroBatching", "BalancedSamplerState"]
