"""Strategies by name: `get("optimal")`, `get("uniform:4")`, `available()`."""

from __future__ import annotations

from tfrecompute._messages import fail
from tfrecompute.strategies.basic import heuristic, none, sqrt, uniform
from tfrecompute.strategies.optimize import optimal
from tfrecompute.strategies.plan import Strategy

__all__ = ["available", "get"]

_REGISTRY: dict[str, Strategy] = {
    "heuristic": heuristic,
    "none": none,
    "optimal": optimal,
    "sqrt": sqrt,
}


def available() -> tuple[str, ...]:
    """Names `get` accepts as they are, sorted; `"uniform:<k>"` is accepted too.

    Example:
        >>> available()
        ('heuristic', 'none', 'optimal', 'sqrt')
    """
    return tuple(sorted(_REGISTRY))


def get(
    name_or_callable: str | Strategy, *, api: str = "get", argument: str = "name_or_callable"
) -> Strategy:
    """Looks up a strategy.

    Args:
        name_or_callable: a name from `available()`, `"uniform:<k>"` for
            `uniform(k)`, or a strategy callable, returned as it is.
        api, argument: the public call and its argument that errors name
            (`recompute(..., strategy=...)` looks a strategy up for the user).

    Returns:
        The strategy, a callable `(chain, budget=None) -> Plan`.

    Raises:
        ValueError: an unknown name or a bad `k` in `"uniform:<k>"`.
        TypeError: neither a string nor a callable.

    Example:
        >>> get("uniform:4").__name__
        'uniform:4'
        >>> get("optimal") is optimal
        True
    """
    if isinstance(name_or_callable, str):
        name = name_or_callable
        if name in _REGISTRY:
            return _REGISTRY[name]
        if name.startswith("uniform:"):
            digits = name[len("uniform:") :]
            if not digits.isdigit() or int(digits) < 1:
                fail(
                    api,
                    "the k of uniform:<k> must be a positive integer",
                    argument,
                    name,
                    'Write e.g. "uniform:4"',
                )
            return uniform(int(digits))
        valid = ", ".join(repr(x) for x in (*available(), "uniform:<k>"))
        fail(api, "unknown strategy name", argument, name, f"Use one of {valid}")
    if callable(name_or_callable):
        return name_or_callable
    fail(
        api,
        "expected a strategy name or a callable",
        argument,
        name_or_callable,
        'Pass a name such as "optimal" or a function (chain, budget=None) -> Plan',
        error=TypeError,
    )
