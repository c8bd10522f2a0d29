"""profile(): the cost chain of Sequential and Functional models."""

from __future__ import annotations

import dataclasses

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfrecompute
from tests import models_zoo
from tests.helpers import MODES, assert_same_values, forward_and_grads, highest_requested_trace
from tfrecompute import strategies


def _mlp(depth=8, width=32, dropout=True):
    return models_zoo.tanh_mlp(depth=depth, width=width, dropout=dropout)


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
    # NOTE [ Which gradients exist ] in costs/profile.py: nothing upstream of the
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
    assert chain.applied_grad_bytes[wide] == (64 * 512 + 512) * 4
    assert chain.applied_grad_bytes[conv] == (5 * 512 * 64 + 64) * 4
    assert chain.workspace_bytes[wide] < 1024  # input gradient 32 KiB, kernel's 128 KiB
    assert chain.workspace_bytes[conv] < 1024  # input gradient 256 KiB, kernel's 640 KiB
    assert chain.workspace_bytes[attention] >= 8 * 4 * 16 * 16 * 4  # the scores' gradient


@pytest.mark.parametrize("clipnorm", [None, 1.0])
def test_parameter_gradients_follow_the_optimizer(clipnorm):
    """NOTE [ Parameter gradients ] in costs/optimizer.py: 8 Dense(2048), 128 MiB of weights.

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
        # worth, the high end alone; under a second process's load one more
        # can be in flight.
        assert predicted >= 0.75 * measured, (predicted, measured)
    else:
        assert measured > weights
        assert abs(predicted / measured - 1) <= 0.15, (predicted, measured)


def test_the_optimizer_to_model_is_an_explicit_keyword():
    model = _mlp(depth=2, dropout=False)
    clipping = keras.optimizers.SGD(global_clipnorm=1.0)
    applied = tfrecompute.profile(model, batch_size=8)  # not compiled: Adam, applied as computed
    assert not any(applied.kept_grad_bytes) and any(applied.applied_grad_bytes)
    assert applied.applied_workspace_bytes > 0  # Adam's temporaries
    kept = tfrecompute.profile(model, batch_size=8, optimizer=clipping)
    assert kept.kept_grad_bytes == applied.applied_grad_bytes
    assert not any(kept.applied_grad_bytes) and kept.update_workspace_bytes > 0
    model.compile(optimizer=clipping, loss="mse")  # the default follows the compiled optimizer
    assert tfrecompute.profile(model, batch_size=8) == kept
    nothing = tfrecompute.profile(model, batch_size=8, optimizer=None)  # no updates modelled
    assert nothing == dataclasses.replace(applied, applied_workspace_bytes=0)


def test_the_recompute_copies_its_input():
    """NOTE [ The recompute's input copy ] in costs/profile.py, on a small CNN.

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
    tfrecompute.recompute(model, plan)
    model.compile(optimizer="sgd", loss="mse")
    x = np.random.default_rng(0).random((64, 32, 32, 3), dtype=np.float32)
    y = np.zeros((64, 10), dtype=np.float32)
    # The median of 5 traced steps: the inter-op order moves single steps both ways.
    peaks = sorted(
        tfrecompute.trace_step(model, x, y, warmup=1).requested_peak_bytes for _ in range(5)
    )
    measured = peaks[2]
    assert abs(plan.peak_bytes / measured - 1) <= 0.15, (plan.peak_bytes, peaks)
    assert measured > without + activation // 4, (without, peaks)


class AnchorHead(keras.layers.Layer):
    """Returns a constant made eagerly before any trace beside its output (D-FINE's anchors)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.anchors = tf.constant(np.linspace(0.0, 1.0, 8, dtype="float32"))

    def call(self, x):
        return x * 2.0, self.anchors


class Detector(keras.Model):
    def __init__(self):
        super().__init__()
        self.body = [keras.layers.Dense(8, activation="gelu") for _ in range(4)]
        self.head = AnchorHead()

    def call(self, x):
        for layer in self.body:
            x = layer(x)
        y, anchors = self.head(x)
        return y + anchors


@pytest.mark.parametrize("mode", MODES)
def test_a_call_returning_an_eager_constant_is_profiled_and_checkpointed(mode):
    """A layer returning a tensor made eagerly (no op in the traced graph) is priced
    as keeping nothing for it; checkpointed, the model's gradients are the plain one's."""
    keras.utils.set_random_seed(0)
    model = Detector()
    x = np.random.default_rng(0).normal(size=(4, 8)).astype("float32")
    model(x)
    chain = tfrecompute.profile(model, sample=x)
    assert chain.n == 5 and chain.names[-1].startswith("anchor_head")
    want = forward_and_grads(model, [tf.constant(x)], model.trainable_variables, mode)
    tfrecompute.recompute(model, "sqrt", sample=x)
    assert tfrecompute.checkpoints(model).blocks
    got = forward_and_grads(model, [tf.constant(x)], model.trainable_variables, mode)
    assert_same_values(got, want)  # to each tensor's scale: oneDNN's kernels round differently
