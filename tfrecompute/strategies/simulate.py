"""The memory model: replay a plan over one training step and predict its peak.

This module is the contract between the planner and TensorFlow: a profiler
calibrates `Chain` numbers against real allocator measurements so that
`simulate` predicts the measured peak. Every strategy is judged by it, and the
optimal solver (`tfrecompute.strategies.optimize`) is tested against it.

The model
---------
A plan is a sorted list of disjoint half-open *segments* `[s, e)` of recomputed
links; every other link is *stored*. An *element* is a stored link or a
segment. Write `a_i` for the size of `x_i` (`a_0 = input_bytes`,
`a_{i+1} = output_bytes[i]`), `saved_i`, `ws_i`, `g_i` for `saved_bytes[i]`,
`workspace_bytes[i]` and `input_grad_bytes[i]` (the gradient link `i` makes
for `x_i`; `a_i` unless it reads only part of `x_i`), and
`S(s..j) = saved_s + ... + saved_j`.
`overhead_bytes` is added to every moment below. `H` is the memory held
between links; it starts at `a_0`.

Four terms come from `carries`, `kept_grad_bytes`, `carry_grads` and
`applied_grad_bytes`:

* `C(s, e)` (`Chain.carried_bytes`): the sum of `bytes` over the carries
  `(i, j, bytes)` with `s <= i < e - 1` and `j >= e`, the skip tensors made
  inside `[s, e)` (other than its output `x_e`) and still needed at link `e`.
  A carry made by a stored link is part of its `saved_bytes` when a backward
  pass needs it and is not counted again; one made by link `e - 1` is `x_e`.
* `G_k` and `R_e` (`Chain.live_gradients`): gradients alive in the backward
  pass whatever the plan. `G_k` is alive while link `k`'s backward pass runs:
  the parameter gradients `kept_grad_bytes[k] + ... + kept_grad_bytes[n-1]` (they stay
  until the optimizer step) plus the `carry_grads` `(i, j, bytes)` with
  `i < k <= j` (a skip tensor's gradient, made by the backward pass of its last
  consumer `j`; at its producer `i` it is part of the gradient of `x_{i+1}`),
  and for `k = 0` the optimizer's copies `update_workspace_bytes` (see the
  step's end below).
  `R_e` is alive while a segment ending at `e` runs forward again, after the
  backward pass of link `e`: the parameter gradients of links `e..n-1` plus
  the `carry_grads` with `i + 1 < e <= j`. Both add to backward-phase moments
  only, and both count `applied_workspace_bytes`: the temporaries of an
  update of an optimizer that applies gradients as they come, in flight
  beside any backward moment.
* `U(j, e)`: the applied parameter gradients (`applied_grad_bytes`, `u_i`)
  alive at the backward pass of link `j` of an element ending at `e`. The
  gradient of link `i` lives from its backward pass through those of the
  next `lag = Chain.UPDATE_LAG` links (its update runs alongside them), and a
  segment holds those of its links until its backward pass ends:
  `U(j, e) = u_j + ... + u_{m-1}` with `m = min(n, max(e, j + lag + 1))` (for
  a stored link `e = j + 1`). While a segment ending at `e` runs forward
  again, `V_e = u_e + ... + u_{min(n, e + lag) - 1}` are alive.

Forward, elements in order (no gradients are live yet):

* stored link `i`: while it runs, live = `H + saved_i + ws_i`; then `H += saved_i`.
* segment `[s, e)`: its links run one after another and keep nothing but what
  later links need: while link `j` runs, live =
  `H + C(s, j) + (a_j if j > s else 0) + a_{j+1} + ws_j` (its input `a_s` is
  already held by its producer; `C(s, j)` are the carries made earlier in the
  segment and used at or after `j`); then `H += a_e + C(s, e)` (the segment
  keeps its output and the carries it hands on).

Backward, elements in reverse order; the gradient of the element's output,
`a_{last + 1}` bytes, is live:

* stored link `i`: live = `H + a_{i+1} + g_i + ws_i + G_i + U(i, i + 1)`
  (gradients of the output and of the input, and the parameter gradients
  alive); then `H -= saved_i`.
* segment `[s, e)`: first `H -= a_e + C(s, e)` (the held outputs are dropped; the
  recompute makes fresh copies). The recompute may read a copy of its input,
  `K_s = input_copy_bytes[s]` (tfrecompute makes one after the incoming
  gradient, so that TensorFlow cannot merge the recompute with the forward;
  the first link's backward may still read it), live through the segment's
  recompute and backward. Phase "recompute": links `s..e-1` run forward
  again, each now stored, before any of them has produced gradients: while
  link `j` runs, live = `H + K_s + a_e + S(s..j) + ws_j + R_e + V_e`. Then
  their backward, link `j = e-1` down to `s`, as stored links that keep
  their parameter gradients: live =
  `H + K_s + S(s..j) + a_{j+1} + g_j + ws_j + G_j + U(j, e)`, and `saved_j` is
  released after it.

A segment may be recomputed *under the policy* (the chain's third state,
`Chain.policy_kept_bytes` `k_i` and `Chain.policy_forward_cost`; `selective`
marks such segments): its forward also keeps the products the policy keeps,
`k_s + ... + k_j` live while link `j` runs and `K(s..e-1)` held after it
(`H += a_e + C(s, e) + K(s..e-1)`); in the backward they are released with
the held outputs, and while link `j` is recomputed the products of the links
not yet recomputed, `K(j..e-1)`, are still live (each is used by its link's
recompute). Its recompute costs `policy_forward_cost` instead of
`forward_cost`. A chain may have several policy states (`more_policies`:
`"attention"` and `"dots"`, say); `selective` then gives each segment's state
(0 whole, `k` the `k`-th policy), and the segment uses that state's `k_i` and
costs.

The step ends with the optimizer update, when `H = a_0` and all parameter
gradients kept for it are live, with the copies the optimizer makes of them
(`W = update_workspace_bytes`: clipped or unscaled gradients):
`a_0 + R_0 + V_0 + W`. That moment is part of the model but is never above
the backward moment of link 0 (the same plus `saved_0`, the gradients of
`x_1` and `x_0`, `ws_0` and `U(0, e) >= V_0`, as `G_0` counts `W`), so it is
folded into it: the timeline ends with the backward of link 0.

NOTE [ What the model assumes of RecomputeBlock ]
Each runtime behaviour of a block (tfrecompute/layers/) that this model
relies on, the `Chain` field or term that models it, and the test that pins
the behaviour:

* A block keeps only its inputs from its forward to its backward; the
  activations inside are dropped. A segment holds its output and the carries
  it hands on (`output_bytes`, `carries`: the `H += a_e + C(s, e)` above).
  tests/check/test_trace_step.py test_trace_sees_recompute_keep_fewer_activations,
  tests/check/test_measure_step.py test_sqrt_blocks_at_most_halve_step_memory.
* The recompute runs when the gradient of the block's outputs exists, not
  earlier, and TensorFlow does not merge it with the forward: the recompute
  phase of the backward (`layers/custom_gradient.py` makes everything it
  reads depend on the incoming gradient, also under XLA).
  tests/check/test_measure_step.py test_block_with_only_integer_inputs_still_saves_memory,
  tests/layers/test_block_xla_export_higher_order.py test_blocks_still_save_memory_under_xla_on_cpu.
* The recompute reads a copy of the block's floating inputs, live through the
  segment's recompute and backward (`input_copy_bytes`, `K_s`).
  tests/costs/test_profile.py test_the_recompute_copies_its_input.
* A block releases its weight gradients only once its whole backward is
  computed, so a segment holds them until its backward ends
  (`applied_grad_bytes`, `U(j, e)`), and an optimizer that needs all
  gradients keeps them to the step's end (`kept_grad_bytes`).
  tests/layers/test_block.py test_variable_updates_in_the_same_step_do_not_reach_the_recompute
  (why), tests/costs/test_profile.py test_parameter_gradients_follow_the_optimizer (the bytes).
* One segment's backward at a time: a block releases its inputs' gradients,
  from which the previous segment's recompute starts, only once its whole
  backward is computed, so no two segments' recomputed activations are live
  at once. tests/layers/test_block.py test_a_blocks_input_gradient_waits_for_its_weight_gradients.
* Plans are single-level: a block nested in another recomputes once more per
  enclosing recompute, which this model does not describe; `rewrite` never
  nests blocks.

The peak is the largest live value over every moment, forward and backward;
all arithmetic is on exact ints. The recompute cost is the sum of
`forward_cost` over the recomputed links (an exactly rounded float sum).

Example:
    >>> from tfrecompute.strategies import Chain, simulate
    >>> chain = Chain.homogeneous(4, activation_bytes=100)
    >>> simulate(chain, [])          # store all: 4 held + input + 2 gradients
    Estimate(peak_bytes=700, recompute_cost=0.0)
    >>> simulate(chain, [(0, 2), (2, 4)])
    Estimate(peak_bytes=600, recompute_cost=4.0)
    >>> skip = Chain(100, [100] * 4, [100] * 4, [1.0] * 4, carries=[(0, 3, 100)],
    ...              kept_grad_bytes=[10] * 4)
    >>> skip.carried_bytes(0, 2)     # [0, 2) also holds link 0's output, used by link 3
    100
    >>> simulate(skip, [(0, 2), (2, 4)])   # 3 held + input + 2 gradients + G_3
    Estimate(peak_bytes=710, recompute_cost=4.0)
"""

from __future__ import annotations

import bisect
import itertools
import math
import numbers
from collections.abc import Iterable, Iterator, Sequence
from typing import Literal, NamedTuple

from tfrecompute._messages import fail
from tfrecompute.strategies.chain import Chain

__all__ = ["Estimate", "MemoryEvent", "Segments", "simulate", "timeline"]

Segments = Sequence[tuple[int, int]]
"""Half-open ranges `(start, stop)` of recomputed links, sorted and disjoint."""

Phase = Literal["forward", "recompute", "backward"]


class MemoryEvent(NamedTuple):
    """One moment of a training step in the memory model.

    Attributes:
        phase: `"forward"`, `"recompute"` (a segment's forward run again during
            the backward pass) or `"backward"`.
        link: index of the link running.
        live_bytes: bytes live while it runs, `overhead_bytes` included.
    """

    phase: Phase
    link: int
    live_bytes: int


class Estimate(NamedTuple):
    """What a plan costs in the memory model.

    Attributes:
        peak_bytes: the largest live memory over one training step.
        recompute_cost: summed `forward_cost` of the recomputed links.
    """

    peak_bytes: int
    recompute_cost: float


def timeline(
    chain: Chain, segments: Iterable[Sequence[int]], *, selective: Iterable[int] | None = None
) -> list[MemoryEvent]:
    """Replays one training step of a plan, moment by moment.

    Args:
        chain: the cost model.
        segments: sorted, disjoint half-open ranges `(start, stop)` of recomputed
            links (adjacent ranges allowed).
        selective: per segment, whether it is recomputed under the policy
            (needs a chain with `policy_kept_bytes`), or with several policy
            states its state (0 whole, `k` under `Chain.policy_states[k-1]`);
            None: none is.

    Returns:
        The events in time order: `n` forward events, then for each element in
        reverse order its recompute events (segments only) and backward events.

    Raises:
        TypeError: `chain` is not a `Chain` or a segment is not a pair of ints.
        ValueError: segments are empty, overlapping, unsorted or out of range.

    Example:
        >>> chain = Chain.homogeneous(2, activation_bytes=10)
        >>> [e.live_bytes for e in timeline(chain, [(0, 2)])]
        [20, 30, 30, 40, 50, 40]
    """
    checked = check_segments("timeline", chain, segments)
    modes = check_selective("timeline", chain, checked, selective)
    return [MemoryEvent._make(event) for event in _events(chain, checked, modes)]


def simulate(
    chain: Chain, segments: Iterable[Sequence[int]], *, selective: Iterable[int] | None = None
) -> Estimate:
    """Predicts the peak memory and the recompute cost of a plan.

    The peak is the maximum of `timeline(chain, segments)`; see the module
    docstring for the model.

    Args:
        chain: the cost model.
        segments: sorted, disjoint half-open ranges `(start, stop)` of recomputed
            links.
        selective: per segment, whether it is recomputed under the policy
            (needs a chain with `policy_kept_bytes`), or with several policy
            states its state (0 whole, `k` under `Chain.policy_states[k-1]`);
            None: none is.

    Returns:
        `Estimate(peak_bytes, recompute_cost)`.

    Raises:
        TypeError: `chain` is not a `Chain`, a segment is not a pair of ints,
            or `selective` holds something else than bools.
        ValueError: segments are empty, overlapping, unsorted or out of range,
            or `selective` does not fit them or the chain.

    Example:
        >>> simulate(Chain.homogeneous(2, activation_bytes=10), [(0, 2)])
        Estimate(peak_bytes=50, recompute_cost=2.0)
    """
    checked = check_segments("simulate", chain, segments)
    return estimate(chain, checked, check_selective("simulate", chain, checked, selective))


def estimate(
    chain: Chain, segments: tuple[tuple[int, int], ...], selective: tuple[int, ...] = ()
) -> Estimate:
    """`simulate` for segments and `selective` already checked (private to the package)."""
    peak = max(live for _, _, live in _events(chain, segments, selective))
    return Estimate(peak, recompute_cost(chain, segments, selective))


def recompute_cost(
    chain: Chain, segments: tuple[tuple[int, int], ...], selective: tuple[int, ...] = ()
) -> float:
    """The summed recompute cost of the segments (private to the package)."""
    modes = selective or (0,) * len(segments)
    states = chain.segment_states
    return math.fsum(
        states[state][1][j] for (s, e), state in zip(segments, modes) for j in range(s, e)
    )


def check_selective(
    api: str, chain: Chain, segments: tuple[tuple[int, int], ...], selective: object
) -> tuple[int, ...]:
    """Validates `selective` against the segments and the chain; () when none is (or for ()).

    Entries are the segments' states: `False`/0 recomputed whole, `True`/1 under the
    chain's first policy, `k` under its `k`-th (`Chain.policy_states`). Returned as ints.
    """
    if selective is None:
        return ()
    if isinstance(selective, (str, bytes)) or not isinstance(selective, Iterable):
        fail(
            api,
            "selective must be a sequence of bools or policy states, one per segment",
            "selective",
            selective,
            "Pass e.g. [True, False] for two segments, or None",
            error=TypeError,
        )
    flags = tuple(selective)
    if not flags:  # () means none, as None does
        return ()
    if not all(isinstance(flag, numbers.Integral) for flag in flags):
        fail(
            api,
            "selective must hold bools or ints only",
            "selective",
            selective,
            "Pass True (under the policy) or False per segment; with several policies "
            "the state k (1-based) of the policy, 0 for recomputed whole",
            error=TypeError,
        )
    if len(flags) != len(segments):
        fail(
            api,
            f"selective has {len(flags)} entries for {len(segments)} segments",
            "selective",
            selective,
            "Pass one entry per segment",
        )
    states = tuple(int(flag) for flag in flags)
    if any(states) and not chain.has_policy:
        fail(
            api,
            "a segment is marked selective but the chain has no policy costs",
            "selective",
            selective,
            "Profile with a policy (profile(model, ..., policy='dots')) or build the Chain "
            "with policy_kept_bytes and policy_forward_cost",
        )
    count = len(chain.policy_states)
    if not all(0 <= state <= count for state in states):
        fail(
            api,
            f"selective names a policy state outside 0..{count} (the chain has {count})",
            "selective",
            selective,
            f"Pass 0 (recomputed whole) or a state 1..{count} per segment",
        )
    return states if any(states) else ()


def _events(
    chain: Chain, segments: tuple[tuple[int, int], ...], selective: tuple[int, ...] = ()
) -> Iterator[tuple[Phase, int, int]]:
    """Generates the moments `(phase, link, live_bytes)` of one training step.

    This is the one implementation of the memory model (see the module docstring).
    """
    out = chain.output_bytes
    saved = chain.saved_bytes
    work = chain.workspace_bytes
    base = chain.overhead_bytes
    act = (chain.input_bytes, *out)  # act[i] is the size of x_i
    grad_in = chain.input_grad_bytes  # grad_in[i]: the gradient link i makes for x_i
    copies = chain.input_copy_bytes
    grads, regrads = chain.live_gradients()  # G_k, R_e
    n = chain.n
    lag = chain.UPDATE_LAG
    applied = [0, *itertools.accumulate(chain.applied_grad_bytes)]  # prefix sums of u

    def updates(j: int, e: int) -> int:  # U(j, e)
        return applied[min(n, max(e, j + lag + 1))] - applied[j]

    elements = _elements(n, segments, selective)
    carried: dict[int, list[int]] = {}  # segment start -> [C(s, s), ..., C(s, e)]
    none = [0] * (n + 1)  # the carry profile of any segment when there are no carries
    kept_by = [kept for kept, _ in chain.segment_states]  # k_i, per state

    held = act[0]
    for s, e, mode in elements:
        if mode == _STORED:
            yield ("forward", s, base + held + saved[s] + work[s])
            held += saved[s]
            continue
        inside = carried[s] = carry_profile(chain, s, e) if chain.carries else none
        products = kept_by[mode]
        kept = 0  # K(s..j) under the segment's policy
        for j in range(s, e):
            kept += products[j]
            transient = inside[j - s] + (act[j] if j > s else 0) + act[j + 1] + work[j]
            yield ("forward", j, base + held + transient + kept)
        held += act[e] + inside[e - s] + kept

    for s, e, mode in reversed(elements):
        if mode == _STORED:
            live = held + act[s + 1] + grad_in[s] + work[s] + grads[s] + updates(s, e)
            yield ("backward", s, base + live)
            held -= saved[s]
            continue
        products = kept_by[mode]
        kept = sum(products[s:e])
        held -= act[e] + carried[s][e - s] + kept
        again = copies[s]  # K_s: the copy of x_s the recompute reads
        lagging = regrads[e] + applied[min(n, e + lag)] - applied[e]  # R_e + V_e
        for j in range(s, e):
            again += saved[j]
            yield ("recompute", j, base + held + act[e] + again + work[j] + lagging + kept)
            kept -= products[j]
        for j in range(e - 1, s - 1, -1):
            live = held + again + act[j + 1] + grad_in[j] + work[j] + grads[j] + updates(j, e)
            yield ("backward", j, base + live)
            again -= saved[j]


def within_limits(chain: Chain, segments: Segments) -> tuple[tuple[int, int], ...]:
    """`segments` cut to what `Chain.max_stop` allows (private to the package).

    Each segment becomes the longest allowed pieces from its start on; a link
    that cannot be recomputed is left stored. Without limits it is a no-op.

    Example:
        >>> chain = Chain(1, [1] * 6, [1] * 6, [1.0] * 6, max_stop=[3, 3, 3, 3, 5, 6])
        >>> within_limits(chain, [(0, 6)])
        ((0, 3), (4, 5), (5, 6))
    """
    pieces: list[tuple[int, int]] = []
    for start, stop in segments:
        s = start
        while s < stop:
            e = min(stop, chain.max_stop[s])
            if e > s:
                pieces.append((s, e))
                s = e
            else:
                s += 1
    return tuple(pieces)


def carry_profile(chain: Chain, s: int, e: int) -> list[int]:
    """`[C(s, s), C(s, s + 1), ..., C(s, e)]` in `O(e - s + carries)` (private)."""
    carries = chain.carries
    diff = [0] * (e - s + 2)
    # Carries are sorted by producer; only producers s..e-2 count.
    for k in range(bisect.bisect_left(carries, (s,)), len(carries)):
        i, j, size = carries[k]
        if i > e - 2:
            break
        diff[i + 2 - s] += size
        diff[min(j, e) + 1 - s] -= size
    profile = list(itertools.accumulate(diff))
    profile.pop()
    return profile


_STORED = -1  # a segment's mode is its state: 0 recomputed whole, k under policy state k


def _elements(
    n: int, segments: tuple[tuple[int, int], ...], selective: tuple[int, ...] = ()
) -> list[tuple[int, int, int]]:
    """The plan's elements in order: `(start, stop, mode)`, mode stored or a segment's state."""
    elements: list[tuple[int, int, int]] = []
    position = 0
    modes = selective or (0,) * len(segments)
    for (s, e), state in zip(segments, modes):
        elements.extend((i, i + 1, _STORED) for i in range(position, s))
        elements.append((s, e, state))
        position = e
    elements.extend((i, i + 1, _STORED) for i in range(position, n))
    return elements


def check_chain(api: str, chain: object) -> Chain:
    """Returns `chain`; raises a TypeError naming `api` unless it is a `Chain`."""
    if not isinstance(chain, Chain):
        fail(
            api,
            "chain must be a Chain",
            "chain",
            chain,
            "Build one with tfrecompute.strategies.Chain(...)",
            error=TypeError,
        )
    return chain


def check_segments(api: str, chain: object, segments: object) -> tuple[tuple[int, int], ...]:
    """Validates segments against a chain; returns them as a tuple of int pairs."""
    chain = check_chain(api, chain)
    if isinstance(segments, (str, bytes)) or not isinstance(segments, Iterable):
        fail(
            api,
            "segments must be a sequence of (start, stop) pairs",
            "segments",
            segments,
            "Pass e.g. [(0, 4), (6, 9)]",
            error=TypeError,
        )
    checked: list[tuple[int, int]] = []
    for item in segments:
        checked.append(_check_segment(api, chain, segments, item, checked[-1] if checked else None))
    return tuple(checked)


def _check_segment(
    api: str, chain: Chain, segments: object, item: object, previous: tuple[int, int] | None
) -> tuple[int, int]:
    """One segment of `segments`, checked against the chain and the segment before it."""
    n = chain.n
    pair = tuple(item) if isinstance(item, (tuple, list)) else None
    if (
        pair is None
        or len(pair) != 2
        or not all(isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in pair)
    ):
        fail(
            api,
            f"segment {item!r} is not a pair of ints",
            "segments",
            segments,
            "Pass each segment as a (start, stop) pair of ints",
            error=TypeError,
        )
    start, stop = int(pair[0]), int(pair[1])
    if start >= stop:
        fail(
            api,
            f"segment ({start}, {stop}) is empty",
            "segments",
            segments,
            "Use half-open ranges (start, stop) with start < stop",
        )
    if start < 0 or stop > n:
        fail(
            api,
            f"segment ({start}, {stop}) is outside the chain's links 0..{n - 1}",
            "segments",
            segments,
            f"Keep 0 <= start < stop <= {n}",
        )
    if previous is not None and start < previous[1]:
        what = "overlap" if start >= previous[0] else "are not sorted"
        fail(
            api,
            f"segments {previous} and ({start}, {stop}) {what}",
            "segments",
            segments,
            "Pass disjoint segments sorted by start",
        )
    if not chain.allowed(start, stop):
        fail(
            api,
            f"segment ({start}, {stop}) is not allowed by the chain: a segment starting "
            f"at link {start} may stop at {chain.max_stop[start]} at most",
            "segments",
            segments,
            "Keep each segment within Chain.max_stop (see its docstring for why a "
            "profiled model limits blocks)",
        )
    return start, stop
