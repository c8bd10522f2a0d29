"""RecomputeBlock against the same layers unwrapped: outputs, gradients, state."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import MODES, assert_same_training, load_state, save_state
from tfrecompute import RecomputeBlock


def _x(shape=(4, 8), seed=0):
    return tf.constant(np.random.default_rng(seed).normal(size=shape).astype("float32"))


def _apply(layers):
    def fn(x, training=None):
        for layer in layers:
            x = layer(x, training=training)
        return x

    return fn


def _built(layers, shape=(None, 8)):
    for layer in layers:
        layer.build(shape)
        shape = layer.compute_output_shape(shape)
    return layers


class CountingLayer(keras.layers.Layer):
    """Counts how often its forward runs (Python side: once per eager run or trace)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.calls = 0
        self.dense = keras.layers.Dense(8, activation="tanh")

    def build(self, input_shape):
        self.dense.build(input_shape)

    def call(self, x):
        self.calls += 1
        return self.dense(x)


LAYER_CASES = {
    "dense_chain": lambda: [keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(8)],
    "dropout": lambda: [
        keras.layers.Dense(16, activation="relu"),
        keras.layers.Dropout(0.5, seed=1),
        keras.layers.Dense(8),
    ],
    "batchnorm": lambda: [
        keras.layers.Dense(16),
        keras.layers.BatchNormalization(momentum=0.5),
        keras.layers.Dense(8),
    ],
    "dropout_batchnorm_noise": lambda: [
        keras.layers.Dense(16),
        keras.layers.GaussianNoise(0.3, seed=2),
        keras.layers.BatchNormalization(momentum=0.5),
        keras.layers.Dropout(0.3),  # unseeded: its SeedGenerator is still owned by the layer
        keras.layers.Dense(8),
    ],
    "layer_norm_activation": lambda: [
        keras.layers.Dense(16),
        keras.layers.LayerNormalization(),
        keras.layers.Activation("gelu"),
        keras.layers.Dense(8),
    ],
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", sorted(LAYER_CASES))
def test_list_of_layers_matches_unwrapped(case, mode):
    layers = _built(LAYER_CASES[case]())
    block = RecomputeBlock(layers)
    block.build((None, 8))
    assert_same_training(
        block,
        _apply(layers),
        [_x()],
        block.trainable_variables,
        block.non_trainable_variables,
        mode,
    )


@pytest.mark.parametrize("mode", MODES)
def test_single_layer_matches_unwrapped(mode):
    layer = keras.layers.Dense(8, activation="sigmoid")
    layer.build((None, 8))
    block = RecomputeBlock(layer)
    assert_same_training(block, layer, [_x()], layer.trainable_variables, [], mode)


def _functional_two_in_two_out():
    a = keras.Input((8,), name="a")
    b = keras.Input((3,), name="b")
    h = keras.layers.Dense(16, activation="tanh")(a)
    h = keras.layers.Dropout(0.5, seed=4)(h)
    g = keras.layers.Dense(16)(b)
    s = keras.layers.Add()([h, g])
    s = keras.layers.BatchNormalization(momentum=0.5)(s)
    return keras.Model([a, b], {"sum": s, "head": keras.layers.Dense(2)(s)})


@pytest.mark.parametrize("mode", MODES)
def test_functional_model_with_two_inputs_and_dict_outputs(mode):
    model = _functional_two_in_two_out()
    block = RecomputeBlock(model)
    x = [_x(), _x((4, 3), seed=1)]

    def wrapped(a, b, training=None):
        return block([a, b], training=training)

    def unwrapped(a, b, training=None):
        return model([a, b], training=training)

    assert_same_training(
        wrapped, unwrapped, x, model.trainable_variables, model.non_trainable_variables, mode
    )


@pytest.mark.parametrize("mode", MODES)
def test_integer_token_ids_and_extra_float_input(mode):
    ids_in = keras.Input((5,), dtype="int32")
    scale_in = keras.Input((5, 1))
    e = keras.layers.Embedding(20, 6)(ids_in)
    h = keras.layers.Multiply()([e, scale_in])
    model = keras.Model([ids_in, scale_in], keras.layers.Dense(4, activation="tanh")(h))
    block = RecomputeBlock(model)
    ids = tf.constant(np.random.default_rng(0).integers(0, 20, size=(3, 5)), dtype=tf.int32)
    scale = _x((3, 5, 1))

    def wrapped(i, s, training=None):
        return block([i, s], training=training)

    def unwrapped(i, s, training=None):
        return model([i, s], training=training)

    assert_same_training(wrapped, unwrapped, [ids, scale], model.trainable_variables, [], mode)


@pytest.mark.parametrize("mode", MODES)
def test_extra_call_arguments_reach_a_single_layer(mode):
    mha = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4, dropout=0.5, seed=3)
    q, v = _x((2, 5, 8)), _x((2, 7, 8), seed=1)
    mha(q, v)
    block = RecomputeBlock(mha)

    def wrapped(q, v, training=None):
        return block(q, v, training=training)

    def unwrapped(q, v, training=None):
        return mha(q, v, training=training)

    assert_same_training(
        wrapped, unwrapped, [q, v], mha.trainable_variables, mha.non_trainable_variables, mode
    )


class NoTrainingArg(keras.layers.Layer):
    """Its call takes no `training`: the Dropout inside reads it from Keras's call context."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(8)
        self.dropout = keras.layers.Dropout(0.5, seed=5)

    def call(self, x):
        return self.dropout(self.dense(x))


@pytest.mark.parametrize("mode", MODES)
def test_training_reaches_nested_layers_in_the_recompute(mode):
    layer = NoTrainingArg()
    layer(_x())
    block = RecomputeBlock([layer, keras.layers.Dense(4)])
    block.build((None, 8))

    def unwrapped(x, training=None):
        return block.layers[1](layer(x, training=training), training=training)

    assert_same_training(
        block, unwrapped, [_x()], block.trainable_variables, block.non_trainable_variables, mode
    )


@pytest.mark.parametrize("mode", MODES)
def test_activity_regularizer_loss_gets_its_gradient(mode):
    dense = keras.layers.Dense(8, activity_regularizer=keras.regularizers.L2(0.1))
    dense.build((None, 8))
    block = RecomputeBlock([dense])

    def with_loss(layer_call):
        def fn(x, training=None):
            owner = block if layer_call is block else dense
            y = layer_call(x, training=training)
            return [y, tf.add_n(owner.losses)]

        return fn

    assert_same_training(
        with_loss(block), with_loss(dense), [_x()], dense.trainable_variables, [], mode
    )


@pytest.mark.parametrize("mode", MODES)
def test_forward_runs_twice_in_training_and_once_in_inference(mode):
    counter = CountingLayer()
    block = RecomputeBlock([counter])
    block.build((None, 8))
    x = _x()

    def train(x):
        with tf.GradientTape() as tape:
            y = block(x, training=True)
        return tape.gradient(y, block.trainable_variables)

    def infer(x):
        return block(x, training=False)

    if mode == "function":
        train, infer = tf.function(train), tf.function(infer)
    counter.calls = 0
    train(x)
    # Forward + recompute, eagerly from the first call on (no trace to look for
    # unreplayable random ops: the eager ops are watched as they run).
    assert counter.calls == 2
    counter.calls = 0
    infer(x)
    assert counter.calls == 1


def test_training_without_a_tape_is_a_plain_call_with_updates():
    layers = _built([keras.layers.Dense(8), keras.layers.BatchNormalization(momentum=0.5)])
    block = RecomputeBlock(layers)
    block.build((None, 8))
    state = block.non_trainable_variables
    initial = save_state(state)
    got = block(_x(), training=True)
    got_state = save_state(state)
    load_state(state, initial)
    want = _apply(layers)(_x(), training=True)
    np.testing.assert_allclose(got, want, atol=1e-6)
    for g, w in zip(got_state, save_state(state)):
        np.testing.assert_allclose(g, w, atol=1e-6)


def test_inference_matches_unwrapped():
    layers = _built(LAYER_CASES["dropout_batchnorm_noise"]())
    block = RecomputeBlock(layers)
    np.testing.assert_allclose(
        block(_x(), training=False), _apply(layers)(_x(), training=False), atol=1e-6
    )


@pytest.mark.parametrize("mode", MODES)
def test_state_updates_apply_once_per_forward(mode):
    """BatchNorm with momentum 0.5 from zero statistics: one update, not two."""
    bn = keras.layers.BatchNormalization(momentum=0.5, center=False, scale=False)
    block = RecomputeBlock([keras.layers.Dense(4, kernel_initializer="ones"), bn])
    block.build((None, 2))
    dropout_free = tf.ones((8, 2))

    def step(x):
        with tf.GradientTape() as tape:
            y = block(x, training=True)
            loss = tf.reduce_sum(y)
        return tape.gradient(loss, block.trainable_variables)

    if mode == "function":
        step = tf.function(step)
    step(dropout_free)
    # Batch mean is 2 per feature; one update gives 0.5 * 0 + 0.5 * 2 = 1.0 (two would give 1.5).
    np.testing.assert_allclose(bn.moving_mean.numpy(), np.ones(4), atol=1e-6)


def _sequential(layers, blocked, block_size=2):
    if blocked:
        layers = [
            RecomputeBlock(layers[i : i + block_size]) for i in range(0, len(layers), block_size)
        ]
    return keras.Sequential([keras.Input((8,)), *layers])


@pytest.mark.parametrize("jit_compile", [False, True])
def test_model_fit_trains_exactly_like_unwrapped(jit_compile):
    layers = [
        keras.layers.Dense(16, activation="relu"),
        keras.layers.Dropout(0.3, seed=7),
        keras.layers.Dense(16),
        keras.layers.BatchNormalization(),
        keras.layers.Dense(4),
    ]
    plain = _sequential(layers, blocked=False)
    blocked = _sequential(layers, blocked=True)  # same layer objects, same variables
    variables = plain.variables  # includes seed generator states
    x = np.random.default_rng(0).normal(size=(32, 8)).astype("float32")
    y = np.random.default_rng(1).normal(size=(32, 4)).astype("float32")
    initial = save_state(variables)
    results = []
    for model in (blocked, plain):
        load_state(variables, initial)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", jit_compile=jit_compile)
        history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        results.append((history.history["loss"], save_state(variables)))
    (loss_a, state_a), (loss_b, state_b) = results
    np.testing.assert_allclose(loss_a, loss_b, rtol=1e-5)
    for a, b in zip(state_a, state_b):
        np.testing.assert_allclose(a, b, atol=1e-5)
    # Training moved the weights (so the comparison is not vacuous).
    assert any(not np.allclose(a, b) for a, b in zip(state_a, initial))


def test_recompute_grad_alone_is_wrong_with_dropout():
    """The failure RecomputeBlock exists for: plain tf.recompute_grad redraws the mask."""
    layers = _built([keras.layers.Dense(64), keras.layers.Dropout(0.5, seed=1)])
    x = _x()
    state = [v for layer in layers for v in layer.non_trainable_variables]

    def naive(x, training=None):
        return tf.recompute_grad(lambda t: _apply(layers)(t, training=True))(x)

    with pytest.raises(AssertionError):
        assert_same_training(
            naive, _apply(layers), [x], layers[0].trainable_variables, state, "eager"
        )


@pytest.mark.parametrize("mode", MODES)
def test_output_without_a_gradient(mode):
    """A block output the loss does not use gets no gradient; the others are unaffected."""
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    model = keras.Model(inputs, [keras.layers.Dense(3)(hidden), keras.layers.Dense(2)(hidden)])
    block = RecomputeBlock(model)

    def step(fn, x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.sin(fn(x, training=True)[0]))
        return tape.gradient(loss, model.trainable_variables)

    if mode == "function":
        step = tf.function(step)
    got, want = step(block, _x()), step(model, _x())
    for g, w in zip(got, want):
        if w is None:
            assert g is None or not np.any(g)
        else:
            np.testing.assert_allclose(g, w, atol=1e-6)


def _producer(tensor: tf.Tensor) -> tf.Operation:
    """The op computing `tensor`, through the identities that pass it on."""
    while tensor.op.type in ("Identity", "IdentityN"):
        tensor = tensor.op.inputs[tensor.value_index]
    return tensor.op


def _ancestors(op: tf.Operation) -> set[str]:
    seen, todo = set(), [op]
    while todo:
        op = todo.pop()
        for parent in [t.op for t in op.inputs] + list(op.control_inputs):
            if parent.name not in seen:
                seen.add(parent.name)
                todo.append(parent)
    return seen


def test_a_blocks_input_gradient_waits_for_its_weight_gradients():
    """NOTE [ Variable gradients wait for the whole backward ]: inputs' gradients wait too.

    Else the previous segment's recompute can start while this segment's
    weight gradients, and so its recomputed activations, are still pending:
    a sqrt plan of 64 Dense layers then peaked at up to 79 MiB in one step of
    150 instead of 17 (more than storing everything) on a loaded 2-core CPU.
    """
    block = RecomputeBlock([keras.layers.Dense(8, activation="tanh") for _ in range(2)])
    block.build((None, 8))

    @tf.function
    def gradients(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = block(x, training=True)
        return tape.gradient(y, [x, *block.trainable_variables])

    graph = gradients.get_concrete_function(tf.TensorSpec((4, 8))).graph
    input_gradient, *weight_gradients = graph.outputs
    before = _ancestors(input_gradient.op)
    assert len(weight_gradients) == 4
    for gradient in weight_gradients:
        assert _producer(gradient).name in before, gradient


def test_variable_updates_in_the_same_step_do_not_reach_the_recompute():
    """NOTE [ Variable gradients wait for the whole backward ] in recompute.py.

    A train step that applies its updates inside the same `tf.function`,
    traced afresh each time, must train like the unwrapped layers every time.
    """
    keras.utils.set_random_seed(3)
    layers = [
        keras.layers.Dense(8),
        keras.layers.Dense(8, activation="relu"),
        keras.layers.Dense(3),
    ]
    plain = keras.Sequential([keras.Input((5,)), *layers])
    blocked = keras.Sequential([keras.Input((5,)), RecomputeBlock(layers)])
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(16, 5)).astype("float32"))
    y = tf.constant(rng.normal(size=(16, 3)).astype("float32"))
    initial = save_state(plain.trainable_variables)

    def train(model):
        load_state(plain.trainable_variables, initial)
        optimizer = keras.optimizers.SGD(0.1)

        @tf.function
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply(grads, model.trainable_variables)
            return loss

        return [float(step(x[i : i + 8], y[i : i + 8])) for _ in range(2) for i in (0, 8)]

    want = train(plain)
    for trace in range(20):
        np.testing.assert_allclose(train(blocked), want, rtol=1e-5, err_msg=f"trace {trace}")
