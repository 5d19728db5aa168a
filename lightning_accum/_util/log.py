"""The ``lightning_accum`` logger: events (a schedule change, an OOM recovered, a size grown back) at INFO.

Like Lightning's own ``lightning.pytorch`` logger, it prints to stderr when the application configured no logging,
so events are visible (and land in W&B's console log) without any setup; an application's own configuration wins.
"""

from __future__ import annotations

import logging
import os

import torch.distributed as dist

log = logging.getLogger("lightning_accum")


def configure() -> None:
    logger = log
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    if not logging.getLogger().hasHandlers() and not logger.handlers:
        logger.addHandler(logging.StreamHandler())


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
