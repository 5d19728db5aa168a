"""Lightning callbacks: thin glue between Lightning's hooks and the pure core."""

from lightning_accum.callbacks.accumulation_monitor import AccumulationMonitor
from lightning_accum.callbacks.accumulation_scheduler import AccumulationScheduler
from lightning_accum.callbacks.auto_micro_batching import AutoMicroBatching

__all__ = ["AccumulationMonitor", "AccumulationScheduler", "AutoMicroBatching"]
