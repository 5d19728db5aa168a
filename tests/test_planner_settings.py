"""`PlannerSettings`: the planner's settings written once, and what reads them (issue 20, item 3)."""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
from typing import Any

import pytest

from lightning_accum import AutoMicroBatching
from lightning_accum.memory.budget import GIB
from lightning_accum.split.planner import MicroBatchPlanner
from lightning_accum.split.planner.settings import PlannerSettings
from lightning_accum.split.planner.simulation import simulate

DEFAULTS: dict[str, Any] = {
    "micro_batch_size": "auto",
    "min_micro_batch_size": 1,
    "pin_micro_batch_size": False,
    "low_watermark": 0.7,
    "grow_patience": 20,
    "oom_cooldown": 200,
    "predictive": True,
    "refit_tolerance": 0.25,
}
# The planner's attributes that the callback, the monitor and the CLI tests read, and the setting behind each.
ATTRIBUTES = {name: name for name in DEFAULTS if name not in ("micro_batch_size", "refit_tolerance")}
ATTRIBUTES["micro_batch_size_setting"] = "micro_batch_size"
SOME: dict[str, Any] = {
    "micro_batch_size": 32,
    "min_micro_batch_size": 2,
    "pin_micro_batch_size": True,
    "low_watermark": 0.5,
    "grow_patience": 3,
    "oom_cooldown": 7,
    "predictive": False,
    "refit_tolerance": 0.1,
}


def test_the_defaults_are_the_class_attributes_and_the_run_config():
    settings = PlannerSettings()
    assert settings.run_config() == DEFAULTS
    assert {name: getattr(PlannerSettings, name) for name in DEFAULTS} == DEFAULTS
    assert [f.name for f in dataclasses.fields(PlannerSettings)] == list(DEFAULTS)


def test_the_run_config_holds_every_setting_as_a_plain_value():
    config = PlannerSettings(**SOME).run_config()
    assert config == SOME
    assert json.loads(json.dumps(config)) == config  # W&B and YAML take it as it is


def test_only_micro_batch_size_is_positional():
    assert PlannerSettings(8).micro_batch_size == 8
    with pytest.raises(TypeError, match=r"takes from 1 to 2 positional arguments but 3 were given"):
        PlannerSettings(8, 2)  # type: ignore[call-arg]  # the call the test shows refused


def test_frozen():
    settings = PlannerSettings()
    with pytest.raises(dataclasses.FrozenInstanceError, match=r"cannot assign to field 'grow_patience'"):
        settings.grow_patience = 5  # type: ignore[misc]  # the assignment the test shows refused
    assert dataclasses.replace(settings, grow_patience=5).grow_patience == 5


def test_numbers_are_stored_as_floats_as_the_planner_stored_them():
    settings = PlannerSettings(refit_tolerance=1)
    assert settings.refit_tolerance == 1.0 and isinstance(settings.refit_tolerance, float)
    assert isinstance(PlannerSettings(low_watermark=0.5).low_watermark, float)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"micro_batch_size": 0}, ValueError, r"`micro_batch_size` must be an int >= 1 or \"auto\", got 0"),
        ({"micro_batch_size": "max"}, TypeError, r"`micro_batch_size` must be an int >= 1 or \"auto\", got 'max'"),
        ({"micro_batch_size": True}, TypeError, r"`micro_batch_size` must be an int >= 1 or \"auto\", got True"),
        (
            {"micro_batch_size": 2, "min_micro_batch_size": 4},
            ValueError,
            r"`micro_batch_size=2` is below `min_micro_batch_size=4`\. Lower `min_micro_batch_size` or raise",
        ),
        ({"min_micro_batch_size": 0}, ValueError, r"`min_micro_batch_size` must be an int >= 1, got 0"),
        ({"low_watermark": 1.0}, ValueError, r"`low_watermark` must be a fraction of the budget in \(0, 1\), got 1.0"),
        ({"low_watermark": 0}, ValueError, r"`low_watermark` must be a fraction of the budget in \(0, 1\), got 0\."),
        ({"low_watermark": math.nan}, ValueError, r"`low_watermark` must be a fraction of the budget in \(0, 1\)"),
        ({"low_watermark": "0.7"}, TypeError, r"`low_watermark` must be a fraction of the budget in \(0, 1\), got '0"),
        ({"refit_tolerance": 0.0}, ValueError, r"`refit_tolerance` must be a finite number > 0, got 0.0"),
        ({"grow_patience": 0}, ValueError, r"`grow_patience` must be an int >= 1, got 0"),
        ({"grow_patience": 2.0}, TypeError, r"`grow_patience` must be an int >= 1, got 2.0 of type float"),
        ({"oom_cooldown": -1}, ValueError, r"`oom_cooldown` must be an int >= 0, got -1"),
        ({"predictive": 1}, TypeError, r"`predictive` must be a bool, got 1 of type int"),
        ({"pin_micro_batch_size": "yes"}, TypeError, r"`pin_micro_batch_size` must be a bool, got 'yes' of type str"),
        ({"pin_micro_batch_size": True}, ValueError, r"`pin_micro_batch_size=True` needs an int `micro_batch_size`"),
    ],
)
def test_validation(kwargs: dict[str, Any], error: type[Exception], match: str):
    with pytest.raises(error, match=match):
        PlannerSettings(**kwargs)
    with pytest.raises(error, match=match):
        MicroBatchPlanner(**kwargs)  # the planner's keywords build the same settings


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        # Two faults: the first in the order the planner always checked them is the one refused.
        ({"micro_batch_size": 0, "min_micro_batch_size": 0}, r"`micro_batch_size` must be"),
        ({"min_micro_batch_size": 0, "grow_patience": 0}, r"`min_micro_batch_size` must be"),
        ({"low_watermark": 0, "grow_patience": 0}, r"`low_watermark` must be"),
        ({"oom_cooldown": -1, "predictive": 1}, r"`oom_cooldown` must be"),
        ({"pin_micro_batch_size": True, "refit_tolerance": 0}, r"`pin_micro_batch_size=True` needs"),
    ],
)
def test_the_first_fault_is_refused_in_the_planners_order(kwargs: dict[str, Any], match: str):
    with pytest.raises((TypeError, ValueError), match=match):
        PlannerSettings(**kwargs)


# ---- the planner reads its settings through them ---------------------------------------------------------------------


def test_the_planner_takes_settings_or_the_same_keywords():
    settings = PlannerSettings(**SOME)
    given = MicroBatchPlanner(settings, budget_bytes=GIB)
    by_keywords = MicroBatchPlanner(budget_bytes=GIB, **SOME)
    by_position = MicroBatchPlanner(32, budget_bytes=GIB, **{k: v for k, v in SOME.items() if k != "micro_batch_size"})
    assert given.settings is settings
    assert given.settings == by_keywords.settings == by_position.settings
    assert MicroBatchPlanner().settings == PlannerSettings() == MicroBatchPlanner("auto").settings


@pytest.mark.parametrize("kwargs", [{}, SOME])
def test_the_planners_attributes_read_the_settings(kwargs: dict[str, Any]):
    planner = MicroBatchPlanner(**kwargs)
    expected = {**DEFAULTS, **kwargs}
    assert {attribute: getattr(planner, attribute) for attribute in ATTRIBUTES} == {
        attribute: expected[setting] for attribute, setting in ATTRIBUTES.items()
    }
    planner.settings = dataclasses.replace(planner.settings, grow_patience=9)
    assert planner.grow_patience == 9  # read, not copied


def test_a_setting_cannot_be_assigned_on_the_planner():
    # An assignment that made an instance attribute would be silently ignored: the planner reads `settings`.
    planner = MicroBatchPlanner(grow_patience=3)
    with pytest.raises(AttributeError, match=r"`MicroBatchPlanner.grow_patience` reads `planner.settings`, which is"):
        planner.grow_patience = 1
    assert planner.grow_patience == planner.settings.grow_patience == 3


def test_settings_and_keywords_together_are_refused():
    with pytest.raises(TypeError, match=r"takes a `PlannerSettings` or the settings as keywords, got both \(also `gr"):
        MicroBatchPlanner(PlannerSettings(), grow_patience=3)


def test_an_unknown_keyword_is_refused():
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'grow_patients'"):
        MicroBatchPlanner(grow_patients=3)


@pytest.mark.parametrize("predictive", [True, False])
def test_a_planner_from_settings_decides_as_one_from_keywords(predictive: bool):
    def peak(step: int, b: int) -> float:  # a memory-hungry phase between steps 100 and 200
        return 2 * GIB + (GIB / 2 if 100 <= step < 200 else GIB / 4) * b

    keywords: dict[str, Any] = {"predictive": predictive, "grow_patience": 2, "oom_cooldown": 30}
    runs = [
        simulate(planner, step_batch_size=256, steps=300, peak_bytes=peak, capacity_bytes=16 * GIB)
        for planner in (
            MicroBatchPlanner(PlannerSettings(**keywords), budget_bytes=14.4 * GIB),
            MicroBatchPlanner(budget_bytes=14.4 * GIB, **keywords),
        )
    ]
    assert runs[0] == runs[1]
    assert runs[0].ooms > 0 and any(e.kind == "grow" for e in runs[0].events)  # the run exercised the settings


# ---- the callback's signature ----------------------------------------------------------------------------------------


def test_the_callbacks_defaults_are_the_settings_defaults():
    # LightningCLI reads the callback's signature, so the settings stay keywords there; their defaults must not drift.
    parameters = inspect.signature(AutoMicroBatching).parameters
    taken = {name: parameters[name].default for name in DEFAULTS if name in parameters}
    assert taken == {name: DEFAULTS[name] for name in taken}
    assert set(DEFAULTS) - set(taken) == {"refit_tolerance"}  # the planner's own; the callback does not take it
