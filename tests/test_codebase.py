"""The shape the codebase keeps (issue 10): every function in the package short enough to read at once."""

from __future__ import annotations

import ast
from pathlib import Path

import lightning_accum

PACKAGE = Path(lightning_accum.__file__).parent
MAX_FUNCTION_LINES = 60  # signature, docstring and body


def long_functions(root: Path, limit: int) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name}() has {lines} lines")
    return found


def test_no_function_in_the_package_is_over_60_lines():
    assert long_functions(PACKAGE, MAX_FUNCTION_LINES) == []


def test_the_check_finds_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(61))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(f"def long():\n{body}\n\n\ndef short():\n    return 1\n")
    assert long_functions(tmp_path / "pkg", MAX_FUNCTION_LINES) == ["pkg/mod.py:1 long() has 62 lines"]
