"""The gain rules of ``AdaptiveBatchSize(lr_scaling=...)``: the learning rate follows AdaScale's gain ratio.

``"gain"`` keeps the learning rate at ``r = (b / k_min + 1) / (b / k + 1)`` times the one set for ``k_min``, ``b``
being the noise scale in micro-steps; ``"sqrt_gain"`` at its square root (AdaptDL's rule for Adam).
"""

from __future__ import annotations

import math
import random

import pytest
from torch.utils.data import DataLoader

from lightning_accum import AccumulationScheduler
from lightning_accum.core.learning_rate import LearningRateRule, gain_multiplier
from lightning_accum.schedules import AdaptiveBatchSize, BatchSizeRamp, Progress, StepwiseSchedule
from tests.helpers import IndexedDataset, RegressionModel, make_trainer


@pytest.mark.parametrize("k", [3, 4, 8, 64])
def test_the_gain_is_linear_far_under_the_noise_scale_flat_far_over_it_and_between_in_between(k):
    assert gain_multiplier("gain", k, 2, 1e12) == pytest.approx(k / 2)
    assert gain_multiplier("gain", k, 2, 1e-9) == pytest.approx(1.0)
    for noise_steps in (1.0, 8.0, 100.0):
        gain = gain_multiplier("gain", k, 2, noise_steps)
        assert 1.0 < gain < k / 2
        assert gain_multiplier("sqrt_gain", k, 2, noise_steps) == pytest.approx(math.sqrt(gain))
    assert gain_multiplier("gain", k, 2, None) == 1.0  # unknown: the rate stays


def test_the_factors_of_a_path_multiply_to_the_gain_of_its_last_k_at_its_last_noise_scale():
    # The noise scale moves between changes, so each change corrects what the last one applied.
    rng = random.Random(0)
    for scaling in ("gain", "sqrt_gain"):
        rule, k, product = LearningRateRule(scaling, base_k=2), 2, 1.0
        for _ in range(20):
            after, noise_steps = rng.randint(2, 64), rng.choice([None, rng.uniform(0.5, 500.0)])
            product *= rule.factor(k, after, noise_steps)
            k = after
            if noise_steps is not None:
                assert product == pytest.approx(gain_multiplier(scaling, k, 2, noise_steps))
        assert product == pytest.approx(rule.applied)


def noise_steps_schedule(scaling, **kwargs) -> AdaptiveBatchSize:
    settings = {"max_accumulation_steps": 6, "objective": "noise_scale", "warmup_windows": 1, "beta": 0.0}
    return AdaptiveBatchSize(2, lr_scaling=scaling, **{**settings, "max_growth": None, **kwargs})


@pytest.mark.parametrize(("scaling", "factor"), [("gain", 2.0), ("sqrt_gain", math.sqrt(2.0)), ("linear", 3.0)])
def test_the_noise_scale_is_read_in_micro_steps_of_all_ranks(scaling, factor):
    schedule = noise_steps_schedule(scaling)
    # 16 items over 2 micro-batches on each of 2 ranks: 4 items a micro-batch and rank, 8 a micro-step. A noise scale
    # of 48 items is 6 micro-steps, so k goes to 6 and the gain over k = 2 is (6/2 + 1) / (6/6 + 1) = 2.
    schedule.observe(items=16.0, micro_batches=2, world_size=2, noise=(1.0, 48.0))
    assert schedule.accumulation_steps(Progress()) == 6
    assert schedule.lr_factor(2, 6) == pytest.approx(factor)


def test_a_checkpoint_carries_the_multiplier_applied_so_far():
    def observe(schedule, noise_scale):
        schedule.observe(items=16.0, micro_batches=2, world_size=1, noise=(1.0, noise_scale))

    whole = noise_steps_schedule("gain", max_accumulation_steps=64, max_growth=2.0)
    observe(whole, 64.0)  # 8 items a micro-step: 8 micro-steps, k 2 -> 4
    first = whole.lr_factor(2, 4)
    observe(whole, 28.0)  # 3.5 micro-steps: k stays 4, the rate stays where 8 micro-steps put it
    assert whole.accumulation_steps(Progress()) == 4
    saved = whole.state_dict()
    observe(whole, 400.0)  # 50 micro-steps: k 4 -> 8
    second = whole.lr_factor(4, 8)
    resumed = noise_steps_schedule("gain", max_accumulation_steps=64, max_growth=2.0)
    resumed.load_state_dict(saved)
    observe(resumed, 400.0)
    assert resumed.accumulation_steps(Progress()) == 8
    assert resumed.lr_factor(4, 8) == pytest.approx(second)
    assert first * second == pytest.approx(gain_multiplier("gain", 8, 2, 50.0))
    # A checkpoint written before the multiplier was saved: the rate found is taken as right for the k restored, at
    # the noise scale restored.
    old = {key: value for key, value in saved.items() if key != "lr"}
    legacy = noise_steps_schedule("gain", max_accumulation_steps=64, max_growth=2.0)
    legacy.load_state_dict(old)
    assert legacy._lr.applied == pytest.approx(gain_multiplier("gain", 4, 2, 3.5))


@pytest.mark.parametrize("schedule", [StepwiseSchedule, BatchSizeRamp])
@pytest.mark.parametrize("scaling", ["gain", "sqrt_gain"])
def test_a_gain_rule_on_a_schedule_without_a_noise_scale_is_refused(schedule, scaling):
    build = (
        (lambda: StepwiseSchedule({0: 1}, lr_scaling=scaling))
        if schedule is StepwiseSchedule
        else (lambda: BatchSizeRamp(8, 16, 8, 100, lr_scaling=scaling))
    )
    with pytest.raises(ValueError, match=rf"`lr_scaling='{scaling}'` follows the gradient noise scale, which only"):
        build()


def test_an_unknown_rule_names_the_gain_rules_on_adaptive_batch_size():
    with pytest.raises(
        ValueError, match=r"must be one of 'linear', 'sqrt', 'gain', 'sqrt_gain', got 'adascale'\. Or None"
    ):
        AdaptiveBatchSize(lr_scaling="adascale")


def test_under_the_trainer_the_rate_ends_between_none_and_the_square_root_rule(tmp_path):
    # y is pure noise, so the noise scale rises as the fit converges and k grows (tests/test_adaptive_batch_size.py).
    schedule = AdaptiveBatchSize(2, 8, objective="noise_scale", warmup_windows=5, beta=0.8, lr_scaling="sqrt_gain")
    model = RegressionModel(lr=0.2)
    trainer = make_trainer(tmp_path, [AccumulationScheduler(schedule)], max_epochs=2)
    trainer.fit(model, DataLoader(IndexedDataset(256), batch_size=4))
    k_end = schedule.accumulation_steps(Progress())
    changes = [event for event in trainer.callbacks[0].events if event.kind == "schedule_change"]
    assert changes and k_end > 2 and all("learning rate x" in event.reason for event in changes)
    lr = trainer.optimizers[0].param_groups[0]["lr"]
    assert lr == pytest.approx(0.2 * schedule._lr.applied)
    assert 0.2 < lr < 0.2 * math.sqrt(k_end / 2)  # the gain is under k_end / 2: less than the "sqrt" rule
