"""``lightning-accum``: entry point. Each subcommand lives in its own module and registers itself here."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# name -> module that defines `add_parser(subparsers)` and `run(args) -> int`
_SUBCOMMANDS: dict[str, str] = {
    "probe": "lightning_accum.cli.probe",
    "report": "lightning_accum.cli.report",
    "dashboard": "lightning_accum.cli.dashboard",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-accum",
        description="Exact, memory-aware gradient accumulation for PyTorch Lightning.",
    )
    from lightning_accum import __version__

    parser.add_argument("--version", action="version", version=f"lightning-accum {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in _SUBCOMMANDS.values():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name != module_name:  # a missing dependency of an existing subcommand: say so
                raise
            continue  # not built yet
        module.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    module = importlib.import_module(_SUBCOMMANDS[args.command])
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
