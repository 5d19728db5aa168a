"""The Trainer-free side of AccumulationMonitor (issue 20): its totals, clock and memory reads, and every metric dict,
bar text, run config and warning it produces, checked without a Trainer against figures worked out by hand."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import Tensor

from lightning_accum import keys
from lightning_accum.core.engine import Ranks
from lightning_accum.core.noise_scale import NoiseScale, NoiseScaleEstimator
from lightning_accum.core.step_report import AccumulationEvent, LossSum, StepReport
from lightning_accum.memory.budget import GIB
from lightning_accum.monitor.metrics import (
    AccumulationMetrics,
    EveryStepMetrics,
    check_key_prefix,
    check_logging_interval,
    late_reader_warnings,
    logging_metrics,
    noise_metrics,
    progress_bar_batch,
    progress_bar_memory,
    run_config,
    why_not_every_step,
)
from lightning_accum.monitor.rows import every_step_keys
from lightning_accum.monitor.summary import FitSummary
from lightning_accum.monitor.totals import LightningWindows, MemoryReading, RankMemory, TrainingClock
from lightning_accum.monitor.window_loss import WeightedMean, window_loss


class FakeBackend:
    """A `lightning_accum.memory.backends.MemoryBackend` whose figures the test sets."""

    name = "fake"

    def __init__(self, capacity: int = 8 * GIB, peak: int = 0, reserved: int | None = None, retries: int = 0) -> None:
        self.capacity, self.peak, self.reserved, self.retries = capacity, peak, reserved, retries
        self.capacity_reads = 0
        self.resets = 0

    def reset_peak(self) -> None:
        self.resets += 1
        self.peak = 0

    def peak_bytes(self) -> int:
        return self.peak

    def peak_reserved_bytes(self) -> int | None:
        return self.reserved

    def capacity_bytes(self) -> int:
        self.capacity_reads += 1
        return self.capacity

    def alloc_retries(self) -> int:
        return self.retries

    def current_bytes(self) -> int:
        return self.peak


def ticking(*times: float) -> Callable[[], float]:
    """A clock that returns ``times`` in turn."""
    it: Iterator[float] = iter(times)
    return lambda: next(it)


def other_rank(values: list[float]) -> Callable[[Tensor], Tensor]:
    """An element-wise max over this rank and a second one holding ``values``."""
    return lambda local: torch.maximum(local, torch.tensor(values, dtype=local.dtype))


def report(step: int = 0, **fields: Any) -> StepReport:
    """Step ``step``'s report: micro-batches of 4, k=2 and 8 samples unless ``fields`` say otherwise."""
    values: dict[str, Any] = {"micro_batch_size": 4, "accumulation_steps": 2, "effective_batch_size": 8}
    values.update(fields)
    values.setdefault("items", float(values["effective_batch_size"]))
    return StepReport(mode="window", consumed_samples=8 * (step + 1), **values)


# ----------------------------------------------------------------------------------------------------------------
# monitoring.py: the clock, memory reads, the window loss and the plain-Lightning windows
# ----------------------------------------------------------------------------------------------------------------
def test_the_clock_leaves_validation_out_of_the_interval_and_the_fit():
    # start at 10; validation 12 -> 15; interval read at 20; new interval at 21; read at 25; fit read at 30.
    clock = TrainingClock(now=ticking(10.0, 12.0, 15.0, 20.0, 21.0, 25.0, 30.0))
    clock.pause()
    clock.resume()
    assert clock.interval_seconds() == (20 - 10) - (15 - 12)
    clock.new_interval()
    assert clock.interval_seconds() == 25 - 21  # the validation belonged to the interval before
    assert clock.train_seconds() == (30 - 10) - (15 - 12)


def test_the_clock_ignores_a_resume_without_a_pause():
    clock = TrainingClock(now=ticking(0.0, 4.0))
    clock.resume()  # e.g. a validation outside fit, whose start the monitor did not time
    assert clock.interval_seconds() == 4.0


def test_memory_is_the_max_over_ranks_and_the_owners_peak_and_resets_the_peak():
    backend = FakeBackend(capacity=8 * GIB, peak=2 * GIB, reserved=3 * GIB)
    memory = RankMemory(backend)
    assert backend.capacity_reads == 1  # read once (on CPU it walks the cgroup files), not at every logging step
    # The owner measured 5 GiB in split mode; the other rank peaked at 6 GiB, reserved 1 GiB, has 16 GiB.
    reading = memory.read(owner_peak=5 * GIB, max_across=other_rank([6 * GIB, 1 * GIB, 16 * GIB]))
    assert reading == MemoryReading(peak_bytes=6 * GIB, peak_reserved_bytes=3 * GIB, capacity_bytes=16 * GIB)
    assert memory.last_peak == 5 * GIB  # this rank's own, for `memory/rank{r}/peak_gib`
    assert backend.resets == 1 and backend.capacity_reads == 1


def test_memory_without_a_reserved_pool_reports_none_on_one_process():
    memory = RankMemory(FakeBackend(capacity=4 * GIB, peak=GIB))
    assert memory.read(owner_peak=0, max_across=None) == MemoryReading(GIB, None, 4 * GIB)


def test_rank_metrics_take_the_allocators_max_and_each_ranks_peak():
    memory = RankMemory(FakeBackend(peak=GIB, retries=3))
    memory.read(0, None)
    gathered: list[Tensor] = []

    def gather(local: Tensor) -> Tensor:
        gathered.append(local)
        return torch.stack([local, local * 2])  # a second rank with twice the peak

    metrics = memory.rank_metrics(other_rank([7.0]), gather, allocator=True)
    assert metrics == {keys.ALLOC_RETRIES: 7.0, "memory/rank0/peak_gib": 1.0, "memory/rank1/peak_gib": 2.0}
    assert memory.rank_metrics(None, None, allocator=False) == {}  # CPU, per-rank memory off: no collective
    assert len(gathered) == 1


def test_window_loss_is_item_weighted_and_resets():
    mean = WeightedMean()
    loss = LossSum()
    loss.add(torch.tensor(1.0), n_items=3, loss_reduction="mean")
    loss.add(torch.tensor(10.0), n_items=2, loss_reduction="sum")
    assert window_loss(mean, loss) == pytest.approx((1.0 * 3 + 10.0) / (3 + 2))
    assert math.isnan(window_loss(mean, LossSum()))  # nothing seen since the reset: nan, not the last value


@pytest.mark.parametrize(
    ("outputs", "expected_loss"),
    [(torch.tensor(0.5), 0.5 * 2), ({"loss": torch.tensor(0.5)}, 0.5 * 2), (None, None)],
    ids=["tensor", "dict", "skipped"],
)
def test_plain_lightning_windows_multiply_back_the_divisor_and_report_at_the_step(outputs, expected_loss):
    windows = LightningWindows(global_step=3)
    assert windows.step_report(4, outputs, 2, global_step=3) is None  # the Trainer has not stepped yet
    last = windows.step_report(2, outputs, 2, global_step=4)
    assert last is not None
    assert (last.micro_batch_size, last.accumulation_steps, last.effective_batch_size) == (4, 2, 6)
    if expected_loss is None:
        assert last.loss_items == 0
    else:
        assert float(last.loss_sum) / last.loss_items == pytest.approx(expected_loss)
    assert windows.step_report(4, outputs, 2, global_step=4) is None  # the next window starts
    assert windows.step_report(4, outputs, 2, global_step=5).consumed_samples == 6 + 8


def test_the_summary_peak_is_against_the_budget_or_the_capacity():
    summary = FitSummary()
    assert summary.add_peak_bytes(GIB, None, 0) is None and summary.peak_fraction is None  # no capacity known
    assert summary.add_peak_bytes(3 * GIB, 4 * GIB, 8 * GIB) == 3 / 4
    assert summary.add_peak_bytes(1 * GIB, 4 * GIB, 8 * GIB) == 1 / 4
    assert (summary.peak_fraction, summary.memory_limit) == (3 / 4, "budget")  # the highest so far
    assert summary.add_peak_bytes(7 * GIB, None, 8 * GIB) == 7 / 8
    assert (summary.peak_fraction, summary.memory_limit) == (7 / 8, "capacity")


# ----------------------------------------------------------------------------------------------------------------
# monitor_metrics.py: the functions
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (True, TypeError, r"`logging_interval` must be an int .* got True of type bool"),
        (2.0, TypeError, r"`logging_interval` must be an int .* got 2.0 of type float"),
        (0, ValueError, r"`logging_interval` must be >= 1 .* got 0"),
    ],
)
def test_a_bad_logging_interval_is_refused(value, error, match):
    with pytest.raises(error, match=match):
        check_logging_interval(value)


def test_good_arguments_pass_through():
    assert check_logging_interval(None) is None and check_logging_interval(7) == 7
    assert check_key_prefix("") == ""
    with pytest.raises(TypeError, match=r"`key_prefix` must be a str such as 'run2/', got 2 of type int"):
        check_key_prefix(2)


def test_noise_metrics_divide_the_two_estimates():
    assert noise_metrics(NoiseScale(grad_sq_norm=4.0, trace_cov=48.0, windows=5, skipped=1)) == {
        keys.GRADIENT_NOISE_SCALE: 48.0 / 4.0,
        keys.GRAD_SQ_NORM: 4.0,
        keys.GRAD_TRACE_COV: 48.0,
        keys.NOISE_SCALE_SKIPPED: 1,
    }
    assert noise_metrics(NoiseScaleEstimator().value()) == {}  # nothing measured yet


def test_logging_metrics_are_the_hand_worked_figures():
    last = report(
        micro_batch_size=4, accumulation_steps=3, effective_batch_size=24, items=100.0, oom_retries=2,
        consumed_items=300.0, target_accumulation_steps=3.0,
    )  # fmt: skip
    metrics = logging_metrics(
        last, samples=72, items=300.0, window_loss=0.25, seconds=1.5,
        memory=MemoryReading(3 * GIB, 5 * GIB, 12 * GIB), budget_bytes=6 * GIB,
    )  # fmt: skip
    assert metrics == {
        keys.EFFECTIVE_BATCH_SIZE: 24.0,
        keys.MICRO_BATCH_SIZE: 4.0,
        keys.ACCUMULATION_STEPS: 3.0,
        keys.ITEMS_PER_STEP: 100.0,
        keys.OOM_RETRIES: 2.0,
        keys.PEAK_GIB: 3.0,
        keys.CAPACITY_GIB: 12.0,
        keys.PEAK_FRACTION: 3 / 12,
        keys.BUDGET_FRACTION: 6 / 12,
        keys.SAMPLES_PER_SEC: 72 / 1.5,
        keys.ITEMS_PER_SEC: 300.0 / 1.5,
        keys.WINDOW_LOSS: 0.25,
        keys.PEAK_RESERVED_GIB: 5.0,
        keys.SAMPLES_SEEN: 8.0,  # the report's consumed samples, all ranks, since the start of training
        keys.ITEMS_SEEN: 300.0,
        keys.TARGET_ACCUMULATION_STEPS: 3.0,
    }


def test_between_logging_steps_batch_figures_go_in_when_they_change_and_the_loss_always():
    every = EveryStepMetrics(every_step_keys(has_owner=True, world_size=1, noise_scale=False), key_prefix="p/")
    loss = LossSum()
    loss.add(torch.tensor(2.0), n_items=4, loss_reduction="mean")
    first = every.metrics(report(), loss, {})
    assert first["p/" + keys.EFFECTIVE_BATCH_SIZE] == 8.0 and set(first) == {
        "p/" + key for key in (*keys.BATCH_KEYS, keys.OOM_RETRIES, keys.WINDOW_LOSS)
    }
    assert isinstance(first["p/" + keys.WINDOW_LOSS], Tensor)  # no host read between logging steps
    assert set(every.metrics(report(1), loss, {})) == {"p/" + keys.WINDOW_LOSS}  # same figures: not again
    assert every.metrics(report(2, oom_retries=1), loss, {})["p/" + keys.OOM_RETRIES] == 1.0
    assert every.metrics(report(2), loss, {keys.GRAD_SQ_NORM: 1.0})["p/" + keys.GRAD_SQ_NORM] == 1.0
    assert EveryStepMetrics(()).metrics(report(), loss, {}) == {}  # plain Lightning under DDP: nothing
    assert EveryStepMetrics(every.wanted).metrics(None, loss, {}) == {}  # before the first step


def test_the_progress_bar_text():
    assert progress_bar_batch(report(micro_batch_size=16, accumulation_steps=4)) == {"mb": "16", "k": "4"}
    assert progress_bar_memory(0.456, has_budget=True) == {"mem/budget": "0.46"}


def test_the_run_config_copies_the_owners_settings():
    owner = {"mode": "split", "max_memory": 0.8}
    settings = run_config(owner, accumulate_grad_batches=1, world_size=4, logging_every=10)
    assert settings == {"mode": "split", "max_memory": 0.8, "world_size": 4, "monitor_logging_interval": 10}
    assert owner == {"mode": "split", "max_memory": 0.8}  # never mutate what the owner handed over


@pytest.mark.parametrize(
    ("reader", "logging_every", "warned"),
    [
        (("memory/peak_gib", 20, False), 10, False),  # saves at logging steps only
        (("memory/peak_gib", 5, False), 10, True),
        (("memory/peak_gib", 0, True), 10, True),  # by time: whenever it pleases
        (("memory/peak_gib", 0, False), 10, False),  # by epoch: not a step reader
        (("memory/peak_gib", 5, False), 1, False),  # the monitor logs every step
        (("memory/peak_gib", 5, False), 0, True),  # `log_every_n_steps=0`: never refreshed
        (("accum/window_loss", 5, False), 10, False),  # refreshed at every step (one process)
        (("val/loss", 5, False), 10, False),  # not the monitor's key
        (("memory/rank1/peak_gib", 5, False), 10, True),
        (("run2/memory/peak_gib", 5, False), 10, False),  # another monitor's prefix
    ],
)
def test_which_checkpoints_are_warned_about(reader, logging_every, warned):
    every_step = every_step_keys(has_owner=True, world_size=1, noise_scale=False)
    found = late_reader_warnings([reader], key_prefix="", every_step=every_step, logging_every=logging_every)
    assert len(found) == warned


def test_the_warning_says_why_and_how_to_fix_it():
    (message,) = late_reader_warnings(
        [("p/accum/window_loss", 6, False)], key_prefix="p/", every_step=(), logging_every=4
    )
    assert message.startswith("`ModelCheckpoint(monitor='p/accum/window_loss', every_n_train_steps=6)`")
    assert why_not_every_step(keys.WINDOW_LOSS) in message and "logs it (every 4 optimizer steps)" in message
    assert "`AccumulationMonitor(logging_interval=...)` to a divisor of 6" in message
    assert "`every_n_train_steps` to a multiple of 4" in message


# ----------------------------------------------------------------------------------------------------------------
# AccumulationMetrics: step reports in, metric dicts out
# ----------------------------------------------------------------------------------------------------------------
def started(*, has_owner: bool = True, world_size: int = 1, prefix: str = "", **kwargs: Any) -> AccumulationMetrics:
    """Metrics started for a fit on a fake 8 GiB device; ``kwargs`` go to `AccumulationMetrics`."""
    metrics = AccumulationMetrics(prefix, **kwargs)
    metrics.memory = RankMemory(FakeBackend(capacity=8 * GIB))
    wanted = every_step_keys(has_owner=has_owner, world_size=world_size, noise_scale=metrics.log_noise_scale)
    metrics.start(wanted, has_owner=has_owner)
    return metrics


def with_loss(step: int, loss: float, items: int = 8, **kwargs: Any) -> StepReport:
    return report(step, loss_sum=torch.tensor(loss * items), loss_items=items, **kwargs)


def test_an_interval_of_steps_is_logged_once_with_its_own_figures():
    metrics = started(prefix="run/")
    shrink = AccumulationEvent("shrink", step=1, before=8, after=4)
    metrics.add(with_loss(0, 1.0))
    metrics.add(with_loss(1, 4.0, micro_batch_size=2, accumulation_steps=4, events=(shrink,)))
    assert metrics.memory is not None
    metrics.memory.backend.peak = 2 * GIB  # the fake's knob
    logged = metrics.logging_step(Ranks(), None, allocator=False)
    assert logged["run/" + keys.WINDOW_LOSS] == pytest.approx((1.0 * 8 + 4.0 * 8) / 16)
    assert logged["run/" + keys.MICRO_BATCH_SIZE] == 2.0 and logged["run/" + keys.ACCUMULATION_STEPS] == 4.0
    assert logged["run/" + keys.EVENT_SHRINK] == 4.0 and logged["run/" + keys.PEAK_FRACTION] == 2 / 8
    assert all(key.startswith("run/") for key in logged)
    assert metrics.memory_bar == {"mem/capacity": "0.25"}
    metrics.new_interval()
    metrics.add(with_loss(2, 9.0))
    again = metrics.logging_step(Ranks(), None, allocator=False)
    assert again["run/" + keys.WINDOW_LOSS] == pytest.approx(9.0)  # only the new interval's step
    assert "run/" + keys.EVENT_SHRINK not in again


def test_a_report_counts_once_also_the_owners_from_before_the_fit():
    metrics = AccumulationMetrics()
    earlier = report()
    metrics.start((), has_owner=True, last_report=earlier)  # a second fit finds the first one's last report
    assert not metrics.add(earlier)
    fresh = report(1)
    assert metrics.add(fresh) and not metrics.add(fresh)
    assert metrics.interval.steps == 1 and metrics.fit.steps == 1


def test_plain_lightning_counts_are_summed_over_ranks_at_logging_steps_only():
    metrics = started(has_owner=False, world_size=2)
    metrics.add(report(0, effective_batch_size=6, micro_batch_size=3))  # this rank's batches
    metrics.add(report(1, effective_batch_size=6, micro_batch_size=3))
    calls: list[Tensor] = []

    def twice(local: Tensor) -> Tensor:  # a second rank with the same counts
        calls.append(local)
        return local * 2

    logged = metrics.logging_step(Ranks(world_size=2, sum=twice), None, allocator=False)
    assert logged[keys.EFFECTIVE_BATCH_SIZE] == 12.0 and logged[keys.ITEMS_PER_STEP] == 12.0
    assert len(calls) == 1  # one all-reduce for the step and the interval together
    metrics.new_interval()
    metrics.add(report(2, effective_batch_size=6, micro_batch_size=3))
    summary = metrics.finish(Ranks(world_size=2, sum=twice))
    assert summary.samples == 3 * 12 and summary.effective_batch_sizes == {12}


def test_the_summary_covers_the_steps_after_the_last_logging_step():
    metrics = started()
    assert metrics.memory is not None
    metrics.add(report(0, budget_bytes=4.0 * GIB))
    metrics.memory.backend.peak = 3 * GIB  # a spike after the last logging step
    summary = metrics.finish(Ranks())
    assert (summary.peak_fraction, summary.memory_limit) == (3 / 4, "budget")
    assert summary.steps == 1 and summary.seconds > 0


def test_the_noise_scale_a_schedule_follows_is_logged_instead_of_the_monitors():
    own = NoiseScaleEstimator(beta=0.0)
    metrics = started(noise_scale=own, log_noise_scale=True)
    metrics.add(report(0, noise=(2.0, 8.0)), noise_windows=1)
    assert metrics.noise_metrics()[keys.GRADIENT_NOISE_SCALE] == 8.0 / 2.0
    assert metrics.between_logging_steps()[keys.GRADIENT_NOISE_SCALE] == 8.0 / 2.0
    schedules = NoiseScaleEstimator(beta=0.0)
    schedules.add_estimates(1.0, 64.0)
    metrics.start((), has_owner=True, noise_in_use=schedules)
    metrics.add(report(1, noise=(2.0, 8.0)), noise_windows=1)
    assert metrics.noise_metrics()[keys.GRADIENT_NOISE_SCALE] == 64.0  # the schedule's, which decides k
    assert own.value().windows == 1  # the schedule averages its own measurements
    assert started(log_noise_scale=False).noise_metrics() == {}


# ----------------------------------------------------------------------------------------------------------------
# split mode by tokens: the token budget and the padding (issue 21, item 4)
# ----------------------------------------------------------------------------------------------------------------
def token_report(step: int = 0, tokens: int = 96, padding: float = 0.25, **fields: Any) -> StepReport:
    """A step split by tokens: at a budget of ``tokens``, with ``padding`` of its positions computed holding none."""
    return report(step, micro_batch_tokens=tokens, padding_fraction=padding, **fields)


def test_logging_metrics_by_tokens_add_the_budget_and_the_padding_and_by_samples_nothing():
    interval = {"samples": 8, "items": 8.0, "window_loss": 0.5, "seconds": 1.0, "budget_bytes": None}
    memory = MemoryReading(GIB, None, 8 * GIB)
    by_samples = logging_metrics(report(), memory=memory, **interval)
    by_tokens = logging_metrics(token_report(micro_batch_size=6, accumulation_steps=5), memory=memory, **interval)
    assert not set(keys.TOKEN_KEYS) & set(by_samples)
    assert by_tokens == {
        **by_samples,
        keys.MICRO_BATCH_SIZE: 6.0,
        keys.ACCUMULATION_STEPS: 5.0,
        keys.MICRO_BATCH_TOKENS: 96.0,
        keys.PADDING_FRACTION: 0.25,
    }


def test_between_logging_steps_the_token_figures_go_in_with_the_batch_figures():
    wanted = every_step_keys(has_owner=True, world_size=2, noise_scale=False, tokens=True)
    assert set(wanted) == {*keys.BATCH_KEYS, keys.OOM_RETRIES, *keys.TOKEN_KEYS}  # global already: no collective
    every = EveryStepMetrics(wanted, key_prefix="p/")
    first = every.metrics(token_report(0), LossSum(), {})
    assert (first["p/" + keys.MICRO_BATCH_TOKENS], first["p/" + keys.PADDING_FRACTION]) == (96.0, 0.25)
    assert every.metrics(token_report(1), LossSum(), {}) == {}  # the same figures: not again
    again = every.metrics(token_report(2, padding=0.125), LossSum(), {})  # the padding moves at almost every step
    assert again["p/" + keys.PADDING_FRACTION] == 0.125 and again["p/" + keys.MICRO_BATCH_TOKENS] == 96.0
    assert every.metrics(token_report(3, tokens=48, padding=0.125), LossSum(), {})["p/" + keys.MICRO_BATCH_TOKENS] == 48


def test_the_progress_bar_text_by_tokens():
    shown = progress_bar_batch(token_report(micro_batch_size=9, accumulation_steps=3, padding=0.2768))
    assert shown == {"mb": "9", "k": "3", "mb_tokens": "96", "pad": "0.28"}
    assert set(progress_bar_batch(report())) == {"mb", "k"}  # by samples: as before


def test_the_fit_summary_by_tokens_gives_the_budget_where_it_settled_and_the_mean_padding():
    summary = FitSummary()
    steps = [(96, 0.3, 9), (96, 0.2, 6), (48, 0.1, 4), (48, 0.2, 3)]  # (budget, padding, largest micro-batch)
    for step, (tokens, padding, largest) in enumerate(steps):
        summary.add(token_report(step, tokens=tokens, padding=padding, micro_batch_size=largest))
    parts = summary.text().removesuffix(".").split("; ")
    assert parts == [
        "lightning_accum: 4 optimizer steps, effective batch 8 samples",
        "micro-batch budget 48 to 96 tokens, settled at 48 from step 2 (3 to 9 samples)",
        "padding 20% of the token positions computed (mean over steps)",
    ]
    figures = summary.as_dict()
    assert figures["micro_batch_tokens_settled"] == 48 and figures["padding_fraction_mean"] == pytest.approx(0.2)
    assert "micro_batch_size_settled" not in figures  # by tokens the samples follow the lengths: nothing settles

    fixed = FitSummary()
    fixed.add(token_report(0, micro_batch_size=9))
    assert "; micro-batch budget 96 tokens (9 samples); padding 25% of" in fixed.text()


def test_the_fit_summary_of_a_run_split_on_several_ranks_says_how_unequal_they_were():
    summary = FitSummary()
    for step, (imbalance, wait) in enumerate([(1.25, 0.5), (1.05, 0.25), (1.0, 0.0)]):
        summary.add(
            StepReport("split", 4, 2, 16, 16.0, 16 * (step + 1), rank_imbalance=imbalance, sync_wait_seconds=wait)
        )
    assert "; slowest rank 1.10x the mean rank's step (mean over steps), 0.8 s waited at the sync" in summary.text()
    figures = summary.as_dict()
    assert figures["rank_imbalance_mean"] == pytest.approx(3.3 / 3) and figures["sync_wait_seconds"] == 0.75

    one_rank = FitSummary()  # the owner reports no balance on one rank: the summary says nothing of ranks
    one_rank.add(StepReport("split", 4, 2, 8, 8.0, 8))
    assert "rank" not in one_rank.text() and "rank_imbalance_mean" not in one_rank.as_dict()


@pytest.mark.parametrize(("errors", "says_measure"), [((1.02, 1.0, 1.03), False), ((1.12, 1.08, 1.1), True)])
def test_the_fit_summary_says_when_the_balanced_samplers_price_should_be_measured(errors, says_measure):
    # Issue 37, item 2: dealt by a price the compute belies, the ranks are balanced on paper only.
    summary = FitSummary()
    for step, error in enumerate(errors):
        summary.add(
            StepReport(
                "split", 4, 2, 16, 16.0, 16 * (step + 1), rank_imbalance=1.0, sync_wait_seconds=0.0, price_error=error
            )
        )
    mean = sum(errors) / len(errors)
    assert summary.as_dict()["price_error_mean"] == pytest.approx(mean)
    assert f"the slowest rank's measured compute {mean:.2f}x the mean's over what the sampler's price" in summary.text()
    assert ("measure_step_cost" in summary.text()) is says_measure and (
        "`quadratic=`" in summary.text()
    ) is says_measure
    undealt = FitSummary()  # no balanced sampler: no price to check
    undealt.add(StepReport("split", 4, 2, 16, 16.0, 16, rank_imbalance=1.3, sync_wait_seconds=0.1))
    assert "price" not in undealt.text() and "price_error_mean" not in undealt.as_dict()
