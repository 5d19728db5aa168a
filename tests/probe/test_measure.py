"""``probe_memory``: the two comparisons of the memory question on two models at opposite ends, and its checks."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_accum.probe import probe_memory
from lightning_accum.probe.options import ProbeOptions, RunOptions
from tests.probe.models import ActHeavy, ParamHeavy, RegressionData, grad_bytes, regression_batch

# ---- the two comparisons --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [2, 4])
def test_activation_heavy_full_batch_costs_more_than_accumulation(act_heavy, k):
    b = 512 // k
    full, acc = act_heavy.measurement(512, 1), act_heavy.measurement(b, k)
    assert full.peak_bytes > acc.peak_bytes
    # The saving is the activations of B - b samples less the gradient buffer accumulation keeps alive.
    expected = act_heavy.peak_model.per_sample_bytes * (512 - b) - act_heavy.gradient_bytes
    assert full.peak_bytes - acc.peak_bytes == pytest.approx(expected, rel=0.1)


@pytest.mark.parametrize("k", [2, 4])
def test_accumulation_costs_one_gradient_copy_over_the_same_micro_batch(act_heavy, k):
    b = 512 // k
    grad = grad_bytes(ActHeavy())
    assert act_heavy.gradient_bytes == grad
    extra = act_heavy.measurement(b, k).peak_bytes - act_heavy.measurement(b, 1).peak_bytes
    assert extra == pytest.approx(grad, rel=0.1)
    assert act_heavy.measurement(b, k).breakdown["gradients"] == grad
    assert act_heavy.measurement(b, 1).breakdown["gradients"] == 0  # k=1 peaks before any gradient exists


def test_parameter_heavy_orders_configurations(param_heavy):
    grad = grad_bytes(ParamHeavy())
    full, acc, same = (param_heavy.measurement(*c) for c in ((8, 1), (2, 4), (2, 1)))
    # Accumulation costs more than the same micro-batch without it, by at most one gradient copy.
    assert 0 < acc.peak_bytes - same.peak_bytes <= grad
    # With activations this small the saving against the full batch cannot pay for the gradient buffer:
    # accumulation peaks higher than the full batch, again by at most one gradient copy.
    assert 0 < acc.peak_bytes - full.peak_bytes <= grad
    assert full.breakdown["parameters"] == acc.breakdown["parameters"] == grad


def test_adam_step_sets_the_peak_when_parameters_dominate():
    result = probe_memory(
        ParamHeavy,
        lambda b: regression_batch(b, 1024),
        batch_size=4,
        accumulation_steps=(2,),
        fit_micro_batch_sizes=(),
        module_init_args={"optimizer": "adam"},
    )
    peaks = {m.label: m.peak_bytes for m in result.measurements}
    assert len(set(peaks.values())) == 1, peaks
    assert all(m.peak_phase == "optimizer" for m in result.measurements)
    # exp_avg and exp_avg_sq per parameter, plus Adam's float32 `step` counter for each of the 6 parameters
    assert result.measurement(4, 1).breakdown["optimizer_state"] == 2 * result.gradient_bytes + 4 * 6


def test_micro_batch_not_k_sets_activation_memory(act_heavy):
    by_k = {k: act_heavy.measurement(128, k) for k in (1, 2, 4)}
    assert by_k[2].peak_bytes == by_k[4].peak_bytes
    assert by_k[1].breakdown["activations"] == by_k[2].breakdown["activations"] == by_k[4].breakdown["activations"]
    assert act_heavy.measurement(256, 2).breakdown["activations"] > 1.9 * by_k[2].breakdown["activations"]


# ---- the fit --------------------------------------------------------------------------------------------------------


def test_fit_predicts_held_out_micro_batch_sizes_within_15_percent(act_heavy):
    assert act_heavy.holdout_sizes and act_heavy.fit_sizes
    assert act_heavy.holdout_error is not None
    print(f"held-out relative error: {act_heavy.holdout_error:.4%} on b={act_heavy.holdout_sizes}")
    assert act_heavy.holdout_error < 0.15
    b = act_heavy.fitting_micro_batch_size
    budget = 2 * 2**20
    assert b is not None and 1 <= b <= 512
    assert act_heavy.peak_model.predict(b) <= budget
    assert b == 512 or act_heavy.peak_model.predict(b + 1) > budget


# ---- inputs ---------------------------------------------------------------------------------------------------------


def test_datamodule_and_instance_give_the_same_peaks_as_a_factory():
    from_dm = probe_memory(
        ActHeavy(), RegressionData(), batch_size=32, accumulation_steps=(2,), fit_micro_batch_sizes=()
    )
    from_paths = probe_memory(
        "tests.probe.models:ActHeavy",
        "tests.probe.models:regression_batch",
        batch_size=32,
        accumulation_steps=(2,),
        fit_micro_batch_sizes=(),
        data_init_args={"dim": 64},
    )
    assert [m.peak_bytes for m in from_dm.measurements] == [m.peak_bytes for m in from_paths.measurements]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"batch_size": 10, "accumulation_steps": (4,)}, ValueError, r"holds 4, which does not divide `batch_size`=10"),
        ({"batch_size": 0}, ValueError, r"`batch_size` must be an int >= 1, got 0"),
        ({"batch_size": 8, "accumulation_steps": (1,)}, ValueError, r"`accumulation_steps` must be an int >= 2, got 1"),
        ({"batch_size": 8, "steps": 0}, ValueError, r"`steps` must be an int >= 1, got 0"),
        ({"batch_size": 8, "warmup_steps": -1}, ValueError, r"`warmup_steps` must be an int >= 0, got -1"),
        (
            {"batch_size": 8, "warmup": 0},
            TypeError,
            r"`probe_memory\(\)` got an unexpected keyword argument `warmup=0`\. The keywords both probes share are "
            r"`warmup_steps`, `device`",
        ),
    ],
)
def test_bad_arguments_are_named(kwargs, error, match):
    with pytest.raises(error, match=match):
        probe_memory(ActHeavy, regression_batch, **kwargs)


def test_manual_optimization_is_refused():
    class Manual(ActHeavy):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

    with pytest.raises(RuntimeError, match="uses manual optimization"):
        probe_memory(Manual, regression_batch, batch_size=4, accumulation_steps=(2,), fit_micro_batch_sizes=())


def test_the_shared_keywords_are_typed_and_defaulted_once_for_both_probes():
    # `ProbeOptions` types the keywords for a type checker and `RunOptions` gives their defaults: the two must agree.
    assert list(ProbeOptions.__annotations__) == [field.name for field in dataclasses.fields(RunOptions)]
    assert RunOptions.of("probe_memory", {"seed": 3}) == RunOptions(seed=3)
    assert RunOptions.of("probe_memory", {}).device == "cpu"
