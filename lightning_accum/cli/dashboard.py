"""``lightning-accum dashboard``: the ready-made W&B workspace, written to a JSON file or uploaded to a project."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``dashboard`` subcommand to an ``argparse`` subparsers object."""
    parser = subparsers.add_parser(
        "dashboard",
        help="create the lightning_accum W&B workspace (or write its spec with --output)",
        description=(
            "Build the W&B workspace with the Batch, Memory, Recovery and Throughput sections for the metrics"
            " AccumulationMonitor logs. With --output, write its JSON spec and touch no network; without it,"
            " save it to ENTITY/PROJECT on W&B (needs a login)."
        ),
    )
    parser.add_argument("--entity", required=True, help="the W&B entity (user or team) that owns the project")
    parser.add_argument("--project", required=True, help="the W&B project")
    parser.add_argument("--name", default="lightning_accum", help="the workspace name (default: %(default)s)")
    parser.add_argument("--output", "-o", help="write the spec as JSON here instead of uploading it")
    return parser


def run(args: argparse.Namespace) -> int:
    """Write the spec (``--output``) or upload the workspace; return the exit status."""
    try:
        from lightning_accum.integrations.wandb import dashboard_spec, save_dashboard, spec_to_json

        if args.output:
            text = spec_to_json(dashboard_spec(args.entity, args.project, name=args.name))
        else:
            url = save_dashboard(args.entity, args.project, name=args.name)
    except ModuleNotFoundError as err:
        raise SystemExit(
            f"error: `lightning-accum dashboard` needs {err.name!r}: pip install 'lightning-accum[wandb]'."
        ) from err
    except ValueError as err:
        raise SystemExit(f"error: {err}") from err
    if args.output:
        output = Path(args.output)
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(text + "\n")
        print(f"wrote {output}")
    else:
        print(f"saved the workspace: {url}")
    return 0
