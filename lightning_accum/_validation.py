"""Argument checks shared by the modules.

Their messages say what the project promises: the argument, what was expected, and the value received.
"""

from __future__ import annotations

from typing import Any


def check_int(value: Any, name: str, minimum: int, hint: str = "") -> int:
    """``value`` if it is an int >= ``minimum``; ``hint`` is appended to what was expected (e.g. ``' or "auto"'``)."""
    # bool is an int subclass; `True` as a size or a count is always a mistake.
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"`{name}` must be an int >= {minimum}{hint}, got {value!r} of type {type(value).__name__}.")
    if value < minimum:
        raise ValueError(f"`{name}` must be an int >= {minimum}{hint}, got {value!r}.")
    return value
