"""The optimal single-level plan under a memory budget, the Pareto frontier, the least peak.

The search is exact: among all sets of segments it finds the least recompute
cost whose simulated peak fits the budget (ties: lower peak, then fewer
segments). It works on exact integers (bytes as they are, costs as the exact
binary values of their floats), with one documented exception: on chains of
more than 64 links whose exact costs would overflow 64-bit arithmetic (costs
in seconds, say), costs are rounded to a grid finer than about 2^-30 of the total
cost. See `_solver.py` for the algorithm.

Heterogeneous chains can have very many Pareto-optimal partial plans (the
problem contains knapsack). `max_work` bounds the candidate labels examined:
once it is spent, `optimal` returns the best plan found by passes that keep a
bounded number of labels per position. Such a plan always fits the budget (memory
is checked exactly); only its cost may exceed the optimum, and `Plan.proven_optimal`
is False. Chains of up to 16 links are always solved exactly.

On a chain with a third state (`Chain.policy_kept_bytes`: a segment may be
recomputed under the recompute policy) `optimal` and `frontier` search the
three-state plans exactly (`_selective.py`, without a work bound); the plan's
`selective` flags mark the segments recomputed under the policy. With several
policy states (`Chain.more_policies`) the search covers them all and
`selective` gives each segment's state. The least peak is the two-state one: a
selective segment never peaks below the same segment recomputed whole.
"""

from __future__ import annotations

import logging
import numbers

from tfrecompute._messages import fail
from tfrecompute.strategies import _selective, _solver
from tfrecompute.strategies.basic import sqrt
from tfrecompute.strategies.chain import Chain
from tfrecompute.strategies.plan import Budget, Plan, chain_budget, infeasible
from tfrecompute.strategies.simulate import check_chain, estimate

__all__ = [
    "DEFAULT_MAX_WORK",
    "REPLAYED_AT_MOST",
    "REPLAYED_WITHIN",
    "frontier",
    "least_replayed",
    "min_peak",
    "optimal",
]

_logger = logging.getLogger(__name__)

DEFAULT_MAX_WORK = 36_000_000
"""Default bound on candidate labels examined by `optimal` and `frontier` (about 1 s)."""


def min_peak(chain: Chain) -> int:
    """The least peak memory any single-level plan reaches.

    Args:
        chain: the cost model.

    Returns:
        The least `simulate(chain, segments).peak_bytes` over all segment sets.

    Example:
        >>> min_peak(Chain.homogeneous(9, activation_bytes=100))
        700
    """
    check_chain("min_peak", chain)
    return _solver.least_peak(_solver.Problem.from_chain(chain))


def optimal(
    chain: Chain, budget: Budget | None = None, *, max_work: int | None = DEFAULT_MAX_WORK
) -> Plan:
    """The least-cost plan whose predicted peak fits the budget.

    Args:
        chain: the cost model.
        budget: the largest allowed peak, bytes or a string like `"512MiB"`.
            None: the plan with the least peak (ties: least cost).
        max_work: bound on the candidate labels the exact search examines
            (about 30 million per second); past it, the best plan found so far
            is returned with `proven_optimal=False`. None: search until exact,
            which can take long on large heterogeneous chains.

    Returns:
        The plan, with `strategy="optimal"`.

    Raises:
        InfeasibleBudgetError: the budget is below `min_peak(chain)`.
        TypeError, ValueError: a malformed budget or `max_work`.

    Example:
        >>> chain = Chain.homogeneous(8, activation_bytes=1024)
        >>> plan = optimal(chain, "8KiB")
        >>> plan.segments, plan.peak_bytes, plan.recompute_cost
        (((1, 5),), 8192, 4.0)
    """
    check_chain("optimal", chain)
    _check_max_work("optimal", max_work)
    pb = _solver.Problem.from_chain(chain)
    least = _solver.least_peak(pb)
    if budget is None:
        limit = least
    else:
        limit = chain_budget("optimal", chain, budget)
        if limit < least:
            raise infeasible("optimal", budget, limit, own=least, least=least)
    if chain.has_policy:
        return _three_state(chain, limit, least=budget is None)
    solution = _solver.solve_budget(pb, limit, max_work=max_work)
    if solution is None:  # pragma: no cover - min_peak guarantees a plan fits
        raise RuntimeError("optimal: no plan found although the budget is feasible")
    peak, cost = estimate(chain, solution.segments)
    if not solution.exact:
        _logger.info(
            "optimal: stopped at max_work=%d before proving optimality; the plan fits the "
            "budget but may cost more than the optimum (pass max_work=None for an exact search)",
            max_work,
        )
    return Plan(
        solution.segments,
        peak_bytes=peak,
        recompute_cost=cost,
        strategy="optimal",
        chain=chain,
        proven_optimal=solution.exact,
    )


def frontier(chain: Chain, *, max_work: int | None = DEFAULT_MAX_WORK) -> list[Plan]:
    """The Pareto set of (peak, recompute cost) over all single-level plans.

    Args:
        chain: the cost model.
        max_work: bound on the candidate labels of the exact search. Past it, the
            frontier of a search keeping a bounded number of labels per position
            is returned: every point is a real plan and no point dominates another,
            but points may be missing or beaten by unlisted plans, and each plan
            has `proven_optimal=False`. None: always exact.

    Returns:
        Plans sorted by peak ascending (so cost descending): the first has the
        least peak, the last costs least (the plan that stores everything, unless
        free links exist). Of plans with equal peak and cost, the one with the
        fewest segments.

    Example:
        >>> [(p.peak_bytes, p.recompute_cost) for p in frontier(Chain.homogeneous(
        ...     3, activation_bytes=10))]
        [(50, 2.0), (60, 0.0)]
    """
    check_chain("frontier", chain)
    _check_max_work("frontier", max_work)
    if chain.has_policy:
        return [_plan_of(chain, label) for label in _selective.solve(chain)]
    pb = _solver.Problem.from_chain(chain)
    found, exact = _solver.solve_frontier(pb, max_work=max_work)
    return [
        Plan(
            segments,
            peak_bytes=peak,
            recompute_cost=_solver.fsum_cost(chain, segments),
            strategy="optimal",
            chain=chain,
            proven_optimal=exact,
        )
        for segments, peak in found
    ]


REPLAYED_WITHIN = 1.1
"""`least_replayed` replays the frontier's plans predicted within this factor of the least
peak, at most `REPLAYED_AT_MOST` of them (those of the lowest predicted peaks)."""

REPLAYED_AT_MOST = 64
"""The most frontier plans `least_replayed` replays."""


def least_replayed(chain: Chain, least: Plan) -> Plan:
    """NOTE [ The least peak of a calibrated chain ]

    A calibrated chain's plans can be replayed from its measured step
    through a simulation of TensorFlow's allocator (`Plan.replayed_peak_bytes`,
    NOTE [ Replaying a plan through the allocator ] in
    `tfrecompute/check/replay.py`), which follows what the chain's byte
    counts do not: where the allocator finds room for the buffers a plan
    frees and allocates again, and the copies the optimizer makes. The
    plan the chain predicts at the least peak can replay above plans it
    predicts a little higher, and above `sqrt`. Without a budget
    (`plan_within`, so `plan`, `recompute` and the command line with the
    default strategy or `optimal`), a calibrated chain's plan is therefore,
    of the frontier's plans predicted within `REPLAYED_WITHIN` of the least
    peak (the `REPLAYED_AT_MOST` lowest), `least` itself and the `sqrt`
    plan, the one whose replayed peak is least (ties: the least recompute
    cost, then the first found). The bound keeps the choice near what the
    chain predicts: a replay follows one measured order of the step's ops,
    and the more replays the choice takes the least of, the more it favours
    a replay that came out low. A
    chain that cannot be replayed (not calibrated; policy states, whose
    plans are not replayed) keeps `least`.

    Args:
        chain: the chain `least` was planned on.
        least: `optimal(chain)`, the plan of the least predicted peak.

    Returns:
        The plan of the least replayed peak, or `least`.
    """
    own = least.replayed_peak_bytes
    if own is None:
        return least
    bound = least.peak_bytes * REPLAYED_WITHIN
    near = [p for p in frontier(chain) if p.peak_bytes <= bound][:REPLAYED_AT_MOST]
    candidates = [least, *near, sqrt(chain)]
    scored = [(own, least.recompute_cost, 0)] + [
        (replayed, plan.recompute_cost, k)
        for k, plan in enumerate(candidates[1:], start=1)
        if (replayed := plan.replayed_peak_bytes) is not None
    ]
    return candidates[min(scored)[2]]


def _three_state(chain: Chain, limit: int, *, least: bool) -> Plan:
    """`optimal` with policy states: the cheapest plan within `limit` (least peak if `least`)."""
    base = chain.overhead_bytes + chain.input_bytes
    labels = _selective.solve(chain, limit - base)
    # Sorted by headroom ascending, cost strictly descending.
    return _plan_of(chain, labels[0] if least else labels[-1])


def _plan_of(chain: Chain, label: _selective.Label) -> Plan:
    segments, selective = label.plan()
    peak, cost = estimate(chain, segments, selective if any(selective) else ())
    return Plan(
        segments,
        peak_bytes=peak,
        recompute_cost=cost,
        strategy="optimal",
        chain=chain,
        proven_optimal=True,
        selective=selective,
    )


def _check_max_work(api: str, max_work: object) -> None:
    if max_work is None:
        return
    if isinstance(max_work, bool) or not isinstance(max_work, numbers.Integral):
        fail(
            api,
            "max_work must be an int or None",
            "max_work",
            max_work,
            "Pass a positive int, or None for an exact search",
            error=TypeError,
        )
    if max_work < 1:
        fail(
            api,
            "max_work must be positive",
            "max_work",
            max_work,
            "Pass a positive int, or None for an exact search",
        )
