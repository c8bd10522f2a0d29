"""`frontier`: the Pareto set of (peak, cost), against brute force."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from planner_cases import brute_force, chains, exact_cost, pareto, random_chain, wide_chain

from tfrecompute.strategies import Chain, Plan, frontier, min_peak, none, optimal, simulate


def _check_points(chain: Chain, plans: list[Plan]) -> None:
    """Every point is a real plan; sorted by peak; no point dominates another."""
    assert plans
    for plan in plans:
        assert (plan.peak_bytes, plan.recompute_cost) == simulate(chain, plan.segments)
    points = [(p.peak_bytes, exact_cost(chain, p.segments)) for p in plans]
    assert all(a[0] < b[0] and a[1] > b[1] for a, b in zip(points, points[1:]))
    assert plans[0].peak_bytes == min_peak(chain)


@settings(deadline=None, max_examples=40)
@given(chains(max_layers=8))
def test_equals_the_brute_force_pareto_set(chain: Chain) -> None:
    table = brute_force(chain)
    plans = frontier(chain)
    _check_points(chain, plans)
    assert [(p.peak_bytes, exact_cost(chain, p.segments)) for p in plans] == pareto(table)
    for plan in plans:  # of equal peak and cost, the fewest segments
        assert len(plan.segments) == min(
            count
            for peak, cost, count, _ in table
            if (peak, cost) == (plan.peak_bytes, exact_cost(chain, plan.segments))
        )
        assert plan.proven_optimal and plan.strategy == "optimal"


def test_twelve_layers() -> None:
    chain = random_chain(random.Random(21), 12)
    assert [(p.peak_bytes, exact_cost(chain, p.segments)) for p in frontier(chain)] == pareto(
        brute_force(chain)
    )


@pytest.mark.parametrize("skips", [False, True])
def test_endpoints_match_optimal_and_none(skips: bool) -> None:
    chain = wide_chain(random.Random(4), 40, skips=skips)  # positive costs
    plans = frontier(chain)
    _check_points(chain, plans)
    assert plans[-1].segments == () and plans[-1].peak_bytes == none(chain).peak_bytes
    assert (plans[0].peak_bytes, plans[0].recompute_cost) == (
        optimal(chain).peak_bytes,
        optimal(chain).recompute_cost,
    )
    for plan in plans[:: max(1, len(plans) // 10)]:  # each point is optimal for its budget
        assert optimal(chain, plan.peak_bytes).recompute_cost == plan.recompute_cost


def test_bounded_frontier_is_made_of_real_non_dominated_plans() -> None:
    chain = wide_chain(random.Random(8), 60)
    plans = frontier(chain, max_work=50_000)
    _check_points(chain, plans)
    assert not any(p.proven_optimal for p in plans)
    exact = frontier(chain, max_work=None)
    assert all(p.proven_optimal for p in exact) and len(exact) >= len(plans)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"chain": 3},
            TypeError,
            r"^frontier: chain must be a Chain\. Received: chain=3 "
            r"\(of type int\)",
        ),
        ({"max_work": -1}, ValueError, r"^frontier: max_work must be positive"),
        ({"max_work": "1"}, TypeError, r"^frontier: max_work must be an int or None"),
    ],
)
def test_errors(kwargs: dict[str, object], error: type[Exception], match: str) -> None:
    arguments: dict[str, object] = {"chain": Chain.homogeneous(2, activation_bytes=1)}
    arguments.update(kwargs)
    with pytest.raises(error, match=match):
        frontier(arguments.pop("chain"), **arguments)  # type: ignore[arg-type]
