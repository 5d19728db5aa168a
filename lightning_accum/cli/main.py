"""``lightning-accum``: entry point. Each subcommand lives in its own module and registers itself here.

A mistake in how a command is called (a bad argument, a path that cannot be read or written, a missing login) is
one ``error:`` line on stderr and a non-zero exit status: 2 for what ``argparse`` finds, 1 for the rest.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from collections.abc import Sequence
from typing import NoReturn

from lightning_accum.cli._common import CommandError

# name -> module that defines `HELP`, `DESCRIPTION`, `add_arguments(parser)` and `run(args) -> int`
_SUBCOMMANDS: dict[str, str] = {
    "probe": "lightning_accum.cli.probe",
    "report": "lightning_accum.cli.report",
    "dashboard": "lightning_accum.cli.dashboard",
}


class _ArgumentParser(argparse.ArgumentParser):
    """An ``argparse`` parser whose usage errors are one ``error:`` line, like every other error of the command.

    ``add_subparsers`` builds the subcommands' parsers with the same class, so theirs are too.
    """

    def error(self, message: str) -> NoReturn:
        raise CommandError(f"{message}. See `{self.prog} --help`.", exit_code=2)


def build_parser() -> argparse.ArgumentParser:
    parser = _ArgumentParser(
        prog="lightning-accum",
        description="Exact, memory-aware gradient accumulation for PyTorch Lightning.",
    )
    from lightning_accum import __version__

    parser.add_argument("--version", action="version", version=f"lightning-accum {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module_name in _SUBCOMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name != module_name:  # a missing dependency of an existing subcommand: say so
                raise
            continue  # not built yet
        module.add_arguments(subparsers.add_parser(name, help=module.HELP, description=module.DESCRIPTION))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``lightning-accum``; return the exit status. A `CommandError` is printed as one ``error:`` line."""
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help()
            return 0
        module = importlib.import_module(_SUBCOMMANDS[args.command])
        return int(module.run(args) or 0)
    except CommandError as err:
        # Messages quoted from other libraries may span lines; the contract is one line.
        print("error: " + re.sub(r"\s*\n\s*", " ", str(err)).strip(), file=sys.stderr)
        return err.exit_code


if __name__ == "__main__":
    sys.exit(main())
