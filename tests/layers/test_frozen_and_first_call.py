"""Two peer behaviours: frozen blocks are not recomputed, and a block's first call
runs its layers no more often than the layers unwrapped (plus the recompute).

Each case names the peer test it is modelled on and runs eagerly and under
`tf.function`, against the same layers unwrapped (None where they give None).
Layers count their calls in Python (`calls`): once per eager run or per trace,
which is what a Python side effect sees.
"""

from __future__ import annotations

import contextlib
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import MODES, assert_same_run, assert_same_values, normal
from tfrecompute import RecomputeBlock


class Counted(keras.layers.Layer):
    """`Dense(units, tanh)` that counts its calls (a recompute is one more)."""

    def __init__(self, units, seed=0, **kwargs):
        super().__init__(**kwargs)
        self.calls = 0
        initializer = keras.initializers.GlorotUniform(seed=seed)
        self.dense = keras.layers.Dense(units, activation="tanh", kernel_initializer=initializer)

    def build(self, input_shape):
        self.dense.build(input_shape)

    def call(self, x):
        self.calls += 1
        return self.dense(x)

    def compute_output_shape(self, input_shape):
        return self.dense.compute_output_shape(input_shape)


class CountedWithoutBuild(keras.layers.Layer):
    """No `build()`: Keras builds it by a symbolic run of `call()`, unwrapped too."""

    def __init__(self, units, seed=0, **kwargs):
        super().__init__(**kwargs)
        self.calls = 0
        initializer = keras.initializers.GlorotUniform(seed=seed)
        self.dense = keras.layers.Dense(units, kernel_initializer=initializer)

    def call(self, x):
        self.calls += 1
        return tf.sin(self.dense(x))


def _frozen(layer, shape=(None, 8)):
    """Built, then frozen: as a pretrained layer is (its tf.Variables stay trainable)."""
    layer.build(shape)
    layer.trainable = False
    return layer


def _loss(outputs):
    floats = [o for o in tf.nest.flatten(outputs) if o.dtype.is_floating]
    return tf.add_n(
        [
            tf.reduce_sum(o * tf.reshape(tf.cos(tf.range(tf.size(o), dtype=o.dtype)), tf.shape(o)))
            for o in floats
        ]
    )


def _in_order(calls):
    def fn(x, training=None):
        for call in calls:
            x = call(x, training=training)
        return x

    return fn


@contextlib.contextmanager
def _recording_warnings():
    """The warnings raised inside, checked by the test after its other assertions."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught


def _warned_pointless(caught):
    return any("recompute is pointless" in str(w.message) for w in caught)


def _calls_per_run(run, fn, counters, mode):
    """Each counter's calls while `run(fn)` runs once (eagerly, or traced once)."""
    for counter in counters:
        counter.calls = 0
    (tf.function(lambda: run(fn)) if mode == "function" else lambda: run(fn))()
    return [counter.calls for counter in counters]


# ------------------------------------------------------------------ frozen blocks


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "frozen, recomputed",
    [((0, 1, 2), (False, False, False, True)), ((1, 2), (True, True, True, True))],
    ids=["first_three_frozen", "first_trainable"],
)
def test_fairscale_checkpoint_requires_grad(frozen, recomputed, mode):
    """fairscale `tests/nn/checkpoint/test_checkpoint_activations.py::
    test_checkpoint_requires_grad`: four checkpointed modules in a row, the input
    needing no gradient. Frozen ones before any trainable one run their forward
    once; once a trainable one comes first, every later one needs the gradient
    of its input and recomputes, frozen or not, with exact gradients."""
    layers = [Counted(8, seed=i) for i in range(4)]
    for index, layer in enumerate(layers):
        layer.build((None, 8))
        layer.trainable = index not in frozen
    blocks = [RecomputeBlock(layer) for layer in layers]
    x = normal((4, 8))
    trainable = [v for layer in layers for v in layer.trainable_variables]

    def run(fn):
        with tf.GradientTape() as tape:
            loss = _loss(fn(x, training=True))
        return tape.gradient(loss, [x, *trainable])  # x: None, as no tape watches it

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "RecomputeBlock .*pointless")
        grads = assert_same_run(run, _in_order(blocks), _in_order(layers), mode)
        calls = _calls_per_run(run, _in_order(blocks), layers, mode)
    assert grads[0] is None and all(g is not None for g in grads[1:])
    assert calls == [2 if again else 1 for again in recomputed]
    assert _calls_per_run(run, _in_order(layers), layers, mode) == [1, 1, 1, 1]


@pytest.mark.parametrize("mode", MODES)
def test_fairscale_checkpoint_requires_grad_partially_frozen_block_recomputes(mode):
    """fairscale's `test_checkpoint_requires_grad`, its `TestModel2` case: a module
    that needs a gradient runs its forward twice though what feeds it is frozen. Here
    inside one block: its first layer frozen, its last not, the input unwatched; the
    block recomputes both layers (the frozen one's output feeds a weight's gradient),
    with exact gradients."""
    first, second = _frozen(Counted(8, seed=1)), Counted(4, seed=2)
    second.build((None, 8))
    block = RecomputeBlock([first, second])
    x = normal((3, 8))

    def run(fn):
        with tf.GradientTape() as tape:
            loss = _loss(fn(x, training=True))
        return tape.gradient(loss, [x, *second.trainable_variables])

    grads = assert_same_run(run, block, _in_order([first, second]), mode)
    assert grads[0] is None and grads[1] is not None
    assert _calls_per_run(run, block, [first, second], mode) == [2, 2]


@pytest.mark.parametrize("mode", MODES)
def test_frozen_block_with_an_input_needing_its_gradient_recomputes(mode):
    """fairscale's `test_checkpoint_requires_grad`, second half, on one block: frozen
    weights, but the input is watched, so the block recomputes and passes it its
    gradient exactly."""
    layer = _frozen(Counted(8, seed=3))
    block = RecomputeBlock(layer)
    x = normal((3, 8))

    def run(fn):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = _loss(fn(x, training=True))
        return tape.gradient(loss, x)

    grad = assert_same_run(run, block, layer, mode)
    assert grad is not None and float(tf.reduce_max(tf.abs(grad))) > 0
    assert _calls_per_run(run, block, [layer], mode) == [2]


@pytest.mark.parametrize("mode", MODES)
def test_frozen_block_without_a_watched_input_keeps_nothing_for_backprop(mode):
    """fairscale's `test_checkpoint_requires_grad` ("only last model needs grad"), and
    PyTorch `test/test_utils.py::TestCheckpoint::test_checkpoint_no_tensors` (nothing
    needing a gradient: the function runs once): the block runs once and no tape
    records it. Unwrapped, the tape watches the frozen weights as they are read
    (Keras leaves their tf.Variables trainable) and keeps the activations; through
    the block it watches none of them."""
    layers = [_frozen(Counted(8, seed=4)), keras.layers.Dropout(0.5, seed=1)]
    block = RecomputeBlock(layers)
    x = normal((4, 8))

    def run(fn):
        with tf.GradientTape() as tape:
            outputs = fn(x, training=True)
        return outputs, len(tape.watched_variables())

    def step(fn):
        return tf.function(lambda: run(fn))() if mode == "function" else run(fn)

    state = list(block.non_trainable_variables)
    initial = [v.numpy() for v in state]
    with _recording_warnings() as caught:
        got, watched = step(block)
    for variable, value in zip(state, initial):
        variable.assign(value)
    want, watched_unwrapped = step(_in_order(layers))
    assert_same_values(got, want)
    assert int(watched) == 0 and int(watched_unwrapped) == 2
    assert layers[0].calls == 2  # once through the block, once unwrapped
    assert _warned_pointless(caught)


@pytest.mark.parametrize("mode", MODES)
def test_a_frozen_weight_no_tape_watches_gets_none_through_the_block(mode):
    """The one difference from the layers unwrapped (NOTE [ Frozen blocks ]). Keras
    leaves a frozen layer's tf.Variables trainable, so unwrapped a tape watches them
    as they are read and `tape.gradient(loss, kernel)` gives a tensor, though no
    optimizer asks for it (`fit` asks for `trainable_variables`); through the block
    it gives None. A frozen weight the tape watches gets its gradient, exactly."""
    layer = _frozen(Counted(8, seed=5))
    kernel = layer.dense.kernel
    x = normal((2, 8))

    def run(fn, watch):
        with tf.GradientTape() as tape:
            if watch:
                tape.watch(kernel.value)
            loss = _loss(fn(x, training=True))
        return tape.gradient(loss, kernel.value)

    def step(fn, watch):
        return tf.function(lambda: run(fn, watch))() if mode == "function" else run(fn, watch)

    with _recording_warnings() as caught:
        assert step(RecomputeBlock(layer), False) is None
    assert step(layer, False) is not None
    assert _warned_pointless(caught)
    assert_same_values(step(RecomputeBlock(layer), True), step(layer, True))


def _fit_models():
    """A frozen block first (no gradient reaches it) and one after a trainable layer."""
    first = [_frozen(Counted(8, seed=6)), keras.layers.Dropout(0.3, seed=2)]
    middle = keras.layers.Dense(8, activation="tanh")
    last = _frozen(Counted(8, seed=7))
    head = keras.layers.Dense(2)
    plain = keras.Sequential([keras.Input((8,)), *first, middle, last, head])
    blocked = keras.Sequential(
        [keras.Input((8,)), RecomputeBlock(first), middle, RecomputeBlock(last), head]
    )
    return plain, blocked, first[0], last


def _fit_trajectory(model, variables, x, y, counters):
    """`variables` after each of 3 AdamW steps, and the counters' calls during fit."""
    steps = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: steps.append([v.numpy() for v in variables])
    )
    model.compile(optimizer=keras.optimizers.AdamW(1e-2, weight_decay=0.1), loss="mse")
    for counter in counters:
        counter.calls = 0
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[record])
    return steps, [counter.calls for counter in counters]


def test_model_fit_with_adamw_follows_the_plain_model_and_skips_the_frozen_recompute():
    """fairscale's `test_checkpoint_requires_grad` in `fit`: 3 AdamW steps (weight
    decay moves every weight a gradient reaches) follow the plain model step by step;
    the frozen block first in the model runs its layer as often as the plain model
    does, the frozen block after a trainable layer recomputes."""
    plain, blocked, first, last = _fit_models()
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(24, 8)).astype("float32"), rng.normal(size=(24, 2)).astype("float32")
    variables = plain.variables  # weights, and the Dropout's seed state
    initial = [v.numpy() for v in variables]
    want, plain_calls = _fit_trajectory(plain, variables, x, y, [first, last])
    for variable, value in zip(variables, initial):
        variable.assign(value)
    with _recording_warnings() as caught:
        got, blocked_calls = _fit_trajectory(blocked, variables, x, y, [first, last])
    assert len(got) == len(want) == 3
    for step, (got_weights, want_weights) in enumerate(zip(got, want)):
        for index, (g, w) in enumerate(zip(got_weights, want_weights)):
            np.testing.assert_allclose(g, w, atol=1e-5, err_msg=f"step {step}, weight {index}")
    assert any(not np.allclose(a, b) for a, b in zip(want[-1], initial))
    assert blocked_calls[0] == plain_calls[0]  # not recomputed
    assert blocked_calls[1] > plain_calls[1]  # recomputed: its input needs a gradient
    assert _warned_pointless(caught)


# ------------------------------------------------------- first call of unbuilt layers


def _unbuilt_layers(seed):
    return [
        Counted(16, seed=seed),
        keras.layers.BatchNormalization(momentum=0.5),  # state created at its first call
        keras.layers.Dropout(0.3, seed=seed),
        CountedWithoutBuild(8, seed=seed + 1),
        Counted(4, seed=seed + 2),
    ]


def _first_step(fn, counted, mode):
    """`[outputs, grads]` of the first training step, the counters' calls, and how many
    times the step's Python body ran (each eager run, each trace)."""
    runs = []
    variables = []

    def step(x):
        runs.append(1)
        with tf.GradientTape() as tape:
            tape.watch(x)
            outputs = fn(x, training=True)
            loss = _loss(outputs)
        if not variables:  # created by this first step
            variables.extend(v for layer in counted for v in layer.trainable_variables)
        return [outputs, tape.gradient(loss, [x, *variables])]

    results = (tf.function(step) if mode == "function" else step)(normal((4, 8)))
    return results, [layer.calls for layer in counted], len(runs)


@pytest.mark.parametrize("mode", MODES)
def test_first_step_of_unbuilt_layers_calls_them_as_unwrapped_plus_the_recompute(mode):
    """fairscale `test_checkpoint_activations.py::test_list_input` counts a checkpointed
    module's forward calls: one in the forward, one more in backward. Here the layers
    are not built before the first training step: the block builds each as Keras
    would unwrapped (`build()`, or Keras's own symbolic run for a layer without one),
    so each `call()` runs as often as unwrapped plus once per recompute, with the same
    outputs, gradients, BatchNormalization statistics and Dropout mask."""
    unwrapped_layers, block_layers = _unbuilt_layers(10), _unbuilt_layers(10)
    block = RecomputeBlock(block_layers)
    counted = lambda layers: [layers[0], layers[3], layers[4]]  # noqa: E731
    got, got_calls, runs = _first_step(block, counted(block_layers), mode)
    want, want_calls, want_runs = _first_step(
        _in_order(unwrapped_layers), counted(unwrapped_layers), mode
    )
    assert runs == want_runs  # a first tf.function call traces twice (variables), both ways
    assert_same_values(got, want)
    assert_same_values(
        [v.numpy() for v in block.non_trainable_variables],
        [v.numpy() for layer in unwrapped_layers for v in layer.non_trainable_variables],
        what="state",
    )
    assert got_calls == [calls + runs for calls in want_calls]  # + one recompute per run


@pytest.mark.parametrize("mode", MODES)
def test_first_step_of_a_frozen_block_calls_its_layer_as_unwrapped(mode):
    """fairscale's `test_checkpoint_requires_grad` with unbuilt layers: a layer frozen
    before it is built, in a block whose input needs no gradient, runs as unwrapped."""
    layer, twin = Counted(8, seed=11), Counted(8, seed=11)
    layer.trainable = twin.trainable = False
    block = RecomputeBlock(layer)

    def run(fn):
        with tf.GradientTape():
            return fn(normal((2, 8)), training=True)

    with _recording_warnings() as caught:
        got = _calls_per_run(run, block, [layer], mode)
    assert got == _calls_per_run(run, twin, [twin], mode)
    assert _warned_pointless(caught)


class Remembers(keras.layers.Layer):
    """Keeps the first input it sees and subtracts it (a Python side effect on a
    tensor, as JAX's test keeps a traced value in a list)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.first = None

    def build(self, input_shape):
        initializer = keras.initializers.GlorotUniform(seed=12)
        self.kernel = self.add_weight(shape=(input_shape[-1], 4), initializer=initializer)

    def call(self, x):
        if self.first is None:
            self.first = x
        return tf.tanh(tf.matmul(x - self.first[:1], self.kernel))


def test_jax_escaped_tracer_remat_cannot_happen_on_the_first_step():
    """JAX `tests/api_test.py::RematTest::test_escaped_tracer_remat`: a remat'd
    function that keeps a traced value raises `UnexpectedTracerError` later. A block
    built its layers by a symbolic call, which left a graph tensor in the layer, and
    its next eager call failed with "... is out of scope". The first step now runs
    no such call: the layer keeps an eager tensor, as unwrapped. (Eagerly only: a
    layer keeping a tensor from a `tf.function` trace fails unwrapped too.)"""
    layer, twin = Remembers(), Remembers()
    block = RecomputeBlock(layer)
    xs = [normal((3, 5), seed=s) for s in range(2)]

    def run(fn, layer, x):
        with tf.GradientTape() as tape:
            outputs = fn(x, training=True)
            loss = _loss(outputs)
        return [outputs, tape.gradient(loss, layer.trainable_variables)]

    for x in xs:  # the first step builds, the second uses what the first kept
        assert_same_values(run(block, layer, x), run(twin, twin, x))


def test_jax_escaped_tracer_remat_where_a_symbolic_build_remains_the_error_is_clear():
    """JAX's `test_escaped_tracer_remat` expects an error naming the cause ("global
    state"). Building a block directly (`block.build(shape)`) still traces its
    layers symbolically; a tensor left on a layer by it is named there, not at the
    next call as TensorFlow's "... is out of scope"."""
    block = RecomputeBlock(Remembers(name="remembers"))
    with pytest.raises(ValueError, match=r"left graph tensors on them \(remembers\.first\)"):
        block.build((None, 5))
