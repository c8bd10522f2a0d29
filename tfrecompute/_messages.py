"""Error messages in the project's one format, and the checks of plain options.

Every message reads
`"<api>: <what was wrong>. Received: <name>=<value> (of type <T>). <how to fix>."`
Wrong types raise `TypeError`, wrong values of the right type `ValueError`,
whichever public function the option belongs to.

Pure Python (no TensorFlow): the planner in `tfrecompute.strategies` uses it.
"""

from __future__ import annotations

import numbers
from typing import NoReturn

__all__ = [
    "as_bool",
    "as_count",
    "as_positive_int",
    "cause",
    "describe",
    "fail",
    "received",
    "short_repr",
]

_MAX_REPR = 80


def short_repr(value: object) -> str:
    """`repr(value)`, cut to a readable length."""
    text = repr(value)
    if len(text) > _MAX_REPR:
        text = text[: _MAX_REPR - 4] + " ..." + text[-1:]
    return text


def cause(error: BaseException) -> str:
    """`"<ErrorType>: <first line of its message>"` (the type alone for an empty message):
    an error another one quotes as its cause."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


def describe(value: object) -> str:
    """`"<short repr> (of type <T>)"`: a value as a message quotes it."""
    return f"{short_repr(value)} (of type {type(value).__name__})"


def received(name: str, value: object, *, by_name: bool = False) -> str:
    """`"Received: <name>=<short repr> (of type <T>)"`.

    With `by_name`, the value is shown by its `.name` (a Keras model or
    layer, whose repr says little).
    """
    if by_name:
        return (
            f"Received: {name}={getattr(value, 'name', value)!r} (of type {type(value).__name__})"
        )
    return f"Received: {name}={describe(value)}"


def fail(
    api: str,
    what: str,
    name: str,
    value: object,
    fix: str,
    *,
    error: type[Exception] = ValueError,
    by_name: bool = False,
) -> NoReturn:
    """Raises `error` with a message in the project's format (see `received` for `by_name`).

    Example:
        >>> fail("plan", "unknown strategy", "strategy", "fast", "Use one of 'none', 'sqrt'")
        Traceback (most recent call last):
        ...
        ValueError: plan: unknown strategy. Received: strategy='fast' (of type str). Use one of \
'none', 'sqrt'.
    """
    raise error(f"{api}: {what}. {received(name, value, by_name=by_name)}. {fix}.")


def as_positive_int(api: str, name: str, value: object, *, example: str | None = None) -> int:
    """Validates an integer option >= 1 (never a bool): TypeError for a non-int, else ValueError.

    Example:
        >>> as_positive_int("measure_step", "steps", 3)
        3
        >>> as_positive_int("measure_step", "steps", "3")
        Traceback (most recent call last):
        ...
        TypeError: measure_step: `steps` must be an int. Received: steps='3' (of type str). Pass \
an int >= 1, e.g. steps=3.
    """
    fix = f"Pass an int >= 1, e.g. {example or f'{name}=3'}"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        fail(api, f"`{name}` must be an int", name, value, fix, error=TypeError)
    number = int(value)
    if number < 1:
        fail(api, f"`{name}` must be at least 1", name, value, fix)
    return number


def as_count(api: str, name: str, value: object) -> int:
    """Validates an integer option >= 0 (never a bool): TypeError for a non-int, else ValueError.

    Example:
        >>> as_count("profile", "depth", -1)
        Traceback (most recent call last):
        ...
        ValueError: profile: `depth` must not be negative. Received: depth=-1 (of type int). \
Pass an int >= 0, e.g. depth=1.
    """
    fix = f"Pass an int >= 0, e.g. {name}=1"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        fail(api, f"`{name}` must be an int", name, value, fix, error=TypeError)
    if int(value) < 0:
        fail(api, f"`{name}` must not be negative", name, value, fix)
    return int(value)


def as_bool(api: str, name: str, value: object, *, fix: str | None = None) -> bool:
    """Validates a flag: a Python or numpy bool, else TypeError.

    Example:
        >>> as_bool("RecomputeBlock", "debug", 1)
        Traceback (most recent call last):
        ...
        TypeError: RecomputeBlock: `debug` must be a bool. Received: debug=1 (of type int). Pass \
debug=True or debug=False.
    """
    numpy_bool = type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")
    if not isinstance(value, bool) and not numpy_bool:
        fail(
            api,
            f"`{name}` must be a bool",
            name,
            value,
            fix or f"Pass {name}=True or {name}=False",
            error=TypeError,
        )
    return bool(value)
