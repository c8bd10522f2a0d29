"""A plan's training step replayed from a measured step storing everything.

NOTE [ Replaying a plan through the allocator ]
A plan's allocator peak is its buffers' bytes as the allocator rounds
them, and TensorFlow's BFC allocator rounds by where earlier buffers left
free space: it serves a request from the smallest free chunk that fits
and splits the chunk only if it is at least twice the request (or the rest
is at least 128 MiB). A step storing everything allocates its forward
buffers into fresh space and the rounding is small; a plan's step frees a
segment's buffers at its end and allocates again into that space, and its
buffers hold 7% to 29% more than they request at the peak of the held-out
default plans of BatchNorm CNNs (`benchmarks/results/held_out.md`). No
byte count of a link follows that, so a calibrated chain's plan is also
replayed:

1. The calibration's measured step gives every buffer of the step in
   order: the bytes it requested, when it was freed, the link whose
   layer's op made it, and whether that op is a forward op.
2. The plan's step is that sequence changed as the plan changes it: the
   forward buffers of a recomputed segment still held at the segment's
   forward end are freed there (all but the one its last link outputs);
   before the segment's first gradient buffer after the forward's last
   buffer (gradient ops that need no incoming gradient run early, from
   the step's start: a loop's accumulators) its forward buffers are
   allocated again, in order, and freed where the measured step freed
   them (the ones it freed before that point right away, its output at
   the recomputation's end). The segment's gradient buffers that ran
   early in the measured step are allocated there too: a block's gradient
   ops run in its backward. A segment none of whose gradient buffers
   shows after the forward is replayed as stored. An optimizer's update
   of a variable a forward op still reads copies it (storing everything,
   the backward holds the forward's read); a recomputed link's backward
   reads its variables again and the update runs in place, so the copy of
   a recomputed link's variable (placed by the last gradient buffer of its
   bytes before it) and the free of the buffer it replaced are left out.
3. That sequence runs through a simulation of the BFC allocator (allow
   growth: regions from 2 MiB, doubling) for `STEPS` steps in a row,
   after the model's and its optimizer's variables (`resident`, in
   creation order: they fill the first regions): a buffer freed that was
   allocated before its step (a variable's previous buffer, which an
   update replaces) is matched by its requested bytes. The replayed peak is the largest of
   the steps after the first, above the bytes in use before each, as
   `measure_step` reports it.

The measured order of ops is one of those TensorFlow's inter-op threads
can take (the same step's peak moves between processes), and a
recomputation's ops are taken to be the forward's: a recompute block's own
buffers are not in the measured step. How close the
replay comes is measured per plan in `benchmarks/results/held_out.md`
(*replayed*, and the default plans' spread over processes).
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import re
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

__all__ = ["STEPS", "Buffer", "recorded", "replayed_peak", "resident_bytes"]

STEPS = 4  # steps replayed in a row: one as the warm-up, three as `measure_step` measures
_MIN_CHUNK = 256  # the BFC allocator rounds every request up to a multiple of this
_SPLIT_ABOVE = 128 << 20  # a chunk is split when the rest is at least this, whatever the request
_FIRST_REGION = 2 << 20  # the first region under allow_growth; each new one doubles
_UPDATE = re.compile(r"(^|/)Assign(Add|Sub)?VariableOp(_\d+)?$")  # a variable's update


@dataclasses.dataclass(frozen=True)
class Buffer:
    """One allocator event of a measured step.

    Attributes:
        allocates: True for an allocation, False for a deallocation.
        address: the buffer's address (pairs an allocation with its free).
        requested: the bytes the tensor asked for.
        link: the chain link of the op that allocated it (None: no link's
            layer made it, or a deallocation).
        forward: whether a forward op (not a `gradient_tape/` one) made it.
        update: whether an optimizer's variable update made it (an `Assign*VariableOp`
            copying a variable a forward op still reads).
    """

    allocates: bool
    address: int
    requested: int
    link: int | None = None
    forward: bool = True
    update: bool = False


def recorded(
    events: Iterable[tuple[str, dict[str, Any]]], link_of_op: Callable[[str], int | None]
) -> tuple[Buffer, ...]:
    """A measured step's allocator events (`traced_events`) as `Buffer`s, each allocation
    placed on the link `link_of_op` gives its op."""
    buffers = []
    for name, stats in events:
        op = str(stats.get("tf_op", ""))
        allocates = name == "MemoryAllocation"
        buffers.append(
            Buffer(
                allocates=allocates,
                address=int(stats.get("addr", 0)),
                requested=int(stats.get("requested_bytes", 0)),
                link=link_of_op(op) if allocates else None,
                forward="gradient_tape" not in op,
                update=allocates and _UPDATE.search(op) is not None,
            )
        )
    return tuple(buffers)


def resident_bytes(variables: Iterable[Any], smallest: int) -> tuple[int, ...]:
    """The bytes of each variable the allocator holds between steps, in order: those of
    `smallest` bytes or more, which it counts (`costs.measured.counted_from`: oneDNN's CPU
    allocator serves buffers under 256 KiB outside the allocator replayed)."""
    sizes = (int(np.prod(v.shape)) * tf.as_dtype(str(v.dtype)).size for v in variables)
    return tuple(size for size in sizes if size >= smallest)


def replayed_peak(
    record: Sequence[Buffer],
    segments: Sequence[tuple[int, int]],
    output_bytes: Sequence[int],
    steps: int = STEPS,
    resident: Sequence[int] = (),
) -> int:
    """The allocator's peak of a plan's step replayed from a measured step storing
    everything (NOTE [ Replaying a plan through the allocator ]): `record` is that step,
    `segments` the plan's recomputed links, `output_bytes` the chain's per link."""
    events = _plan_events(record, segments, output_bytes)
    allocator = _BFC()
    carried: dict[int, collections.deque[Hashable]] = collections.defaultdict(collections.deque)
    for index, size in enumerate(resident):
        allocator.allocate(("resident", index), size)
        carried[size].append(("resident", index))
    peaks = []
    for step in range(steps):
        start = allocator.in_use
        allocator.peak = start
        live: dict[Hashable, int] = {}
        for allocates, key, requested in events:
            key = (step, key)
            if allocates:
                allocator.allocate(key, requested)
                live[key] = requested
            elif key in live:
                allocator.release(key)
                del live[key]
            elif key[1][0] == "before" and carried[requested]:
                allocator.release(carried[requested].popleft())
        carried = collections.defaultdict(collections.deque)
        for key, requested in live.items():
            carried[requested].append(key)
        peaks.append(allocator.peak - start)
    return max(peaks[1:] or peaks)


_Event = tuple[bool, Hashable, int]  # (allocates, key, requested bytes)


def _plan_events(
    record: Sequence[Buffer], segments: Sequence[tuple[int, int]], output_bytes: Sequence[int]
) -> list[_Event]:
    """The measured step's events as the plan changes them (step 2 of the NOTE): keys
    `("step", i)` for the measured buffer allocated at event i, `("again", i)` for its
    recomputation, `("before", address)` for a buffer allocated before the step."""
    segment_of = {
        link: k for k, (first, stop) in enumerate(segments) for link in range(first, stop)
    }
    freed = _freed_at(record)
    forward: dict[int, list[int]] = collections.defaultdict(list)
    ran_early: dict[int, list[int]] = collections.defaultdict(list)  # gradient buffers
    backward: dict[int, int] = {}  # segment -> its first gradient buffer's event
    linked = [i for i, b in enumerate(record) if b.allocates and b.link is not None]
    forward_end = max((i for i in linked if record[i].forward), default=-1)
    for i in linked:
        k = segment_of.get(record[i].link)  # type: ignore[arg-type]
        if k is not None and record[i].forward:
            forward[k].append(i)
        elif k is not None and i < forward_end:
            ran_early[k].append(i)
        elif k is not None:
            backward.setdefault(k, i)
    released: set[int] = set()
    moved: set[int] = set()
    after: dict[int, list[_Event]] = collections.defaultdict(list)
    before: dict[int, list[_Event]] = collections.defaultdict(list)
    for k, allocations in forward.items():
        if k not in backward:  # no gradient buffer shows where it would be recomputed: kept
            continue
        end, start = allocations[-1], backward[k]
        output = _output(record, allocations, segments[k][1] - 1, output_bytes)
        early = [i for i in allocations if i != output and freed.get(i, len(record)) > end]
        released.update(early)
        after[end] += [(False, ("step", i), 0) for i in early]
        before[start] += _recomputation(record, allocations, freed, start, set(early))
        before[start] += _run_late(record, ran_early[k], freed, start)
        moved.update(ran_early[k])
    in_place = _in_place_updates(record, set(segment_of), freed)
    return _merged(record, before, after, released, moved, in_place)


def _in_place_updates(
    record: Sequence[Buffer], recomputed: set[int], freed: dict[int, int]
) -> set[int]:
    """The events of the variable updates a plan makes in place (step 2 of the NOTE): each
    update's copy of a recomputed link's variable (the link of the last gradient buffer of
    the copy's bytes before it) and the free of the buffer it replaced, the next free of
    those bytes of a buffer allocated before the step (one no allocation of `freed`'s)."""
    in_step = set(freed.values())  # frees of buffers the step allocated
    gradient_link: dict[int, int] = {}  # bytes -> link of the last gradient buffer of them
    waiting: dict[int, collections.deque[int]] = collections.defaultdict(collections.deque)
    dropped: set[int] = set()
    for i, buffer in enumerate(record):
        if buffer.allocates:
            if buffer.update and gradient_link.get(buffer.requested) in recomputed:
                waiting[buffer.requested].append(i)
            elif not buffer.forward and buffer.link is not None:
                gradient_link[buffer.requested] = buffer.link
        elif i not in in_step and waiting[buffer.requested]:
            dropped.update((waiting[buffer.requested].popleft(), i))
    return dropped


def _run_late(
    record: Sequence[Buffer], indices: list[int], freed: dict[int, int], start: int
) -> list[_Event]:
    """A recomputed segment's gradient buffers that ran early in the measured step (they
    need no incoming gradient), allocated with its recomputation instead: a block's
    gradient ops run in its backward. One the measured step freed before is freed at once."""
    events: list[_Event] = []
    for i in indices:
        events.append((True, ("step", i), record[i].requested))
        if freed.get(i, len(record)) < start:
            events.append((False, ("step", i), 0))
    return events


def _freed_at(record: Sequence[Buffer]) -> dict[int, int]:
    """Allocation event -> the event that freed it (buffers never freed are left out)."""
    live: dict[int, int] = {}
    freed = {}
    for i, buffer in enumerate(record):
        if buffer.allocates:
            live[buffer.address] = i
        elif buffer.address in live:
            freed[live.pop(buffer.address)] = i
    return freed


def _output(
    record: Sequence[Buffer], allocations: list[int], last: int, output_bytes: Sequence[int]
) -> int | None:
    """The allocation of a segment's output: its last link's last forward buffer of the
    link's output bytes, else that link's last forward buffer (None: it made none)."""
    own = [i for i in allocations if record[i].link == last]
    sized = [i for i in own if record[i].requested == output_bytes[last]]
    return (sized or own or [None])[-1]


def _recomputation(
    record: Sequence[Buffer],
    allocations: list[int],
    freed: dict[int, int],
    start: int,
    early: set[int],
) -> list[_Event]:
    """A segment's forward buffers allocated again at `start`, before its backward: those
    the measured step freed before `start` freed right away, its output at the end, the
    rest where the measured step freed them."""
    events: list[_Event] = []
    kept_to_end = []
    for i in allocations:
        events.append((True, ("again", i), record[i].requested))
        if freed.get(i, len(record)) < start:
            events.append((False, ("again", i), 0))
        elif i not in early:
            kept_to_end.append((False, ("again", i), 0))
    return events + kept_to_end


def _merged(
    record: Sequence[Buffer],
    before: dict[int, list[_Event]],
    after: dict[int, list[_Event]],
    released: set[int],
    moved: set[int] = frozenset(),  # type: ignore[assignment]
    dropped: set[int] = frozenset(),  # type: ignore[assignment]
) -> list[_Event]:
    """The measured events with the plan's inserted before and after them; a buffer
    released early is freed as its recomputation where the step freed it; one `moved`
    is allocated where `before` has it instead; events `dropped` do not happen."""
    events: list[_Event] = []
    live: dict[int, int] = {}
    for i, buffer in enumerate(record):
        events += before.get(i, [])
        if buffer.allocates:
            live[buffer.address] = i
            if i not in moved and i not in dropped:
                events.append((True, ("step", i), buffer.requested))
        elif i not in dropped:
            j = live.pop(buffer.address, None)
            if j is None:
                events.append((False, ("before", buffer.address), buffer.requested))
            elif j not in dropped:
                events.append((False, ("again" if j in released else "step", j), 0))
        events += after.get(i, [])
    return events


class _BFC:
    """TensorFlow's best-fit-with-coalescing allocator, as far as its bytes in use go:
    chunks in regions, a request served from the smallest free chunk that fits (lowest
    address among equals), split when the chunk is at least twice the rounded request or
    the rest at least 128 MiB, and freed chunks merged with free neighbours."""

    def __init__(self) -> None:
        self.region = _FIRST_REGION
        self.next_region = 0
        self.free: list[tuple[int, int]] = []  # (size, address), sorted
        self.chunks: dict[int, list[Any]] = {}  # address -> [size, in use, previous, next]
        self.at: dict[Hashable, int] = {}  # key -> address
        self.in_use = self.peak = 0

    def allocate(self, key: Hashable, requested: int) -> None:
        rounded = max(_MIN_CHUNK, -(-requested // _MIN_CHUNK) * _MIN_CHUNK)
        index = bisect.bisect_left(self.free, (rounded, -1))
        if index == len(self.free):
            self._extend(rounded)
            index = bisect.bisect_left(self.free, (rounded, -1))
        size, address = self.free.pop(index)
        chunk = self.chunks[address]
        if size >= 2 * rounded or size - rounded >= _SPLIT_ABOVE:
            rest = address + rounded
            self.chunks[rest] = [size - rounded, False, address, chunk[3]]
            if chunk[3] is not None:
                self.chunks[chunk[3]][2] = rest
            chunk[0], chunk[3] = rounded, rest
            bisect.insort(self.free, (size - rounded, rest))
        chunk[1] = True
        self.at[key] = address
        self.in_use += chunk[0]
        self.peak = max(self.peak, self.in_use)

    def release(self, key: Hashable) -> None:
        address = self.at.pop(key)
        chunk = self.chunks[address]
        chunk[1] = False
        self.in_use -= chunk[0]
        following = chunk[3]
        if following is not None and not self.chunks[following][1]:
            self.free.remove((self.chunks[following][0], following))
            self._absorb(address, following)
        previous = chunk[2]
        if previous is not None and not self.chunks[previous][1]:
            self.free.remove((self.chunks[previous][0], previous))
            self._absorb(previous, address)
            address = previous
        bisect.insort(self.free, (self.chunks[address][0], address))

    def _absorb(self, first: int, second: int) -> None:
        """Chunk `second` merged into `first`, its neighbour below (both out of `free`)."""
        other = self.chunks.pop(second)
        chunk = self.chunks[first]
        chunk[0] += other[0]
        chunk[3] = other[3]
        if other[3] is not None:
            self.chunks[other[3]][2] = first

    def _extend(self, rounded: int) -> None:
        """A new region holding at least `rounded` bytes (TensorFlow's `Extend`)."""
        grew = False
        while rounded > self.region:
            self.region *= 2
            grew = True
        address = self.next_region
        self.next_region += self.region + _MIN_CHUNK  # a gap: regions never merge
        self.chunks[address] = [self.region, False, None, None]
        bisect.insort(self.free, (self.region, address))
        if not grew:
            self.region *= 2
