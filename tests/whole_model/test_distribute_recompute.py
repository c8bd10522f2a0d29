"""`tfrecompute.recompute` of models built inside a `MirroredStrategy`'s scope.

The README's workflow: build and compile the model in `strategy.scope()`, then
checkpoint it there. Each model is built twice in the scope from one seed; one is
checkpointed (with every way of choosing a plan), both train on the same data, and
they must end on the same variables on every replica. The strategy runs two replicas
on the two logical CPUs of conftest.py.
"""

from __future__ import annotations

import logging
from typing import Any

import keras
import numpy as np
import pytest

import tfrecompute
from tests import any_models
from tests import multiworker_worker as worker

pytestmark = pytest.mark.usefixtures("collect_garbage")  # see tests/conftest.py


@pytest.fixture(scope="module")
def strategy():
    return worker.mirrored_strategy(["CPU:0", "CPU:1"])


def _functional(
    width: int = 32, depth: int = 6, batch: int = 16, features: int = 16
) -> tuple[keras.Model, tuple[Any, Any]]:
    inputs = keras.Input((features,))
    h = inputs
    for seed in range(depth):
        h = keras.layers.Dense(width, activation="relu")(h)
        h = keras.layers.BatchNormalization(momentum=0.5)(h)
        h = keras.layers.Dropout(0.2, seed=seed)(h)
    model = keras.Model(inputs, keras.layers.Dense(3)(h))
    rng = np.random.default_rng(0)
    return model, (
        rng.normal(size=(batch, features)).astype("float32"),
        rng.normal(size=(batch, 3)).astype("float32"),
    )


def _wide_functional() -> tuple[keras.Model, tuple[Any, Any]]:
    """`_functional` large enough for the CPU allocator's statistics to see its step.

    Allocations under 256 KiB measure as 0 on CPU; at batch 4096 each Dense(128)
    activation is 2 MiB.
    """
    return _functional(width=128, depth=8, batch=4096, features=128)


def _bert():
    return any_models.bert(layers=2, hidden=32, sequence=8, batch=4)


def _subclassed():
    return any_models.loop_transformer(layers=2, hidden=32, sequence=8, batch=4)


BUILDERS = {
    "functional": _functional,
    "wide functional": _wide_functional,
    "bert": _bert,
    "subclassed": _subclassed,
}


def _pair(strategy, name: str):
    """(checkpointed-to-be, control): equal models built and compiled in the scope."""
    models = []
    with strategy.scope():
        for _ in range(2):
            keras.utils.set_random_seed(0)
            model, (x, y) = BUILDERS[name]()
            model(x)
            model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.5), loss="mse")
            models.append(model)
    return models[0], models[1], x, y


def _assert_trains_like_the_control(model, control, x, y):
    initial = worker.replica_values(control)
    for m in (model, control):
        m.fit(x, y, batch_size=len(keras.tree.flatten(x)[0]) // 2, epochs=2, verbose=0)
    got, want = worker.replica_values(model), worker.replica_values(control)
    assert len(got) == len(want)
    for variable, g, w in zip(control.variables, got, want):
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5, err_msg=variable.path)
    assert any(not np.allclose(a, b) for a, b in zip(want, initial))  # it trained


def _blocks(model) -> int:
    return len(tfrecompute.checkpoints(model).blocks)


CHOICES = {
    "sqrt": lambda m, x, y: tfrecompute.recompute(m, "sqrt", sample=x),
    "uniform:2": lambda m, x, y: tfrecompute.recompute(m, "uniform:2", sample=x),
    "default": lambda m, x, y: tfrecompute.recompute(m, sample=x),
    "where": lambda m, x, y: tfrecompute.recompute(m, "sqrt", where=keras.layers.Dense, sample=x),
    "plan": lambda m, x, y: tfrecompute.recompute(m, tfrecompute.plan(m, "sqrt", sample=x)),
    # The sqrt plan's train step measured within a budget that storing everything
    # exceeds. On the wide model in the scope (logical CPUs share one allocator, so the
    # replicas' peaks add up; see `measure_step`) storing everything measured 74.5 to
    # 79 MiB, the sqrt plan 39.5 to 40 MiB, against the budget's 57.6 MiB (64 less its
    # 10% margin).
    "verify": lambda m, x, y: tfrecompute.recompute(
        m, "sqrt", sample=(x, y), budget="64MiB", verify=True, batch_size=len(x)
    ),
}


@pytest.mark.parametrize("choice", list(CHOICES))
def test_a_functional_model_checkpointed_in_the_scope_trains_like_the_control(strategy, choice):
    builder = "wide functional" if choice == "verify" else "functional"
    model, control, x, y = _pair(strategy, builder)
    with strategy.scope():
        assert CHOICES[choice](model, x, y) is model
    assert _blocks(model) >= 1
    _assert_trains_like_the_control(model, control, x, y)


@pytest.mark.parametrize("name", ["bert", "subclassed"])
def test_other_kinds_checkpointed_in_the_scope_train_like_the_control(strategy, name):
    model, control, x, y = _pair(strategy, name)
    with strategy.scope():
        tfrecompute.recompute(model, "sqrt", sample=x)
    assert _blocks(model) >= 1
    _assert_trains_like_the_control(model, control, x, y)


def _wide(optimizer: Any) -> tuple[keras.Model, Any, Any]:
    """Dense(256) x 8: at batch 512 and more its activations pass 256 KiB, which
    the CPU allocator's statistics see (smaller ones they leave out)."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((256,))
    h = inputs
    for seed in range(8):
        h = keras.layers.Dense(256, activation="relu")(h)
        h = keras.layers.Dropout(0.2, seed=seed)(h)
    model = keras.Model(inputs, keras.layers.Dense(3)(h))
    model.compile(optimizer=optimizer, loss="mse")
    rng = np.random.default_rng(0)
    return (
        model,
        rng.normal(size=(16, 256)).astype("float32"),
        rng.normal(size=(16, 3)).astype("float32"),
    )


def test_max_batch_size_in_the_scope(strategy):
    """Probes measured in the scope: the largest batch that fits is found, checkpointed."""
    budget = 24 << 20  # between what batches 512 and 1024 measure here (the probes say)
    with strategy.scope():
        model, x, y = _wide("sgd")
        found = tfrecompute.max_batch_size(
            model, (x, y), budget=budget, multiple=256, limit=2048, isolate=False
        )
    assert found.model is model
    if found.plan.segments:
        assert tfrecompute.checkpoints(model).plan == found.plan
    else:  # the batch fits storing everything
        assert not tfrecompute.checkpoints(model)
    assert 0 < found.peak_bytes <= budget, found
    assert all(p.fits == (p.batch_size <= found.batch_size) for p in found.probes), found
    assert any(not p.fits for p in found.probes), found  # the budget binds
    assert all(p.peak_bytes > 0 for p in found.probes), found


def test_the_optimizers_updates_are_measured_in_the_scope(strategy, caplog):
    """The update workspace probe runs outside the strategy: the same chain as the control's."""
    # Learning rates no other test uses: configurations not probed (and cached) yet.
    control, _, _ = _wide(keras.optimizers.Adam(learning_rate=0.0123))
    want = tfrecompute.profile(control, batch_size=16).applied_workspace_bytes
    with strategy.scope():
        model, _, _ = _wide(keras.optimizers.Adam(learning_rate=0.0321))
        with caplog.at_level(logging.WARNING, logger="tfrecompute.costs.optimizer"):
            got = tfrecompute.profile(model, batch_size=16).applied_workspace_bytes
    assert "were not measured" not in caplog.text
    assert got == want >= 2 * 256 * 256 * 4  # Adam: two temporaries of the largest kernel
