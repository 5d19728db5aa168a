"""The goodput objective of AdaptiveBatchSize (issue 39): the k that trains fastest for the measured step cost."""

from __future__ import annotations

import copy
import math
import time

import pytest
import torch
from torch.utils.data import DataLoader

from lightning_accum import AccumulationMonitor, AccumulationScheduler, keys
from lightning_accum.core.batch_choice import (
    COST_START_WINDOWS,
    StepCost,
    StepCostAverage,
    balanced_accumulation_steps,
    choose_accumulation_steps,
    goodput,
    optimal_accumulation_steps,
    statistical_efficiency,
)
from lightning_accum.core.step_clock import StepClock
from lightning_accum.schedules import AdaptiveBatchSize, Progress
from tests.helpers import (
    FP32,
    IndexedDataset,
    RegressionModel,
    assert_grads_close,
    make_trainer,
    mse_loss,
    replay_reference,
)

# (micro-batch seconds c_mb, step overhead s, items per micro-batch n, ranks W, noise scale B_noise)
SETTINGS = [
    (0.010, 0.001, 8, 1, 64.0),  # cheap steps: k* = sqrt(0.001 * 64 / (8 * 0.010)) = 0.89, the smallest k
    (0.010, 0.040, 8, 1, 64.0),  # k* = sqrt(0.040 * 64 / 0.080) = 5.66
    (0.002, 0.050, 4, 2, 512.0),  # k* = sqrt(0.050 * 512 / (8 * 0.002)) = 40
    (0.005, 0.020, 16, 4, 2000.0),  # k* = sqrt(0.020 * 2000 / (64 * 0.005)) = 11.2
]


@pytest.mark.parametrize(("c_mb", "s", "n", "world", "noise"), SETTINGS)
def test_the_chosen_k_gives_the_global_batch_of_b_star(c_mb, s, n, world, noise):
    cost = StepCost(c_mb, s)
    per_item = c_mb / (n * world)  # the time of one item, all ranks working
    b_star = math.sqrt(noise * s / per_item)  # McCandlish's fastest global batch
    k_star = optimal_accumulation_steps(cost, n, world, noise)
    assert k_star * n * world == pytest.approx(b_star)
    choice = choose_accumulation_steps(1, 1, 256, cost, n, world, noise, min_gain=0.0)
    # The whole k of the largest goodput is one of the two around k*, and no other k does better.
    assert choice.best in {max(1, math.floor(k_star)), max(1, math.ceil(k_star))}
    rates = {k: goodput(k, cost, n, world, noise) for k in range(1, 257)}
    assert rates[choice.best] == max(rates.values())


def test_goodput_is_throughput_times_statistical_efficiency():
    cost = StepCost(micro_batch_seconds=0.5, overhead_seconds=1.0)
    # k=4 of 8 items on 2 ranks: 64 items in 4 * 0.5 + 1 = 3 s, each worth 1 / (1 + 64 / 32) of a small batch's item
    assert goodput(4, cost, 8, 2, 32.0) == pytest.approx(64 / 3.0 * (1 / 3))
    assert statistical_efficiency(64, 32.0) == pytest.approx(1 / 3)


def test_k_moves_only_for_a_predicted_gain_of_min_gain():
    cost = StepCost(0.010, 0.040)  # k* = 5.66 at n=8, B_noise=64: k=5 or 6
    near = choose_accumulation_steps(4, 1, 64, cost, 8, 1, 64.0, min_gain=0.05)
    gain = goodput(near.best, cost, 8, 1, 64.0) / goodput(4, cost, 8, 1, 64.0) - 1
    assert near.k == 4 and near.best in (5, 6) and near.gain == pytest.approx(gain) and 0 < gain < 0.05
    far = choose_accumulation_steps(1, 1, 64, cost, 8, 1, 64.0, min_gain=0.05)
    assert far.k == far.best and far.gain > 0.05


def feed(schedule: AdaptiveBatchSize, windows: int, cost: StepCost, n: float, noise: float, k_used: int = 2) -> None:
    """``windows`` windows of ``k_used`` micro-batches of ``n`` items, at ``cost``, with the noise scale ``noise``."""
    for _ in range(windows):
        schedule.observe_cost(cost.micro_batch_seconds * (k_used - 1), k_used - 1, cost.overhead_seconds, 1)
        schedule.observe(items=n * k_used, micro_batches=k_used, world_size=1, noise=(1.0, noise))


@pytest.mark.parametrize(("c_mb", "s", "n", "world", "noise"), [setting for setting in SETTINGS if setting[3] == 1])
def test_the_schedule_settles_at_the_k_of_b_star(c_mb, s, n, world, noise):
    schedule = AdaptiveBatchSize(2, 64, warmup_windows=1, beta=0.0, max_growth=None, min_gain=0.0)
    feed(schedule, 5, StepCost(c_mb, s), n, noise)
    k_star = optimal_accumulation_steps(StepCost(c_mb, s), n, 1, noise)
    k = schedule.accumulation_steps(Progress())
    assert k in {max(2, math.floor(k_star)), max(2, math.ceil(k_star))}
    assert schedule.target == pytest.approx(k_star, rel=1e-6)
    figures = schedule.figures()
    assert figures.statistical_efficiency == pytest.approx(statistical_efficiency(k * n, noise))
    assert figures.step_overhead_seconds == pytest.approx(s)


NOISE_SCALES = [2.0**e for e in range(-2, 24)]  # items: from far below one micro-batch to far above any batch


def best_goodput(cost: StepCost, n: int, world: int, noise: float) -> float:
    return max(goodput(k, cost, n, world, noise) for k in range(1, 4097))


@pytest.mark.parametrize(("c_mb", "s", "n", "world"), [(0.005, 0.030, 8, 2), (0.001, 0.050, 4, 1), (0.01, 0.08, 16, 8)])
def test_the_balanced_k_keeps_half_the_best_goodput_whatever_the_noise_scale(c_mb, s, n, world):
    cost = StepCost(c_mb, s)
    k = balanced_accumulation_steps(cost)
    assert k == s / c_mb  # these step costs are whole multiples of a micro-batch
    best = {noise: best_goodput(cost, n, world, noise) for noise in NOISE_SCALES}
    worst = {
        guess: min(goodput(guess, cost, n, world, noise) / best[noise] for noise in NOISE_SCALES)
        for guess in (k // 2, k, 2 * k)
    }
    assert worst[k] >= 0.5 - 1e-9  # the minimax guarantee, over noise scales from 0.25 to 8 M items
    assert worst[k // 2] < 0.5 and worst[2 * k] < 0.5, worst  # half or twice that k can lose more


def test_a_cheap_step_keeps_the_smallest_k_until_the_noise_scale_is_known():
    schedule = AdaptiveBatchSize(2, 64, warmup_windows=10)
    for _ in range(COST_START_WINDOWS + 3):
        schedule.observe_cost(0.010, 1, 0.004, 1)  # a micro-batch of 10 ms, a step of 4 ms
        schedule.observe(items=16.0, micro_batches=2, world_size=1, noise=None)
    assert schedule.accumulation_steps(Progress()) == 2 and schedule.reason == ""


def start(schedule: AdaptiveBatchSize, cost: StepCost, windows: int, noise: tuple[float, float] | None = None) -> list:
    path = []
    for _ in range(windows):
        k = schedule.accumulation_steps(Progress())
        schedule.observe_cost(cost.micro_batch_seconds * (k - 1), k - 1, cost.overhead_seconds, 1)
        schedule.observe(items=8.0 * k, micro_batches=k, world_size=1, noise=noise)
        path.append(schedule.accumulation_steps(Progress()))
    return path


def test_a_dear_step_leaves_the_smallest_k_after_four_timed_windows_before_the_noise_scale_is_known():
    schedule = AdaptiveBatchSize(2, 64, warmup_windows=10)
    path = start(schedule, StepCost(0.005, 0.030), COST_START_WINDOWS + 6)  # no noise estimate at all
    assert path == [2] * (COST_START_WINDOWS - 1) + [6] * 7, path  # once, at the 4th window: 30 ms / 5 ms
    assert "before the noise scale is known" in schedule.reason and "k 6 spends as long" in schedule.reason
    capped = AdaptiveBatchSize(2, 4, warmup_windows=10)
    assert start(capped, StepCost(0.005, 0.030), COST_START_WINDOWS)[-1] == 4  # within the bounds
    aimed = AdaptiveBatchSize(2, 64, objective="noise_scale", warmup_windows=10)
    assert start(aimed, StepCost(0.005, 0.030), COST_START_WINDOWS + 2) == [2] * (COST_START_WINDOWS + 2)


def test_the_first_noise_scale_may_take_the_guessed_k_back_down_once():
    # A dear step guesses k = 20; a noise scale of 16 items puts the best k at sqrt(0.1 * 16 / (8 * 0.005)) = 6.3.
    schedule = AdaptiveBatchSize(2, 64, warmup_windows=6, beta=0.0, max_growth=None)
    path = start(schedule, StepCost(0.005, 0.100), 12, noise=(1.0, 16.0))
    assert path[COST_START_WINDOWS - 1] == 20 and path[-1] in (6, 7), path
    # Once checked by the noise scale, k goes down no more without allow_decrease.
    path = start(schedule, StepCost(0.005, 0.100), 10, noise=(1.0, 1.0))
    assert set(path) == {path[0]}, path


def test_the_goodput_state_round_trips_and_a_restored_schedule_decides_alike():
    cost = StepCost(0.002, 0.05)
    schedule = AdaptiveBatchSize(2, 64, warmup_windows=3, beta=0.5)
    feed(schedule, 7, cost, 8, 256.0)
    restored = AdaptiveBatchSize(2, 64, warmup_windows=3, beta=0.5)
    restored.load_state_dict(copy.deepcopy(schedule.state_dict()))
    for target in (schedule, restored):
        feed(target, 9, cost, 8, 256.0, k_used=4)
    assert restored.accumulation_steps(Progress()) == schedule.accumulation_steps(Progress()) > 2
    assert restored.state_dict() == schedule.state_dict()


def test_a_checkpoint_from_before_the_goodput_start_resumes_past_it():
    cost = StepCost(0.005, 0.100)  # the clock alone would take k = 20
    saved = AdaptiveBatchSize(2, 64, warmup_windows=50).state_dict()
    del saved["phase"]  # what a checkpoint written before the start carries
    moved = AdaptiveBatchSize(2, 64, warmup_windows=50)
    moved.load_state_dict(saved | {"k": 8})  # it had left the minimum: past the start, it stays at 8
    assert start(moved, cost, COST_START_WINDOWS + 1) == [8] * (COST_START_WINDOWS + 1)
    fresh = AdaptiveBatchSize(2, 64, warmup_windows=50)
    fresh.load_state_dict(saved)  # still at the minimum: it takes the start
    assert start(fresh, cost, COST_START_WINDOWS)[-1] == 20


def test_a_goodput_checkpoint_resumed_under_the_noise_scale_objective_does_not_wait_for_a_clock():
    saved = AdaptiveBatchSize(2, 64, warmup_windows=1).state_dict()  # still timing: no window seen
    aimed = AdaptiveBatchSize(2, 64, objective="noise_scale", warmup_windows=1, beta=0.0)
    aimed.load_state_dict(saved)
    for _ in range(3):  # the noise-scale objective never times a step: it follows the noise scale, 160 / 16 = 10
        aimed.observe(items=32.0, micro_batches=2, world_size=1, noise=(1.0, 160.0))
    assert aimed.accumulation_steps(Progress()) > 2


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"objective": "fastest"}, r"`objective` must be 'goodput' or 'noise_scale', got 'fastest'\. 'goodput'"),
        (
            {"objective": "goodput", "factor": 2.0},
            r"`factor` \(2\.0\) applies to `objective='noise_scale'` only.* Pass `objective='noise_sc",
        ),
        ({"min_gain": -0.1}, r"`min_gain` must be a finite number >= 0(\.0)?, got -0\.1\. 0\.05 moves k"),
    ],
)
def test_a_bad_setting_is_one_clear_error_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AdaptiveBatchSize(**kwargs)


def test_the_clock_splits_a_step_into_micro_batches_and_the_fixed_part():
    times = iter([0.0, 1.0, 2.0, 9.0, 10.0, 11.0, 12.0])  # windows of 3, 3 and 1: micro-batches of 1 s, a step of 6 s
    clock = StepClock(now=lambda: next(times))
    average = StepCostAverage(beta=0.0)
    for window in ((True, False, False), (True, False, False)):
        for first in window:
            clock.tick(first)
        average.add(*clock.take())
    assert average.value() == StepCost(micro_batch_seconds=1.0, overhead_seconds=6.0)
    clock.restart()  # an epoch's end: the time up to the next micro-batch is no step's
    clock.tick(True)
    assert clock.take() == (0.0, 0.0, 0.0, 0.0)


def test_a_slow_first_window_weighs_no_more_than_the_next_ones():
    # The first timed window is often slow (allocations, the first collectives). Not debiased, an average that starts
    # from it would still read 7.6 ms after four windows; debiased, the four weigh 0.73, 0.81, 0.9 and 1: 2.9 ms.
    average = StepCostAverage(beta=0.9)
    for micro in (0.010, 0.001, 0.001, 0.001):
        average.add(micro, 1, 0.030, 1)
    expected = (0.729 * 0.010 + (0.81 + 0.9 + 1.0) * 0.001) / (0.729 + 0.81 + 0.9 + 1.0)
    assert average.value() == StepCost(pytest.approx(expected), pytest.approx(0.030))


class SlowStepSGD(torch.optim.SGD):
    """SGD whose step takes ``delay`` seconds longer: the step's fixed part made long (a slow sync or optimizer)."""

    def __init__(self, params, lr: float, delay: float) -> None:
        super().__init__(params, lr=lr)
        self.delay = delay

    def step(self, closure=None):
        loss = super().step(closure)
        time.sleep(self.delay)
        return loss


class SlowStepModel(RegressionModel):
    def __init__(self, delay: float) -> None:
        super().__init__(lr=0.2)
        self.delay = delay

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return SlowStepSGD(self.parameters(), lr=self.lr, delay=self.delay)


def test_a_slow_step_makes_goodput_choose_a_larger_k_and_every_window_stays_exact(tmp_path, caplog):
    # y is pure noise: the noise scale rises as the fit converges. The same data and initial weights, with and without
    # 40 ms added to every optimizer step: the dearer the step's fixed part, the more micro-batches share it.
    ends = {}
    for delay in (0.0, 0.04):
        schedule = AdaptiveBatchSize(2, 32, warmup_windows=5, beta=0.8, max_growth=None)
        model = SlowStepModel(delay)
        initial = copy.deepcopy(model)
        trainer = make_trainer(tmp_path / str(delay), [AccumulationScheduler(schedule)], max_epochs=2)
        with caplog.at_level("INFO", logger="lightning_accum"):
            trainer.fit(model, DataLoader(IndexedDataset(256), batch_size=4))
        ends[delay] = schedule.accumulation_steps(Progress())
        # The default `lr_scaling="sqrt_gain"` moves the rate with k: the replay takes each step's.
        lrs = model.step_lrs
        expected = replay_reference(initial, IndexedDataset(256), model.step_indices, mse_loss, lr=0.2, lrs=lrs)
        assert_grads_close(model.step_grads, expected, **FP32)
        assert delay == 0.0 or lrs[-1] > lrs[0]  # it did move
    assert ends[0.04] > ends[0.0], ends
    changes = [r.getMessage() for r in caplog.records if "accumulation steps" in r.getMessage()]
    assert changes and all("goodput" in line and "step overhead" in line for line in changes), changes
    # With the slow step, k leaves 2 at the 4th timed window, before the noise scale is known, and says so.
    assert any("at step 4 " in line and "before the noise scale is known" in line for line in changes), changes


def test_the_monitor_logs_what_goodput_weighs(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    from tests.callbacks.test_monitor import read_csv

    schedule = AdaptiveBatchSize(2, 16, warmup_windows=2, beta=0.8)
    logger = CSVLogger(str(tmp_path), name="csv")
    callbacks = [AccumulationScheduler(schedule), AccumulationMonitor()]
    trainer = make_trainer(tmp_path, callbacks, logger=logger, max_epochs=1)
    trainer.fit(RegressionModel(lr=0.2), DataLoader(IndexedDataset(128), batch_size=4))
    rows = read_csv(logger.log_dir)
    last = rows[max(rows)]
    assert 0 < last[keys.STATISTICAL_EFFICIENCY] < 1 and last[keys.STEP_OVERHEAD_SECONDS] > 0
    assert last[keys.TARGET_ACCUMULATION_STEPS] == pytest.approx(schedule.target)
    assert last[keys.SAMPLES_SEEN] == 128


class SlowOnRankOne(SlowStepModel):
    """Rank 1's optimizer step takes 30 ms longer: the ranks' clocks differ, and they must still agree on k."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return SlowStepSGD(self.parameters(), lr=self.lr, delay=0.03 if self.global_rank == 1 else 0.0)


@pytest.mark.ddp
@pytest.mark.timeout(240)
def test_under_ddp_ranks_with_different_clocks_take_the_same_k_with_no_extra_gradient_collective(tmp_path):
    from tests.test_ddp import CountAllReduces, ddp_trainer, load_ranks

    model = SlowOnRankOne(0.0)
    initial = copy.deepcopy(model)
    schedule = AdaptiveBatchSize(2, 16, warmup_windows=3, beta=0.8, max_growth=None)
    trainer = ddp_trainer(tmp_path, [AccumulationScheduler(schedule), CountAllReduces(str(tmp_path))], max_epochs=2)
    trainer.fit(model, DataLoader(IndexedDataset(256), batch_size=4))
    ranks = load_ranks(tmp_path)
    windows = [[len(indices) // 4 for indices in rank["step_indices"]] for rank in ranks]
    assert windows[0] == windows[1] and max(windows[0]) > 2, windows  # agreed, and it moved
    steps = ranks[0]["optimizer_steps"]
    assert [rank["allreduces"] for rank in ranks] == [steps, steps]  # one gradient all-reduce per step, as before
    assert_grads_close(ranks[0]["step_grads"], ranks[1]["step_grads"], rtol=0, atol=0)
    union = [a + b for a, b in zip(ranks[0]["step_indices"], ranks[1]["step_indices"], strict=True)]
    assert ranks[0]["step_lrs"] == ranks[1]["step_lrs"]  # the default gain rule scaled every rank's rate alike
    expected = replay_reference(initial, IndexedDataset(256), union, mse_loss, lr=0.2, lrs=ranks[0]["step_lrs"])
    assert_grads_close(ranks[0]["step_grads"], expected, rtol=1e-5, atol=1e-6)


def test_a_factor_alone_keeps_its_meaning_from_before_the_goodput_objective():
    # AdaptiveBatchSize(factor=2.0), in code or YAML, aimed k at 2 x the noise scale before goodput was the default.
    assert (AdaptiveBatchSize(factor=2.0).objective, AdaptiveBatchSize(factor=2.0).factor) == ("noise_scale", 2.0)
    assert AdaptiveBatchSize().objective == "goodput"
