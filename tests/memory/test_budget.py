from __future__ import annotations

import math

import pytest

from lightning_accum.memory.budget import (
    DEFAULT_MAX_MEMORY,
    GIB,
    budget_bytes,
    budget_fraction,
    check_max_memory,
    parse_size,
)

CAPACITY = 16 * GIB


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("6GiB", 6 * 2**30),
        ("6gib", 6 * 2**30),
        ("6 GIB", 6 * 2**30),
        (" 500 MB ", 500 * 10**6),
        ("1.5KiB", 1536),
        ("2TiB", 2 * 2**40),
        ("3tb", 3 * 10**12),
        ("7kb", 7 * 10**3),
        ("9MiB", 9 * 2**20),
        ("4GB", 4 * 10**9),
        ("123B", 123),
        ("0.5b", 0),  # whole bytes, rounded down
    ],
)
def test_parse_size_reads_every_unit(text: str, expected: int):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["8iB", "8 bananas", "GiB", "8", "-1GiB", "8 GiBs", "1e9B", "8XiB", ""])
def test_parse_size_refuses_what_is_not_a_size(text: str):
    # "8iB" matched the unit pattern once and then failed the unit lookup with a KeyError.
    expected = rf"`max_memory` as a string must be a size such as '8GiB' or '500MB', got {text!r}\. Units: B, KB"
    with pytest.raises(ValueError, match=expected):
        parse_size(text)


def test_parse_size_names_the_argument_it_was_given_as():
    with pytest.raises(ValueError, match=r"`budget` as a string must be a size"):
        parse_size("lots", name="budget")


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, DEFAULT_MAX_MEMORY),
        (0.5, 0.5),
        (1.0, 1.0),
        (1, 1),  # an int is bytes, even 1
        (8 * GIB, 8 * GIB),
        (8.0 * GIB, 8 * GIB),  # LightningCLI hands a YAML int over as a float
        ("8GiB", 8 * GIB),
        ("500 MB", 500 * 10**6),
    ],
)
def test_check_max_memory_reads_fractions_bytes_and_sizes(value: object, expected: float):
    resolved = check_max_memory(value)
    assert resolved == expected and type(resolved) is type(expected)


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (1.5, ValueError, r"`max_memory` as a fraction of device memory must be in \(0, 1\], got 1.5\. For a number"),
        (0.0, ValueError, r"must be in \(0, 1\], got 0.0"),
        (-5.0, ValueError, r"must be in \(0, 1\], got -5.0"),
        (math.nan, ValueError, r"must be in \(0, 1\], got nan"),
        (math.inf, ValueError, r"must be in \(0, 1\], got inf"),
        (0, ValueError, r"`max_memory` in bytes must be >= 1, got 0\. For a fraction pass a float"),
        (-5, ValueError, r"`max_memory` in bytes must be >= 1, got -5"),
        ("0GiB", ValueError, r"`max_memory` in bytes must be >= 1, got 0"),
        ("8iB", ValueError, r"`max_memory` as a string must be a size such as '8GiB' or '500MB', got '8iB'"),
        (True, TypeError, r"`max_memory` must be a fraction .* got True of type bool"),
        (
            [8],
            TypeError,
            r"`max_memory` must be a fraction of device memory \(a float in \(0, 1\]\), a number of bytes",
        ),
    ],
)
def test_check_max_memory_refuses_bad_values(value: object, error: type[Exception], match: str):
    with pytest.raises(error, match=match):
        check_max_memory(value)


@pytest.mark.parametrize(
    ("max_memory", "expected"),
    [
        (None, int(0.9 * CAPACITY)),
        (0.5, CAPACITY // 2),
        (3 * GIB, 3 * GIB),
        (3.0 * GIB, 3 * GIB),
        ("3GiB", 3 * GIB),
        (32 * GIB, 32 * GIB),  # bytes are bytes, even above the capacity
    ],
)
def test_budget_bytes_resolves_against_the_capacity(max_memory: object, expected: int):
    budget = budget_bytes(max_memory, CAPACITY)
    assert budget == expected and isinstance(budget, int)


def test_budget_bytes_rounds_a_fraction_down_to_whole_bytes():
    assert budget_bytes(0.9, 1001) == 900 == int(0.9 * 1001)


@pytest.mark.parametrize(("capacity", "error"), [(-1, ValueError), (math.inf, ValueError), ("16GiB", TypeError)])
def test_budget_bytes_checks_the_capacity(capacity: object, error: type[Exception]):
    with pytest.raises(error, match=rf"`capacity_bytes` must be a finite number of bytes >= 0, got {capacity!r}"):
        budget_bytes(0.5, capacity)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("max_memory", "capacity", "expected"),
    [
        (None, CAPACITY, 1.0),  # no budget: the capacity is the limit
        (0.8, CAPACITY, 0.8),
        (4 * GIB, CAPACITY, 4 * GIB / CAPACITY),
        (4.0 * GIB, CAPACITY, 4 * GIB / CAPACITY),
        ("4GiB", CAPACITY, 4 * GIB / CAPACITY),
        (0.8, 0, 0.8),  # a fraction needs no capacity
    ],
)
def test_budget_fraction(max_memory: object, capacity: int, expected: float):
    assert budget_fraction(max_memory, capacity) == expected


def test_budget_fraction_of_bytes_is_nan_without_a_capacity():
    assert math.isnan(budget_fraction(4 * GIB, 0))


def test_budget_bytes_and_budget_fraction_agree():
    for max_memory in (0.25, 0.9, 2 * GIB, "6GiB"):
        assert budget_fraction(max_memory, CAPACITY) == pytest.approx(budget_bytes(max_memory, CAPACITY) / CAPACITY)


def test_gib_is_two_to_the_thirty():
    assert GIB == 2**30 == 1024**3
