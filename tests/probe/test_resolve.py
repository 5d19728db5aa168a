"""Resolving what the probe is given: import paths (`pkgutil.resolve_name`) and LightningCLI configs (jsonargparse)."""

from __future__ import annotations

import pytest

from lightning_accum.probe import import_object, load_cli_config, probe_memory
from tests.probe.models import regression_batch


def test_bad_import_paths_are_named():
    with pytest.raises(ValueError, match=r"`module` must be an import path like 'pkg.module:Name', got 'ActHeavy'"):
        probe_memory("ActHeavy", regression_batch, batch_size=4)
    with pytest.raises(ImportError, match=r"module 'tests.probe.models' has no attribute 'Nope'"):
        import_object("tests.probe.models:Nope", "module")


def test_cli_config_without_class_path_says_how_to_fix(tmp_path):
    config = tmp_path / "cli.yaml"
    config.write_text("model:\n  width: 3\n")
    with pytest.raises(ValueError, match=r"the `model` section has no `class_path`.*`--model pkg.mod:Class`"):
        load_cli_config(config)
