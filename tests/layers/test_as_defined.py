"""`as_defined(model)` (tests/helpers.py): the control that whole-model tests compare with.

It calls the checkpointed model object itself with its checkpoints lifted for the
call. If it lifted nothing, those tests would compare a checkpointed model with
itself and could not fail; so here a lifted call must run no block at all (no block
call, no recompute), eagerly and while `tf.function` traces it, and give what the
model gave before it was checkpointed; the same call outside it runs every applied
block, so the checkpoints are back after it. Three models without keras-hub: a
Functional one calling a nested Functional model (rerouted by `tfrecompute.recompute`
through a rebuilt model), a Sequential one, and a subclassed one (its layers
checkpointed in place).
"""

from __future__ import annotations

import functools

import keras
import pytest

import tfrecompute
from tests import models_zoo
from tests.helpers import (
    MODES,
    applied_blocks,
    as_defined,
    assert_same_values,
    forward_and_grads,
    load_state,
    normal,
    save_state,
)
from tfrecompute import RecomputeBlock
from tfrecompute.layers.in_place import checkpointed_in_place

# Plans for models this small save little memory; recompute() says so.
pytestmark = pytest.mark.filterwarnings("ignore:recompute. plan:UserWarning")

WIDTH = 16


class Residual(keras.layers.Layer):
    def __init__(self, width: int, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(width, activation="tanh")
        self.dropout = keras.layers.Dropout(0.2)

    def call(self, x, training=None):
        return x + self.dropout(self.dense(x), training=training)


class Loop(keras.Model):
    """A subclassed model looping over subclassed layers, as research code writes it."""

    def __init__(self, width: int = WIDTH, depth: int = 3, **kwargs):
        super().__init__(**kwargs)
        self.stack = [Residual(width, name=f"residual_{i}") for i in range(depth)]
        self.head = keras.layers.Dense(3)

    def call(self, x, training=None):
        for layer in self.stack:
            x = layer(x, training=training)
        return self.head(x)


def _functional() -> keras.Model:
    inner_in = keras.Input((WIDTH,))
    hidden = keras.layers.Dense(WIDTH, activation="relu")(inner_in)
    inner = keras.Model(inner_in, keras.layers.Dropout(0.2)(hidden), name="inner")
    inputs = keras.Input((WIDTH,))
    h = inputs
    for _ in range(3):
        h = inner(keras.layers.Dense(WIDTH, activation="tanh")(h))
    return keras.Model(inputs, keras.layers.Dense(3)(h))


# How each model is built and checkpointed.
MODELS = {
    "functional": (_functional, "sqrt"),
    "sequential": (lambda: models_zoo.tanh_mlp(depth=4, width=WIDTH), "sqrt"),
    "subclassed": (Loop, "uniform:1"),
}


@pytest.fixture
def block_runs(monkeypatch):
    """The blocks called, and those that recomputed, while the test runs."""
    runs = {"called": [], "recomputed": []}
    call, recomputed_call = RecomputeBlock.call, RecomputeBlock._recomputed_call

    @functools.wraps(call)
    def counting_call(self, *args, **kwargs):
        runs["called"].append(self)
        return call(self, *args, **kwargs)

    def counting_recomputed_call(self, frame):
        runs["recomputed"].append(self)
        return recomputed_call(self, frame)

    monkeypatch.setattr(RecomputeBlock, "call", counting_call)
    monkeypatch.setattr(RecomputeBlock, "_recomputed_call", counting_recomputed_call)
    return runs


def _ids(blocks) -> set[int]:
    return {id(block) for block in blocks}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", list(MODELS))
def test_a_call_as_defined_runs_no_block_and_a_call_outside_runs_them(kind, mode, block_runs):
    build, strategy = MODELS[kind]
    keras.utils.set_random_seed(0)
    model = build()
    x = normal((4, WIDTH))
    model(x)
    state = model.non_trainable_variables  # the Dropout layers' seed states
    initial = save_state(state)

    def train_step(fn):
        """Outputs and gradients of a training call (under a tape), from the initial state."""
        load_state(state, initial)
        return forward_and_grads(fn, [x], model.trainable_variables, mode)

    before = train_step(model)  # the model as defined, never checkpointed yet
    assert tfrecompute.recompute(model, strategy, sample=x) is model
    blocks = applied_blocks(model)
    assert blocks
    if kind == "subclassed":  # checkpointed where its code calls the layers
        assert all(checkpointed_in_place(block.layers[0]) for block in blocks)
    block_runs["called"].clear()

    lifted = train_step(as_defined(model))
    assert [block.name for block in block_runs["called"] + block_runs["recomputed"]] == []
    assert_same_values(lifted, before)

    checkpointed = train_step(model)
    assert _ids(block_runs["called"]) >= _ids(blocks)
    assert _ids(block_runs["recomputed"]) >= _ids(blocks)
    assert_same_values(checkpointed, before)
