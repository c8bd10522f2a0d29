"""Measuring what a training step really costs: `measure_step`."""

from __future__ import annotations

import dataclasses
import statistics
import time
import warnings
from typing import Any

import keras
import tensorflow as tf

__all__ = ["StepMeasurement", "default_device", "measure_step"]


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
    if not isinstance(model, keras.Model):
        raise TypeError(
            "measure_step: `model` must be a Keras model. Received: "
            f"model={model!r} (of type {type(model).__name__}). Pass a keras.Model."
        )
    if not getattr(model, "compiled", False):
        raise ValueError(
            "measure_step: the model is not compiled. Received: "
            f"model={model.name!r} (of type {type(model).__name__}). Call "
            "model.compile(optimizer=..., loss=...) first, e.g. "
            'model.compile(optimizer="sgd", loss="mse").'
        )
    for name, value in (("steps", steps), ("warmup", warmup)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(
                f"measure_step: `{name}` must be a positive integer. Received: "
                f"{name}={value!r} (of type {type(value).__name__}). Pass {name}=1 or more."
            )
    if x is None:
        raise ValueError(
            "measure_step: `x` is missing. Received: x=None (of type NoneType). Pass one "
            "batch of inputs, e.g. x[:batch_size]."
        )
    if device is not None and not isinstance(device, str):
        raise TypeError(
            f"measure_step: `device` must be a device name. Received: device={device!r} "
            f'(of type {type(device).__name__}). Pass e.g. device="GPU:0" or "CPU:0".'
        )
    device = device or default_device()
    known = [d.name.split("device:")[-1] for d in tf.config.list_logical_devices()]
    if device.replace("/device:", "").upper() not in [k.upper() for k in known]:
        raise ValueError(
            f"measure_step: no {device} device is available. Received: device={device!r} "
            f"(of type str). Use one of {known}."
        )

    with tf.device(device):
        x = keras.tree.map_structure(tf.convert_to_tensor, x)
        if y is not None:
            y = keras.tree.map_structure(tf.convert_to_tensor, y)
    for _ in range(warmup):
        model.train_on_batch(x, y)

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
