"""Issue 15: a block gives what the layers unwrapped give, or a clear error.

One section per item of the issue, each checked against the same layers
unwrapped, eagerly and under `tf.function` (gradients to 1e-6 relative, None
where the unwrapped layers give None), and with `model.fit` + AdamW where an
optimizer could tell zeros from None.
"""

from __future__ import annotations

import gc
import types
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import (
    MODES,
    assert_same_fit,
    assert_same_run,
    assert_same_values,
    normal,
)
from tests.test_errors import CONVENTION, _own_message
from tfrecompute import RecomputeBlock
from tfrecompute.layers import RecomputeMismatchError


def _weighted_sum(outputs):
    """A loss that weights every element of every output differently."""
    return tf.add_n(
        [
            tf.reduce_sum(
                tf.cast(o, tf.float32)
                * tf.reshape(tf.sin(tf.range(tf.size(o), dtype=tf.float32) + 1.0), tf.shape(o))
            )
            for o in tf.nest.flatten(outputs)
            if o is not None and o.dtype.is_floating
        ]
    )


def _gradients(call, x, variables, **tape_kwargs):
    """Outputs and gradients of `_weighted_sum(call(x))` with respect to x and `variables`."""
    with tf.GradientTape(**tape_kwargs) as tape:
        tape.watch(x)
        outputs = call(x)
        loss = _weighted_sum(outputs)
    return [outputs, tape.gradient(loss, [x, *variables])]


class Counting(keras.layers.Layer):
    """Wraps a layer and counts its Python calls (once per eager run or trace)."""

    def __init__(self, layer, **kwargs):
        super().__init__(**kwargs)
        self.layer = layer
        self.calls = 0

    def build(self, input_shape):
        self.layer.build(input_shape)

    def call(self, x):
        self.calls += 1
        return self.layer(x)

    def compute_output_shape(self, input_shape):
        return self.layer.compute_output_shape(input_shape)


# ------------------------------------------------- 1. unconnected gradients are None


class StopAndAux(keras.layers.Layer):
    """`main = tanh(a(x)) + stop_gradient(b(x))`, and an auxiliary head `aux = c(x)`."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.a = keras.layers.Dense(6, activation="tanh")
        self.b = keras.layers.Dense(6)
        self.c = keras.layers.Dense(3)

    def build(self, input_shape):
        for layer in (self.a, self.b, self.c):
            layer.build(input_shape)

    def call(self, x):
        return {"main": self.a(x) + tf.stop_gradient(self.b(x)), "aux": self.c(x)}


@pytest.mark.parametrize("mode", MODES)
def test_weights_behind_stop_gradient_and_an_unused_head_get_none(mode):
    layer = StopAndAux()
    layer.build((None, 6))
    block = RecomputeBlock(layer)
    x = normal((4, 6))

    def run(fn):
        return _gradients(lambda t: fn(t, training=True)["main"], x, layer.trainable_variables)

    _, grads = assert_same_run(run, block, layer, mode)
    assert all(g is not None for g in grads[:3])  # x, a's kernel and bias
    assert all(g is None for g in grads[3:])  # b behind stop_gradient, c unused


class IgnoresSecond(keras.layers.Layer):
    """Takes two tensors and uses the first only."""

    def build(self, input_shape):
        self.dense = keras.layers.Dense(5, activation="tanh")
        self.dense.build(input_shape)

    def call(self, x, unused):
        return self.dense(x)


@pytest.mark.parametrize("mode", MODES)
def test_an_unused_input_gets_none(mode):
    layer = IgnoresSecond()
    layer.build((None, 6))
    block = RecomputeBlock(layer)
    x, unused = normal((3, 6)), normal((3, 6), seed=1)

    def run(fn):
        with tf.GradientTape() as tape:
            tape.watch([x, unused])
            loss = _weighted_sum(fn(x, unused, training=True))
        return tape.gradient(loss, [x, unused, *layer.trainable_variables])

    grads = assert_same_run(run, block, layer, mode)
    assert grads[1] is None


def test_model_fit_with_adamw_leaves_weights_without_gradient_in_place():
    """AdamW decays every weight it gets a gradient for, zeros included."""
    keras.utils.set_random_seed(1)
    pre, layer, head = keras.layers.Dense(6), StopAndAux(), keras.layers.Dense(2)

    def model(blocked):
        inputs = keras.Input((6,))
        inner = RecomputeBlock(layer) if blocked else layer
        return keras.Model(inputs, head(inner(pre(inputs))["main"]))

    assert_adamw_fit_leaves_unreached_weights(model(False), model(True), layer)


def assert_adamw_fit_leaves_unreached_weights(
    plain: keras.Model, blocked: keras.Model, layer: StopAndAux
) -> None:
    """Both train alike under AdamW, and the weights no loss reaches (`b`, `c`) stay put."""
    frozen_by_graph = layer.b.trainable_variables + layer.c.trainable_variables
    before = [v.numpy().copy() for v in frozen_by_graph]
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(16, 6)).astype("float32"), rng.normal(size=(16, 2)).astype("float32")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Gradients do not exist")
        assert_same_fit(
            [plain, blocked],
            plain.variables,
            x,
            y,
            optimizer=lambda: keras.optimizers.AdamW(0.05, weight_decay=0.5),
        )
    for variable, value in zip(frozen_by_graph, before):
        np.testing.assert_array_equal(variable.numpy(), value, err_msg=variable.path)


# ------------------------------------------------- 2. captured tensors keep their gradients


class ScaledByHeld(keras.layers.Layer):
    """`dense(x) * holder.scale`: reads a tensor held outside the block."""

    def __init__(self, holder, **kwargs):
        super().__init__(**kwargs)
        self.holder = holder
        self.dense = keras.layers.Dense(6, activation="tanh")

    def build(self, input_shape):
        self.dense.build(input_shape)

    def call(self, x):
        return tf.tanh(self.dense(x) * self.holder.scale)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("source", ["variable", "block_input"])
def test_a_tensor_held_on_self_gets_its_gradient(source, mode):
    holder = types.SimpleNamespace(scale=None)
    layer = ScaledByHeld(holder)
    layer.build((None, 6))
    block = RecomputeBlock(layer)
    w = tf.Variable(np.linspace(-1.0, 1.0, 6).astype("float32"))
    x = normal((4, 6))

    def run(fn):
        with tf.GradientTape() as tape:
            tape.watch(x)
            holder.scale = tf.sin(w * 2.0) + (x * 0.5 if source == "block_input" else 0.0)
            loss = _weighted_sum(fn(x, training=True))
        return tape.gradient(loss, [x, w, *layer.trainable_variables])

    grads = assert_same_run(run, block, layer, mode)
    assert np.abs(grads[1]).max() > 1e-3  # the captured tensor's own gradient


@pytest.mark.parametrize("mode", MODES)
def test_a_lambda_closure_gets_its_gradient(mode):
    w = tf.Variable([[0.5, -1.0, 2.0, 0.25, 1.5, -0.5]])
    dense = keras.layers.Dense(6, activation="tanh")
    dense.build((None, 6))
    x = normal((4, 6))

    def run(make):
        with tf.GradientTape() as tape:
            h = w * 2.0
            layers = [dense, keras.layers.Lambda(lambda z: tf.sin(z * h))]
            loss = _weighted_sum(make(layers)(x, training=True))
        return tape.gradient(loss, [w, *dense.trainable_variables])

    def unwrapped(layers):
        return lambda t, training: layers[1](layers[0](t))

    grads = assert_same_run(run, RecomputeBlock, unwrapped, mode)
    assert np.abs(grads[0]).max() > 1e-3


class ReadsRawVariable(keras.layers.Layer):
    """Multiplies by a raw `tf.Variable`, which Keras does not track as a weight."""

    def __init__(self, raw, **kwargs):
        super().__init__(**kwargs)
        self.raw = raw
        self.dense = keras.layers.Dense(6, activation="tanh")

    def build(self, input_shape):
        self.dense.build(input_shape)

    def call(self, x):
        return tf.tanh(self.dense(x) * self.raw)


@pytest.mark.parametrize("mode", MODES)
def test_a_raw_variable_read_inside_gets_its_gradient(mode):
    raw = tf.Variable(np.linspace(0.5, 1.5, 6).astype("float32"))
    layer = ReadsRawVariable(raw)
    layer.build((None, 6))
    assert not any(v is raw for v in layer.trainable_variables)

    def run(fn):
        return _gradients(
            lambda t: fn(t, training=True), normal((4, 6)), [raw, *layer.trainable_variables]
        )

    _, grads = assert_same_run(run, RecomputeBlock(layer), layer, mode)
    assert np.abs(grads[1]).max() > 1e-3


class GatedModel(keras.Model):
    """`head(block(h))` where a layer in the block reads a gate computed from `h` on `self`."""

    def __init__(self, gated, blocked, **kwargs):
        super().__init__(**kwargs)
        self.pre = gated.pre
        self.inner = RecomputeBlock(gated.layer) if blocked else gated.layer
        self.head = gated.head
        self.holder = gated.holder

    def call(self, x, training=None):
        h = self.pre(x)
        self.holder.scale = tf.sigmoid(h)
        return self.head(self.inner(h, training=training))


def test_model_fit_with_adamw_trains_a_captured_gate_like_unwrapped():
    keras.utils.set_random_seed(2)
    holder = types.SimpleNamespace(scale=None)
    gated = types.SimpleNamespace(
        pre=keras.layers.Dense(6),
        layer=ScaledByHeld(holder),
        head=keras.layers.Dense(2),
        holder=holder,
    )
    plain, blocked = GatedModel(gated, False), GatedModel(gated, True)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(16, 6)).astype("float32"), rng.normal(size=(16, 2)).astype("float32")
    plain(x[:2])
    blocked(x[:2])
    assert_same_fit(
        [plain, blocked],
        plain.variables,
        x,
        y,
        optimizer=lambda: keras.optimizers.AdamW(0.05, weight_decay=0.1),
    )


# ------------------------------------------------- 3. the always-on metadata check


class ChangesOnRecompute(keras.layers.Layer):
    """Behaves differently from its second call on: another shape, dtype or output count."""

    def __init__(self, change, **kwargs):
        super().__init__(**kwargs)
        self.change = change
        self.calls = 0

    def call(self, x):
        self.calls += 1
        if self.calls == 1:
            return x * 2.0
        if self.change == "shape":
            return x[:, :1] * 2.0
        if self.change == "dtype":
            return tf.cast(x * 2.0, tf.float16)
        if self.change == "count":
            self.add_loss(tf.reduce_sum(x))  # one more result than the forward had
        return x * 2.0


def _mismatch_step(block, mode):
    def step(x):
        with tf.GradientTape() as tape:
            y = block(x, training=True)
        return tape.gradient(y, block.trainable_variables)

    # autograph=False keeps the exception type (README, "Limits and guarantees").
    return tf.function(step, autograph=False) if mode == "function" else step


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("change", ["shape", "dtype", "count"])
def test_a_recompute_with_other_metadata_raises_without_debug_mode(change, mode):
    layer = ChangesOnRecompute(change)
    block = RecomputeBlock([keras.layers.Dense(4), layer], name="flaky")
    block.build((None, 4))
    layer.calls = 0  # building called it once
    with pytest.raises(RecomputeMismatchError) as raised:
        _mismatch_step(block, mode)(normal((2, 4)))
    message = str(raised.value)
    assert CONVENTION.match(message), message
    assert message.startswith("RecomputeBlock 'flaky': the recompute in backprop returned other")
    assert "Received: recomputed=" in message and "keep it out of the block" in message


def test_a_block_works_again_after_a_metadata_error():
    layer = ChangesOnRecompute("shape")
    block = RecomputeBlock([keras.layers.Dense(4), layer])
    block.build((None, 4))
    layer.calls = 0
    with pytest.raises(RecomputeMismatchError):
        _mismatch_step(block, "eager")(normal((2, 4)))
    layer.calls = 0
    layer.change = "nothing"  # from now on the recompute repeats the forward
    assert all(g is not None for g in _mismatch_step(block, "eager")(normal((2, 4))))


def test_the_metadata_check_adds_no_op_to_the_graph():
    block = RecomputeBlock([keras.layers.Dense(4, activation="tanh")])
    block.build((None, 4))
    graph = _mismatch_step(block, "function").get_concrete_function(tf.TensorSpec((2, 4))).graph
    assert not [op for op in graph.get_operations() if op.type in ("Assert", "CheckNumerics")]


# ------------------------------------------------- 4. a tape inside a wrapped layer


class InputGradientFeature(keras.layers.Layer):
    """`d(x) + d/dx sum(d(x) ** 2)`: opens a tape of its own (a gradient penalty's shape)."""

    def build(self, input_shape):
        self.dense = keras.layers.Dense(input_shape[-1], activation="tanh")
        self.dense.build(input_shape)

    def call(self, x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            energy = tf.reduce_sum(self.dense(x) ** 2)
        return self.dense(x) + tape.gradient(energy, x)


@pytest.mark.parametrize("mode", MODES)
def test_a_tape_opened_inside_a_wrapped_layer_records(mode):
    layer = InputGradientFeature()
    layer.build((None, 5))
    inner = keras.layers.Dense(5, activation="tanh")
    layers = [inner, layer]
    block = RecomputeBlock(layers)
    block.build((None, 5))

    def unwrapped(t, training=None):
        return layer(inner(t))

    def run(fn):
        return _gradients(lambda t: fn(t, training=True), normal((3, 5)), block.trainable_variables)

    outputs, grads = assert_same_run(run, block, unwrapped, mode)
    assert all(g is not None for g in grads)


# ------------------------------------------------- 5. mixed keyword arguments


@pytest.mark.parametrize("mode", MODES)
def test_attention_with_mask_and_scores_reaches_a_single_wrapped_layer(mode):
    mha = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4, dropout=0.3, seed=4)
    q, v = normal((2, 3, 8)), normal((2, 5, 8), seed=1)
    mask = tf.constant(np.random.default_rng(2).random((2, 3, 5)) > 0.3)
    mha(q, v)
    block = RecomputeBlock(mha)

    def run(fn):
        with tf.GradientTape() as tape:
            tape.watch([q, v])
            out, scores = fn(q, v, attention_mask=mask, return_attention_scores=True, training=True)
            loss = _weighted_sum([out, scores])
        return [out, scores, tape.gradient(loss, [q, v, *mha.trainable_variables])]

    assert_same_run(run, block, mha, mode, state=mha.non_trainable_variables)


class ScaleOffset(keras.layers.Layer):
    """`x * scale + offset`, plus `bias` when given: Keras's remat keyword case."""

    def build(self, input_shape):
        self.dense = keras.layers.Dense(input_shape[-1], activation="tanh")
        self.dense.build(input_shape)

    def call(self, x, scale=1.0, offset=0.0, bias=None):
        y = self.dense(x) * scale + offset
        return y if bias is None else y + bias


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "kwargs",
    [
        {"scale": np.float32(2.0), "offset": 1.0},  # a numpy scalar beside a Python float
        {"scale": 3.0, "bias": None},
        {"offset": np.float64(-0.5), "bias": "tensor"},
        {},
    ],
    ids=["numpy_and_python", "python_and_none", "numpy_and_tensor", "defaults"],
)
def test_tensors_python_values_numpy_scalars_and_none_reach_the_layer(kwargs, mode):
    layer = ScaleOffset()
    layer.build((None, 4))
    block = RecomputeBlock(layer)
    x, bias = normal((3, 4)), normal((3, 4), seed=5)
    call_kwargs = {k: bias if v == "tensor" else v for k, v in kwargs.items()}

    def run(fn):
        return _gradients(
            lambda t: fn(t, training=True, **call_kwargs), x, layer.trainable_variables
        )

    assert_same_run(run, block, layer, mode)


def test_a_functional_model_with_routed_arguments_saves_and_loads(tmp_path):
    q_in, v_in = keras.Input((3, 8)), keras.Input((5, 8))
    mask_in = keras.Input((3, 5), dtype="bool")
    out, scores = RecomputeBlock(keras.layers.MultiHeadAttention(2, 4))(
        q_in, v_in, attention_mask=mask_in, return_attention_scores=True
    )
    model = keras.Model([q_in, v_in, mask_in], [out, scores])
    rng = np.random.default_rng(0)
    inputs = [
        rng.normal(size=(2, 3, 8)).astype("float32"),
        rng.normal(size=(2, 5, 8)).astype("float32"),
        rng.random((2, 3, 5)) > 0.3,
    ]
    model.save(tmp_path / "model.keras")
    loaded = keras.models.load_model(tmp_path / "model.keras")
    assert_same_values(loaded(inputs), model(inputs))


# ------------------------------------------------- 6. eager code that runs unwrapped


class BranchesOnValues(keras.layers.Layer):
    """Python control flow on a tensor value, and a Python-held running tensor."""

    def build(self, input_shape):
        self.dense = keras.layers.Dense(input_shape[-1], activation="tanh")
        self.dense.build(input_shape)
        self.seen = tf.zeros(())

    def call(self, x):
        y = self.dense(x)
        self.seen = self.seen + tf.reduce_sum(x)  # a Python attribute, not a variable
        if tf.reduce_sum(y) > 0:
            return y * 2.0
        return -y


def test_python_control_flow_on_tensor_values_runs_in_an_eager_block():
    layer = BranchesOnValues()
    layer.build((None, 4))
    block = RecomputeBlock(layer)
    for seed in range(3):  # both branches
        x = normal((3, 4), seed=seed)
        assert_same_run(
            lambda fn, x=x: _gradients(
                lambda t: fn(t, training=True), x, layer.trainable_variables
            ),
            block,
            layer,
            "eager",
        )


class EagerModel(keras.Model):
    """`head(inner(x))` over built layers."""

    def __init__(self, inner, head, **kwargs):
        super().__init__(**kwargs)
        self.inner = inner
        self.head = head

    def build(self, input_shape):
        self.built = True  # the layers are built: no symbolic trace, which cannot branch

    def call(self, x, training=None):
        return self.head(self.inner(x, training=training))


def test_python_control_flow_trains_in_model_fit_run_eagerly():
    layer = BranchesOnValues()
    layer.build((None, 4))
    head = keras.layers.Dense(2)
    head.build((None, 4))
    plain = EagerModel(layer, head)
    blocked = EagerModel(RecomputeBlock(layer), head)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(16, 4)).astype("float32"), rng.normal(size=(16, 2)).astype("float32")
    assert_same_fit([plain, blocked], plain.variables, x, y, run_eagerly=True)


@pytest.mark.parametrize("mode", MODES)
def test_call_runs_forward_plus_one_recompute_from_the_first_step(mode):
    counter = Counting(keras.layers.Dense(4, activation="tanh"))
    counter.build((None, 4))
    block = RecomputeBlock(counter)

    def step(x):
        with tf.GradientTape() as tape:
            y = block(x, training=True)
        return tape.gradient(y, block.trainable_variables)

    if mode == "function":
        step = tf.function(step)
    counts = []
    for _ in range(3):
        counter.calls = 0
        step(normal((2, 4)))
        counts.append(counter.calls)
    # Eagerly 2 per step from the first (no trace); a traced step runs Python once.
    assert counts == ([2, 2, 2] if mode == "eager" else [2, 0, 0])


# ------------------------------------------------- 7. gradients between a block's outputs


def _outputs_model(kind):
    inputs = keras.Input((5,))
    dense = [keras.layers.Dense(5, activation="tanh") for _ in range(3)]
    h1 = dense[0](inputs)
    h2 = dense[1](h1)
    if kind == "pair":
        return keras.Model(inputs, [h1, h2])
    if kind == "chain":
        return keras.Model(inputs, [h1, h2, dense[2](h2)])
    # A skip: the third output reads the first directly and through the second.
    return keras.Model(inputs, [h1, h2, dense[2](keras.layers.Add()([h1, h2]))])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["pair", "chain", "skip"])
def test_gradients_between_outputs_match_unwrapped(kind, mode):
    model = _outputs_model(kind)
    block = RecomputeBlock(model)
    x = normal((3, 5))

    def run(fn):
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(x)
            outputs = fn(x, training=True)
            loss = _weighted_sum(outputs)
        between = [
            tape.gradient(outputs[j], outputs[i])
            for j in range(len(outputs))
            for i in range(len(outputs))
            if i != j
        ]
        return [*between, *tape.gradient(loss, [x, *model.trainable_variables])]

    results = assert_same_run(run, block, model, mode)
    assert sum(g is not None for g in results) > len(model.trainable_variables) + 1


@pytest.mark.parametrize("mode", MODES)
def test_attention_output_differentiates_with_respect_to_its_scores(mode):
    mha = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)
    x = normal((2, 4, 8))
    mha(x, x)

    def run(fn):
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(x)
            out, scores = fn(x, x, return_attention_scores=True, training=True)
            loss = _weighted_sum([out, scores * 3.0])
        return [tape.gradient(out, scores), *tape.gradient(loss, [x, *mha.trainable_variables])]

    results = assert_same_run(run, RecomputeBlock(mha), mha, mode)
    assert results[0] is not None


# ------------------------------------------------- 8. blocks inside loops


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("loop", ["while_loop", "scan"])
@pytest.mark.parametrize("weightless", [False, True])
def test_blocks_inside_loop_bodies_match_unwrapped(weightless, loop, mode):
    dense = keras.layers.Dense(5, activation="tanh")
    dense.build((None, 5))
    layer = keras.layers.Activation("tanh") if weightless else dense
    block = RecomputeBlock(layer)
    x = normal((3, 5))

    def run(fn):
        def body(h):
            return fn(h, training=True) * 0.9

        with tf.GradientTape() as tape:
            tape.watch(x)
            if loop == "scan":
                y = tf.scan(lambda h, _: body(h), tf.range(3), initializer=x)[-1]
            else:
                y = tf.while_loop(lambda i, h: i < 3, lambda i, h: (i + 1, body(h)), (0, x))[1]
            loss = _weighted_sum(y)
        return tape.gradient(loss, [x, *layer.trainable_variables])

    with warnings.catch_warnings():
        warnings.filterwarnings("error", "RecomputeBlock .*pointless")  # not pointless here
        assert_same_run(run, block, layer, mode)


class ReadsOutsideVariable(keras.layers.Layer):
    """Reads a variable the block does not own, directly or in a tf.custom_gradient's body."""

    def __init__(self, raw, in_custom_gradient, **kwargs):
        super().__init__(**kwargs)
        self.raw = raw
        self.in_custom_gradient = in_custom_gradient
        self.dense = keras.layers.Dense(5, activation="tanh")

    def build(self, input_shape):
        self.dense.build(input_shape)

    def call(self, x):
        if not self.in_custom_gradient:
            return self.dense(x) * self.raw

        @tf.custom_gradient
        def scaled(h):
            scale = self.dense.kernel[0]  # a variable read in the body

            def grad(dy, variables=None):
                return dy * scale, [tf.zeros_like(v) for v in variables or []]

            return h * scale, grad

        return scaled(x)


@pytest.mark.parametrize(
    "in_custom_gradient", [False, True], ids=["raw_variable", "custom_gradient"]
)
def test_what_a_recompute_in_a_loop_body_cannot_replay_raises(in_custom_gradient):
    """NOTE [ Blocks in loop bodies ]: the layers unwrapped run; the block names the cause."""
    layer = ReadsOutsideVariable(tf.Variable(tf.ones((5,))), in_custom_gradient)
    layer.build((None, 5))
    block = RecomputeBlock(layer, name="looped")

    def step(fn, x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.while_loop(
                lambda i, h: i < 2, lambda i, h: (i + 1, fn(h, training=True)), (0, x)
            )
            loss = tf.reduce_sum(y[1])
        return tape.gradient(loss, x)

    tf.function(step, autograph=False)(layer, normal((3, 5)))  # unwrapped: fine
    what = "a tf.custom_gradient inside reads" if in_custom_gradient else "the wrapped layers read"
    with pytest.raises(ValueError, match=rf"RecomputeBlock 'looped': {what}") as raised:
        tf.function(step, autograph=False)(block, normal((3, 5)))
    own = _own_message(raised.value)
    assert CONVENTION.match(own), own
    assert "keep that layer (or the block) out of the loop" in own


class BlockCell(keras.layers.Layer):
    """An RNN cell whose step is a block (or the same layer unwrapped)."""

    def __init__(self, dense, blocked, **kwargs):
        super().__init__(**kwargs)
        self.state_size = 4
        self.output_size = 4
        self.dense = dense
        self.step_layer = RecomputeBlock(dense) if blocked else dense

    def build(self, input_shape):
        if not self.dense.built:  # shared by the blocked and the plain cell
            self.dense.build((None, input_shape[-1] + 4))

    def call(self, x, states, training=None):
        h = self.step_layer(tf.concat([x, states[0]], -1), training=training)
        return h, [h]


@pytest.mark.parametrize("run_eagerly", [False, True])
def test_an_rnn_over_a_block_cell_trains_like_unwrapped(run_eagerly):
    dense = keras.layers.Dense(4, activation="tanh")
    plain = keras.Sequential([keras.Input((5, 3)), keras.layers.RNN(BlockCell(dense, False))])
    blocked = keras.Sequential([keras.Input((5, 3)), keras.layers.RNN(BlockCell(dense, True))])
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(8, 5, 3)).astype("float32"), rng.normal(size=(8, 4)).astype("float32")
    assert_same_fit([plain, blocked], plain.variables, x, y, batch_size=4, run_eagerly=run_eagerly)


# ------------------------------------------------- 9. a None leaf of an unbuilt block's input


class OptionalBias(keras.layers.Layer):
    """`dense(a)`, plus `b` when it is not None."""

    def build(self, input_shape):
        self.dense = keras.layers.Dense(4, activation="tanh")
        self.dense.build(input_shape["a"])

    def call(self, inputs):
        y = self.dense(inputs["a"])
        return y if inputs["b"] is None else y + inputs["b"]


@pytest.mark.parametrize("mode", MODES)
def test_a_none_leaf_of_a_nested_input_while_unbuilt(mode):
    layer = OptionalBias()
    block = RecomputeBlock(layer)  # neither built yet
    x = normal((3, 6))

    def run(fn):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = _weighted_sum(fn({"a": x, "b": None}, training=True))
        return tape.gradient(loss, [x, *layer.trainable_variables])

    grads = assert_same_run(run, block, layer, mode)  # the block runs first, unbuilt
    assert layer.built and len(grads) == 3


# ------------------------------------------------- 10. the recompute runs in the forward's device


class RecordsDevice(keras.layers.Layer):
    """Records the device of its output on every call."""

    def build(self, input_shape):
        self.dense = keras.layers.Dense(4, activation="tanh")
        self.dense.build(input_shape)
        self.devices = []

    def call(self, x):
        y = self.dense(x)
        self.devices.append(y.device)
        return y


@pytest.mark.parametrize("mode", MODES)
def test_the_recompute_runs_in_the_forwards_device_scope(mode):
    layer = RecordsDevice()
    layer.build((None, 4))
    block = RecomputeBlock(layer)

    def step(x):
        with tf.GradientTape() as tape:
            with tf.device("/CPU:1"):
                y = block(x, training=True)
        return tape.gradient(y, block.trainable_variables)  # outside the device scope

    (tf.function(step) if mode == "function" else step)(normal((2, 4)))
    assert len(layer.devices) == 2  # forward and recompute
    assert all(device.endswith("CPU:1") for device in layer.devices), layer.devices


# ------------------------------------------------- 11. a watched frozen variable


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("watch_input", [False, True])
def test_an_explicitly_watched_frozen_variable_gets_its_gradient(watch_input, mode):
    dense = keras.layers.Dense(4, activation="tanh")
    dense.build((None, 5))
    dense.trainable = False
    x = normal((3, 5))

    def run(fn):
        with tf.GradientTape() as tape:
            tape.watch(dense.kernel.value)
            if watch_input:
                tape.watch(x)
            loss = _weighted_sum(fn(x, training=True))
        return tape.gradient(loss, [dense.kernel.value, dense.bias.value, x])

    with warnings.catch_warnings():
        # The block checkpoints: a tape watches its state.
        warnings.filterwarnings("error", "RecomputeBlock .*pointless")
        grads = assert_same_run(run, RecomputeBlock(dense), dense, mode)
    assert grads[0] is not None


# ------------------------------------------------- 12. retracing does not accumulate tensors


def _live_tensors():
    gc.collect()
    return sum(isinstance(o, tf.Tensor) for o in gc.get_objects())


def _retraced_tensors(layer, count):
    x = tf.ones((4, 8))

    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(layer(x, training=True))
        return tape.gradient(loss, [x, *layer.trainable_variables])

    tf.function(step)(x)
    before = _live_tensors()
    for _ in range(count):
        tf.function(step)(x)  # a new function each time: a new trace, then dropped
    return _live_tensors() - before


def test_retraced_steps_keep_no_tensors_alive():
    """Measured after 10 retraces: 0, as a plain Dense (TF's own custom_gradient: 300;
    this block before issue 15: 820, as TF's gradient registry kept every trace)."""
    block = RecomputeBlock([keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(8)])
    block.build((None, 8))
    assert _retraced_tensors(keras.layers.Dense(8, activation="tanh"), 10) <= 0
    assert _retraced_tensors(block, 10) <= 10


# ------------------------------------------------- 13. early stop


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "make",
    [
        lambda: keras.layers.Reshape((2, 3)),
        lambda: keras.layers.Identity(),
        lambda: keras.layers.Flatten(),
        lambda: keras.layers.Dense(6),  # linear: its backward reads its input and kernel only
    ],
    ids=["reshape", "identity", "flatten", "linear_dense"],
)
def test_a_block_that_saves_nothing_is_not_recomputed(make, mode):
    counter = Counting(make())
    counter.build((None, 6))
    block = RecomputeBlock(counter)
    x = normal((3, 6))

    def run(fn):
        return _gradients(lambda t: fn(t, training=True), x, counter.trainable_variables)

    counter.calls = 0
    assert_same_run(run, block, counter, mode)
    assert counter.calls == 2  # one call each for the block and the unwrapped run


def _flat_and_back(x):
    flat = tf.reshape(x, (-1,))
    return flat, tf.reshape(flat, (2, -1))


@pytest.mark.parametrize("mode", MODES)
def test_early_stop_keeps_gradients_between_outputs(mode):
    """A block that saves nothing, one output computed from the other."""
    layer = Counting(keras.layers.Lambda(_flat_and_back))
    layer.build((None, 4))
    block = RecomputeBlock(layer)
    x = normal((2, 4))

    def run(fn):
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(x)
            flat, tripled = fn(x, training=True)
            loss = _weighted_sum([flat, tripled])
        return [tape.gradient(tripled, flat), tape.gradient(loss, x)]

    layer.calls = 0
    between, _ = assert_same_run(run, block, layer, mode)
    assert layer.calls == 2 and between is not None


@pytest.mark.parametrize("mode", MODES)
def test_a_block_that_saves_activations_is_still_recomputed(mode):
    counter = Counting(keras.layers.Dense(6, activation="tanh"))
    counter.build((None, 6))
    block = RecomputeBlock(counter)
    counter.calls = 0
    assert_same_run(
        lambda fn: _gradients(
            lambda t: fn(t, training=True), normal((3, 6)), counter.trainable_variables
        ),
        block,
        counter,
        mode,
    )
    assert counter.calls == 3  # the block's forward and recompute, the unwrapped run
