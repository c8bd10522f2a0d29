"""Byte units: parse `"512MiB"`-style budgets into bytes, format bytes for people.

Budgets are whole bytes at the core of the planner; strings are accepted at the
edge. Units are case-insensitive, with an optional space before them:

* IEC, powers of 1024: `KiB`, `MiB`, `GiB`, `TiB`, `PiB`;
* SI, powers of 1000: `kB`, `MB`, `GB`, `TB`, `PB`;
* `B` or no unit: bytes.

Bare `k`, `M`, `G`, `T` are rejected because they are ambiguous (1000 or 1024?).
A fractional result is rounded down to whole bytes (`"0.5KiB"` is 512 bytes,
`"1.5 B"` is 1 byte), so a parsed budget never exceeds what was written.
"""

from __future__ import annotations

import math
import numbers
import re
from fractions import Fraction

from tfrecompute._messages import fail

__all__ = ["budget_bytes", "format_bytes", "format_size", "parse_budget"]

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
    "pib": 1024**5,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "pb": 1000**5,
}
_AMBIGUOUS = {"k", "m", "g", "t", "p", "ki", "mi", "gi", "ti", "pi"}
_PATTERN = re.compile(
    r"^\s*(?P<number>(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)\s*(?P<unit>[A-Za-z]*)\s*$"
)
_FIX = 'Pass a positive int of bytes or a string such as "512MiB", "2GB" or "1.5 GiB"'


def parse_budget(value: int | str) -> int:
    """Parses a memory budget into whole bytes.

    Args:
        value: a positive int of bytes, or a string: a number and an optional
            unit (`KiB`/`MiB`/`GiB`/`TiB`/`PiB` are powers of 1024,
            `kB`/`MB`/`GB`/`TB`/`PB` powers of 1000, `B` bytes; case-insensitive,
            an optional space in between).

    Returns:
        The budget in bytes, at least 1 (fractions of a byte are rounded down).

    Raises:
        TypeError: `value` is neither an int nor a string (bools and floats are
            rejected: write `"1.5GiB"` rather than `1.5 * 2**30`).
        ValueError: the string is malformed, the unit unknown or ambiguous, or the
            budget is not positive.

    Example:
        >>> parse_budget("1.5 GiB")
        1610612736
        >>> parse_budget("2GB")
        2000000000
        >>> parse_budget(4096)
        4096
    """
    return budget_bytes(value, api="parse_budget", name="value")


def budget_bytes(value: object, *, api: str, name: str) -> int:
    """`parse_budget` with the caller's api and argument name in error messages."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, str)):
        fail(
            api, "a budget must be an int of bytes or a string", name, value, _FIX, error=TypeError
        )
    if isinstance(value, numbers.Integral):
        number = int(value)
        if number <= 0:
            fail(api, "a budget must be positive", name, value, _FIX)
        return number
    match = _PATTERN.match(value)
    if match is None:
        fail(api, "the budget string is not a number followed by a unit", name, value, _FIX)
    unit = match.group("unit").lower()
    if unit in _AMBIGUOUS:
        fail(
            api,
            f"the unit {match.group('unit')!r} is ambiguous",
            name,
            value,
            "Write KiB/MiB/GiB/TiB for powers of 1024 or kB/MB/GB/TB for powers of 1000",
        )
    if unit not in _UNITS:
        fail(
            api,
            f"unknown unit {match.group('unit')!r}",
            name,
            value,
            "Use one of B, KiB, MiB, GiB, TiB, PiB, kB, MB, GB, TB, PB",
        )
    number = math.floor(Fraction(match.group("number")) * _UNITS[unit])
    if number <= 0:
        fail(api, "a budget must be at least 1 byte", name, value, _FIX)
    return number


_IEC = ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


def format_bytes(n: int) -> str:
    """Formats a byte count with IEC units and two decimals.

    Args:
        n: a number of bytes (negative values, e.g. differences, keep their sign).

    Returns:
        `"512 B"` below 1 KiB, otherwise e.g. `"1.50 MiB"`.

    Raises:
        TypeError: `n` is not an int (bools are rejected).

    Example:
        >>> format_bytes(1572864)
        '1.50 MiB'
        >>> format_bytes(100)
        '100 B'
    """
    if isinstance(n, bool) or not isinstance(n, numbers.Integral):
        fail(
            "format_bytes",
            "expected a whole number of bytes",
            "n",
            n,
            "Pass an int",
            error=TypeError,
        )
    number = int(n)
    sign = "-" if number < 0 else ""
    size = abs(number)
    if size < 1024:
        return f"{sign}{size} B"
    scaled = float(size)
    index = 0
    while True:
        scaled /= 1024.0
        if round(scaled, 2) < 1024.0 or index == len(_IEC) - 1:
            break
        index += 1
    return f"{sign}{scaled:.2f} {_IEC[index]}"


def format_size(n: int) -> str:
    """A size as a message states it: binary units, the exact byte count in brackets.

    Example:
        >>> format_size(105373989)
        '100.49 MiB (105373989 bytes)'
        >>> format_size(512)
        '512 B'
    """
    text = format_bytes(n)
    return text if abs(int(n)) < 1024 else f"{text} ({int(n)} bytes)"
