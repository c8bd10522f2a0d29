"""NOTE [ Measured state times ]: what the timed recompute of a cheaper state runs.

Times themselves are not asserted (they live in benchmarks/results/selective.md);
the functions timed are read op by op, and the profiled costs are bounded.
"""

from __future__ import annotations

import collections

import keras
import keras_hub
import numpy as np
import pytest

import tfrecompute
from tests.helpers import save_state
from tfrecompute.costs import state_time
from tfrecompute.layers.policy import resolve_policy


def _op_types(function, inputs) -> collections.Counter[str]:
    graph = function.get_concrete_function(*inputs).graph
    return collections.Counter(op.type for op in graph.get_operations())


def _variables_read(function, inputs, *, trainable: bool) -> list:
    graph = function.get_concrete_function(*inputs).graph
    return [v for v in graph.variables if v.trainable == trainable]


def _attention(dropout: float = 0.1):
    keras.utils.set_random_seed(0)
    layer = keras.layers.MultiHeadAttention(2, 16, dropout=dropout)
    query = keras.Input((32, 32))
    layer(query, query)
    return layer, (query, query)


def test_a_replay_under_dots_runs_no_product_with_a_weight():
    layer, args = _attention()
    dots = resolve_policy("test", "dots")
    replay, inputs = state_time._policy_replay(layer, args, {}, 4, dots)
    ops = _op_types(replay, inputs)
    # QK^T, AV and the softmax run again; the 4 projections (Reshape and
    # BatchMatMulV2 in TensorFlow) are given.
    assert ops["BatchMatMulV2"] == 2 and ops["Softmax"] == 1 and ops["Reshape"] == 0
    # Every tensor it makes is an output: the ops before a given projection run.
    graph = replay.get_concrete_function(*inputs).graph
    assert {t.op.inputs[0].op.type for t in graph.outputs} >= {"Softmax", "BatchMatMulV2"}
    keep_nothing = resolve_policy("test", lambda op: False)
    replay, inputs = state_time._policy_replay(layer, args, {}, 4, keep_nothing)
    assert _op_types(replay, inputs)["BatchMatMulV2"] == 2 + 4
    assert len(_variables_read(replay, inputs, trainable=True)) == 8  # 4 kernels, 4 biases


def test_the_cores_run_alone_without_the_projections():
    layer, args = _attention()
    cores, inputs = state_time._cores_alone(layer, args, {}, 4)
    ops = _op_types(cores, inputs)
    assert ops["BatchMatMulV2"] == 2 and ops["Softmax"] == 1 and ops["Reshape"] == 0
    assert ops["StatelessRandomUniformV2"] == 1  # its Dropout
    assert not _variables_read(cores, inputs, trainable=True)  # no projection kernel
    assert _variables_read(cores, inputs, trainable=False)  # the Dropout's seed state
    dense = keras.layers.Dense(8)
    x = keras.Input((8,))
    dense(x)
    assert state_time.attention_core_seconds(dense, (x,), {}, 4) == 0.0


def test_timing_leaves_the_seed_states_where_they_were():
    layer, args = _attention()
    before = save_state(layer.non_trainable_variables)
    assert before  # the Dropout's seed generator
    assert state_time.attention_core_seconds(layer, args, {}, 4) > 0
    assert state_time.policy_recompute_seconds(layer, args, {}, 4, resolve_policy("t", "dots")) > 0
    for got, want in zip(save_state(layer.non_trainable_variables), before):
        np.testing.assert_array_equal(got, want)
    assert "_compute_attention" not in vars(layer)  # the capture is removed


def test_a_keras_hub_attention_core_is_timed():
    keras.utils.set_random_seed(0)
    model = keras_hub.models.LlamaBackbone(
        vocabulary_size=50, num_layers=1, num_query_heads=2, num_key_value_heads=1,
        hidden_dim=16, intermediate_dim=32,
    )  # fmt: skip
    layer = model.get_layer("transformer_layer_0")
    x = keras.Input((8, 16))
    layer(x)
    cores, inputs = state_time._cores_alone(layer, (x,), {}, 2)
    ops = _op_types(cores, inputs)
    assert ops["BatchMatMulV2"] == 2 and ops["Softmax"] == 1
    assert not _variables_read(cores, inputs, trainable=True)  # no projection kernel


def _encoder() -> keras.Model:
    keras.utils.set_random_seed(0)
    tokens = keras.Input((64, 32))
    h = tokens
    for _ in range(2):
        attended = keras.layers.MultiHeadAttention(2, 16, dropout=0.1)(h, h)
        h = keras.layers.LayerNormalization()(h + attended)
        h = keras.layers.Dense(32, activation="relu")(keras.layers.Dense(64)(h))
    return keras.Model(tokens, h)


@pytest.mark.parametrize("policy", ["attention", "dots"])
def test_measured_state_costs_are_bounded_by_the_forward(policy):
    model = _encoder()
    chain = tfrecompute.profile(model, batch_size=8, policy=policy, measure_time=True)
    cheaper, forward = chain.policy_forward_cost, chain.forward_cost
    assert all(0 <= c <= f for c, f in zip(cheaper, forward))
    attention = [i for i, name in enumerate(chain.names) if "multi_head_attention" in name]
    assert attention and all(cheaper[i] > 0 for i in attention)
    if policy == "attention":  # only the links holding attention have cores
        assert all(cheaper[i] == 0 for i in range(chain.n) if i not in attention)
