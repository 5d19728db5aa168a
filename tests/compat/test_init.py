"""``lightning_accum._compat`` keeps answering for every name its callers use, and each module names its guard."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import lightning_accum
from lightning_accum import _compat

ROOT = Path(lightning_accum.__file__).parent.parent
PACKAGE = Path(_compat.__file__).parent
MODULES = ["loops", "trainer", "ddp", "fsdp2"]


def _names_used_as_compat_attributes() -> set[str]:
    """Every ``_compat.<name>`` in the package, the tests and the examples."""
    used = set()
    for folder in ("lightning_accum", "tests", "examples"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "_compat":
                    used.add(node.attr)
    return used


def test_every_name_callers_use_is_re_exported():
    used = {n for n in _names_used_as_compat_attributes() - set(MODULES) - {"_version"} if not n.startswith("__")}
    assert {"install_window_control", "unsynced_gradients", "SplitStepContext"} <= used  # the walk finds them
    assert sorted(name for name in used if not hasattr(_compat, name)) == []
    assert sorted(used - set(_compat.__all__)) == []


def test_all_is_sorted_and_each_name_lives_in_one_module():
    assert _compat.__all__ == sorted(_compat.__all__)
    homes = {
        name: [m for m in MODULES if name in vars(importlib.import_module(f"{_compat.__name__}.{m}"))]
        for name in _compat.__all__
    }
    assert {name: where for name, where in homes.items() if len(where) > 1} == {}


@pytest.mark.parametrize("module", MODULES)
def test_each_module_names_its_upstream_files_and_the_tests_that_guard_them(module):
    doc = importlib.import_module(f"{_compat.__name__}.{module}").__doc__
    assert doc is not None and "Upstream" in doc
    guard = f"tests/compat/test_{module}.py"
    assert guard in doc and (ROOT / guard).is_file()
