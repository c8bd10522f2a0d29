"""Checks of the planner's per-link numbers: byte counts, costs and sequences (private).

Messages follow the project's format through `tfrecompute._messages`.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping

from tfrecompute._messages import fail

__all__: list[str] = []


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
    """Turns an iterable of per-link values (list, tuple, numpy array) into a tuple."""
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        fail(
            api,
            f"{name} must be a sequence with one entry per link",
            name,
            value,
            "Pass a list or tuple",
            error=TypeError,
        )
    return tuple(value)
