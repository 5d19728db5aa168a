"""How many optimizer steps a run takes under a schedule (Lightning's step estimate): `count_optimizer_steps`. Pure."""

from __future__ import annotations

import math

from lightning_accum.schedules import AccumulationSchedule, ConstantSchedule, Progress


def count_optimizer_steps(
    schedule: AccumulationSchedule,
    *,
    batches_per_epoch: int,
    max_epochs: int,
    max_steps: int = -1,
    micro_batch_size: int = 1,
    samples_per_epoch: int | None = None,
    world_size: int = 1,
) -> int:
    """The number of optimizer steps a run takes when ``schedule`` sets ``k`` window by window.

    It replays what window mode does: a window starts, asks the schedule for ``k`` with the progress so far, takes up
    to ``k`` micro-batches, and never crosses an epoch boundary (the epoch's last window is short). Lightning's own
    estimate, ``ceil(batches / accumulate_grad_batches) * max_epochs``, is the special case of a constant ``k``.

    Args:
        schedule: the schedule, asked exactly as the callback asks it.
        batches_per_epoch: micro-batches per epoch on one rank (``trainer.num_training_batches``).
        max_epochs: epochs in the run.
        max_steps: stop after this many optimizer steps (``-1``: no limit).
        micro_batch_size: samples per micro-batch on one rank, for sample-keyed schedules.
        samples_per_epoch: samples per epoch on one rank, when the last micro-batch is short; default
            ``batches_per_epoch * micro_batch_size``.
        world_size: data-parallel ranks; consumed samples count all of them.

    Examples:
        10 micro-batches per epoch at k=4 make windows of 4, 4 and 2, so two epochs take 6 steps:

        >>> from lightning_accum.schedules import ConstantSchedule, StepwiseSchedule
        >>> count_optimizer_steps(ConstantSchedule(4), batches_per_epoch=10, max_epochs=2)
        6
        >>> count_optimizer_steps(StepwiseSchedule({0: 1, 3: 4}, unit="step"), batches_per_epoch=10, max_epochs=1)
        5
    """
    full_epoch = batches_per_epoch * micro_batch_size
    epoch_samples = full_epoch if samples_per_epoch is None else samples_per_epoch
    last_batch_samples = micro_batch_size - (full_epoch - epoch_samples)
    steps = consumed = 0
    for epoch in range(max(max_epochs, 1)):
        if isinstance(schedule, ConstantSchedule) or getattr(schedule, "unit", None) == "epoch":
            # k is fixed within the epoch: no need to walk its windows one by one.
            k = schedule.accumulation_steps(Progress(epoch, steps, consumed, micro_batch_size, world_size))
            steps += math.ceil(batches_per_epoch / k)
            consumed += epoch_samples * world_size
        else:
            done = 0
            while done < batches_per_epoch and (max_steps < 0 or steps < max_steps):
                progress = Progress(epoch, steps, consumed, micro_batch_size, world_size)
                taken = min(schedule.accumulation_steps(progress), batches_per_epoch - done)
                done += taken
                short = last_batch_samples if done == batches_per_epoch else micro_batch_size
                consumed += ((taken - 1) * micro_batch_size + short) * world_size
                steps += 1
        if 0 <= max_steps <= steps:
            return max_steps
    return steps
