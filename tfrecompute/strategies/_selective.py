"""Exact search over plans with policy states: stored, recomputed, recomputed under a policy.

Private to the package.

NOTE [ Policy states ]
A chain with `policy_kept_bytes` lets a segment be recomputed under the
recompute policy (`simulate`'s "selective" segments). The element formula of
`_solver.py` holds for them too: the peak of a plan is `overhead + a_0 +
max_k (P_k - a_0 + L_k)` over its elements, each holding `h` between its
forward and its backward and peaking `L` above what is held before it. A
selective segment `[s, e)` holds `h = a_e + C(s, e) + K(s..e-1)` (`k_i =
policy_kept_bytes[i]`, `K` their sums) and peaks at

    L = max_{s<=j<e} max(C(s, j) + [j>s] a_j + a_{j+1} + ws_j + K(s..j),          (forward)
                         K_s + a_e + R_e + V_e + S(s..j) + ws_j + K(j..e-1),       (recompute)
                         K_s + S(s..j) + a_{j+1} + g_j + ws_j + G_j + U(j, e))     (backward)

(the recomputed segment is the same with `k = 0`; `K_s` here is the input
copy). For a fixed start `s` all three are running maxima over `j` plus terms
of `e`, so a row of elements costs `O(n)`.

With several policy states (`Chain.more_policies`: `"attention"` and
`"dots"` beside recomputing whole, four states in all) each state's segments
are one more row of elements, with that state's `k_i` and costs.

The search is the Pareto-label DP of `_solver.py` (NOTE [ Labels ]) in plain
Python, without its bounded-work passes: labels `(R, cost)` per position,
prepending an element gives `(max(L, h + R), cost + c)`, and dominated labels
are dropped. Costs are exact (`Fraction`s of the floats). It is exact over
all plans `Chain.max_stop` allows; `tests/strategies/test_selective.py`
checks it against a brute force over every three- and four-state plan. Of plans with
equal cost and peak it returns one, not necessarily the one with the fewest
segments. It is meant for profiled models (tens to a few hundred links).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from fractions import Fraction

from tfrecompute.strategies.chain import Chain
from tfrecompute.strategies.simulate import carry_profile

__all__: list[str] = []

_NONE = -(1 << 62)  # the headroom of an empty suffix


@dataclass(frozen=True)
class Element:
    """One element of a plan: `mode` -1 stored link, 0 recomputed, `k` under policy state `k`."""

    start: int
    stop: int
    mode: int
    held: int
    peak: int
    cost: Fraction


@dataclass(frozen=True)
class Label:
    """A suffix plan: its headroom above what is held before it, its cost, its first element."""

    headroom: int
    cost: Fraction
    element: Element | None
    rest: Label | None

    def plan(self) -> tuple[tuple[tuple[int, int], ...], tuple[int, ...]]:
        """The segments and their states (0 whole, `k` policy state `k`)."""
        segments: list[tuple[int, int]] = []
        flags: list[int] = []
        label: Label | None = self
        while label is not None and label.element is not None:
            element = label.element
            if element.mode >= 0:
                segments.append((element.start, element.stop))
                flags.append(element.mode)
            label = label.rest
        return tuple(segments), tuple(flags)


class _Terms:
    """The per-link arrays of the element formula."""

    def __init__(self, chain: Chain) -> None:
        self.n = chain.n
        self.chain = chain
        self.act = (chain.input_bytes, *chain.output_bytes)
        self.saved_prefix = [0, *itertools.accumulate(chain.saved_bytes)]
        states = chain.segment_states
        self.kept_prefix = [[0, *itertools.accumulate(kept)] for kept, _ in states]
        self.grads, self.regrads = chain.live_gradients()
        self.applied = [0, *itertools.accumulate(chain.applied_grad_bytes)]
        self.lag = chain.UPDATE_LAG
        self.cost_prefix = [
            [Fraction(0), *itertools.accumulate(Fraction(c) for c in cost)] for _, cost in states
        ]

    def stored(self, i: int) -> Element:
        chain, act = self.chain, self.act
        window = self.applied[min(self.n, i + self.lag + 1)] - self.applied[i]
        peak = chain.saved_bytes[i] + act[i + 1] + chain.input_grad_bytes[i]
        peak += chain.workspace_bytes[i] + self.grads[i] + window
        return Element(i, i + 1, -1, chain.saved_bytes[i], peak, Fraction(0))

    def segments(self, s: int, state: int) -> list[Element]:
        """The segments `[s, e)` of one state for every allowed stop `e`, in `O(n)`."""
        chain, act, n, lag = self.chain, self.act, self.n, self.lag
        stop_max = chain.max_stop[s]
        if stop_max <= s:
            return []
        carries = carry_profile(chain, s, stop_max) if chain.carries else [0] * (stop_max - s + 1)
        kp = self.kept_prefix[state]
        sp, applied, copy = self.saved_prefix, self.applied, chain.input_copy_bytes[s]
        prefix = self.cost_prefix[state]
        found: list[Element] = []
        forward = recompute = far = _NONE
        for e in range(s + 1, stop_max + 1):
            j = e - 1
            work = chain.workspace_bytes[j]
            forward = max(
                forward,
                carries[j - s] + (act[j] if j > s else 0) + act[j + 1] + work + kp[j + 1] - kp[s],
            )
            recompute = max(recompute, sp[j + 1] - sp[s] + work - kp[j])
            if e - lag - 1 >= s:
                far = max(far, self._backward(s, e - lag - 1, copy) - applied[e - lag - 1])
            near = max(
                self._backward(s, i, copy) + applied[min(n, i + lag + 1)] - applied[i]
                for i in range(max(s, e - lag), e)
            )
            lagging = self.regrads[e] + applied[min(n, e + lag)] - applied[e]
            peak = max(
                forward,
                copy + act[e] + lagging + kp[e] + recompute,
                near,
                far + applied[e] if far > _NONE else _NONE,
            )
            held = act[e] + carries[e - s] + kp[e] - kp[s]
            found.append(Element(s, e, state, held, peak, prefix[e] - prefix[s]))
        return found

    def _backward(self, s: int, j: int, copy: int) -> int:
        """`K_s + S(s..j) + a_{j+1} + g_j + ws_j + G_j`: the backward term without `U`."""
        chain = self.chain
        held = copy + self.saved_prefix[j + 1] - self.saved_prefix[s]
        return (
            held
            + self.act[j + 1]
            + chain.input_grad_bytes[j]
            + chain.workspace_bytes[j]
            + (self.grads[j])
        )


def _pareto(candidates: list[Label]) -> list[Label]:
    """The labels no other beats on both headroom and cost."""
    candidates.sort(key=lambda label: (label.headroom, label.cost))
    kept: list[Label] = []
    for label in candidates:
        if not kept or label.cost < kept[-1].cost:
            kept.append(label)
    return kept


def solve(chain: Chain, headroom_limit: int | None = None) -> list[Label]:
    """The Pareto labels of whole plans, by headroom over `a_0 + overhead`, ascending.

    `headroom_limit` drops labels above it (a budget less `a_0 + overhead`).

    Example:
        >>> chain = Chain(10, [10] * 4, [100] * 4, [4.0] * 4,
        ...               policy_kept_bytes=[10] * 4, policy_forward_cost=[1.0] * 4)
        >>> [(label.headroom + 10, float(label.cost), label.plan()) for label in solve(chain)][-2:]
        [(350, 1.0, (((2, 3),), (1,))), (430, 0.0, ((), ()))]
    """
    terms = _Terms(chain)
    n = chain.n
    limit = (1 << 62) if headroom_limit is None else headroom_limit
    labels: list[list[Label]] = [[] for _ in range(n + 1)]
    labels[n] = [Label(_NONE, Fraction(0), None, None)]
    for s in range(n - 1, -1, -1):
        elements = [terms.stored(s)]
        for state in range(len(chain.segment_states)):
            elements += terms.segments(s, state)
        candidates = []
        for element in elements:
            for rest in labels[element.stop]:
                headroom = max(element.peak, element.held + rest.headroom)
                if headroom <= limit:
                    candidates.append(Label(headroom, element.cost + rest.cost, element, rest))
        labels[s] = _pareto(candidates)
    return labels[0]
