"""Byte units: parse `"512MiB"`-style budgets into bytes, format bytes for people.

Budgets are whole bytes at the core of the planner; strings are accepted at the
edge. Units are case-insensitive, with an optional space before them:

* IEC, powers of 1024: `KiB`, `MiB`, `GiB`, `TiB`, `PiB`;
* SI, powers of 1000: `kB`, `MB`, `GB`, `TB`, `PB`;
* `B` or no unit: bytes.

Bare `k`, `M`, `G`, `T` are rejected because they are ambiguous (1000 or 1024?).
A fractional result is rounded down to whole bytes (`"0.5KiB"` is 512 bytes,
`"1.5 B"` is 1 byte), so a parsed budget never exceeds what was written.

NOTE [ A budget as a share of storing everything ]
A float in `(0, 1]` (`0.5`), a number string without a unit in that range
(`"0.5"`, what `--budget 0.5` passes) or a percentage (`"50%"`) is a share
of the predicted peak of storing every activation (`strategies.none`), the
first thing to try without knowing a model's size. It becomes bytes where
that peak is known, from the chain (`plan_within`, the strategies,
`verified_plan`): `floor(share * peak)`, at least 1. `plan` and `recompute`
plan a share without headroom unless one is given (NOTE [ Budget headroom ]):
`budget=0.5` is a plan predicted at half of storing everything, `budget=1.0`
stores everything. A float above 1 is a byte
count when it is whole (`1e9`, `1.5 * 2**30`); `1.5` is refused, as are 0,
negative numbers, NaN and infinities. Integers and number strings without a
decimal point (`"1"`) stay bytes.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Callable
from fractions import Fraction

from tfrecompute._messages import fail

__all__ = [
    "budget_bytes",
    "budget_share",
    "check_budget",
    "format_budget",
    "format_bytes",
    "format_size",
    "parse_budget",
]

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
    r"^\s*(?P<number>(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)\s*(?P<unit>[A-Za-z%]*)\s*$"
)
_FIX = (
    'Pass a positive int of bytes, a string such as "512MiB", "2GB" or "1.5 GiB", or a share '
    'of storing everything in (0, 1] such as 0.5 or "50%"'
)

Whole = int | Callable[[], int]
"""The predicted peak of storing everything a share is taken of, or a function giving it."""


def parse_budget(value: int | float | str, *, of: int | None = None) -> int:
    """Parses a memory budget into whole bytes.

    Args:
        value: a positive int of bytes, or a string: a number and an optional
            unit (`KiB`/`MiB`/`GiB`/`TiB`/`PiB` are powers of 1024,
            `kB`/`MB`/`GB`/`TB`/`PB` powers of 1000, `B` bytes; case-insensitive,
            an optional space in between); or a share of storing everything
            (NOTE [ A budget as a share of storing everything ]): a float in
            `(0, 1]`, `"0.5"` or `"50%"`, which needs `of`.
        of: the predicted peak of storing everything, in bytes, that a share
            is taken of (e.g. `strategies.none(chain).peak_bytes`).

    Returns:
        The budget in bytes, at least 1 (fractions of a byte are rounded down).

    Raises:
        TypeError: `value` is neither a number nor a string (bools are
            rejected).
        ValueError: the string is malformed, the unit unknown or ambiguous, the
            budget is not positive, a float above 1 is not a whole number of
            bytes, or a share is given without `of`.

    Example:
        >>> parse_budget("1.5 GiB")
        1610612736
        >>> parse_budget("2GB")
        2000000000
        >>> parse_budget(4096)
        4096
        >>> parse_budget(0.5, of=3000), parse_budget("25%", of=3000)
        (1500, 750)
    """
    if of is None and budget_share(value, api="parse_budget", name="value") is not None:
        fail(
            "parse_budget",
            "a share of storing everything needs the peak it is a share of",
            "value",
            value,
            "Pass of=<the predicted peak of storing everything, in bytes>, e.g. "
            "of=strategies.none(chain).peak_bytes, or pass bytes",
        )
    return budget_bytes(value, api="parse_budget", name="value", whole=of)


def budget_bytes(value: object, *, api: str, name: str, whole: Whole | None = None) -> int:
    """`parse_budget` with the caller's api and argument name in error messages.

    A share (NOTE [ A budget as a share of storing everything ]) is taken of
    `whole`, the predicted peak of storing everything (called if a function,
    only for a share); without it a share is refused.
    """
    share = budget_share(value, api=api, name=name)
    if share is None:
        return _bytes(value, api=api, name=name)
    if whole is None:
        fail(
            api,
            "a budget given as a share of storing everything needs the model's predicted "
            "peak, unknown here",
            name,
            value,
            "Pass the share to plan, recompute or verified_plan, which know the model, or "
            'pass bytes (e.g. "2GiB")',
        )
    peak = whole() if callable(whole) else whole
    return max(math.floor(share * peak), 1)


def check_budget(value: object, *, api: str, name: str) -> None:
    """Refuses a malformed budget of either kind, bytes or a share, before anything runs."""
    if budget_share(value, api=api, name=name) is None:
        _bytes(value, api=api, name=name)


def budget_share(value: object, *, api: str, name: str) -> Fraction | None:
    """The share of storing everything a budget asks for, None for a budget in bytes.

    Checks the budget either way (the errors of `parse_budget`).

    Example:
        >>> budget_share("50%", api="plan", name="budget")
        Fraction(1, 2)
        >>> budget_share("2GiB", api="plan", name="budget") is None
        True
    """
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, str)):
        fail(api, "a budget must be a number or a string", name, value, _FIX, error=TypeError)
    if isinstance(value, numbers.Integral):
        return None
    if isinstance(value, numbers.Real):
        return _float_share(float(value), api=api, name=name, value=value)
    match = _PATTERN.match(value)
    if match is None:
        fail(api, "the budget string is not a number followed by a unit", name, value, _FIX)
    number, unit = Fraction(match.group("number")), match.group("unit")
    if unit == "%":
        number /= 100
    elif unit or number > 1 or match.group("number").isdigit():
        return None  # bytes
    if not 0 < number <= 1:
        fail(api, "a share of storing everything must be in (0, 1], 0% to 100%", name, value, _FIX)
    return number


def _float_share(number: float, *, api: str, name: str, value: object) -> Fraction | None:
    """A float budget: a share in (0, 1], else None for a whole number of bytes, else an error."""
    if not math.isfinite(number):
        fail(api, "a budget must be a finite number", name, value, _FIX)
    if number <= 0:
        fail(api, "a budget must be positive", name, value, _FIX)
    if number <= 1:
        return Fraction(number)
    if not number.is_integer():
        fail(
            api,
            "a float budget is a share of storing everything in (0, 1] or a whole number of bytes",
            name,
            value,
            _FIX,
        )
    return None


def _bytes(value: object, *, api: str, name: str) -> int:
    """A budget `budget_share` found to be bytes, as an int."""
    if isinstance(value, numbers.Real):
        # an int, or a float that budget_share found to be a whole number of bytes
        number = int(value) if isinstance(value, numbers.Integral) else math.floor(float(value))
        if number <= 0:
            fail(api, "a budget must be positive", name, value, _FIX)
        return number
    assert isinstance(value, str)
    match = _PATTERN.match(value)
    assert match is not None  # budget_share checked it
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
            "Use one of B, KiB, MiB, GiB, TiB, PiB, kB, MB, GB, TB, PB, or % of storing everything",
        )
    number = math.floor(Fraction(match.group("number")) * _UNITS[unit])
    if number <= 0:
        fail(api, "a budget must be at least 1 byte", name, value, _FIX)
    return number


def format_budget(value: object, total: int) -> str:
    """A budget as a message states it (`format_size`), and the share it was given as, if one.

    Example:
        >>> format_budget(0.5, 3 * 2**20)
        '3.00 MiB (3145728 bytes, 0.5 of the predicted peak of storing everything)'
        >>> format_budget("3MiB", 3 * 2**20)
        '3.00 MiB (3145728 bytes)'
    """
    share = None
    if isinstance(value, (str, numbers.Real)) and not isinstance(value, bool):
        try:
            share = budget_share(value, api="format_budget", name="value")
        except (TypeError, ValueError):
            share = None
    if share is None:
        return format_size(total)
    of = f"{value} of the predicted peak of storing everything"
    if abs(int(total)) < 1024:
        return f"{format_bytes(total)} ({of})"
    return f"{format_bytes(total)} ({int(total)} bytes, {of})"


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
