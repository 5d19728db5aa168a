"""Exact, memory-aware, schedulable gradient accumulation for PyTorch Lightning."""

from lightning_accum._util import log
from lightning_accum.front_ends.accumulation_monitor import AccumulationMonitor
from lightning_accum.front_ends.accumulation_scheduler import AccumulationScheduler
from lightning_accum.front_ends.auto_micro_batching import AutoMicroBatching
from lightning_accum.front_ends.fabric import FabricAccumulation, FabricMicroBatching
from lightning_accum.front_ends.manual import ManualAccumulation
from lightning_accum.probe.preflight import in_preflight
from lightning_accum.schedules import AdaptiveBatchSize, BatchSizeRamp, ConstantSchedule, Progress, StepwiseSchedule

__version__ = "0.1.0"

log.configure()

__all__ = [
    "AccumulationMonitor",
    "AdaptiveBatchSize",
    "AccumulationScheduler",
    "AutoMicroBatching",
    "BatchSizeRamp",
    "ConstantSchedule",
    "FabricAccumulation",
    "FabricMicroBatching",
    "ManualAccumulation",
    "Progress",
    "StepwiseSchedule",
    "in_preflight",
]
