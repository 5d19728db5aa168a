"""The monitor's arithmetic: rates and units, the metric row, the totals and the end-of-fit summary. No Trainer.

`lightning_accum.AccumulationMonitor` (in `lightning_accum.front_ends`) is the callback over it.
"""
