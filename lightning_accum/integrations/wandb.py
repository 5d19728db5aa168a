"""W&B integration: metric definitions, run config and the ready-made workspace.

``wandb`` and ``wandb_workspaces`` are imported inside the functions that need them (the ``wandb`` extra), so that
`PANEL_LAYOUT` stays importable without them.

`spec_to_json` (the dashboard as JSON) never touches the network; only `save_dashboard` uploads. The reader of
offline runs lives in `lightning_accum.integrations.wandb_offline`; its names are re-exported here, where they
used to live.
"""

from __future__ import annotations

import json
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
from lightning_accum.monitoring import BUDGET_FRACTION

if TYPE_CHECKING:
    from wandb_workspaces.workspaces import Workspace

__all__ = [
    "CONFIG_KEY",
    "MAX_SUMMARY_KEYS",
    "PANEL_LAYOUT",
    "STEP_METRIC",
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
    "spec_to_dict",
    "spec_to_json",
]

CONFIG_KEY = "lightning_accum"
"""The run-config entry that holds the accumulation settings."""

MAX_SUMMARY_KEYS = (keys.PEAK_GIB, keys.PEAK_FRACTION, keys.PEAK_RESERVED_GIB)
"""Keys whose run summary is their maximum (a memory peak matters at its worst, not at the last step)."""


# ------------------------------------------------------------------------------------------------------------------
# the panels: one layout for the W&B workspace and the `lightning-accum report` PNG
# ------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PanelSpec:
    """One line plot: a title, the keys it draws against `STEP_METRIC`, and how to draw them."""

    title: str
    keys: tuple[str, ...]
    y_label: str
    y_range: tuple[float | None, float | None] = (None, None)
    style: Literal["line", "points"] = "line"


@dataclass(frozen=True)
class SectionSpec:
    """A named group of panels (a W&B workspace section, a row of the report)."""

    name: str
    panels: tuple[PanelSpec, ...]


# Counts, sizes and rates are drawn from zero, so that a flat line reads as flat rather than as noise.
_FROM_ZERO: tuple[float | None, float | None] = (0, None)

PANEL_LAYOUT: tuple[SectionSpec, ...] = (
    SectionSpec(
        "Batch",
        (
            PanelSpec("Effective batch size", (keys.EFFECTIVE_BATCH_SIZE,), "samples / step (all ranks)", _FROM_ZERO),
            PanelSpec("Micro-batch size", (keys.MICRO_BATCH_SIZE,), "samples / micro-batch", _FROM_ZERO),
            PanelSpec("Accumulation steps", (keys.ACCUMULATION_STEPS,), "micro-batches / step", _FROM_ZERO),
            PanelSpec("Items per step", (keys.ITEMS_PER_STEP,), "items / step (all ranks)", _FROM_ZERO),
            PanelSpec("Window loss", (keys.WINDOW_LOSS,), "item-weighted mean loss"),
        ),
    ),
    SectionSpec(
        "Memory",
        (
            PanelSpec("Peak memory", (keys.PEAK_GIB, keys.PEAK_RESERVED_GIB), "GiB (max over ranks)", _FROM_ZERO),
            PanelSpec(
                # From zero, not to 1: a budget of a few percent of capacity (CPU) must still be visible.
                "Peak fraction vs budget",
                (keys.PEAK_FRACTION, BUDGET_FRACTION),
                "fraction of capacity",
                _FROM_ZERO,
            ),
            # Apart from the peak: on a large host the capacity would flatten the peak's line to zero.
            PanelSpec("Capacity", (keys.CAPACITY_GIB,), "GiB", _FROM_ZERO),
        ),
    ),
    SectionSpec(
        "Recovery",
        (
            PanelSpec("OOM retries", (keys.OOM_RETRIES,), "OOMs recovered (cumulative)", _FROM_ZERO),
            PanelSpec("Events", keys.EVENT_KEYS, "size after the change", style="points"),
        ),
    ),
    SectionSpec(
        "Throughput",
        (
            PanelSpec("Samples / s", (keys.SAMPLES_PER_SEC,), "samples / s (all ranks)", _FROM_ZERO),
            PanelSpec("Items / s", (keys.ITEMS_PER_SEC,), "items / s (all ranks)", _FROM_ZERO),
        ),
    ),
)
"""The dashboard: sections Batch, Memory, Recovery and Throughput, drawn against `STEP_METRIC`."""


def layout_keys(layout: Sequence[SectionSpec] = PANEL_LAYOUT) -> tuple[str, ...]:
    """Every metric key the layout draws, in layout order."""
    return tuple(key for section in layout for panel in section.panels for key in panel.keys)


# ------------------------------------------------------------------------------------------------------------------
# a live run: metric definitions and config
# ------------------------------------------------------------------------------------------------------------------
def define_metrics(run: Any) -> None:
    """Define every contract key on ``run`` against `STEP_METRIC`, with max summaries for memory peaks.

    Safe to call more than once, and next to ``WandbLogger``'s own ``define_metric("*", ...)``: explicit names
    take precedence over the glob.
    """
    run.define_metric(STEP_METRIC)
    for key in (*keys.ALL_KEYS, BUDGET_FRACTION, *keys.EVENT_KEYS):
        kwargs: dict[str, Any] = {"step_metric": STEP_METRIC, "step_sync": True}
        if key in MAX_SUMMARY_KEYS:
            kwargs["summary"] = "max"
        run.define_metric(key, **kwargs)


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
) -> Workspace:
    """The ready-made W&B workspace for ``entity/project``: one section per `SectionSpec` of ``layout``.

    Building it touches no network; `save_dashboard` uploads it.
    """
    import wandb_workspaces.reports.v2 as wr
    import wandb_workspaces.workspaces as ws

    if not entity or not project:
        raise ValueError(f"`entity` and `project` must be non-empty, got entity={entity!r}, project={project!r}.")
    sections = [
        ws.Section(
            name=section.name,
            is_open=True,
            panel_settings=ws.SectionPanelSettings(x_axis=STEP_METRIC),
            panels=[
                wr.LinePlot(
                    title=panel.title,
                    x=STEP_METRIC,
                    y=list(panel.keys),
                    title_x="optimizer step",
                    title_y=panel.y_label,
                    range_y=panel.y_range,
                )
                for panel in section.panels
            ],
        )
        for section in layout
    ]
    return ws.Workspace(
        entity=entity,
        project=project,
        name=name,
        settings=ws.WorkspaceSettings(x_axis=STEP_METRIC),
        sections=sections,
    )


def spec_to_dict(workspace: Workspace) -> dict[str, Any]:
    """The workspace as W&B's view JSON, built offline.

    ``Workspace.save`` sends exactly this model (``_to_model()``), so the dump is what would be uploaded. The
    method is private in wandb-workspaces 0.4; ``tests/integrations/test_wandb.py`` fails if it changes.
    """
    return workspace._to_model().model_dump(by_alias=True, exclude_none=True, mode="json")


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


def save_dashboard(entity: str, project: str, *, name: str = "lightning_accum") -> str:
    """Build the workspace and upload it to W&B (needs network and a login). Returns the workspace URL."""
    workspace = dashboard_spec(entity, project, name=name).save()
    return str(workspace.url)
