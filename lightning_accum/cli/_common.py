"""What the subcommands share: the one-line user error, number types for ``argparse``, and output-path checks."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from pathlib import Path

from lightning_accum.memory.budget import parse_size


class CommandError(Exception):
    """A mistake in how a command was called: `lightning_accum.cli.main.main` prints it as one ``error:`` line.

    Args:
        message: what is wrong, naming the argument and the value it got, and how to fix it.
        exit_code: the process exit status: 1, or 2 for a usage error that ``argparse`` found.
    """

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An ``argparse`` type: an int ``>= minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"expected an int >= {minimum}, got {text!r}")
        return value

    return parse


def positive_float(text: str) -> float:
    """An ``argparse`` type: a finite number ``> 0``."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def memory_size(text: str) -> int:
    """An ``argparse`` type: a size with its unit, such as ``8GiB`` or ``500MB``, in bytes (``> 0``)."""
    try:
        value = parse_size(text)
    except ValueError:
        hint = " (add a unit: GiB, MiB, GB, ...)" if _is_number(text) else ""
        raise argparse.ArgumentTypeError(f"expected a size such as 8GiB or 500MB, got {text!r}{hint}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a size > 0, such as 8GiB or 500MB, got {text!r}")
    return value


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def check_output_dir(value: str, flag: str) -> Path:
    """``value`` as a directory that can be created or written into.

    Checked before the work starts, so that a long run does not end on a path it cannot write. Nothing is created.

    Raises:
        CommandError: ``value`` is a file, lies under one, or is in a directory this user cannot write to.
    """
    path = Path(value)
    if path.exists() and not path.is_dir():
        raise CommandError(f"`{flag}`={value!r} is not a directory: it is a file. Choose a directory to write into.")
    _check_writable(path, flag, value)
    return path


def check_output_file(value: str, flag: str, example_name: str) -> Path:
    """``value`` as a file that can be created or overwritten; ``example_name`` is suggested for a directory.

    Raises:
        CommandError: ``value`` is a directory, lies under a file, or cannot be written by this user.
    """
    path = Path(value)
    if path.is_dir():
        raise CommandError(
            f"`{flag}`={value!r} is a directory. Name the file to write, such as {str(path / example_name)!r}."
        )
    if path.exists() and not os.access(path, os.W_OK):
        raise CommandError(f"`{flag}`={value!r} is not writable. Choose another file, or change its permissions.")
    _check_writable(path.parent, flag, value)
    return path


def _check_writable(directory: Path, flag: str, value: str) -> None:
    # The nearest directory that exists is where the missing ones would be created.
    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise CommandError(
            f"`{flag}`={value!r} cannot be written: {str(existing)!r} is not a directory. Choose another path."
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise CommandError(
            f"`{flag}`={value!r} cannot be written: {str(existing)!r} is not writable by this user. Choose a"
            " path you can write to."
        )
