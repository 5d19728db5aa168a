"""The cold start of split mode: the first step batch traced on fake tensors, to start at the size predicted to fit.

Run by `lightning_accum.split.session.SplitSession` for every front end; the trace and its fit are
`lightning_accum.split.preflight`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn

from lightning_accum._util.distributed import HasRanks, max_across_ranks
from lightning_accum._util.log import log_info
from lightning_accum.batches import BatchHooks
from lightning_accum.memory.backends import MemoryBackend, free_bytes
from lightning_accum.memory.oom import describe_error
from lightning_accum.sequences import PaddedSequences
from lightning_accum.sequences.token_cut import TokenCut
from lightning_accum.split.planner import MicroBatchPlanner
from lightning_accum.split.preflight import Preflight, fallback_warning, preflight


@dataclass(frozen=True)
class PreflightStart:
    """The cold start of an ``"auto"`` run: trace the first step, and start at the largest size predicted to fit.

    The trace runs on fake tensors, on every rank alike (`run`). By tokens (``sequences``), the sizes are token
    budgets.
    """

    ranks: HasRanks  # the Trainer, or Fabric's host: every rank takes part in one small all-reduce
    module: Any  # what the trace runs: the LightningModule, or Fabric's model with its loss function
    batch: Any
    planner: MicroBatchPlanner
    hooks: BatchHooks
    backend: MemoryBackend
    optimizers: Sequence[Any]
    precision: Any = "32-true"
    sequences: PaddedSequences | None = None

    def run(self) -> Preflight | None:
        """Start the planner where this rank's and every other rank's traces allow; returns this rank's trace.

        Every rank calls one small all-reduce here, whatever its trace found (an error included): the smallest
        prediction wins, and a failed trace on any rank means every rank starts from the whole step batch, as
        without a pre-flight.
        """
        found: Preflight | None = None
        try:
            start, why, found = self._predicted()
        except Exception as err:  # e.g. a batch the hooks can't count: the first step's own checks will say so
            start, why = None, f"{type(err).__name__}: {describe_error(err)}"
        # Max over ranks of (failed, -start): any failure falls back everywhere, else the smallest start wins.
        local = torch.tensor([int(start is None), -(start or 0)], dtype=torch.int64)
        failed, negative_start = (int(v) for v in max_across_ranks(self.ranks, local).tolist())
        if failed:
            rank_zero_warn(fallback_warning(why if start is None else None))
            return found
        planner = self.planner
        planner.start_from(-negative_start)
        assert found is not None
        small, large = sorted(found.peaks)
        step_size = self._first_cut()[1]
        counts = " tokens" if self.sequences is not None else ""
        log_info(
            f"lightning_accum: pre-flight traced micro-batches of {small} and {large}{counts} on fake tensors in"
            f" {found.seconds:.2f} s; starting at {planner.unit.noun} {planner.size_for(step_size)} of {step_size}"
        )
        return found

    def _first_cut(self) -> tuple[BatchHooks | TokenCut, int]:
        """How the trace cuts the first step batch, and the batch's size in the planner's unit."""
        if self.sequences is None:
            return self.hooks, self.hooks.batch_size(self.batch)
        cut = self.sequences.cut(self.batch, self.hooks)
        self.planner.unit.set_longest(cut.longest)
        return cut, cut.tokens

    def _predicted(self) -> tuple[int | None, str, Preflight | None]:
        """This rank's predicted starting size (``None``: no prediction), why there is none, and its trace."""
        planner, backend = self.planner, self.backend
        budget = planner.budget_bytes
        cutter, step_size = self._first_cut()
        small, large = max(1, step_size // 4), max(1, step_size // 2)
        if small == large or budget is None:
            return None, f"a step batch of {step_size} {planner.unit.counts} is too small to trace at two sizes", None
        found = preflight(
            self.module,
            self.batch,
            (small, large),
            optimizers=self.optimizers,
            precision=self.precision,
            hooks=cutter,
        )
        if found.peak_model is None:
            return None, str(found.reason), found
        start = found.starting_micro_batch_size(budget, step_size, backend.current_bytes(), free_bytes(backend))
        # Predicted not to fit at all: begin where an OOM would end up.
        return (planner.unit.floor(planner.settings) if start is None else start), "", found
