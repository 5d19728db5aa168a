"""The layout that shows the architecture (issue 26): the public paths keep working, the package's root holds only
those faces and the folders, no import circles (at module level or inside functions), and no module over 500 lines."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import lightning_accum

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
ROOT_MODULES = {"__init__.py", "fabric.py", "items.py", "keys.py", "manual.py", "schedules.py", "sequences.py"}
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
