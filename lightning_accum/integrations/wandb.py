"""W&B integration: metric definitions, run config and the ready-made workspace.

``wandb`` and ``wandb_workspaces`` are imported inside the functions that need them (the ``wandb`` extra), so that
`PANEL_LAYOUT` stays importable without them.

`spec_to_json` (the dashboard as JSON) never touches the network; only `save_dashboard` uploads. The reader of
offline runs lives in `lightning_accum.integrations.wandb_offline`; its names are re-exported here, where they
used to live.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from lightning_accum import keys
from lightning_accum.integrations.wandb_offline import (  # re-exported: tests, `report` and users import them here
    STEP_METRIC,
    OfflineRun,
    find_run_file,
    iter_records,
    read_offline_run,
)
from lightning_accum.monitor.rows import BUDGET_FRACTION

if TYPE_CHECKING:
    from wandb_workspaces.workspaces import Workspace

__all__ = [
    "CONFIG_KEY",
    "MAX_SUMMARY_KEYS",
    "MEAN_SUMMARY_KEYS",
    "NO_SUMMARY_KEYS",
    "PANEL_LAYOUT",
    "STEP_METRIC",
    "USER_PREFIXES",
    "OfflineRun",
    "PanelSpec",
    "SectionSpec",
    "dashboard_spec",
    "define_metrics",
    "find_run_file",
    "iter_records",
    "layout_keys",
    "read_offline_run",
    "record_config",
    "save_dashboard",
    "spec_metric_keys",
    "spec_metric_patterns",
    "spec_to_dict",
    "spec_to_json",
]

CONFIG_KEY = "lightning_accum"
"""The run-config entry that holds the accumulation settings."""

MAX_SUMMARY_KEYS = (keys.PEAK_GIB, keys.PEAK_FRACTION, keys.PEAK_RESERVED_GIB)
"""Keys whose run summary is their maximum (a memory peak matters at its worst, not at the last step)."""

MEAN_SUMMARY_KEYS = (keys.PADDING_FRACTION, keys.RANK_IMBALANCE, keys.SYNC_WAIT_SECONDS, *keys.PRICE_KEYS)
"""Keys whose run summary is their mean over the logged steps: the padding's and the ranks' waits' cost is spread
over the run."""

NO_SUMMARY_KEYS = keys.EVENT_KEYS
"""Keys without a run summary: an event's value is the size after it, so its last value would read as a count
(``events/oom_recovered: 16`` after one OOM). The count is `keys.OOM_RETRIES`, whose last value is the total."""

USER_PREFIXES = ("train/", "val/")
"""The prefixes of the user's own metrics that ``lightning-accum dashboard`` gives panels by default."""


# ------------------------------------------------------------------------------------------------------------------
# the panels: one layout for the W&B workspace and the `lightning-accum report` PNG
# ------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PanelSpec:
    """One panel: a title, the keys it draws against `STEP_METRIC`, and how to draw them.

    ``style="scalar"`` is a single number (the last value of its one key), for a quantity that does not move; the
    report puts it in its section's title. ``integer`` asks for whole-number ticks (sizes, counts), and
    ``mark_events`` for the `keys.EVENT_KEYS` steps drawn as vertical lines (in the report). ``y_label_by_tokens``
    is the y label of a run split by tokens where its values count something else (the events' sizes are token
    budgets there); the report uses it for such a run, the dashboard names both.
    """

    title: str
    keys: tuple[str, ...]
    y_label: str
    y_range: tuple[float | None, float | None] = (None, None)
    style: Literal["line", "points", "scalar"] = "line"
    integer: bool = False
    mark_events: bool = False
    y_label_by_tokens: str | None = None

    @property
    def y_label_any_run(self) -> str:
        """The y label for runs split by samples and by tokens alike (the dashboard's, which draws both)."""
        if self.y_label_by_tokens is None:
            return self.y_label
        return f"{self.y_label}; split by tokens, {self.y_label_by_tokens}"


@dataclass(frozen=True)
class SectionSpec:
    """A named group of panels (a W&B workspace section, a row of the report)."""

    name: str
    panels: tuple[PanelSpec, ...]


# Counts, sizes and rates are drawn from zero, so that a flat line reads as flat rather than as noise.
_FROM_ZERO: tuple[float | None, float | None] = (0, None)


def _marked(title: str, drawn: tuple[str, ...], y_label: str, *, integer: bool = False) -> PanelSpec:
    """A panel from zero with the `keys.EVENT_KEYS` steps marked: what a change of the batch or an OOM moves."""
    return PanelSpec(title, drawn, y_label, _FROM_ZERO, integer=integer, mark_events=True)


PANEL_LAYOUT: tuple[SectionSpec, ...] = (
    SectionSpec(
        "Batch",
        (
            _marked("Effective batch size", (keys.EFFECTIVE_BATCH_SIZE,), "samples / step (all ranks)", integer=True),
            _marked("Micro-batch size", (keys.MICRO_BATCH_SIZE,), "samples / micro-batch", integer=True),
            _marked("Accumulation steps", (keys.ACCUMULATION_STEPS,), "micro-batches / step", integer=True),
            PanelSpec("Items per step", (keys.ITEMS_PER_STEP,), "items / step (all ranks)", _FROM_ZERO, integer=True),
            # The report overlays the user's own training loss here, where it was logged.
            PanelSpec("Window loss", (keys.WINDOW_LOSS,), "item-weighted mean loss"),
        ),
    ),
    SectionSpec(
        # Only with AutoMicroBatching(sequences=...): micro-batches sized by padded tokens; the number of micro-batches
        # is the Batch section's accumulation steps.
        "Tokens",
        (
            _marked("Token budget", (keys.MICRO_BATCH_TOKENS,), "padded tokens / micro-batch", integer=True),
            PanelSpec("Padding", (keys.PADDING_FRACTION,), "fraction of positions computed (all ranks)", _FROM_ZERO),
        ),
    ),
    SectionSpec(
        # Only split mode on more than one rank: how unequal the ranks' steps were (1.0: equal), and what it cost.
        "Ranks",
        (
            PanelSpec("Rank imbalance", (keys.RANK_IMBALANCE,), "slowest rank's step cost / mean", (1.0, None)),
            PanelSpec("Sync wait", (keys.SYNC_WAIT_SECONDS,), "s (longest over ranks)", _FROM_ZERO),
            # Dealt by a BalancedBatchSampler: the measured compute's imbalance over the priced (1.0: the price fits).
            PanelSpec("Price error", keys.PRICE_KEYS, "measured compute's imbalance / priced", (1.0, None)),
        ),
    ),
    SectionSpec(
        # Only with AccumulationMonitor(gradient_noise_scale=True): the batch the gradient says is worth it.
        "Noise scale",
        (
            _marked("Noise scale vs items per step", (keys.GRADIENT_NOISE_SCALE, keys.ITEMS_PER_STEP), "items"),
            PanelSpec("|G|² and tr(Σ)", (keys.GRAD_SQ_NORM, keys.GRAD_TRACE_COV), "squared gradient norm"),
            PanelSpec("Non-finite windows skipped", (keys.NOISE_SCALE_SKIPPED,), "windows", _FROM_ZERO),
        ),
    ),
    SectionSpec(
        # Where a schedule plans the windows: the k it aims at (the adaptive schedule's before clamping) against the
        # k it runs; with `AdaptiveBatchSize(objective="goodput")`, what it weighs.
        "Schedule",
        (
            _marked(
                "Accumulation steps vs target",
                (keys.ACCUMULATION_STEPS, keys.TARGET_ACCUMULATION_STEPS),
                "micro-batches / step",
            ),
            PanelSpec("Statistical efficiency", (keys.STATISTICAL_EFFICIENCY,), "1 / (1 + B / B_noise)", (0, 1)),
            PanelSpec("Step overhead", (keys.STEP_OVERHEAD_SECONDS,), "s (sync, optimizer, zero_grad)", _FROM_ZERO),
        ),
    ),
    SectionSpec(
        "Memory",
        (
            _marked("Peak memory", (keys.PEAK_GIB, keys.PEAK_RESERVED_GIB), "GiB (max over ranks)"),
            # From zero, not to 1: a budget of a few percent of capacity (CPU) must still be visible.
            _marked("Peak fraction vs budget", (keys.PEAK_FRACTION, BUDGET_FRACTION), "fraction of capacity"),
            # A number, not a line: the capacity does not move, and a line of it would say nothing.
            PanelSpec("Capacity", (keys.CAPACITY_GIB,), "GiB", style="scalar"),
        ),
    ),
    SectionSpec(
        "Recovery",
        (
            PanelSpec("OOM retries", (keys.OOM_RETRIES,), "OOMs recovered (cumulative)", _FROM_ZERO, integer=True),
            PanelSpec(
                "Allocator retries", (keys.ALLOC_RETRIES,), "cudaMalloc retries (cumulative)", _FROM_ZERO, integer=True
            ),
            PanelSpec(
                "Events",
                keys.EVENT_KEYS,
                "samples / micro-batch after the change",
                _FROM_ZERO,
                style="points",
                integer=True,
                y_label_by_tokens="token budget after the change (tokens)",
            ),
        ),
    ),
    SectionSpec(
        "Throughput",
        (
            PanelSpec("Samples / s", (keys.SAMPLES_PER_SEC,), "samples / s (all ranks)", _FROM_ZERO),
            PanelSpec("Items / s", (keys.ITEMS_PER_SEC,), "items / s (all ranks)", _FROM_ZERO),
            PanelSpec("Training time", (keys.TRAIN_SECONDS,), "s (validation excluded)", _FROM_ZERO),
            PanelSpec("Samples seen", (keys.SAMPLES_SEEN,), "samples (all ranks, cumulative)", _FROM_ZERO),
            PanelSpec("Items seen", (keys.ITEMS_SEEN,), "items (all ranks, cumulative)", _FROM_ZERO),
        ),
    ),
)
"""The dashboard: sections Batch, Tokens, Noise scale, Memory, Recovery and Throughput, against `STEP_METRIC`."""


def layout_keys(layout: Sequence[SectionSpec] = PANEL_LAYOUT) -> tuple[str, ...]:
    """Every metric key the layout draws, in layout order."""
    return tuple(key for section in layout for panel in section.panels for key in panel.keys)


# ------------------------------------------------------------------------------------------------------------------
# a live run: metric definitions and config
# ------------------------------------------------------------------------------------------------------------------
def define_metrics(run: Any, prefix: str = "", *, tokens: bool = False, ranks: bool = False) -> None:
    """Define every contract key on ``run`` against `STEP_METRIC`: max summaries for memory peaks, none for events.

    Safe to call more than once, and next to ``WandbLogger``'s own ``define_metric("*", ...)``: explicit names
    take precedence over the glob. ``prefix`` is the monitor's ``key_prefix``, put in front of every key.
    An event key's summary is set at the end of ``fit`` to the number of events (`record_event_counts`). The token
    keys (`keys.TOKEN_KEYS`, the padding summarized by its mean) are defined only for a run split by ``tokens``, so
    that a run split by samples holds what it always held; the ranks' balance (`keys.RANK_KEYS`, by their means) only
    for a run split on several ``ranks``.
    """
    run.define_metric(STEP_METRIC)
    token_keys = keys.TOKEN_KEYS if tokens else ()
    rank_keys = (*keys.RANK_KEYS, *keys.PRICE_KEYS) if ranks else ()
    contract = (*keys.ALL_KEYS, BUDGET_FRACTION, *keys.EVENT_KEYS, *keys.NOISE_SCALE_KEYS, *keys.SCHEDULE_KEYS)
    for key in (*contract, *keys.GOODPUT_KEYS, *token_keys, *rank_keys):
        kwargs: dict[str, Any] = {"step_metric": STEP_METRIC, "step_sync": True}
        if key in MAX_SUMMARY_KEYS:
            kwargs["summary"] = "max"
        elif key in MEAN_SUMMARY_KEYS:
            kwargs["summary"] = "mean"
        elif key in NO_SUMMARY_KEYS:
            kwargs["summary"] = "none"
        run.define_metric(prefix + key, **kwargs)


def record_event_counts(run: Any, counts: Mapping[str, int], prefix: str = "") -> None:
    """Set each event key's run summary to how many such events the run had (0 included).

    The history holds each event's size after the change; W&B would otherwise summarize an event key by its last
    value, which reads like a count (``events/oom_recovered: 2`` after one OOM that left size 2).
    """
    run.summary.update({prefix + key: int(counts.get(key, 0)) for key in keys.EVENT_KEYS})


def record_config(run: Any, settings: Mapping[str, Any]) -> None:
    """Put the accumulation ``settings`` into ``run``'s config under `CONFIG_KEY`.

    ``allow_val_change`` because a second ``fit`` (or a resumed run) may record different settings.
    """
    run.config.update({CONFIG_KEY: _json_safe(dict(settings))}, allow_val_change=True)


def _json_safe(value: Any) -> Any:
    # W&B's config must be JSON: keep what JSON can hold and describe everything else.
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return repr(value)


# ------------------------------------------------------------------------------------------------------------------
# the workspace
# ------------------------------------------------------------------------------------------------------------------
def dashboard_spec(
    entity: str,
    project: str,
    *,
    name: str = "lightning_accum",
    layout: Sequence[SectionSpec] = PANEL_LAYOUT,
    user_prefixes: Sequence[str] = (),
    user_keys: Sequence[str] = (),
) -> Workspace:
    """The ready-made W&B workspace for ``entity/project``: one section per `SectionSpec` of ``layout``.

    With ``user_prefixes`` (e.g. `USER_PREFIXES`) or ``user_keys``, a last section, "Your metrics", draws the
    user's own metrics: one panel per prefix, matching every key under it by regex (the keys are not known in
    advance), and one per named key. Building it touches no network; `save_dashboard` uploads it.
    """
    import wandb_workspaces.workspaces as ws

    if not entity or not project:
        raise ValueError(f"`entity` and `project` must be non-empty, got entity={entity!r}, project={project!r}.")
    settings = ws.SectionPanelSettings(x_axis=STEP_METRIC)
    sections = [
        ws.Section(name=section.name, is_open=True, panel_settings=settings, panels=_panels(section))
        for section in layout
    ]
    if user_prefixes or user_keys:
        panels = [*map(_prefix_panel, user_prefixes), *map(_key_panel, user_keys)]
        sections.append(ws.Section(name=USER_SECTION, is_open=True, panel_settings=settings, panels=panels))
    return ws.Workspace(
        entity=entity,
        project=project,
        name=name,
        settings=ws.WorkspaceSettings(x_axis=STEP_METRIC),
        sections=sections,
    )


USER_SECTION = "Your metrics"
"""The name of the dashboard section that holds the user's own metrics."""


def _panels(section: SectionSpec) -> list[Any]:
    import wandb_workspaces.reports.v2 as wr

    return [
        wr.ScalarChart(title=f"{panel.title} ({panel.y_label})", metric=panel.keys[0])
        if panel.style == "scalar"
        else wr.LinePlot(
            title=panel.title,
            x=STEP_METRIC,
            y=list(panel.keys),
            title_x="optimizer step",
            title_y=panel.y_label_any_run,
            range_y=panel.y_range,
        )
        for panel in section.panels
    ]


def _prefix_panel(prefix: str) -> Any:
    import wandb_workspaces.reports.v2 as wr

    if not prefix:
        raise ValueError("`user_prefixes` must hold non-empty prefixes, got ''. Pass e.g. 'train/'.")
    return wr.LinePlot(
        title=f"{prefix}*", x=STEP_METRIC, metric_regex=f"^{re.escape(prefix)}.*", title_x="optimizer step"
    )


def _key_panel(key: str) -> Any:
    import wandb_workspaces.reports.v2 as wr

    if not key:
        raise ValueError("`user_keys` must hold non-empty keys, got ''. Pass e.g. 'train_loss_step'.")
    return wr.LinePlot(title=key, x=STEP_METRIC, y=[key], title_x="optimizer step", title_y=key)


def spec_to_dict(workspace: Workspace) -> dict[str, Any]:
    """The workspace as W&B's view JSON, built offline.

    ``Workspace.save`` sends exactly this model (``_to_model()``), so the dump is what would be uploaded. The
    method is private in wandb-workspaces 0.4; ``tests/integrations/test_wandb.py`` fails if it changes.
    """
    spec: dict[str, Any] = workspace._to_model().model_dump(by_alias=True, exclude_none=True, mode="json")
    return spec


def spec_to_json(workspace: Workspace, *, indent: int | None = 2) -> str:
    """`spec_to_dict` as a JSON string, without any network access."""
    return json.dumps(spec_to_dict(workspace), indent=indent)


def spec_metric_keys(spec: Mapping[str, Any]) -> set[str]:
    """The metric keys the panels of a spec (from `spec_to_dict`) draw on their y-axes."""
    found: set[str] = set()
    sections = spec["spec"]["section"]["panelBankConfig"]["sections"]
    for section in sections:
        for panel in section.get("panels", []):
            found.update(panel.get("config", {}).get("metrics", []))
    return found


def spec_metric_patterns(spec: Mapping[str, Any]) -> set[str]:
    """The metric regexes of the panels of a spec (from `spec_to_dict`): panels for keys not known in advance."""
    sections = spec["spec"]["section"]["panelBankConfig"]["sections"]
    return {
        panel["config"]["metricRegex"]
        for section in sections
        for panel in section.get("panels", [])
        if panel.get("config", {}).get("useMetricRegex")
    }


def save_dashboard(
    entity: str,
    project: str,
    *,
    name: str = "lightning_accum",
    user_prefixes: Sequence[str] = (),
    user_keys: Sequence[str] = (),
) -> str:
    """Build the workspace (see `dashboard_spec`) and upload it to W&B (needs network and a login); return its URL."""
    workspace = dashboard_spec(entity, project, name=name, user_prefixes=user_prefixes, user_keys=user_keys).save()
    return str(workspace.url)
