"""Measured per-call costs: calls the gradient graph does not show are run and measured."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest

import tfrecompute
from tfrecompute import strategies

ROOT = Path(__file__).resolve().parents[2]

# ConvNeXt's depthwise conv as Keras builds it (grouped, so run under XLA), in a fresh
# process for a clean allocator: the prediction with and without measuring, and the step.
GROUPED_CONV = """
import json, os
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
import keras, numpy as np
import tfrecompute
from tfrecompute import strategies
inputs = keras.Input((2, 2, 768))
h = keras.layers.Conv2D(768, 7, groups=768, padding="same")(inputs)
outputs = keras.layers.Dense(10)(keras.layers.Flatten()(h))
model = keras.Model(inputs, outputs)
model.compile(optimizer="sgd", loss="mse")
rng = np.random.default_rng(0)
x = rng.random((16, 2, 2, 768), dtype="float32")
y = rng.random((16, 10), dtype="float32")
peaks = {
    str(m): strategies.none(tfrecompute.profile(model, batch_size=16, measure=m)).peak_bytes
    for m in (False, None)
}
peaks["measured"] = tfrecompute.measure_step(model, x, y).peak_bytes
print(json.dumps(peaks))
"""


def _run_fresh(code: str) -> dict[str, int]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_a_grouped_conv_under_xla_is_measured_and_predicted_within_20_percent():
    peaks = _run_fresh(GROUPED_CONV)
    measured = peaks["measured"]
    assert peaks["False"] < 0.1 * measured  # the graph alone misses the XLA buffer
    assert abs(peaks["None"] - measured) <= 0.2 * measured, peaks


def _small_model() -> keras.Model:
    inputs = keras.Input((64,))
    h = keras.layers.Dense(512, activation="tanh")(inputs)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.Dropout(0.1, seed=1)(h)
    outputs = keras.layers.Dense(8)(h)
    return keras.Model(inputs, outputs)


def test_measuring_every_call_keeps_what_the_graph_shows_and_the_layer_state():
    model = _small_model()
    state = [np.array(v.numpy()) for v in model.non_trainable_variables]
    static = tfrecompute.profile(model, batch_size=256, measure=False)
    measured = tfrecompute.profile(model, batch_size=256, measure=True)
    assert measured.saved_bytes == static.saved_bytes
    assert all(m >= s for m, s in zip(measured.workspace_bytes, static.workspace_bytes))
    for variable, value in zip(model.non_trainable_variables, state):
        np.testing.assert_array_equal(variable.numpy(), value)  # BatchNorm, seed state


def test_measured_forward_times_replace_the_flop_estimate():
    model = _small_model()
    chain = tfrecompute.profile(model, batch_size=256, measure_time=True)
    flops = tfrecompute.profile(model, batch_size=256)
    assert all(0 <= t < 1 for t in chain.forward_cost)
    assert chain.forward_cost != flops.forward_cost
    dense = chain.names.index(next(n for n in chain.names if n.startswith("dense")))
    assert chain.forward_cost[dense] > 0
    assert strategies.sqrt(chain).segments == strategies.sqrt(flops).segments


@pytest.mark.parametrize("option", ["measure", "measure_time"])
def test_measure_options_must_be_bools(option):
    with pytest.raises(TypeError, match=rf"profile: `{option}` must be a bool\. Received: "):
        tfrecompute.profile(_small_model(), batch_size=8, **{option: "yes"})


class _CoordinateLookup(keras.layers.Layer):
    """Looks rows of a table up by coordinates in [0, 1): a float input that becomes an
    index, as keras-hub's SAM3 geometry encoder does with boxes. A negative coordinate
    indexes out of range, which TensorFlow's CPU GatherNd rejects."""

    def build(self, input_shape):
        self.table = self.add_weight(shape=(4, 4, 32), initializer="random_normal")

    def call(self, coordinates):
        import tensorflow as tf

        return tf.gather_nd(self.table, tf.cast(tf.floor(coordinates * 4), "int32"))


def _lookup_model() -> keras.Model:
    inputs = keras.Input((2,))
    h = keras.layers.Dense(256, activation="relu")(_CoordinateLookup(name="lookup")(inputs))
    return keras.Model(inputs, keras.layers.Dense(4)(h))


def test_a_call_that_cannot_run_on_synthetic_values_keeps_its_traced_reading():
    model = _lookup_model()
    x = np.random.default_rng(0).random((64, 2), dtype="float32")  # valid coordinates
    static = tfrecompute.profile(model, sample=x, measure=False)
    with pytest.warns(UserWarning, match=r"profile: measuring the call of 'lookup' on synthetic"):
        measured = tfrecompute.profile(model, sample=x, measure=True)
    lookup = measured.names.index("lookup")
    assert measured.saved_bytes[lookup] == static.saved_bytes[lookup]
    assert measured.workspace_bytes[lookup] == static.workspace_bytes[lookup]
    with pytest.raises(
        ValueError,
        match=r"profile: measuring the call of 'lookup' .* failed "
        r"\(InvalidArgumentError: .*\)\. Received: measure_time=True",
    ):
        tfrecompute.profile(model, sample=x, measure_time=True)
