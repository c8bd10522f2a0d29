"""The debug mode that checks each recompute against the forward."""

from __future__ import annotations

import keras
import pytest
import tensorflow as tf

from tests.helpers import MODES, apply_in_order, assert_same_training, normal
from tfrecompute import RecomputeBlock
from tfrecompute.layers import RecomputeMismatchError, debug_enabled, set_debug
from tfrecompute.layers.debug import CHECK_SCOPE


class ShapeFromCounter(keras.layers.Layer):
    """Output width alternates with a Python call counter: 2 in the forward, 1 in the recompute."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.calls = 0

    def call(self, x):
        self.calls += 1
        return x[:, : 1 + self.calls % 2]


class ValueFromCounter(keras.layers.Layer):
    """Scales by a Python call counter: silently wrong gradients without debug mode."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.calls = 0

    def call(self, x):
        self.calls += 1
        return x * float(self.calls)


def _step(block, mode):
    def step(x):
        with tf.GradientTape() as tape:
            y = block(x, training=True)
        return tape.gradient(y, block.trainable_variables)

    # autograph=False keeps the exception type (see README, "Limits").
    return tf.function(step, autograph=False) if mode == "function" else step


def _block(layer, **kwargs):
    block = RecomputeBlock([keras.layers.Dense(4), layer], **kwargs)
    block.build((None, 4))
    return block


@pytest.mark.parametrize("mode", MODES)
def test_debug_mode_passes_normal_layers(mode):
    layers = [
        keras.layers.Dense(8, activation="relu"),
        keras.layers.Dropout(0.4, seed=1),
        keras.layers.BatchNormalization(momentum=0.5),
        keras.layers.Dense(4, activity_regularizer=keras.regularizers.L2(0.1)),
    ]
    block = RecomputeBlock(layers, debug=True)
    block.build((None, 8))
    assert_same_training(
        block,
        apply_in_order(layers),
        [normal((4, 8))],
        block.trainable_variables,
        block.non_trainable_variables,
        mode,
    )


@pytest.mark.parametrize("mode", MODES)
def test_debug_mode_catches_a_shape_that_changes_in_the_recompute(mode):
    block = _block(ShapeFromCounter(), debug=True, name="flaky_shape")
    with pytest.raises(RecomputeMismatchError, match=r"RecomputeBlock 'flaky_shape'.*shape"):
        _step(block, mode)(normal((2, 4)))


@pytest.mark.parametrize("mode", MODES)
def test_debug_mode_catches_values_that_change_in_the_recompute(mode):
    block = _block(ValueFromCounter(), debug=True, name="flaky_values")
    # Eagerly the comparison runs in Python; in a graph it is an assertion op.
    error = RecomputeMismatchError if mode == "eager" else tf.errors.InvalidArgumentError
    # (A graph's assertion message escapes the quotes around the name.)
    with pytest.raises(
        error, match=r"RecomputeBlock \W+flaky_values\W+ \(debug mode\).*other values"
    ):
        _step(block, mode)(normal((2, 4)))


@pytest.mark.parametrize("mode", MODES)
def test_without_debug_mode_changed_values_go_unnoticed(mode):
    """Why debug mode exists: the same layer gives wrong gradients without an error."""
    block = _block(ValueFromCounter())
    assert all(g is not None for g in _step(block, mode)(normal((2, 4))))


def test_global_debug_mode_applies_to_every_block():
    assert not debug_enabled()
    block = _block(ShapeFromCounter())
    with set_debug(True):
        assert debug_enabled()
        with pytest.raises(RecomputeMismatchError):
            _step(block, "eager")(normal((2, 4)))
        with set_debug(False):
            assert not debug_enabled()
        assert debug_enabled()
    assert not debug_enabled()
    set_debug(True)
    try:
        assert debug_enabled()
    finally:
        set_debug(False)


def _traced_op_names(block):
    graph = tf.function(_step(block, "eager")).get_concrete_function(tf.TensorSpec((2, 4))).graph
    return [op.name for op in graph.get_operations()]


def test_debug_mode_off_adds_no_op():
    plain = _traced_op_names(_block(keras.layers.Dense(3)))
    assert not [name for name in plain if CHECK_SCOPE in name]
    checked = _traced_op_names(_block(keras.layers.Dense(3), debug=True))
    assert [name for name in checked if CHECK_SCOPE in name]


def test_debug_flag_is_serialized():
    block = RecomputeBlock([keras.layers.Dense(2)], debug=True)
    config = block.get_config()
    assert config["debug"] is True
    assert RecomputeBlock.from_config(config).debug is True
    assert RecomputeBlock(keras.layers.Dense(2)).get_config()["debug"] is False
