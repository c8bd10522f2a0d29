"""The third state of a link: recomputed under the policy. Model, exact solver, plans."""

from __future__ import annotations

import dataclasses
import itertools
import random
from fractions import Fraction

import pytest
from planner_cases import allowed_segment_sets, random_chain

from tfrecompute.strategies import Chain, Plan, frontier, min_peak, optimal, simulate, timeline
from tfrecompute.strategies.simulate import estimate


def _policy_state(chain: Chain, rng: random.Random) -> tuple[list[int], list[float]]:
    """Random kept products (up to a link's saved bytes) and cheaper recomputes."""
    kept = [rng.choice([0, s // 2, s, s + 2]) for s in chain.saved_bytes]
    cost = [rng.choice([0.0, c / 2, c]) for c in chain.forward_cost]
    return kept, cost


def _with_policies(chain: Chain, rng: random.Random, count: int) -> Chain:
    """`chain` with `count` random policy states."""
    (kept, cost), *more = [_policy_state(chain, rng) for _ in range(count)]
    return dataclasses.replace(
        chain, policy_kept_bytes=kept, policy_forward_cost=cost, more_policies=more
    )


def _state_table(chain: Chain) -> list[tuple[int, Fraction, tuple, tuple]]:
    """(peak, exact cost, segments, states) of every plan over every state, via `simulate`."""
    table = []
    costs = [
        [Fraction(c) for c in cost]
        for cost in (chain.forward_cost, *(cost for _, cost in chain.policy_states))
    ]
    for segments in allowed_segment_sets(chain):
        for states in itertools.product(range(len(costs)), repeat=len(segments)):
            peak, _ = estimate(chain, segments, states if any(states) else ())
            cost = sum(
                costs[state][j] for (s, e), state in zip(segments, states) for j in range(s, e)
            )
            table.append((peak, Fraction(cost), segments, states))
    return table


def _exact(plan: Plan) -> Fraction:
    chain = plan.chain
    costs = (chain.forward_cost, *(cost for _, cost in chain.policy_states))
    return Fraction(
        sum(
            Fraction(costs[plan.state(i)][j])
            for i, (s, e) in enumerate(plan.segments)
            for j in range(s, e)
        )
    )


@pytest.mark.parametrize(
    ("policies", "seed"), [(1, seed) for seed in range(40)] + [(2, seed) for seed in range(30)]
)
def test_optimal_and_frontier_equal_brute_force_over_every_state(policies, seed):
    """Three states (stored, whole, one policy) and four (a second policy, as "attention"
    beside "dots")."""
    rng = random.Random(seed)
    chain = _with_policies(
        random_chain(rng, rng.randint(1, 6 if policies == 1 else 5)), rng, policies
    )
    table = _state_table(chain)
    assert min_peak(chain) == min(row[0] for row in table)
    peaks = sorted({row[0] for row in table})
    for budget in {peaks[0], peaks[-1], *rng.sample(peaks, min(3, len(peaks)))}:
        fitting = [row for row in table if row[0] <= budget]
        best = min((cost, peak) for peak, cost, _, _ in fitting)
        plan = optimal(chain, budget)
        assert (_exact(plan), plan.peak_bytes) == best
        assert (plan.peak_bytes, plan.recompute_cost) == simulate(
            chain, plan.segments, selective=plan.selective or None
        )
    least = optimal(chain)
    assert (least.peak_bytes, _exact(least)) == min((p, c) for p, c, _, _ in table)
    points = {(p, c) for p, c, _, _ in table}
    want = sorted(
        (p, c)
        for p, c in points
        if not any(q <= p and d <= c and (q, d) != (p, c) for q, d in points)
    )
    assert [(p.peak_bytes, _exact(p)) for p in frontier(chain)] == want


def test_a_selective_segment_keeps_its_products_and_recomputes_cheaper():
    chain = Chain(
        10,
        [10] * 4,
        [30] * 4,
        [4.0] * 4,
        policy_kept_bytes=[5] * 4,
        policy_forward_cost=[1.0] * 4,
    )
    whole = simulate(chain, [(0, 4)])
    under = simulate(chain, [(0, 4)], selective=[True])
    assert under.recompute_cost == 4.0 and whole.recompute_cost == 16.0
    # The forward holds the four products until the segment's backward.
    forward = [e.live_bytes for e in timeline(chain, [(0, 4)], selective=[True])][:4]
    plain = [e.live_bytes for e in timeline(chain, [(0, 4)])][:4]
    assert [f - p for f, p in zip(forward, plain)] == [5, 10, 15, 20]
    assert under.peak_bytes >= whole.peak_bytes


def test_the_planner_uses_the_policy_where_it_fits_the_budget():
    """Large saved activations, small kept products: the policy beats recomputing whole."""
    chain = Chain(
        10,
        [10] * 8,
        [100] * 8,
        [4.0] * 8,
        policy_kept_bytes=[10] * 8,
        policy_forward_cost=[1.0] * 8,
    )
    two_state = dataclasses.replace(chain, policy_kept_bytes=None, policy_forward_cost=None)
    selective = [p for p in frontier(chain) if any(p.selective)]
    assert selective
    for plan in selective:
        chosen = optimal(chain, plan.peak_bytes)
        assert any(chosen.selective)
        assert chosen.recompute_cost < optimal(two_state, plan.peak_bytes).recompute_cost
    assert "selective" in selective[0].summary()


def test_a_two_state_chain_plans_as_before():
    chain = Chain.homogeneous(8, activation_bytes=1024)
    plan = optimal(chain, "8KiB")
    assert plan.segments == ((1, 5),) and plan.selective == ()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"policy_kept_bytes": [1, 1]}, ValueError, "policy_kept_bytes is given without"),
        ({"policy_forward_cost": [1.0, 1.0]}, ValueError, "policy_forward_cost is given without"),
    ],
)
def test_the_third_state_needs_both_fields(kwargs, error, match):
    with pytest.raises(error, match=match):
        Chain(1, [1, 1], [1, 1], [1.0, 1.0], **kwargs)


_FIRST = {"policy_kept_bytes": [1, 1], "policy_forward_cost": [0.5, 0.5]}


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"more_policies": [([1, 1], [0.5, 0.5])]}, ValueError, "given without policy_kept"),
        ({**_FIRST, "more_policies": [([1, 1],)]}, ValueError, r"more_policies\[0\] must be a"),
        ({**_FIRST, "more_policies": [([1], [0.5])]}, ValueError, "has 1 entries but the chain"),
        ({**_FIRST, "more_policies": [([-1, 1], [0.5, 0.5])]}, ValueError, "negative"),
        ({**_FIRST, "policy_names": ["a", "b"]}, ValueError, r"one string per policy state \(1"),
        ({"policy_names": ["a"]}, ValueError, r"one string per policy state \(0"),
    ],
)
def test_more_policy_states_are_checked(kwargs, error, match):
    with pytest.raises(error, match=match) as info:
        Chain(1, [1, 1], [1, 1], [1.0, 1.0], **kwargs)
    assert str(info.value).startswith("Chain: ")


def test_each_segment_uses_its_own_states_products_and_costs():
    chain = Chain(
        10,
        [10] * 2,
        [30] * 2,
        [4.0] * 2,
        policy_kept_bytes=[5, 5],
        policy_forward_cost=[1.0, 1.0],
        more_policies=[([20, 20], [0.5, 0.5])],
        policy_names=["attention", "dots"],
    )
    plan = Plan.from_segments(chain, [(0, 1), (1, 2)], selective=[2, 1])
    assert plan.recompute_cost == 1.5 and plan.selective == (2, 1)
    forward = [e.live_bytes for e in plan.timeline()][:2]
    plain = [e.live_bytes for e in timeline(chain, [(0, 1), (1, 2)])][:2]
    assert [f - p for f, p in zip(forward, plain)] == [20, 25]
    summary = plan.summary()
    assert "selective (dots)" in summary and "selective (attention)" in summary


@pytest.mark.parametrize(
    ("selective", "error", "match"),
    [
        ("yes", TypeError, "selective must be a sequence of bools"),
        ([1.0], TypeError, "selective must hold bools or ints only"),
        ([2], ValueError, r"selective names a policy state outside 0\.\.1"),
        ([True, False], ValueError, "selective has 2 entries for 1 segments"),
    ],
)
def test_malformed_selective_flags_are_rejected(selective, error, match):
    chain = Chain(
        1, [1, 1], [1, 1], [1.0, 1.0], policy_kept_bytes=[1, 1], policy_forward_cost=[0.5, 0.5]
    )
    with pytest.raises(error, match=match):
        simulate(chain, [(0, 2)], selective=selective)


def test_selective_flags_need_a_chain_with_policy_costs():
    with pytest.raises(ValueError, match="the chain has no policy costs"):
        simulate(Chain.homogeneous(2, activation_bytes=1), [(0, 2)], selective=[True])
