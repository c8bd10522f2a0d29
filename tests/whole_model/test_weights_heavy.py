"""Steps whose peak is the weights' updates, not the activations: recompute only where it pays.

NOTE [ A plan worth its recompute ] in whole_model.py and NOTE [ The
optimizer's update workspace ] in costs/optimizer.py. A small-image ResNet and
a 2-layer decoder with a large vocabulary, at batch 2: their activations are a
few MiB beside tens of MiB of gradients and Adam's temporaries, and their
measured steps vary more than a plan would save (benchmarks/results/any_model.md).
"""

from __future__ import annotations

import warnings

import keras
import numpy as np
import pytest

import tfrecompute
from tfrecompute import strategies

pytestmark = pytest.mark.slow

THIN = r"only \d+% below storing everything .*less than measured peaks vary \(10%\)"


def _resnet(batch: int):
    keras.utils.set_random_seed(0)
    model = keras.applications.ResNet50V2(weights=None, input_shape=(32, 32, 3), classes=10)
    rng = np.random.default_rng(0)
    x = rng.random((batch, 32, 32, 3), dtype=np.float32)
    return model, (x, rng.integers(0, 10, batch))


def _applied(model) -> tuple:
    applied = tfrecompute.checkpoints(model)
    return () if applied.plan is None else applied.plan.segments


def test_a_small_batch_resnet_is_left_as_it_is_and_says_why():
    model, sample = _resnet(2)
    chain = tfrecompute.profile(model, sample=sample)
    stored = strategies.none(chain).peak_bytes
    least = strategies.optimal(chain).peak_bytes
    assert 0.9 * stored < least < stored  # a plan exists, saving too little
    with pytest.warns(UserWarning, match=THIN + r", so nothing is recomputed"):
        tfrecompute.recompute(model, sample=sample)
    assert _applied(model) == ()
    with pytest.warns(UserWarning, match=r"plan 'sqrt' predicts .* (not|only \d+%) below"):
        named = tfrecompute.plan(model, "sqrt", sample=sample)
    assert named.segments  # a named strategy's plan is kept, with the warning
    budgeted = tfrecompute.plan(model, budget=least, headroom=0, sample=sample)
    assert budgeted.segments and budgeted.peak_bytes <= least  # a budget still plans


def test_the_same_resnet_at_a_larger_batch_is_checkpointed_silently():
    model, sample = _resnet(32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        tfrecompute.recompute(model, sample=sample)
    assert _applied(model)


def test_a_two_layer_decoder_with_a_large_vocabulary_is_left_as_it_is():
    keras_hub = pytest.importorskip("keras_hub")
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.Qwen3Backbone(
        vocabulary_size=32000, num_layers=2, num_query_heads=4, num_key_value_heads=2,
        head_dim=32, hidden_dim=128, intermediate_dim=256,
    )  # fmt: skip
    inputs = {
        "token_ids": keras.Input((32,), dtype="int32", name="token_ids"),
        "padding_mask": keras.Input((32,), dtype="int32", name="padding_mask"),
    }
    model = keras.Model(inputs, keras.layers.Dense(32000)(backbone(inputs)))
    rng = np.random.default_rng(0)
    x = {"token_ids": rng.integers(0, 32000, (2, 32)), "padding_mask": np.ones((2, 32), "int32")}
    with pytest.warns(UserWarning, match=THIN):
        tfrecompute.recompute(model, sample=(x, rng.integers(0, 32000, (2, 32))))
    assert _applied(model) == ()
