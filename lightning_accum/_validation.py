"""Argument checks shared by the modules.

Their messages say what the project promises: the argument, what was expected, and the value received.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import torch


def check_int(value: Any, name: str, minimum: int, hint: str = "") -> int:
    """``value`` if it is an int >= ``minimum``; ``hint`` is appended to what was expected (e.g. ``' or "auto"'``)."""
    # bool is an int subclass; `True` as a size or a count is always a mistake.
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"`{name}` must be an int >= {minimum}{hint}, got {value!r} of type {type(value).__name__}.")
    if value < minimum:
        raise ValueError(f"`{name}` must be an int >= {minimum}{hint}, got {value!r}.")
    return value


def import_object(path: str, name: str) -> Any:
    """The object an import path names, ``"package.module.attr"`` or ``"package.module:attr"``.

    ``name`` is the argument the path was given as (e.g. ``count_items``); the messages name it.

    Raises:
        ValueError: the path is malformed, its module can't be imported, or the module has no such attribute.
    """
    if ":" in path:
        module_name, _, attr_path = path.partition(":")
    else:
        module_name, _, attr_path = path.rpartition(".")
    if not module_name or not attr_path:
        raise ValueError(
            f"`{name}={path!r}` is not an import path. Write 'package.module.function' or 'package.module:function'."
        )
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"`{name}={path!r}`: cannot import module {module_name!r} ({err}).") from err
    for attr in attr_path.split("."):
        try:
            target = getattr(target, attr)
        except AttributeError as err:
            raise ValueError(f"`{name}={path!r}`: {module_name!r} has no attribute {attr_path!r}.") from err
    return target


def as_whole_number(value: Any) -> Any:
    """``value`` as a Python int if it is an integer (int, NumPy integer, single-element integer tensor), else as is.

    Sample counts come from user code as any of these; bools are left alone so that callers refuse them.
    """
    if isinstance(value, bool):
        return value
    np = sys.modules.get("numpy")  # only if the caller's code already imported it
    if np is not None and isinstance(value, np.integer):
        return int(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        if not value.is_complex() and value.dtype != torch.bool:
            return int(value.item())
    return value
