"""Lightning Fabric: exact, memory-aware accumulation in a loop of your own (the public path).

`FabricAccumulation` (window mode) and `FabricMicroBatching` (split mode) live in `lightning_accum.front_ends.fabric`,
beside the other front ends.
"""

from lightning_accum.front_ends.fabric import FabricAccumulation, FabricMicroBatching

__all__ = ["FabricAccumulation", "FabricMicroBatching"]
