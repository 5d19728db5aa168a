"""The memory budget, ``max_memory``: size strings, the forms a user may give it, and what it comes to in bytes.

Pure: no device. A budget is one of

* a fraction of the device's capacity, a float in ``(0, 1]`` (``0.8``);
* a number of bytes, an int (``8 * 2**30``), or a whole float above 1, because YAML and LightningCLI hand large ints
  over as floats;
* a size string such as ``"6GiB"`` or ``"500 MB"``;
* ``None``, the default: `DEFAULT_MAX_MEMORY` of the capacity.

`check_max_memory` turns any of these into a fraction (a float) or bytes (an int); `budget_bytes` resolves it
against a capacity.

Examples:
    >>> capacity = 16 * GIB
    >>> budget_bytes("6GiB", capacity) == 6 * GIB, budget_bytes(0.5, capacity) == 8 * GIB
    (True, True)
    >>> budget_fraction(4 * GIB, capacity)
    0.25
"""

from __future__ import annotations

import re
from typing import Any

from lightning_accum._util.validation import check_number

GIB = 2**30
"""Bytes in a GiB: the unit of every ``*_gib`` metric and message."""

DEFAULT_MAX_MEMORY = 0.9
"""The budget when ``max_memory`` is ``None``: this fraction of the device's capacity."""

_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": GIB,
    "tib": 2**40,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(B|[KMGT]i?B)\s*", flags=re.IGNORECASE)


def parse_size(text: str, name: str = "max_memory") -> int:
    """The number of bytes a size string such as ``"6GiB"`` or ``"500 MB"`` names (the unit is case-insensitive).

    Units: ``B``; ``KB``, ``MB``, ``GB``, ``TB`` (powers of 10); ``KiB``, ``MiB``, ``GiB``, ``TiB`` (powers of 2).
    A fractional size is rounded down to whole bytes.

    Args:
        text: the size.
        name: the argument it was given as, for the message.

    Raises:
        ValueError: ``text`` is not a number followed by one of the units above.

    Examples:
        >>> parse_size("6GiB") == 6 * 2**30, parse_size("500 MB"), parse_size("1.5kib")
        (True, 500000000, 1536)
        >>> parse_size("8iB")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
            ...
        ValueError: `max_memory` as a string must be a size such as '8GiB' or '500MB', got '8iB'. Units: B, KB, ...
    """
    match = _SIZE.fullmatch(text)
    if match is None:
        raise ValueError(
            f"`{name}` as a string must be a size such as '8GiB' or '500MB', got {text!r}. Units: B, KB, MB, GB, TB"
            " (powers of 10) and KiB, MiB, GiB, TiB (powers of 2)."
        )
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def check_max_memory(max_memory: object) -> float | int:
    """The budget as a fraction of capacity (a float in ``(0, 1]``) or as bytes (an int >= 1).

    Raises:
        TypeError: ``max_memory`` is not a float, an int, a string or ``None``.
        ValueError: a float fraction outside ``(0, 1]``, fewer than 1 byte, or a string that is not a size.

    Examples:
        >>> check_max_memory(None), check_max_memory(0.8), check_max_memory("1KiB"), check_max_memory(8.0 * 2**30)
        (0.9, 0.8, 1024, 8589934592)
        >>> check_max_memory(1.5)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
            ...
        ValueError: `max_memory` as a fraction of device memory must be in (0, 1], got 1.5. For a number of bytes ...
    """
    if max_memory is None:
        return DEFAULT_MAX_MEMORY
    if isinstance(max_memory, str):
        max_memory = parse_size(max_memory)
    if isinstance(max_memory, bool) or not isinstance(max_memory, (int, float)):
        raise TypeError(
            f"`max_memory` must be a fraction of device memory (a float in (0, 1]), a number of bytes (an int) or a"
            f" size such as '8GiB', got {max_memory!r} of type {type(max_memory).__name__}."
        )
    if isinstance(max_memory, float) and max_memory > 1 and max_memory.is_integer():
        # YAML and LightningCLI turn large ints into floats; a whole number of bytes is still meant.
        max_memory = int(max_memory)
    if isinstance(max_memory, float):
        if not 0.0 < max_memory <= 1.0:
            raise ValueError(
                f"`max_memory` as a fraction of device memory must be in (0, 1], got {max_memory}. For a number of"
                " bytes pass an int or a size, e.g. `max_memory=8 * 2**30` or `max_memory='8GiB'`."
            )
        return max_memory
    if max_memory < 1:
        raise ValueError(f"`max_memory` in bytes must be >= 1, got {max_memory}. For a fraction pass a float.")
    return max_memory


def budget_bytes(max_memory: Any, capacity_bytes: float) -> int:
    """The budget in bytes on a device of ``capacity_bytes``: a fraction of it, or the bytes given.

    ``max_memory`` takes every form `check_max_memory` accepts (``None`` is `DEFAULT_MAX_MEMORY`).

    Raises:
        TypeError: as `check_max_memory`, or ``capacity_bytes`` is not a number.
        ValueError: as `check_max_memory`, or ``capacity_bytes`` is negative.

    Examples:
        >>> budget_bytes(None, 1000), budget_bytes(0.5, 1000), budget_bytes(600, 1000), budget_bytes("2KB", 1000)
        (900, 500, 600, 2000)
    """
    capacity = check_number(capacity_bytes, "capacity_bytes", 0, kind="number of bytes")
    budget = check_max_memory(max_memory)
    return int(budget * capacity) if isinstance(budget, float) else budget


def budget_fraction(max_memory: Any, capacity_bytes: float) -> float:
    """The budget as a fraction of capacity, as the dashboard's budget line shows it.

    ``None`` here means that no budget was set (nothing splits the batch), so the capacity is the limit: 1.0. Every
    other form is read as `check_max_memory` reads it. The fraction is ``nan`` when the capacity is unknown (0).

    Raises:
        TypeError: as `check_max_memory`.
        ValueError: as `check_max_memory`.

    Examples:
        >>> capacity = 8 * GIB
        >>> budget_fraction(None, capacity), budget_fraction(0.8, capacity), budget_fraction(2 * GIB, capacity)
        (1.0, 0.8, 0.25)
    """
    if max_memory is None:
        return 1.0
    budget = check_max_memory(max_memory)
    if isinstance(budget, float):
        return budget
    return float(budget) / float(capacity_bytes) if capacity_bytes > 0 else float("nan")


def over_capacity_warning(max_memory: Any, budget: float, capacity_bytes: float, device: str) -> str | None:
    """The warning for a budget larger than the device, or ``None`` when it fits (or the capacity is unknown).

    A budget the device cannot hold is never reached: nothing shrinks before memory runs out, and every shrink comes
    from an OOM. It is legal (a budget written for a larger device), so it warns rather than raises.

    Examples:
        >>> over_capacity_warning("100GiB", 100 * GIB, 23.5 * GIB, "cpu")[:92]
        '`max_memory=100GiB` sets a budget of 100.00 GiB, more than the device holds (23.50 GiB, cpu)'
        >>> over_capacity_warning(0.9, 0.9 * GIB, GIB, "cpu") is None
        True
    """
    if capacity_bytes <= 0 or budget <= capacity_bytes:
        return None
    given = max_memory if isinstance(max_memory, str) else repr(max_memory)
    return (
        f"`max_memory={given}` sets a budget of {budget / GIB:.2f} GiB, more than the device holds"
        f" ({capacity_bytes / GIB:.2f} GiB, {device}): the budget is never reached, so the micro-batch only shrinks"
        " after an out-of-memory error. Pass a fraction of the device (e.g. `max_memory=0.9`) or a size below its"
        " capacity."
    )
