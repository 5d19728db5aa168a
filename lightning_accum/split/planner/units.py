"""What the micro-batch planner's sizes count: samples, or padded tokens. Pure: no Trainer, no device.

`lightning_accum.split.planner.MicroBatchPlanner` decides one size per step from measured peaks and OOMs; its unit says
what that size is, what the smallest one is, how a size is used under the planner's limit, and which peak model fits
the measurements:

=================  ===================================  ============================================================
unit               the size                             the smallest size
=================  ===================================  ============================================================
`Samples`          samples per micro-batch, balanced    ``min_micro_batch_size``
                   so that micro-batches are even
`Tokens`           the token budget: padded tokens      the step's longest sequence (a micro-batch of one sequence:
                   (samples x longest length) per       shrinking further cannot help it)
                   micro-batch
=================  ===================================  ============================================================
"""

from __future__ import annotations

import math
from typing import Literal

from lightning_accum._util.validation import check_int
from lightning_accum.memory.model import LinearPeakModel, SequencePeakModel
from lightning_accum.split.planner.settings import PlannerSettings

PeakModel = LinearPeakModel | SequencePeakModel


class Samples:
    """Sizes count samples (split mode's default).

    Examples:
        >>> Samples().balance(40, 100, PlannerSettings())  # 3 micro-batches under 40: 34 + 34 + 32
        34
    """

    noun = "micro-batch size"
    counts: Literal["samples", "tokens"] = "samples"

    def set_longest(self, longest: int) -> None:
        """The step's longest sequence, which a size in samples does not depend on: nothing to set."""

    def floor(self, settings: PlannerSettings) -> int:
        """The smallest size: an OOM there cannot be helped by shrinking."""
        return settings.min_micro_batch_size

    def length(self) -> int:
        """The length a size is measured at: split by tokens the step's longest sequence; by samples 1, unknown."""
        return 1

    def least_shrink(self, size: int) -> int:
        """The least a shrink for a peak over the budget takes off ``size``: in samples, 1.

        `balance` then gives the step one micro-batch more at least, a step whose memory the next peak measures.
        """
        return 1

    def balance(self, limit: int, step_size: int | None, settings: PlannerSettings) -> int:
        """The size used under ``limit``: as many micro-batches as ``limit`` needs, evened out.

        This never adds a pass and lowers the peak: 100 samples under 40 run as 34 + 34 + 32, not 40 + 40 + 20.
        """
        if step_size is None:
            return limit
        cap = max(1, min(limit, step_size))
        k = math.ceil(step_size / cap)
        balanced = math.ceil(step_size / k)  # <= cap because cap >= step_size / k
        return balanced if balanced >= min(settings.min_micro_batch_size, cap) else cap

    def new_model(self, max_sizes: int = 16) -> PeakModel:
        """A peak model in this unit."""
        return LinearPeakModel(max_sizes=max_sizes)


class Tokens(Samples):
    """Sizes count padded tokens: the token budget of `lightning_accum.sequences.PaddedSequences` split mode.

    The split cuts each step batch into micro-batches within the budget
    (`lightning_accum.sequences.token_cut.TokenCut`), so a budget is used as it is, not balanced. Before each decision
    the caller sets `longest`, the step's longest sequence (the largest over ranks): it is the smallest useful budget,
    and the length the peak model costs.

    Examples:
        >>> unit = Tokens()
        >>> unit.set_longest(256)
        >>> unit.floor(PlannerSettings()), unit.balance(4096, 64 * 256, PlannerSettings())
        (256, 4096)
    """

    noun = "token budget"
    counts: Literal["samples", "tokens"] = "tokens"

    def __init__(self) -> None:
        self.longest = 1
        self._model: SequencePeakModel | None = None  # the planner holds one model at a time

    def set_longest(self, longest: int) -> None:
        """The step's longest sequence, in tokens (at least 1)."""
        self.longest = max(1, check_int(longest, "longest", 0))
        if self._model is not None:
            self._model.length = self.longest

    def floor(self, settings: PlannerSettings) -> int:
        return self.longest

    def length(self) -> int:
        return self.longest

    def least_shrink(self, size: int) -> int:
        """An eighth of ``size``, and one longest sequence at least.

        A token budget is not balanced, so a fit over noisy peaks could take one token off (2048 -> 2047 -> 2046 in a
        user's CPU run): the same cut, the same peak, and another shrink at the next step.
        """
        return max(self.longest, math.ceil(size / 8))

    def balance(self, limit: int, step_size: int | None, settings: PlannerSettings) -> int:
        return limit if step_size is None else max(1, min(limit, step_size))

    def new_model(self, max_sizes: int = 16) -> PeakModel:
        model = SequencePeakModel(max_sizes=max_sizes)
        model.length = self.longest
        self._model = model
        return model
