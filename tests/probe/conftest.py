"""Probe results shared by the probe's tests: each is measured once per test session."""

from __future__ import annotations

import pytest

from lightning_accum.probe import probe_memory
from tests.probe.models import ActHeavy, ParamHeavy, regression_batch

MiB = 2**20


@pytest.fixture(scope="package")
def act_heavy():
    return probe_memory(
        ActHeavy, lambda b: regression_batch(b, 64), batch_size=512, accumulation_steps=(2, 4), budget_bytes=2 * MiB
    )


@pytest.fixture(scope="package")
def param_heavy():
    return probe_memory(
        ParamHeavy,
        lambda b: regression_batch(b, 1024),
        batch_size=8,
        accumulation_steps=(4,),
        fit_micro_batch_sizes=(1, 2, 4),
    )
