"""`policy="attention"`: every attention core recomputes, everything else is kept.

Each behaviour is compared with the same layers without checkpointing
(`as_defined`, or the layer itself), eagerly and under `tf.function`, with the
seed and statistics state restored between the runs; and each test checks
that the cores did run again in backprop.
"""

from __future__ import annotations

import collections

import h5py
import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf

import tfrecompute
from tests import any_models
from tests import multiworker_worker as worker
from tests.helpers import (
    MODES,
    applied_blocks,
    as_defined,
    assert_same_adamw_fit,
    assert_same_training,
    assert_same_values,
    forward_and_grads,
    highest_requested_trace,
    load_state,
    model_runner,
    normal,
    recomputed_blocks,
    save_state,
)
from tests.whole_model.test_any_model import assert_trains_like_before
from tfrecompute.layers import RecomputeBlock
from tfrecompute.layers.attention import (
    attention_layers,
    checkpoint_attention,
    core_method,
    cores_checkpointed,
    is_checkpointed,
)
from tfrecompute.layers.in_place import checkpoint_in_place, checkpointed_in_place, release

pytestmark = pytest.mark.usefixtures("collect_garbage")


class CountingAttention(keras.layers.MultiHeadAttention):
    """Keras's attention, counting the runs of its core (traced runs under tf.function)."""

    runs = 0

    def _compute_attention(self, *args, **kwargs):
        CountingAttention.runs += 1
        return super()._compute_attention(*args, **kwargs)


def _options(case, query, value):
    mask = np.random.default_rng(0).random((2, query.shape[1], value.shape[1])) > 0.3
    mask[..., 0] = True  # every query attends somewhere
    return {
        "padding": {"attention_mask": tf.constant(mask)},
        "causal": {"use_causal_mask": True},
        "scores": {"attention_mask": tf.constant(mask), "return_attention_scores": True},
    }[case]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", ["padding", "causal", "scores"])
def test_a_block_recomputes_only_the_core_exactly(case, mode):
    """Attention dropout 0.3: the recompute replays its mask."""
    keras.utils.set_random_seed(0)
    attention = CountingAttention(2, 8, dropout=0.3, seed=3)
    query = normal((2, 5, 8))
    value = query if case == "causal" else normal((2, 7, 8), seed=1)
    attention(query, value)
    block = RecomputeBlock(attention, policy="attention")
    options = _options(case, query, value)
    inputs = [query] if value is query else [query, value]

    def calling(layer):
        def call(q, *v, training=None):
            return layer(q, v[0] if v else q, training=training, **options)

        return call

    CountingAttention.runs = 0
    assert_same_training(
        calling(block),
        calling(attention),
        inputs,
        attention.trainable_variables,
        attention.non_trainable_variables,
        mode,
    )
    assert CountingAttention.runs == 3  # forward and recompute for the block, one unwrapped
    assert "_compute_attention" not in vars(attention)  # only while the block runs


def _products(layer, query):
    """The matmuls of a traced training step: (projections, attention core), by op name."""

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(layer(x, x, training=True) ** 2)
        return tape.gradient(loss, layer.trainable_variables)

    graph = step.get_concrete_function(query).graph
    names = [op.name for op in graph.get_operations() if op.type == "BatchMatMulV2"]
    projections = ("/query", "/key", "/value", "/attention_output")
    counts = collections.Counter(any(p in n for p in projections) for n in names)
    return counts[True], counts[False]


def test_the_backward_runs_no_projection_again():
    """Counted in the traced step's graph: the core's two products run again, none of
    the four projections does (a full recompute runs all six again)."""
    keras.utils.set_random_seed(0)
    attention = keras.layers.MultiHeadAttention(2, 8, dropout=0.1)
    query = normal((2, 5, 8))
    attention(query, query)
    plain = _products(attention, query)
    assert plain[0] == 4 + 8 and plain[1] == 2 + 4  # forward, then two VJP products each
    assert _products(RecomputeBlock(attention, policy="attention"), query) == (12, 8)
    assert _products(RecomputeBlock(attention), query) == (16, 8)


# ------------------------------------------------------------ whole models


def _gemma():
    model = keras_hub.models.GemmaBackbone(
        vocabulary_size=100,
        num_layers=2,
        num_query_heads=2,
        num_key_value_heads=1,
        hidden_dim=32,
        intermediate_dim=64,
        head_dim=16,
        dropout=0.1,
    )
    tokens = np.random.default_rng(0).integers(1, 100, (2, 8)).astype("int32")
    return model, ({"token_ids": tokens, "padding_mask": np.ones((2, 8), "int32")}, None)


def _vit():
    model = keras_hub.models.ViTBackbone(
        image_shape=(32, 32, 3),
        patch_size=8,
        num_layers=2,
        num_heads=2,
        hidden_dim=32,
        mlp_dim=64,
        attention_dropout=0.1,
    )
    return model, (np.random.default_rng(0).normal(size=(2, 32, 32, 3)).astype("float32"), None)


HUB = {
    "bert": lambda: any_models.bert(layers=2, hidden=32, sequence=16, batch=2),
    "gpt2": lambda: any_models.gpt2(layers=2, hidden=32, sequence=16, batch=2),
    "llama": lambda: any_models.llama(layers=2),
    "gemma": _gemma,
    "vit": _vit,
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(HUB))
def test_keras_hub_models_train_like_the_original(name, mode):
    """BERT and GPT-2 (keras-hub's CachedMultiHeadAttention, attention dropout on), ViT
    (Keras's own, attention dropout on), Llama and Gemma (their own cores, Gemma's
    taking `training`): exactly one block per attention layer, each recomputing."""
    keras.utils.set_random_seed(0)
    model, (x, _) = HUB[name]()
    model(x)
    flat = [tf.convert_to_tensor(v) for v in keras.tree.flatten(x)]
    trainable, state = model.trainable_variables, model.non_trainable_variables
    initial = save_state(state)
    want = forward_and_grads(model_runner(model, x), flat, trainable, mode)
    want_state = save_state(state)
    load_state(state, initial)
    assert tfrecompute.recompute(model, policy="attention") is model
    assert tfrecompute.checkpoints(model).plan is None
    assert len(applied_blocks(model)) == 2

    def training_call():
        with tf.GradientTape():
            model(x, training=True)

    assert recomputed_blocks(model, training_call) == 2
    got = forward_and_grads(model_runner(model, x), flat, trainable, mode)
    assert_same_values(got, want, rtol=1e-5)
    for got_value, want_value in zip(save_state(state), want_state):  # seeds advanced alike
        np.testing.assert_array_equal(got_value, want_value)
    tfrecompute.recompute(model, "none")
    assert not any("_compute_attention" in vars(layer) for layer in model._flatten_layers())


# ------------------------------------------ attention computed inline in `call`


def _tokens(batch, sequence, prefix=""):
    return {f"{prefix}{key}": value for key, value in any_models._tokens(batch, sequence).items()}


def _t5(batch=2, sequence=8, hidden=16, heads=2):
    model = keras_hub.models.T5Backbone(
        vocabulary_size=100, num_layers=2, num_heads=heads, hidden_dim=hidden,
        intermediate_dim=2 * hidden, key_value_dim=hidden // heads, dropout=0.1,
    )  # fmt: skip
    x = {**_tokens(batch, sequence, "encoder_"), **_tokens(batch, sequence, "decoder_")}
    y = {
        f"{part}_sequence_output": np.zeros((batch, sequence, hidden), "float32")
        for part in ("encoder", "decoder")
    }
    return model, x, y


def _bloom():
    model = keras_hub.models.BloomBackbone(
        vocabulary_size=100, num_layers=2, num_heads=2, hidden_dim=16, intermediate_dim=32,
        dropout=0.1,
    )  # fmt: skip
    return model, _tokens(2, 8), None


def _falcon():
    model = keras_hub.models.FalconBackbone(
        vocabulary_size=100, num_layers=2, num_attention_heads=2, hidden_dim=16,
        intermediate_dim=32, attention_dropout_rate=0.1,
    )  # fmt: skip
    return model, _tokens(2, 8), None


INLINE = {"t5": (_t5, 6), "bloom": (_bloom, 2), "falcon": (_falcon, 2)}  # attention layers


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(INLINE))
def test_attention_computed_inline_trains_like_the_original(name, mode):
    """T5's, Bloom's and Falcon's attention compute the core inline in `call` (NOTE
    [ Attention computed inline ]): each attention layer (T5's self- and
    cross-attention) is one block under "dots", recomputed in backprop, with
    attention dropout on; gradients and seed states equal the plain model's."""
    build, layers = INLINE[name]
    keras.utils.set_random_seed(0)
    model, x, _ = build()
    model(x)

    def attention(m):
        return tfrecompute.recompute(m, policy="attention")

    assert_trains_like_before(model, x, mode, attention, blocks=layers)
    assert len(applied_blocks(model)) == layers
    assert {block.policy for block in applied_blocks(model)} == {"dots"}
    tfrecompute.recompute(model, "none")
    assert not any("call" in vars(layer) for layer in attention_layers([model]))


def _bloom_attention_matmuls(layer, hidden):
    """The matmuls a traced training step of one Bloom attention layer runs: those
    its gradients (the input's, as inside a model, and the weights') depend on (a
    product the policy kept is computed again by its VJP's local tape and never
    read: pruned by Grappler, not counted here)."""
    mask = tf.ones((2, 8, 8), "bool")

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(layer(x, attention_mask=mask, training=True) ** 2)
        return tape.gradient(loss, [x, *layer.trainable_variables])

    graph = step.get_concrete_function(hidden).graph
    seen, stack = set(), [t.op for t in graph.outputs]
    while stack:
        op = stack.pop()
        if op.name not in seen:
            seen.add(op.name)
            stack.extend([t.op for t in op.inputs] + list(op.control_inputs))
    return sum(graph.get_operation_by_name(n).type in ("BatchMatMulV2", "MatMul") for n in seen)


def test_attention_computed_inline_runs_the_core_again_and_no_projection():
    """Counted in the traced step's graph, as for `_compute_attention`: under the
    attention policy the core's two products run again and none of the four
    projections does."""
    keras.utils.set_random_seed(0)
    model, x, _ = _bloom()
    model(x)
    attention = attention_layers([model])[0]
    hidden = normal((2, 8, 16))
    plain = _bloom_attention_matmuls(attention, hidden)
    assert plain == 6 * 3  # four projections and two core products, two VJP products each
    with cores_checkpointed([attention]):
        assert _bloom_attention_matmuls(attention, hidden) == plain + 2
    assert "call" not in vars(attention)
    # A whole recompute runs the other five again (the output projection's output
    # is read by no backward).
    assert _bloom_attention_matmuls(RecomputeBlock(attention), hidden) == plain + 5


def test_attention_computed_inline_is_found_by_its_call():
    """Which method is checkpointed: the core where `call` calls `_compute_attention`,
    `call` for an attention computed inline (XLNet's layer inherits the core but never
    calls it), nothing for a layer without projection sublayers (XLNet's attention
    mask layer) or one holding an attention layer."""
    mha = keras.layers.MultiHeadAttention(2, 4)
    mha(normal((1, 3, 4)), normal((1, 3, 4)))
    assert core_method(mha) == "_compute_attention"
    xlnet = keras_hub.models.XLNetBackbone(
        vocabulary_size=100, num_layers=1, num_heads=2, hidden_dim=8, intermediate_dim=16
    )
    found = attention_layers([xlnet])
    assert [type(layer).__name__ for layer in found] == ["TwoStreamRelativeAttention"]
    assert core_method(found[0]) == "call"
    model, _, _ = _bloom()
    assert {core_method(layer) for layer in attention_layers([model])} == {"call"}
    assert core_method(model) is None and core_method(model.transformer_layers[0]) is None

    class AttentionMask(keras.layers.Layer):  # says attention, has no projection layers
        def build(self, shape):
            self.embedding = self.add_weight(shape=shape[-1:])

        def call(self, x):
            return x * self.embedding > 0

    mask = AttentionMask()
    mask(normal((1, 4)))
    assert mask.weights and core_method(mask) is None


def test_a_subclass_calling_its_parents_call_keeps_the_core_method():
    """A `MultiHeadAttention` subclass whose `call` returns `super().call(...)` computes
    its core in `_compute_attention` (the MRO's next `call` calls it)."""

    class ScaledAttention(keras.layers.MultiHeadAttention):
        def call(self, query, value, key=None, **kwargs):
            return super().call(query, value, key, **kwargs) * 2.0

    layer = ScaledAttention(2, 4)
    layer(normal((1, 3, 4)), normal((1, 3, 4)))
    assert core_method(layer) == "_compute_attention"


def test_a_layer_shared_by_two_checkpointed_models_is_released_by_either():
    """Checkpointed twice (two models holding the same attention layer), an inline
    core is one change: releasing it gives the layer its own `call` back."""
    keras.utils.set_random_seed(0)
    model, x, _ = _bloom()
    model(x)
    attention = attention_layers([model])[0]
    first, second = checkpoint_attention(attention), checkpoint_attention(attention)
    assert first is second and is_checkpointed(attention)
    release(attention, "call")
    assert "call" not in vars(attention) and not is_checkpointed(attention)


def test_a_plans_in_place_block_keeps_its_call_under_the_attention_policy(monkeypatch):
    """An in-place block around an attention layer computed inline (Bloom's decoder
    calls it as `layer(hidden_states=...)`) applies the policy to the same `call`
    while it runs: the core recomputes, gradients equal the plain model's, and the
    in-place call is there after."""
    keras.utils.set_random_seed(0)
    model, x, _ = _bloom()
    model(x)
    flat = [tf.convert_to_tensor(v) for v in keras.tree.flatten(x)]
    seeds = save_state(model.non_trainable_variables)
    want = forward_and_grads(model_runner(model, x), flat, model.trainable_variables, "eager")
    load_state(model.non_trainable_variables, seeds)
    attention = attention_layers([model])[0]
    block = checkpoint_in_place(attention, policy="attention")
    seen = []
    original = RecomputeBlock._recomputed_call

    def counting(self, frame):
        seen.append(self)
        return original(self, frame)

    monkeypatch.setattr(RecomputeBlock, "_recomputed_call", counting)
    got = forward_and_grads(model_runner(model, x), flat, model.trainable_variables, "eager")
    assert_same_values(got, want, rtol=1e-5)
    assert block not in seen  # a block under "attention" recomputes only the cores
    assert [b.policy for b in seen] == ["dots"]
    assert checkpointed_in_place(attention)
    release(attention)
    assert "call" not in vars(attention)


def test_attention_computed_inline_is_priced_and_timed():
    """Bloom's attention links keep less under the attention state, which recomputes
    their cores' products; timed, the recompute (the call given its projections)
    costs something and no more than the link's forward."""
    keras.utils.set_random_seed(0)
    model, x, _ = _bloom()
    model(x)
    chain = tfrecompute.profile(model, sample=x, policy="attention")
    attention = [i for i in range(chain.n) if chain.policy_kept_bytes[i] < chain.saved_bytes[i]]
    assert len(attention) == 2
    cores = 2 * (2 * 2 * 2 * 8 * 8 * 8)  # QK^T and AV: 2 x elements x contraction
    assert [chain.policy_forward_cost[i] for i in attention] == [cores, cores]
    timed = tfrecompute.profile(model, sample=x, policy="attention", measure_time=True)
    for i in attention:
        assert 0 < timed.policy_forward_cost[i] <= timed.forward_cost[i]


@pytest.mark.slow
def test_attention_computed_inline_keeps_less_for_backprop():
    """T5 at sequence 256 (each head's scores 1 MiB): the attention policy keeps
    less than storing everything, priced and in the requested peak of traced steps."""
    keras.utils.set_random_seed(0)
    model, x, y = _t5(batch=4, sequence=256, hidden=64, heads=4)
    model(x)
    model.compile(optimizer="sgd", loss="mse")
    chain = tfrecompute.profile(model, sample=(x, y), policy="attention")
    kept = [k / s for k, s in zip(chain.policy_kept_bytes, chain.saved_bytes)]
    assert sum(ratio < 0.6 for ratio in kept) == 4  # the four transformer layers
    stored = highest_requested_trace(model, x, y).requested_peak_bytes
    tfrecompute.recompute(model, policy="attention")
    assert highest_requested_trace(model, x, y).requested_peak_bytes < 0.8 * stored


def _encoder(seed=0, sequence=8):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((sequence, 16))
    x = inputs
    for _ in range(2):
        attended = keras.layers.MultiHeadAttention(2, 8, dropout=0.2)(x, x)
        x = keras.layers.LayerNormalization()(x + keras.layers.Dropout(0.1)(attended))
        x = keras.layers.LayerNormalization()(x + keras.layers.Dense(16, activation="gelu")(x))
    return keras.Model(inputs, keras.layers.Dense(3)(keras.layers.GlobalAveragePooling1D()(x)))


def _fit_alike(checkpointed, plain):
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(16, 8, 16)).astype("float32"), rng.normal(size=(16, 3))
    plain.set_weights(checkpointed.get_weights())
    assert_same_adamw_fit([checkpointed, plain], x, y)


def test_fit_follows_the_plain_model():
    checkpointed, plain = _encoder(), _encoder()
    tfrecompute.recompute(checkpointed, policy="attention")
    _fit_alike(checkpointed, plain)


def test_fit_follows_the_plain_model_under_mirrored_strategy():
    strategy = worker.mirrored_strategy(["CPU:0", "CPU:1"])
    with strategy.scope():
        checkpointed, plain = _encoder(), _encoder()
        tfrecompute.recompute(checkpointed, policy="attention")
        _fit_alike(checkpointed, plain)


def test_saves_and_exchanges_weights_like_the_plain_model(tmp_path):
    checkpointed, plain = _encoder(), _encoder(seed=1)
    tfrecompute.recompute(checkpointed, policy="attention")
    x = normal((2, 8, 16))
    with tf.GradientTape():
        checkpointed(x, training=True)  # the cores are made and cached on their layers
    checkpointed.save_weights(tmp_path / "c.weights.h5")
    plain.save_weights(tmp_path / "p.weights.h5")
    keys = []
    for path in ("c", "p"):
        with h5py.File(tmp_path / f"{path}.weights.h5") as f:
            found = []
            f.visit(found.append)
            keys.append(found)
    assert keys[0] == keys[1]
    plain.load_weights(tmp_path / "c.weights.h5")
    assert_same_values(plain.get_weights(), checkpointed.get_weights())
    tf.train.Checkpoint(model=checkpointed).write(str(tmp_path / "ckpt"))
    control = _encoder(seed=2)
    tf.train.Checkpoint(model=control).read(str(tmp_path / "ckpt")).assert_consumed()
    assert_same_values(control.get_weights(), checkpointed.get_weights())
    checkpointed.save(tmp_path / "c.keras")
    loaded = keras.saving.load_model(tmp_path / "c.keras")
    assert_same_values(loaded(x), as_defined(checkpointed)(x))
    assert not tfrecompute.checkpoints(loaded)


# ------------------------------------------------------------ the planner's third state


def test_profile_prices_the_attention_state():
    """Under "attention" a link with attention keeps less and recomputes its cores'
    products; the forward estimate counts them too. Other links keep what they keep."""
    model = _encoder()
    x = normal((4, 8, 16))
    plain = tfrecompute.profile(model, sample=x)
    chain = tfrecompute.profile(model, sample=x, policy="attention")
    attention = [i for i, name in enumerate(chain.names) if "multi_head_attention" in name]
    assert len(attention) == 2 and chain.names == plain.names
    for i in range(chain.n):
        if i in attention:
            assert chain.policy_kept_bytes[i] < chain.saved_bytes[i]
            cores = 2 * (2 * 4 * 2 * 8 * 8 * 8)  # QK^T and AV: 2 x elements x contraction
            assert chain.policy_forward_cost[i] == cores
            assert chain.forward_cost[i] == plain.forward_cost[i] + cores
        else:
            assert chain.policy_kept_bytes[i] == chain.saved_bytes[i] == plain.saved_bytes[i]
            assert chain.policy_forward_cost[i] == 0
    timed = tfrecompute.profile(model, sample=x, policy="attention", measure_time=True)
    for i in attention:
        assert 0 < timed.policy_forward_cost[i] <= timed.forward_cost[i]  # timed alone


@pytest.mark.parametrize("mode", MODES)
def test_a_budget_mixes_attention_cores_and_full_blocks(mode):
    """`optimal` under a budget with the attention state: some segments keep all but
    their cores, others recompute whole; training equals the model as defined."""
    model = _encoder(sequence=64)
    x = normal((4, 64, 16))
    chain = tfrecompute.profile(model, sample=x, policy="attention")
    mixed = [
        p
        for p in tfrecompute.strategies.frontier(chain)
        if any(p.selective) and not all(p.selective)
    ]
    assert mixed
    plan = tfrecompute.plan(
        model, budget=mixed[0].peak_bytes, sample=x, headroom=0, policy="attention"
    )
    assert any(plan.selective) and not all(plan.selective)
    tfrecompute.recompute(model, plan, policy="attention")
    policies = {block.policy for block in applied_blocks(model)}
    assert policies == {None, "attention"}
    state, initial = model.non_trainable_variables, save_state(model.non_trainable_variables)
    plain = as_defined(model)
    want = forward_and_grads(plain, [x], model.trainable_variables, mode)
    load_state(state, initial)
    got = forward_and_grads(model, [x], model.trainable_variables, mode)
    assert_same_values(got, want, rtol=1e-5)


# ---------------------------------------------------------------- errors


def test_a_model_without_attention_is_refused():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4)])
    with pytest.raises(
        ValueError,
        match=r"found no attention layer in the model \(a layer with a `_compute_attention`",
    ):
        tfrecompute.recompute(model, policy="attention")


def test_a_block_without_attention_warns():
    block = RecomputeBlock(keras.layers.Dense(4), policy="attention")
    with pytest.warns(UserWarning, match=r"no attention layer .* so nothing is recomputed"):
        with tf.GradientTape():
            block(normal((2, 4)), training=True)
