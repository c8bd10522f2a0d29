"""`tfrecompute.checkpoint(fn)`: a function recomputed in backprop, against `fn` itself.

Every test runs the checkpointed function and the function unwrapped on the
same variables and state (restored between the two runs) and compares
outputs, gradients (None where the unwrapped function gives None) and state
updates; and checks that the checkpointed function did run twice.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfrecompute
from tests import multiworker_worker as worker
from tests.helpers import (
    MODES,
    assert_same_adamw_fit,
    assert_same_run,
    assert_same_values,
    load_state,
    normal,
    save_state,
)
from tfrecompute.errors import NonReplayableRandomnessError

pytestmark = pytest.mark.usefixtures("collect_garbage")


def _layers():
    keras.utils.set_random_seed(0)
    dense = keras.layers.Dense(16, activation="relu")
    dropout = keras.layers.Dropout(0.5, seed=1)
    norm = keras.layers.BatchNormalization(momentum=0.5)
    dense.build((4, 8))
    norm.build((4, 16))
    return dense, dropout, norm


def _grads_run(fn, x, variables):
    """`run(f)` for `assert_same_run`: f's outputs and gradients for x and `variables`."""

    def run(f):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = f(x)
            loss = tf.reduce_sum(y * tf.sin(tf.range(tf.size(y), dtype=y.dtype)[: y.shape[-1]]))
        return y, tape.gradient(loss, [x, *variables])

    return run


def _counting(fn):
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return fn(*args, **kwargs)

    return counted, calls


@pytest.mark.parametrize("mode", MODES)
def test_dropout_and_batch_norm_in_a_closure(mode):
    """Dropout's mask is replayed and BatchNormalization's statistics move once."""
    dense, dropout, norm = _layers()

    def block(x):
        return norm(dropout(dense(x), training=True), training=True)

    counted, calls = _counting(block)
    checkpointed = tfrecompute.checkpoint(counted)
    x = normal((4, 8))
    state = dropout.non_trainable_variables + norm.non_trainable_variables
    variables = dense.trainable_variables + norm.trainable_variables
    before = save_state(state)
    assert_same_run(_grads_run(None, x, variables), checkpointed, block, mode, state=state)
    assert len(calls) == 2  # the forward, and the recompute in backprop (traced once each)
    assert any(not np.array_equal(a, b) for a, b in zip(save_state(state), before))


@pytest.mark.parametrize("mode", MODES)
def test_layers_first_built_by_the_first_taped_call_get_their_gradients(mode):
    """Layers in the closure built by the checkpointed function's first call, under a tape:
    their weights as built (not fresh initializer draws) and their exact gradients."""

    def make():
        keras.utils.set_random_seed(0)
        return keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(4)

    def run(fn, layers):
        def step(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = fn(x)
                loss = tf.reduce_sum(y * tf.sin(tf.range(4, dtype=y.dtype)))
            variables = [v for layer in layers for v in layer.trainable_variables]
            return y, tape.gradient(loss, [x, *variables])

        return (step if mode == "eager" else tf.function(step))(normal((8, 8)))

    first, second = make()
    got = run(tfrecompute.checkpoint(lambda t: second(first(t))), (first, second))
    plain_first, plain_second = make()
    want = run(lambda t: plain_second(plain_first(t)), (plain_first, plain_second))
    assert all(g is not None for g in got[1]), got[1]
    assert_same_values(got, want, what="outputs and gradients")


def test_reaches_the_state_of_what_it_calls():
    dense, dropout, norm = _layers()
    checkpointed = tfrecompute.checkpoint(lambda x: norm(dropout(dense(x))))
    names = {v.path for v in checkpointed.block.non_trainable_variables}
    assert names == {v.path for v in dropout.non_trainable_variables + norm.non_trainable_variables}


@pytest.mark.parametrize("mode", MODES)
def test_captured_variables_get_their_gradients_and_unused_ones_none(mode):
    """A tf.Variable and a keras.Variable read from the closure, and one that only an
    output nobody differentiates reads: its gradient is None, as unwrapped."""
    w = tf.Variable(normal((8, 8), seed=1))
    k = keras.Variable(normal((8,), seed=2))
    unused = tf.Variable(normal((8,), seed=3))

    def fn(x):
        return tf.tanh(x @ w) * k, x * unused

    checkpointed = tfrecompute.checkpoint(fn)
    x = normal((4, 8))

    def run(f):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y, _ = f(x)
            loss = tf.reduce_sum(y * y)
        return y, tape.gradient(loss, [x, w, k.value, unused])

    got = assert_same_run(run, checkpointed, fn, mode)
    assert got[1][3] is None


def test_runs_plainly_without_a_tape_and_in_inference():
    dense, dropout, _ = _layers()
    counted, calls = _counting(lambda x, training=None: dropout(dense(x), training=training))
    checkpointed = tfrecompute.checkpoint(counted)
    x = normal((4, 8))
    np.testing.assert_array_equal(checkpointed(x), dense(x))  # no tape, no Keras call: no dropout
    assert len(calls) == 1
    for training, runs in ((False, 1), (True, 2)):
        calls.clear()
        with tf.GradientTape() as tape:
            y = checkpointed(x, training=training)
        assert tape.gradient(y, dense.kernel) is not None
        assert len(calls) == runs


def _attention_class(checkpointed):
    """A layer recomputing only part of its call, its core (a method); the control is the
    same class without the decorator (same name: Keras's files name layers by class)."""

    class Attention(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.qkv = keras.layers.Dense(48)
            self.out = keras.layers.Dense(16)
            self.dropout = keras.layers.Dropout(0.3, seed=5)

        def build(self, shape):
            self.qkv.build(shape)
            self.out.build((*shape[:-1], 16))

        def core(self, q, k, v, training=None):
            scores = keras.ops.softmax(keras.ops.einsum("bqd,bkd->bqk", q, k) / 4.0)
            return keras.ops.einsum("bqk,bkd->bqd", self.dropout(scores, training=training), v)

        if checkpointed:
            core = tfrecompute.checkpoint(core)

        def call(self, x, training=None):
            q, k, v = keras.ops.split(self.qkv(x), 3, axis=-1)
            return self.out(self.core(q, k, v, training))

    return Attention


CheckpointedAttention, PlainAttention = _attention_class(True), _attention_class(False)


def _attention_models():
    keras.utils.set_random_seed(0)
    models = []
    for cls in (CheckpointedAttention, PlainAttention):
        inputs = keras.Input((6, 16))
        x = cls(name="attention")(inputs)
        models.append(keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Flatten()(x))))
    models[1].set_weights(models[0].get_weights())
    return models


def _fit_alike(models):
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(16, 6, 16)).astype("float32"), rng.normal(size=(16, 3))
    assert_same_adamw_fit(models, x, y)


def test_a_decorated_method_trains_like_the_plain_method():
    checkpointed, plain = _attention_models()
    _fit_alike([checkpointed, plain])
    layer = checkpointed.get_layer("attention")
    assert layer.core is layer.core  # one per instance
    assert layer.core.block.non_trainable_variables == layer.dropout.non_trainable_variables
    counted, calls = _counting(layer.core._fn)
    layer.core._fn = counted
    layer.core.block._fn = counted
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(checkpointed(normal((2, 6, 16)), training=True))
    tape.gradient(loss, checkpointed.trainable_variables)
    assert len(calls) == 2


def test_a_decorated_method_saves_like_the_plain_method(tmp_path):
    checkpointed, plain = _attention_models()
    x = normal((2, 6, 16))
    with tf.GradientTape():
        checkpointed(x, training=True)  # the checkpoint is made and cached on the layer
    checkpointed.save_weights(tmp_path / "c.weights.h5")
    plain.set_weights([np.zeros_like(w) for w in plain.get_weights()])
    plain.load_weights(tmp_path / "c.weights.h5")
    assert_same_values(plain.get_weights(), checkpointed.get_weights())
    tf.train.Checkpoint(model=checkpointed).write(str(tmp_path / "ckpt"))
    plain.set_weights([np.zeros_like(w) for w in plain.get_weights()])
    tf.train.Checkpoint(model=plain).read(str(tmp_path / "ckpt")).assert_consumed()
    assert_same_values(plain.get_weights(), checkpointed.get_weights())
    checkpointed.save(tmp_path / "c.keras")
    loaded = keras.saving.load_model(
        tmp_path / "c.keras", custom_objects={"Attention": CheckpointedAttention}
    )
    assert_same_values(loaded(x), checkpointed(x))


def test_xla():
    dense, dropout, norm = _layers()

    def block(x):
        return norm(dropout(dense(x), training=True), training=True)

    x = normal((4, 8))
    state = dropout.non_trainable_variables + norm.non_trainable_variables
    run = _grads_run(None, x, dense.trainable_variables)
    initial = save_state(state)
    got = tf.function(lambda: run(tfrecompute.checkpoint(block)), jit_compile=True)()
    load_state(state, initial)
    want = tf.function(lambda: run(block), jit_compile=True)()
    assert_same_values(got, want, rtol=1e-5)


def test_mirrored_strategy_trains_like_the_plain_method():
    strategy = worker.mirrored_strategy(["CPU:0", "CPU:1"])
    with strategy.scope():
        models = _attention_models()
        _fit_alike(models)


# ---------------------------------------------------------------- errors


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match=r"tfrecompute.checkpoint: `fn` must be callable"):
        tfrecompute.checkpoint(3)
    with pytest.raises(TypeError, match=r"`state` must hold Keras layers.*Received: state=3"):
        tfrecompute.checkpoint(lambda x: x, state=3)
    with pytest.raises(ValueError, match=r"policy 'attention' selects attention layers"):
        tfrecompute.checkpoint(lambda x: x, policy="attention")
    with pytest.raises(ValueError, match=r"unknown recompute policy"):
        tfrecompute.checkpoint(lambda x: x, policy="everything")


def test_state_it_cannot_reach_fails_loudly():
    """A Dropout held where the closure scan does not look (an object's attribute)."""
    holder = type("Holder", (), {})()
    holder.dropout = keras.layers.Dropout(0.5, seed=1)
    checkpointed = tfrecompute.checkpoint(lambda x: holder.dropout(x, training=True))
    with pytest.raises(NonReplayableRandomnessError, match=r"Pass the layers or seed generators"):
        with tf.GradientTape() as tape:
            x = normal((4, 8))
            tape.watch(x)
            checkpointed(x)
    reached = tfrecompute.checkpoint(
        lambda x: holder.dropout(x, training=True), state=[holder.dropout]
    )
    run = _grads_run(None, normal((4, 8)), [])
    state = holder.dropout.non_trainable_variables
    assert_same_run(run, reached, lambda x: holder.dropout(x, training=True), "eager", state=state)


def test_a_loss_with_no_layer_to_hold_it_fails_loudly():
    regularized = type("Holder", (), {})()
    regularized.dense = keras.layers.Dense(4, activity_regularizer="l2")
    checkpointed = tfrecompute.checkpoint(lambda x: regularized.dense(x), state=[])
    with pytest.raises(ValueError, match=r"added a loss .* reaches no layer"):
        with tf.GradientTape() as tape:
            x = normal((4, 8))
            tape.watch(x)
            checkpointed(x)
