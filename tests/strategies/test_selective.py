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


def _with_policy(chain: Chain, rng: random.Random) -> Chain:
    """`chain` with random kept products (up to a link's saved bytes) and cheaper recomputes."""
    kept = [rng.choice([0, s // 2, s, s + 2]) for s in chain.saved_bytes]
    cost = [rng.choice([0.0, c / 2, c]) for c in chain.forward_cost]
    return dataclasses.replace(chain, policy_kept_bytes=kept, policy_forward_cost=cost)


def _three_state_table(chain: Chain) -> list[tuple[int, Fraction, tuple, tuple]]:
    """(peak, exact cost, segments, selective) of every three-state plan, via `simulate`."""
    table = []
    policy = [Fraction(c) for c in chain.policy_forward_cost]
    full = [Fraction(c) for c in chain.forward_cost]
    for segments in allowed_segment_sets(chain):
        for flags in itertools.product((False, True), repeat=len(segments)):
            peak, _ = estimate(chain, segments, flags if any(flags) else ())
            cost = sum(
                (policy if under else full)[j]
                for (s, e), under in zip(segments, flags)
                for j in range(s, e)
            )
            table.append((peak, Fraction(cost), segments, flags))
    return table


def _exact(plan: Plan) -> Fraction:
    chain = plan.chain
    flags = plan.selective or (False,) * len(plan.segments)
    return Fraction(
        sum(
            Fraction((chain.policy_forward_cost if under else chain.forward_cost)[j])
            for (s, e), under in zip(plan.segments, flags)
            for j in range(s, e)
        )
    )


@pytest.mark.parametrize("seed", range(40))
def test_optimal_and_frontier_equal_brute_force_over_three_states(seed):
    rng = random.Random(seed)
    chain = _with_policy(random_chain(rng, rng.randint(1, 6)), rng)
    table = _three_state_table(chain)
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


@pytest.mark.parametrize(
    ("selective", "error", "match"),
    [
        ("yes", TypeError, "selective must be a sequence of bools"),
        ([1], TypeError, "selective must hold bools only"),
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
