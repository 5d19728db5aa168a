"""The module paths of the last release that moved: each still imports, as a view of the module now in its place.

A moved path is not a second home: importing it gives a stand-in module that forwards every name to the new one (the
same objects), and warns once with a ``DeprecationWarning`` that names the new path. ``MOVED`` is the one table;
``tests/test_layout.py`` imports every entry.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from collections.abc import Sequence
from typing import Any

MOVED: dict[str, str] = {
    # 0.1 (issue 26) -> 0.2 (issue 34): the callbacks at their public paths, the hand loops as real modules
    "lightning_accum.front_ends": "lightning_accum.callbacks",
    "lightning_accum.front_ends.accumulation_monitor": "lightning_accum.callbacks.accumulation_monitor",
    "lightning_accum.front_ends.accumulation_scheduler": "lightning_accum.callbacks.accumulation_scheduler",
    "lightning_accum.front_ends.auto_micro_batching": "lightning_accum.callbacks.auto_micro_batching",
    "lightning_accum.front_ends.balanced_sampler_state": "lightning_accum.callbacks.balanced_sampler_state",
    "lightning_accum.front_ends.fabric": "lightning_accum.fabric",
    "lightning_accum.front_ends.manual": "lightning_accum.manual",
    # reading and cutting batches, under a name that says so
    "lightning_accum.splitting": "lightning_accum.batches",
    "lightning_accum.splitting.hooks": "lightning_accum.batches.hooks",
    "lightning_accum.splitting.plan": "lightning_accum.batches.plan",
    "lightning_accum.splitting.trim": "lightning_accum.batches.trim",
    # the planner in a folder of its own
    "lightning_accum.split.planner_history": "lightning_accum.split.planner.history",
    "lightning_accum.split.planner_messages": "lightning_accum.split.planner.messages",
    "lightning_accum.split.planner_settings": "lightning_accum.split.planner.settings",
    "lightning_accum.split.planner_units": "lightning_accum.split.planner.units",
    "lightning_accum.split.simulation": "lightning_accum.split.planner.simulation",
    # sequences in one place
    "lightning_accum.split.tokens": "lightning_accum.sequences.token_cut",
    "lightning_accum.split.masks": "lightning_accum.sequences.masks",
    "lightning_accum.split.balanced_sampler": "lightning_accum.sequences.balanced_sampler",
    "lightning_accum.split.balancing": "lightning_accum.sequences.balancing",
    "lightning_accum.split.pass_timing": "lightning_accum.sequences.pass_timing",
    # split mode's cold start is no part of the probe tool
    "lightning_accum.probe.preflight": "lightning_accum.split.preflight",
    "lightning_accum.probe.report": "lightning_accum.probe.sample_report",  # no two modules of one name
}


class _MovedPathFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the paths in `MOVED` (and only those), and loads each as a stand-in for its new module."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        is_package = any(other.startswith(fullname + ".") for other in MOVED)
        return importlib.machinery.ModuleSpec(fullname, self, is_package=is_package)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        new = MOVED[spec.name]
        warnings.warn(
            f"`{spec.name}` moved to `{new}`; import from there (the old path goes in a later release).",
            DeprecationWarning,
            stacklevel=2,
        )
        target = importlib.import_module(new)
        stand_in = types.ModuleType(spec.name, target.__doc__)

        def forward(name: str) -> Any:
            return getattr(target, name)

        # PEP 562: a module's own `__getattr__` and `__dir__`, read from its namespace.
        stand_in.__dict__.update(__getattr__=forward, __dir__=lambda: dir(target))
        return stand_in

    def exec_module(self, module: types.ModuleType) -> None:
        if module.__spec__ is not None and module.__spec__.submodule_search_locations is not None:
            module.__path__ = []


def install() -> None:
    """Put the finder on ``sys.meta_path`` once, ahead of the path finder (a moved path has no file any more)."""
    if not any(isinstance(finder, _MovedPathFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _MovedPathFinder())
