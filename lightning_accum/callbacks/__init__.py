"""Lightning callbacks: thin glue between Lightning's hooks and the pure core."""

from lightning_accum.callbacks.accumulation_scheduler import AccumulationScheduler

__all__ = ["AccumulationScheduler"]
