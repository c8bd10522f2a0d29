"""Helpers that compare a recomputed model against the same layers unwrapped."""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

MODES = ["eager", "function"]


def quantize(model: Any, mode: str) -> None:
    """`model.quantize(mode)`, without Keras's garbage collection per dropped kernel.

    Keras's `Layer.__delattr__` runs `gc.collect()` for every variable it
    removes, which `quantize` does for each float kernel; each collection
    grows with the heap of a test process that has traced many models, and
    they were most of tests/costs/test_quantized.py's time (profiled once).
    Nothing is left for those collections that a test needs collected.
    """
    collect = gc.collect
    gc.collect = lambda *args, **kwargs: 0
    try:
        model.quantize(mode)
    finally:
        gc.collect = collect


def save_state(variables: Sequence[Any]) -> list[np.ndarray]:
    """Copies the values of `variables` (weights, statistics, seed states)."""
    return [np.array(v.numpy(), copy=True) for v in variables]


def load_state(variables: Sequence[Any], values: Sequence[np.ndarray]) -> None:
    for variable, value in zip(variables, values):
        variable.assign(value)


def forward_and_grads(
    fn: Callable[..., Any],
    inputs: Sequence[tf.Tensor],
    variables: Sequence[Any],
    mode: str,
) -> list[np.ndarray]:
    """Runs `fn(*inputs, training=True)` under a tape; returns outputs then gradients.

    The loss weights every output element differently, so a wrong gradient
    entry anywhere changes the result.
    """

    def step(*xs: tf.Tensor) -> list[tf.Tensor]:
        with tf.GradientTape() as tape:
            for x in xs:
                if x.dtype.is_floating:
                    tape.watch(x)
            outputs = tf.nest.flatten(fn(*xs, training=True))
            loss = tf.add_n(
                [
                    tf.reduce_sum(
                        tf.cast(o, tf.float32)
                        * tf.reshape(tf.sin(tf.range(tf.size(o), dtype=tf.float32)), tf.shape(o))
                    )
                    for o in outputs
                ]
            )
        sources = [x for x in xs if x.dtype.is_floating] + list(variables)
        grads = tape.gradient(loss, sources)
        # Dense tensors: an Embedding's gradient is IndexedSlices unwrapped, dense
        # through a recompute; both must hold the same numbers.
        return outputs + [tf.convert_to_tensor(g) if g is not None else tf.zeros(()) for g in grads]

    if mode == "function":
        step = tf.function(step)
    elif mode != "eager":
        raise ValueError(mode)
    return [np.asarray(t) for t in step(*inputs)]


def assert_same_training(
    wrapped: Callable[..., Any],
    unwrapped: Callable[..., Any],
    inputs: Sequence[tf.Tensor],
    trainable: Sequence[Any],
    state: Sequence[Any],
    mode: str,
    *,
    atol: float = 1e-6,
) -> None:
    """Asserts equal outputs, gradients and state updates for one training step.

    `state` holds every variable either run may change (statistics, seed
    states); it is restored between the two runs so both start alike.
    """
    initial = save_state(state)
    got = forward_and_grads(wrapped, inputs, trainable, mode)
    got_state = save_state(state)
    load_state(state, initial)
    want = forward_and_grads(unwrapped, inputs, trainable, mode)
    want_state = save_state(state)
    assert len(got) == len(want)
    for index, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_allclose(g, w, atol=atol, rtol=1e-5, err_msg=f"output/gradient {index}")
    for variable, g, w in zip(state, got_state, want_state):
        np.testing.assert_allclose(g, w, atol=atol, rtol=1e-5, err_msg=f"state {variable.path}")


def _float64(value: Any) -> np.ndarray:
    """A tensor (dense, or IndexedSlices as a dense gradient) as a float64 array."""
    return np.asarray(tf.convert_to_tensor(value), np.float64)


def _is_integral(array: np.ndarray) -> bool:
    return np.issubdtype(array.dtype, np.integer) or array.dtype == np.bool_


def assert_same_values(got: Any, want: Any, *, rtol: float = 1e-6, what: str = "value") -> None:
    """Asserts two nested structures of tensors (or None) are equal to `rtol`.

    None must meet None: a gradient the unwrapped layers leave None must be
    None, not zeros. Each floating tensor is measured against max(its own
    scale, 1e-2 of the largest scale of all floating tensors), the GUIDE's
    rule: a mathematically zero gradient is float noise next to the others.
    Integer tensors (seed generator states, counters) must be equal, and set
    no scale: a seed state's numbers (about 1e9) would otherwise make every
    float tensor next to it pass.
    """
    got_flat, want_flat = tf.nest.flatten(got), tf.nest.flatten(want)
    assert len(got_flat) == len(want_flat), (len(got_flat), len(want_flat))
    exact = [None if w is None else np.asarray(tf.convert_to_tensor(w)) for w in want_flat]
    arrays = [None if a is None else a if _is_integral(a) else a.astype(np.float64) for a in exact]
    floats = [a for a in arrays if a is not None and a.size and not _is_integral(a)]
    largest = max([float(np.max(np.abs(a))) for a in floats] + [0.0])
    for index, (g, w) in enumerate(zip(got_flat, arrays)):
        if w is None:
            assert g is None, f"{what} {index}: expected None (as unwrapped), got {g!r}"
            continue
        assert g is not None, f"{what} {index}: got None, the unwrapped layers give a tensor"
        if _is_integral(w):
            g = np.asarray(tf.convert_to_tensor(g))
            assert g.shape == w.shape, f"{what} {index}: shape {g.shape}, unwrapped {w.shape}"
            assert np.array_equal(g, w), f"{what} {index}: {g} differs from {w}"
            continue
        g = _float64(g)
        assert g.shape == w.shape, f"{what} {index}: shape {g.shape}, unwrapped {w.shape}"
        scale = max(float(np.max(np.abs(w))) if w.size else 0.0, 1e-2 * largest, 1e-30)
        error = float(np.max(np.abs(g - w))) if w.size else 0.0
        assert error <= rtol * scale, f"{what} {index}: error {error:.3g} > {rtol} x {scale:.3g}"


def assert_same_run(
    run: Callable[[Any], Any],
    wrapped: Any,
    unwrapped: Any,
    mode: str,
    *,
    state: Sequence[Any] = (),
    rtol: float = 1e-6,
) -> Any:
    """Runs `run(wrapped)` and `run(unwrapped)` alike (eagerly or traced) and compares them.

    `state` (statistics, seed states) is restored between the two runs.
    Returns the wrapped run's results.
    """
    if mode not in MODES:
        raise ValueError(mode)

    def first() -> Any:
        return run(wrapped)

    def second() -> Any:
        return run(unwrapped)

    if mode == "function":
        first, second = tf.function(first), tf.function(second)
    initial = save_state(state)
    got = first()
    got_state = save_state(state)
    load_state(state, initial)
    want = second()
    assert_same_values(got, want, rtol=rtol)
    assert_same_values(got_state, save_state(state), rtol=rtol, what="state")
    return got


def normal(shape: Sequence[int], seed: int = 0) -> tf.Tensor:
    """A float32 tensor of standard normal values (deterministic per seed)."""
    return tf.constant(np.random.default_rng(seed).normal(size=shape).astype("float32"))


def apply_in_order(layers: Sequence[Any]) -> Callable[..., Any]:
    """`fn(x, training=None)` applying `layers` in order: the unwrapped twin of a block."""

    def fn(x: Any, training: Any = None) -> Any:
        for layer in layers:
            x = layer(x, training=training)
        return x

    return fn


def assert_same_fit(
    models: Sequence[Any],
    variables: Sequence[Any],
    x: Any,
    y: Any,
    *,
    epochs: int = 2,
    batch_size: int = 8,
    atol: float = 1e-5,
    optimizer: Callable[[], Any] | None = None,
    **compile_kwargs: Any,
) -> None:
    """Asserts that models sharing `variables` train alike with `model.fit`.

    Each model starts from the same values of `variables` (weights, statistics,
    seed states), is compiled with `optimizer()` (default SGD(0.1)) and
    `compile_kwargs` and fitted without shuffling; the losses and the final
    values must agree, and training must have moved the weights.
    """
    import keras

    initial = save_state(variables)
    results = []
    for model in models:
        load_state(variables, initial)
        compile_kwargs.setdefault("loss", "mse")
        made = keras.optimizers.SGD(0.1) if optimizer is None else optimizer()
        model.compile(optimizer=made, **compile_kwargs)
        history = model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0)
        results.append((history.history["loss"], save_state(variables)))
    (want_loss, want_state), *others = results
    for loss, state in others:
        np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
        for variable, got, want in zip(variables, state, want_state):
            np.testing.assert_allclose(got, want, atol=atol, err_msg=variable.path)
    assert any(not np.allclose(a, b) for a, b in zip(want_state, initial))


def run_benchmark_smoke(
    name: str, out: Any, *, timeout: float = 600, args: Any = ()
) -> tuple[dict, str]:
    """Runs `python benchmarks/<name>.py --smoke --out <out> <args...>` in a fresh process.

    Asserts that it exits 0 and returns its JSON report and Markdown table.
    """
    import json
    import os
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    out = pathlib.Path(out)
    result = subprocess.run(
        [sys.executable, f"benchmarks/{name}.py", "--smoke", "--out", str(out), *args],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads((out / f"{name}.json").read_text()), (out / f"{name}.md").read_text()


def highest_requested_trace(model: Any, x: Any, y: Any, *, traces: int = 2) -> Any:
    """Of `traces` traced steps (`tfrecompute.trace_step`), the one with the highest requested peak.

    The order in which TensorFlow's inter-op threads run ops moves a step's
    requested peak; the highest of a few is the stable figure to compare.
    """
    import tfrecompute

    steps = [tfrecompute.trace_step(model, x, y, warmup=1) for _ in range(traces)]
    return max(steps, key=lambda trace: trace.requested_peak_bytes)


def median_requested_peak(model: Any, x: Any, y: Any, *, traces: int = 3) -> int:
    """The median requested peak of `traces` traced steps (`tfrecompute.trace_step`).

    A step's requested peak moves with the order TensorFlow's inter-op threads
    run ops in, more so on a loaded machine (a U-Net's moved by a fifth); the
    median of a few is the figure to compare two models by.
    """
    import statistics

    import tfrecompute

    steps = [tfrecompute.trace_step(model, x, y, warmup=1) for _ in range(traces)]
    return int(statistics.median(trace.requested_peak_bytes for trace in steps))


def as_defined(model: Any) -> Callable[..., Any]:
    """`model` as it was defined: what `tfrecompute.recompute` applied to it suspended.

    The same layers and variables without checkpointing, the control a
    checkpointed model is compared with (also under `tf.function`: the
    suspension holds while the call is traced).
    """
    from tfrecompute.layers.in_place import suspended

    def run(*args: Any, **kwargs: Any) -> Any:
        with suspended(model):
            return model(*args, **kwargs)

    return run


def applied_blocks(model: Any) -> list[Any]:
    """The blocks `tfrecompute.recompute` applied to `model` (none when nothing is)."""
    import tfrecompute

    return list(tfrecompute.checkpoints(model).blocks)


def recomputed_blocks(model: Any, run: Callable[[], Any]) -> int:
    """How many of the blocks applied to `model` checkpoint a call while `run()` runs.

    Makes sure a comparison with `as_defined(model)` compares something: the
    checkpointed model's call goes through its blocks. The model's variables
    (statistics, seed states) are as they were afterwards.
    """
    from tfrecompute import RecomputeBlock

    blocks = applied_blocks(model)
    seen: set[int] = set()
    original = RecomputeBlock._recomputed_call

    def counting(self: Any, frame: Any) -> Any:
        seen.add(id(self))
        return original(self, frame)

    state = save_state(model.variables)
    RecomputeBlock._recomputed_call = counting
    try:
        run()
    finally:
        RecomputeBlock._recomputed_call = original
        load_state(model.variables, state)
    return sum(id(block) in seen for block in blocks)


def model_runner(model: Any, structure: Any) -> Callable[..., Any]:
    """`fn(*flat_inputs, training=None)` calling `model` on them packed as `structure`
    (what `forward_and_grads` takes for a model with nested inputs)."""
    import keras

    def fn(*xs: Any, training: Any = None) -> Any:
        return model(keras.tree.pack_sequence_as(structure, list(xs)), training=training)

    return fn


def assert_same_weights(got: Any, want: Any, atol: float = 1e-6) -> None:
    """The two models' `get_weights()` agree in order, shapes and values (to `atol`)."""
    got_weights, want_weights = got.get_weights(), want.get_weights()
    assert [w.shape for w in got_weights] == [w.shape for w in want_weights]
    for index, (a, b) in enumerate(zip(got_weights, want_weights)):
        np.testing.assert_allclose(a, b, atol=atol, rtol=0, err_msg=f"weight {index}")


def assert_same_adamw_fit(models: Sequence[Any], x: Any, y: Any, *, epochs: int = 3) -> None:
    """Models starting from equal weights end on equal weights after `fit` with AdamW.

    Weight decay moves every weight a gradient reaches, so a gradient that is
    None unwrapped but zero (or missing) checkpointed shows. Each model is
    fitted from the same seed, without shuffling; the weights must have moved.
    """
    import keras

    initial = models[0].get_weights()
    trained = []
    for model in models:
        model.compile(optimizer=keras.optimizers.AdamW(1e-2, weight_decay=0.1), loss="mse")
        keras.utils.set_random_seed(1)
        model.fit(x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0)
        trained.append(model.get_weights())
    for index, (got, want) in enumerate(zip(*trained)):
        np.testing.assert_allclose(got, want, atol=1e-5, err_msg=f"weight {index}")
    assert any(not np.allclose(a, b) for a, b in zip(trained[0], initial))
