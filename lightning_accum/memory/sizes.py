"""Byte counts for people: each size in the unit that reads best (B, KiB, MiB, GiB or TiB).

Pure. `format_size` is the one formatting function; `size_unit` picks the unit, and `format_sizes` writes several sizes
that are read against each other (a peak and its budget) in one unit, with enough digits to tell them apart.
Machine-readable outputs (JSON, metrics) stay in bytes.

Examples:
    >>> format_size(8_320), format_size(161_776_640), format_size(185_675_000_000)
    ('8.12 KiB', '154.28 MiB', '172.92 GiB')
    >>> format_size(512), format_size(0)
    ('512 B', '0 B')
    >>> format_sizes(473_956_352, 461_373_440)  # 0.441 vs 0.430 GiB: not both "0.43 GiB"
    ['452.00 MiB', '440.00 MiB']
    >>> format_sizes(2**30 + 2**20, 2**30)
    ['1.001 GiB', '1.000 GiB']
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

UNITS: tuple[tuple[str, int], ...] = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))
"""Binary units, largest first: sizes of memory are powers of two (an "80 GB" GPU reports 81,920 MiB)."""

FACTORS: dict[str, int] = dict(UNITS)
"""Bytes per unit, by name: ``FACTORS["MiB"] == 2**20``."""


def size_unit(nbytes: float) -> str:
    """The largest unit in which ``nbytes`` is at least 1 (``"B"`` below 1 KiB), e.g. ``"MiB"`` for 3.5 MiB."""
    magnitude = abs(nbytes)
    return next((unit for unit, size in UNITS if magnitude >= size), "B")


def format_size(nbytes: float, unit: str | None = None, digits: int = 2) -> str:
    """``nbytes`` as ``"154.28 MiB"``: in ``unit`` (one of `UNITS`, by default `size_unit`), ``digits`` decimals.

    Whole bytes have no decimals (``"512 B"``).

    Raises:
        ValueError: if ``unit`` is not one of `UNITS`.
    """
    unit = size_unit(nbytes) if unit is None else unit
    if unit not in FACTORS:
        raise ValueError(f"`unit` must be one of {', '.join(FACTORS)}, got {unit!r}.")
    if unit == "B":
        return f"{nbytes:.0f} B"
    return f"{nbytes / FACTORS[unit]:.{digits}f} {unit}"


def format_sizes(*sizes: float, digits: int = 2, max_digits: int = 6) -> list[str]:
    """``sizes`` in one unit, that of the largest, with enough decimals to write different sizes differently.

    Decimals go from ``digits`` up to ``max_digits``: "peak 0.43 GiB > budget 0.43 GiB" says nothing.
    """
    unit = size_unit(max((abs(s) for s in sizes), default=0))
    for places in range(digits, max_digits + 1):
        texts = [format_size(s, unit, places) for s in sizes]
        if _distinct(sizes, texts):
            break
    return texts


def _distinct(sizes: Sequence[float], texts: Sequence[str]) -> bool:
    pairs = itertools.combinations(zip(sizes, texts, strict=True), 2)
    return all((a == b) == (text_a == text_b) for (a, text_a), (b, text_b) in pairs)
