"""recompute() and plan() on Sequential and Functional models."""

from __future__ import annotations

import functools
import math
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfrecompute
from tests import models_zoo
from tests.helpers import (
    MODES,
    applied_blocks,
    as_defined,
    assert_same_training,
    assert_same_values,
    forward_and_grads,
    load_state,
    recomputed_blocks,
    save_state,
)
from tfrecompute import RecomputeBlock, strategies
from tfrecompute.graph.layer_graph import LayerGraph

_blocks = applied_blocks


def _runtime(model):
    """The rebuilt model with blocks that a checkpointed model's call runs."""
    return tfrecompute.checkpoints(model).runtime


def _runs_its_blocks(model, inputs):
    """Whether a training call of the checkpointed model recomputes through its blocks."""
    x = list(inputs) if len(inputs) > 1 else inputs[0]

    def run():
        with tf.GradientTape():
            model(x, training=True)

    return recomputed_blocks(model, run) > 0


def _same_training(model, inputs, mode, atol=1e-5):
    """The checkpointed model against itself as defined: the same layers, no checkpoints."""

    def run(m):
        def fn(*xs, training=None):
            return m(list(xs) if len(xs) > 1 else xs[0], training=training)

        return fn

    assert _runs_its_blocks(model, inputs)
    assert_same_training(
        run(model),
        run(as_defined(model)),
        inputs,
        model.trainable_variables,
        model.non_trainable_variables,
        mode,
        atol=atol,
    )


def _trains_as_before_checkpointing(model, checkpoint, run, inputs):
    """`checkpoint()` changes no output, gradient or state update of a training call.

    `run(*inputs, training=True)` calls `model`; each step runs from the same
    state (Dropout seeds, BatchNorm statistics), eagerly and traced, first with the
    model as defined (before `checkpoint()`), then checkpointed, through its blocks.
    """
    state = model.non_trainable_variables
    initial = save_state(state)

    def steps():
        values, states = [], []
        for mode in MODES:
            load_state(state, initial)
            values.append(forward_and_grads(run, inputs, model.trainable_variables, mode))
            states.append(save_state(state))
        return values, states

    def train_call():
        with tf.GradientTape():
            run(*inputs, training=True)

    want_values, want_states = steps()
    checkpoint()
    blocks = _blocks(model)
    assert blocks and recomputed_blocks(model, train_call) == len(blocks)
    got_values, got_states = steps()
    assert_same_values(got_values, want_values, rtol=1e-6)
    assert_same_values(got_states, want_states, rtol=1e-6, what="state")


def _mlp(depth=8, width=32, dropout=True):
    return models_zoo.tanh_mlp(depth=depth, width=width, dropout=dropout)


def _x(shape, seed=0):
    return tf.constant(np.random.default_rng(seed).normal(size=shape).astype("float32"))


# ---------------------------------------------------------------- Sequential


@pytest.mark.parametrize("mode", MODES)
def test_sequential_sqrt_rewrite_matches_original(mode):
    model = _mlp()
    variables = [id(v) for v in model.variables]
    assert tfrecompute.recompute(model, "sqrt") is model
    assert isinstance(_runtime(model), keras.Sequential)  # a Sequential runs a Sequential
    blocks = _blocks(model)
    assert 2 <= len(blocks) <= len(model.layers)
    # The model is what it was: its layers, no blocks, the same variables.
    assert not any(isinstance(layer, RecomputeBlock) for layer in model.layers)
    assert [id(v) for v in model.variables] == variables
    assert {id(v) for v in _runtime(model).variables} == set(variables)
    _same_training(model, [_x((4, 32))], mode)


def test_rewrite_with_an_explicit_plan():
    model = _mlp(depth=3, dropout=False)
    chain = tfrecompute.profile(model, batch_size=8)
    plan = tfrecompute.strategies.Plan.from_segments(chain, [(0, 2)])
    tfrecompute.recompute(model, plan)
    assert tfrecompute.checkpoints(model).plan is plan
    assert [type(layer).__name__ for layer in _runtime(model).layers] == [
        "RecomputeBlock",
        "Dense",
        "Dense",
    ]
    assert [layer.name for layer in _blocks(model)[0].layers] == [
        model.layers[0].name,
        model.layers[1].name,
    ]


def test_a_strategy_callable_plans_the_rewrite():
    model = _mlp(depth=3, dropout=False)
    seen = []

    def first_two(chain, budget=None):
        seen.append((chain.n, budget))
        return strategies.Plan.from_segments(chain, [(0, 2)], strategy="first_two")

    plan = tfrecompute.plan(model, first_two, budget="1MiB", batch_size=8, headroom=0)
    assert plan.strategy == "first_two" and plan.segments == ((0, 2),)
    assert seen == [(4, 2**20)]
    tfrecompute.recompute(model, first_two)
    assert [type(layer).__name__ for layer in _runtime(model).layers] == [
        "RecomputeBlock",
        "Dense",
        "Dense",
    ]


def test_none_strategy_recomputes_nothing():
    model = _mlp(depth=3)
    assert tfrecompute.recompute(model, "none") is model
    assert _blocks(model) == [] and not tfrecompute.checkpoints(model)


def test_recompute_again_replaces_and_none_turns_it_off():
    model = _mlp(depth=6, dropout=False)
    x = _x((4, 32))
    want = model(x)
    before = tfrecompute.plan(model, "sqrt", batch_size=4)
    tfrecompute.recompute(model, "uniform:1")
    assert len(_blocks(model)) == 7 and "call" in vars(model)
    # A checkpointed model is planned as defined, not through its blocks.
    again = tfrecompute.plan(model, "sqrt", batch_size=4)
    assert again.chain.names == before.chain.names and again.segments == before.segments
    assert again.peak_bytes == before.peak_bytes
    tfrecompute.recompute(model, "uniform:3")
    assert len(_blocks(model)) == 3
    np.testing.assert_allclose(model(x), want, atol=1e-6)
    tfrecompute.recompute(model, "none")
    assert not tfrecompute.checkpoints(model) and "call" not in vars(model)
    np.testing.assert_allclose(model(x), want, atol=1e-6)


# ---------------------------------------------------------------- Functional


def _two_in_two_out():
    a = keras.Input((8,), name="a")
    b = keras.Input((4,), name="b")
    h = a
    for _ in range(6):
        h = keras.layers.Dense(8, activation="tanh")(h)
    shared = keras.layers.Dense(8)
    g = shared(keras.layers.Dense(8)(b))
    g = shared(g)  # a shared layer, called twice
    s = keras.layers.Concatenate()([h, g])
    return keras.Model({"a": a, "b": b}, {"main": keras.layers.Dense(2)(s), "aux": g})


def test_functional_multi_io_and_shared_layer():
    model = _two_in_two_out()
    graph = LayerGraph.of(model)
    assert "dense_shared" not in graph.names  # names are unique per call
    assert len(graph.names) == len(set(graph.names))
    x = {"a": _x((3, 8)), "b": _x((3, 4), seed=1)}

    def run(*xs, training=None):
        return model(dict(zip(("a", "b"), xs)), training=training)

    checkpoint = functools.partial(tfrecompute.recompute, model, "sqrt")
    _trains_as_before_checkpointing(model, checkpoint, run, [x["a"], x["b"]])


def _train_two_in_two_out(model, mode):
    def run(m):
        def fn(a, b, training=None):
            return m({"a": a, "b": b}, training=training)

        return fn

    inputs = [_x((3, 8)), _x((3, 4), seed=1)]
    assert _runs_its_blocks(model, [{"a": inputs[0], "b": inputs[1]}])
    assert_same_training(
        run(model),
        run(as_defined(model)),
        inputs,
        model.trainable_variables,
        [],
        mode,
    )


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "where",
    ["sqrt", "first call only", "second call only", "both in one block", "one in each block"],
)
def test_shared_layer_trains_like_the_original(mode, where):
    """A layer called twice, with its calls in one block, in two, or one in a block."""
    model = _two_in_two_out()
    chain = tfrecompute.profile(model, batch_size=3)
    # A layer's second call is named "<layer>#1" (names are unique per call).
    second = next(i for i, name in enumerate(chain.names) if "#1" in name)
    first = chain.names.index(chain.names[second].split("#")[0])
    assert first < second - 1
    segments = {
        "sqrt": None,
        "first call only": [(first - 1, first + 1)],
        "second call only": [(second, second + 1)],
        "both in one block": [(first, second + 1)],
        "one in each block": [(first, first + 1), (second, second + 1)],
    }[where]
    plan = "sqrt" if segments is None else strategies.Plan.from_segments(chain, segments)
    tfrecompute.recompute(model, plan)
    _train_two_in_two_out(model, mode)


@pytest.mark.parametrize("mode", MODES)
def test_functional_gradients_with_every_segment(mode):
    model = _two_in_two_out()
    graph = LayerGraph.of(model)
    chain = tfrecompute.profile(model, batch_size=3)
    plan = tfrecompute.strategies.Plan.from_segments(chain, [(0, len(graph))])
    tfrecompute.recompute(model, plan)
    _train_two_in_two_out(model, mode)


def _nested():
    inner_in = keras.Input((8,))
    hidden = keras.layers.Dense(8, activation="relu")(inner_in)
    inner = keras.Model(inner_in, keras.layers.Dropout(0.3)(hidden), name="inner")
    x_in = keras.Input((8,))
    h = x_in
    for _ in range(4):
        h = inner(keras.layers.Dense(8)(h))  # one nested model, called 4 times
    return keras.Model(x_in, keras.layers.Dense(2)(h))


def test_nested_functional_model_as_a_layer():
    model = _nested()
    checkpoint = functools.partial(tfrecompute.recompute, model, "sqrt")
    _trains_as_before_checkpointing(model, checkpoint, model, [_x((2, 8))])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("segments", [None, [(1, 2)], [(0, 3), (5, 8)]])
def test_nested_functional_model_trains_like_the_original(mode, segments):
    """With depth=0 the nested model (with Dropout) is one link per call, in blocks or not."""
    model = _nested()
    chain = tfrecompute.profile(model, batch_size=4, depth=0)
    assert [name.split("#")[0] for name in chain.names[1::2]] == ["inner"] * 4
    plan = "sqrt" if segments is None else strategies.Plan.from_segments(chain, segments)
    tfrecompute.recompute(model, plan)
    _same_training(model, [_x((4, 8))], mode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("segments", [None, [(1, 3)], [(0, 4), (6, 11)]])
def test_a_nested_functional_model_is_inlined(mode, segments):
    """By default the nested model's calls are links: blocks may start and end inside it."""
    model = _nested()
    chain = tfrecompute.profile(model, batch_size=4)
    # 4 x (Dense, then the nested Dense and Dropout), then the head.
    assert chain.names[1].startswith("inner/dense") and chain.names[2].startswith("inner/dropout")
    assert sum(name.startswith("inner/") for name in chain.names) == 8
    plan = "sqrt" if segments is None else strategies.Plan.from_segments(chain, segments)
    tfrecompute.recompute(model, plan)
    assert not any(layer.name == "inner" for layer in _runtime(model).layers)
    _same_training(model, [_x((4, 8))], mode)


@pytest.mark.parametrize("mode", MODES)
def test_keras_ops_in_a_functional_model(mode):
    """`keras.ops` functions on symbolic tensors are nodes too, without weights."""
    inputs = keras.Input((8,))
    h = inputs
    for _ in range(4):
        z = keras.layers.Dense(8)(h)
        h = keras.ops.add(h, keras.ops.tanh(z))  # a residual written with keras.ops
        h = keras.layers.Dropout(0.2)(h)
    model = keras.Model(inputs, keras.ops.mean(keras.layers.Dense(3)(h), axis=-1, keepdims=True))
    assert sum(name.startswith(("add", "tanh")) for name in LayerGraph.of(model).names) == 8
    chain = tfrecompute.profile(model, batch_size=4)
    assert sum(chain.applied_grad_bytes) == sum(
        math.prod(v.shape) * 4 for v in model.trainable_variables
    )
    tfrecompute.recompute(model, "sqrt")
    _same_training(model, [_x((4, 8))], mode)


def _masked_sequence_model():
    tokens = keras.Input((6,), dtype="int32")
    h = keras.layers.Embedding(20, 8, mask_zero=True)(tokens)  # id 0 is padding
    h = keras.layers.Dense(8, activation="tanh")(h)  # passes the mask on
    h = keras.layers.LSTM(8, return_sequences=True)(h)  # reads the mask
    h = keras.layers.Dense(8, activation="tanh")(h)
    h = keras.layers.MultiHeadAttention(2, 4)(h, h)  # masks its query and value
    h = keras.layers.LSTM(8)(h)
    return keras.Model(tokens, keras.layers.Dense(3)(h))


def _masked_sequential():
    return keras.Sequential(
        [
            keras.Input((6,), dtype="int32"),
            keras.layers.Embedding(20, 8, mask_zero=True),
            keras.layers.Dense(8, activation="tanh"),
            keras.layers.LSTM(8, return_sequences=True),
            keras.layers.Dense(8, activation="tanh"),
            keras.layers.LSTM(8),
            keras.layers.Dense(3),
        ]
    )


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("segments", [None, [(1, 3)], [(2, 6)]])
@pytest.mark.parametrize("build", [_masked_sequence_model, _masked_sequential])
def test_keras_masks_cross_the_rewrite(mode, segments, build):
    """Padding masks reach the layers inside blocks and after them.

    The graph of either kind of model holds the op that computes the mask
    (`not_equal`) as a node; a Sequential rewrite leaves it to the Sequential.
    """
    model = build()
    chain = tfrecompute.profile(model, batch_size=3)
    plan = "sqrt" if segments is None else strategies.Plan.from_segments(chain, segments)
    tfrecompute.recompute(model, plan)
    tokens = tf.constant([[3, 5, 7, 0, 0, 0], [1, 2, 3, 4, 5, 6], [9, 0, 0, 0, 0, 0]])
    # The mask matters: the same tokens with other padding ids give other outputs.
    unmasked = model(tf.where(tokens == 0, 11, tokens))
    assert not np.allclose(model(tokens), unmasked, atol=1e-4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _same_training(model, [tokens], mode)
    # Keras's "will destroy the mask" warning is wrong for the blocks' sub-models.
    assert not [w for w in caught if "mask attached" in str(w.message)]


def test_long_skips_go_around_blocks():
    model = models_zoo.unet(size=16, depth=2)
    graph = LayerGraph.of(model)
    concat = next(i for i, name in enumerate(graph.names) if name.startswith("concatenate"))
    # A segment over the bottom of the U keeps the outer skip out of its block.
    inputs, outputs = graph.segment_io(concat - 3, concat + 1)
    assert len(outputs) == 1
    assert len(inputs) == 2


def test_a_subclassed_model_needs_a_sample():
    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(2)

        def call(self, x):
            return self.dense(x)

    net = Net()
    net(tf.ones((1, 2)))
    with pytest.raises(ValueError, match=r"recompute: a subclassed or unbuilt model.*sample="):
        tfrecompute.recompute(net)
    assert tfrecompute.recompute(net, sample=np.ones((4, 2), "float32")) is net


def test_unbuilt_model_is_rejected():
    model = keras.Sequential([keras.layers.Dense(2)])
    with pytest.raises(ValueError, match=r"plan: the model is not built"):
        tfrecompute.plan(model)


def test_budget_needs_a_batch_size():
    with pytest.raises(ValueError, match=r"recompute: a memory budget needs the batch size"):
        tfrecompute.recompute(_mlp(depth=2), "optimal", budget="1MiB")


def test_a_model_budget_leaves_headroom_for_the_allocator():
    model = _mlp(depth=8, width=64)
    model.compile(optimizer="sgd", loss="mse")  # updates in place: activations set the peak
    chain = tfrecompute.profile(model, batch_size=64)
    budget = (strategies.min_peak(chain) + strategies.simulate(chain, []).peak_bytes) // 2
    default = tfrecompute.plan(model, "optimal", budget=budget, batch_size=64)
    assert default.peak_bytes <= (1 - strategies.DEFAULT_HEADROOM) * budget
    assert default == strategies.optimal(
        chain, budget=int(budget * (1 - strategies.DEFAULT_HEADROOM))
    )
    none = tfrecompute.plan(model, "optimal", budget=budget, batch_size=64, headroom=0)
    assert none == strategies.optimal(chain, budget=budget)
    assert none.recompute_cost < default.recompute_cost  # the headroom is paid in recompute


def test_infeasible_model_budget_names_the_least_budget_with_headroom():
    model = _mlp(depth=4, width=64)
    least = strategies.min_peak(tfrecompute.profile(model, batch_size=64))
    with pytest.raises(
        strategies.InfeasibleBudgetError, match=r"^recompute: the plan must fit"
    ) as info:
        tfrecompute.recompute(model, "optimal", budget=least, batch_size=64, headroom=0.5)
    assert info.value.minimum == 2 * least and info.value.budget == least
    tfrecompute.plan(model, "optimal", budget=2 * least, batch_size=64, headroom=0.5)
    with pytest.raises(strategies.InfeasibleBudgetError):
        tfrecompute.plan(model, "optimal", budget=2 * least - 1, batch_size=64, headroom=0.5)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"headroom": 0.2}, ValueError, r"^plan: headroom only applies to a budget"),
        ({"budget": "1MiB", "headroom": 1.0}, ValueError, r"^plan: headroom must be in \[0, 1\)"),
        ({"budget": "1MiB", "headroom": float("nan")}, ValueError, r"headroom must be in"),
        ({"budget": "1MiB", "headroom": "0.2"}, TypeError, r"^plan: headroom must be a real"),
        ({"budget": "1MiB", "headroom": True}, TypeError, r"headroom must be a real number"),
    ],
)
def test_bad_headroom(kwargs, error, match):
    with pytest.raises(error, match=match):
        tfrecompute.plan(_mlp(depth=2), "optimal", batch_size=8, **kwargs)


def test_headroom_with_a_plan_is_rejected():
    model = _mlp(depth=2)
    plan = tfrecompute.plan(model, "sqrt")
    with pytest.raises(
        ValueError, match=r"^recompute: a Plan already fixes the segments, so a headroom"
    ):
        tfrecompute.recompute(model, plan, headroom=0.1)


@pytest.mark.parametrize(
    ("batch_size", "error", "what"),
    [(0, ValueError, "at least 1"), (-3, ValueError, "at least 1"), (2.5, TypeError, "an int"),
     (True, TypeError, "an int")],
)  # fmt: skip
def test_bad_batch_size(batch_size, error, what):
    with pytest.raises(error, match=rf"profile: `batch_size` must be {what}"):
        tfrecompute.profile(_mlp(depth=2), batch_size=batch_size)


def test_plan_for_another_model_is_rejected():
    plan = tfrecompute.plan(_mlp(depth=2), "sqrt")
    with pytest.raises(
        ValueError, match=r"the plan was made for another model: its chain has \d+ links"
    ):
        tfrecompute.recompute(_mlp(depth=5), plan)


def test_unknown_strategy_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"optimal"):
        tfrecompute.recompute(_mlp(depth=2), "fastest")


# ------------------------------------------------------------ profile once


@pytest.fixture
def profiles(monkeypatch):
    """Counts the model profiles run (each traces every call of the model once)."""
    import tfrecompute.costs.profile

    count = {"profiles": 0}
    traced = tfrecompute.costs.profile._call_memories

    def counting(*args, **kwargs):
        count["profiles"] += 1
        return traced(*args, **kwargs)

    monkeypatch.setattr(tfrecompute.costs.profile, "_call_memories", counting)
    return count


def test_plan_then_recompute_profiles_once(profiles):
    model = _mlp(depth=4)
    plan = tfrecompute.plan(model, "optimal", budget="1GiB", batch_size=32)
    tfrecompute.recompute(model, plan)
    assert profiles["profiles"] == 1
    assert _blocks(model) or not plan.segments


def test_a_plan_on_a_profiled_chain_is_applied_without_profiling_again(profiles):
    model = _mlp(depth=4)
    chain = tfrecompute.profile(model, batch_size=32)
    plan = strategies.optimal(chain)
    assert plan.segments
    tfrecompute.recompute(model, plan)
    assert profiles["profiles"] == 1
    assert len(_blocks(model)) == len(plan.segments)


def test_a_plan_for_another_model_object_is_matched_by_profiling_it(profiles):
    model = _mlp(depth=4)
    twin = keras.models.clone_model(model)  # same layer names, other objects
    plan = tfrecompute.plan(model, "sqrt")
    assert tfrecompute.recompute(twin, plan) is twin
    assert profiles["profiles"] == 2
    assert not tfrecompute.checkpoints(model)  # only the twin is checkpointed
    assert {id(v) for v in _runtime(twin).trainable_variables} == {
        id(v) for v in twin.trainable_variables
    }


# ------------------------------------------------------------------ losses


class LossInCall(keras.layers.Layer):
    """Adds a loss in its own `call`, as research code does."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(8, activation="tanh")

    def call(self, x):
        y = self.dense(x)
        self.add_loss(0.1 * tf.reduce_sum(y * y))
        return y


class LossyNet(keras.Model):
    def __init__(self):
        super().__init__()
        self.first = keras.layers.Dense(8, activity_regularizer=keras.regularizers.L2(0.1))
        self.second = LossInCall()
        self.head = keras.layers.Dense(1)

    def call(self, x):
        return self.head(self.second(self.first(x)))


def _lossy_functional():
    inputs = keras.Input((4,))
    h = keras.layers.Dense(8, activity_regularizer=keras.regularizers.L2(0.1))(inputs)
    h = LossInCall()(h)
    h = keras.layers.Dense(8, activation="tanh")(h)
    return keras.Model(inputs, keras.layers.Dense(1)(h))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["subclassed", "functional"])
def test_losses_made_inside_checkpointed_calls_count_once(kind, mode):
    """`add_loss` in a layer's call and activity regularizers reach `model.losses`
    once per call, with their gradients, whether the call is checkpointed where its
    code makes it (subclassed) or inside a rebuilt model's block (functional)."""
    model = LossyNet() if kind == "subclassed" else _lossy_functional()
    x = _x((4, 4))
    model(x)
    strategy = "uniform:1" if kind == "subclassed" else "uniform:2"
    tfrecompute.recompute(model, strategy, sample=np.asarray(x))
    assert _runs_its_blocks(model, [x])

    def step(run):
        def fn():
            with tf.GradientTape() as tape:
                y = run(x, training=True)
                losses = list(model.losses)
                total = tf.add_n(losses) + tf.reduce_sum(y)
            return [len(losses), total, *tape.gradient(total, model.trainable_variables)]

        return tf.function(fn) if mode == "function" else fn

    got, want = step(model)(), step(as_defined(model))()
    assert int(got[0]) == int(want[0]) == 2
    for a, b in zip(got[1:], want[1:]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
