"""`parse_budget` and `format_bytes`."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from tfrecompute.strategies import format_bytes, parse_budget


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("512MiB", 512 * 1024**2),
        ("2GB", 2 * 1000**3),
        ("1.5 GiB", 3 * 1024**3 // 2),
        ("1000", 1000),
        ("64kB", 64_000),
        ("64KiB", 65_536),
        ("64 kib", 65_536),
        ("  3 mib ", 3 * 1024**2),
        ("1e9", 10**9),
        ("2.5e3 B", 2500),
        ("10b", 10),
        ("0.5KiB", 512),
        ("0.1 KiB", 102),  # 102.4 bytes, rounded down
        ("1.5", 1),
        (".5 MB", 500_000),
        ("1 TiB", 1024**4),
        ("2 PB", 2 * 1000**5),
    ],
)
def test_parses_strings(text: str, expected: int) -> None:
    assert parse_budget(text) == expected


def test_accepts_ints() -> None:
    assert parse_budget(4096) == 4096
    assert parse_budget(np.int64(7)) == 7  # type: ignore[arg-type]
    assert type(parse_budget(np.int64(7))) is int  # type: ignore[arg-type]


@settings(deadline=None, max_examples=50)
@given(hs.integers(1, 10**6), hs.sampled_from(["KiB", "MiB", "GiB", "kB", "MB", "GB", "B"]))
def test_units_scale_exactly(number: int, unit: str) -> None:
    factor = {
        "KiB": 1024,
        "MiB": 1024**2,
        "GiB": 1024**3,
        "kB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
        "B": 1,
    }[unit]
    assert parse_budget(f"{number}{unit}") == number * factor
    assert parse_budget(f"{number} {unit.upper()}") == number * factor


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (
            True,
            TypeError,
            r"parse_budget: a budget must be a number or a string\. "
            r"Received: value=True \(of type bool\)\. Pass a positive int of bytes, a string "
            r"such as \"512MiB\"",
        ),
        (
            1.5,
            ValueError,
            r"parse_budget: a float budget is a share of storing everything in \(0, 1\] or a "
            r"whole number of bytes\. Received: value=1\.5 \(of type float\)",
        ),
        (None, TypeError, r"Received: value=None \(of type NoneType\)"),
        (
            0,
            ValueError,
            r"parse_budget: a budget must be positive\. Received: value=0 "
            r"\(of type int\)",
        ),
        (-5, ValueError, r"a budget must be positive\. Received: value=-5"),
        (
            "abc",
            ValueError,
            r"parse_budget: the budget string is not a number followed by a "
            r"unit\. Received: value='abc' \(of type str\)",
        ),
        ("", ValueError, r"not a number followed by a unit"),
        ("-5MiB", ValueError, r"not a number followed by a unit"),
        ("nan", ValueError, r"not a number followed by a unit"),
        ("5 MiB extra", ValueError, r"not a number followed by a unit"),
        (
            "5 XB",
            ValueError,
            r"parse_budget: unknown unit 'XB'\. Received: value='5 XB' "
            r"\(of type str\)\. Use one of B, KiB",
        ),
        (
            "64k",
            ValueError,
            r"parse_budget: the unit 'k' is ambiguous\. Received: value='64k' "
            r"\(of type str\)\. Write KiB/MiB/GiB/TiB for powers of 1024 or kB/MB/GB/TB",
        ),
        ("2G", ValueError, r"the unit 'G' is ambiguous"),
        ("0 MiB", ValueError, r"a budget must be at least 1 byte"),
        (
            "0.1 B",
            ValueError,
            r"parse_budget: a budget must be at least 1 byte\. Received: "
            r"value='0\.1 B'",
        ),
    ],
)
def test_rejects(value: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        parse_budget(value)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (100, "100 B"),
        (1023, "1023 B"),
        (1024, "1.00 KiB"),
        (1536, "1.50 KiB"),
        (1572864, "1.50 MiB"),
        (1048575, "1.00 MiB"),  # 1023.999 KiB rounds up to the next unit
        (1436549, "1.37 MiB"),
        (5 * 1024**3, "5.00 GiB"),
        (3 * 1024**4, "3.00 TiB"),
        (-1572864, "-1.50 MiB"),
        (np.int64(2048), "2.00 KiB"),
    ],
)
def test_format_bytes(n: int, text: str) -> None:
    assert format_bytes(n) == text


@pytest.mark.parametrize("value", [1.5, True, "1"])
def test_format_bytes_rejects(value: object) -> None:
    with pytest.raises(
        TypeError,
        match=r"format_bytes: expected a whole number of bytes\. "
        r"Received: n=.* \(of type (float|bool|str)\)\. Pass an int\.",
    ):
        format_bytes(value)  # type: ignore[arg-type]
