"""``lightning-accum report RUN``: the dashboard's panels as one PNG, from a W&B offline run or a CSVLogger file.

The panels are `lightning_accum.integrations.wandb.PANEL_LAYOUT`, the same ones the W&B workspace shows, so
a run looks the same with or without W&B.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lightning_accum import keys
from lightning_accum.cli._common import CommandError, check_output_file
from lightning_accum.integrations.wandb import (
    PANEL_LAYOUT,
    STEP_METRIC,
    OfflineRun,
    SectionSpec,
    layout_keys,
    read_offline_run,
)
from lightning_accum.monitoring import BUDGET_FRACTION

Series = dict[str, list[tuple[float, float]]]
"""key -> ``(step, value)`` points, in logging order."""

_COLUMNS = 3
# Limits, not measurements: drawn dashed so the eye reads them as the line not to cross.
_REFERENCE_KEYS = frozenset({BUDGET_FRACTION})
_DEFAULT_OUTPUT = "lightning_accum_report.png"
_FORMATS = (".png", ".pdf", ".svg")  # what matplotlib writes without extra packages

UNFINISHED_RUN_WAIT_S = 2.0
"""How long the command waits for the exit record of a W&B run that lacks one: wandb may still be flushing a run
that has just finished (see `read_offline_run`)."""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``report`` subcommand to an ``argparse`` subparsers object."""
    parser = subparsers.add_parser(
        "report",
        help="plot a run's accumulation, memory, recovery and throughput metrics to a PNG",
        description=(
            "Draw the panels of the lightning_accum W&B dashboard (batch, memory, recovery, throughput) from a run"
            " logged by AccumulationMonitor, without W&B's servers."
        ),
    )
    parser.add_argument(
        "run",
        metavar="RUN",
        help=(
            "a W&B offline run directory or its run-*.wandb file, a wandb/ directory (its latest run), or a"
            " CSVLogger metrics.csv (or the directory that holds it)"
        ),
    )
    parser.add_argument(
        "--output",
        "-o",
        default=_DEFAULT_OUTPUT,
        help="the PNG to write; .pdf and .svg work too, and no suffix means .png (default: %(default)s)",
    )
    parser.add_argument("--title", help="the figure title (default: the run's path)")
    parser.add_argument(
        "--allow-incomplete",
        action="store_true",
        help="draw a W&B run that did not finish, or whose file is cut short, from the records it holds",
    )
    return parser


def run(args: argparse.Namespace) -> int:
    """Read the run, draw the panels and write the image; return the exit status.

    Raises:
        CommandError: the run cannot be read, is incomplete (without ``--allow-incomplete``), holds none of the
            metrics, or the output cannot be written.
    """
    output = _output_path(args.output)
    try:
        series, wandb_run = _load(args.run, wait_s=UNFINISHED_RUN_WAIT_S)
    except ModuleNotFoundError as err:
        raise CommandError(f"reading a W&B run needs {err.name!r}: pip install 'lightning-accum[wandb]'.") from err
    except (OSError, ValueError) as err:
        raise CommandError(str(err)) from err
    problem, rows = None, 0
    if wandb_run is not None and not wandb_run.complete:
        problem, rows = _incomplete(wandb_run), len(wandb_run.history)
    if problem and not args.allow_incomplete:
        if not rows:
            raise CommandError(f"{problem} It holds no history rows yet: report it when the run has logged some.")
        raise CommandError(
            f"{problem} Report a finished run, or pass `--allow-incomplete` to draw the {rows} history rows it holds."
        )
    if not any(series.get(key) for key in layout_keys()):
        raise CommandError(
            f"{args.run!r} holds none of the lightning_accum metrics ({keys.EFFECTIVE_BATCH_SIZE}, ...)."
            " Was `AccumulationMonitor` among the Trainer's callbacks?"
        )
    if problem:
        print(f"warning: {problem} Drawing the {rows} history rows it holds.", file=sys.stderr)
    try:
        output = write_report(series, output, title=args.title or str(args.run))
    except ModuleNotFoundError as err:
        raise CommandError(
            f"`lightning-accum report` needs {err.name!r}: pip install 'lightning-accum[report]'."
        ) from err
    except OSError as err:
        raise CommandError(f"`--output`={args.output!r} could not be written: {err}. Choose another path.") from err
    print(f"wrote {output}")
    return 0


def _output_path(value: str) -> Path:
    # The path printed is the path written: matplotlib would add ".png" to a name without a suffix behind our back.
    path = check_output_file(value, "--output", _DEFAULT_OUTPUT)
    if not path.suffix:
        path = path.with_name(path.name + ".png")
        check_output_file(str(path), "--output", _DEFAULT_OUTPUT)
    if path.suffix.lower() not in _FORMATS:
        raise CommandError(
            f"`--output`={value!r}: {path.suffix!r} is not a format the report writes. Use a .png name (or "
            + ", ".join(_FORMATS[1:])
            + ")."
        )
    return path


def _incomplete(run: OfflineRun) -> str:
    if run.truncated_at is not None:
        size = run.path.stat().st_size
        return (
            f"{str(run.path)!r} is truncated: it ends inside a record at byte {run.truncated_at} of {size}, so the"
            " run was killed while writing it, or is still running."
        )
    return (
        f"{str(run.path)!r} is incomplete: it has no exit record, so the run did not finish (it was killed, or is"
        " still running)."
    )


# ------------------------------------------------------------------------------------------------------------------
# reading
# ------------------------------------------------------------------------------------------------------------------
def load_series(path: str | Path) -> Series:
    """Every numeric metric of a run as ``(step, value)`` points; the step is the optimizer step.

    A W&B run that did not finish gives the rows its file holds (`OfflineRun.complete` says whether that is all).

    Raises:
        FileNotFoundError: nothing readable at ``path``.
        ValueError: a file that is neither a W&B transaction log nor a CSV with a ``step`` column.
    """
    return _load(path)[0]


def _load(path: str | Path, *, wait_s: float = 0.0) -> tuple[Series, OfflineRun | None]:
    # The series, and the W&B run they came from (None for a CSV).
    path = Path(path)
    csv_file = path if path.suffix == ".csv" else path / "metrics.csv"
    if csv_file.is_file():
        return _series_from_csv(csv_file), None
    if path.suffix == ".csv":
        raise FileNotFoundError(f"No CSV file at {str(path)!r}.")
    wandb_run = read_offline_run(path, wait_s=wait_s)
    return _series_from_rows(wandb_run.history, STEP_METRIC), wandb_run


def _series_from_csv(path: Path) -> Series:
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames is None or "step" not in reader.fieldnames:
            raise ValueError(f"{str(path)!r} has no `step` column: expected a CSVLogger metrics.csv.")
        return _series_from_rows(list(reader), "step")


def _series_from_rows(rows: Sequence[Mapping[str, Any]], step_key: str) -> Series:
    series: Series = {}
    for row in rows:
        step = _number(row.get(step_key))
        if step is None:
            continue
        for key, raw in row.items():
            value = _number(raw)
            if key != step_key and value is not None:
                series.setdefault(key, []).append((step, value))
    return series


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or value is None or value == "":
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


# ------------------------------------------------------------------------------------------------------------------
# drawing
# ------------------------------------------------------------------------------------------------------------------
def write_report(
    series: Series, output: str | Path, *, title: str = "", layout: Sequence[SectionSpec] = PANEL_LAYOUT
) -> Path:
    """Draw one row of panels per section of ``layout`` (wrapping at three panels) and save the image.

    The format follows the suffix of ``output`` (PNG, PDF, SVG); a name without one gets ``.png``. Returns the path
    written.
    """
    # The object API with an Agg canvas: no pyplot, so no global backend is chosen for the caller's process.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows_per_section = [math.ceil(len(section.panels) / _COLUMNS) for section in layout]
    figure = Figure(figsize=(5.0 * _COLUMNS, 3.1 * sum(rows_per_section) + 0.8), layout="constrained")
    FigureCanvasAgg(figure)
    if title:
        figure.suptitle(title, fontsize=13, fontweight="bold")
    subfigures = figure.subfigures(len(layout), 1, height_ratios=rows_per_section, squeeze=False)[:, 0]
    for section, subfigure, n_rows in zip(layout, subfigures, rows_per_section, strict=True):
        subfigure.suptitle(section.name, fontsize=12, fontweight="bold", x=0.01, ha="left")
        axes = subfigure.subplots(n_rows, _COLUMNS, squeeze=False).ravel()
        for ax, panel in zip(axes, section.panels, strict=False):  # the last row may have spare axes
            _draw_panel(ax, panel, series)
        for ax in axes[len(section.panels) :]:
            ax.set_visible(False)
    output = Path(output)
    if not output.suffix:
        output = output.with_name(output.name + ".png")
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output, dpi=100, format=output.suffix[1:].lower())
    return output


def _draw_panel(ax: Any, panel: Any, series: Series) -> None:
    ax.set_title(panel.title, fontsize=10)
    ax.set_xlabel("optimizer step", fontsize=8)
    ax.set_ylabel(panel.y_label, fontsize=8)
    ax.tick_params(labelsize=8)
    ax.grid(True, alpha=0.3)
    drawn = 0
    for key in panel.keys:
        points = series.get(key)
        if not points:
            continue
        steps, values = zip(*points, strict=True)
        if panel.style == "points":
            ax.scatter(steps, values, s=28, label=key, zorder=3)
        elif key in _REFERENCE_KEYS:
            ax.plot(steps, values, linestyle="--", linewidth=1.5, color="tab:red", label=key)
        else:
            ax.plot(steps, values, marker="." if len(points) < 60 else None, linewidth=1.3, label=key)
        drawn += 1
    if drawn == 0:
        ax.text(0.5, 0.5, "nothing logged", ha="center", va="center", transform=ax.transAxes, color="gray")
    elif len(panel.keys) > 1:
        ax.legend(fontsize=7, loc="best")
    low, high = panel.y_range
    if drawn and (low is not None or high is not None):
        if high is None:
            # Headroom above the largest value, so a flat series does not sit on the frame; 1 when all are 0.
            finite = [v for key in panel.keys for _, v in series.get(key, []) if math.isfinite(v)]
            largest = max(finite, default=0.0)
            high = largest * 1.1 if largest > (low or 0) else (low or 0) + 1
        ax.set_ylim(low, high)
    ax.ticklabel_format(axis="y", useOffset=False, style="plain")
