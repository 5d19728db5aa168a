"""The documentation's code runs as written, and the README's commands leave a working, clean checkout.

Every ```python block of every ``docs/*.md`` page and of ``README.md`` runs here: a page's blocks in order, in one
namespace (a block may use what an earlier block of the same page imported or made, never another page's), in a
temporary directory, with W&B offline.

A block that needs hardware the test machine may lack says so in an HTML comment on the line before its fence, which
the rendered page does not show::

    <!-- docs-test: needs cuda -->      a CUDA device (``torch.cuda.is_available()``)
    <!-- docs-test: needs 8 gpus -->    at least that many CUDA devices (``torch.cuda.device_count()``)
    <!-- docs-test: needs the ray package -->   an optional package (importable), which an extra installs

The page's test runs every block without a marker; a marked block is a test of its own, skipped (with the reason)
only where the hardware is missing, and run, after the page's blocks before it, where it is present. A marker this
module doesn't know is an error, so that a typo can't skip a block for good. Blocks stay small: one that would train
for long trains a tiny model for a few steps, and what it shows must stay true at that size.
"""

from __future__ import annotations

import configparser
import importlib.util
import os
import re
import shutil
import subprocess
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PAGES = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]

_FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)[ \t]*$")
_MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*(?P<needs>.*?)\s*-->\s*$")
_NEEDS = re.compile(r"^needs (?:(?P<cuda>cuda)|(?P<gpus>\d+) gpus|the (?P<package>[\w.]+) package)$")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, from 1
    code: str
    needs: str  # the marker's text ("needs 8 gpus"), "" for none

    @property
    def name(self) -> str:
        page = self.page.relative_to(ROOT) if self.page.is_relative_to(ROOT) else self.page.name
        return f"{page}:{self.line}"

    def missing(self) -> str | None:
        """What this block needs that this machine lacks (None: it can run here)."""
        if not self.needs:
            return None
        match = _NEEDS.match(self.needs)
        if match is None:
            raise ValueError(f"{self.name}: unknown marker `docs-test: {self.needs}`; see tests/test_docs.py")
        if match["cuda"]:
            return None if torch.cuda.is_available() else "needs a CUDA device"
        if match["package"]:
            found = importlib.util.find_spec(match["package"]) is not None
            return None if found else f"needs the {match['package']} package (an extra: see pyproject.toml)"
        wanted = int(match["gpus"])
        found = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return None if found >= wanted else f"needs {wanted} CUDA devices, found {found}"


def python_blocks(page: Path) -> list[Block]:
    """The page's ```python blocks in order, dedented when they sit in a list or an admonition."""
    lines = page.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if fence is None:
            i += 1
            continue
        closing = re.compile(rf"^{re.escape(fence['indent'])}```[ \t]*$")
        end = next((j for j in range(i + 1, len(lines)) if closing.match(lines[j])), None)
        assert end is not None, f"{page.name}:{i + 1}: a fence that never closes"
        if fence["lang"] == "python":
            before = [line for line in lines[:i] if line.strip()]
            marker = _MARKER.match(before[-1]) if before else None
            code = "\n".join(line[len(fence["indent"]) :] for line in lines[i + 1 : end])
            blocks.append(Block(page, i + 1, code, marker["needs"] if marker else ""))
        i = end + 1
    return blocks


BLOCKS = {page: python_blocks(page) for page in PAGES}
MARKED = [block for blocks in BLOCKS.values() for block in blocks if block.needs]


@pytest.fixture
def sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A temporary working directory, W&B offline inside it, and the environment and process group put back after."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path))
    environ = dict(os.environ)  # Lightning's DDP sets MASTER_PORT and the like for the rest of the process
    yield tmp_path
    os.environ.clear()
    os.environ.update(environ)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def run_blocks(blocks: list[Block]) -> None:
    namespace: dict[str, object] = {"__name__": "__docs__"}
    for block in blocks:
        try:
            exec(compile(block.code, block.name, "exec"), namespace)
        except Exception as err:
            raise AssertionError(f"{block.name} failed: {type(err).__name__}: {err}\n{block.code}") from err


@pytest.mark.parametrize("page", [page for page in PAGES if BLOCKS[page]], ids=lambda p: str(p.relative_to(ROOT)))
def test_the_blocks_of_a_page_run_in_order(page: Path, sandbox: Path) -> None:
    run_blocks([block for block in BLOCKS[page] if not block.needs])


@pytest.mark.parametrize("block", MARKED, ids=lambda block: block.name)
def test_a_block_that_needs_hardware_runs_where_it_is_present(block: Block, sandbox: Path) -> None:
    missing = block.missing()
    if missing is not None:
        pytest.skip(f"{block.name} {missing}")
    earlier = [b for b in BLOCKS[block.page] if b.line < block.line and b.missing() is None]
    run_blocks([*earlier, block])


def test_the_collection_finds_every_block_and_reads_the_markers(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "# A page\n\n```python\nx = 1\n```\n\n- in a list:\n\n    ```python\n    y = x + 1\n    ```\n\n"
        "```bash\necho not python\n```\n\n<!-- docs-test: needs 8 gpus -->\n```python\nz = 3\n```\n\n"
        "<!-- docs-test: needs a quantum computer -->\n```python\npass\n```\n"
        "\n<!-- docs-test: needs the no_such_package_here package -->\n```python\npass\n```\n"
    )
    blocks = python_blocks(page)
    assert [(b.line, b.code, b.needs) for b in blocks] == [
        (3, "x = 1", ""),
        (9, "y = x + 1", ""),
        (18, "z = 3", "needs 8 gpus"),
        (23, "pass", "needs a quantum computer"),
        (28, "pass", "needs the no_such_package_here package"),
    ]
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert blocks[2].missing() == (None if found >= 8 else f"needs 8 CUDA devices, found {found}")
    with pytest.raises(ValueError, match="unknown marker `docs-test: needs a quantum computer`"):
        blocks[3].missing()
    assert blocks[4].missing() == "needs the no_such_package_here package (an extra: see pyproject.toml)"


def test_every_marker_in_the_docs_is_known() -> None:
    for block in MARKED:
        block.missing()  # raises on a marker this module doesn't know


# ----------------------------------------------------------------------------------------------------------------------
# The README's commands: the demo's environment runs the LightningCLI docs, and tox leaves `git status` clean.
# ----------------------------------------------------------------------------------------------------------------------


def extra_requirements(extras: set[str]) -> set[str]:
    """What installing the package with these extras brings, following `lightning-accum[...]` inside the extras."""
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")
    optional = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    found: set[str] = set()
    for extra in extras:
        for requirement in optional[extra]:
            nested = re.fullmatch(r"lightning-accum\[(.+)\]", requirement)
            found |= extra_requirements(set(nested[1].split(","))) if nested else {requirement}
    return found


def test_the_demo_environment_runs_the_cli_docs() -> None:
    # docs/cli.md runs `python -m examples.char_lm.main`, a LightningCLI, which imports `jsonargparse[signatures]`:
    # without it the page's first command was a ModuleNotFoundError in the README's own environment.
    cli_page = (ROOT / "docs" / "cli.md").read_text()
    assert "python -m examples.char_lm.main" in cli_page and ".tox/demo/bin/python" in cli_page
    tox = configparser.ConfigParser()
    tox.read(ROOT / "tox.ini")
    demo_extras = {extra.strip() for extra in tox["testenv:demo"]["extras"].split(",")}
    needed = {r for r in extra_requirements({"cli"}) if r.startswith("jsonargparse")}
    assert needed and needed <= extra_requirements(demo_extras), f"tox.ini's demo env has extras {demo_extras}"


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
@pytest.mark.parametrize("as_folder", [False, True], ids=["file", "folder"])
def test_the_venv_that_tox_writes_is_ignored(tmp_path: Path, as_folder: bool) -> None:
    # tox 4 writes `.venv` as a file holding its environment's path (".tox/tests"); `.venv/` matched folders only.
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    shutil.copy(ROOT / ".gitignore", tmp_path / ".gitignore")
    if as_folder:
        (tmp_path / ".venv").mkdir()
        (tmp_path / ".venv" / "pyvenv.cfg").write_text("home = /usr/bin\n")
    else:
        (tmp_path / ".venv").write_text(".tox/tests")
    git = ["git", "-C", str(tmp_path), "-c", "core.excludesFile=/dev/null"]
    status = subprocess.run([*git, "status", "--porcelain"], check=True, capture_output=True, text=True).stdout
    assert status.splitlines() == ["?? .gitignore"]


def test_the_fabric_pages_examples_run_clean(sandbox: Path) -> None:
    """A user who pastes docs/fabric.md's examples gets no warning of ours (issue 35, item 15)."""
    page = ROOT / "docs" / "fabric.md"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_blocks([block for block in BLOCKS[page] if not block.needs])
    ours = [str(w.message) for w in caught if "lightning_accum" in w.filename or "PaddedSequences" in str(w.message)]
    assert ours == []
