"""`none`, `uniform`, `sqrt`, `heuristic` and the registry (`get`, `available`)."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs
from planner_cases import chains, random_chain, wide_chain

from tfrecompute.errors import InfeasibleBudgetError
from tfrecompute.strategies import (
    Chain,
    Plan,
    available,
    basic,
    get,
    heuristic,
    min_peak,
    none,
    optimal,
    simulate,
    sqrt,
    uniform,
)


def test_none_stores_everything() -> None:
    chain = Chain.homogeneous(4, activation_bytes=100)
    plan = none(chain)
    assert plan.segments == () and plan.recompute_cost == 0.0 and plan.strategy == "none"
    assert plan.peak_bytes == simulate(chain, []).peak_bytes == 700
    assert none(chain, 700) == plan and none(chain, "1KiB") == plan


def test_fixed_strategies_raise_when_their_plan_exceeds_the_budget() -> None:
    chain = Chain.homogeneous(9, activation_bytes=100)  # none: 1200, sqrt: 800, least: 700
    with pytest.raises(
        InfeasibleBudgetError,
        match=(
            r"^none: the plan's predicted peak 1\.17 KiB \(1200 bytes\) exceeds the budget 900 B\. "
            r"Received: budget=900 \(of type int\)\. Raise the budget to at least 1\.17 KiB "
            r"\(1200 bytes\) for this strategy, or use the \"optimal\" strategy, which needs "
            r"700 B\.$"
        ),
    ) as info:
        none(chain, 900)
    assert (info.value.budget, info.value.minimum) == (900, 1200)
    with pytest.raises(
        InfeasibleBudgetError,
        match=(
            r"^sqrt: budget 600 B is below the least peak any plan reaches, 700 B\. Received: "
            r"budget='600B' \(of type str\)\. Raise the budget to at least 800 B for this "
            r"strategy, or use the \"optimal\" strategy, which needs 700 B, or reduce the "
            r"batch size\.$"
        ),
    ) as info:
        sqrt(chain, "600B")
    assert (info.value.budget, info.value.minimum) == (600, 800)
    with pytest.raises(InfeasibleBudgetError, match=r"^uniform:1: the plan's predicted peak"):
        uniform(1)(chain, 750)
    with pytest.raises(ValueError, match=r"^none: a float budget is a share of storing every"):
        none(chain, 1.5)
    with pytest.raises(TypeError, match=r"^none: a budget must be a number or a string"):
        none(chain, [1])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("n", "k", "segments"),
    [
        (7, 3, ((0, 3), (3, 6), (6, 7))),
        (6, 3, ((0, 3), (3, 6))),
        (4, 1, ((0, 1), (1, 2), (2, 3), (3, 4))),
        (4, 4, ((0, 4),)),
        (3, 10, ((0, 3),)),
        (1, 1, ((0, 1),)),
    ],
)
def test_uniform_segments(n: int, k: int, segments: tuple[tuple[int, int], ...]) -> None:
    chain = Chain.homogeneous(n, activation_bytes=8)
    plan = uniform(k)(chain)
    assert plan.segments == segments
    assert plan.strategy == f"uniform:{k}" and uniform(k).__name__ == f"uniform:{k}"
    assert plan.recompute_cost == float(n)
    assert plan == Plan.from_segments(chain, segments, strategy=f"uniform:{k}")


@pytest.mark.parametrize(
    ("k", "error", "match"),
    [
        (
            0,
            ValueError,
            r"^uniform: `k` must be at least 1\. Received: k=0 \(of type int\)\. "
            r"Pass an int >= 1, e\.g\. k=3\.$",
        ),
        (-2, ValueError, r"^uniform: `k` must be at least 1"),
        (2.0, TypeError, r"^uniform: `k` must be an int\. Received: k=2\.0 \(of type float\)"),
        (True, TypeError, r"^uniform: `k` must be an int\. Received: k=True \(of type bool\)"),
        ("3", TypeError, r"^uniform: `k` must be an int"),
    ],
)
def test_uniform_rejects_bad_k(k: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        uniform(k)  # type: ignore[arg-type]


def test_sqrt_segments() -> None:
    assert sqrt(Chain.homogeneous(9, activation_bytes=1)).segments == ((0, 3), (3, 6), (6, 9))
    assert sqrt(Chain.homogeneous(10, activation_bytes=1)).segments == ((0, 4), (4, 8), (8, 10))
    assert sqrt(Chain.homogeneous(1, activation_bytes=1)).segments == ((0, 1),)


@settings(deadline=None, max_examples=40)
@given(hs.integers(1, 300), hs.integers(1, 1 << 20))
def test_sqrt_homogeneous_bound(n: int, activation: int) -> None:
    """Within one activation of the best equal-segment plan.

    In the memory model a plan of m equal segments of k layers peaks at about
    (k + m + 2) activations: the held segment outputs, the recomputed segment and
    the gradients of one layer's output and input. So the bound reads
    `min_k (k + ceil(n / k)) + 2`, plus the one activation of slack.
    """
    chain = Chain.homogeneous(n, activation_bytes=activation)
    peak = sqrt(chain).peak_bytes
    best_count = min(k + math.ceil(n / k) for k in range(1, n + 1))
    assert peak <= (best_count + 2 + 1) * activation
    best_uniform = min(
        simulate(chain, uniform(k)(chain).segments).peak_bytes for k in range(1, n + 1)
    )
    assert peak <= best_uniform + activation


def test_fixed_strategies_use_the_model_with_carries_and_gradients() -> None:
    chain = wide_chain(random.Random(3), 30, skips=True)
    assert chain.carries and any(chain.kept_grad_bytes)
    for strategy in (none, sqrt, uniform(4), heuristic):
        plan = strategy(chain)
        assert (plan.peak_bytes, plan.recompute_cost) == simulate(chain, plan.segments)
        assert plan == Plan.from_segments(chain, plan.segments, strategy=plan.strategy)


def test_heuristic_closes_segments_where_they_hold_least() -> None:
    # Equal 8-byte layers; layer 2's output is carried to layer 6 (64 bytes). With a
    # threshold of 32 saved bytes the walk from layer 0 passes it at layer 4, and may
    # close at 1..4; ends 1..3 hold 8 bytes, end 4 holds 8 + C(0, 4) = 72.
    chain = Chain(8, [8] * 8, [8] * 8, [1.0] * 8, carries=[(2, 6, 64)])
    assert chain.carried_bytes(0, 4) == 64 and chain.carried_bytes(0, 3) == 0
    assert basic._greedy(chain, set(), 32)[0] == (0, 3)  # the latest end of least hold
    plain = Chain(8, [8] * 8, [8] * 8, [1.0] * 8)
    assert basic._greedy(plain, set(), 32)[0] == (0, 4)


def test_heuristic_without_budget_lowers_the_peak() -> None:
    chain = Chain.homogeneous(64, activation_bytes=1000)
    plan = heuristic(chain)
    assert plan.strategy == "heuristic" and not plan.proven_optimal
    assert plan.peak_bytes <= sqrt(chain).peak_bytes
    assert (plan.peak_bytes, plan.recompute_cost) == simulate(chain, plan.segments)


@settings(deadline=None, max_examples=30)
@given(chains(max_layers=30), hs.floats(0.0, 1.2))
def test_heuristic_fits_its_budget_or_raises(chain: Chain, share: float) -> None:
    low, high = min_peak(chain), none(chain).peak_bytes
    budget = max(1, int(low + share * (high - low)) - 1)
    try:
        plan = heuristic(chain, budget)
    except InfeasibleBudgetError as err:
        assert err.budget == budget and err.minimum > budget
        assert heuristic(chain, err.minimum).peak_bytes <= err.minimum
        return
    assert plan.peak_bytes <= budget
    assert (plan.peak_bytes, plan.recompute_cost) == simulate(chain, plan.segments)
    if budget >= high:
        assert plan.recompute_cost == 0.0 or min(chain.forward_cost) == 0.0


def test_heuristic_infeasible_message() -> None:
    chain = Chain.homogeneous(9, activation_bytes=100)
    with pytest.raises(
        InfeasibleBudgetError,
        match=(
            r"^heuristic: budget 100 B is below the least peak any plan reaches, 700 B\. "
            r"Received: budget=100 \(of type int\)\. Raise the budget to at least 800 B "
            r"for this strategy, or use the \"optimal\" strategy, which needs 700 B, or "
            r"reduce the batch size\.$"
        ),
    ) as info:
        heuristic(chain, 100)
    assert info.value.minimum == 800


@settings(deadline=None, max_examples=25)
@given(hs.integers(0, 10**6), hs.integers(2, 40))
def test_optimal_never_costs_more_than_the_others(seed: int, n: int) -> None:
    rng = random.Random(seed)
    chain = random_chain(rng, n) if seed % 2 else wide_chain(rng, n, skips=seed % 4 == 0)
    others = [heuristic(chain), sqrt(chain), none(chain), uniform(rng.randint(1, n))(chain)]
    low, high = min_peak(chain), none(chain).peak_bytes
    try:
        others.append(heuristic(chain, rng.randint(low, high)))
    except InfeasibleBudgetError:
        pass
    for plan in others:
        for budget in (plan.peak_bytes, plan.peak_bytes + rng.randint(0, high)):
            best = optimal(chain, budget)
            assert best.peak_bytes <= budget
            assert best.recompute_cost <= plan.recompute_cost + 1e-9 * chain.total_forward_cost


def test_registry() -> None:
    assert available() == ("heuristic", "none", "optimal", "sqrt")
    for name in available():
        assert get(name).__name__ == name
    assert get("uniform:4").__name__ == "uniform:4"
    chain = Chain.homogeneous(8, activation_bytes=2)
    assert get("uniform:4")(chain).segments == ((0, 4), (4, 8))

    def mine(chain: Chain, budget: int | str | None = None) -> Plan:
        return none(chain, budget)

    assert get(mine) is mine


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (
            "fastest",
            ValueError,
            r"^get: unknown strategy name\. Received: "
            r"name_or_callable='fastest' \(of type str\)\. Use one of 'heuristic', 'none', "
            r"'optimal', 'sqrt', 'uniform:<k>'\.$",
        ),
        ("uniform", ValueError, r"^get: unknown strategy name"),
        (
            "uniform:0",
            ValueError,
            r"^get: the k of uniform:<k> must be a positive integer\. "
            r"Received: name_or_callable='uniform:0' \(of type str\)\. Write e\.g\. \"uniform:4\"",
        ),
        ("uniform:x", ValueError, r"the k of uniform:<k> must be a positive integer"),
        ("uniform:-3", ValueError, r"the k of uniform:<k> must be a positive integer"),
        (
            3,
            TypeError,
            r"^get: expected a strategy name or a callable\. Received: "
            r"name_or_callable=3 \(of type int\)\. Pass a name such as \"optimal\"",
        ),
        (None, TypeError, r"expected a strategy name or a callable"),
    ],
)
def test_get_errors(value: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        get(value)  # type: ignore[arg-type]
