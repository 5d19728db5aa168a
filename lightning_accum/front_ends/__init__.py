"""The front ends: thin glue from a framework's hooks to the accumulation core (`lightning_accum.core`).

The Trainer callbacks (`AccumulationScheduler`, `AutoMicroBatching`, `AccumulationMonitor`), manual optimization
(`ManualAccumulation`) and Lightning Fabric. Users import them from `lightning_accum`, `lightning_accum.callbacks`
and `lightning_accum.front_ends.manual`.
"""
