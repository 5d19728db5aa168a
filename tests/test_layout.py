"""The layout that shows the architecture (issue 26): the public paths keep working, the package's root holds only
those faces and the folders, no import circles (at module level or inside functions), and no module over 500 lines."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

import lightning_accum
from lightning_accum._util.moved import MOVED

PACKAGE = Path(lightning_accum.__file__).parent
MAX_MODULE_LINES = 500

PUBLIC_PATHS = {
    # what the README, the how-to pages and the examples import; each must keep importing
    "lightning_accum": ["AccumulationMonitor", "AccumulationScheduler", "AutoMicroBatching", "ManualAccumulation"],
    "lightning_accum.callbacks": [
        "AccumulationMonitor",
        "AccumulationScheduler",
        "AutoMicroBatching",
        "BalancedSamplerState",
    ],
    "lightning_accum.items": ["CountTokens", "CountSamples"],
    "lightning_accum.schedules": ["AdaptiveBatchSize", "BatchSizeRamp", "StepwiseSchedule"],
    "lightning_accum.manual": ["ManualAccumulation"],
    "lightning_accum.fabric": ["FabricAccumulation", "FabricMicroBatching"],
    "lightning_accum.sequences": ["PaddedSequences", "BalancedBatchSampler", "measure_step_cost"],
    "lightning_accum.probe": ["probe_memory", "probe_tokens", "findings", "table", "write_outputs"],
    "lightning_accum.memory": ["is_oom_error"],
    "lightning_accum.memory.oom": ["OOMInjector", "OOMFault"],
    "lightning_accum.integrations.wandb": ["read_offline_run"],
    "lightning_accum.keys": ["BATCH_KEYS"],
}
ROOT_MODULES = {"__init__.py", "fabric.py", "items.py", "keys.py", "manual.py", "schedules.py"}
"""The package root's modules: the public faces; everything else lives in a folder."""


@pytest.mark.parametrize("module", sorted(PUBLIC_PATHS))
def test_every_public_path_imports_what_users_import(module):
    imported = importlib.import_module(module)
    missing = [name for name in PUBLIC_PATHS[module] if not hasattr(imported, name)]
    assert missing == [], f"{module} lost {missing}"


def test_the_root_holds_the_public_faces_and_folders_only():
    modules = {p.name for p in PACKAGE.glob("*.py")}
    assert modules == ROOT_MODULES


def test_no_module_in_the_package_is_over_500_lines():
    sizes = {str(p.relative_to(PACKAGE.parent)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert {path: n for path, n in sizes.items() if n > MAX_MODULE_LINES} == {}


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, anywhere in it (functions included, ``TYPE_CHECKING`` too).

    ``from package import module`` depends on the module only: the package's ``__init__`` is already being imported.
    """

    def owner(name: str) -> str:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("lightning_"):
                submodules = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules]
                deps.update(submodules)
                if len(submodules) < len(node.names):
                    deps.add(owner(node.module or ""))
            elif isinstance(node, ast.Import):
                deps.update(owner(a.name) for a in node.names if a.name.startswith("lightning_accum"))
        graph[name] = deps - {name, ""}
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                circles.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def test_no_import_circles_in_the_package():
    assert import_circles(import_graph(_modules())) == []


def test_the_circle_check_finds_a_circle_inside_a_function():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_circles(graph) == [["a", "b", "c"]]
    assert import_circles({"a": {"b"}, "b": set()}) == []


# ---- issue 34: one path per public class, the old paths still import, a cheap import, thin front ends -------------


@pytest.mark.parametrize("old", sorted(MOVED))
def test_every_moved_path_of_the_last_release_still_imports_the_same_objects(old):
    new = importlib.import_module(MOVED[old])
    with pytest.warns(DeprecationWarning, match=f"`{re.escape(old)}` moved to `{re.escape(MOVED[old])}`"):
        sys.modules.pop(old, None)
        stand_in = importlib.import_module(old)
    public = [name for name in dir(new) if not name.startswith("_")]
    assert public, f"{MOVED[old]} has no public names to forward"
    assert all(getattr(stand_in, name) is getattr(new, name) for name in public)


def test_a_moved_path_names_only_paths_that_are_gone_and_targets_that_exist():
    assert all(not (PACKAGE.parent / (old.replace(".", "/") + ".py")).exists() for old in MOVED)
    assert all(importlib.util.find_spec(new) is not None for new in MOVED.values())


def test_each_public_class_has_one_home_module_named_after_it():
    homes = {
        "AccumulationMonitor": "lightning_accum.callbacks.accumulation_monitor",
        "AccumulationScheduler": "lightning_accum.callbacks.accumulation_scheduler",
        "AutoMicroBatching": "lightning_accum.callbacks.auto_micro_batching",
        "BalancedSamplerState": "lightning_accum.callbacks.balanced_sampler_state",
        "FabricAccumulation": "lightning_accum.fabric",
        "FabricMicroBatching": "lightning_accum.fabric",
        "ManualAccumulation": "lightning_accum.manual",
        "PaddedSequences": "lightning_accum.sequences.padded",
        "BalancedBatchSampler": "lightning_accum.sequences.balanced_sampler",
    }
    found = {}
    for name in homes:
        for face in ("lightning_accum", "lightning_accum.callbacks", "lightning_accum.sequences"):
            obj = getattr(importlib.import_module(face), name, None)
            if obj is not None:
                found[name] = obj.__module__
    assert found == homes


def test_importing_the_package_loads_neither_the_probe_nor_the_command_line():
    code = "import sys, lightning_accum; print(sorted(m for m in sys.modules if m.startswith('lightning_accum')))"
    loaded = eval(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert [m for m in loaded if m.startswith(("lightning_accum.probe", "lightning_accum.cli"))] == []
    assert "lightning_accum.split.preflight" in loaded  # what `in_preflight` needs, and no more of the tool


FRONT_ENDS = [
    "lightning_accum.callbacks.auto_micro_batching",
    "lightning_accum.callbacks.accumulation_scheduler",
    "lightning_accum.callbacks.accumulation_monitor",
    "lightning_accum.fabric",
    "lightning_accum.manual",
]
MAX_FRONT_END_IMPORTS = 12


@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_a_front_end_is_glue_over_at_most_12_of_the_package_modules(front_end):
    deps = import_graph(_modules())[front_end]
    assert len(deps) <= MAX_FRONT_END_IMPORTS, sorted(deps)


def test_no_two_folders_differ_by_a_suffix_and_no_two_modules_share_a_name():
    folders = sorted(p.name for p in PACKAGE.rglob("*") if p.is_dir() and p.name != "__pycache__")
    stems = [p.stem for p in PACKAGE.rglob("*.py") if p.stem != "__init__"]
    assert [(a, b) for a in folders for b in folders if a != b and b.startswith(a)] == []
    assert sorted({s for s in stems if stems.count(s) > 1}) == []
