"""Calls that cost the same are traced, measured and timed once (NOTE [ Calls that cost the same ]).

Layers of one class whose forward ops match op for op share every cost;
layers that compute differently (another activation, dropout rate, bias,
frozen weights) never do; and the chain priced with shared costs equals the
chain priced call by call.
"""

from __future__ import annotations

import keras
import keras_hub
import numpy as np
import pytest

import tfrecompute
from tfrecompute.costs import policy_state, profile
from tfrecompute.graph import layer_graph
from tfrecompute.graph.trace import traced_graph


def _model() -> keras.Model:
    keras.utils.set_random_seed(0)
    x = keras.Input((32,))
    h = x
    layers = {
        "tanh_a": keras.layers.Dense(32, activation="tanh"),
        "tanh_b": keras.layers.Dense(32, activation="tanh"),
        "tanh_c": keras.layers.Dense(32, activation="tanh"),
        "relu": keras.layers.Dense(32, activation="relu"),
        "no_bias": keras.layers.Dense(32, activation="tanh", use_bias=False),
        "frozen": keras.layers.Dense(32, activation="tanh", trainable=False),
        "drop_a": keras.layers.Dropout(0.1),
        "drop_b": keras.layers.Dropout(0.1),
        "drop_other_rate": keras.layers.Dropout(0.3),
        "tanh_d": keras.layers.Dense(32, activation="tanh"),
    }
    for name, layer in layers.items():
        layer.name = name
        h = layer(h)
    return keras.Model(x, keras.layers.Dense(4, name="head")(h))


def _keys_by_name(model: keras.Model) -> dict[str, tuple]:
    graph = traced_graph("plan", model, None, 8)
    return {c.layer.name: k for c, k in zip(graph.calls, layer_graph.cost_keys(graph.calls))}


def test_layers_that_compute_alike_share_a_key_and_others_do_not():
    keys = _keys_by_name(_model())
    assert keys["tanh_a"] == keys["tanh_b"] == keys["tanh_c"] == keys["tanh_d"]
    assert keys["drop_a"] == keys["drop_b"]
    others = ["relu", "no_bias", "frozen", "drop_other_rate", "head"]
    distinct = {keys["tanh_a"], keys["drop_a"], *(keys[name] for name in others)}
    assert len(distinct) == 2 + len(others)


def test_a_layer_without_a_twin_is_keyed_by_itself():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16), keras.layers.Dense(4)])
    graph = traced_graph("plan", model, None, 8)
    assert all(call.forward_digest is None for call in graph.calls)
    keys = layer_graph.cost_keys(graph.calls)
    assert [k[0] for k in keys] == [id(call.layer) for call in graph.calls]


def _one_key_per_layer(calls):
    return [(id(call.layer), layer_graph.call_signature(call)) for call in calls]


@pytest.fixture
def traced(monkeypatch):
    """The names of the layers whose calls `profile` traces for their memory, in order."""
    names = []
    original = profile.traced_call_memory

    def counting(layer, *args, **kwargs):
        names.append(layer.name)
        return original(layer, *args, **kwargs)

    monkeypatch.setattr(profile, "traced_call_memory", counting)
    return names


@pytest.mark.parametrize("policy", [None, "dots"])
def test_the_chain_priced_once_per_twin_equals_the_chain_priced_per_layer(
    monkeypatch, traced, policy
):
    model = _model()
    shared = tfrecompute.profile(model, batch_size=8, policy=policy, measure=True)
    distinct = ["tanh_a", "relu", "no_bias", "frozen", "drop_a", "drop_other_rate", "head"]
    assert sorted(traced) == sorted(distinct)
    traced.clear()
    monkeypatch.setattr(profile, "cost_keys", _one_key_per_layer)
    monkeypatch.setattr(policy_state, "cost_keys", _one_key_per_layer)
    apart = tfrecompute.profile(model, batch_size=8, policy=policy, measure=True)
    assert len(traced) == len(model.layers) - 1  # every layer but the input
    assert shared == apart


def test_a_keras_hub_backbone_traces_each_distinct_layer_once(traced):
    keras.utils.set_random_seed(0)
    model = keras_hub.models.BertBackbone(
        vocabulary_size=50,
        num_layers=3,
        num_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        max_sequence_length=16,
    )
    sample = {
        "token_ids": np.ones((2, 8), "int32"),
        "segment_ids": np.zeros((2, 8), "int32"),
        "padding_mask": np.ones((2, 8), "int32"),
    }
    tfrecompute.profile(model, sample=sample)
    layers = [name for name in traced if name.startswith("transformer_layer")]
    assert layers == ["transformer_layer_0"], traced
