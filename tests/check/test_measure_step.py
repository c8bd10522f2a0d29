"""measure_step: real allocator peaks of a compiled training step."""

from __future__ import annotations

import math

import keras
import numpy as np
import pytest

from tfrecompute import RecomputeBlock, StepMeasurement, measure_step


def _dense_chain(depth, width, block_size=None):
    keras.utils.set_random_seed(0)
    layers = [keras.layers.Dense(width, activation="tanh") for _ in range(depth)]
    if block_size:
        layers = [RecomputeBlock(layers[i : i + block_size]) for i in range(0, depth, block_size)]
    model = keras.Sequential([keras.Input((width,)), *layers])
    model.compile(optimizer="sgd", loss="mse")
    return model


def test_sqrt_blocks_at_most_halve_step_memory():
    """32 Dense(512, tanh) at batch 2048: blocks of about sqrt(32) layers."""
    depth, width, batch = 32, 512, 2048
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, width)).astype("float32")
    y = rng.normal(size=(batch, width)).astype("float32")
    plain = measure_step(_dense_chain(depth, width), x, y)
    blocked = measure_step(_dense_chain(depth, width, block_size=round(math.sqrt(depth))), x, y)
    activation = batch * width * 4
    # Without recompute the step keeps every layer's activation alive.
    assert plain.peak_bytes > depth * activation
    assert blocked.peak_bytes <= 0.5 * plain.peak_bytes, (blocked, plain)


def test_measure_step_reports_growth_with_batch():
    model = _dense_chain(4, 256)
    small = measure_step(model, np.ones((64, 256), "float32"), np.ones((64, 256), "float32"))
    large = measure_step(model, np.ones((512, 256), "float32"), np.ones((512, 256), "float32"))
    assert isinstance(small, StepMeasurement)
    assert small.device == "CPU:0" and small.steps == 3 and small.seconds > 0
    # Four layers' activations grow by (512 - 64) rows of 256 float32 each.
    assert large.peak_bytes - small.peak_bytes >= 4 * (512 - 64) * 256 * 4
    assert small.peak_bytes > 0


def test_measure_step_rejects_an_uncompiled_model():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    with pytest.raises(ValueError, match=r"measure_step: the model is not compiled.*model.compile"):
        measure_step(model, np.ones((1, 2)), np.ones((1, 1)))


def test_measure_step_rejects_a_non_model():
    with pytest.raises(
        TypeError, match=r"measure_step: `model` must be a Keras model.*of type Dense"
    ):
        measure_step(keras.layers.Dense(1), np.ones((1, 2)))


@pytest.mark.parametrize(
    ("steps", "error", "what"),
    [
        (0, ValueError, "must be at least 1"),
        (-1, ValueError, "must be at least 1"),
        (1.5, TypeError, "must be an int"),
        (True, TypeError, "must be an int"),
        ("3", TypeError, "must be an int"),
    ],
)
def test_measure_step_rejects_bad_step_counts(steps, error, what):
    # One mechanism for every integer option: a wrong type is a TypeError,
    # a wrong value of the right type a ValueError.
    model = _dense_chain(1, 2)
    with pytest.raises(error, match=rf"`steps` {what}\. Received: steps="):
        measure_step(model, np.ones((1, 2)), np.ones((1, 2)), steps=steps)


def test_measure_step_rejects_a_missing_device():
    model = _dense_chain(1, 2)
    with pytest.raises(ValueError, match=r"no TPU:0 device is available"):
        measure_step(model, np.ones((1, 2)), np.ones((1, 2)), device="TPU:0")


def test_measure_step_warns_when_nothing_was_recorded():
    model = _dense_chain(1, 4)
    with pytest.warns(UserWarning, match="recorded no memory"):
        result = measure_step(model, np.ones((2, 4), "float32"), np.ones((2, 4), "float32"))
    assert result.peak_bytes == 0


def test_block_with_only_integer_inputs_still_saves_memory():
    """Token ids in, nothing floating: the recompute must not merge with the forward.

    With no floating input, nothing ordered the first block's recompute after
    the incoming gradient, and graph optimisation merged its ops with the
    forward's: its activations stayed alive through the whole backward.
    """

    def build(blocked):
        keras.utils.set_random_seed(0)
        layers = [keras.layers.Embedding(100, 128)]
        layers += [keras.layers.Dense(128, activation="gelu") for _ in range(9)]
        if blocked:  # the first block's only input is the token ids
            layers = [RecomputeBlock(layers[i : i + 3 + (i == 0)]) for i in (0, 4, 7)]
        model = keras.Sequential(
            [keras.Input((64,), dtype="int32"), *layers, keras.layers.GlobalAveragePooling1D()]
        )
        model.compile(optimizer="sgd", loss="mse")
        return model

    ids = np.random.default_rng(0).integers(0, 100, size=(256, 64)).astype("int32")
    y = np.zeros((256, 128), "float32")
    plain = measure_step(build(False), ids, y)
    blocked = measure_step(build(True), ids, y)
    assert blocked.peak_bytes <= 0.5 * plain.peak_bytes, (blocked, plain)
