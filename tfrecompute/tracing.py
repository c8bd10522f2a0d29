"""What is live at a training step's peak: `trace_step`.

`measure_step` reads the allocator's peak; `trace_step` also says what made
it. It records every allocation and deallocation of one compiled step with
TensorFlow's profiler (the allocator's `MemoryAllocation` and
`MemoryDeallocation` events, which its default host tracer records) and
replays them in time order.

NOTE [ Requested and allocated bytes ]
TensorFlow's BFC allocator (the CPU allocator under oneDNN, and the GPU
allocator) serves a request from the smallest free chunk that fits, and only
splits that chunk when it is at least twice the request (or the rest is at
least 128 MiB). So a tensor can hold up to twice its own bytes: an 8 MiB
activation placed in a 12 MiB hole left by an earlier step holds 12 MiB. The
allocator's peak counts chunks; the bytes the tensors asked for are the
"requested" peak. The difference depends on where earlier steps left free
space (variables updated by copy-on-write move every step), so it varies from
step to step of the same model. The planner's memory model predicts requested
bytes; this module measures both.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import os
import tempfile
from typing import Any

import keras
import tensorflow as tf

from tfrecompute.profiling import prepare_step

__all__ = ["Allocation", "StepTrace", "trace_step"]


@dataclasses.dataclass(frozen=True)
class Allocation:
    """One buffer the step allocated and still held at its peak.

    Attributes:
        op: name of the TensorFlow op that allocated it (forward ops carry
            the layer's name; gradient ops start with `gradient_tape/`).
        shape: the tensor's shape as TensorFlow printed it, e.g. `"[32,64]"`.
        requested_bytes: the bytes the tensor asked for.
        allocated_bytes: the bytes of the allocator chunk it holds.
    """

    op: str
    shape: str
    requested_bytes: int
    allocated_bytes: int


@dataclasses.dataclass(frozen=True)
class StepTrace:
    """One traced training step.

    Attributes:
        peak_bytes: the allocator's peak minus the bytes in use before the
            step, as `measure_step` reports it.
        requested_peak_bytes: the most bytes the step's live tensors asked
            for at any moment, above what they had asked for before the step:
            the peak without the allocator's rounding of chunks (NOTE [
            Requested and allocated bytes ] in this module), which is what the
            planner's memory model predicts. It can fall at another moment
            than the allocator's peak, and even exceed it when the step frees
            buffers of an earlier step that held more than they asked for.
        live_at_peak: the buffers allocated during the step and live at the
            peak, largest first.
        device: the device whose allocator was traced.
    """

    peak_bytes: int
    requested_peak_bytes: int
    live_at_peak: tuple[Allocation, ...]
    device: str

    @property
    def allocator_overhead_bytes(self) -> int:
        """`peak_bytes - requested_peak_bytes`: what the allocator's rounding added."""
        return self.peak_bytes - self.requested_peak_bytes

    def summary(self, top: int = 10) -> str:
        """The peak and its `top` largest live buffers, one per line."""
        mib = 2**20
        lines = [
            f"peak {self.peak_bytes / mib:.1f} MiB on {self.device} "
            f"({self.requested_peak_bytes / mib:.1f} MiB requested, "
            f"{self.allocator_overhead_bytes / mib:.1f} MiB allocator rounding)"
        ]
        for a in self.live_at_peak[:top]:
            lines.append(
                f"  {a.allocated_bytes / mib:8.2f} MiB ({a.requested_bytes / mib:.2f} requested) "
                f"{a.shape} {a.op}"
            )
        return "\n".join(lines)


def _allocator_matches(name: str, device: str) -> bool:
    name = name.lower()
    kind, _, index = device.replace("/device:", "").lower().partition(":")
    if kind == "gpu":
        return name.startswith(f"gpu_{index or '0'}_")
    return not name.startswith("gpu")


def _memory_events(logdir: str, device: str) -> list[tuple[str, dict[str, Any]]]:
    """The allocator events of a profile, in time order, as (name, stats)."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    paths = glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True)
    if not paths:
        raise RuntimeError(
            f"trace_step: TensorFlow's profiler wrote no trace. Received: logdir={logdir!r} "
            "(of type str). Check that TensorFlow was built with its profiler."
        )
    space = xplane_pb2.XSpace()
    with open(max(paths, key=os.path.getmtime), "rb") as f:
        space.ParseFromString(f.read())
    events = []
    for plane in space.planes:
        event_names = {k: v.name for k, v in plane.event_metadata.items()}
        stat_names = {k: v.name for k, v in plane.stat_metadata.items()}
        for line_index, line in enumerate(plane.lines):
            for position, event in enumerate(line.events):
                name = event_names.get(event.metadata_id, "")
                if name not in ("MemoryAllocation", "MemoryDeallocation"):
                    continue
                stats: dict[str, Any] = {}
                for stat in event.stats:
                    kind = stat.WhichOneof("value")
                    value = getattr(stat, kind) if kind else None
                    if kind == "ref_value":
                        value = stat_names.get(value, "")
                    stats[stat_names.get(stat.metadata_id, "")] = value
                if not _allocator_matches(str(stats.get("allocator_name", "")), device):
                    continue
                time_ps = line.timestamp_ns * 1000 + event.offset_ps
                events.append(((time_ps, line_index, position), name, stats))
    # One allocator's events: its count of bytes in use is what is replayed.
    allocators = collections.Counter(str(e[2].get("allocator_name", "")) for e in events)
    if len(allocators) > 1:
        busiest = allocators.most_common(1)[0][0]
        events = [e for e in events if e[2].get("allocator_name") == busiest]
    events.sort(key=lambda e: e[0])
    return [(name, stats) for _, name, stats in events]


@dataclasses.dataclass(frozen=True)
class _Replay:
    peak: int  # the most bytes in use above the first event's starting point
    requested_peak: int  # the most bytes requested above the same point
    live_at_peak: tuple[Allocation, ...]


def _replay(events: list[tuple[str, dict[str, Any]]]) -> _Replay:
    """Replays allocator events in time order (see `trace_step`).

    Every event carries its buffer's requested and allocated bytes, also the
    deallocation of a buffer made before the trace began (a variable's
    previous buffer, freed when an update copies it), so both running sums are
    exact. The live set only knows buffers allocated during the trace.
    """
    live: dict[int, Allocation] = {}
    allocated = requested = 0
    peak = requested_peak = 0
    top_live: dict[int, Allocation] = {}
    for name, stats in events:
        address = int(stats.get("addr", 0))
        chunk = int(stats.get("allocation_bytes", 0))
        asked = int(stats.get("requested_bytes", 0))
        if name == "MemoryAllocation":
            allocated += chunk
            requested += asked
            live[address] = Allocation(
                op=str(stats.get("tf_op", "")),
                shape=str(stats.get("shape", "")),
                requested_bytes=asked,
                allocated_bytes=chunk,
            )
        else:
            allocated -= chunk
            requested -= asked
            live.pop(address, None)
        requested_peak = max(requested_peak, requested)
        if allocated > peak:
            peak, top_live = allocated, dict(live)
    return _Replay(
        peak=peak,
        requested_peak=requested_peak,
        live_at_peak=tuple(sorted(top_live.values(), key=lambda a: -a.allocated_bytes)),
    )


def trace_step(
    model: keras.Model,
    x: Any,
    y: Any = None,
    *,
    warmup: int = 2,
    device: str | None = None,
) -> StepTrace:
    """Runs one compiled training step under TensorFlow's profiler and finds its peak.

    Runs `warmup` steps, then one more with the profiler recording the
    allocator's events, and replays them: the moment the allocator's bytes in
    use were highest and which of the step's buffers were live then, and the
    most bytes the live tensors requested at any moment (NOTE [ Requested and
    allocated bytes ] in `tfrecompute.tracing`). The traced step runs a little
    slower; its peak is that of an untraced step, which varies from step to
    step.

    Args:
        model: a built, compiled Keras model.
        x: one batch of inputs.
        y: one batch of targets.
        warmup: steps to run before the traced one (>= 1); the default 2
            lets the allocator settle after the first step's tracing.
        device: the device to trace, `"CPU:0"` or `"GPU:0"`; by default the
            first GPU when there is one, else the CPU.

    Returns:
        A `StepTrace`; `summary()` prints the peak and its largest buffers.

    Raises:
        TypeError: `model` is not a Keras model, or `device` not a string.
        ValueError: the model is not compiled, `x` is missing, `warmup` is
            not a positive integer, or the device does not exist.
        RuntimeError: another TensorFlow profiler session is running, or
            the trace recorded no allocation.

    Example:

    ```python
    model.compile(optimizer="sgd", loss="mse")
    trace = tfrecompute.trace_step(model, x, y)
    print(trace.summary())
    ```
    """
    x, y, device = prepare_step("trace_step", model, x, y, warmup=warmup, device=device)
    with tempfile.TemporaryDirectory(prefix="tfrecompute-trace-") as logdir:
        # The default host tracer level records the allocator's events.
        try:
            tf.profiler.experimental.start(logdir)
        except tf.errors.AlreadyExistsError as error:
            raise RuntimeError(
                "trace_step: another TensorFlow profiler session is running, and TensorFlow "
                f"runs one at a time. Received: model={model.name!r} (of type "
                f"{type(model).__name__}). Stop it with tf.profiler.experimental.stop() first."
            ) from error
        try:
            before = tf.config.experimental.get_memory_info(device)["current"]
            tf.config.experimental.reset_memory_stats(device)
            model.train_on_batch(x, y)
            peak = tf.config.experimental.get_memory_info(device)["peak"] - before
        finally:
            tf.profiler.experimental.stop()
        events = _memory_events(logdir, device)
    if not events:
        hint = (
            "TensorFlow's CPU allocator traces allocations of 256 KiB or more; trace a "
            "larger batch."
            if device.upper().replace("/DEVICE:", "").startswith("CPU")
            else "The GPU allocator must be TensorFlow's BFC allocator (TF_GPU_ALLOCATOR "
            "unset); cuda_malloc_async records no such events."
        )
        raise RuntimeError(
            f"trace_step: the profiler recorded no allocation on {device}. Received: "
            f"model={model.name!r} (of type {type(model).__name__}). {hint}"
        )
    replay = _replay(events)
    return StepTrace(
        peak_bytes=int(peak),
        requested_peak_bytes=replay.requested_peak,
        live_at_peak=replay.live_at_peak,
        device=device,
    )
