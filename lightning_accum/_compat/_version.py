"""The Lightning versions whose internals ``lightning_accum._compat`` was written against and is tested on.

The loop patches (``loops.py``) refuse other versions before they touch anything; the other modules name the
versions they were read against in their docstrings. CI tests both ends: the newest release of the range
(``tox -e tests``) and its oldest, 2.4.0 (``tox -e tests-oldest``). Lightning 2.2 and 2.3 lack
``ModelParallelStrategy`` (FSDP2), which the package supports, and 2.2 no longer imports without ``pkg_resources``.
"""

from __future__ import annotations

import lightning
from lightning_utilities.core.imports import RequirementCache

SUPPORTED_LIGHTNING = ">=2.4,<2.7"
_LIGHTNING_OK = bool(RequirementCache(f"lightning{SUPPORTED_LIGHTNING}"))


def _check_version() -> None:
    if not _LIGHTNING_OK:
        raise RuntimeError(
            f"lightning_accum supports lightning{SUPPORTED_LIGHTNING}, found {lightning.__version__}."
            " Install a supported version, e.g. `pip install 'lightning>=2.4,<2.7'`."
        )


def _missing(qualname: str, use: str) -> RuntimeError:
    """The error for a Lightning internal this version lacks: ``qualname`` is what is missing, ``use`` who needs it."""
    return RuntimeError(
        f"lightning {lightning.__version__} has no `{qualname}`, which {use}. Use lightning{SUPPORTED_LIGHTNING}."
    )
