"""The snippets a newcomer copies first: the token counter for a Hugging Face causal LM, and one way to install.

The pages run in ``tests/test_docs.py``; these checks are about what the pages say, where running cannot tell: a
``count_items`` that counts one token too many a row runs fine, and so does an install line that pulls the CUDA build.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIRST_PAGES = ["README.md", "docs/index.md", "docs/getting-started.md"]  # what a newcomer opens first
INSTALL_PAGES = [
    *FIRST_PAGES,
    *sorted(
        str(page.relative_to(ROOT))
        for page in (ROOT / "docs").glob("*.md")
        if page.name not in ("index.md", "getting-started.md")
    ),
    "examples/README.md",
    "examples/hf_finetune/main.py",
    "examples/hf_finetune/__init__.py",
    "examples/hf_finetune/configs/ddp_cpu.yaml",
]
_PIP = re.compile(r"pip install (?P<args>[^`\n#]*)")
_OURS = re.compile(r"""^-e (?P<q>["']?)\.(\[(?P<extras>[A-Za-z,]+)\])?(?P=q)\s*$""")


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


@pytest.mark.parametrize("page", FIRST_PAGES)
def test_the_first_token_counter_on_a_first_page_is_the_causal_lms(page: str) -> None:
    # A Hugging Face causal LM scores labels[..., 1:]: a counter without shift=1 is off by one token a row.
    code = "\n".join(_python_blocks((ROOT / page).read_text()))
    first = re.search(r"count_items=([^\n]*)", code)
    assert first is not None, f"{page} shows no count_items"
    assert first[1].startswith('CountTokens("labels", shift=1)'), f"{page}: the first counter is {first[1]!r}"


def _installs(page: str) -> list[str]:
    # Messages quoted from the package (``error: ... pip install 'lightning-accum[wandb]'``) are not instructions.
    text = re.sub(r"``.*?``", "", (ROOT / page).read_text())
    return [m["args"].strip() for m in _PIP.finditer(text)]


@pytest.mark.parametrize("page", INSTALL_PAGES)
def test_every_install_of_the_package_has_one_form(page: str) -> None:
    for args in _installs(page):
        if re.match(r"(torch|tox)\b", args) or "lightning>=" in args:
            continue
        if "lightning-accum" not in args and not args.startswith("-e"):
            continue  # another package (litgpt's pins, say): not an install of this one
        assert _OURS.match(args), f'{page}: `pip install {args}`; write pip install -e ".[EXTRAS]" from the checkout'


def test_getting_started_takes_torchs_cpu_build_before_the_package() -> None:
    installs = _installs("docs/getting-started.md")
    cpu = "torch --index-url https://download.pytorch.org/whl/cpu"
    assert cpu in installs, installs
    assert installs.index(cpu) < next(i for i, a in enumerate(installs) if a.startswith("-e")), installs


@pytest.mark.parametrize("page", ["docs/huggingface.md", "examples/hf_finetune/main.py"])
def test_the_hf_install_line_carries_what_the_memory_page_uses(page: str) -> None:
    # docs/memory.md probes a LightningCLI config (jsonargparse: `cli`) and writes probe.png (matplotlib: `report`).
    extras = {e for args in _installs(page) if (m := _OURS.match(args)) and m["extras"] for e in m["extras"].split(",")}
    assert {"hf", "cli", "report"} <= extras, f"{page}: extras {sorted(extras)}"


def test_the_hf_pages_result_is_the_loss_optimized_and_says_which_is_which() -> None:
    # Under DDP rank 0's micro-batch loss (`train/loss`) and the window loss over both ranks differ: 1.16 vs 1.22.
    text = " ".join((ROOT / "docs/huggingface.md").read_text().split())
    result = re.search(
        r"In 40 steps the loss optimized, `accum/window_loss` [^.]*, falls from (\d+\.\d+) to (\d+\.\d+)", text
    )
    assert result is not None and result.groups() == ("5.57", "1.22")
    assert "`train/loss` in `metrics.csv` is one micro-batch's, on rank 0" in text
