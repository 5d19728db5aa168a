"""What the probe says about either result, by its kind: the sentences, the table, the JSON, the snippet, the plot.

`lightning_accum.probe.sample_report` presents a `lightning_accum.probe.result.ProbeResult` (by samples) and
`lightning_accum.probe.token_report` a `lightning_accum.probe.token_result.TokenProbeResult` (by tokens); the result
types hold what was measured and import no presentation.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

from lightning_accum.probe import sample_report as report
from lightning_accum.probe import token_report
from lightning_accum.probe.result import ProbeResult
from lightning_accum.probe.token_result import TokenProbeResult

Result = ProbeResult | TokenProbeResult


def _presenter(result: Result) -> ModuleType:
    if isinstance(result, TokenProbeResult):
        return token_report
    if isinstance(result, ProbeResult):
        return report
    raise TypeError(
        f"`result` must be what `probe_memory` or `probe_tokens` returned, got {type(result).__name__}. Pass the"
        " `ProbeResult` or `TokenProbeResult` itself."
    )


def findings(result: Result) -> list[str]:
    """The answers the probe measured, in plain sentences with the numbers."""
    return list(_presenter(result).findings(result))


def table(result: Result) -> str:
    """The measurements as a fixed-width text table, then the findings and the snippet."""
    return str(_presenter(result).table(result))


def to_dict(result: Result) -> dict[str, Any]:
    """Everything as JSON-serializable values (bytes as numbers)."""
    return dict(_presenter(result).to_dict(result))


def snippet(result: Result) -> str | None:
    """Ready-to-paste ``AutoMicroBatching`` settings (Python and LightningCLI YAML) for what fits, if anything does."""
    text: str | None = _presenter(result).snippet(result)
    return text


def plot(result: Result, path: str | Path) -> Path:
    """Write the result's PNG to ``path``.

    Raises:
        ModuleNotFoundError: if matplotlib is not installed (``pip install 'lightning-accum[report]'``).
    """
    return Path(_presenter(result).plot(result, path))


def write_outputs(result: Result, output_dir: str | Path, stem: str = "probe") -> dict[str, Path]:
    """Write ``<stem>.txt`` (the table), ``<stem>.json`` and ``<stem>.png`` into ``output_dir``; return the paths.

    Without matplotlib the picture is left out with a `UserWarning` that names the package to install: the text and
    the JSON hold every number, so the paths returned are theirs alone.
    """
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"txt": out / f"{stem}.txt", "json": out / f"{stem}.json", "png": out / f"{stem}.png"}
    paths["txt"].write_text(table(result) + "\n")
    paths["json"].write_text(json.dumps(to_dict(result), indent=2) + "\n")
    try:
        plot(result, paths["png"])
    except ModuleNotFoundError as err:
        if err.name != "matplotlib":
            raise
        warnings.warn(
            f"{paths['png'].name} was not written: drawing it needs matplotlib, which is not installed (pip install "
            f"'lightning-accum[report]', or pip install matplotlib). {paths['txt'].name} and {paths['json'].name} "
            "hold every number.",
            UserWarning,
            stacklevel=2,
        )
        del paths["png"]
    return paths
