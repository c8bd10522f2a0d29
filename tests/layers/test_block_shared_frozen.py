"""Shared and frozen layers, pointless blocks, and odd inputs.

Odd inputs: the same tensor passed twice, zero-size batches, integer token ids
and integer outputs.
"""

from __future__ import annotations

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import (
    MODES,
    apply_in_order,
    assert_same_fit,
    assert_same_training,
    normal,
)
from tfrecompute import RecomputeBlock


def _built(layer, shape=(None, 8)):
    layer.build(shape)
    return layer


# ------------------------------------------------------------------ shared layers


@pytest.mark.parametrize("mode", MODES)
def test_layer_shared_inside_and_outside_a_block(mode):
    shared = _built(keras.layers.Dense(8, activation="tanh"))
    block = RecomputeBlock([shared, keras.layers.Dense(8)])
    block.build((None, 8))

    def wrapped(x, training=None):
        return shared(block(shared(x), training=training))

    def unwrapped(x, training=None):
        return shared(block.layers[1](shared(shared(x))))

    assert_same_training(wrapped, unwrapped, [normal((4, 8))], block.trainable_variables, [], mode)


@pytest.mark.parametrize("mode", MODES)
def test_layers_shared_by_two_blocks_and_a_block_used_twice(mode):
    shared = _built(keras.layers.Dense(8, activation="tanh"))
    bn = _built(keras.layers.BatchNormalization(momentum=0.5))  # updated by both blocks, in order
    first = RecomputeBlock([shared, bn, keras.layers.Dropout(0.3, seed=1)])
    second = RecomputeBlock([keras.layers.Dense(8), shared, bn])
    first.build((None, 8))
    second.build((None, 8))
    variables = first.trainable_variables + second.layers[0].trainable_variables
    state = first.non_trainable_variables

    def wrapped(x, training=None):
        return first(second(first(x, training=training), training=training), training=training)

    def unwrapped(x, training=None):
        once = apply_in_order(first.layers)
        return once(apply_in_order(second.layers)(once(x, training), training), training)

    assert_same_training(wrapped, unwrapped, [normal((4, 8))], variables, state, mode)


# ------------------------------------------------------------------ frozen layers


def _frozen_layers():
    frozen_dense = keras.layers.Dense(8, activation="tanh")
    frozen_bn = keras.layers.BatchNormalization(momentum=0.5)
    frozen_dense.trainable = False
    frozen_bn.trainable = False  # runs in inference mode, never updates
    return [frozen_dense, frozen_bn, keras.layers.Dropout(0.3, seed=2), keras.layers.Dense(4)]


@pytest.mark.parametrize("mode", MODES)
def test_frozen_layers_get_no_gradient_and_no_update(mode):
    layers = _frozen_layers()
    block = RecomputeBlock(layers)
    block.build((None, 8))
    frozen = layers[0].variables + layers[1].variables
    assert len(block.trainable_variables) == 2  # only the last Dense
    before = [v.numpy().copy() for v in frozen]
    assert_same_training(
        block,
        apply_in_order(layers),
        [normal((4, 8))],
        block.trainable_variables,
        block.non_trainable_variables,
        mode,
    )

    def step(x):
        with tf.GradientTape() as tape:
            y = block(x, training=True)
        return tape.gradient(y, frozen)

    if mode == "function":
        step = tf.function(step)
    assert all(g is None for g in step(normal((4, 8))))
    for variable, value in zip(frozen, before):
        np.testing.assert_array_equal(variable.numpy(), value, err_msg=variable.path)


def test_frozen_layers_train_like_unwrapped_in_model_fit():
    layers = _frozen_layers()
    head = keras.layers.Dense(8)  # trainable, so the block's input needs a gradient
    blocked = keras.Sequential([keras.Input((8,)), head, RecomputeBlock(layers)])
    plain = keras.Sequential([keras.Input((8,)), head, *layers])
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(16, 8)).astype("float32"), rng.normal(size=(16, 4)).astype("float32")
    frozen = layers[0].variables + layers[1].variables
    before = [v.numpy().copy() for v in frozen]
    assert_same_fit([plain, blocked], plain.variables, x, y)
    for variable, value in zip(frozen, before):
        np.testing.assert_array_equal(variable.numpy(), value, err_msg=variable.path)


def _pointless_block():
    dense = keras.layers.Dense(4)
    dense.trainable = False
    block = RecomputeBlock([dense, keras.layers.Dropout(0.5, seed=1)])
    block.build((None, 8))
    return block


@pytest.mark.parametrize("mode", MODES)
def test_block_with_nothing_to_differentiate_warns_once_and_runs_plainly(mode):
    block = _pointless_block()
    x = normal((4, 8))

    def step(x):
        with tf.GradientTape():
            return block(x, training=True)

    if mode == "function":
        step = tf.function(step)
    with pytest.warns(UserWarning, match=r"RecomputeBlock '.*': recompute is pointless") as caught:
        first = step(x)
        second = step(x * 2.0)
    assert len([w for w in caught if "pointless" in str(w.message)]) == 1
    # A plain training call: dropout active, the same as the layers unwrapped.
    assert np.count_nonzero(first.numpy() == 0) > 0
    assert second.shape == (4, 4)


@pytest.mark.parametrize("mode", MODES)
def test_frozen_block_with_a_watched_input_recomputes_without_warning(mode):
    block = _pointless_block()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_same_training(
            block,
            apply_in_order(block.layers),
            [normal((4, 8))],  # watched by the helper's tape: the input needs its gradient
            [],
            block.non_trainable_variables,
            mode,
        )


@pytest.mark.parametrize("mode", MODES)
def test_nested_block_without_variables_does_not_warn(mode):
    """In the enclosing block's forward nothing records: the inner block is a plain call."""
    inner = RecomputeBlock([keras.layers.Dropout(0.5, seed=1)])
    outer = RecomputeBlock([inner, keras.layers.Dense(8)])
    outer.build((None, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_same_training(
            outer,
            apply_in_order([inner.layers[0], outer.layers[1]]),
            [normal((4, 8))],
            outer.trainable_variables,
            outer.non_trainable_variables,
            mode,
        )


def test_pointless_block_warns_in_model_fit():
    model = keras.Sequential(
        [keras.Input((8,)), _pointless_block(), keras.layers.Dense(2)]  # the block comes first
    )
    model.compile(optimizer="sgd", loss="mse")
    with pytest.warns(UserWarning, match="recompute is pointless"):
        model.fit(np.ones((4, 8), "float32"), np.ones((4, 2), "float32"), verbose=0)


# ------------------------------------------------------------------ odd inputs


@pytest.mark.parametrize("mode", MODES)
def test_same_tensor_passed_twice_to_a_functional_block(mode):
    a, b = keras.Input((4,)), keras.Input((4,))
    product = keras.layers.Multiply()([keras.layers.Dense(4, activation="tanh")(a), b])
    model = keras.Model([a, b], keras.layers.Dense(3)(product))
    block = RecomputeBlock(model)

    def wrapped(x, training=None):
        return block([x, x], training=training)

    def unwrapped(x, training=None):
        return model([x, x], training=training)

    assert_same_training(wrapped, unwrapped, [normal((2, 4))], model.trainable_variables, [], mode)


@pytest.mark.parametrize("mode", MODES)
def test_same_tensor_as_query_and_value_of_a_single_layer_block(mode):
    mha = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)
    x = normal((2, 5, 8))
    mha(x, x)
    block = RecomputeBlock(mha)

    def wrapped(x, training=None):
        return block(x, x, training=training)

    def unwrapped(x, training=None):
        return mha(x, x, training=training)

    assert_same_training(wrapped, unwrapped, [x], mha.trainable_variables, [], mode)


@pytest.mark.parametrize("mode", MODES)
def test_zero_size_batch_passes_through(mode):
    layers = [
        keras.layers.Dense(6),
        keras.layers.Dropout(0.5, seed=1),
        keras.layers.LayerNormalization(),
        keras.layers.Dense(3),
    ]
    block = RecomputeBlock(layers)
    block.build((None, 4))
    assert_same_training(
        block,
        apply_in_order(layers),
        [tf.zeros((0, 4))],
        block.trainable_variables,
        block.non_trainable_variables,
        mode,
    )


@pytest.mark.parametrize("mode", MODES)
def test_integer_token_ids_as_the_only_input(mode):
    layers = [keras.layers.Embedding(20, 4), keras.layers.Dense(3, activation="tanh")]
    block = RecomputeBlock(layers)
    block.build((None, 5))
    ids = tf.constant(np.random.default_rng(0).integers(0, 20, size=(3, 5)), tf.int32)
    assert_same_training(block, apply_in_order(layers), [ids], block.trainable_variables, [], mode)


class WithArgmax(keras.layers.Layer):
    """Returns a float tensor and an integer one (no gradient)."""

    def build(self, input_shape):
        self.dense = keras.layers.Dense(5)
        self.dense.build(input_shape)

    def call(self, x):
        h = self.dense(x)
        return {"h": h, "index": tf.argmax(h, axis=-1, output_type=tf.int32)}


@pytest.mark.parametrize("mode", MODES)
def test_integer_outputs_pass_through(mode):
    layer = WithArgmax()
    layer.build((None, 8))
    block = RecomputeBlock(layer)

    def wrapped(x, training=None):
        out = block(x, training=training)
        return [out["h"], tf.cast(out["index"], tf.float32)]

    def unwrapped(x, training=None):
        out = layer(x)
        return [out["h"], tf.cast(out["index"], tf.float32)]

    assert_same_training(wrapped, unwrapped, [normal((4, 8))], layer.trainable_variables, [], mode)
