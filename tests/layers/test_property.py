"""Property: random small models with random block groupings train like the original.

Hypothesis draws a Sequential or Functional model (widths 1 to 8, 1 to 6
units of Dense, Dropout, BatchNormalization and, in Functional models,
residual adds), then a random grouping of its units into RecomputeBlocks
(sometimes nested), and checks outputs, gradients and state updates against
the same layers unwrapped, eagerly or under `tf.function`. A second property
rewrites the plain model with `tfrecompute.recompute` under random segments
of its chain and checks the same.
"""

from __future__ import annotations

import keras
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import tfrecompute
from tests.helpers import (
    applied_blocks,
    as_defined,
    assert_same_training,
    normal,
    recomputed_blocks,
)
from tfrecompute import RecomputeBlock, strategies
from tfrecompute.strategies.simulate import within_limits

ACTIVATIONS = [None, "relu", "tanh", "sigmoid"]


@st.composite
def unit_specs(draw, *, residual):
    """1 to 6 units as plain data.

    ("dense", width, activation), ("dropout", rate, seed), ("batchnorm",) and,
    in Functional models, ("residual",) for h + Dense(h). Layers are made from
    the specs in the test (Keras draws default seeds from Python's `random`,
    which Hypothesis forbids inside strategies).
    """
    kinds = ["dense", "dropout", "batchnorm"] + (["residual"] if residual else [])
    specs = []
    for _ in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(kinds))
        if kind == "dense":
            specs.append((kind, draw(st.integers(1, 8)), draw(st.sampled_from(ACTIVATIONS))))
        elif kind == "dropout":
            # Unseeded Dropout still draws from its own SeedGenerator.
            specs.append(
                (kind, draw(st.sampled_from([0.1, 0.5])), draw(st.none() | st.integers(0, 9)))
            )
        else:
            specs.append((kind,))
    return specs


@st.composite
def groupings(draw, count):
    """Cuts `count` units into consecutive groups; each is wrapped (1), nested (2) or not (0)."""
    cuts = sorted(draw(st.sets(st.integers(1, max(count - 1, 1)), max_size=count - 1)))
    bounds = [0, *[c for c in cuts if 0 < c < count], count]
    return [
        (start, stop, draw(st.sampled_from([0, 1, 1, 2])))
        for start, stop in zip(bounds, bounds[1:])
        if start < stop
    ]


@st.composite
def model_specs(draw):
    functional = draw(st.booleans())
    specs = draw(unit_specs(residual=functional))
    return functional, draw(st.integers(1, 8)), specs, draw(groupings(len(specs)))


def _make_units(specs, width):
    """A unit is a list of layers, or ("residual", dense) for h + dense(h)."""
    units = []
    for spec in specs:
        if spec[0] == "dense":
            units.append([keras.layers.Dense(spec[1], activation=spec[2])])
            width = spec[1]
        elif spec[0] == "dropout":
            units.append([keras.layers.Dropout(spec[1], seed=spec[2])])
        elif spec[0] == "batchnorm":
            units.append([keras.layers.BatchNormalization(momentum=0.5)])
        else:
            units.append(("residual", keras.layers.Dense(width, activation="tanh")))
    return units


def _apply_unit(unit, h):
    if isinstance(unit, tuple):
        return keras.layers.Add()([h, unit[1](h)])
    for layer in unit:
        h = layer(h)
    return h


def _wrap(body, nesting):
    block = RecomputeBlock(body)
    return RecomputeBlock([block]) if nesting == 2 else block


def _sequential(unit_list, grouping, width):
    layers = [layer for unit in unit_list for layer in unit]
    plain = keras.Sequential([keras.Input((width,)), *layers])
    blocked = [keras.Input((width,))]
    for start, stop, nesting in grouping:
        group = [layer for unit in unit_list[start:stop] for layer in unit]
        blocked.extend([_wrap(group, nesting)] if nesting else group)
    return plain, keras.Sequential(blocked)


def _functional(unit_list, grouping, width):
    inputs = keras.Input((width,))
    h = inputs
    for unit in unit_list:
        h = _apply_unit(unit, h)
    plain = keras.Model(inputs, h)
    inputs = keras.Input((width,))
    h = inputs
    for start, stop, nesting in grouping:
        if nesting:
            sub_in = keras.Input(tuple(h.shape[1:]))
            sub_out = sub_in
            for unit in unit_list[start:stop]:
                sub_out = _apply_unit(unit, sub_out)
            h = _wrap(keras.Model(sub_in, sub_out), nesting)(h)
        else:
            for unit in unit_list[start:stop]:
                h = _apply_unit(unit, h)
    return plain, keras.Model(inputs, h)


_SETTINGS = {
    "deadline": None,
    "database": None,
    "print_blob": True,  # a failure prints how to reproduce it
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
}


def _assert_trains_like(model, plain, width, seed, mode, *, variables=None):
    variables = variables or plain
    assert_same_training(
        model,
        plain,
        [normal((6, width), seed=seed)],
        variables.trainable_variables,
        variables.non_trainable_variables,
        mode,
        atol=1e-5,
    )


@pytest.mark.filterwarnings("error:.*recompute is pointless")
@settings(max_examples=20, **_SETTINGS)
@given(model_specs(), st.sampled_from(["eager", "function"]), st.integers(0, 2**16))
def test_random_models_with_random_blocks_match_the_original(spec, mode, seed):
    functional, width, unit_list, grouping = spec
    build = _functional if functional else _sequential
    plain, blocked = build(_make_units(unit_list, width), grouping, width)
    _assert_trains_like(blocked, plain, width, seed, mode)


@settings(max_examples=15, **_SETTINGS)
@given(model_specs(), st.sampled_from(["eager", "function"]), st.integers(0, 2**16), st.data())
def test_random_models_rewritten_by_recompute_match_the_original(spec, mode, seed, data):
    functional, width, unit_list, _ = spec
    build = _functional if functional else _sequential
    plain, _ = build(_make_units(unit_list, width), [], width)  # no hand-placed blocks
    chain = tfrecompute.profile(plain, batch_size=6)
    cuts = sorted(data.draw(st.sets(st.integers(0, chain.n), min_size=2), label="cuts"))
    # The pieces blocks may cover (Chain.max_stop), of which at least one is recomputed:
    # an example without a block would compare the model with itself.
    pieces = within_limits(chain, list(zip(cuts, cuts[1:])))
    assume(pieces)
    chosen = data.draw(st.sets(st.sampled_from(pieces), min_size=1), label="recomputed")
    segments = sorted(chosen)
    model = tfrecompute.recompute(plain, strategies.Plan.from_segments(chain, segments))
    assert model is plain and len(applied_blocks(plain)) == len(segments) >= 1
    x = normal((6, width), seed=seed)

    def train_call():
        with tf.GradientTape() as tape:
            tape.watch(x)
            plain(x, training=True)

    assert recomputed_blocks(plain, train_call) == len(segments)  # each block checkpoints
    _assert_trains_like(plain, as_defined(plain), width, seed, mode, variables=plain)


@settings(max_examples=15, **_SETTINGS)
@given(model_specs())
def test_unwrap_gives_the_model_without_blocks(spec):
    """`unwrap` of a model with hand-placed blocks is the plain model: the same layers,
    in the same order, the same weights in the same order, under the same paths."""
    functional, width, unit_list, grouping = spec
    build = _functional if functional else _sequential
    plain, blocked = build(_make_units(unit_list, width), grouping, width)
    unwrapped = tfrecompute.unwrap(blocked)
    assert not any(isinstance(layer, RecomputeBlock) for layer in unwrapped._flatten_layers())
    assert [id(v) for v in unwrapped.weights] == [id(v) for v in plain.weights]
    assert [v.path for v in unwrapped.weights] == [v.path for v in plain.weights]
    if not any(nesting for _, _, nesting in grouping) or not functional:

        def names(model):  # a residual unit makes an Add layer per model: compare its kind
            return [
                la.name if la.weights else type(la).__name__
                for la in model.layers
                if not isinstance(la, keras.layers.InputLayer)
            ]

        assert names(unwrapped) == names(plain)
