"""Sizes for people: the unit picked per value, one unit with enough digits for sizes read against each other."""

from __future__ import annotations

import pytest

from lightning_accum.memory.sizes import format_size, format_sizes, size_unit

KiB, MiB, GiB = 2**10, 2**20, 2**30


@pytest.mark.parametrize(
    ("nbytes", "text"),
    [
        (0, "0 B"),
        (80, "80 B"),  # a bias of 20 floats
        (1023, "1023 B"),
        (1024, "1.00 KiB"),
        (13_440, "13.12 KiB"),  # a tiny model's parameters: not "0.01 MiB"
        (3_366_912, "3.21 MiB"),
        (161_776_640, "154.28 MiB"),
        (16_060_522_496, "14.96 GiB"),  # Llama-3-8B's bf16 weights
        (185_673_427_968, "172.92 GiB"),  # its 8 x 1 peak: not "177074.85 MiB"
        (64_241_582_080, "59.83 GiB"),  # its fitted fixed memory: not "61267.18 MiB"
        (3 * 2**40, "3.00 TiB"),
        (-2 * MiB, "-2.00 MiB"),
    ],
)
def test_each_size_reads_in_its_own_unit(nbytes: int, text: str):
    assert format_size(nbytes) == text


def test_a_unit_and_digits_can_be_asked_for():
    assert format_size(3 * MiB, "GiB", 4) == "0.0029 GiB" and size_unit(3 * MiB) == "MiB"
    with pytest.raises(ValueError, match=r"`unit` must be one of TiB, GiB, MiB, KiB, B, got 'GB'"):
        format_size(1, "GB")


@pytest.mark.parametrize(
    ("sizes", "texts"),
    [
        ((473_956_352, 461_373_440), ["452.00 MiB", "440.00 MiB"]),  # 0.441 and 0.430 GiB
        ((GiB + MiB, GiB), ["1.001 GiB", "1.000 GiB"]),
        ((GiB + 4 * KiB, GiB), ["1.000004 GiB", "1.000000 GiB"]),  # as many digits as it takes, up to 6
        ((GiB, GiB), ["1.00 GiB", "1.00 GiB"]),  # equal sizes read equal
        ((2 * GiB, 512 * MiB), ["2.00 GiB", "0.50 GiB"]),  # one unit: that of the largest
    ],
)
def test_sizes_read_against_each_other_share_a_unit_and_differ(sizes: tuple[int, ...], texts: list[str]):
    assert format_sizes(*sizes) == texts
