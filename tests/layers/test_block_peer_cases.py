"""Checkpoint test cases of PyTorch, TensorFlow, Keras and JAX, ported to RecomputeBlock.

Each case is named after the peer test it comes from and runs the block
against the same layers unwrapped, eagerly and under `tf.function` (gradients
to 1e-6 relative, None where the unwrapped layers give None). Sources:

* PyTorch `test/test_utils.py` (TestCheckpoint) and the checkpoint tests of
  `test/test_autograd.py` (TestAutograd, TestNestedCheckpoint);
* TensorFlow `tensorflow/python/ops/gradients_test.py` and
  `custom_gradient_test.py`;
* Keras `keras/src/backend/common/remat_test.py`;
* JAX `tests/api_test.py` (RematTest).

Cases without a Keras analogue (GPU memory, RNG of CUDA streams, vmap,
`use_reentrant`, remat policies) are left out.
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
    assert_same_run,
    normal,
)
from tfrecompute import RecomputeBlock
from tfrecompute.layers import RecomputeMismatchError


def _loss(outputs):
    """Weights every element of the floating outputs differently."""
    floats = [o for o in tf.nest.flatten(outputs) if tf.is_tensor(o) and o.dtype.is_floating]
    return tf.add_n(
        [
            tf.reduce_sum(o * tf.reshape(tf.cos(tf.range(tf.size(o), dtype=o.dtype)), tf.shape(o)))
            for o in floats
        ]
    )


def _grads(call, sources, **tape_kwargs):
    """`[outputs, d loss / d sources]` for `loss = _loss(call())`."""
    with tf.GradientTape(**tape_kwargs) as tape:
        tape.watch([s for s in sources if isinstance(s, tf.Tensor)])
        outputs = call()
        loss = _loss(outputs)
    return [outputs, tape.gradient(loss, sources)]


def _grad_of_grad(fn, x, cotangent=None):
    """`[g, h]`: g = d sum(fn(x)) / dx, h = d/dx of sum(g) (or the VJP of g with `cotangent`)."""
    with tf.GradientTape() as outer:
        outer.watch(x)
        with tf.GradientTape() as inner:
            inner.watch(x)
            y = tf.reduce_sum(fn(x, training=True))
        gx = inner.gradient(y, x)
        target = tf.reduce_sum(gx) if cotangent is None else gx
    second = outer.gradient(target, x, output_gradients=cotangent)
    assert second is not None
    return [gx, second]


def _assert_alike(layer, x, mode, *, extra=()):
    """`RecomputeBlock(layer)` against `layer`: outputs and gradients for x and the weights."""

    def run(fn):
        return _grads(lambda: fn(x, training=True), [x, *layer.trainable_variables, *extra])

    return assert_same_run(run, RecomputeBlock(layer), layer, mode)


class Fn(keras.layers.Layer):
    """A layer computing `fn(*inputs, **kwargs)` (a peer test's function); counts its calls."""

    def __init__(self, fn, **kwargs):
        super().__init__(**kwargs)
        self.fn = fn
        self.calls = 0

    def call(self, *args, **kwargs):
        self.calls += 1
        kwargs.pop("training", None)
        return self.fn(*args, **kwargs)


def _dense_relu_stack(sizes=(12, 8, 6, 4)):
    layers = []
    for units in sizes[1:]:
        layers += [keras.layers.Dense(units), keras.layers.ReLU()]
    shape = (None, sizes[0])
    for layer in layers:
        layer.build(shape)
        shape = layer.compute_output_shape(shape)
    return layers


# ------------------------------------------------------------------ PyTorch test_utils.py


def test_torch_checkpoint_trigger():
    """Each layer runs once in the forward; a checkpointed one once more in backprop."""
    layers = [Fn(lambda x: tf.tanh(x) * 2.0) for _ in range(10)]
    # Two chunks: checkpoint_sequential leaves the last one plain.
    model = [RecomputeBlock(layers[:5]), *layers[5:]]
    model[0].build((None, 4))
    for layer in layers:
        layer.calls = 0  # building the block traced its layers once
    x = normal((3, 4))
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = tf.reduce_sum(apply_in_order(model)(x, training=True))
    assert [layer.calls for layer in layers] == [1] * 10
    tape.gradient(y, x)
    assert [layer.calls for layer in layers] == [2] * 5 + [1] * 5


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("as_list", [True, False], ids=["module_list", "sequential"])
def test_torch_checkpoint_and_checkpoint_module_list(as_list, mode):
    """Outputs, input gradients and weight gradients of two checkpointed chunks."""
    layers = _dense_relu_stack()
    chunks = [layers[:3], layers[3:]]
    if as_list:
        blocks = [RecomputeBlock(chunk) for chunk in chunks]
    else:
        blocks = [RecomputeBlock(keras.Sequential(chunk)) for chunk in chunks]
    variables = [v for layer in layers for v in layer.trainable_variables]
    x = normal((1, 12))

    def run(fn):
        return _grads(lambda: fn(x, training=True), [x, *variables])

    assert_same_run(run, apply_in_order(blocks), apply_in_order(layers), mode)


@pytest.mark.parametrize("mode", MODES)
def test_torch_checkpoint_valid_double_backward(mode):
    """`create_graph=True`: the input gradient is differentiated again."""
    layers = [keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(4, activation="tanh")]
    block = RecomputeBlock(layers)
    block.build((None, 12))
    x = normal((2, 12))

    def run(fn):
        with tf.GradientTape() as outer:
            outer.watch(x)
            with tf.GradientTape() as inner:
                inner.watch(x)
                y = _loss(fn(x, training=True))
            gx = inner.gradient(y, x)
            penalty = tf.reduce_sum(gx**2)
        return [gx, outer.gradient(penalty, [x, *block.trainable_variables])]

    assert_same_run(run, block, apply_in_order(layers), mode)


@pytest.mark.parametrize("mode", MODES)
def test_torch_checkpoint_rng(mode):
    """Dropout before and inside a checkpoint: the recompute replays the mask."""
    phase1 = keras.layers.Dropout(0.5, seed=1)
    phase2 = keras.layers.Dropout(0.5, seed=2)
    block = RecomputeBlock(phase2)
    x = normal((5, 200))
    state = phase1.non_trainable_variables + phase2.non_trainable_variables

    def run(fn):
        return _grads(lambda: fn(phase1(x, training=True), training=True), [x])

    for _ in range(5):
        assert_same_run(run, block, phase2, mode, state=state)
        phase1(x, training=True)  # advance the seeds between rounds


class TwoTensors(keras.layers.Layer):
    """`run_fn(tensor1, tensor2)`: returns tensor1 when tensor2 is None."""

    def call(self, tensor1, tensor2=None):
        return tf.tanh(tensor1) if tensor2 is None else tf.tanh(tensor1 + tensor2)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("second", ["none", "tensor"])
def test_torch_checkpoint_non_tensor(second, mode):
    layer = TwoTensors()
    x, other = normal((1, 10)), normal((1, 10), seed=1)
    value = None if second == "none" else other

    def run(fn):
        return _grads(lambda: fn(x, value, training=True), [x, other])

    assert_same_run(run, RecomputeBlock(layer), layer, mode)


class NonTensorOutputs(keras.layers.Layer):
    """`foo(t1, t2, scale, t3)` returning `scale, t4, None, True, t5, "bar", t1`."""

    def call(self, t1, t2, t3, scale=1):
        t4 = (t1 + t2 * t3) * scale
        t5 = (t1 * t2 + t3) * scale
        return scale, t4, None, True, t5, "bar", t1


@pytest.mark.parametrize("mode", MODES)
def test_torch_checkpoint_non_tensor_inputs_outputs(mode):
    layer = NonTensorOutputs()
    t1, t2 = normal((10,)), normal((10,), seed=1)
    t3 = normal((10,), seed=2)  # no tape watches it: requires_grad=False
    scale = 7

    def run(fn):
        with tf.GradientTape() as tape:
            tape.watch([t1, t2])
            res = fn(t1, t2, t3, scale=scale, training=True)
            loss = tf.reduce_sum(res[1]) + tf.reduce_sum(res[4]) + tf.reduce_sum(res[6])
        assert res[0] == scale and res[2] is None and res[3] is True and res[5] == "bar"
        return [res[1], res[4], res[6], tape.gradient(loss, [t1, t2, t3])]

    grads = assert_same_run(run, RecomputeBlock(layer), layer, mode)[-1]
    assert grads[2] is None


@pytest.mark.parametrize("mode", MODES)
def test_torch_checkpoint_partial_grad(mode):
    """Two outputs, the second of an input no tape watches; backprop through the first."""
    dense = keras.layers.Dense(4, activation="tanh")
    dense.build((None, 4))
    layer = Fn(lambda t1, t2: (dense(t1), t2 * 2.0))
    x, y = normal((1, 4)), normal((1, 4), seed=1)

    def run(fn):
        with tf.GradientTape() as tape:
            tape.watch(x)
            first, _ = fn(x, y, training=True)
            loss = tf.reduce_sum(first)
        return tape.gradient(loss, [x, y, *dense.trainable_variables])

    grads = assert_same_run(run, RecomputeBlock(layer), layer, mode)
    assert grads[1] is None


def test_torch_checkpoint_partial_grad_when_nothing_needs_a_gradient_warns():
    """PyTorch raises "none of output has requires_grad=True, this checkpoint() is not
    necessary"; a block warns and runs plainly."""
    block = RecomputeBlock(Fn(lambda t1: tf.tanh(t1)))
    with pytest.warns(UserWarning, match=r"recompute is pointless"):
        with tf.GradientTape():
            block(normal((1, 4)), training=True)


class CreatesTensor(keras.layers.Layer):
    """Creates a tensor without a device (`torch.empty(4)` in the peer test)."""

    def build(self, input_shape):
        self.devices = []

    def call(self, x):
        intermediate = tf.ones((4,)) * 0.5
        self.devices.append(intermediate.device)
        return x * tf.reduce_sum(intermediate)


@pytest.mark.parametrize("mode", MODES)
def test_torch_checkpoint_preserves_device_context(mode):
    layer = CreatesTensor()
    layer.build(None)
    block = RecomputeBlock(layer)
    x = normal((4,))

    def step():
        with tf.GradientTape() as tape:
            tape.watch(x)
            with tf.device("/CPU:1"):
                y = block(x, training=True)
            loss = tf.reduce_sum(y)
        return tape.gradient(loss, x)

    (tf.function(step) if mode == "function" else step)()
    assert len(layer.devices) == 2, layer.devices
    assert all(device.endswith("CPU:1") for device in layer.devices), layer.devices


# --------------------------------------------------------------- PyTorch test_autograd.py


@pytest.mark.parametrize("mode", MODES)
def test_torch_checkpointing_one_block_called_many_times(mode):
    """`feat_combined = [checkpoint(module, data_r) for r in range(num_inp)]`."""
    layers = _dense_relu_stack((10, 16, 6))
    block = RecomputeBlock(layers)
    variables = block.trainable_variables
    data = [normal((1, 10), seed=r) for r in range(6)]

    def run(fn):
        with tf.GradientTape() as tape:
            mean = tf.reduce_mean(tf.stack([fn(d, training=True) for d in data]))
        return tape.gradient(mean, variables)

    assert_same_run(run, block, apply_in_order(layers), mode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("input_watched", [True, False])
def test_torch_checkpointing_without_reentrant_input_requires_grad(input_watched, mode):
    layers = _dense_relu_stack((6, 8, 4))
    block = RecomputeBlock(layers)
    x = normal((3, 6))

    def run(fn):
        with tf.GradientTape() as tape:
            if input_watched:
                tape.watch(x)
            loss = _loss(fn(x, training=True))
        return tape.gradient(loss, [x, *block.trainable_variables])

    grads = assert_same_run(run, block, apply_in_order(layers), mode)
    assert (grads[0] is None) != input_watched


@pytest.mark.parametrize("mode", MODES)
def test_torch_checkpointing_without_reentrant_correct_grad(mode):
    """`b = exp(a).sum(); c = checkpoint(exp, a).sum(); (b + c).backward()`."""
    layer = Fn(tf.exp)
    a = normal((2,))

    def run(fn):
        with tf.GradientTape() as tape:
            tape.watch(a)
            total = tf.reduce_sum(tf.exp(a)) + tf.reduce_sum(fn(a, training=True))
        return tape.gradient(total, a)

    grad = assert_same_run(run, RecomputeBlock(layer), layer, mode)
    np.testing.assert_allclose(grad, 2 * np.exp(a.numpy()), rtol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_torch_checkpointing_without_reentrant_parameter_used_in_an_out(mode):
    """A weight used outside the checkpoint and, captured, inside it."""
    w = tf.Variable(normal((10, 10), seed=3))
    layer = Fn(lambda h: w * h)
    x = normal((10, 10))

    def run(fn):
        with tf.GradientTape() as tape:
            tape.watch(x)
            out = fn(w * x, training=True)
            loss = tf.reduce_sum(out)
        return tape.gradient(loss, [x, w])

    assert_same_run(run, RecomputeBlock(layer), layer, mode)


class DictInOut(keras.layers.Layer):
    """Dict input, dict output (the peer's `arbitrary_input_output`)."""

    def build(self, input_shape):
        self.dense = keras.layers.Dense(5, activation="tanh")
        self.dense.build(input_shape["a"])

    def call(self, inputs):
        return {"sum": self.dense(inputs["a"]) + inputs["b"], "b": inputs["b"] * 2.0}


@pytest.mark.parametrize("mode", MODES)
def test_torch_checkpointing_without_reentrant_arbitrary_input_output(mode):
    layer = DictInOut()
    layer.build({"a": (None, 4), "b": (None, 5)})
    a, b = normal((3, 4)), normal((3, 5), seed=1)

    def run(fn):
        sources = [a, b, *layer.trainable_variables]
        return _grads(lambda: fn({"a": a, "b": b}, training=True), sources)

    assert_same_run(run, RecomputeBlock(layer), layer, mode)


@tf.custom_gradient
def _scaled_identity(x):
    """`MyIdentity` of TensorFlow's custom_gradient test: gradient 3 * dy."""
    return tf.identity(x), lambda dy: 3.0 * dy


class UsesCustomGradient(keras.layers.Layer):
    """A tf.custom_gradient with and without a variable (TF's WithVariables case)."""

    def build(self, input_shape):
        self.dense = keras.layers.Dense(4)
        self.dense.build(input_shape)
        self.w = self.add_weight(shape=(4,), initializer="ones")

    def call(self, x):
        @tf.custom_gradient
        def scale(h):
            def grad(dy, variables=None):
                return dy * self.w, [tf.reduce_sum(dy * h, axis=0) * 2.0 for _ in variables or []]

            return h * self.w, grad

        return tf.tanh(scale(_scaled_identity(self.dense(x))))


@pytest.mark.parametrize("mode", MODES)
def test_torch_custom_function_and_tf_custom_gradient_inside_a_checkpoint(mode):
    layer = UsesCustomGradient()
    layer.build((None, 3))
    x = normal((2, 3))

    def run(fn):
        out = [_grads(lambda: fn(x, training=True), [x, *layer.trainable_variables])]
        out.append(_grads(lambda: fn(x * 2.0, training=True), [x]))  # called twice
        return out

    assert_same_run(run, RecomputeBlock(layer), layer, mode)


class NonDeterministic(keras.layers.Layer):
    """`get_non_det_fn(orig_fn, recompute_fn)`: another function from its second call on."""

    def __init__(self, orig_fn, recompute_fn, **kwargs):
        super().__init__(**kwargs)
        self.fns, self.calls = (orig_fn, recompute_fn), 0

    def call(self, x):
        self.calls += 1
        return self.fns[min(self.calls, 2) - 1](x)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "recompute_fn",
    [
        lambda x: tf.sin(x)[:1],  # another shape
        lambda x: tf.cast(tf.sin(x), tf.float64),  # another dtype
    ],
    ids=["shape", "dtype"],
)
def test_torch_checkpoint_detects_non_determinism(recompute_fn, mode):
    layer = NonDeterministic(tf.sin, recompute_fn)
    block = RecomputeBlock([keras.layers.Dense(4), layer], name="non_det")
    block.build((None, 4))
    layer.calls = 0

    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.cast(block(x, training=True), tf.float32))
        return tape.gradient(loss, block.trainable_variables)

    if mode == "function":
        step = tf.function(step, autograph=False)
    with pytest.raises(RecomputeMismatchError, match=r"RecomputeBlock 'non_det': the recompute"):
        step(normal((2, 4)))


@pytest.mark.parametrize("mode", MODES)
def test_torch_checkpointing_non_reentrant_autocast(mode):
    """Mixed precision: the block computes in bfloat16 like the layers unwrapped."""
    layers = [
        keras.layers.Dense(8, activation="tanh", dtype="mixed_bfloat16"),
        keras.layers.Dense(4, dtype="mixed_bfloat16"),
    ]
    block = RecomputeBlock(layers, dtype="mixed_bfloat16")
    block.build((None, 6))
    x = normal((3, 6))

    def run(fn):
        outputs, grads = _grads(lambda: fn(x, training=True), [x, *block.trainable_variables])
        assert outputs.dtype == tf.bfloat16
        return [tf.cast(outputs, tf.float32), grads]

    assert_same_run(run, block, apply_in_order(layers), mode)


@pytest.mark.parametrize("mode", MODES)
def test_torch_checkpointing_without_reentrant_detached_tensor(mode):
    """The checkpointed function detaches: no gradient flows, as unwrapped."""
    dense = keras.layers.Dense(4)
    dense.build((None, 4))
    layer = Fn(lambda x: tf.stop_gradient(dense(x)) * x)
    grads = _assert_alike(layer, normal((2, 4)), mode, extra=dense.trainable_variables)[1]
    assert grads[0] is not None and grads[1] is None and grads[2] is None


def _nested_sin(depth):
    """`sin(sin(...sin(x)))`, each level a block around the next (TestNestedCheckpoint)."""
    layer = Fn(tf.sin)
    fns = [layer]
    for _ in range(depth):
        layer = RecomputeBlock([layer, Fn(tf.sin)])
    return layer, fns


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("depth", [1, 2, 3])
def test_torch_nested_checkpoint_grad_of_grad(depth, mode):
    block, _ = _nested_sin(depth)
    plain = Fn(lambda x: _apply_sin(x, depth + 1))
    x = normal((3,))

    assert_same_run(lambda fn: _grad_of_grad(fn, x), block, plain, mode)


def _apply_sin(x, times):
    for _ in range(times):
        x = tf.sin(x)
    return x


@pytest.mark.parametrize("mode", MODES)
def test_torch_nested_checkpoint_set_early_stop_no_recompution_needed(mode):
    """`checkpoint(x.sin())` saves only its input: nothing to recompute."""
    layer = Fn(tf.sin)
    layer.built = True
    _assert_alike(layer, normal((5,)), mode)
    assert layer.calls == 2  # one forward each for the block and the unwrapped layer


# ------------------------------------------------------------------ TensorFlow


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("unconnected", ["none", "zero"])
def test_tf_gradients_unconnected_gradients(unconnected, mode):
    """`tape.gradient(..., unconnected_gradients=...)`: None or zeros, as the caller asks."""
    used, unused = keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(3)
    layer = Fn(lambda x: [used(x), unused(x)])
    for dense in (used, unused):
        dense.build((None, 4))
    x = normal((2, 4))

    def run(fn):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(fn(x, training=True)[0])
        return tape.gradient(
            loss,
            [v.value for v in used.trainable_variables + unused.trainable_variables],
            unconnected_gradients=tf.UnconnectedGradients(unconnected),
        )

    grads = assert_same_run(run, RecomputeBlock(layer), layer, mode)
    assert all((g is None) == (unconnected == "none") for g in grads[2:])


@pytest.mark.parametrize("mode", MODES)
def test_tf_gradients_boundary_continue(mode):
    """`y = x * 2; z = y * 3; gradients(z, [x, y]) == [6, 3]`, y and z outputs of a block."""
    layer = Fn(_chain)
    x = tf.constant(1.0)

    def run(fn):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y, z = fn(x, training=True)
        return tape.gradient(z, [x, y])

    grads = assert_same_run(run, RecomputeBlock(layer), layer, mode)
    assert [float(g) for g in grads] == [6.0, 3.0]


def _chain(x):
    y = x * 2.0
    return [y, y * 3.0]


@pytest.mark.parametrize("mode", MODES)
def test_tf_gradients_aggregation(mode):
    """`z = y + y + ... (10 times)`: gradients [20, 10] with respect to x and y."""
    layer = Fn(lambda x: [x * 2.0])
    x = tf.constant(1.0)

    def run(fn):
        with tf.GradientTape() as tape:
            tape.watch(x)
            (y,) = fn(x, training=True)
            z = tf.add_n([y] * 10)
        return tape.gradient(z, [x, y])

    grads = assert_same_run(run, RecomputeBlock(layer), layer, mode)
    assert [float(g) for g in grads] == [20.0, 10.0]


@pytest.mark.parametrize("mode", MODES)
def test_tf_hessian_vector_product(mode):
    """`x^T A x`: the Hessian-vector product through a block is (A + A^T) v."""
    rng = np.random.default_rng([1, 2, 3])
    matrix = tf.constant(rng.normal(size=(4, 4)).astype("float32"))
    v, x = (tf.constant(rng.normal(size=(4, 1)).astype("float32")) for _ in range(2))
    layer = Fn(lambda t: tf.matmul(tf.transpose(t), tf.matmul(matrix, t)))

    def run(fn):
        return _grad_of_grad(fn, x, cotangent=v)[1]

    hv = assert_same_run(run, RecomputeBlock(layer), layer, mode)
    np.testing.assert_allclose(hv, (matrix + tf.transpose(matrix)) @ v, rtol=1e-5)


class LoopInside(keras.layers.Layer):
    """A tf.while_loop and a nested tf.function inside (TF's recompute_grad test)."""

    def build(self, input_shape):
        self.w = self.add_weight(shape=(input_shape[-1], input_shape[-1]))
        self.inner = tf.function(lambda h: tf.tanh(tf.matmul(h, self.w)))

    def call(self, x):
        return tf.while_loop(lambda i, h: i < 3, lambda i, h: (i + 1, self.inner(h) + x), (0, x))[1]


@pytest.mark.parametrize("mode", MODES)
def test_tf_recompute_grad_with_nested_function_and_while_loop(mode):
    layer = LoopInside()
    layer.build((None, 4))
    _assert_alike(layer, normal((2, 4)), mode)


# ------------------------------------------------------------------ Keras remat_test.py


def test_keras_remat_basic_call():
    """Dense, a rematerialized ReLU, Dense: `fit` trains like the model without remat."""
    first, relu, last = keras.layers.Dense(4), keras.layers.ReLU(), keras.layers.Dense(1)

    def model(blocked):
        inputs = keras.Input((4,))
        hidden = (RecomputeBlock(relu) if blocked else relu)(first(inputs))
        return keras.Model(inputs, last(hidden))

    plain, blocked = model(False), model(True)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 4)).astype("float32"), rng.normal(size=(64, 1)).astype("float32")
    np.testing.assert_allclose(blocked.predict(x, verbose=0), plain.predict(x, verbose=0))
    assert_same_fit([plain, blocked], plain.variables, x, y, batch_size=16)


@pytest.mark.parametrize("mode", MODES)
def test_keras_remat_with_kwargs(mode):
    """`fn_with_kwargs(x, scale=1.0, offset=0.0)`: given, default and partial kwargs."""
    layer = Fn(lambda x, scale=1.0, offset=0.0: tf.tanh(x * scale + offset))
    x = tf.constant([1.0, 2.0, 3.0])

    def run(fn):
        return [
            _grads(lambda: fn(x, scale=2.0, offset=1.0, training=True), [x]),
            _grads(lambda: fn(x, training=True), [x]),
            _grads(lambda: fn(x, scale=3.0, training=True), [x]),
        ]

    assert_same_run(run, RecomputeBlock(layer), layer, mode)


# ------------------------------------------------------------------ JAX RematTest


@pytest.mark.parametrize("mode", MODES)
def test_jax_remat_basic(mode):
    """`g(x) = sin(sin(x)), 3.`: a Python value among the outputs; vjp as unwrapped."""
    layer = Fn(lambda x: (tf.sin(tf.sin(x)), 3.0))
    x = tf.constant(2.0)

    def run(fn):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y, three = fn(x, training=True)
        assert three == 3.0
        return [y, tape.gradient(y, x)]

    _, grad = assert_same_run(run, RecomputeBlock(layer), layer, mode)
    np.testing.assert_allclose(grad, np.cos(np.sin(2.0)) * np.cos(2.0), rtol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_jax_remat_freevars(mode):
    """`f2` closes over `y = 2 * sin(x)`, computed outside the remat: same as `f1`."""
    layer = Fn(lambda t, y: tf.cos(t) * tf.sin(y))
    holder = {}
    free = Fn(lambda t: tf.cos(t) * tf.sin(holder["y"]))  # the closure, as a layer
    x = normal((3,))

    def f1(fn):
        with tf.GradientTape() as tape:
            tape.watch(x)
            z = tf.reduce_sum(fn(x, 2.0 * tf.sin(x), training=True))
        return tape.gradient(z, x)

    def f2(fn):
        with tf.GradientTape() as tape:
            tape.watch(x)
            holder["y"] = 2.0 * tf.sin(x)
            z = tf.reduce_sum(fn(x, training=True))
        return tape.gradient(z, x)

    want = assert_same_run(f1, RecomputeBlock(layer), layer, mode)
    got = assert_same_run(f2, RecomputeBlock(free), free, mode)
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_jax_remat_grad_python_control_flow():
    """`if x > 0: sin(x), 3. else: cos(x), 4.` on tensor values, eagerly."""
    layer = Fn(lambda x: (tf.sin(x), 3.0) if x > 0 else (tf.cos(x), 4.0))

    def run(fn):
        results = []
        for value in (2.0, -2.0):
            x = tf.constant(value)
            with tf.GradientTape() as tape:
                tape.watch(x)
                y, const = fn(x, training=True)
            results += [y, tape.gradient(y, x), tf.constant(const)]
        return results

    assert_same_run(run, RecomputeBlock(layer), layer, "eager")


@pytest.mark.parametrize("mode", MODES)
def test_jax_remat_higher_order_autodiff(mode):
    """`grad(grad(remat(cos(sin(x)))))`."""
    layer = Fn(lambda x: tf.cos(tf.sin(x)))
    x = tf.constant(3.0)

    assert_same_run(lambda fn: _grad_of_grad(fn, x), RecomputeBlock(layer), layer, mode)


@pytest.mark.parametrize("mode", MODES)
def test_jax_remat_scan(mode):
    """`lax.scan(remat(lambda c, x: (sin(c), None)), x, arange(3))`."""
    layer = Fn(tf.sin)
    block = RecomputeBlock(layer)
    x = tf.constant(4.0)

    def run(fn):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.scan(lambda c, _: fn(c, training=True), tf.range(3.0), initializer=x)[-1]
        return [y, tape.gradient(y, x)]

    with warnings.catch_warnings():
        warnings.filterwarnings("error", "RecomputeBlock .*pointless")
        assert_same_run(run, block, layer, mode)


def test_jax_remat_no_redundant_flops():
    """The forward runs once; a gradient adds one recompute, not more."""
    layer = Fn(lambda x: tf.sin(tf.sin(x)))
    block = RecomputeBlock(layer)
    block.build(())
    layer.calls = 0
    x = tf.constant(2.0)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = block(x, training=True)
    assert layer.calls == 1
    tape.gradient(y, x)
    assert layer.calls == 2


@pytest.mark.parametrize("mode", MODES)
def test_jax_remat_binomial_checkpointing(mode):
    """`binom_checkpoint(funs)`: blocks nested by halves, sin at the leaves."""

    def binom(count):
        if count == 1:
            return Fn(tf.sin)
        return RecomputeBlock([binom(count // 2), binom(count - count // 2)])

    block = binom(8)
    plain = Fn(lambda x: _apply_sin(x, 8))
    x = tf.constant(3.0)

    def run(fn):
        return _grads(lambda: fn(x, training=True), [x])

    assert_same_run(run, block, plain, mode)


@pytest.mark.parametrize("mode", MODES)
def test_jax_remat_symbolic_zeros(mode):
    """Outputs `(x, x ** 2)`, only the first used: the second's cotangent is zero."""
    dense = keras.layers.Dense(3)
    dense.build((None, 3))
    layer = Fn(lambda x: (dense(x), tf.square(x) * dense.kernel))
    x = normal((3, 3))

    def run(fn):
        with tf.GradientTape() as tape:
            tape.watch(x)
            first, _ = fn(x, training=True)
            loss = _loss(first)
        return tape.gradient(loss, [x, *dense.trainable_variables])

    assert_same_run(run, RecomputeBlock(layer), layer, mode)


@pytest.mark.parametrize("mode", MODES)
def test_jax_remat_jvp(mode):
    """Forward mode through a block: the JVP of `sin(sin(x))`."""
    layer = Fn(lambda x: tf.sin(tf.sin(x)))
    x = tf.constant([1.0, 2.0, 3.0])

    def run(fn):
        with tf.autodiff.ForwardAccumulator(x, tf.ones_like(x)) as accumulator:
            y = fn(x, training=True)
        return [y, accumulator.jvp(y)]

    assert_same_run(run, RecomputeBlock(layer), layer, mode)


@pytest.mark.parametrize("mode", MODES)
def test_jax_remat_of_while_loop(mode):
    """A while loop inside the rematerialized function."""

    def body(i, h):
        return i + 1, tf.sin(h) * 1.1

    layer = Fn(lambda x: tf.while_loop(lambda i, h: i < 3, body, (0, x))[1])
    _assert_alike(layer, normal((4,)), mode)
