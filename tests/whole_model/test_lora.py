"""LoRA fine-tuning with checkpointing: keras-hub's `enable_lora` before or after `recompute`.

`enable_lora` freezes every layer of the backbone and unfreezes the adapted
projections inside the transformer layers. Each case builds the model twice from
one seed (the control is never checkpointed), gives the adapters non-zero values
(a fresh adapter's `B` is zero, which would leave `A` without gradient), and checks
that blocks are placed where the adapters' gradients need the layers' activations,
that the adapter gradients equal the control's eagerly and under `tf.function`, and
that `fit` moves the adapters as the control's and leaves every frozen weight where
it was. The same under `mixed_bfloat16` and `mixed_float16`, and without LoRA under
both.
"""

from __future__ import annotations

import warnings
from typing import Any

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf

import tfrecompute
from tests import any_models
from tests.helpers import (
    MODES,
    forward_and_grads,
    load_state,
    model_runner,
    recomputed_blocks,
    save_state,
)
from tests.whole_model.test_any_model import _per_tensor_errors, assert_close_per_tensor

RANK = 2


def _llama() -> tuple[keras.Model, keras.Model, Any, Any, Any]:
    model, (x, _) = any_models.llama(layers=3, hidden=32, sequence=8, batch=2)
    y = np.random.default_rng(1).normal(size=(2, 8, 32)).astype("float32")
    return model, model, x, y, "mse"


def _bert_classifier() -> tuple[keras.Model, keras.Model, Any, Any, Any]:
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=100, num_layers=3, num_heads=2, hidden_dim=32,
        intermediate_dim=64, max_sequence_length=16,
    )  # fmt: skip
    model = keras_hub.models.BertTextClassifier(backbone, num_classes=2, preprocessor=None)
    x = {
        **any_models._tokens(2, 8),
        "segment_ids": np.zeros((2, 8), "int32"),
    }
    y = np.array([0, 1])
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return model, backbone, x, y, loss


def _gemma_causal_lm() -> tuple[keras.Model, keras.Model, Any, Any, Any]:
    """A causal LM whose token embedding is tied to its logits (called twice)."""
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=100, num_layers=3, num_query_heads=2, num_key_value_heads=1,
        hidden_dim=32, intermediate_dim=64, head_dim=16,
    )  # fmt: skip
    model = keras_hub.models.GemmaCausalLM(backbone, preprocessor=None)
    x = any_models._tokens(2, 8)
    y = np.random.default_rng(1).integers(1, 100, (2, 8))
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return model, backbone, x, y, loss


MODELS = {"llama": _llama, "bert_classifier": _bert_classifier, "gemma_causal_lm": _gemma_causal_lm}


def _build(
    name: str, order: str, checkpointed: bool, *, lora: bool = True
) -> tuple[keras.Model, Any, Any, Any]:
    keras.utils.set_random_seed(0)
    model, backbone, x, y, loss = MODELS[name]()
    model(x)
    if checkpointed and (order == "after" or not lora):
        tfrecompute.recompute(model, "sqrt", sample=x)
    if lora:
        backbone.enable_lora(RANK)
        rng = np.random.default_rng(2)
        for variable in backbone.trainable_variables:
            if "lora_kernel" in variable.path:
                variable.assign(rng.normal(scale=0.1, size=variable.shape).astype("float32"))
    if checkpointed and order == "before" and lora:
        tfrecompute.recompute(model, "sqrt", sample=x)
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.5), loss=loss)
    return model, x, y, backbone


@pytest.fixture(params=["mixed_bfloat16", "mixed_float16"])
def mixed_policy(request):
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(request.param)
    yield request.param
    keras.config.set_dtype_policy(previous)


def _adapters(model: keras.Model) -> list[Any]:
    """What trains: the adapters, and what `enable_lora` leaves trainable beside them
    (the adapted projections' biases; a task's head)."""
    trainable = model.trainable_variables
    assert sum("lora_kernel" in v.path for v in trainable) >= 2 * 3
    return trainable


def _recomputing(model: keras.Model, x: Any) -> int:
    def run() -> None:
        with tf.GradientTape():
            model(x, training=True)

    return recomputed_blocks(model, run)


# The bound on float32 rounding noise: about 84 float32 ulps (eps = 1.2e-7) of each
# tensor's scale; a wrong gradient is off by a fraction of its own size (a block's
# recompute scaled by 1.001: 1e-3).
FLOAT32_NOISE = 1e-5


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("order", ["before", "after"], ids=["lora_first", "recompute_first"])
@pytest.mark.parametrize("name", list(MODELS))
def test_adapter_gradients_equal_the_control(name, order, mode):
    """The checkpointed model's outputs and adapter gradients equal the control's.

    Eagerly they are bitwise equal. Under `tf.function` Grappler's arithmetic
    optimizer rewrites the two graphs differently around the blocks' boundaries
    (the same float32 sums in another order) for the Gemma causal LM, so the
    checkpointed gradients differ from the control's by float32 rounding, of
    the size of the control's own eager-vs-function spread, which this test
    measures. Which oneDNN kernels a CPU gets decides how large: an element-wise
    atol=1e-6 held on one machine and not on another. So each tensor is
    measured against max(its own scale, 1e-2 of the largest) (GUIDE.md) and
    may be off by `FLOAT32_NOISE`, or twice the control's spread where a
    machine's is larger (it may not exceed 1e-4: a bound that a gradient off by
    1e-3 still fails). Seed states are restored before each run: BERT's
    Dropout draws the same masks in each.
    """
    model, x, _, _ = _build(name, order, checkpointed=True)
    control, _, _, _ = _build(name, order, checkpointed=False)
    assert _recomputing(model, x) >= 2  # the frozen transformer layers are checkpointed
    flat = [tf.convert_to_tensor(v) for v in keras.tree.flatten(x)]
    seeds = save_state(control.non_trainable_variables)

    def run(m, run_mode):
        load_state(m.non_trainable_variables, seeds)
        return forward_and_grads(model_runner(m, x), flat, _adapters(m), run_mode)

    want = {run_mode: run(control, run_mode) for run_mode in MODES}
    spread = max(error for error, _ in _per_tensor_errors(want["function"], want["eager"]))
    assert spread <= 1e-4, f"the control alone: eager vs tf.function differ by {spread:.3g}"
    got = run(model, mode)
    assert_close_per_tensor(got, want[mode], rtol=max(2 * spread, FLOAT32_NOISE))
    assert any(np.abs(g).max() > 0 for g in got[-len(_adapters(model)) :])


@pytest.mark.parametrize("order", ["before", "after"], ids=["lora_first", "recompute_first"])
@pytest.mark.parametrize("name", list(MODELS))
def test_fit_moves_the_adapters_as_the_control_and_nothing_else(name, order):
    model, x, y, _ = _build(name, order, checkpointed=True)
    control, _, _, _ = _build(name, order, checkpointed=False)
    frozen = [v for v in model.weights if not v.trainable and "seed_generator" not in v.path]
    frozen_before = save_state(frozen)
    for m in (model, control):
        m.fit(x, y, batch_size=1, epochs=2, shuffle=False, verbose=0)
    for got, want in zip(save_state(model.weights), save_state(control.weights)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for variable, before, after in zip(frozen, frozen_before, save_state(frozen)):
        np.testing.assert_array_equal(after, before, err_msg=variable.path)
    adapters_before = _build(name, order, checkpointed=False)[0].trainable_variables
    assert any(
        not np.allclose(a, b)
        for a, b in zip(save_state(_adapters(model)), save_state(adapters_before))
    )


# Without LoRA, Llama under both policies is in test_any_model.py.
MIXED_CASES = [(name, True, "after") for name in MODELS] + [
    ("gemma_causal_lm", True, "before"),  # the order keras-hub's fine-tuning guides use
    ("bert_classifier", False, "after"),
    ("gemma_causal_lm", False, "after"),
]


@pytest.mark.parametrize(
    ("name", "lora", "order"),
    MIXED_CASES,
    ids=[
        f"{name}-{('lora_first' if order == 'before' else 'lora') if lora else 'no_lora'}"
        for name, lora, order in MIXED_CASES
    ],
)
def test_under_a_mixed_policy_trains_as_the_control(name, lora, order, mixed_policy):
    """Each model under `mixed_bfloat16` and `mixed_float16`, with LoRA after recompute
    (the Gemma causal LM also before), and without LoRA.

    In half precision TensorFlow fuses a model's ops differently eagerly and
    under `tf.function`, so the control alone gives other gradients in the two
    (`spread`); the checkpointed model's may differ from the control's by no
    more than twice that (Gemma's adapters under `mixed_bfloat16`: spread 1.2%,
    checkpointed 2.1%; a wrong gradient is off by its own size). Frozen weights
    stay where they were; what trains moves as the control's, within the same
    tolerance. The seed states are restored before each run: BERT's Dropout
    draws the same masks in each.
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, x, y, _ = _build(name, order, checkpointed=True, lora=lora)
        assert _recomputing(model, x) >= 2
    # keras-hub's attention softmax runs in float32 inside each transformer layer:
    # not the user's to split, so blocks placed by recompute() do not warn of it.
    assert not [w for w in caught if "compute in different dtypes" in str(w.message)]
    control, _, _, _ = _build(name, order, checkpointed=False, lora=lora)
    trained = _adapters if lora else (lambda m: m.trainable_variables)
    flat = [tf.convert_to_tensor(v) for v in keras.tree.flatten(x)]
    seeds = save_state(control.non_trainable_variables)  # BERT's Dropout: the same masks

    def run(m, mode):
        load_state(m.non_trainable_variables, seeds)
        return forward_and_grads(model_runner(m, x), flat, trained(m), mode)

    runs = [run(control, mode) for mode in MODES]
    spread = max(error for error, _ in _per_tensor_errors(*runs))
    assert spread < 0.1  # a comparison that can still fail
    rtol = max(2 * spread, 1e-5)
    got = run(model, "function")
    assert_close_per_tensor(got, runs[1], rtol=rtol)
    frozen = [v for v in model.weights if not v.trainable and "seed_generator" not in v.path]
    frozen_before = save_state(frozen)
    for m in (model, control):
        m.fit(x, y, batch_size=1, epochs=2, shuffle=False, verbose=0)
    for variable, before, after in zip(frozen, frozen_before, save_state(frozen)):
        np.testing.assert_array_equal(after, before, err_msg=variable.path)
    assert_close_per_tensor(save_state(trained(model)), save_state(trained(control)), rtol=rtol)


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_lora_first_then_recompute_lowers_the_measured_step(policy):
    """keras-hub's fine-tuning flow, `enable_lora` then `recompute()`: blocks are placed
    and the allocator's step peak falls (it used to place none: 0.97-1.05x). The same
    model measured with and without its checkpoints, in this process."""
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(policy)
    try:
        keras.utils.set_random_seed(0)
        model, (x, _) = any_models.llama(layers=2, hidden=64, sequence=256, batch=4)
        y = np.zeros((4, 256, 64), "float32")
        model(x)
        model.enable_lora(RANK)
        model.compile(optimizer="adam", loss="mse")
        stored = tfrecompute.measure_step(model, x, y, steps=3).peak_bytes
        tfrecompute.recompute(model, sample=x)
        assert _recomputing(model, x) >= 1
        checkpointed = tfrecompute.measure_step(model, x, y, steps=3).peak_bytes
    finally:
        keras.config.set_dtype_policy(previous)
    assert checkpointed < 0.75 * stored, (checkpointed, stored)
