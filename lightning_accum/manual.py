"""``ManualAccumulation``: exact accumulation and one gradient sync per step under manual optimization.

The public path; the front end lives in `lightning_accum.front_ends.manual`.
"""

from lightning_accum.front_ends.manual import ManualAccumulation

__all__ = ["ManualAccumulation"]
