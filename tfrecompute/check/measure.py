"""Measuring what a training step really costs: `measure_step` and `trace_step`.

`measure_step` runs the model's compiled train step and reads the allocator's
peak and the step's time; `trace_step` also says what made the peak. It
records every allocation and deallocation of one step with TensorFlow's
profiler (the allocator's `MemoryAllocation` and `MemoryDeallocation`
events, which its default host tracer records) and replays them in time
order. Both run steps through `_run_step`, the one measured step.

NOTE [ Requested and allocated bytes ]
TensorFlow's BFC allocator (the CPU allocator under oneDNN or with
`TF_CPU_ALLOCATOR_USE_BFC=true`, and the GPU allocator) serves a request from
the smallest free chunk that fits, and only splits that chunk when it is at
least twice the request (or the rest is at least 128 MiB). So a tensor can
hold up to twice its own bytes: an 8 MiB activation placed in a 12 MiB hole
left by an earlier step holds 12 MiB. The allocator's peak counts chunks; the
bytes the tensors asked for are the "requested" peak. The difference depends
on where earlier steps left free space (variables updated by copy-on-write
move every step), so it varies from step to step of the same model. The
planner's memory model predicts requested bytes; this module measures both.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import os
import statistics
import tempfile
import time
import warnings
from typing import Any

import keras
import tensorflow as tf

from tfrecompute._keras_internals import xplane_pb2
from tfrecompute._messages import as_positive_int, fail, received
from tfrecompute.costs.measured import counted_from, memory_info
from tfrecompute.strategies import format_bytes

__all__ = [
    "Allocation",
    "StepMeasurement",
    "StepTrace",
    "default_device",
    "measure_step",
    "trace_step",
]


@dataclasses.dataclass(frozen=True)
class StepMeasurement:
    """What one compiled training step cost.

    Attributes:
        peak_bytes: the allocator's peak during the step minus the bytes in use
            just before it: the memory the step added (activations, gradients,
            optimizer temporaries).
        seconds: median wall time of the measured steps.
        device: the device whose allocator was read, e.g. `"CPU:0"`.
        steps: how many steps were measured (after the warm-up).
        cpu_seconds: median CPU time of the process over the measured steps
            (`time.process_time`, all threads). On a shared machine the wall
            time of the same step varies by 2x as neighbours come and go; the
            CPU time is stable, so compare variants by it.
    """

    peak_bytes: int
    seconds: float
    device: str
    steps: int
    cpu_seconds: float = 0.0


def default_device() -> str:
    """`"GPU:0"` when TensorFlow sees a GPU, else `"CPU:0"`."""
    return "GPU:0" if tf.config.list_logical_devices("GPU") else "CPU:0"


def _device(api: str, device: Any) -> tf.DeviceSpec:
    """The device to measure, checked against TensorFlow's logical devices."""
    if device is not None and not isinstance(device, str):
        fail(
            api,
            "`device` must be a device name",
            "device",
            device,
            'Pass e.g. device="GPU:0" or "CPU:0"',
            error=TypeError,
        )
    name = device or default_device()
    known = [tf.DeviceSpec.from_string(d.name) for d in tf.config.list_logical_devices()]
    try:
        spec = tf.DeviceSpec.from_string(name)
    except ValueError:
        spec = None
    if spec is not None and spec.device_index is None:
        spec = spec.replace(device_index=0)
    if spec is None or not any(
        (k.device_type, k.device_index) == (spec.device_type, spec.device_index) for k in known
    ):
        names = [f"{k.device_type}:{k.device_index}" for k in known]
        fail(api, f"no {name} device is available", "device", name, f"Use one of {names}")
    return tf.DeviceSpec(device_type=spec.device_type, device_index=spec.device_index)


def _device_name(device: tf.DeviceSpec) -> str:
    """`"CPU:0"`: the name `tf.config.experimental.get_memory_info` takes."""
    return f"{device.device_type}:{device.device_index}"


def _prepare_step(
    api: str, model: Any, x: Any, y: Any, *, warmup: int, device: Any
) -> tuple[Any, Any, tf.DeviceSpec]:
    """Checks a step's arguments, converts the batch and runs the warm-up steps."""
    if not isinstance(model, keras.Model):
        fail(
            api,
            "`model` must be a Keras model",
            "model",
            model,
            "Pass a keras.Model",
            error=TypeError,
        )
    if not getattr(model, "compiled", False):
        fail(
            api,
            "the model is not compiled",
            "model",
            model,
            "Call model.compile(optimizer=..., loss=...) first, e.g. "
            'model.compile(optimizer="sgd", loss="mse")',
            by_name=True,
        )
    as_positive_int(api, "warmup", warmup, example="warmup=1")
    if x is None:
        fail(api, "`x` is missing", "x", x, "Pass one batch of inputs, e.g. x[:batch_size]")
    spec = _device(api, device)
    with tf.device(spec.to_string()):
        x = keras.tree.map_structure(tf.convert_to_tensor, x)
        if y is not None:
            y = keras.tree.map_structure(tf.convert_to_tensor, y)
    for _ in range(warmup):
        model.train_on_batch(x, y)
    return x, y, spec


@dataclasses.dataclass(frozen=True)
class _Step:
    peak_bytes: int  # the allocator's peak above the bytes in use before the step
    seconds: float  # wall time
    cpu_seconds: float  # CPU time of the process (all threads)


def _run_step(api: str, model: keras.Model, x: Any, y: Any, device: tf.DeviceSpec) -> _Step:
    """Runs one compiled training step from a reset allocator peak; returns what it took."""
    name = _device_name(device)
    before = memory_info(api, name)["current"]
    tf.config.experimental.reset_memory_stats(name)
    wall, cpu = time.perf_counter(), time.process_time()
    model.train_on_batch(x, y)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    peak = memory_info(api, name)["peak"] - before
    return _Step(int(peak), wall, cpu)


def measure_step(
    model: keras.Model,
    x: Any,
    y: Any = None,
    *,
    steps: int = 3,
    warmup: int = 1,
    device: str | None = None,
) -> StepMeasurement:
    """Runs compiled training steps and measures their peak memory and time.

    The model's own compiled train function runs (graph mode unless the model
    was compiled with `run_eagerly=True`, XLA if `jit_compile=True`): the same
    step `model.fit` runs. The first `warmup` steps trace the function and
    create the optimizer's variables; then, for each measured step, the
    allocator's peak is reset, the step runs, and the peak above the bytes in
    use before the step is recorded. The largest of those peaks is returned.

    On CPUs where TensorFlow runs oneDNN, its allocator's statistics leave out
    allocations smaller than 256 KiB (measured with tensorflow 2.21), and
    every allocator rounds sizes up to its bins, so use batches large enough
    for activations to be counted; a step that recorded nothing warns.

    For a model built in a `tf.distribute` strategy's scope, Keras's
    `train_on_batch` gives every replica the whole batch `x` (`fit` splits
    its batch): the peak is that of one replica's step on `len(x)` rows, a
    `fit` batch of `num_replicas_in_sync * len(x)`, read from `device`'s
    allocator (replica 0's GPU). Logical CPU devices share one allocator,
    so there the peak is the replicas' together.

    Args:
        model: a built, compiled Keras model.
        x: one batch of inputs (converted to tensors before measuring).
        y: one batch of targets.
        steps: how many steps to measure after the warm-up (>= 1).
        warmup: how many steps to run before measuring (>= 1: the first step
            traces the function and allocates optimizer state).
        device: the device whose allocator to read, `"CPU:0"` or `"GPU:0"`;
            by default the first GPU when there is one, else the CPU.

    Returns:
        A `StepMeasurement`: the largest peak, the median wall and CPU times.

    Raises:
        TypeError: `model` is not a Keras model, `device` not a string, or
            `steps` or `warmup` not an int.
        ValueError: the model is not compiled, `x` is missing, `steps` or
            `warmup` is below 1, or the device does not exist.

    Example:

    ```python
    model.compile(optimizer="sgd", loss="mse")
    m = tfrecompute.measure_step(model, x, y)
    print(f"{m.peak_bytes / 2**20:.1f} MiB in {m.seconds * 1e3:.1f} ms")
    ```
    """
    return measured_step("measure_step", model, x, y, steps=steps, warmup=warmup, device=device)


def measured_step(
    api: str, model: Any, x: Any, y: Any, *, steps: int, warmup: int = 1, device: Any = None
) -> StepMeasurement:
    """`measure_step` for an API that measures a step of its own: errors name `api`."""
    as_positive_int(api, "steps", steps, example="steps=3")
    x, y, spec = _prepare_step(api, model, x, y, warmup=warmup, device=device)
    measured = [_run_step(api, model, x, y, spec) for _ in range(steps)]
    device = _device_name(spec)
    peak = max(step.peak_bytes for step in measured)
    if peak <= 0:
        why = (
            "TensorFlow's oneDNN CPU allocator leaves out allocations smaller than 256 KiB"
            if counted_from(api, device)
            else "its tensors may be too few or too small to show"
        )
        warnings.warn(
            f"{api}: the {device} allocator recorded no memory for the step of "
            f"model {model.name!r}. {why}; measure with a larger batch.",
            stacklevel=3,
        )
    return StepMeasurement(
        peak_bytes=peak,
        seconds=statistics.median(step.seconds for step in measured),
        device=device,
        steps=steps,
        cpu_seconds=statistics.median(step.cpu_seconds for step in measured),
    )


# ------------------------------------------------------------------ tracing


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
        lines = [
            f"peak {format_bytes(self.peak_bytes)} on {self.device} "
            f"({format_bytes(self.requested_peak_bytes)} requested, "
            f"{format_bytes(self.allocator_overhead_bytes)} allocator rounding)"
        ]
        for a in self.live_at_peak[:top]:
            lines.append(
                f"  {format_bytes(a.allocated_bytes):>10} ({format_bytes(a.requested_bytes)} "
                f"requested) {a.shape} {a.op}"
            )
        return "\n".join(lines)


def _allocator_matches(name: str, device: tf.DeviceSpec) -> bool:
    """Whether the allocator called `name` in a trace serves `device`."""
    name = name.lower()
    if device.device_type == "GPU":
        return name.startswith(f"gpu_{device.device_index}_")
    return not name.startswith("gpu")


def _memory_events(logdir: str, device: tf.DeviceSpec) -> list[tuple[str, dict[str, Any]]]:
    """The allocator events of a profile, in time order, as (name, stats)."""
    paths = glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True)
    if not paths:
        fail(
            "trace_step",
            "TensorFlow's profiler wrote no trace",
            "logdir",
            logdir,
            "Check that TensorFlow was built with its profiler",
            error=RuntimeError,
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


def requested_peak(events: list[tuple[str, dict[str, Any]]]) -> int:
    """The most bytes the traced buffers requested at once, above the first event's start."""
    return _replay(events).requested_peak


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
        TypeError: `model` is not a Keras model, `device` not a string, or
            `warmup` not an int.
        ValueError: the model is not compiled, `x` is missing, `warmup` is
            below 1, or the device does not exist.
        RuntimeError: another TensorFlow profiler session is running, or
            the trace recorded no allocation.

    Example:

    ```python
    model.compile(optimizer="sgd", loss="mse")
    trace = tfrecompute.trace_step(model, x, y)
    print(trace.summary())
    ```
    """
    step, events, spec = traced_events("trace_step", model, x, y, warmup=warmup, device=device)
    replay = _replay(events)
    return StepTrace(
        peak_bytes=step.peak_bytes,
        requested_peak_bytes=replay.requested_peak,
        live_at_peak=replay.live_at_peak,
        device=_device_name(spec),
    )


def traced_events(
    api: str, model: keras.Model, x: Any, y: Any, *, warmup: int = 2, device: Any = None
) -> tuple[_Step, list[tuple[str, dict[str, Any]]], tf.DeviceSpec]:
    """One compiled train step under the profiler (see `trace_step`): the step, its
    allocator's events in time order as `(name, stats)`, and the device traced."""
    x, y, spec = _prepare_step(api, model, x, y, warmup=warmup, device=device)
    with tempfile.TemporaryDirectory(prefix="tfrecompute-trace-") as logdir:
        # The default host tracer level records the allocator's events.
        try:
            tf.profiler.experimental.start(logdir)
        except tf.errors.AlreadyExistsError as error:
            raise RuntimeError(
                f"{api}: another TensorFlow profiler session is running, and TensorFlow "
                f"runs one at a time. {received('model', model, by_name=True)}. Stop it with "
                "tf.profiler.experimental.stop() first."
            ) from error
        try:
            step = _run_step(api, model, x, y, spec)
        finally:
            tf.profiler.experimental.stop()
        events = _memory_events(logdir, spec)
    device = _device_name(spec)
    if not events:
        if spec.device_type != "CPU":
            hint = (
                "The GPU allocator must be TensorFlow's BFC allocator (TF_GPU_ALLOCATOR "
                "unset); cuda_malloc_async records no such events"
            )
        elif counted_from(api, device):
            hint = (
                "TensorFlow's oneDNN CPU allocator traces allocations of 256 KiB or more; "
                "trace a larger batch"
            )
        else:
            hint = "Trace a larger batch"
        fail(
            api,
            f"the profiler recorded no allocation on {device}",
            "model",
            model,
            hint,
            error=RuntimeError,
            by_name=True,
        )
    return step, events, spec
