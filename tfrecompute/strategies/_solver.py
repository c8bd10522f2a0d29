"""Exact search over single-level plans: a vectorized Pareto-label DP (private).

NOTE [ The element formula ]
    In the model of `memory.py`, the peak of a plan with elements `k = 1..m` is

        overhead + max_k (P_k + L_k),    P_1 = a_0,   P_{k+1} = P_k + h_k

    where `h_k` is what the element holds between its forward and backward
    (`saved_i` for a stored link, `h(s, e) = a_e + C(s, e)` for a segment
    `[s, e)`) and `L_k` its local peak above the memory held before it. Both
    passes of element `k` see the same held memory `P_k` (its backward starts
    after it released `h_k`), and `h`, `L` depend on the element alone (a carry
    is held by the segment that makes it, or sits in a stored producer's
    `saved_bytes`), which is what makes a DP over positions exact:

        stored i:   L = saved_i + a_{i+1} + g_i + ws_i + G_i + U(i, i+1)
        [s, e):     L = max_{s<=j<e} max(K_s + a_e + R_e + V_e + S(s..j) + ws_j, (recompute)
                                         K_s + S(s..j) + a_{j+1} + g_j + ws_j
                                                 + G_j + U(j, e),                (backward)
                                         C(s, j) + [j>s] a_j + a_{j+1} + ws_j)   (forward)

    with `S(s..j) = saved_s + ... + saved_j`, `g_j = input_grad_bytes[j]`, the
    live gradients `G_k`, `R_e` of `Chain.live_gradients` and the applied
    gradients `U(j, e)`, `V_e` of `memory.py`. A stored
    link's forward moment `saved_i + ws_i` is below its backward one. `G`,
    `R`, `U`, `V` and `K_s` only add to backward and recompute moments, so
    they never break a domination. A segment's forward moment of
    link `j` holds `C(s, j)`, the carries made by links `s..j-2`; when every
    link's outgoing carries fit in its `saved_bytes` (`Problem.forward_dominated`,
    true for realistic chains where a carried tensor is part of its producer's
    output), `C(s, j) <= S(s..j-2)` and the forward term is below the backward
    one, so it is skipped. The step-end moment `a_0 + R_0 + V_0` is below
    link 0's backward moment, whatever the plan.

    With prefix sums `Ss`, the recompute and backward terms are `g1[j] - Ss[s]`
    and `g2[j] - Ss[s]` (plus `K_s`, the copy of the segment's input) for
    arrays `g1`, `g2` that do not depend on `s`, so a
    whole row `L(s, s+1..n)` costs two running maxima. The backward term
    depends on `e` through `U(j, e)`: for the last `lag + 1` links of the
    segment it is their own window `U(j, j+1)` (in `g2`), for earlier ones
    `gU[j] + Us[e]` with prefix sums `Us` of the applied gradients, so the
    backward row is a running maximum of `gU` shifted by `lag + 1`, plus `Us`,
    against a sliding maximum of `g2` over `lag + 1` links. It is still
    nondecreasing in `e`. `C(s, .)` does depend on
    `s`: `Problem` keeps the row `C(s, x)` for all `x` and moves it from `s` to
    `s - 1` by adding each carry made by link `s - 1` on `x in [s + 1, j]` (a
    slice add), so a pass over all positions costs `O(n + carries)` slice adds;
    the forward term is then a third running maximum. Tests check this formula
    against `simulate` on random plans.

NOTE [ Labels ]
    A suffix of a plan starting at position `s` is summarised by a label
    `(R, C)`: `R` is the headroom it needs above the memory held before it
    (`max_k (sum of h before k within the suffix + L_k)`), `C` its cost. Prepending
    an element gives `R' = max(L, h + R)`, `C' = C + cost`, monotone in both, so
    a label dominated at the same position (larger-or-equal `R` and `C`) can be
    dropped without losing any optimum: the labels at position 0 are the exact
    Pareto set of (peak - overhead - a_0, cost) over all plans. Costs are exact
    integers (floats are dyadic rationals) folded as `cost * (n + 1) + segments`,
    so ties in cost are broken exactly by the number of segments. Pruning that
    keeps the search exact:
      * `R <= B - minP(s)`, `minP(s)` the least memory any feasible prefix holds
        at `s` (a forward DP, exact because feasibility is monotone in held
        memory);
      * anchor: any prefix holds at most `P0(s) = a_0 + sum_{i<s} U_i` with
        `U_i = max(saved_i, carries made by i)` (a segment `[s', e)` holds
        `a_e + C(s', e) <= saved_{e-1} + sum_{s'<=i<e-1} carries made by i`;
        without large carries this is `a_0 + Ss[s]`, everything stored), so among
        labels with `R <= B - P0(s)` only the cheapest matters (labels of equal
        cost but lower `R` are kept for the peak tie-break);
      * cost: labels costing more than a known feasible plan.

NOTE [ Bounded work ]
    The Pareto sets of heterogeneous chains grow fast (the problem contains
    knapsack, so it is NP-hard in general: thousands of labels per position
    for 1000 random links). With a work limit (candidate labels examined, plus
    a fixed charge per position), `solve_budget` runs passes that keep at most
    `K` labels per position: the cheapest label of each of `K` buckets over `R`
    and the lowest-`R` label of each of `K` buckets over cost. The first pass
    keeps 32; each next pass is pruned by the best cost so far and keeps as many
    labels as the remaining work allows (a pass that runs out keeps 16 labels on
    its remaining positions rather than being thrown away). The search is exact
    as soon as a pass needed no trimming. Trimmed passes check memory exactly,
    so their plans always fit the budget; only their cost may exceed the
    optimum (benchmarks/planner_speed.py measures by how much).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import numpy as np
import numpy.typing as npt

from tfrecompute.strategies.chain import Chain

__all__: list[str] = []

Array = npt.NDArray[Any]

_LIMIT = 2**62
EXACT_LINKS = 16
"""Chains up to this many links are always searched exactly."""
EXACT_OBJECT_LINKS = 64
"""Up to this many links, costs too fine for int64 use exact Python ints (slower)."""
_FIRST_KEEP = 32
_MAX_GROWTH = 16
_GROWTH_COST = 0.6
_TAIL_KEEP = 16
_POSITION_WORK = 4000
"""Work units charged per position of a pass (its fixed numpy overhead, ~100 us)."""
FRONTIER_KEEP = 256
"""Labels kept per position by `frontier` once its exact search hits the work limit."""


@dataclass
class Problem:
    """A chain turned into the arrays of the element formula."""

    n: int
    fold: int
    dtype: Any
    exact_costs: bool
    inf: Any
    big_cost: Any
    a: Array
    saved: Array
    ws: Array
    Lst: Array
    g1: Array
    g2: Array
    aG: Array
    K: Array
    gU: Array
    Us: Array
    lag: int
    Ss: Array
    P0: Array
    Cs: Array
    a0: int
    overhead: int
    bound: int
    carries: tuple[tuple[int, int, int], ...]
    forward_dominated: bool
    max_width: Array  # max_width[s]: the most links a segment starting at s may hold
    carry_first: list[int] = field(init=False)
    carry_at: int = field(init=False)
    carry_row: Array = field(init=False)

    def __post_init__(self) -> None:
        # carries[carry_first[i]:] are those made by links >= i (sorted by producer);
        # `carried` keeps the row C(carry_at, .) and moves it from position to position.
        producers = [i for i, _, _ in self.carries]
        self.carry_first = [bisect.bisect_left(producers, i) for i in range(self.n + 1)]
        self.carry_at = self.n
        self.carry_row = np.zeros(self.n + 2, dtype=self.dtype)

    @classmethod
    def from_chain(cls, chain: Chain) -> Problem:
        n = chain.n
        act = [chain.input_bytes, *chain.output_bytes]
        saved = list(chain.saved_bytes)
        ws = list(chain.workspace_bytes)
        backward_grads, recompute_grads = chain.live_gradients()  # G_k, R_e
        carried_out = [0] * n  # bytes of the carries each link makes
        for i, _, size in chain.carries:
            carried_out[i] += size
        upper = [max(kept, out) for kept, out in zip(saved, carried_out)]
        bound = 2 * (sum(carried_out) + _bytes_total(chain)) + 1  # above any peak - overhead
        fold = n + 1
        dtype, weights, exact_costs = _cost_grid(chain, bound)

        def arr(values: list[int]) -> Array:
            return np.array(values, dtype=dtype)

        a = arr(act)
        sv = arr(saved)
        wk = arr(ws)
        G = arr([*backward_grads, 0])
        gi = arr(list(chain.input_grad_bytes))
        Ss = np.concatenate([arr([0]), np.cumsum(sv)])
        lag = chain.UPDATE_LAG
        Us = np.concatenate([arr([0]), np.cumsum(arr(list(chain.applied_grad_bytes)))])
        window = Us[np.minimum(np.arange(1, n + 1) + lag, n)] - Us[:-1]  # U(j, j + 1)
        g1 = Ss[1:] + wk
        g2 = Ss[1:] + a[1:] + gi + wk + G[:-1] + window
        Lst = sv + a[1:] + gi + wk + G[:-1] + window
        Cs = np.concatenate([arr([0]), np.cumsum(arr(weights))]) * fold
        big_cost = 2 * fold * (sum(weights) + 1) + 4
        return cls(
            n=n,
            fold=fold,
            dtype=dtype,
            exact_costs=exact_costs,
            inf=4 * bound + 8,
            big_cost=big_cost,
            a=a,
            saved=sv,
            ws=wk,
            Lst=Lst,
            g1=g1,
            g2=g2,
            aG=a + arr(list(recompute_grads)) + Us[np.minimum(np.arange(n + 1) + lag, n)] - Us,
            K=arr(list(chain.input_copy_bytes)),
            gU=g2 - window - Us[:-1],
            Us=Us,
            lag=lag,
            Ss=Ss,
            P0=chain.input_bytes + np.concatenate([arr([0]), np.cumsum(arr(upper))]),
            Cs=Cs,
            a0=chain.input_bytes,
            overhead=chain.overhead_bytes,
            bound=bound,
            carries=chain.carries,
            forward_dominated=all(out <= kept for out, kept in zip(carried_out, saved)),
            max_width=np.array(chain.max_stop, dtype=np.int64) - np.arange(n),
        )

    def carried(self, s: int, width: int) -> Array:
        """`C(s, x)` for `x = s .. s + width` (a view, valid until the next call)."""
        carries = self.carries
        row = self.carry_row
        while self.carry_at > s:  # add the carries made by link carry_at - 1
            i = self.carry_at - 1
            for k in range(self.carry_first[i], self.carry_first[i + 1]):
                _, j, size = carries[k]
                row[i + 2 : j + 1] += size
            self.carry_at = i
        while self.carry_at < s:  # remove the carries made by link carry_at
            i = self.carry_at
            for k in range(self.carry_first[i], self.carry_first[i + 1]):
                _, j, size = carries[k]
                row[i + 2 : j + 1] -= size
            self.carry_at = i + 1
        return row[s : s + width + 1]

    def row(self, s: int, cap: Any) -> tuple[int, Array, Array]:
        """`L(s, e)` and `h(s, e)` for `e = s+1 .. s+W`.

        `W` is the last `e` whose lower bound on `L(s, e)` (the backward terms,
        nondecreasing in `e`) fits `cap`, and at most `max_stop[s] - s`.
        """
        M2 = self.g2[s:].copy()  # links j >= e - 1 - lag: their own window of updates
        for shift in range(1, self.lag + 1):
            np.maximum(M2[shift:], self.g2[s : self.n - shift], out=M2[shift:])
        if self.n - s > self.lag + 1:  # links j < e - 1 - lag: the segment holds U(j, e)
            held = np.maximum.accumulate(self.gU[s : self.n - self.lag - 1])
            held += self.Us[s + self.lag + 2 :]
            np.maximum(M2[self.lag + 1 :], held, out=M2[self.lag + 1 :])
        M2 += self.K[s] - self.Ss[s]  # K_s: the copy of x_s the recompute reads
        width = min(int(np.searchsorted(M2, cap, side="right")), int(self.max_width[s]))
        M1 = np.maximum.accumulate(self.g1[s : s + width]) + (self.K[s] - self.Ss[s])
        L = np.maximum(M2[:width], self.aG[s + 1 : s + 1 + width] + M1)
        held = self.a[s + 1 : s + 1 + width]
        if self.carries and width:
            C = self.carried(s, width)
            held = held + C[1:]
            if not self.forward_dominated:
                f = C[:-1] + self.a[s : s + width] + self.a[s + 1 : s + 1 + width]
                f += self.ws[s : s + width]
                f[0] -= self.a[s]
                np.maximum(L, np.maximum.accumulate(f), out=L)
        return width, L, held

    def none_peak(self) -> int:
        """Peak of the plan that stores every link."""
        return self.overhead + self.a0 + int((self.Ss[:-1] + self.Lst).max())


def _bytes_total(chain: Chain) -> int:
    """Every byte count of the chain summed (carries aside): a bound on any peak."""
    total = chain.input_bytes + sum(chain.output_bytes) + sum(chain.saved_bytes)
    total += sum(chain.workspace_bytes) + max(chain.live_gradients()[0])
    return total + sum(chain.applied_grad_bytes) + sum(chain.input_copy_bytes)


def _cost_grid(chain: Chain, bound: int) -> tuple[Any, list[int], bool]:
    """The arrays' dtype, the costs as integers, and whether those are exact.

    Costs are the exact binary values of their floats, scaled to integers.
    When bytes or costs would overflow int64 sums, chains of up to
    `EXACT_OBJECT_LINKS` links use Python ints (exact, slower); longer ones
    round the costs to the coarsest grid that fits.
    """
    n = chain.n
    fold = n + 1
    exact = [Fraction(c) for c in chain.forward_cost]
    scale = max(f.denominator for f in exact)  # floats are dyadic: a power of two
    weights = [int(f * scale) for f in exact]

    def costs_fit(ws_: list[int]) -> bool:
        return (n + 2) * (2 * fold * (sum(ws_) + 1) + 4) < _LIMIT

    bytes_fit = (n + 2) * (4 * bound + 8) < _LIMIT
    if bytes_fit and costs_fit(weights):
        return np.int64, weights, True
    if not bytes_fit or n <= EXACT_OBJECT_LINKS:
        return object, weights, True
    shift = 1
    while not costs_fit(_rounded(weights, shift)):
        shift += 1
    exact_costs = all(w % (1 << shift) == 0 for w in weights)
    return np.int64, _rounded(weights, shift), exact_costs


def _rounded(weights: list[int], shift: int) -> list[int]:
    """`weights / 2**shift`, rounded to the nearest int (the grid of coarse costs)."""
    return [(w + (1 << (shift - 1))) >> shift for w in weights]


def min_headroom(pb: Problem) -> int:
    """Least `R` over all plans: `min_peak = overhead + a_0 + min_headroom`."""
    n = pb.n
    best = [0] * (n + 1)
    best_arr = np.zeros(n + 1, dtype=pb.dtype)
    for s in range(n - 1, -1, -1):
        stored = max(int(pb.Lst[s]), int(pb.saved[s]) + best[s + 1])
        width, L, h = pb.row(s, stored)
        value = stored
        if width:
            value = min(value, int(np.maximum(L, h + best_arr[s + 1 : s + 1 + width]).min()))
        best[s] = value
        best_arr[s] = value
    return best[0]


def least_peak(pb: Problem) -> int:
    """The least peak of any plan: `overhead + a_0 + min_headroom`."""
    return pb.overhead + pb.a0 + min_headroom(pb)


def min_held(pb: Problem, limit: int) -> Array:
    """`minP(s)`: least memory held before position `s` by a prefix within `limit`.

    `limit` is the budget minus the overhead; unreachable positions get `pb.inf`.
    """
    n = pb.n
    inf = pb.inf
    held = np.full(n + 1, inf, dtype=pb.dtype)
    held[0] = pb.a0
    for s in range(n):
        here = held[s]
        if here >= inf:
            continue
        cap = limit - here
        if pb.Lst[s] <= cap:
            held[s + 1] = min(held[s + 1], here + pb.saved[s])
        width, L, h = pb.row(s, cap)
        if width:
            fits = np.flatnonzero(L <= cap)
            ends = fits + (s + 1)
            held[ends] = np.minimum(held[ends], here + h[fits])
    return held


@dataclass
class Labels:
    """The outcome of one label pass: every label's back-pointers, and the labels at 0."""

    R: Array
    C: Array
    PE: Array
    PI: Array
    first: int
    stop: int
    trimmed: bool
    work: int


def label_pass(
    pb: Problem,
    limit: int,
    held: Array,
    *,
    keep: int | None,
    max_cost: int | None,
    anchor: bool,
    work_limit: int | None,
    soft: bool = False,
) -> Labels | None:
    """Backward Pareto-label DP; None when `work_limit` candidate labels were exceeded.

    With `soft`, exceeding `work_limit` does not abort: the remaining positions
    keep at most `_TAIL_KEEP` labels instead (the result is then trimmed).

    Args:
        pb: the problem.
        limit: budget minus overhead; `min_held(pb, limit)` is `held`.
        keep: labels kept per position (None: all, exact).
        max_cost: drop labels costing more (in exact integer cost units).
        anchor: apply the anchor pruning (only valid for one fixed budget).
        work_limit: abort when more candidate labels were examined.
    """
    n, fold, dt = pb.n, pb.fold, pb.dtype
    a, saved, Lst, Cs, P0 = pb.a, pb.saved, pb.Lst, pb.Cs, pb.P0
    inf = pb.inf
    BIG = limit + 1
    BIGC = pb.big_cost
    ubf = None if max_cost is None else (max_cost + 1) * fold - 1
    positions = np.arange(n + 1)
    if dt is object:
        positions = positions.astype(object)

    size = max(1024, 8 * n)
    R = np.empty(size, dtype=dt)
    C = np.empty(size, dtype=dt)
    KEY = np.empty(size, dtype=dt)  # (n - position) * BIG + R: sorted across blocks
    KC = np.empty(size, dtype=dt)  # (n - position) * BIGC + BIGC - 1 - (C + Cs[position])
    A = np.empty(size, dtype=dt)  # a[position] + R
    CP = np.empty(size, dtype=dt)  # C + Cs[position]
    PE = np.empty(size, dtype=np.int64)  # element end; -1 for a stored link
    PI = np.empty(size, dtype=np.int64)  # parent label
    bs = np.zeros(n + 1, dtype=np.int64)
    be = np.zeros(n + 1, dtype=np.int64)
    R[0], C[0], KEY[0], A[0], CP[0] = 0, 0, 0, a[n], Cs[n]
    KC[0] = BIGC - 1 - Cs[n]
    PE[0], PI[0] = -1, -1
    bs[n], be[n] = 0, 1
    length = 1
    work = 0
    trimmed = False

    for s in range(n - 1, -1, -1):
        if held[s] >= inf:
            bs[s] = be[s] = length
            continue
        cap = limit - held[s]

        # Candidates from storing link s: the labels at s + 1.
        b0, b1 = int(bs[s + 1]), int(be[s + 1])
        lo_st = hi_st = b0
        if b1 > b0 and Lst[s] <= cap:
            hi_st = b0 + int(np.searchsorted(R[b0:b1], cap - saved[s], side="right"))
            if ubf is not None:
                lo_st = max(
                    b0,
                    int(
                        np.searchsorted(
                            KC[:length],
                            (n - s - 1) * BIGC + (BIGC - 1 - (ubf + Cs[s + 1])),
                            side="left",
                        )
                    ),
                )
        n_st = max(hi_st - lo_st, 0)

        # Candidates from a segment [s, e): labels at e with h(s, e) + R above L(s, e),
        # plus the one just below (it maps to R' = L(s, e)).
        tot = 0
        width, L, h = pb.row(s, cap)
        if width:
            ends = positions[s + 1 : s + 1 + width]
            base = (n - ends) * BIG
            lo = np.searchsorted(KEY[:length], base + (L - h), side="right") - 1
            np.maximum(lo, bs[s + 1 : s + 1 + width], out=lo)
            if ubf is not None:
                lo_c = np.searchsorted(
                    KC[:length], (n - ends) * BIGC + (BIGC - 1 - (ubf + Cs[s] - 1)), side="left"
                )
                np.maximum(lo, lo_c, out=lo)
            hi = np.searchsorted(KEY[:length], base + (cap - h), side="right")
            cnt = hi - lo
            cnt[L > cap] = 0
            np.maximum(cnt, 0, out=cnt)
            tot = int(cnt.sum())

        total = n_st + tot
        work += total + _POSITION_WORK
        if work_limit is not None and work > work_limit:
            if not soft:
                return None
            keep = _TAIL_KEEP if keep is None else min(keep, _TAIL_KEEP)
            work_limit = None
        if total == 0:
            bs[s] = be[s] = length
            continue

        r = np.empty(total, dtype=dt)
        c = np.empty(total, dtype=dt)
        if n_st:
            r[:n_st] = np.maximum(saved[s] + R[lo_st:hi_st], Lst[s])
            c[:n_st] = C[lo_st:hi_st]
        if tot:
            groups = np.flatnonzero(cnt)
            counts = cnt[groups]
            group_end = np.cumsum(counts)
            group_start = group_end - counts
            idx = np.repeat(lo[groups] - group_start, counts) + np.arange(tot)
            rs = A[idx]
            if pb.carries:  # h(s, e) = a[e] + C(s, e); A holds a[e] + R
                rs += np.repeat((h - a[s + 1 : s + 1 + width])[groups], counts)
            rs[group_start] = np.maximum(rs[group_start], L[groups])
            r[n_st:] = rs
            c[n_st:] = CP[idx] - (Cs[s] - 1)

        # Pareto filter: sort by R, keep strict cost improvements, last of equal R.
        order = np.argsort(r)
        rs = r[order]
        cs = c[order]
        running = np.minimum.accumulate(cs)
        better = np.empty(total, dtype=bool)
        better[0] = True
        better[1:] = cs[1:] < running[:-1]
        kept = np.flatnonzero(better)
        rk = rs[kept]
        last = np.empty(len(kept), dtype=bool)
        last[-1] = True
        last[:-1] = rk[1:] != rk[:-1]
        kept = kept[last]

        if anchor and len(kept) > 1:
            rk = rs[kept]
            at = int(np.searchsorted(rk, limit - P0[s], side="right")) - 1
            if at > 0:
                pure = cs[kept[: at + 1]] // fold
                kept = kept[int(np.argmax(pure <= pure[at])) :]

        if keep is not None and len(kept) > keep:
            rk = rs[kept]
            ck = cs[kept]
            mask = np.zeros(len(kept), dtype=bool)
            mask[0] = mask[-1] = True
            bucket = (rk - rk[0]) // ((cap - rk[0]) // keep + 1)
            mask[:-1] |= bucket[1:] != bucket[:-1]  # cheapest label of each R bucket
            bucket = (ck - ck[-1]) // ((ck[0] - ck[-1]) // keep + 1)
            mask[1:] |= bucket[1:] != bucket[:-1]  # lowest-R label of each cost bucket
            kept = kept[mask]
            trimmed = True

        k = len(kept)
        work += 2 * k
        if length + k > size:
            while length + k > size:
                size *= 2
            R, C, KEY, KC, A, CP, PE, PI = (
                _grown(x, length, size) for x in (R, C, KEY, KC, A, CP, PE, PI)
            )
        span = slice(length, length + k)
        R[span] = rs[kept]
        C[span] = cs[kept]
        KEY[span] = (n - s) * BIG + R[span]
        A[span] = a[s] + R[span]
        CP[span] = C[span] + Cs[s]
        KC[span] = (n - s) * BIGC + (BIGC - 1 - CP[span])
        source = order[kept]
        stored = source < n_st
        PI[span] = np.where(stored, lo_st + source, 0)
        PE[span] = -1
        if not stored.all():
            seg = np.flatnonzero(~stored)
            k_seg = source[seg] - n_st
            PI[length + seg] = idx[k_seg]
            PE[length + seg] = s + 1 + groups[np.searchsorted(group_end, k_seg, side="right")]
        bs[s], be[s] = length, length + k
        length += k

    return Labels(R, C, PE, PI, int(bs[0]), int(be[0]), trimmed, work)


def _grown(values: Array, length: int, size: int) -> Array:
    grown = np.empty(size, dtype=values.dtype)
    grown[:length] = values[:length]
    return grown


def segments_of(labels: Labels, n: int, j: int) -> tuple[tuple[int, int], ...]:
    """Follows the back-pointers of label `j` at position 0."""
    segments: list[tuple[int, int]] = []
    s = 0
    while s < n:
        end = int(labels.PE[j])
        if end < 0:
            end = s + 1
        else:
            segments.append((s, end))
        j = int(labels.PI[j])
        s = end
    return tuple(segments)


def cheapest(labels: Labels, fold: int) -> int:
    """Index of the least-cost label at 0; ties: least R, then fewest segments."""
    C = labels.C[labels.first : labels.stop]
    pure = C // fold
    return labels.first + int(np.argmax(pure == pure[-1]))


@dataclass
class Solution:
    segments: tuple[tuple[int, int], ...]
    exact: bool


def solve_budget(pb: Problem, budget: int, *, max_work: int | None) -> Solution | None:
    """The least-cost plan with peak <= budget (None when no plan fits)."""
    limit = min(budget - pb.overhead, pb.bound)
    if limit < pb.a0:
        return None
    held = min_held(pb, limit)
    if held[pb.n] >= pb.inf:
        return None
    if max_work is None or pb.n <= EXACT_LINKS:
        labels = label_pass(pb, limit, held, keep=None, max_cost=None, anchor=True, work_limit=None)
        assert labels is not None
        return Solution(segments_of(labels, pb.n, cheapest(labels, pb.fold)), True)

    best: tuple[int, int, int] | None = None  # (cost, R, folded cost)
    best_segments: tuple[tuple[int, int], ...] = ()
    keep = _FIRST_KEEP
    spent = 0
    exact = False
    while True:
        labels = label_pass(
            pb,
            limit,
            held,
            keep=keep,
            max_cost=None if best is None else best[0],
            anchor=True,
            work_limit=None if best is None else max_work - spent,
            soft=True,
        )
        assert labels is not None
        spent += labels.work
        if labels.stop > labels.first:
            j = cheapest(labels, pb.fold)
            key = (int(labels.C[j]) // pb.fold, int(labels.R[j]), int(labels.C[j]))
            if best is None or key < best:
                best = key
                best_segments = segments_of(labels, pb.n, j)
        if not labels.trimmed:
            exact = True
            break
        # The next pass keeps as many labels as the remaining work allows, assuming
        # the work grows linearly with the labels kept; the tighter cost bound of
        # each pass makes the next one cheaper per label (measured: 0.5x to 0.9x).
        per_label = max(labels.work, 1) / keep
        grown = min(keep * _MAX_GROWTH, int((max_work - spent) / (_GROWTH_COST * per_label)))
        if grown < keep * 3 // 2:
            break
        keep = grown
    assert best is not None
    return Solution(best_segments, exact)


def solve_frontier(
    pb: Problem, *, max_work: int | None
) -> tuple[list[tuple[tuple[tuple[int, int], ...], int]], bool]:
    """(segments, peak) of the Pareto-optimal plans, by peak ascending; and whether exact."""
    limit = pb.none_peak() - pb.overhead
    held = min_held(pb, limit)
    work_limit = None if pb.n <= EXACT_LINKS else max_work
    labels = label_pass(
        pb, limit, held, keep=None, max_cost=None, anchor=False, work_limit=work_limit
    )
    exact = labels is not None
    if labels is None:
        labels = label_pass(
            pb, limit, held, keep=FRONTIER_KEEP, max_cost=None, anchor=False, work_limit=None
        )
        assert labels is not None
    pure = labels.C[labels.first : labels.stop] // pb.fold
    chosen = [labels.first + i for i in range(len(pure)) if i == 0 or pure[i] != pure[i - 1]]
    base = pb.overhead + pb.a0
    return [(segments_of(labels, pb.n, j), base + int(labels.R[j])) for j in chosen], exact


def fsum_cost(chain: Chain, segments: tuple[tuple[int, int], ...]) -> float:
    return math.fsum(chain.forward_cost[j] for s, e in segments for j in range(s, e))
