"""Memory budgets: parse `"512MiB"`-style strings into bytes, format bytes for people.

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
from collections.abc import Callable
from fractions import Fraction
from typing import TYPE_CHECKING, Any

from tfrecompute.errors import InfeasibleBudgetError
from tfrecompute.strategies._checks import fail, received

if TYPE_CHECKING:
    from tfrecompute.strategies.chain import Chain
    from tfrecompute.strategies.plan import Plan

__all__ = ["DEFAULT_HEADROOM", "format_bytes", "parse_budget", "plan_within"]

DEFAULT_HEADROOM = 0.3
"""Share of a model's budget the planner leaves for the allocator's rounding.

NOTE [ Budget headroom ]
The memory model predicts the bytes a step's tensors request. TensorFlow's
BFC allocator serves each request from a free chunk of up to twice its size
(NOTE [ Requested and allocated bytes ] in tfrecompute/tracing.py), so what
the allocator holds, which is what runs out on a GPU, is more: +1% to +32%
over the requested peak in benchmarks/results/prediction_accuracy.md (the
most under `sqrt` plans), different from step to step, while the requested
peak itself can exceed the prediction by several percent. A budget given for
a model (`plan`, `recompute`, the CLI) is therefore planned as
`budget * (1 - headroom)`: 1 / 0.7 covers +43% over an exact prediction, and
the optimal plans of that benchmark measured 69% to 90% of their budget. It
is a margin, not a bound: a prediction under the requested peak and a large
rounding can together exceed it. tests/test_models_real.py checks that the
optimal plan's measured allocator peak stays under the budget.
"""

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
    return _parse_budget(value, api="parse_budget", name="value")


def _parse_budget(value: object, *, api: str, name: str) -> int:
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


def plan_within(
    api: str,
    strategy: Callable[..., Plan],
    chain: Chain,
    budget: object,
    headroom: object,
) -> Plan:
    """Plans `chain` with `strategy` under a model's budget, leaving `headroom` of it.

    The strategy gets `floor(budget * (1 - headroom))` bytes (NOTE [ Budget
    headroom ]). Without a budget it gets none, and `headroom` must be None.

    Args:
        api: the public function, for error messages.
        strategy: `(chain, budget=None) -> Plan`.
        chain: the chain to plan.
        budget: None, bytes or a string like `"2GiB"`.
        headroom: None for `DEFAULT_HEADROOM`, or a share in `[0, 1)`.

    Returns:
        The strategy's plan.

    Raises:
        TypeError: `budget` or `headroom` has the wrong type.
        ValueError: `budget` is not positive or malformed, or `headroom` is outside
            `[0, 1)` or given without a budget.
        InfeasibleBudgetError: the strategy cannot meet the reduced budget;
            `minimum` is the least budget (headroom included) it meets.

    Example:
        >>> from tfrecompute.strategies import Chain, optimal
        >>> chain = Chain.homogeneous(16, activation_bytes=100)
        >>> plan_within("plan", optimal, chain, 1200, 0.25).peak_bytes  # planned in 900
        900
    """
    if budget is None:
        if headroom is not None:
            fail(
                api,
                "headroom only applies to a budget",
                "headroom",
                headroom,
                "Pass a budget too, or leave headroom=None",
            )
        return strategy(chain, budget=None)
    total = _parse_budget(budget, api=api, name="budget")
    share = _headroom(api, DEFAULT_HEADROOM if headroom is None else headroom)
    planned = math.floor(total * (1 - share))
    try:
        return strategy(chain, budget=max(planned, 1))
    except InfeasibleBudgetError as error:
        least = math.ceil(error.minimum / (1 - share))
        message = (
            f"{api}: the plan must fit in {format_bytes(max(planned, 1))}, the budget "
            f"{format_bytes(total)} less {float(share) * 100:.3g}% headroom for the allocator, but "
            f"the least predicted peak the strategy reaches is {format_bytes(error.minimum)}. "
            f"{received('budget', budget)}, headroom={headroom!r}. Raise the "
            f"budget to at least {least} bytes, lower the headroom, or reduce the batch size."
        )
        raise InfeasibleBudgetError(message, budget=total, minimum=least) from None


def _headroom(api: str, value: Any) -> Fraction:
    fix = "Pass a share of the budget in [0, 1), e.g. headroom=0.3 (0 plans to the budget)"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        fail(api, "headroom must be a real number", "headroom", value, fix, error=TypeError)
    share = float(value)
    if not math.isfinite(share) or not 0 <= share < 1:
        fail(api, "headroom must be in [0, 1)", "headroom", value, fix)
    return Fraction(share)
