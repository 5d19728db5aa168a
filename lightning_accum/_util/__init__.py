"""Support shared by every part of the package: argument checks, the package's logger, CLI types, collectives."""

from lightning_accum._util.cli_types import MicroBatchSize
from lightning_accum._util.log import log_info
from lightning_accum._util.validation import check_bool, check_choice, check_int

__all__ = ["MicroBatchSize", "check_bool", "check_choice", "check_int", "log_info"]
