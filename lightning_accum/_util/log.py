"""The ``lightning_accum`` logger: events (a schedule change, an OOM recovered, a size grown back) at INFO.

Like Lightning's own ``lightning.pytorch`` logger, it prints to stderr when the application configured no logging,
so events are visible (and land in W&B's console log) without any setup; an application's own configuration wins.

Warnings raised from the package's own files print as ``lightning_accum: <message>``, not behind the path and line
of the file that raised them (`show_warnings_as_the_package`).
"""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path
from typing import Any

import torch.distributed as dist

log = logging.getLogger("lightning_accum")


def configure() -> None:
    logger = log
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    if not logging.getLogger().hasHandlers() and not logger.handlers:
        logger.addHandler(logging.StreamHandler())


_PACKAGE = str(Path(__file__).resolve().parents[1]) + os.sep


def show_warnings_as_the_package() -> None:
    """Print the package's warnings as ``lightning_accum: <message>``; every other warning as before.

    Lightning formats a warning from any path holding "lightning" as ``<path>:<line>: <message>``, and the package's
    path holds it: a user read ``/.../lightning_accum/split/session.py:242: The step's peak memory ...``. The format
    in place when the package is imported (Lightning's, or the standard one) still formats every other warning.
    A category other than `UserWarning` keeps its name (``lightning_accum: DeprecationWarning: ...``).
    """
    previous = warnings.formatwarning
    if getattr(previous, "lightning_accum", False):
        return

    def format_warning(
        message: Warning | str, category: type[Warning], filename: str, lineno: int, line: str | None = None
    ) -> str:
        if os.path.abspath(filename).startswith(_PACKAGE):
            kind = "" if category is UserWarning else f"{category.__name__}: "
            return f"lightning_accum: {kind}{message}\n"
        return previous(message, category, filename, lineno, line)

    marked: Any = format_warning
    marked.lightning_accum = True
    warnings.formatwarning = format_warning


def log_info(message: str) -> None:
    """Log at INFO on rank 0 only: an event every rank saw alike is said once."""
    if _global_rank() == 0:
        log.info(message)


def _global_rank() -> int:
    """This process's rank: the process group's, else what a launcher set (as Lightning's ``rank_zero_only`` reads)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    for name in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"):
        if name in os.environ:
            return int(os.environ[name])
    return 0
