"""``lightning-accum report RUN``: the dashboard's panels as one PNG, from a W&B offline run or a CSVLogger file.

The panels are `lightning_accum.integrations.wandb.PANEL_LAYOUT`, the same ones the W&B workspace shows, so
a run looks the same with or without W&B; the report leaves out the optional ones (the token budget and the padding,
the ranks' balance, the noise scale, allocator retries) that a run never logged.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_accum import keys
from lightning_accum.cli._common import CommandError, check_output_file
from lightning_accum.cli.report_summary import Series, finite_values, size_text, splits_by_tokens, summarize
from lightning_accum.integrations.wandb import (
    PANEL_LAYOUT,
    STEP_METRIC,
    OfflineRun,
    PanelSpec,
    SectionSpec,
    layout_keys,
    read_offline_run,
)
from lightning_accum.monitor.rows import BUDGET_FRACTION

if TYPE_CHECKING:
    from matplotlib.figure import Figure

_COLUMNS = 3
# Limits, not measurements: drawn dashed so the eye reads them as the line not to cross.
_REFERENCE_KEYS = frozenset({BUDGET_FRACTION})
# Event key -> (colour, what it is): the Events panel's points and the vertical marks on the other panels agree.
_EVENT_STYLE: dict[str, tuple[str, str]] = {
    keys.EVENT_OOM_RECOVERED: ("tab:red", "OOM recovered"),
    keys.EVENT_SHRINK: ("tab:orange", "micro-batch shrunk"),
    keys.EVENT_GROW: ("tab:green", "micro-batch grown"),
    keys.EVENT_SCHEDULE_CHANGE: ("tab:purple", "k changed"),
}
# Split by tokens the planner moves the token budget: its events say so.
_EVENT_LABEL_BY_TOKENS: dict[str, str] = {
    keys.EVENT_OOM_RECOVERED: "OOM recovered",
    keys.EVENT_SHRINK: "token budget shrunk",
    keys.EVENT_GROW: "token budget grown",
    keys.EVENT_SCHEDULE_CHANGE: "k changed",
}
_OFF_SCALE = 3.0  # a budget more than this many times the largest peak is named, not drawn
_PLAIN_BELOW = 1e6  # y tick labels are written out below this, and in powers of ten above (a diverged loss)
# Keys that only some runs log: a panel that draws one of them is left out where none of them was logged, and a
# section with no panel left goes too. The token keys need AutoMicroBatching(sequences=...), the ranks' balance
# split mode on more than one rank, the noise scale AccumulationMonitor(gradient_noise_scale=True), the allocator's
# retries a CUDA or XPU device, the schedule's figures an owner (its target a schedule that plans windows, the goodput
# pair `AdaptiveBatchSize`'s goodput objective); the other panels are drawn even when blank, so a missing figure shows.
_OPTIONAL_KEYS = frozenset(
    {
        *keys.TOKEN_KEYS,
        *keys.RANK_KEYS,
        *keys.PRICE_KEYS,
        *keys.NOISE_SCALE_KEYS,
        keys.ALLOC_RETRIES,
        *keys.SCHEDULE_KEYS,
        *keys.GOODPUT_KEYS,
    }
)
_DEFAULT_OUTPUT = "lightning_accum_report.png"
_FORMATS = (".png", ".pdf", ".svg")  # what matplotlib writes without extra packages

UNFINISHED_RUN_WAIT_S = 2.0
"""How long the command waits for the exit record of a W&B run that lacks one: wandb may still be flushing a run
that has just finished (see `read_offline_run`)."""


HELP = "plot a run's accumulation, memory, recovery and throughput metrics to a PNG"

DESCRIPTION = (
    "Draw the panels of the lightning_accum W&B dashboard (batch, memory, recovery, throughput) from a run"
    " logged by AccumulationMonitor, without W&B's servers."
)


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``report`` subcommand's arguments to its parser (`lightning_accum.cli.main` builds it); return it."""
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
        summary = summary_path(output).read_text().strip()
    except ModuleNotFoundError as err:
        raise CommandError(
            f"`lightning-accum report` needs {err.name!r}: pip install 'lightning-accum[report]'."
        ) from err
    except OSError as err:
        raise CommandError(f"`--output`={args.output!r} could not be written: {err}. Choose another path.") from err
    print(summary)
    print(f"wrote {output}")
    print(f"wrote {summary_path(output)}")
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
    """Draw the panels (see `build_figure`) into ``output`` and write the `summarize` paragraph beside it.

    The format follows the suffix of ``output`` (PNG, PDF, SVG); a name without one gets ``.png``. The summary goes
    to the same path with ``.txt`` (`summary_path`). Returns the image's path.
    """
    output = Path(output)
    if not output.suffix:
        output = output.with_name(output.name + ".png")
    figure = build_figure(series, title=title, layout=layout)
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output, dpi=100, format=output.suffix[1:].lower())
    summary_path(output).write_text(summarize(series) + "\n")
    return output


def summary_path(output: str | Path) -> Path:
    """Where `write_report` puts the text summary of the image at ``output``: the same path with ``.txt``."""
    return Path(output).with_suffix(".txt")


def build_figure(series: Series, *, title: str = "", layout: Sequence[SectionSpec] = PANEL_LAYOUT) -> Figure:
    """The report as a matplotlib ``Figure``: one row of panels per section of ``layout``, three to a row.

    Every panel spans the same steps; steps, sizes and counts get whole-number ticks; events are marked on the
    panels that ask for them; a scalar panel (the capacity) is written into its section's title; the user's own
    training loss is drawn next to the window loss. A panel of keys that only some runs log (the noise scale, the
    allocator's retries) is left out when none of them was logged, and so is a section left without panels.
    """
    # The object API with an Agg canvas: no pyplot, so no global backend is chosen for the caller's process.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    sections = _sections_to_draw(series, layout)
    rows_per_section = [max(1, math.ceil(len(panels) / _COLUMNS)) for _, panels in sections]
    figure = Figure(figsize=(5.0 * _COLUMNS, 3.1 * sum(rows_per_section) + 0.8), layout="constrained")
    FigureCanvasAgg(figure)
    if title:
        figure.suptitle(title, fontsize=13, fontweight="bold")
    context = _Context(
        series, x_range=_x_range(series, layout), events=_event_steps(series), tokens=splits_by_tokens(series)
    )
    subfigures = figure.subfigures(len(sections), 1, height_ratios=rows_per_section, squeeze=False)[:, 0]
    for (section, panels), subfigure, n_rows in zip(sections, subfigures, rows_per_section, strict=True):
        subfigure.suptitle(_section_title(section, series), fontsize=12, fontweight="bold", x=0.01, ha="left")
        axes = subfigure.subplots(n_rows, _COLUMNS, squeeze=False).ravel()
        for ax, panel in zip(axes, panels, strict=False):  # the last row may have spare axes
            _draw_panel(ax, panel, context)
        for ax in axes[len(panels) :]:
            ax.set_visible(False)
    # In the first section's title row, not the figure's: a long figure title would run under it.
    _event_legend(subfigures[0], context.events, tokens=context.tokens)
    return figure


def _sections_to_draw(series: Series, layout: Sequence[SectionSpec]) -> list[tuple[SectionSpec, list[PanelSpec]]]:
    # Each section with the panels it draws (scalar panels go into its title), less those of optional keys never
    # logged; a section left without panels is left out.
    def logged(panel: PanelSpec) -> bool:
        optional = [key for key in panel.keys if key in _OPTIONAL_KEYS]
        return not optional or any(series.get(key) for key in optional)

    sections = [(s, [p for p in s.panels if p.style != "scalar" and logged(p)]) for s in layout]
    return [(section, panels) for section, panels in sections if panels]


def event_label(key: str, *, tokens: bool) -> str:
    """What an event key's marks stand for in the report: by ``tokens``, the token budget's changes."""
    return (_EVENT_LABEL_BY_TOKENS if tokens else {k: label for k, (_, label) in _EVENT_STYLE.items()})[key]


def _event_legend(subfigure: Any, events: Mapping[str, list[float]], *, tokens: bool = False) -> None:
    # What the dotted lines on the batch and memory panels mean, once for the whole figure.
    from matplotlib.lines import Line2D

    if not events:
        return
    handles = [Line2D([], [], color=_EVENT_STYLE[key][0], linestyle=":", linewidth=1.5) for key in events]
    labels = [event_label(key, tokens=tokens) for key in events]
    subfigure.legend(handles, labels, loc="outside upper right", ncols=len(handles), fontsize=8, frameon=False)


@dataclass(frozen=True)
class _Context:
    # What every panel needs besides its own keys.
    series: Series
    x_range: tuple[float, float]
    events: dict[str, list[float]]  # event key -> the steps it was logged at
    tokens: bool = False  # the run split by tokens: the events move the token budget


def _section_title(section: SectionSpec, series: Series) -> str:
    # A scalar panel (a quantity that does not move) is a number in the title, not a flat line.
    parts = [section.name]
    for panel in section.panels:
        points = series.get(panel.keys[0]) if panel.style == "scalar" else None
        if points:
            parts.append(f"{panel.title.lower()} {points[-1][1]:.3g} {panel.y_label}")
    return "   ·   ".join(parts)


def _x_range(series: Series, layout: Sequence[SectionSpec]) -> tuple[float, float]:
    # One range for every panel, the Events panel included, so a step lines up down the page.
    steps = [s for key in (*layout_keys(layout), *user_loss_keys(series)) for s, _ in series.get(key, [])]
    low, high = (min(steps), max(steps)) if steps else (0.0, 1.0)
    pad = max(0.5, 0.02 * (high - low))
    return low - pad, high + pad


def _event_steps(series: Series) -> dict[str, list[float]]:
    return {key: [s for s, _ in series[key]] for key in keys.EVENT_KEYS if series.get(key)}


def user_loss_keys(series: Series) -> list[str]:
    """The user's own loss keys in ``series`` (``train/loss``, ``train_loss_step``, ...): not ours, not per epoch."""
    ours = ("accum/", "memory/", "perf/", "events/", "_")
    return sorted(
        key
        for key in series
        if not key.startswith(ours) and key.lower().removesuffix("_step").endswith("loss") and series[key]
    )


def _draw_panel(ax: Any, panel: PanelSpec, context: _Context) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.set_title(panel.title, fontsize=10)
    ax.set_xlabel("optimizer step", fontsize=8)
    ax.set_ylabel(panel.y_label_by_tokens if context.tokens and panel.y_label_by_tokens else panel.y_label, fontsize=8)
    ax.tick_params(labelsize=8)
    ax.grid(True, alpha=0.3)
    extra = user_loss_keys(context.series) if keys.WINDOW_LOSS in panel.keys else []
    values = [v for key in (*panel.keys, *extra) for v in _draw_key(ax, panel, key, context)]
    if keys.PEAK_GIB in panel.keys and values:  # the budget beside the peak, in the peak's unit
        values += _budget_gib(ax, context.series, max(values))
    if not values:
        ax.text(0.5, 0.5, "nothing logged", ha="center", va="center", transform=ax.transAxes, color="gray")
    if panel.mark_events:
        _mark_events(ax, context.events)
    # A legend only where it tells lines (or kinds of event) apart: one line is named by the panel's title.
    if len(ax.get_legend_handles_labels()[0]) > 1 or (panel.style == "points" and values):
        ax.legend(fontsize=7, loc="best")
    _set_y_range(ax, panel, values)
    ax.set_xlim(*context.x_range)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if panel.integer:
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    large = any(abs(v) >= _PLAIN_BELOW for v in values)
    ax.ticklabel_format(axis="y", useOffset=False, style="sci" if large else "plain")


def _draw_key(ax: Any, panel: PanelSpec, key: str, context: _Context) -> list[float]:
    # Draw one key's points; return the values drawn.
    points = context.series.get(key, [])
    if key == BUDGET_FRACTION:
        points = _budget_points(ax, context.series)
    if not points:
        return []
    steps, values = zip(*points, strict=True)
    if panel.style == "points":
        color = _EVENT_STYLE.get(key, (None, ""))[0]
        label = f"{key}: {event_label(key, tokens=context.tokens)}" if key in _EVENT_STYLE else key
        ax.scatter(steps, values, s=28, label=label, zorder=3, color=color)
    elif key in _REFERENCE_KEYS:
        ax.plot(steps, values, linestyle="--", linewidth=1.5, color="tab:red", label=key)
    elif key not in panel.keys:  # the user's own loss, overlaid where it was logged
        ax.plot(steps, values, linestyle="--", linewidth=1.1, color="tab:orange", label=f"{key} (yours)", zorder=3)
    else:
        ax.plot(steps, values, marker="." if len(points) < 60 else None, linewidth=1.3, label=key, zorder=2)
    return [v for v in values if math.isfinite(v)]


def _budget_points(ax: Any, series: Series) -> list[tuple[float, float]]:
    # The budget line where it reads: a budget of 1.0 is "none" (window mode), and one far above the peak would
    # flatten the peak's line to zero. Either is then a legend entry instead of a line.
    points = [(s, v) for s, v in series.get(BUDGET_FRACTION, []) if v < 1]
    peaks = finite_values(series, keys.PEAK_FRACTION)
    if not series.get(BUDGET_FRACTION):
        return []
    if not points:
        ax.plot([], [], " ", label="no memory budget (window mode)")
        return []
    if peaks and min(v for _, v in points) > _OFF_SCALE * max(peaks):
        ax.plot([], [], " ", label=f"budget {points[-1][1]:.1%} (far above the peak: off the scale)")
        return []
    return points


def _budget_gib(ax: Any, series: Series, peak: float) -> list[float]:
    # The budget as a size (the fraction logged times the capacity), labelled as `max_memory` takes it: 500 MiB.
    capacity = dict(series.get(keys.CAPACITY_GIB, []))
    if not capacity:
        return []
    last_capacity = list(capacity.values())[-1]
    points = [(s, f * capacity.get(s, last_capacity)) for s, f in series.get(BUDGET_FRACTION, []) if f < 1]
    if not points:
        return []
    label = f"budget {size_text(points[-1][1])}"
    if min(v for _, v in points) > _OFF_SCALE * peak:
        ax.plot([], [], " ", label=f"{label} (far above the peak: off the scale)")
        return []
    steps, values = zip(*points, strict=True)
    ax.plot(steps, values, linestyle="--", linewidth=1.5, color="tab:red", label=label)
    return list(values)


def _mark_events(ax: Any, events: Mapping[str, list[float]]) -> None:
    for key, steps in events.items():
        color, _ = _EVENT_STYLE[key]
        for step in steps:
            ax.axvline(step, color=color, linewidth=1.2, linestyle=":", alpha=0.9, zorder=0)


def _set_y_range(ax: Any, panel: PanelSpec, values: list[float]) -> None:
    low, high = panel.y_range
    if not values or (low is None and high is None):
        return
    if high is None:
        # Headroom above the largest value drawn, so a flat series does not sit on the frame; 1 when all are 0.
        largest = max(values)
        high = largest * 1.1 if largest > (low or 0) else (low or 0) + 1
    if low is not None and high is not None:
        low -= 0.02 * (high - low)  # a line at the floor (no OOMs: 0 throughout) would hide under the frame
    ax.set_ylim(low, high)
