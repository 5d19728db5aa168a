"""The ``lightning_accum`` logger: events (a schedule change, an OOM recovered, a size grown back) at INFO.

Like Lightning's own ``lightning.pytorch`` logger, it prints to stderr when the application configured no logging,
so events are visible (and land in W&B's console log) without any setup; an application's own configuration wins.
"""

from __future__ import annotations

import logging


def configure() -> None:
    logger = logging.getLogger("lightning_accum")
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    if not logging.getLogger().hasHandlers() and not logger.handlers:
        logger.addHandler(logging.StreamHandler())
