"""Recompute policies: a block that keeps its weight products trains as the layers unwrapped.

Every policy is checked against the same layers unwrapped (outputs, gradients,
None gradients, state updates), eagerly, under `tf.function` and under XLA;
that a `"dots"` block's backward runs no weight product again is checked on
the traced graph's op counts.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests import multiworker_worker as worker
from tests.helpers import MODES, assert_same_run, normal
from tests.layers.test_block_exactness import StopAndAux, assert_adamw_fit_leaves_unreached_weights
from tests.test_errors import CONVENTION, _own_message
from tfrecompute import RecomputeBlock
from tfrecompute.layers import OpInfo, RecomputeMismatchError


def _loss(outputs):
    return tf.add_n(
        [
            tf.reduce_sum(
                o * tf.reshape(tf.sin(tf.range(tf.size(o), dtype=tf.float32) + 1.0), o.shape)
            )
            for o in tf.nest.flatten(outputs)
        ]
    )


def _gradients(call, x, variables):
    with tf.GradientTape() as tape:
        tape.watch(x)
        outputs = call(x)
        loss = _loss(outputs)
    return [outputs, tape.gradient(loss, [x, *variables])]


def keep_matmuls(op):
    """A custom policy: every matmul, with a weight or not."""
    return op.kind == "matmul"


class Attention(keras.layers.Layer):
    """Self-attention with dropout on the scores, a residual, a norm and a GELU MLP."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.mha = keras.layers.MultiHeadAttention(2, 4, dropout=0.3, seed=1)
        self.norm = keras.layers.LayerNormalization()
        self.mlp = keras.layers.Dense(8, activation="gelu")

    def build(self, shape):
        self.mha.build(shape, shape)
        self.norm.build(shape)
        self.mlp.build(shape)

    def call(self, x, training=None):
        x = self.norm(x + self.mha(x, x, training=training))
        return self.mlp(x)


def _dense():
    return [
        keras.layers.Dense(16, activation="gelu"),
        keras.layers.Dropout(0.3, seed=2),
        keras.layers.Dense(16, activation="tanh"),
    ], (4, 8)


def _attention():
    return [Attention()], (2, 6, 8)


def _conv_bn():
    return [
        keras.layers.Conv2D(4, 3, padding="same"),
        keras.layers.BatchNormalization(momentum=0.5),
        keras.layers.ReLU(),
        keras.layers.DepthwiseConv2D(3, padding="same"),
        keras.layers.Conv2D(3, 1),
    ], (2, 6, 6, 3)


CASES = {"dense_dropout": _dense, "attention": _attention, "conv_bn": _conv_bn}
POLICIES = [None, "nothing", "dots", keep_matmuls]


def _same_step(case, policy, mode, *, jit_compile=False):
    keras.utils.set_random_seed(0)
    layers, shape = CASES[case]()
    block = RecomputeBlock(layers, policy=policy)
    x = normal(shape)
    block(x)  # builds
    variables = block.trainable_variables
    state = block.non_trainable_variables

    def run(fn):
        return _gradients(lambda v: fn(v, training=True), x, variables)

    def unwrapped(v, training=None):
        for layer in layers:
            v = layer(v, training=training)
        return v

    if jit_compile:
        wrapped = tf.function(lambda: run(block), jit_compile=True)
        plain = tf.function(lambda: run(unwrapped), jit_compile=True)
        assert_same_run(lambda f: f(), wrapped, plain, "eager", state=state, rtol=1e-5)
    else:
        assert_same_run(run, block, unwrapped, mode, state=state)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: getattr(p, "__name__", str(p)))
@pytest.mark.parametrize("case", sorted(CASES))
def test_every_policy_trains_as_unwrapped(case, policy, mode):
    _same_step(case, policy, mode)


@pytest.mark.parametrize("case", sorted(CASES))
def test_dots_under_xla_trains_as_unwrapped(case):
    _same_step(case, "dots", "function", jit_compile=True)


# --------------------------------------------------------------- op counts


def _reachable(outputs):
    """The ops a concrete function runs: those its outputs depend on (the rest is pruned)."""
    seen, stack = {}, [t.op for t in outputs]
    while stack:
        op = stack.pop()
        if op.name not in seen:
            seen[op.name] = op
            stack.extend(i.op for i in op.inputs)
            stack.extend(op.control_inputs)
    return list(seen.values())


def _traced_products(policy, depth=4):
    keras.utils.set_random_seed(0)
    layers = [keras.layers.Dense(32, activation="gelu") for _ in range(depth)]
    model = keras.Sequential(layers)
    call = model if policy == "unwrapped" else RecomputeBlock(layers, policy=policy)
    x = normal((8, 32))
    call(x)

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(call(x, training=True) ** 2)
        return tape.gradient(loss, model.trainable_variables)

    function = step.get_concrete_function(x)
    return sum(op.type == "MatMul" for op in _reachable(function.outputs))


def test_a_dots_block_runs_no_weight_matmul_again():
    depth = 4
    full, dots = _traced_products(None, depth), _traced_products("dots", depth)
    plain = _traced_products("unwrapped", depth)
    # Full recompute: forward, recompute, input and weight gradient per layer.
    assert full == 4 * depth
    # "dots": the recompute's products are gone; what is left is the forward
    # and the two gradient products per layer (the first layer's input
    # gradient too, which the unwrapped step does not compute).
    assert dots == full - depth == plain + 1


# ----------------------------------------------------------- custom policies


def test_a_custom_policy_sees_each_product_of_the_forward():
    seen = []

    def policy(op):
        seen.append(op)
        return op.weight

    keras.utils.set_random_seed(0)
    block = RecomputeBlock([Attention()], policy=policy)
    x = normal((2, 6, 8))
    block(x)
    seen.clear()
    _gradients(lambda v: block(v, training=True), x, block.trainable_variables)
    kinds = [(op.kind, op.weight) for op in seen]
    # q, k, v projections, the scores, the weighted values, the output
    # projection, then the MLP's matmul: seen once, in the forward.
    assert kinds == [("einsum", True)] * 3 + [("einsum", False)] * 2 + [
        ("einsum", True),
        ("matmul", True),
    ]
    assert all(isinstance(op, OpInfo) for op in seen)
    assert seen[0].shape == (2, 6, 2, 4) and seen[0].dtype == "float32"
    assert seen[0].nbytes == 2 * 6 * 2 * 4 * 4
    with pytest.raises(AttributeError):
        seen[0].kind = "conv"  # frozen


def test_a_layer_calling_tensorflow_directly_is_recomputed_correctly():
    class RawMatmul(keras.layers.Layer):
        def build(self, shape):
            self.kernel = self.add_weight(shape=(shape[-1], 8))

        def call(self, x):
            return tf.tanh(tf.linalg.matmul(x, self.kernel))

    seen = []
    keras.utils.set_random_seed(0)
    layer = RawMatmul()
    block = RecomputeBlock(layer, policy=lambda op: seen.append(op) or True)
    x = normal((4, 5))
    block(x)
    for mode in MODES:
        assert_same_run(
            lambda f: _gradients(lambda v: f(v, training=True), x, layer.trainable_variables),
            block,
            lambda v, training=None: layer(v),
            mode,
        )
    assert seen == []


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("inner_policy", [None, "dots"])
def test_nested_blocks_each_apply_their_own_policy(inner_policy, mode):
    keras.utils.set_random_seed(0)
    inner = [keras.layers.Dense(8, activation="relu"), keras.layers.Dense(8, activation="tanh")]
    first = keras.layers.Dense(8, activation="gelu")
    last = keras.layers.Dense(4)
    block = RecomputeBlock([first, RecomputeBlock(inner, policy=inner_policy), last], policy="dots")
    x = normal((3, 8))
    block(x)
    layers = [first, *inner, last]
    variables = [v for layer in layers for v in layer.trainable_variables]

    def unwrapped(v, training=None):
        for layer in layers:
            v = layer(v)
        return v

    def run(f):
        return _gradients(lambda v: f(v, training=True), x, variables)

    assert_same_run(run, block, unwrapped, mode)


def test_fit_with_adamw_under_dots_trains_as_unwrapped():
    """AdamW decays every weight it gets a gradient for: None must stay None under "dots"."""
    keras.utils.set_random_seed(1)
    pre, layer, head = keras.layers.Dense(6), StopAndAux(), keras.layers.Dense(2)
    drop = keras.layers.Dropout(0.3, seed=5)

    def model(blocked):
        inputs = keras.Input((6,))
        x = pre(inputs)
        if blocked:
            out = RecomputeBlock([drop, layer], policy="dots")(x)
        else:
            out = layer(drop(x))
        return keras.Model(inputs, head(out["main"]))

    assert_adamw_fit_leaves_unreached_weights(model(False), model(True), layer)


def test_mirrored_fit_under_dots_matches_unwrapped():
    strategy = worker.mirrored_strategy(["CPU:0", "CPU:1"])
    models = []
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 8)).astype("float32"), rng.normal(size=(32, 3)).astype("float32")
    with strategy.scope():
        for blocked in (False, True):
            model = worker.build_model(blocked, policy="dots")
            model(x[:2])
            model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
            models.append(model)
        for target, source in zip(models[1].variables, models[0].variables):
            target.assign(source)
    losses = [m.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0) for m in models]
    np.testing.assert_allclose(losses[1].history["loss"], losses[0].history["loss"], rtol=1e-6)
    got, want = worker.replica_values(models[1]), worker.replica_values(models[0])
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=1e-6, rtol=1e-6)


# --------------------------------------------------------- saving and errors


def test_get_config_and_a_saved_model_keep_the_policy(tmp_path):
    keras.utils.set_random_seed(0)
    block = RecomputeBlock([keras.layers.Dense(4)], policy="dots")
    model = keras.Sequential([keras.Input((3,)), block])
    assert block.get_config()["policy"] == "dots"
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert loaded.layers[0].policy == "dots"
    x = normal((2, 3))
    np.testing.assert_allclose(loaded(x), model(x))


@keras.saving.register_keras_serializable(package="tfrecompute_tests")
def registered_policy(op):
    return op.kind == "matmul" and op.weight


def test_a_registered_policy_function_saves_and_loads(tmp_path):
    block = RecomputeBlock([keras.layers.Dense(4)], policy=registered_policy)
    model = keras.Sequential([keras.Input((3,)), block])
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert loaded.layers[0].policy is registered_policy


def test_an_unregistered_policy_function_fails_on_save(tmp_path):
    block = RecomputeBlock([keras.layers.Dense(4)], policy=lambda op: op.weight)
    model = keras.Sequential([keras.Input((3,)), block])
    with pytest.raises(ValueError, match="register_keras_serializable") as info:
        model.save(tmp_path / "m.keras")
    assert CONVENTION.match(_own_message(info.value))


@pytest.mark.parametrize(
    ("policy", "error", "match"),
    [
        (3, TypeError, r"`policy` must be None, a policy name or a callable\. Received: policy=3"),
        ("dot", ValueError, r"unknown recompute policy\. Received: policy='dot'"),
    ],
)
def test_a_malformed_policy_raises_when_the_block_is_made(policy, error, match):
    with pytest.raises(error, match=match) as info:
        RecomputeBlock(keras.layers.Dense(2), policy=policy)
    assert CONVENTION.match(_own_message(info.value))


@pytest.mark.parametrize("mode", MODES)
def test_a_policy_returning_no_bool_raises_in_the_forward(mode):
    block = RecomputeBlock(keras.layers.Dense(2), policy=lambda op: "yes")
    x = normal((2, 3))
    block(x)

    def call():
        return _gradients(lambda v: block(v, training=True), x, [])

    if mode == "function":
        call = tf.function(call, autograph=False)
    with pytest.raises(TypeError, match=r"must return True .* Received: answer='yes'") as info:
        call()
    assert CONVENTION.match(_own_message(info.value))


def test_a_recompute_that_computes_other_products_raises():
    class Flaky(keras.layers.Layer):
        switched = False

        def build(self, shape):
            self.kernel = self.add_weight(shape=(shape[-1], shape[-1]))

        def call(self, x):
            if self.switched:
                return keras.ops.tanh(keras.ops.einsum("ij,jk->ik", x, self.kernel))
            return keras.ops.tanh(keras.ops.matmul(x, self.kernel))

    layer = Flaky()
    block = RecomputeBlock(layer, policy="dots")
    x = normal((2, 3))
    with tf.GradientTape() as tape:
        y = block(x, training=True)
    layer.switched = True
    with pytest.raises(RecomputeMismatchError, match="other products than the forward"):
        tape.gradient(y, block.trainable_variables)


@pytest.mark.parametrize("mode", MODES)
def test_dots_under_mixed_bfloat16_trains_as_unwrapped(mode):
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        keras.utils.set_random_seed(0)
        layers = [keras.layers.Dense(8, activation="gelu"), keras.layers.Dense(8)]
        block = RecomputeBlock(layers, policy="dots")
        x = normal((4, 8))
        block(x)

        def unwrapped(v, training=None):
            for layer in layers:
                v = layer(v)
            return v

        def run(f):
            return _gradients(
                lambda v: tf.cast(f(v, training=True), tf.float32), x, block.trainable_variables
            )

        assert_same_run(run, block, unwrapped, mode, rtol=1e-2)
    finally:
        keras.config.set_dtype_policy(previous)


@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])
def test_a_dots_step_keeps_its_products_and_no_more(jit_compile):
    """Allocator peaks: none > dots > full, dots holding at most one product per layer more."""
    import tfrecompute

    def peak(policy):
        keras.utils.set_random_seed(0)
        layers = [keras.layers.Dense(256, activation="gelu") for _ in range(8)]
        body = (
            layers
            if policy == "none"
            else [RecomputeBlock(layers[i : i + 4], policy=policy) for i in (0, 4)]
        )
        model = keras.Sequential([keras.Input((256,)), *body, keras.layers.Dense(1)])
        model.compile("sgd", "mse", jit_compile=jit_compile)
        rng = np.random.default_rng(0)
        x, y = rng.normal(size=(512, 256)).astype("float32"), np.zeros((512, 1), "float32")
        return tfrecompute.measure_step(model, x, y, steps=2).peak_bytes

    none, full, dots = peak("none"), peak(None), peak("dots")
    product = 512 * 256 * 4  # one layer's matmul output
    if jit_compile:
        # XLA takes a step's temporaries as one buffer, in coarse sizes: none
        # measured 32 and 16.25 MiB in two runs, dots 16, 15.25 and 10.5, full
        # 7.75, 15.25 and 12.5 (above dots in that run): only that neither
        # holds more than storing everything holds.
        assert max(full, dots) <= none
    else:  # measured 17.25, 8.5 and 10.5 MiB
        assert full < dots < none
        assert dots - full <= 1.5 * 8 * product  # the kept products, not the activations


def test_eagerly_the_vjp_of_a_kept_product_computes_no_product():
    from tfrecompute.layers import policy

    policy._EAGER_VJPS.clear()
    keras.utils.set_random_seed(0)
    layer = keras.layers.Dense(8, activation="tanh")
    block = RecomputeBlock(layer, policy="dots")
    x = normal((4, 8))
    block(x)
    _gradients(lambda v: block(v, training=True), x, layer.trainable_variables)
    (vjp,) = policy._EAGER_VJPS.values()
    (concrete,) = vjp._list_all_concrete_functions_for_serialization()
    ops = _reachable(concrete.outputs)
    # Traced: the product under the local tape, the input and the weight
    # gradient; run: the two gradients (TensorFlow prunes the unread product).
    assert sum(op.type == "MatMul" for op in concrete.graph.get_operations()) == 3
    assert sum(op.type == "MatMul" for op in ops) == 2
