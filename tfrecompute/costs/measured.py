"""Measured per-call costs: run a call's forward and backward and read the allocator.

`call_memory` reads what a call keeps from its traced gradient graph, without
running it. Where that reading cannot see (NOTE [ Calls the graph does not
show ] in `tfrecompute.costs.call_memory`: XLA-compiled functions, custom gradients,
shapes known only at run time), or everywhere when asked
(`profile(..., measure=True)`), `measure_call` runs the call's forward and
backward once on tensors of the real shapes and reads the device allocator's
peak above the inputs; `corrected` turns that into the call's workspace.
`profile` caches both per distinct call (NOTE [ Calls that cost the same ] in
`tfrecompute.graph.layer_graph`), as it does the static reading, and the
measurement runs the step that reading traced (`traced_call_memory`).

NOTE [ A call's measured workspace ]
The step function returns the call's outputs, the gradients it makes (of
its floating inputs and trainable variables) and is given the output
gradients: all of them live at the end of its backward, all of them bytes the
chain counts elsewhere (`Chain.output_bytes`, `input_grad_bytes`, the weight
gradients). What the peak holds above those and the activations the
call keeps (`CallMemory.kept_bytes`) is memory the backward needs on top:
the workspace. A measured workspace never lowers the one read from the
graph (oneDNN's CPU allocator's statistics leave out allocations under 256 KiB).
The layer's non-trainable state (BatchNorm statistics, seed generators)
is restored after the run.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfrecompute._keras_internals import call_has_training_arg
from tfrecompute._messages import cause, fail
from tfrecompute.costs.call_memory import CallMemory, TracedStep
from tfrecompute.graph.layer_graph import tensor_bytes, trainable_variables
from tfrecompute.startup import COUNTING_FIX, CPU_ALLOCATOR_VARIABLE, bfc_cpu_allocator_asked

__all__ = [
    "ONEDNN_COUNTS_FROM",
    "CallMeasurement",
    "corrected",
    "counted_from",
    "measure_call",
    "measurement_device",
    "memory_info",
    "median_seconds",
    "sample_tensor",
    "step_function",
]

TIMED_RUNS = 5  # forward runs timed per call; the median is kept


@dataclasses.dataclass(frozen=True)
class CallMeasurement:
    """What one call's forward and backward took, run on tensors of the real shapes.

    Attributes:
        peak_bytes: the allocator's peak during forward and backward, above
            the bytes in use before (the inputs and the model's weights).
        accounted_bytes: the bytes of its outputs, their gradients and the
            gradients it returns, all live at the end (NOTE [ A call's
            measured workspace ]).
        forward_seconds: the median time of its forward alone (CPU time on
            a CPU, wall time on a GPU), or None if not timed.
    """

    peak_bytes: int
    accounted_bytes: int
    forward_seconds: float | None = None


def measurement_device() -> str:
    """`"GPU:0"` when TensorFlow sees a GPU, else `"CPU:0"`: where calls are measured."""
    return "GPU:0" if tf.config.list_logical_devices("GPU") else "CPU:0"


def memory_info(api: str, device: str) -> dict[str, int]:
    """The allocator's current and peak bytes on `device` (`"CPU:0"`, `"GPU:0"`).

    Raises:
        RuntimeError: TensorFlow keeps no statistics for that device's allocator in this
            process; the message says how to have them (NOTE [ Counting CPU memory ] in
            `tfrecompute.startup`).
    """
    try:
        return dict(tf.config.experimental.get_memory_info(device))
    except ValueError as error:
        if device.upper().startswith("GPU") or "stats not available" not in str(error):
            fix = f"TensorFlow said: {cause(error)}"
        else:
            fix = _counting_fix()
        fail(
            api,
            "TensorFlow keeps no allocator statistics for this device in this process, and "
            "measuring memory reads them",
            "device",
            device,
            fix,
            error=RuntimeError,
        )


# NOTE [ The smallest buffer an allocator counts ]
# oneDNN's CPU allocator serves requests under 256 KiB from a pool outside its statistics
# (tests/check/test_cpu_allocator.py); TensorFlow's BFC allocator, on a GPU or on a CPU
# with TF_CPU_ALLOCATOR_USE_BFC=true (which wins over oneDNN), counts every one. Which
# allocator a process has is fixed when TensorFlow's runtime starts, so `counted_from`
# asks the allocator itself once: it allocates a 4 KiB tensor and sees whether the
# count moves.
ONEDNN_COUNTS_FROM = 256 << 10
_counted_from: dict[str, int] = {}


def counted_from(api: str, device: str) -> int:
    """The smallest buffer `device`'s allocator counts in this process: 256 KiB for
    oneDNN's CPU allocator, else 0 (NOTE [ The smallest buffer an allocator counts ]).

    Raises:
        RuntimeError: the allocator keeps no statistics (see `memory_info`).
    """
    if device not in _counted_from:
        with tf.device(device):
            before = memory_info(api, device)["current"]
            small = tf.fill([1024], 1.0)  # 4 KiB, made now
            moved = memory_info(api, device)["current"] > before
            del small
        _counted_from[device] = 0 if moved else ONEDNN_COUNTS_FROM
    return _counted_from[device]


def _counting_fix() -> str:
    """How to have TensorFlow's CPU allocator count bytes, given the environment now."""
    value = os.environ.get(CPU_ALLOCATOR_VARIABLE)
    if value is None:
        return (
            "TensorFlow counts CPU memory where it runs with oneDNN (which it turns on by "
            f"itself on some CPUs) or with {CPU_ALLOCATOR_VARIABLE}=true: {COUNTING_FIX}"
        )
    if bfc_cpu_allocator_asked():
        return (
            f"{CPU_ALLOCATOR_VARIABLE}={value} was set after TensorFlow's runtime started: "
            f"{COUNTING_FIX}"
        )
    return (
        f"{CPU_ALLOCATOR_VARIABLE}={value!r} in the environment keeps TensorFlow's counting "
        "CPU allocator off: set it to true (or unset it and call "
        "tfrecompute.count_cpu_memory()) before building a model"
    )


def corrected(memory: CallMemory, measured: CallMeasurement) -> CallMemory:
    """`memory` with its workspace raised to what the measurement shows (see the NOTE)."""
    hidden = measured.peak_bytes - measured.accounted_bytes - memory.kept_bytes
    return dataclasses.replace(memory, workspace_bytes=max(memory.workspace_bytes, hidden))


def sample_tensor(tensor: keras.KerasTensor, batch_size: int) -> tf.Tensor:
    """A tensor of `tensor`'s shape and dtype: normal floats, zeros otherwise (valid ids)."""
    shape = [batch_size if dim is None else int(dim) for dim in tensor.shape]
    dtype = keras.backend.standardize_dtype(tensor.dtype)
    if keras.backend.is_float_dtype(dtype):
        return tf.cast(tf.random.stateless_normal(shape, seed=(0, 0)), dtype)
    return tf.zeros(shape, dtype)


def step_function(layer: Any, args: Any, kwargs: Any, symbolic: list[Any]) -> Any:
    """`(values, backward) -> (outputs, gradients)`: the call on `values`, and its backward."""

    def run(values: tuple[tf.Tensor, ...], backward: bool) -> Any:
        mapping = {id(t): v for t, v in zip(symbolic, values)}

        def substitute(value: Any) -> Any:
            return mapping[id(value)] if isinstance(value, keras.KerasTensor) else value

        call_kwargs = keras.tree.map_structure(substitute, kwargs)
        if call_has_training_arg(layer):
            call_kwargs["training"] = True
        sources = [v for v in values if v.dtype.is_floating] + trainable_variables(layer)
        with tf.GradientTape() as tape:
            tape.watch([v for v in values if v.dtype.is_floating])
            results = keras.tree.flatten(
                layer(*keras.tree.map_structure(substitute, args), **call_kwargs)
            )
        floats = [r for r in results if r.dtype.is_floating]
        if not backward or not floats or not sources:
            return results, []
        upstream = [tf.ones_like(r) for r in floats]
        grads = tape.gradient(floats, sources, output_gradients=upstream)
        parts = [g for g in tf.nest.flatten(grads, expand_composites=True) if g is not None]
        return [*results, *upstream], parts

    return run


def _bytes(tensors: list[tf.Tensor]) -> int:
    return sum(tensor_bytes(t.shape, t.dtype, 1) for t in tensors)


def measure_call(
    layer: Any,
    args: Any,
    kwargs: Any,
    batch_size: int,
    *,
    time_forward: bool = False,
    device: str | None = None,
    traced: TracedStep | None = None,
    api: str = "profile",
) -> CallMeasurement:
    """Runs one call's forward and backward on tensors of the real shapes and measures it.

    The call runs (in training mode) inside a `tf.function` on `device` once
    to trace and compile it, then again from a reset allocator peak. Its
    layer's non-trainable state is restored afterwards.

    Args:
        layer: the layer called, or a plain Keras op.
        args, kwargs: the call's arguments, with `keras.KerasTensor`s for tensors.
        batch_size: the size of the leading `None` dimension.
        time_forward: also time the forward alone (`TIMED_RUNS` runs, median).
        device: `"CPU:0"` or `"GPU:0"`; by default `measurement_device()`.
        traced: the call's step as `call_memory` traced it (`traced_call_memory`):
            run instead of tracing the call again, given ones as its output
            gradients (a large call's trace can take longer than its run).
        api: the function measuring, named in its errors.

    Raises:
        RuntimeError: the allocator keeps no statistics (see `memory_info`).
    """
    name = device or measurement_device()
    flat = keras.tree.flatten((args, kwargs))
    symbolic = list({id(t): t for t in flat if isinstance(t, keras.KerasTensor)}.values())
    state = [v for v in getattr(layer, "variables", []) if not v.trainable]
    saved = [np.array(v.numpy()) for v in state]
    run = step_function(layer, args, kwargs, symbolic)
    try:
        with tf.device(name):
            values = tuple(sample_tensor(t, batch_size) for t in symbolic)
            if traced is None:
                both, given = tf.function(lambda *v: run(v, True), autograph=False), values
            else:
                upstream = [_ones(spec) for spec in traced.specs[traced.arguments :]]
                both, given = traced.function, (*values, *upstream)
            both(*given)  # traces (unless traced) and compiles
            before = memory_info(api, name)["current"]
            tf.config.experimental.reset_memory_stats(name)
            kept, grads = both(*given)
            peak = memory_info(api, name)["peak"] - before
            accounted = _bytes(list(kept)) + _bytes(list(grads))
            del kept, grads
            seconds = _time_forward(run, values, name) if time_forward else None
    finally:
        for variable, value in zip(state, saved):
            variable.assign(value)
    return CallMeasurement(int(max(peak, 0)), accounted, seconds)


def _ones(spec: tf.TensorSpec) -> tf.Tensor:
    """An output gradient of `spec`: ones for a floating output, zeros for another."""
    return (tf.ones if spec.dtype.is_floating else tf.zeros)(spec.shape, spec.dtype)


def _time_forward(run: Any, values: tuple[tf.Tensor, ...], device: str) -> float:
    """The median time of the call's forward alone (CPU time on a CPU, wall on a GPU)."""
    forward = tf.function(lambda *v: run(v, False)[0], autograph=False)
    return median_seconds(forward, values, device)


def median_seconds(function: Any, args: tuple[Any, ...], device: str) -> float:
    """The median time of `function(*args)` over `TIMED_RUNS` runs after a first one that
    traces it (CPU time on a CPU, wall time on a GPU)."""
    clock = time.process_time if device.startswith("CPU") else time.perf_counter
    function(*args)
    times = []
    for _ in range(TIMED_RUNS):
        start = clock()
        results = keras.tree.flatten(function(*args))
        _ = [np.asarray(r) for r in results[:1]]  # waits for the device
        times.append(clock() - start)
    return statistics.median(times)
