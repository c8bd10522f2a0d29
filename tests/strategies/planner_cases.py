"""Shared test helpers for the planner: random chains and a brute-force oracle."""

from __future__ import annotations

import random
from collections.abc import Iterator
from fractions import Fraction

from hypothesis import strategies as hs

from tfrecompute.strategies import Chain
from tfrecompute.strategies.simulate import estimate

Segments = tuple[tuple[int, int], ...]

# Costs drawn from values with and without exact binary forms (0.1, 0.3): the
# optimum is compared on exact fractions, so both must work.
COSTS = [0.0, 0.1, 0.25, 0.3, 0.5, 1.0, 1.5, 2.0, 3.0, 7.0]


def all_segment_sets(n: int) -> Iterator[Segments]:
    """Every single-level plan of an n-layer chain (F(2n+1) of them)."""

    def rec(s: int) -> Iterator[Segments]:
        if s == n:
            yield ()
            return
        yield from rec(s + 1)  # layer s stored
        for e in range(s + 1, n + 1):
            for rest in rec(e):
                yield ((s, e), *rest)

    return rec(0)


def allowed_segment_sets(chain: Chain) -> list[Segments]:
    """Every plan of `chain` that its `max_stop` allows."""
    return [p for p in all_segment_sets(chain.n) if all(chain.allowed(s, e) for s, e in p)]


def _units(chain: Chain) -> tuple[list[int], int]:
    """Costs as integers over a common denominator (floats are dyadic rationals)."""
    fractions = [Fraction(c) for c in chain.forward_cost]
    denominator = max(f.denominator for f in fractions)
    return [int(f * denominator) for f in fractions], denominator


def exact_cost(chain: Chain, segments: Segments) -> Fraction:
    """The exact (unrounded) recompute cost of a plan."""
    units, denominator = _units(chain)
    return Fraction(sum(units[j] for s, e in segments for j in range(s, e)), denominator)


def brute_force(chain: Chain) -> list[tuple[int, Fraction, int, Segments]]:
    """(peak, exact cost, number of segments, segments) of every allowed plan, via `simulate`."""
    units, denominator = _units(chain)
    table = []
    for segments in allowed_segment_sets(chain):
        peak, _ = estimate(chain, segments)
        cost = Fraction(sum(units[j] for s, e in segments for j in range(s, e)), denominator)
        table.append((peak, cost, len(segments), segments))
    return table


def pareto(table: list[tuple[int, Fraction, int, Segments]]) -> list[tuple[int, Fraction]]:
    points = {(peak, cost) for peak, cost, _, _ in table}
    return sorted(
        (p, c)
        for p, c in points
        if not any(q <= p and d <= c and (q, d) != (p, c) for q, d in points)
    )


def random_carries(rng: random.Random, n: int, sizes: list[int]) -> list[tuple[int, int, int]]:
    """Up to n // 2 skip connections, each carrying bytes drawn from `sizes`."""
    if n < 2:
        return []
    carries = []
    for _ in range(rng.randint(0, n // 2)):
        producer = rng.randrange(0, n - 1)
        carries.append((producer, rng.randint(producer + 2, n), rng.choice(sizes)))
    return carries


def limits(kinds: list[int], cuts: list[bool]) -> list[int]:
    """`Chain.max_stop` from per-link kinds: 0 free, 1 one link at a time, 2 never recomputed.

    Free links form regions that end at a cut (or at a link of another kind),
    like the calls of one Functional graph between a subclassed layer's calls.
    """
    n = len(kinds)
    stops = [n] * n
    end = n
    for s in range(n - 1, -1, -1):
        if kinds[s] == 2:
            stops[s], end = s, s
        elif kinds[s] == 1:
            stops[s], end = s + 1, s
        else:
            if cuts[s]:
                end = s + 1
            stops[s] = end
    return stops


def random_limits(rng: random.Random, n: int) -> list[int] | None:
    """No limits half of the time, else random regions, singletons and fixed links."""
    if rng.random() < 0.5:
        return None
    kinds = [rng.choice([0, 0, 0, 1, 2]) for _ in range(n)]
    return limits(kinds, [rng.random() < 0.2 for _ in range(n)])


def random_chain(rng: random.Random, n: int, *, scale: int = 1) -> Chain:
    """A heterogeneous chain with small integer sizes (many ties) and mixed costs.

    It has random carries (some larger than their producer's saved bytes),
    carry gradients and parameter gradients (kept and applied).
    """
    outputs = [rng.choice([0, 1, 2, 3, 5, 8, 13]) * scale for _ in range(n)]
    saved = [o + rng.choice([0, 0, 1, 4, 9]) * scale for o in outputs]
    workspace = [rng.choice([0, 0, 2, 6]) * scale for _ in range(n)]
    first = rng.choice([0, 1, 4, 10]) * scale
    activations = [first, *outputs[:-1]]
    return Chain(
        first,
        outputs,
        saved,
        [rng.choice(COSTS) for _ in range(n)],
        workspace_bytes=workspace,
        overhead_bytes=rng.choice([0, 3]) * scale,
        carries=random_carries(rng, n, [s * scale for s in (0, 1, 3, 8, 20, 40)]),
        kept_grad_bytes=[rng.choice([0, 0, 1, 3]) * scale for _ in range(n)],
        carry_grads=random_carries(rng, n, [s * scale for s in (0, 2, 5, 12)]),
        input_grad_bytes=[rng.choice([a, a, a // 2, 0]) for a in activations],
        applied_grad_bytes=[rng.choice([0, 0, 2, 5]) * scale for _ in range(n)],
        input_copy_bytes=[rng.choice([a, 0]) for a in activations],
        update_workspace_bytes=rng.choice([0, 0, 4, 30]) * scale,
        max_stop=random_limits(rng, n),
        applied_workspace_bytes=rng.choice([0, 0, 3, 20]) * scale,
    )


def wide_chain(rng: random.Random, n: int, *, skips: bool = False) -> Chain:
    """A heterogeneous chain with realistic byte ranges and distinct float costs.

    With `skips`: residual-like carries (each a producer's output, carried 2 to 4
    layers), their gradients and parameter gradients.
    """
    outputs = [rng.randrange(1 << 16, 1 << 22) for _ in range(n)]
    carries = []
    if skips:
        for i in range(0, n - 2, 3):
            carries.append((i, min(n, i + rng.randint(2, 4)), outputs[i]))
    first = rng.randrange(1 << 16, 1 << 22)
    return Chain(
        first,
        outputs,
        [o + rng.randrange(0, 2 * o) for o in outputs],
        [rng.uniform(0.1, 10.0) for _ in range(n)],
        workspace_bytes=[rng.randrange(0, o) if rng.random() < 0.5 else 0 for o in outputs],
        carries=carries,
        kept_grad_bytes=[rng.randrange(0, 1 << 20) for _ in range(n)] if skips else None,
        carry_grads=carries,
        applied_grad_bytes=None if skips else [rng.randrange(0, 1 << 21) for _ in range(n)],
        input_copy_bytes=[first, *outputs[:-1]] if skips else None,
        update_workspace_bytes=rng.randrange(0, 1 << 22) if skips else 0,
    )


@hs.composite
def chains(draw: hs.DrawFn, *, max_layers: int = 8, min_layers: int = 1) -> Chain:
    """Hypothesis strategy: heterogeneous chains with small sizes and mixed costs.

    Up to four random carries (some larger than their producer's saved bytes),
    random gradients for some of them, and random parameter gradients (kept
    and applied).
    """
    n = draw(hs.integers(min_layers, max_layers))
    outputs = draw(hs.lists(hs.integers(0, 20), min_size=n, max_size=n))
    extra = draw(hs.lists(hs.sampled_from([0, 0, 1, 3, 10]), min_size=n, max_size=n))
    workspace = draw(hs.lists(hs.sampled_from([0, 0, 0, 2, 7]), min_size=n, max_size=n))
    costs = draw(hs.lists(hs.sampled_from(COSTS), min_size=n, max_size=n))
    grads = draw(hs.lists(hs.sampled_from([0, 0, 1, 4, 15]), min_size=n, max_size=n))
    updates = draw(hs.lists(hs.sampled_from([0, 0, 3, 9]), min_size=n, max_size=n))
    carries, carry_grads = [], []
    if n >= 2:
        for _ in range(draw(hs.integers(0, min(4, n)))):
            producer = draw(hs.integers(0, n - 2))
            consumer = draw(hs.integers(producer + 2, n))
            # Small carries fit in their producer's saved bytes; large ones do not
            # (then a segment's forward moments can set the peak).
            size = draw(hs.sampled_from([0, 2, 5, 12, 40, 100]))
            carries.append((producer, consumer, size))
            carry_grads.append((producer, consumer, draw(hs.sampled_from([0, 2, 12]))))
    first = draw(hs.integers(0, 20))
    # The input gradient of some layers is part of their input (the rest is a
    # carry's gradient) or nothing (integer inputs).
    shares = draw(hs.lists(hs.sampled_from([1.0, 1.0, 0.5, 0.0]), min_size=n, max_size=n))
    input_grads = [int(a * share) for a, share in zip([first, *outputs[:-1]], shares)]
    copied = draw(hs.lists(hs.booleans(), min_size=n, max_size=n))
    copies = [a if c else 0 for a, c in zip([first, *outputs[:-1]], copied)]
    stops = None
    if draw(hs.booleans()):
        kinds = draw(hs.lists(hs.sampled_from([0, 0, 0, 1, 2]), min_size=n, max_size=n))
        stops = limits(kinds, draw(hs.lists(hs.booleans(), min_size=n, max_size=n)))
    return Chain(
        first,
        outputs,
        [o + x for o, x in zip(outputs, extra)],
        costs,
        workspace_bytes=workspace,
        overhead_bytes=draw(hs.sampled_from([0, 0, 5])),
        carries=carries,
        kept_grad_bytes=grads,
        carry_grads=carry_grads,
        input_grad_bytes=input_grads,
        applied_grad_bytes=updates,
        input_copy_bytes=copies,
        update_workspace_bytes=draw(hs.sampled_from([0, 0, 6, 50])),
        max_stop=stops,
        applied_workspace_bytes=draw(hs.sampled_from([0, 0, 5, 40])),
    )
