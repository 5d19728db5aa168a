"""Exact, memory-aware, schedulable gradient accumulation for PyTorch Lightning."""

from lightning_accum._util import log, moved
from lightning_accum.callbacks import AccumulationMonitor, AccumulationScheduler, AutoMicroBatching
from lightning_accum.fabric import FabricAccumulation, FabricMicroBatching
from lightning_accum.manual import ManualAccumulation
from lightning_accum.schedules import AdaptiveBatchSize, BatchSizeRamp, ConstantSchedule, Progress, StepwiseSchedule
from lightning_accum.split.preflight import in_preflight

__version__ = "0.1.0"

log.configure()
log.show_warnings_as_the_package()
moved.install()

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
