"""Basic strategies: store everything, fixed-size segments, sqrt, Chen's greedy.

Each strategy is a plain function `(chain, budget=None) -> Plan`. `none`,
`uniform(k)` and `sqrt` ignore the budget when planning; when one is given and
their plan's peak exceeds it, they raise `InfeasibleBudgetError` (whose
`minimum` is their own peak) rather than return a plan that does not fit.
Every strategy here cuts its segments to what `Chain.max_stop` allows.
"""

from __future__ import annotations

import math

from tfrecompute._messages import as_positive_int
from tfrecompute.strategies import _solver
from tfrecompute.strategies.chain import Chain
from tfrecompute.strategies.plan import Budget, Plan, Strategy, chain_budget, infeasible
from tfrecompute.strategies.simulate import carry_profile, check_chain, estimate, within_limits

__all__ = ["heuristic", "none", "sqrt", "uniform"]


def none(chain: Chain, budget: Budget | None = None) -> Plan:
    """Stores every link: no recompute, the highest peak.

    Args:
        chain: the cost model.
        budget: optional; raises if the plan's peak exceeds it.

    Returns:
        The plan without segments.

    Raises:
        InfeasibleBudgetError: the peak exceeds the budget.

    Example:
        >>> none(Chain.homogeneous(4, activation_bytes=100)).peak_bytes
        700
    """
    return _fixed_plan("none", chain, (), budget)


def uniform(k: int) -> Strategy:
    """A strategy recomputing every link in segments of `k` links.

    The last segment holds the remaining `n % k` links when `k` does not divide
    `n`; `k >= n` gives a single segment.

    Args:
        k: links per segment, at least 1.

    Returns:
        A strategy `(chain, budget=None) -> Plan` named `"uniform:<k>"`.

    Raises:
        TypeError, ValueError: `k` is not an int >= 1.

    Example:
        >>> uniform(3)(Chain.homogeneous(7, activation_bytes=1)).segments
        ((0, 3), (3, 6), (6, 7))
    """
    size = as_positive_int("uniform", "k", k)
    name = f"uniform:{size}"

    def strategy(chain: Chain, budget: Budget | None = None) -> Plan:
        check_chain(name, chain)
        return _fixed_plan(name, chain, _uniform_segments(chain.n, size), budget)

    strategy.__name__ = strategy.__qualname__ = name
    strategy.__doc__ = f"Recomputes every link in segments of {size} links."
    return strategy


def sqrt(chain: Chain, budget: Budget | None = None) -> Plan:
    """Recomputes everything in segments of `ceil(sqrt(n))` links (Chen et al. 2016).

    On a chain of equal links this reaches within about one activation of
    the best peak of any equal-segment plan, for one extra forward pass.

    Args:
        chain: the cost model.
        budget: optional; raises if the plan's peak exceeds it.

    Returns:
        The plan, with `strategy="sqrt"`.

    Raises:
        InfeasibleBudgetError: the peak exceeds the budget.

    Example:
        >>> sqrt(Chain.homogeneous(9, activation_bytes=1)).segments
        ((0, 3), (3, 6), (6, 9))
    """
    check_chain("sqrt", chain)
    size = math.isqrt(chain.n - 1) + 1
    return _fixed_plan("sqrt", chain, _uniform_segments(chain.n, size), budget)


_THRESHOLDS = 32
_STORED_SHARES = (0.0, 0.1, 0.25)


def heuristic(chain: Chain, budget: Budget | None = None) -> Plan:
    """Chen's greedy segmentation, searched over its threshold.

    For a threshold `t`, walk the chain and grow a segment until the bytes its
    recompute keeps alive (the sum of `saved_bytes`) would pass `t`; then close
    it where it holds the least (its output plus the carries it hands on), so
    that the held outputs are small.
    To prefer recomputing cheap links, the links with the highest forward cost
    per saved byte (none, the top 10% or the top 25%) stay stored. Thresholds
    run over 32 values from the smallest link to the whole chain; the plan that
    stores everything is a candidate too.

    Args:
        chain: the cost model.
        budget: None: the candidate with the least peak (ties: least cost).
            Otherwise: the cheapest candidate whose peak fits (ties: least peak).

    Returns:
        The plan, with `strategy="heuristic"`.

    Raises:
        InfeasibleBudgetError: no candidate fits the budget; `minimum` is the
            least candidate peak.

    Example:
        >>> chain = Chain.homogeneous(16, activation_bytes=1)
        >>> heuristic(chain, 12).peak_bytes <= 12
        True
    """
    check_chain("heuristic", chain)
    limit = None if budget is None else chain_budget("heuristic", chain, budget)
    n = chain.n
    saved = chain.saved_bytes
    ratio = [cost / max(kept, 1) for cost, kept in zip(chain.forward_cost, saved)]
    by_ratio = sorted(range(n), key=lambda i: (-ratio[i], i))
    low = max(min(saved), 1)
    high = max(sum(saved), low)
    thresholds = sorted(
        {round(low * (high / low) ** (i / (_THRESHOLDS - 1))) for i in range(_THRESHOLDS)}
    )
    candidates: set[tuple[tuple[int, int], ...]] = {()}
    for share in _STORED_SHARES:
        stored = set(by_ratio[: int(share * n)])
        for threshold in thresholds:
            candidates.add(within_limits(chain, _greedy(chain, stored, threshold)))
    scored = []
    for segments in candidates:
        peak, cost = estimate(chain, segments)
        scored.append((peak, cost, segments))
    if limit is None:
        peak, cost, segments = min(scored, key=lambda x: (x[0], x[1], len(x[2]), x[2]))
    else:
        fitting = [x for x in scored if x[0] <= limit]
        if not fitting:
            own = min(x[0] for x in scored)
            raise infeasible("heuristic", budget, limit, own=own, least=_least_peak(chain))
        peak, cost, segments = min(fitting, key=lambda x: (x[1], x[0], len(x[2]), x[2]))
    return Plan(segments, peak_bytes=peak, recompute_cost=cost, strategy="heuristic", chain=chain)


def _greedy(chain: Chain, stored: set[int], threshold: int) -> tuple[tuple[int, int], ...]:
    """Chen's walk for one threshold; see `heuristic`."""
    n = chain.n
    saved = chain.saved_bytes
    act = (chain.input_bytes, *chain.output_bytes)
    no_carries = [0] * (n + 1)
    segments: list[tuple[int, int]] = []
    start: int | None = None
    kept = 0
    i = 0
    while i < n:
        if i in stored:
            if start is not None:
                segments.append((start, i))
                start = None
            i += 1
            continue
        if start is None:
            start, kept = i, 0
        kept += saved[i]
        if kept > threshold and i > start:
            # Close where the segment holds least, among the possible ends start+1..i.
            first = start
            carried = carry_profile(chain, first, i + 1) if chain.carries else no_carries
            end = min(range(first + 1, i + 1), key=lambda e: (act[e] + carried[e - first], -e))
            segments.append((start, end))
            start = None
            i = end
            continue
        i += 1
    if start is not None:
        segments.append((start, n))
    return tuple(segments)


def _uniform_segments(n: int, size: int) -> tuple[tuple[int, int], ...]:
    return tuple((s, min(s + size, n)) for s in range(0, n, size))


def _fixed_plan(
    api: str, chain: Chain, segments: tuple[tuple[int, int], ...], budget: Budget | None
) -> Plan:
    check_chain(api, chain)
    segments = within_limits(chain, segments)
    peak, cost = estimate(chain, segments)
    if budget is not None:
        limit = chain_budget(api, chain, budget)
        if peak > limit:
            raise infeasible(api, budget, limit, own=peak, least=_least_peak(chain))
    return Plan(segments, peak_bytes=peak, recompute_cost=cost, strategy=api, chain=chain)


def _least_peak(chain: Chain) -> int:
    """The least peak any plan reaches, for the error of a budget a fixed plan misses."""
    return _solver.least_peak(_solver.Problem.from_chain(chain))
