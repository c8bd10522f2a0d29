"""recompute(), plan() and profile() on Sequential and Functional models."""

from __future__ import annotations

import dataclasses
import math
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfrecompute
from tests import models_zoo
from tests.helpers import MODES, assert_same_training, highest_requested_trace
from tfrecompute import RecomputeBlock, strategies
from tfrecompute.graph import LayerGraph


def _blocks(model):
    return [layer for layer in model.layers if isinstance(layer, RecomputeBlock)]


def _same_training(model, rewritten, inputs, mode, atol=1e-5):
    def run(m):
        def fn(*xs, training=None):
            return m(list(xs) if len(xs) > 1 else xs[0], training=training)

        return fn

    assert_same_training(
        run(rewritten),
        run(model),
        inputs,
        model.trainable_variables,
        model.non_trainable_variables,
        mode,
        atol=atol,
    )


def _mlp(depth=8, width=32, dropout=True):
    layers = []
    for _ in range(depth):
        layers.append(keras.layers.Dense(width, activation="tanh"))
        if dropout:
            layers.append(keras.layers.Dropout(0.2))
    return keras.Sequential([keras.Input((width,)), *layers, keras.layers.Dense(3)])


def _x(shape, seed=0):
    return tf.constant(np.random.default_rng(seed).normal(size=shape).astype("float32"))


# ---------------------------------------------------------------- Sequential


@pytest.mark.parametrize("mode", MODES)
def test_sequential_sqrt_rewrite_matches_original(mode):
    model = _mlp()
    rewritten = tfrecompute.recompute(model, "sqrt")
    assert isinstance(rewritten, keras.Sequential)
    blocks = _blocks(rewritten)
    assert 2 <= len(blocks) <= len(model.layers)
    # The rewrite shares the original's variables: no copies.
    ids = {id(v) for v in model.trainable_variables}
    assert {id(v) for v in rewritten.trainable_variables} == ids
    _same_training(model, rewritten, [_x((4, 32))], mode)


def test_rewrite_with_an_explicit_plan():
    model = _mlp(depth=3, dropout=False)
    chain = tfrecompute.profile(model, batch_size=8)
    plan = tfrecompute.strategies.Plan.from_segments(chain, [(0, 2)])
    rewritten = tfrecompute.recompute(model, plan)
    assert [type(layer).__name__ for layer in rewritten.layers] == [
        "RecomputeBlock",
        "Dense",
        "Dense",
    ]
    assert [layer.name for layer in _blocks(rewritten)[0].layers] == [
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
    rewritten = tfrecompute.recompute(model, first_two)
    assert [type(layer).__name__ for layer in rewritten.layers] == [
        "RecomputeBlock",
        "Dense",
        "Dense",
    ]


def test_none_strategy_recomputes_nothing():
    model = _mlp(depth=3)
    assert _blocks(tfrecompute.recompute(model, "none")) == []


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
    rewritten = tfrecompute.recompute(model, "sqrt")
    assert _blocks(rewritten)
    x = {"a": _x((3, 8)), "b": _x((3, 4), seed=1)}
    for key in ("main", "aux"):
        np.testing.assert_allclose(rewritten(x)[key], model(x)[key], atol=1e-6)


def _train_two_in_two_out(model, rewritten, mode):
    def run(m):
        def fn(a, b, training=None):
            return m({"a": a, "b": b}, training=training)

        return fn

    assert_same_training(
        run(rewritten),
        run(model),
        [_x((3, 8)), _x((3, 4), seed=1)],
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
    rewritten = tfrecompute.recompute(model, plan)
    assert _blocks(rewritten)
    _train_two_in_two_out(model, rewritten, mode)


@pytest.mark.parametrize("mode", MODES)
def test_functional_gradients_with_every_segment(mode):
    model = _two_in_two_out()
    graph = LayerGraph.of(model)
    chain = tfrecompute.profile(model, batch_size=3)
    plan = tfrecompute.strategies.Plan.from_segments(chain, [(0, len(graph))])
    _train_two_in_two_out(model, tfrecompute.recompute(model, plan), mode)


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
    rewritten = tfrecompute.recompute(model, "sqrt")
    assert _blocks(rewritten)
    x = _x((2, 8))
    np.testing.assert_allclose(rewritten(x), model(x), atol=1e-6)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("segments", [None, [(1, 2)], [(0, 3), (5, 8)]])
def test_nested_functional_model_trains_like_the_original(mode, segments):
    """The nested model (with Dropout) is one link per call, inside blocks or not."""
    model = _nested()
    chain = tfrecompute.profile(model, batch_size=4)
    assert [name.split("#")[0] for name in chain.names[1::2]] == ["inner"] * 4
    plan = "sqrt" if segments is None else strategies.Plan.from_segments(chain, segments)
    rewritten = tfrecompute.recompute(model, plan)
    assert _blocks(rewritten)
    _same_training(model, rewritten, [_x((4, 8))], mode)


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
    assert sum(chain.update_grad_bytes) == sum(
        math.prod(v.shape) * 4 for v in model.trainable_variables
    )
    rewritten = tfrecompute.recompute(model, "sqrt")
    assert _blocks(rewritten)
    _same_training(model, rewritten, [_x((4, 8))], mode)


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
    rewritten = tfrecompute.recompute(model, plan)
    assert _blocks(rewritten)
    tokens = tf.constant([[3, 5, 7, 0, 0, 0], [1, 2, 3, 4, 5, 6], [9, 0, 0, 0, 0, 0]])
    # The mask matters: the same tokens with other padding ids give other outputs.
    unmasked = model(tf.where(tokens == 0, 11, tokens))
    assert not np.allclose(model(tokens), unmasked, atol=1e-4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _same_training(model, rewritten, [tokens], mode)
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


def test_subclassed_model_is_rejected():
    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(2)

        def call(self, x):
            return self.dense(x)

    net = Net()
    net(tf.ones((1, 2)))
    with pytest.raises(
        TypeError, match=r"recompute: a subclassed model cannot be traced.*RecomputeBlock"
    ):
        tfrecompute.recompute(net)


def test_unbuilt_model_is_rejected():
    model = keras.Sequential([keras.layers.Dense(2)])
    with pytest.raises(ValueError, match=r"plan: the model is not built"):
        tfrecompute.plan(model)


def test_budget_needs_a_batch_size():
    with pytest.raises(ValueError, match=r"recompute: a memory budget needs the batch size"):
        tfrecompute.recompute(_mlp(depth=2), "optimal", budget="1MiB")


def test_a_model_budget_leaves_headroom_for_the_allocator():
    model = _mlp(depth=8, width=64)
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


@pytest.mark.parametrize("batch_size", [0, -3, 2.5, True])
def test_bad_batch_size(batch_size):
    with pytest.raises(ValueError, match=r"profile: `batch_size` must be a positive integer"):
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


# ------------------------------------------------------------------ profile


def test_profile_counts_bytes_from_shapes_and_dtypes():
    model = _mlp(depth=2, dropout=True)
    chain = tfrecompute.profile(model, batch_size=16)
    assert chain.names == tuple(layer.name for layer in model.layers)
    assert chain.input_bytes == 16 * 32 * 4
    assert chain.output_bytes[0] == 16 * 32 * 4
    # A Dropout keeps its boolean mask (1 byte per element) for its backward.
    assert chain.saved_bytes[1] == chain.output_bytes[1] + 16 * 32
    # Dense(tanh) keeps only its output (tanh's gradient reads it).
    assert chain.saved_bytes[0] == chain.output_bytes[0]
    assert chain.forward_cost[0] == pytest.approx(2 * (32 * 32 + 32) * 16)


def test_profile_counts_only_gradients_that_exist():
    # NOTE [ Which gradients exist ] in models.py: nothing upstream of the
    # first trainable variable has a gradient (the input, its rescaling).
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Rescaling(0.5),
            keras.layers.Dense(8),
            keras.layers.Dense(4),
        ]
    )
    chain = tfrecompute.profile(model, batch_size=16)
    assert len(chain.names) == 3
    assert chain.input_grad_bytes == (0, 0, 16 * 8 * 4)


def test_profile_has_no_gradient_for_frozen_layers_or_integer_ids():
    frozen = keras.layers.Dense(8, activation="relu", trainable=False)
    model = keras.Sequential([keras.Input((8,)), frozen, keras.layers.Dense(4, activation="relu")])
    assert tfrecompute.profile(model, batch_size=16).input_grad_bytes == (0, 0)
    ids = keras.Input((6,), dtype="int32")
    hidden = keras.layers.Embedding(10, 4)(ids)
    model = keras.Model(ids, keras.layers.Dense(2, activation="relu")(hidden))
    # The embedding's input is integer ids; the Dense's input has a gradient.
    assert tfrecompute.profile(model, batch_size=16).input_grad_bytes == (0, 16 * 6 * 4 * 4)


def test_profile_input_gradient_of_a_link_that_skips_its_chain_input():
    # NOTE [ A link that skips its chain input ]: the shortcut reads `h`, not the
    # main path's output `m`, which only the Add reads.
    inputs = keras.Input((8,))
    h = keras.layers.Dense(8, name="h")(inputs)
    # ReLU's backward reads its output, so each call is a link of its own.
    m = keras.layers.Dense(16, activation="relu", name="main")(h)
    s = keras.layers.Dense(16, activation="relu", name="shortcut")(h)
    model = keras.Model(inputs, keras.layers.Add(name="add")([m, s]))
    chain = tfrecompute.profile(model, batch_size=4)
    assert chain.names == ("h", "main", "shortcut", "add")
    row = 4 * 4  # bytes of one feature for the batch
    assert chain.output_bytes == (8 * row, 16 * row, 16 * row, 16 * row)
    # x_2 is `main`'s output: the shortcut reads none of it. x_3 is the
    # shortcut's output, which the Add reads.
    assert chain.input_grad_bytes == (0, 8 * row, 0, 16 * row)
    # `h` (read by the shortcut) and `main` (read by the Add) are carries with
    # gradients: 8 * row from the shortcut's backward, 16 * row from the Add's.
    assert chain.carry_grads == ((0, 2, 8 * row), (1, 3, 16 * row))


def test_profile_halves_bytes_under_a_16_bit_policy():
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        model = _mlp(depth=2, dropout=False)
    finally:
        keras.config.set_dtype_policy("float32")
    chain = tfrecompute.profile(model, batch_size=16)
    assert chain.output_bytes[0] == 16 * 32 * 2


def test_workspace_leaves_out_the_weight_gradients():
    """A link's gradients are counted once, as gradients, not also as workspace.

    Neither the weights' gradients nor the input gradient, which the Dense
    (on 3-D inputs) and the Conv1D make in another shape and reshape, are
    workspace; what is left there is shape bookkeeping. Attention's
    workspace is what else its backward makes: the scores' gradients, of
    shape (batch, heads, query, key).
    """
    tokens = keras.Input((16, 64))
    h = keras.layers.Dense(512, name="wide")(tokens)  # 128 KiB of kernel gradient
    h = keras.layers.Conv1D(64, 5, padding="same", name="conv")(h)  # 640 KiB
    h = keras.layers.MultiHeadAttention(4, 16, name="attention")(h, h)
    model = keras.Model(tokens, h)
    chain = tfrecompute.profile(model, batch_size=8)
    links = {name: i for i, name in enumerate(chain.names)}
    wide, conv, attention = links["wide"], links["conv"], links["attention"]
    assert chain.update_grad_bytes[wide] == (64 * 512 + 512) * 4
    assert chain.update_grad_bytes[conv] == (5 * 512 * 64 + 64) * 4
    assert chain.workspace_bytes[wide] < 1024  # input gradient 32 KiB, kernel's 128 KiB
    assert chain.workspace_bytes[conv] < 1024  # input gradient 256 KiB, kernel's 640 KiB
    assert chain.workspace_bytes[attention] >= 8 * 4 * 16 * 16 * 4  # the scores' gradient


@pytest.mark.parametrize("clipnorm", [None, 1.0])
def test_parameter_gradients_follow_the_optimizer(clipnorm):
    """NOTE [ Parameter gradients ] in models.py: 8 Dense(2048), 128 MiB of weights.

    Without global clipping each variable is updated as soon as its gradient
    exists, so few gradients are alive at once; with it, all of them are
    kept until the step's end. The predicted peak follows both. Compared with
    the requested peak of traced steps (`trace_step`), which leaves out the
    allocator's rounding of chunks.
    """
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((2048,)), *[keras.layers.Dense(2048) for _ in range(8)]])
    model.compile(optimizer=keras.optimizers.SGD(global_clipnorm=clipnorm), loss="mse")
    x = np.random.default_rng(0).random((64, 2048), dtype=np.float32)
    measured = highest_requested_trace(model, x, x).requested_peak_bytes
    predicted = tfrecompute.plan(model, "none", batch_size=64).peak_bytes
    weights = 8 * 2049 * 2048 * 4
    if clipnorm is None:
        assert measured < 0.6 * weights
        assert predicted < 0.6 * weights
        # How many gradients are in flight depends on the order the two
        # inter-op threads run ops in; the prediction assumes three links'
        # worth, the high end.
        assert predicted >= 0.85 * measured, (predicted, measured)
    else:
        assert measured > weights
        assert abs(predicted / measured - 1) <= 0.15, (predicted, measured)


def test_the_recompute_copies_its_input():
    """NOTE [ The recompute's input copy ] in models.py, on a small CNN.

    A block over [conv, pool, conv] in the middle of 8 convolutions (8 MiB
    activations) recomputes from a copy of its 8 MiB input, alive through
    its backward: the requested peak of traced steps matches the prediction
    with the copy, and is above the prediction without it by at least a
    quarter of the copy (not always all of it: how long the copy overlaps
    the rest, and the rest itself, depend on the order the inter-op threads
    run ops in).
    """
    keras.utils.set_random_seed(0)
    layers = [keras.Input((32, 32, 3))]
    for channels in (32, 64):
        layers += [
            keras.layers.Conv2D(channels, 3, padding="same", activation="relu") for _ in range(4)
        ]
        layers.append(keras.layers.MaxPooling2D())
    model = keras.Sequential(
        [*layers, keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(10)]
    )
    chain = tfrecompute.profile(model, batch_size=64)
    activation = 64 * 32 * 32 * 32 * 4
    assert chain.input_copy_bytes[0] == 64 * 32 * 32 * 3 * 4  # the model's input
    assert chain.input_copy_bytes[3] == activation
    plan = strategies.Plan.from_segments(chain, [(3, 6)])
    uncopied = dataclasses.replace(chain, input_copy_bytes=(0,) * chain.n)
    without = strategies.simulate(uncopied, [(3, 6)]).peak_bytes
    assert plan.peak_bytes > without + activation // 2
    rewritten = tfrecompute.recompute(model, plan)
    rewritten.compile(optimizer="sgd", loss="mse")
    x = np.random.default_rng(0).random((64, 32, 32, 3), dtype=np.float32)
    y = np.zeros((64, 10), dtype=np.float32)
    # The median of 5 traced steps: the inter-op order moves single steps both ways.
    peaks = sorted(
        tfrecompute.trace_step(rewritten, x, y, warmup=1).requested_peak_bytes for _ in range(5)
    )
    measured = peaks[2]
    assert abs(plan.peak_bytes / measured - 1) <= 0.15, (plan.peak_bytes, peaks)
    assert measured > without + activation // 4, (without, peaks)
