"""Error-message helpers shared by the planner modules (private).

Every message follows the project convention
`"<api>: <what was wrong>. Received: <name>=<value> (of type <T>). <how to fix>."`
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping
from typing import NoReturn

__all__: list[str] = []

_MAX_REPR = 80


def short_repr(value: object) -> str:
    """`repr(value)`, cut to a readable length."""
    text = repr(value)
    if len(text) > _MAX_REPR:
        text = text[: _MAX_REPR - 4] + " ..." + text[-1:]
    return text


def received(name: str, value: object) -> str:
    return f"Received: {name}={short_repr(value)} (of type {type(value).__name__})"


def fail(
    api: str,
    what: str,
    name: str,
    value: object,
    fix: str,
    *,
    error: type[Exception] = ValueError,
) -> NoReturn:
    """Raises `error` with a message in the project's format."""
    raise error(f"{api}: {what}. {received(name, value)}. {fix}.")


def as_byte_count(api: str, name: str, value: object) -> int:
    """Validates a byte count: an integer (or integral float) >= 0, never a bool."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        fail(
            api,
            f"{name} must be a whole number of bytes",
            name,
            value,
            "Pass an int >= 0",
            error=TypeError,
        )
    if isinstance(value, numbers.Integral):
        number = int(value)
    else:
        real = float(value)
        if not math.isfinite(real) or not real.is_integer():
            fail(
                api,
                f"{name} must be a finite whole number of bytes",
                name,
                value,
                "Pass an int >= 0",
            )
        number = int(real)
    if number < 0:
        fail(api, f"{name} must not be negative", name, value, "Pass an int >= 0")
    return number


def as_cost(api: str, name: str, value: object) -> float:
    """Validates a cost: a finite real number >= 0, never a bool."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        fail(
            api,
            f"{name} must be a real number",
            name,
            value,
            "Pass a finite float >= 0 (seconds or FLOPs)",
            error=TypeError,
        )
    number = float(value)
    if not math.isfinite(number):
        fail(
            api,
            f"{name} must be finite",
            name,
            value,
            "Pass a finite float >= 0 (seconds or FLOPs)",
        )
    if number < 0:
        fail(
            api,
            f"{name} must not be negative",
            name,
            value,
            "Pass a finite float >= 0 (seconds or FLOPs)",
        )
    return number


def as_sequence(api: str, name: str, value: object) -> tuple[object, ...]:
    """Turns an iterable of per-layer values (list, tuple, numpy array) into a tuple."""
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        fail(
            api,
            f"{name} must be a sequence with one entry per layer",
            name,
            value,
            "Pass a list or tuple",
            error=TypeError,
        )
    return tuple(value)


def as_positive_int(api: str, name: str, value: object) -> int:
    """Validates an integer option >= 1, never a bool."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        fail(
            api,
            f"{name} must be an int",
            name,
            value,
            f"Pass an int >= 1 as {name}",
            error=TypeError,
        )
    number = int(value)
    if number < 1:
        fail(api, f"{name} must be at least 1", name, value, f"Pass an int >= 1 as {name}")
    return number
