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
`a_{i+1} = output_bytes[i]`), `saved_i`, `ws_i` for `saved_bytes[i]` and
`workspace_bytes[i]`. `overhead_bytes` is added to every moment below. `H` is
the memory held between layers; it starts at `a_0`.

Forward, elements in order:

* stored layer `i`: while it runs, live = `H + saved_i + ws_i`; then `H += saved_i`.
* segment `[s, e)`: its layers run one after another and keep nothing; while
  layer `j` runs, live = `H + (a_j if j > s else 0) + a_{j+1} + ws_j` (its input
  `a_s` is already held by its producer); then `H += a_e` (the segment keeps
  only its output).

Backward, elements in reverse order; the gradient of the element's output,
`a_{last + 1}` bytes, is live:

* stored layer `i`: live = `H + a_{i+1} + a_i + ws_i` (gradient of the output
  and of the input); then `H -= saved_i`.
* segment `[s, e)`: first `H -= a_e` (the held output is dropped; the
  recompute makes a fresh copy). Phase "recompute": layers `s..e-1` run
  forward again, each now stored: while layer `j` runs, live =
  `H + a_e + (saved_s + ... + saved_j) + ws_j`. Then their backward, layer
  `j = e-1` down to `s`, as stored layers: live =
  `H + (saved_s + ... + saved_j) + a_{j+1} + a_j + ws_j`, and `saved_j` is
  released after it.

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
"""

from __future__ import annotations

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
    elements = _elements(chain.n, segments)

    held = act[0]
    for s, e, recomputed in elements:
        if not recomputed:
            yield ("forward", s, base + held + saved[s] + work[s])
            held += saved[s]
            continue
        for j in range(s, e):
            transient = (act[j] if j > s else 0) + act[j + 1] + work[j]
            yield ("forward", j, base + held + transient)
        held += act[e]

    for s, e, recomputed in reversed(elements):
        if not recomputed:
            yield ("backward", s, base + held + act[s + 1] + act[s] + work[s])
            held -= saved[s]
            continue
        held -= act[e]
        again = 0
        for j in range(s, e):
            again += saved[j]
            yield ("recompute", j, base + held + act[e] + again + work[j])
        for j in range(e - 1, s - 1, -1):
            yield ("backward", j, base + held + again + act[j + 1] + act[j] + work[j])
            again -= saved[j]


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


def check_segments(api: str, chain: object, segments: object) -> tuple[tuple[int, int], ...]:
    """Validates segments against a chain; returns them as a tuple of int pairs."""
    if not isinstance(chain, Chain):
        fail(
            api,
            "chain must be a Chain",
            "chain",
            chain,
            "Build one with tfrecompute.strategies.Chain(...)",
            error=TypeError,
        )
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
