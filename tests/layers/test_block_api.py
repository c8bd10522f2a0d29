"""RecomputeBlock's API: serialization, shapes, summary, unwrap, and bad input."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import MODES
from tests.models_zoo import Untraceable
from tfrecompute import NonReplayableRandomnessError, RecomputeBlock


def _model_with_blocks():
    inputs = keras.Input((8,))
    x = RecomputeBlock(
        [keras.layers.Dense(16, activation="relu"), keras.layers.Dropout(0.2, seed=1)],
        name="list_block",
    )(inputs)
    x = RecomputeBlock(keras.layers.Dense(16), name="single_block")(x)
    sub_in = keras.Input((16,))
    sub = keras.Model(sub_in, keras.layers.BatchNormalization()(keras.layers.Dense(4)(sub_in)))
    x = RecomputeBlock(sub, name="functional_block")(x)
    return keras.Model(inputs, x)


def test_save_and_load_round_trip(tmp_path):
    model = _model_with_blocks()
    model.compile(optimizer="sgd", loss="mse")
    x = np.random.default_rng(0).normal(size=(16, 8)).astype("float32")
    model.fit(x, np.zeros((16, 4), "float32"), verbose=0)  # non-default BatchNorm statistics
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0), atol=1e-6)
    blocks = [layer for layer in loaded.layers if isinstance(layer, RecomputeBlock)]
    assert [b.name for b in blocks] == ["list_block", "single_block", "functional_block"]
    assert isinstance(blocks[0].unwrap(), list) and len(blocks[0].unwrap()) == 2
    assert isinstance(blocks[1].unwrap(), keras.layers.Dense)
    assert isinstance(blocks[2].unwrap(), keras.Model)


def test_get_config_from_config():
    block = RecomputeBlock([keras.layers.Dense(3, name="d1"), keras.layers.Dense(2, name="d2")])
    config = block.get_config()
    clone = RecomputeBlock.from_config(config)
    assert [layer.name for layer in clone.layers] == ["d1", "d2"]
    assert clone.get_config() == config
    assert keras.saving.get_registered_name(RecomputeBlock) == "tfrecompute>RecomputeBlock"


def test_compute_output_shape_delegates():
    block = RecomputeBlock([keras.layers.Dense(16), keras.layers.Reshape((4, 4))])
    assert block.compute_output_shape((None, 8)) == (None, 4, 4)
    single = RecomputeBlock(keras.layers.Conv2D(3, 3))
    assert single.compute_output_shape((2, 9, 9, 1)) == (2, 7, 7, 3)


def test_summary_shows_inner_layers():
    model = _model_with_blocks()
    lines = []
    model.summary(expand_nested=True, print_fn=lambda line, **kwargs: lines.append(line))
    text = "\n".join(lines)
    for name in ("list_block", "single_block", "functional_block"):
        assert name in text
    inner_names = [layer.name for layer in model.get_layer("list_block").layers]
    assert all(name in text for name in inner_names)


def test_unwrap_returns_the_same_objects():
    dense = keras.layers.Dense(2)
    layers = [keras.layers.Dense(3), dense]
    assert RecomputeBlock(dense).unwrap() is dense
    unwrapped = RecomputeBlock(layers).unwrap()
    assert unwrapped == layers and unwrapped[1] is dense


def test_block_builds_its_layers_and_tracks_their_variables():
    block = RecomputeBlock([keras.layers.Dense(4), keras.layers.Dense(2)])
    block.build((None, 3))
    assert all(layer.built for layer in block.layers)
    assert len(block.trainable_variables) == 4


# ------------------------------------------------------------------ bad input


def test_empty_list_is_rejected():
    with pytest.raises(ValueError, match=r"`layers` is empty. Received: layers=\[\]"):
        RecomputeBlock([])


def test_non_layer_is_rejected():
    with pytest.raises(
        TypeError, match=r"must be a Keras layer.*Received: layers=.*of type function"
    ):
        RecomputeBlock(lambda x: x)


def test_list_with_non_layer_is_rejected():
    with pytest.raises(TypeError, match=r"item 1 of `layers` is not a Keras layer.*of type str"):
        RecomputeBlock([keras.layers.Dense(2), "dense"])


def test_extra_arguments_with_a_list_are_rejected():
    block = RecomputeBlock([keras.layers.Dense(2), keras.layers.Dense(2)])
    x = tf.ones((1, 2))
    with pytest.raises(TypeError, match="extra call arguments go to a single wrapped layer"):
        block(x, x)


def test_untraceable_subclassed_model_is_reported():
    block = RecomputeBlock(Untraceable())
    with pytest.raises(ValueError, match="could not build the wrapped layers by tracing"):
        with tf.GradientTape():
            block(tf.ones((2, 3)), training=True)


def test_built_subclassed_model_is_fine():
    model = Untraceable()
    model(tf.ones((2, 3)))
    block = RecomputeBlock(model)
    np.testing.assert_allclose(block(tf.ones((2, 3))), model(tf.ones((2, 3))))


class StatefulNoise(keras.layers.Layer):
    """Adds noise from a stateful TensorFlow op: not replayable."""

    def call(self, x, training=None):
        return x + tf.random.uniform(tf.shape(x)) if training else x


class GlobalSeedNoise(keras.layers.Layer):
    """Adds noise from an unseeded keras.random call: the global seed generator."""

    def call(self, x, training=None):
        return x + keras.random.normal(tf.shape(x)) if training else x


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("noise", [StatefulNoise, GlobalSeedNoise])
def test_unreplayable_randomness_is_reported(noise, mode):
    block = RecomputeBlock([keras.layers.Dense(4), noise()])
    block.build((None, 4))

    def step(x):
        with tf.GradientTape() as tape:
            y = block(x, training=True)
        return tape.gradient(y, block.trainable_variables)

    if mode == "function":
        # AutoGraph re-raises errors of types it does not know as StagingError;
        # without it (as in model.fit's step) the type survives.
        step = tf.function(step, autograph=False)
    with pytest.raises(NonReplayableRandomnessError, match="RecomputeBlock '.*'"):
        step(tf.ones((2, 4)))


def test_unreplayable_randomness_is_reported_in_model_fit():
    model = keras.Sequential(
        [keras.Input((4,)), RecomputeBlock([keras.layers.Dense(4), StatefulNoise()])]
    )
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(NonReplayableRandomnessError, match="stateful TensorFlow random ops"):
        model.fit(np.ones((4, 4)), np.ones((4, 4)), verbose=0)


def test_unreplayable_randomness_message_survives_autograph():
    block = RecomputeBlock([keras.layers.Dense(4), StatefulNoise()])
    block.build((None, 4))

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            y = block(x, training=True)
        return tape.gradient(y, block.trainable_variables)

    with pytest.raises(Exception, match="(?s)NonReplayableRandomnessError.*RandomUniform"):
        step(tf.ones((2, 4)))


def test_stateful_random_op_in_a_while_loop_is_found():
    class LoopNoise(keras.layers.Layer):
        def call(self, x, training=None):
            return tf.while_loop(
                lambda i, t: i < 2, lambda i, t: (i + 1, t + tf.random.normal(tf.shape(t))), (0, x)
            )[1]

    block = RecomputeBlock([LoopNoise()])
    block.build((None, 4))

    @tf.function(autograph=False)
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = block(x, training=True)
        return tape.gradient(y, x)

    with pytest.raises(NonReplayableRandomnessError, match=r"RandomStandardNormal"):
        step(tf.ones((2, 4)))
