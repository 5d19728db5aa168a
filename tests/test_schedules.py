import pytest

from lightning_accum.schedules import (
    BatchSizeRamp,
    ConstantSchedule,
    Progress,
    StepwiseSchedule,
    as_schedule,
    k_for_global_batch,
)


def test_stepwise_schedule_implies_k1_before_the_first_key():
    schedule = StepwiseSchedule({2: 4}, unit="epoch")
    assert [schedule.accumulation_steps(Progress(epoch=e)) for e in range(4)] == [1, 1, 4, 4]


def test_stepwise_schedule_copies_the_users_mapping():
    milestones = {0: 2}
    schedule = StepwiseSchedule(milestones)
    milestones[0] = 8
    assert schedule.accumulation_steps(Progress()) == 2


@pytest.mark.parametrize("unit", ["epoch", "step", "sample"])
def test_stepwise_schedule_reads_the_unit(unit):
    schedule = StepwiseSchedule({0: 1, 10: 3}, unit=unit)
    field = {"epoch": "epoch", "step": "optimizer_steps", "sample": "consumed_samples"}[unit]
    assert schedule.accumulation_steps(Progress(**{field: 9})) == 1
    assert schedule.accumulation_steps(Progress(**{field: 10})) == 3


def test_ramp_follows_megatron_increments():
    # (128 - 32) / 32 = 3 increments over 300 samples: +32 every 100 samples.
    ramp = BatchSizeRamp(start=32, target=128, increment=32, ramp_samples=300)
    assert [ramp.global_batch_size(s) for s in (0, 99, 100, 199, 200, 299, 300, 10**6)] == [
        32,
        32,
        64,
        64,
        96,
        96,
        128,
        128,
    ]


def test_ramp_translates_global_batch_into_k():
    ramp = BatchSizeRamp(start=32, target=128, increment=32, ramp_samples=300)
    # 96 samples with micro-batches of 8 on 2 ranks: 96 / 16 = 6 accumulation steps.
    assert ramp.accumulation_steps(Progress(consumed_samples=250, micro_batch_size=8, world_size=2)) == 6


def test_ramp_refuses_a_global_batch_that_does_not_divide_unless_told_how_to_round():
    ramp = BatchSizeRamp(start=40, target=40, increment=8, ramp_samples=0)
    with pytest.raises(ValueError, match=r"global batch size 40 is not a multiple of .* = 16.*rounding="):
        ramp.accumulation_steps(Progress(micro_batch_size=8, world_size=2))
    for rounding, k in (("floor", 2), ("ceil", 3), ("nearest", 2)):
        ramp = BatchSizeRamp(start=40, target=40, increment=8, ramp_samples=0, rounding=rounding)
        assert ramp.accumulation_steps(Progress(micro_batch_size=8, world_size=2)) == k


def test_k_for_global_batch_never_goes_below_one():
    assert k_for_global_batch(4, 16, "floor") == 1


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"start": 0}, ValueError, r"`start` must be an int >= 1, got 0"),
        ({"target": 16}, ValueError, r"`target` \(16\) must be >= `start` \(32\)"),
        ({"increment": 40}, ValueError, r"multiple of `increment` \(40\)"),
        ({"ramp_samples": -1}, ValueError, r"`ramp_samples` must be an int >= 0, got -1\. It counts consumed samples"),
        ({"ramp_samples": 2.5}, TypeError, r"`ramp_samples` must be an int >= 0, got 2.5 of type float"),
        ({"rounding": "up"}, ValueError, r"`rounding` must be one of 'error', 'floor', 'ceil', 'nearest', got 'up'"),
    ],
)
def test_ramp_bad_arguments(kwargs, error, match):
    args = {"start": 32, "target": 128, "increment": 32, "ramp_samples": 300, **kwargs}
    with pytest.raises(error, match=match):
        BatchSizeRamp(**args)


def test_as_schedule_accepts_a_user_schedule_object():
    class EveryOtherEpoch:
        def accumulation_steps(self, progress):
            return 1 + progress.epoch % 2

    schedule = EveryOtherEpoch()
    assert as_schedule(schedule) is schedule
    assert as_schedule(None) is None
    assert isinstance(as_schedule(3), ConstantSchedule)


@pytest.mark.parametrize(
    "build",
    [
        lambda scaling: StepwiseSchedule({0: 2, 4: 8}, unit="step", lr_scaling=scaling),
        lambda scaling: BatchSizeRamp(start=8, target=32, increment=24, ramp_samples=16, lr_scaling=scaling),
    ],
    ids=["StepwiseSchedule", "BatchSizeRamp"],
)
@pytest.mark.parametrize(("scaling", "factor"), [("linear", 4.0), ("sqrt", 2.0), (None, 1.0)])
def test_every_schedule_says_what_a_change_of_k_does_to_the_learning_rate(build, scaling, factor):
    # Issue 39: AdaptiveBatchSize's rule, on the fixed schedules too: k 2 -> 8 multiplies the rate by 4 or 2.
    from lightning_accum.core.engine import ScheduleDriver

    driver = ScheduleDriver(build(scaling))
    before = driver.plan(Progress(optimizer_steps=0, consumed_samples=0, micro_batch_size=4), step=0)
    after = driver.plan(Progress(optimizer_steps=4, consumed_samples=16, micro_batch_size=4), step=4)
    assert (before.k, after.k, before.lr_factor, after.lr_factor) == (2, 8, 1.0, factor)
    assert after.change is not None and (f"learning rate x{factor:.4g}" in after.change.reason) == (factor != 1.0)


def test_a_bad_lr_scaling_is_refused_at_construction():
    with pytest.raises(ValueError, match=r"`lr_scaling` must be 'linear' or 'sqrt', got 'cubic'\. Or None"):
        StepwiseSchedule({0: 1}, lr_scaling="cubic")
    with pytest.raises(ValueError, match=r"`lr_scaling` must be 'linear' or 'sqrt', got 'square'\. Or None"):
        BatchSizeRamp(8, 16, 8, 100, lr_scaling="square")
