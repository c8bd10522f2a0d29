"""The memory model: replay a plan over one training step and predict its peak.

This module is the contract between the planner and TensorFlow: a profiler
calibrates `Chain` numbers against real allocator measurements so that
`simulate` predicts the measured peak. Every strategy is judged by it, and the
optimal solver (`tfrecompute.strategies.optimize`) is tested against it.

The model
---------
A plan is a sorted list of disjoint half-open *segments* `[s, e)` of recomputed
layers; every other layer is *stored*. An *element* is a stored layer or a
segment. Write `a_i` for the size of `x_i` (`a_0 = input_bytes`,
`a_{i+1} = output_bytes[i]`), `saved_i`, `ws_i`, `g_i` for `saved_bytes[i]`,
`workspace_bytes[i]` and `input_grad_bytes[i]` (the gradient layer `i` makes
for `x_i`; `a_i` unless it reads only part of `x_i`), and
`S(s..j) = saved_s + ... + saved_j`.
`overhead_bytes` is added to every moment below. `H` is the memory held
between layers; it starts at `a_0`.

Four terms come from `carries`, `grad_bytes`, `carry_grads` and
`update_grad_bytes`:

* `C(s, e)` (`Chain.carried_bytes`): the sum of `bytes` over the carries
  `(i, j, bytes)` with `s <= i < e - 1` and `j >= e`, the skip tensors made
  inside `[s, e)` (other than its output `x_e`) and still needed at layer `e`.
  A carry made by a stored layer is part of its `saved_bytes` when a backward
  pass needs it and is not counted again; one made by layer `e - 1` is `x_e`.
* `G_k` and `R_e` (`Chain.live_gradients`): gradients alive in the backward
  pass whatever the plan. `G_k` is alive while layer `k`'s backward pass runs:
  the parameter gradients `grad_bytes[k] + ... + grad_bytes[n-1]` (they stay
  until the optimizer step) plus the `carry_grads` `(i, j, bytes)` with
  `i < k <= j` (a skip tensor's gradient, made by the backward pass of its last
  consumer `j`; at its producer `i` it is part of the gradient of `x_{i+1}`),
  and for `k = 0` the optimizer's copies `update_workspace_bytes` (see the
  step's end below).
  `R_e` is alive while a segment ending at `e` runs forward again, after the
  backward pass of layer `e`: the parameter gradients of layers `e..n-1` plus
  the `carry_grads` with `i + 1 < e <= j`. Both add to backward-phase moments
  only.
* `U(j, e)`: the applied parameter gradients (`update_grad_bytes`, `u_i`)
  alive at the backward pass of layer `j` of an element ending at `e`. The
  gradient of layer `i` lives from its backward pass through those of the
  next `lag = Chain.UPDATE_LAG` layers (its update runs alongside them), and a
  segment holds those of its layers until its backward pass ends:
  `U(j, e) = u_j + ... + u_{m-1}` with `m = min(n, max(e, j + lag + 1))` (for
  a stored layer `e = j + 1`). While a segment ending at `e` runs forward
  again, `V_e = u_e + ... + u_{min(n, e + lag) - 1}` are alive.

Forward, elements in order (no gradients are live yet):

* stored layer `i`: while it runs, live = `H + saved_i + ws_i`; then `H += saved_i`.
* segment `[s, e)`: its layers run one after another and keep nothing but what
  later layers need: while layer `j` runs, live =
  `H + C(s, j) + (a_j if j > s else 0) + a_{j+1} + ws_j` (its input `a_s` is
  already held by its producer; `C(s, j)` are the carries made earlier in the
  segment and used at or after `j`); then `H += a_e + C(s, e)` (the segment
  keeps its output and the carries it hands on).

Backward, elements in reverse order; the gradient of the element's output,
`a_{last + 1}` bytes, is live:

* stored layer `i`: live = `H + a_{i+1} + g_i + ws_i + G_i + U(i, i + 1)`
  (gradients of the output and of the input, and the parameter gradients
  alive); then `H -= saved_i`.
* segment `[s, e)`: first `H -= a_e + C(s, e)` (the held outputs are dropped; the
  recompute makes fresh copies). The recompute may read a copy of its input,
  `K_s = input_copy_bytes[s]` (tfrecompute makes one after the incoming
  gradient, so that TensorFlow cannot merge the recompute with the forward;
  the first layer's backward may still read it), live through the segment's
  recompute and backward. Phase "recompute": layers `s..e-1` run forward
  again, each now stored, before any of them has produced gradients: while
  layer `j` runs, live = `H + K_s + a_e + S(s..j) + ws_j + R_e + V_e`. Then
  their backward, layer `j = e-1` down to `s`, as stored layers that keep
  their parameter gradients: live =
  `H + K_s + S(s..j) + a_{j+1} + g_j + ws_j + G_j + U(j, e)`, and `saved_j` is
  released after it.

The step ends with the optimizer update, when `H = a_0` and all parameter
gradients kept for it are live, with the copies the optimizer makes of them
(`W = update_workspace_bytes`: clipped or unscaled gradients):
`a_0 + R_0 + V_0 + W`. That moment is part of the model but is never above
the backward moment of layer 0 (the same plus `saved_0`, the gradients of
`x_1` and `x_0`, `ws_0` and `U(0, e) >= V_0`, as `G_0` counts `W`), so it is
folded into it: the timeline ends with the backward of layer 0.

The peak is the largest live value over every moment, forward and backward;
all arithmetic is on exact ints. The recompute cost is the sum of
`forward_cost` over the recomputed layers (an exactly rounded float sum).

Example:
    >>> from tfrecompute.strategies import Chain, simulate
    >>> chain = Chain.homogeneous(4, activation_bytes=100)
    >>> simulate(chain, [])          # store all: 4 held + input + 2 gradients
    Estimate(peak_bytes=700, recompute_cost=0.0)
    >>> simulate(chain, [(0, 2), (2, 4)])
    Estimate(peak_bytes=600, recompute_cost=4.0)
    >>> skip = Chain(100, [100] * 4, [100] * 4, [1.0] * 4, carries=[(0, 3, 100)],
    ...              grad_bytes=[10] * 4)
    >>> skip.carried_bytes(0, 2)     # [0, 2) also holds layer 0's output, used by layer 3
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

from tfrecompute.strategies._checks import fail
from tfrecompute.strategies.chain import Chain

__all__ = ["Estimate", "MemoryEvent", "Segments", "simulate", "timeline"]

Segments = Sequence[tuple[int, int]]
"""Half-open ranges `(start, stop)` of recomputed layers, sorted and disjoint."""

Phase = Literal["forward", "recompute", "backward"]


class MemoryEvent(NamedTuple):
    """One moment of a training step in the memory model.

    Attributes:
        phase: `"forward"`, `"recompute"` (a segment's forward run again during
            the backward pass) or `"backward"`.
        layer: index of the layer running.
        live_bytes: bytes live while it runs, `overhead_bytes` included.
    """

    phase: Phase
    layer: int
    live_bytes: int


class Estimate(NamedTuple):
    """What a plan costs in the memory model.

    Attributes:
        peak_bytes: the largest live memory over one training step.
        recompute_cost: summed `forward_cost` of the recomputed layers.
    """

    peak_bytes: int
    recompute_cost: float


def timeline(chain: Chain, segments: Iterable[Sequence[int]]) -> list[MemoryEvent]:
    """Replays one training step of a plan, moment by moment.

    Args:
        chain: the cost model.
        segments: sorted, disjoint half-open ranges `(start, stop)` of recomputed
            layers (adjacent ranges allowed).

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
    return [MemoryEvent._make(event) for event in _events(chain, checked)]


def simulate(chain: Chain, segments: Iterable[Sequence[int]]) -> Estimate:
    """Predicts the peak memory and the recompute cost of a plan.

    The peak is the maximum of `timeline(chain, segments)`; see the module
    docstring for the model.

    Args:
        chain: the cost model.
        segments: sorted, disjoint half-open ranges `(start, stop)` of recomputed
            layers.

    Returns:
        `Estimate(peak_bytes, recompute_cost)`.

    Raises:
        TypeError: `chain` is not a `Chain` or a segment is not a pair of ints.
        ValueError: segments are empty, overlapping, unsorted or out of range.

    Example:
        >>> simulate(Chain.homogeneous(2, activation_bytes=10), [(0, 2)])
        Estimate(peak_bytes=50, recompute_cost=2.0)
    """
    checked = check_segments("simulate", chain, segments)
    return estimate(chain, checked)


def estimate(chain: Chain, segments: tuple[tuple[int, int], ...]) -> Estimate:
    """`simulate` for segments already checked (private to the package)."""
    peak = max(live for _, _, live in _events(chain, segments))
    cost = math.fsum(chain.forward_cost[j] for s, e in segments for j in range(s, e))
    return Estimate(peak, cost)


def _events(
    chain: Chain, segments: tuple[tuple[int, int], ...]
) -> Iterator[tuple[Phase, int, int]]:
    """Generates the moments `(phase, layer, live_bytes)` of one training step.

    This is the one implementation of the memory model (see the module docstring).
    """
    out = chain.output_bytes
    saved = chain.saved_bytes
    work = chain.workspace_bytes
    base = chain.overhead_bytes
    act = (chain.input_bytes, *out)  # act[i] is the size of x_i
    grad_in = chain.input_grad_bytes  # grad_in[i]: the gradient layer i makes for x_i
    copies = chain.input_copy_bytes
    grads, regrads = chain.live_gradients()  # G_k, R_e
    n = chain.n
    lag = chain.UPDATE_LAG
    applied = [0, *itertools.accumulate(chain.update_grad_bytes)]  # prefix sums of u

    def updates(j: int, e: int) -> int:  # U(j, e)
        return applied[min(n, max(e, j + lag + 1))] - applied[j]

    elements = _elements(n, segments)
    carried: dict[int, list[int]] = {}  # segment start -> [C(s, s), ..., C(s, e)]
    none = [0] * (n + 1)  # the carry profile of any segment when there are no carries

    held = act[0]
    for s, e, recomputed in elements:
        if not recomputed:
            yield ("forward", s, base + held + saved[s] + work[s])
            held += saved[s]
            continue
        inside = carried[s] = carry_profile(chain, s, e) if chain.carries else none
        for j in range(s, e):
            transient = inside[j - s] + (act[j] if j > s else 0) + act[j + 1] + work[j]
            yield ("forward", j, base + held + transient)
        held += act[e] + inside[e - s]

    for s, e, recomputed in reversed(elements):
        if not recomputed:
            live = held + act[s + 1] + grad_in[s] + work[s] + grads[s] + updates(s, e)
            yield ("backward", s, base + live)
            held -= saved[s]
            continue
        held -= act[e] + carried[s][e - s]
        again = copies[s]  # K_s: the copy of x_s the recompute reads
        lagging = regrads[e] + applied[min(n, e + lag)] - applied[e]  # R_e + V_e
        for j in range(s, e):
            again += saved[j]
            yield ("recompute", j, base + held + act[e] + again + work[j] + lagging)
        for j in range(e - 1, s - 1, -1):
            live = held + again + act[j + 1] + grad_in[j] + work[j] + grads[j] + updates(j, e)
            yield ("backward", j, base + live)
            again -= saved[j]


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


def _elements(n: int, segments: tuple[tuple[int, int], ...]) -> list[tuple[int, int, bool]]:
    """The plan's elements in order: `(start, stop, recomputed)`."""
    elements: list[tuple[int, int, bool]] = []
    position = 0
    for s, e in segments:
        elements.extend((i, i + 1, False) for i in range(position, s))
        elements.append((s, e, True))
        position = e
    elements.extend((i, i + 1, False) for i in range(position, n))
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
    n = chain.n
    for item in segments:
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
                f"segment ({start}, {stop}) is outside the chain's layers 0..{n - 1}",
                "segments",
                segments,
                f"Keep 0 <= start < stop <= {n}",
            )
        if checked and start < checked[-1][1]:
            what = "overlap" if start >= checked[-1][0] else "are not sorted"
            fail(
                api,
                f"segments {checked[-1]} and ({start}, {stop}) {what}",
                "segments",
                segments,
                "Pass disjoint segments sorted by start",
            )
        checked.append((start, stop))
    return tuple(checked)
