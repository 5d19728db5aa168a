"""The package's metadata as packaging tools read it today, without their deprecation warnings."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_license_is_an_spdx_expression_with_a_setuptools_that_reads_it() -> None:
    # A `license = {text = ...}` table is deprecated by setuptools (PEP 639): it warns at every build.
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert config["project"]["license"] == "Apache-2.0"
    (setuptools,) = [r for r in config["build-system"]["requires"] if r.startswith("setuptools")]
    minimum = re.fullmatch(r"setuptools>=(\d+)(\.\d+)*", setuptools)
    assert minimum is not None and int(minimum[1]) >= 77, setuptools  # the first to read an SPDX string
