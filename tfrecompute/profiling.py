"""Measuring what a training step really costs: `measure_step`."""

from __future__ import annotations

import dataclasses
import statistics
import time
import warnings
from typing import Any

import keras
import tensorflow as tf

from tfrecompute.graph import trainable_variables

__all__ = ["StepMeasurement", "default_device", "measure_step", "prepare_step"]


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
    """

    peak_bytes: int
    seconds: float
    device: str
    steps: int


def default_device() -> str:
    """`"GPU:0"` when TensorFlow sees a GPU, else `"CPU:0"`."""
    return "GPU:0" if tf.config.list_logical_devices("GPU") else "CPU:0"


def _check_count(api: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"{api}: `{name}` must be a positive integer. Received: "
            f"{name}={value!r} (of type {type(value).__name__}). Pass {name}=1 or more."
        )


def prepare_step(
    api: str,
    model: Any,
    x: Any,
    y: Any,
    *,
    warmup: int,
    device: str | None,
    counts: dict[str, Any] | None = None,
) -> tuple[Any, Any, str]:
    """Checks a step's arguments, converts the batch and runs the warm-up steps.

    `counts` are further arguments that must be positive integers (after the
    model is checked, with `warmup`).

    Returns:
        `(x, y, device)`: the batch as tensors on the device, and the device name.
    """
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"{api}: `model` must be a Keras model. Received: "
            f"model={model!r} (of type {type(model).__name__}). Pass a keras.Model."
        )
    if not getattr(model, "compiled", False):
        raise ValueError(
            f"{api}: the model is not compiled. Received: "
            f"model={model.name!r} (of type {type(model).__name__}). Call "
            "model.compile(optimizer=..., loss=...) first, e.g. "
            'model.compile(optimizer="sgd", loss="mse").'
        )
    for name, value in {"warmup": warmup, **(counts or {})}.items():
        _check_count(api, name, value)
    if x is None:
        raise ValueError(
            f"{api}: `x` is missing. Received: x=None (of type NoneType). Pass one "
            "batch of inputs, e.g. x[:batch_size]."
        )
    if device is not None and not isinstance(device, str):
        raise TypeError(
            f"{api}: `device` must be a device name. Received: device={device!r} "
            f'(of type {type(device).__name__}). Pass e.g. device="GPU:0" or "CPU:0".'
        )
    device = device or default_device()
    known = [d.name.split("device:")[-1] for d in tf.config.list_logical_devices()]
    if device.replace("/device:", "").upper() not in [k.upper() for k in known]:
        raise ValueError(
            f"{api}: no {device} device is available. Received: device={device!r} "
            f"(of type str). Use one of {known}."
        )
    with tf.device(device):
        x = keras.tree.map_structure(tf.convert_to_tensor, x)
        if y is not None:
            y = keras.tree.map_structure(tf.convert_to_tensor, y)
    for _ in range(warmup):
        model.train_on_batch(x, y)
    return x, y, device


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

    On CPU, TensorFlow's allocator statistics leave out allocations smaller
    than 256 KiB (measured with tensorflow 2.21) and round sizes up to its
    bins, so use batches large enough for activations to be counted; a step
    that recorded nothing warns.

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
        A `StepMeasurement`.

    Example:

    ```python
    model.compile(optimizer="sgd", loss="mse")
    m = tfrecompute.measure_step(model, x, y)
    print(f"{m.peak_bytes / 2**20:.1f} MiB in {m.seconds * 1e3:.1f} ms")
    ```
    """
    x, y, device = prepare_step(
        "measure_step", model, x, y, warmup=warmup, device=device, counts={"steps": steps}
    )

    peaks, times = [], []
    for _ in range(steps):
        before = tf.config.experimental.get_memory_info(device)["current"]
        tf.config.experimental.reset_memory_stats(device)
        start = time.perf_counter()
        model.train_on_batch(x, y)
        times.append(time.perf_counter() - start)
        peaks.append(tf.config.experimental.get_memory_info(device)["peak"] - before)
    if max(peaks) <= 0:
        warnings.warn(
            f"measure_step: the {device} allocator recorded no memory for the step of "
            f"model {model.name!r}. TensorFlow's CPU allocator statistics leave out "
            "allocations smaller than 256 KiB; measure with a larger batch.",
            stacklevel=2,
        )
    return StepMeasurement(
        peak_bytes=int(max(peaks)),
        seconds=statistics.median(times),
        device=device,
        steps=steps,
    )


# --------------------------------------------------------------------- profile


def _spec(tensor: Any, batch_size: int) -> tf.TensorSpec:
    shape = [batch_size if dim is None else dim for dim in tensor.shape]
    return tf.TensorSpec(shape, keras.backend.standardize_dtype(tensor.dtype))


def _static_bytes(tensor: tf.Tensor) -> int:
    if not tensor.shape.is_fully_defined():
        return 0
    return int(tensor.shape.num_elements()) * tensor.dtype.size


# Forward ops whose outputs are not activations: inputs, variable reads, constants.
_NOT_ACTIVATIONS = frozenset({"Placeholder", "ReadVariableOp", "Const", "Shape", "VarHandleOp"})
# Ops whose output shares its input's buffer: a kept output of one is its input.
_ALIASES = frozenset({"Identity", "IdentityN", "Reshape", "Squeeze", "ExpandDims", "StopGradient"})


def _buffer(tensor: tf.Tensor) -> tf.Tensor:
    """The tensor whose buffer `tensor` shares (itself unless it is a view)."""
    while tensor.op.type in _ALIASES and tensor.op.inputs:
        tensor = tensor.op.inputs[0 if tensor.op.type != "IdentityN" else tensor.value_index]
    return tensor


@dataclasses.dataclass(frozen=True)
class CallMemory:
    """What one layer call keeps for its backward, read from its gradient graph.

    Attributes:
        kept_bytes: activations made inside the call (neither its inputs nor
            its outputs) that its backward reads.
        workspace_bytes: the largest other temporary its backward creates.
        reads_inputs: per tensor argument, whether its backward reads it.
        reads_outputs: per output, whether its backward reads it.
    """

    kept_bytes: int
    workspace_bytes: int
    reads_inputs: tuple[bool, ...]
    reads_outputs: tuple[bool, ...]


def call_memory(
    layer: keras.layers.Layer | keras.Operation,
    args: Any,
    kwargs: Any,
    outputs: Any,
    batch_size: int,
) -> CallMemory:
    """Finds what one layer call keeps alive for its backward.

    Traces the call (in training mode) and its gradient with respect to its
    floating inputs and trainable variables in a `tf.function`, without running
    it. A forward tensor that a gradient op reads is kept from the forward to
    the backward; a view (a reshape, an identity) counts as the buffer it
    shares. This is what TensorFlow keeps between the two passes.

    Args:
        layer: the layer called, or a plain Keras op (`keras.ops` on symbolic tensors).
        args, kwargs: the call's arguments, with `keras.KerasTensor`s for tensors.
        outputs: the call's symbolic outputs.
        batch_size: the size of the leading `None` dimension.
    """
    symbolic = [t for t in keras.tree.flatten((args, kwargs)) if isinstance(t, keras.KerasTensor)]
    symbolic = list({id(t): t for t in symbolic}.values())
    flat_outputs = keras.tree.flatten(outputs)
    specs = [_spec(t, batch_size) for t in symbolic] + [_spec(t, batch_size) for t in flat_outputs]
    trace: dict[str, Any] = {}

    def step(*values: tf.Tensor) -> None:
        inputs, output_grads = values[: len(symbolic)], values[len(symbolic) :]
        mapping = {id(t): v for t, v in zip(symbolic, inputs)}

        def substitute(value: Any) -> Any:
            return mapping[id(value)] if isinstance(value, keras.KerasTensor) else value

        call_kwargs = keras.tree.map_structure(substitute, kwargs)
        if getattr(layer, "_call_has_training_arg", False):  # a plain op has none
            call_kwargs["training"] = True
        with tf.GradientTape() as tape:
            for value in inputs:
                if value.dtype.is_floating:
                    tape.watch(value)
            call_args = keras.tree.map_structure(substitute, args)
            results = keras.tree.flatten(layer(*call_args, **call_kwargs))
        trace["forward_ops"] = len(tf.compat.v1.get_default_graph().get_operations())
        trace["inputs"] = [_buffer(v).ref() for v in inputs]
        trace["outputs"] = [_buffer(r).ref() for r in results]
        pairs = [(r, g) for r, g in zip(results, output_grads) if r.dtype.is_floating]
        floating = [v for v in inputs if v.dtype.is_floating]
        sources = floating + trainable_variables(layer)
        trace["gradients"] = []
        if pairs and sources:
            grads = tape.gradient(
                [r for r, _ in pairs], sources, output_gradients=[g for _, g in pairs]
            )
            for part in tf.nest.flatten(grads, expand_composites=True):  # IndexedSlices too
                if part is not None:
                    trace["gradients"].append(_buffer(part).ref())

    graph = tf.function(step, autograph=False).get_concrete_function(*specs).graph
    operations = graph.get_operations()
    split = trace["forward_ops"]
    forward = {t.ref() for op in operations[:split] for t in op.outputs}
    read: dict[Any, tf.Tensor] = {}
    for op in operations[split:]:
        for tensor in op.inputs:
            if tensor.ref() in forward:
                root = _buffer(tensor)
                read[root.ref()] = root
    boundary = set(trace["inputs"]) | set(trace["outputs"])
    kept = [
        t for key, t in read.items() if key not in boundary and t.op.type not in _NOT_ACTIVATIONS
    ]
    # The memory model counts the gradients the call returns, for its inputs
    # (also when made in another shape and reshaped, as a Conv1D's or a
    # Dense's on 3-D inputs is) and for its variables (`Chain.update_grad_bytes`
    # or `grad_bytes`), and temporaries shaped like its inputs or outputs as
    # those gradients; the workspace is the largest other temporary.
    io_shapes = {tuple(spec.shape) for spec in specs}
    returned = set(trace["gradients"])
    backward = [
        t
        for op in operations[split:]
        if op.type not in _ALIASES
        for t in op.outputs
        if tuple(t.shape) not in io_shapes and t.ref() not in returned
    ]
    return CallMemory(
        kept_bytes=sum(_static_bytes(t) for t in kept),
        workspace_bytes=max((_static_bytes(t) for t in backward), default=0),
        reads_inputs=tuple(key in read for key in trace["inputs"]),
        reads_outputs=tuple(key in read for key in trace["outputs"]),
    )
