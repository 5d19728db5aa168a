"""Sequences of different lengths, in one place: their padding, their one token cut, and the balanced sampler.

``padded`` reads a batch's padded sequences (`PaddedSequences`), ``masks`` every form of padding mask, ``token_cut``
cuts a step batch by a token budget (the one cut: the balancing prices a share by the same), ``balanced_sampler`` and
``balancing`` deal a global step batch by cost (by the price of each rank's cut: ``run_deal`` in runs of neighbouring
lengths, ``priced_share`` pricing a share as the deal that mixes lengths grows it, ``share_moves`` the moves that
relieve the slowest rank), and ``pass_timing`` measures what a pass costs on your model (`measure_step_cost`). Pure:
no Trainer.
"""

from lightning_accum.sequences.balanced_sampler import BalancedBatchSampler
from lightning_accum.sequences.balancing import StepCost
from lightning_accum.sequences.padded import PaddedSequences
from lightning_accum.sequences.pass_timing import measure_step_cost

__all__ = ["BalancedBatchSampler", "PaddedSequences", "StepCost", "measure_step_cost"]
