"""Nested blocks, Keras masks and recurrent layers inside a RecomputeBlock."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras.src.backend import get_keras_mask

from tests.helpers import (
    MODES,
    apply_in_order,
    assert_same_fit,
    assert_same_training,
    normal,
)
from tfrecompute import RecomputeBlock
from tfrecompute.graph.layer_graph import LayerGraph


class CountingLayer(keras.layers.Layer):
    """Counts how often its forward runs (Python side: once per eager run or per trace)."""

    def __init__(self, units=8, **kwargs):
        super().__init__(**kwargs)
        self.calls = 0
        self.dense = keras.layers.Dense(units, activation="tanh")

    def build(self, input_shape):
        self.dense.build(input_shape)

    def call(self, x):
        self.calls += 1
        return self.dense(x)


def _token_ids(shape=(3, 6), seed=0, vocab=10):
    """Token ids in [1, vocab) with trailing padding (0) in the first two rows."""
    ids = np.random.default_rng(seed).integers(1, vocab, size=shape)
    ids[0, shape[1] // 2 :] = 0
    ids[1, 1:] = 0
    return tf.constant(ids, tf.int32)


# ------------------------------------------------------------------ nesting


def _nested(levels):
    """`levels` blocks nested in each other, one CountingLayer per level.

    Level 0 is the outermost; the innermost level also holds Dropout and
    BatchNormalization, so replay and single state updates are checked through
    all levels.
    """
    counters = [CountingLayer(name=f"count_{level}") for level in range(levels)]
    dropout = keras.layers.Dropout(0.4, seed=3)
    bn = keras.layers.BatchNormalization(momentum=0.5)
    block = RecomputeBlock([counters[-1], dropout, bn], name=f"block_{levels - 1}")
    unwrapped = [counters[-1], dropout, bn]
    for level in reversed(range(levels - 1)):
        tail = keras.layers.Dense(8, name=f"tail_{level}")
        block = RecomputeBlock([counters[level], block, tail], name=f"block_{level}")
        unwrapped = [counters[level], *unwrapped, tail]
    block.build((None, 8))
    return block, counters, apply_in_order(unwrapped)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("levels", [2, 3])
def test_nested_blocks_match_unwrapped(levels, mode):
    block, _, unwrapped = _nested(levels)
    assert_same_training(
        block,
        unwrapped,
        [normal((4, 8))],
        block.trainable_variables,
        block.non_trainable_variables,
        mode,
    )


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("levels", [2, 3])
def test_nested_forward_count_is_one_more_per_level(levels, mode):
    # A layer at nesting depth d runs d + 1 times per training step: see
    # NOTE [ Nested blocks ] in tfrecompute/layers/block.py. Two
    # levels: outer layers twice (forward, outer recompute), inner layers three
    # times (forward, outer recompute, the inner block's own recompute).
    block, counters, _ = _nested(levels)
    x = normal((4, 8))

    def step(x):
        with tf.GradientTape() as tape:
            y = block(x, training=True)
        return tape.gradient(y, block.trainable_variables)

    if mode == "function":
        step = tf.function(step)  # counts are per trace
    else:
        step(x)  # a warm-up step; eagerly the counts are the same from the first step on
    for counter in counters:
        counter.calls = 0
    grads = step(x)
    assert all(g is not None for g in grads)
    assert [c.calls for c in counters] == [depth + 2 for depth in range(levels)]


def test_nested_blocks_train_like_unwrapped_in_model_fit():
    inner_layers = [keras.layers.Dense(8, activation="relu"), keras.layers.Dropout(0.3, seed=2)]
    outer_layers = [keras.layers.Dense(8), keras.layers.BatchNormalization(), keras.layers.Dense(3)]
    nested = RecomputeBlock([outer_layers[0], RecomputeBlock(inner_layers), *outer_layers[1:]])
    blocked = keras.Sequential([keras.Input((5,)), nested])
    plain = keras.Sequential([keras.Input((5,)), outer_layers[0], *inner_layers, *outer_layers[1:]])
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(16, 5)).astype("float32"), rng.normal(size=(16, 3)).astype("float32")
    assert_same_fit([plain, blocked], plain.variables, x, y)


# ------------------------------------------------------------------ masking


@pytest.mark.parametrize("mode", MODES)
def test_mask_from_an_embedding_outside_reaches_lstm_and_gru_inside(mode):
    embedding = keras.layers.Embedding(10, 6, mask_zero=True)
    lstm = keras.layers.LSTM(5, return_sequences=True, dropout=0.3, seed=1)
    gru = keras.layers.GRU(4)
    ids = _token_ids()
    block = RecomputeBlock([lstm, gru])
    block(embedding(ids))

    def wrapped(i, training=None):
        return block(embedding(i), training=training)

    def unwrapped(i, training=None):
        return gru(lstm(embedding(i), training=training), training=training)

    variables = embedding.trainable_variables + block.trainable_variables
    assert_same_training(wrapped, unwrapped, [ids], variables, block.non_trainable_variables, mode)
    # Not vacuous: the mask changes the result.
    unmasked = gru(lstm(embedding(ids) + 0.0))
    assert not np.allclose(unwrapped(ids), unmasked)


@pytest.mark.parametrize("mode", MODES)
def test_embedding_and_lstm_inside_a_block_produce_and_consume_the_mask(mode):
    embedding = keras.layers.Embedding(10, 6, mask_zero=True)
    lstm = keras.layers.LSTM(5, return_sequences=True)
    block = RecomputeBlock([embedding, lstm])
    block.build((None, 6))
    ids = _token_ids()
    assert_same_training(
        block, apply_in_order([embedding, lstm]), [ids], block.trainable_variables, [], mode
    )

    def masks(x):
        with tf.GradientTape():  # the recompute path
            trained = block(x, training=True)
        return get_keras_mask(trained), get_keras_mask(block(x, training=False))

    if mode == "function":
        masks = tf.function(masks)
    for mask in masks(ids):
        np.testing.assert_array_equal(mask, ids.numpy() != 0)


@pytest.mark.parametrize("mode", MODES)
def test_masked_inputs_of_multi_head_attention_reach_the_recompute(mode):
    """Several masked tensors: MultiHeadAttention reads query/value masks from its inputs."""
    embedding = keras.layers.Embedding(10, 8, mask_zero=True)
    mha = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4, dropout=0.2, seed=5)
    ids = _token_ids()
    e = embedding(ids)
    mha(e, e)
    block = RecomputeBlock(mha)

    def wrapped(i, training=None):
        e = embedding(i)
        return block(e, e, training=training)

    def unwrapped(i, training=None):
        e = embedding(i)
        return mha(e, e, training=training)

    variables = embedding.trainable_variables + mha.trainable_variables
    assert_same_training(wrapped, unwrapped, [ids], variables, mha.non_trainable_variables, mode)


@pytest.mark.parametrize("mode", MODES)
def test_functional_block_with_embedding_and_attention(mode):
    ids_in = keras.Input((6,), dtype="int32")
    e = keras.layers.Embedding(10, 8, mask_zero=True)(ids_in)
    a = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)(e, e)
    pooled = keras.layers.GlobalAveragePooling1D()(a)  # consumes the mask
    model = keras.Model(ids_in, pooled)
    block = RecomputeBlock(model)
    assert_same_training(block, model, [_token_ids()], model.trainable_variables, [], mode)


def test_block_after_an_embedding_trains_like_unwrapped_in_model_fit():
    embedding = keras.layers.Embedding(10, 6, mask_zero=True)
    lstm = keras.layers.LSTM(5, return_sequences=True)
    pooling = keras.layers.GlobalAveragePooling1D()
    dense = keras.layers.Dense(2)
    blocked = keras.Sequential(
        [keras.Input((6,), dtype="int32"), embedding, RecomputeBlock([lstm, pooling]), dense]
    )
    plain = keras.Sequential([keras.Input((6,), dtype="int32"), embedding, lstm, pooling, dense])
    ids = np.concatenate([_token_ids(seed=s).numpy() for s in range(4)])
    y = np.random.default_rng(0).normal(size=(len(ids), 2)).astype("float32")
    assert_same_fit([plain, blocked], plain.variables, ids, y, batch_size=4)


@pytest.mark.parametrize("kind", ["sequential", "functional"])
def test_a_mask_made_inside_a_block_reaches_the_layers_after_it(kind):
    """The block's symbolic output mask is an op of the model's graph.

    It used to be a spec traced apart, which a later layer of the model could
    not take ("Graph disconnected").
    """
    embedding = keras.layers.Embedding(10, 6, mask_zero=True)
    dense = keras.layers.Dense(6, activation="tanh")
    lstm = keras.layers.LSTM(5)  # reads the mask
    head = keras.layers.Dense(2)
    layers = [embedding, dense, lstm, head]
    if kind == "sequential":
        blocked = keras.Sequential(
            [keras.Input((6,), dtype="int32"), RecomputeBlock([embedding, dense]), lstm, head]
        )
    else:
        ids_in = keras.Input((6,), dtype="int32")
        blocked = keras.Model(ids_in, head(lstm(RecomputeBlock([embedding, dense])(ids_in))))
    # The layer calls compute_mask makes for the symbolic mask are not the model's.
    called = {id(call.layer) for call in LayerGraph.of(blocked).calls}
    assert not {id(embedding), id(dense)} & called
    plain = keras.Sequential([keras.Input((6,), dtype="int32"), *layers])
    ids = np.concatenate([_token_ids(seed=s).numpy() for s in range(4)])
    unmasked = np.where(ids == 0, 7, ids)  # other padding ids: other outputs, if masked
    assert not np.allclose(plain(ids), plain(unmasked), atol=1e-4)
    np.testing.assert_allclose(blocked(ids), plain(ids), atol=1e-6)
    y = np.random.default_rng(0).normal(size=(len(ids), 2)).astype("float32")
    assert_same_fit([plain, blocked], plain.variables, ids, y, batch_size=4)


def test_compute_mask_of_a_list_uses_each_layers_own_input():
    """Masking's mask depends on its input, here the output of the Dense before it."""
    dense = keras.layers.Dense(3, kernel_initializer="zeros", bias_initializer="ones")
    block = RecomputeBlock([dense, keras.layers.Masking(0.0)])
    x = np.ones((2, 4, 3), "float32")
    x[0, 2:] = 0.0  # masked if Masking saw the block's input; the Dense output is all ones
    np.testing.assert_array_equal(block.compute_mask(tf.constant(x)), np.ones((2, 4), bool))
    symbolic = block.compute_mask(keras.Input((4, 3)))
    assert isinstance(symbolic, keras.KerasTensor) and symbolic.shape == (None, 4)
    assert symbolic.dtype == "bool"


def test_compute_mask_of_a_list_delegates_to_the_layers():
    ids = _token_ids()
    keeps = RecomputeBlock(
        [keras.layers.Embedding(10, 4, mask_zero=True), keras.layers.LSTM(3, return_sequences=True)]
    )
    np.testing.assert_array_equal(keeps.compute_mask(ids), ids.numpy() != 0)
    drops = RecomputeBlock([keras.layers.Embedding(10, 4, mask_zero=True), keras.layers.LSTM(3)])
    assert drops.compute_mask(ids) is None
    single = RecomputeBlock(keras.layers.Embedding(10, 4, mask_zero=True))
    np.testing.assert_array_equal(single.compute_mask(ids), ids.numpy() != 0)


def test_symbolic_masks_propagate_through_a_block():
    ids_in = keras.Input((6,), dtype="int32")
    e = keras.layers.Embedding(10, 4, mask_zero=True)(ids_in)
    out = RecomputeBlock([keras.layers.LSTM(3, return_sequences=True), keras.layers.Dense(2)])(e)
    assert get_keras_mask(out) is not None and get_keras_mask(out).shape == (None, 6)


# ------------------------------------------------------------------ recurrent layers


class WhileLoopLayer(keras.layers.Layer):
    """Three steps of h = tanh(h W + x) in a tf.while_loop."""

    def build(self, input_shape):
        self.w = self.add_weight(shape=(input_shape[-1], input_shape[-1]))

    def call(self, x):
        def body(i, h):
            return i + 1, tf.tanh(tf.matmul(h, self.w) + x)

        return tf.while_loop(lambda i, h: i < 3, body, (tf.constant(0), x))[1]


RECURRENT_CASES = {
    "lstm_with_dropouts": lambda: [
        keras.layers.LSTM(6, return_sequences=True, dropout=0.3, recurrent_dropout=0.2, seed=1)
    ],
    "gru_simple_rnn": lambda: [
        keras.layers.GRU(5, return_sequences=True),
        keras.layers.SimpleRNN(4),
    ],
    "bidirectional_lstm": lambda: [keras.layers.Bidirectional(keras.layers.LSTM(3))],
    "while_loop_in_call": lambda: [keras.layers.Flatten(), WhileLoopLayer()],
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", sorted(RECURRENT_CASES))
def test_recurrent_layers_match_unwrapped(case, mode):
    layers = RECURRENT_CASES[case]()
    block = RecomputeBlock(layers)
    block.build((None, 5, 4))
    assert_same_training(
        block,
        apply_in_order(layers),
        [normal((3, 5, 4))],
        block.trainable_variables,
        block.non_trainable_variables,
        mode,
    )
