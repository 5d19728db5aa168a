"""The shape the codebase keeps: every function (issue 10) and every class (issue 20) short enough to read, and its
types checked (issue 20): `tox -e lint` runs mypy, and every `type: ignore` says what it silences and why."""

from __future__ import annotations

import ast
import configparser
import re
import tokenize
from pathlib import Path

import pytest

import lightning_accum

PACKAGE = Path(lightning_accum.__file__).parent
ROOT = Path(__file__).resolve().parents[1]
MAX_FUNCTION_LINES = 60  # signature, docstring and body
MAX_CLASS_LINES = 300  # the same: from `class` to its last line, docstring included

CLASSES_STILL_OVER: dict[str, str] = {}
"""Classes allowed over `MAX_CLASS_LINES` for now, as ``"path:Name"`` (``"lightning_accum/x.py:Big"``) -> the issue
that shrinks them. Empty: a class that grows past the limit fails here. An entry is only for a class that another
branch is splitting; once it is under the limit, the entry fails `test_the_allow_list_names_only_classes_still_over`.
"""


def long_functions(root: Path, limit: int) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name}() has {lines} lines")
    return found


def long_classes(root: Path, limit: int) -> dict[str, int]:
    """``"path:Name"`` -> lines, for every class (nested ones too) over ``limit`` lines under ``root``."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > limit:
                found[f"{path.relative_to(root.parent)}:{node.name}"] = node.end_lineno - node.lineno + 1
    return found


def test_no_function_in_the_package_is_over_60_lines():
    assert long_functions(PACKAGE, MAX_FUNCTION_LINES) == []


def test_the_check_finds_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(61))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(f"def long():\n{body}\n\n\ndef short():\n    return 1\n")
    assert long_functions(tmp_path / "pkg", MAX_FUNCTION_LINES) == ["pkg/mod.py:1 long() has 62 lines"]


def test_no_class_in_the_package_is_over_300_lines():
    over = long_classes(PACKAGE, MAX_CLASS_LINES)
    assert {name: lines for name, lines in over.items() if name not in CLASSES_STILL_OVER} == {}


def test_the_allow_list_names_only_classes_still_over():
    assert set(CLASSES_STILL_OVER) <= set(long_classes(PACKAGE, MAX_CLASS_LINES))


def test_the_check_finds_a_long_class(tmp_path):
    # `class Big:`, then 101 two-line methods with a blank line between: 1 + 101 * 2 + 100 lines.
    methods = "\n".join(f"    def m{i}(self):\n        return {i}\n" for i in range(101))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(f"class Big:\n{methods}\n\nclass Small:\n    pass\n")
    assert long_classes(tmp_path / "pkg", MAX_CLASS_LINES) == {"pkg/mod.py:Big": 1 + 101 * 2 + 100}


# ---- types -------------------------------------------------------------------------------------------------------

TYPE_IGNORE = re.compile(r"#\s*type:\s*ignore\b")
EXPLAINED_IGNORE = re.compile(r"#\s*type:\s*ignore\[[a-z-]+(?:,\s*[a-z-]+)*\]\s+#\s*\S")
"""``# type: ignore[code, ...]  # why``: the error codes it silences, then the reason, on the same line."""


def unexplained_ignores(root: Path) -> list[str]:
    """Every ``type: ignore`` comment under ``root`` without error codes in brackets or a reason after them."""
    found = []
    for path in sorted(root.rglob("*.py")):
        with path.open("rb") as source:
            for token in tokenize.tokenize(source.readline):  # comments only: a string that holds one is not one
                if token.type != tokenize.COMMENT or not TYPE_IGNORE.search(token.string):
                    continue
                if not EXPLAINED_IGNORE.search(token.string):
                    found.append(f"{path.relative_to(root.parent)}:{token.start[0]} {token.string}")
    return found


def test_every_type_ignore_in_the_package_names_its_codes_and_why():
    assert unexplained_ignores(PACKAGE) == []


def test_the_check_finds_an_unexplained_type_ignore(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(
        "a = f()  # type: ignore\n"
        "b = f()  # type: ignore[no-any-return]\n"
        "c = f()  # type: ignore  # no code\n"
        "d = f()  # type: ignore[assignment, misc]  # torch < 2.4 has none\n"
        "e = '# type: ignore'\n"
        "g = f()  # noqa: E501  # type: ignore[arg-type]\n"
    )
    assert unexplained_ignores(tmp_path / "pkg") == [
        "pkg/mod.py:1 # type: ignore",
        "pkg/mod.py:2 # type: ignore[no-any-return]",
        "pkg/mod.py:3 # type: ignore  # no code",
        "pkg/mod.py:6 # noqa: E501  # type: ignore[arg-type]",
    ]


def test_the_lint_env_runs_mypy_pinned_and_strict_over_the_package():
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")
    tox = configparser.ConfigParser()
    tox.read(ROOT / "tox.ini")
    lint = tox["testenv:lint"]
    assert re.search(r"^\s*mypy==[\w.]+\s*$", lint["deps"], re.MULTILINE), lint["deps"]
    assert "mypy" in [line.split()[0] for line in lint["commands"].splitlines() if line.strip()], lint["commands"]
    mypy = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    assert mypy["strict"] is True and mypy["files"] == ["lightning_accum"]


# ---- the pure core ------------------------------------------------------------------------------------------------

PURE_MARKER = re.compile(r"\bPure\b[:.]|\bNo Trainer\b")
"""A module whose docstring says "Pure:", "Pure." or "No Trainer" promises that it imports without Lightning."""


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_level_imports(tree: ast.Module, name: str, is_package: bool) -> set[str]:
    """What ``name`` imports when it is imported: its top-level imports, not those inside functions or under
    ``if TYPE_CHECKING:``, relative ones resolved; ``from a import b`` counts ``a`` and ``a.b``."""
    found: set[str] = set()
    base = name.split(".") if is_package else name.split(".")[:-1]
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for sub in ast.walk(node):
            if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                break
            if isinstance(sub, ast.Import):
                found.update(alias.name for alias in sub.names)
            elif isinstance(sub, ast.ImportFrom):
                module = sub.module or ""
                if sub.level:
                    module = ".".join(base[: len(base) - sub.level + 1] + ([module] if module else []))
                found.add(module)
                found.update(f"{module}.{alias.name}" for alias in sub.names)
    return found


def lightning_paths(root: Path) -> tuple[list[str], dict[str, list[str]]]:
    """The modules under ``root`` that say they are pure, and for each that reaches Lightning when imported, the
    chain of package modules that leads there (a package's ``__init__`` runs first, so it counts as imported)."""
    trees = {module_name(p, root): (ast.parse(p.read_text()), p.name == "__init__.py") for p in root.rglob("*.py")}
    graph = {name: module_level_imports(tree, name, is_package) for name, (tree, is_package) in trees.items()}
    pure = sorted(name for name, (tree, _) in trees.items() if PURE_MARKER.search(ast.get_docstring(tree) or ""))

    def parents(module: str) -> list[str]:  # importing a.b.c runs a, a.b and a.b.c
        parts = module.split(".")
        return [".".join(parts[: i + 1]) for i in range(len(parts))]

    reaching: dict[str, list[str]] = {}
    for start in pure:
        chain: dict[str, str | None] = {start: None}
        todo = [start]
        while todo:
            current = todo.pop()
            for imported in sorted(graph[current]):
                if imported.split(".")[0] == "lightning":
                    path, step = [imported], current
                    while step is not None:
                        path.append(step)
                        step = chain[step]
                    reaching[start] = path[::-1]
                    todo = []
                    break
                for module in parents(imported):
                    if module in graph and module not in chain and module != root.name:
                        chain[module] = current
                        todo.append(module)
    return pure, reaching


def test_the_pure_core_imports_no_lightning():
    pure, reaching = lightning_paths(PACKAGE)
    assert {"lightning_accum.split.planner", "lightning_accum.core.engine", "lightning_accum.sequences"} <= set(pure)
    assert reaching == {}, "\n".join(" -> ".join(chain) for chain in reaching.values())


def test_the_check_finds_lightning_reached_through_another_module(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text('"""A package."""\n')
    (package / "core.py").write_text('"""Pure: no Trainer."""\nfrom pkg import glue\n')
    (package / "glue.py").write_text('"""Glue."""\nfrom typing import TYPE_CHECKING\nimport lightning.pytorch as pl\n')
    (package / "typed.py").write_text(
        '"""Pure."""\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import lightning\n\n'
        "def f():\n    import lightning\n"
    )
    pure, reaching = lightning_paths(package)
    assert pure == ["pkg.core", "pkg.typed"]
    assert reaching == {"pkg.core": ["pkg.core", "pkg.glue", "lightning.pytorch"]}


# ---- issue 25, item 15: every multi-rank test starts its ranks through tests/helpers.py --------------------------

RANK_STARTERS = {"DDPStrategy", "ModelParallelStrategy", "FSDPStrategy", "start_processes", "spawn"}
"""What starts ranks, or builds the strategy that does: outside tests/helpers.py a test uses `h.ddp_strategy`,
`h.fsdp2_strategy` or `h.start_ranks` instead, whose process-group timeout turns a disagreement into a failure."""


def _called_name(func: ast.expr) -> str | None:
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None


def ranks_started_around_the_helpers(root: Path) -> list[str]:
    """Calls under ``root`` (its ``helpers.py`` aside) that start ranks or build a strategy without the test timeout."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.name == "helpers.py" and path.parent == root:
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, ast.Call):
                continue
            name, keywords = _called_name(node.func), {k.arg: k.value for k in node.keywords}
            where = f"{path.relative_to(root.parent)}:{node.lineno}"
            if name in RANK_STARTERS and not (name == "spawn" and not _is_multiprocessing(node.func)):
                found.append(f"{where} calls {name}(): use tests.helpers (ddp_strategy, fsdp2_strategy, start_ranks)")
            elif name == "init_process_group" and "timeout" not in keywords and not _one_rank(keywords):
                found.append(f"{where} calls init_process_group() without timeout=h.RANK_TIMEOUT")
            strategy = keywords.get("strategy")
            if isinstance(strategy, ast.Constant) and str(strategy.value).startswith(("ddp", "fsdp", "model_parallel")):
                found.append(f"{where} passes strategy={strategy.value!r}: use strategy=h.ddp_strategy()")
    return found


def _is_multiprocessing(func: ast.expr) -> bool:
    """``mp.spawn`` / ``torch.multiprocessing.spawn``, not an unrelated ``spawn`` (a pexpect one, say)."""
    return isinstance(func, ast.Attribute) and ast.unparse(func.value) in {
        "mp",
        "multiprocessing",
        "torch.multiprocessing",
    }


def _one_rank(keywords: dict[str | None, ast.expr]) -> bool:
    size = keywords.get("world_size")
    return isinstance(size, ast.Constant) and size.value == 1


def test_every_test_that_starts_ranks_goes_through_the_helpers():
    # A test that built its own `DDPStrategy` would wait 30 minutes in a mismatched collective, past pytest's timeout.
    assert ranks_started_around_the_helpers(ROOT / "tests") == []


def test_the_check_finds_ranks_started_around_the_helpers(tmp_path):
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "helpers.py").write_text("import torch.multiprocessing as mp\nmp.start_processes(print)\n")
    (tests / "test_x.py").write_text(
        "import torch.multiprocessing as mp\n"
        "from lightning.pytorch.strategies import DDPStrategy\n"
        "DDPStrategy(start_method='spawn')\n"
        "mp.start_processes(print, nprocs=2)\n"
        "mp.spawn(print, nprocs=2)\n"
        "dist.init_process_group('gloo', rank=0, world_size=2)\n"
        "dist.init_process_group('gloo', rank=0, world_size=1)\n"  # one rank: nothing to disagree with
        "pl.Trainer(strategy='ddp_spawn', devices=2)\n"
        "pexpect.spawn('ls')\n"
    )
    assert [f.split(" ")[0] for f in ranks_started_around_the_helpers(tests)] == [
        f"tests/test_x.py:{line}" for line in (3, 4, 5, 6, 8)
    ]
