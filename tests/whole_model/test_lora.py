"""LoRA fine-tuning with checkpointing: keras-hub's `enable_lora` before or after `recompute`.

`enable_lora` freezes every layer of the backbone and unfreezes the adapted
projections inside the transformer layers. Each case builds the model twice from
one seed (the control is never checkpointed), gives the adapters non-zero values
(a fresh adapter's `B` is zero, which would leave `A` without gradient), and checks
that blocks are placed where the adapters' gradients need the layers' activations,
that the adapter gradients equal the control's eagerly and under `tf.function`, and
that `fit` moves the adapters as the control's and leaves every frozen weight where
it was. The same under `mixed_bfloat16` and `mixed_float16`, and without LoRA under
both. What a control computes is computed once per module (NOTE [ Shared controls ]).
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


MIXED_POLICIES = ("mixed_bfloat16", "mixed_float16")


@pytest.fixture
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


# NOTE [ Shared controls ]
# A control is never checkpointed, so the cases that differ only in the checkpointed
# model's order (`lora_first`, `recompute_first`) or in the mode it runs in build the
# same control from the same seed and compute the same numbers with it. Each is computed
# once per module, in the order a case computes it (runs, then `fit`; or `fit` alone),
# and kept as numbers; so is the checkpointed model of the gradient test, whose runs
# each restore its seed states first and change no weight. The fit tests build their
# checkpointed models afresh.


@pytest.fixture(scope="module")
def shared() -> dict[tuple[Any, ...], Any]:
    """What the cases of this module share, by what it is (NOTE [ Shared controls ])."""
    return {}


def _run(model: keras.Model, x: Any, seeds: Any, trained: Any, mode: str) -> list[np.ndarray]:
    """Outputs then gradients of `trained(model)`, from the seed states `seeds`."""
    load_state(model.non_trainable_variables, seeds)
    flat = [tf.convert_to_tensor(v) for v in keras.tree.flatten(x)]
    return forward_and_grads(model_runner(model, x), flat, trained(model), mode)


def _control_runs(shared: dict, name: str, *, lora: bool = True) -> tuple[keras.Model, Any, dict]:
    """The control of `name` under the current dtype policy: the model, its seed states
    as built and its runs by mode (eager, then `tf.function`)."""
    key = ("runs", name, lora, keras.config.dtype_policy().name)
    if key not in shared:
        control, x, _, _ = _build(name, "after", checkpointed=False, lora=lora)
        seeds = save_state(control.non_trainable_variables)
        trained = _adapters if lora else _trainable
        shared[key] = (
            control,
            seeds,
            {mode: _run(control, x, seeds, trained, mode) for mode in MODES},
        )
    return shared[key]


def _trainable(model: keras.Model) -> list[Any]:
    return model.trainable_variables


# The bound on float32 rounding noise: about 84 float32 ulps (eps = 1.2e-7) of each
# tensor's scale; a wrong gradient is off by a fraction of its own size (a block's
# recompute scaled by 1.001: 1e-3).
FLOAT32_NOISE = 1e-5


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("order", ["before", "after"], ids=["lora_first", "recompute_first"])
@pytest.mark.parametrize("name", list(MODELS))
def test_adapter_gradients_equal_the_control(name, order, mode, shared):
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
    if ("model", name, order) not in shared:
        shared["model", name, order] = _build(name, order, checkpointed=True)[:2]
    model, x = shared["model", name, order]
    _, seeds, want = _control_runs(shared, name)
    assert _recomputing(model, x) >= 2  # the frozen transformer layers are checkpointed
    spread = max(error for error, _ in _per_tensor_errors(want["function"], want["eager"]))
    assert spread <= 1e-4, f"the control alone: eager vs tf.function differ by {spread:.3g}"
    got = _run(model, x, seeds, _adapters, mode)
    assert_close_per_tensor(got, want[mode], rtol=max(2 * spread, FLOAT32_NOISE))
    assert any(np.abs(g).max() > 0 for g in got[-len(_adapters(model)) :])


@pytest.mark.parametrize("order", ["before", "after"], ids=["lora_first", "recompute_first"])
@pytest.mark.parametrize("name", list(MODELS))
def test_fit_moves_the_adapters_as_the_control_and_nothing_else(name, order, shared):
    model, x, y, _ = _build(name, order, checkpointed=True)
    if ("fit", name) not in shared:  # the control as built, fitted
        control = _build(name, order, checkpointed=False)[0]
        control.fit(x, y, batch_size=1, epochs=2, shuffle=False, verbose=0)
        shared["fit", name] = save_state(control.weights)
    frozen = [v for v in model.weights if not v.trainable and "seed_generator" not in v.path]
    frozen_before, adapters_before = save_state(frozen), save_state(_adapters(model))
    model.fit(x, y, batch_size=1, epochs=2, shuffle=False, verbose=0)
    weights = save_state(model.weights)
    assert len(weights) == len(shared["fit", name])
    for got, want in zip(weights, shared["fit", name]):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for variable, before, after in zip(frozen, frozen_before, save_state(frozen)):
        np.testing.assert_array_equal(after, before, err_msg=variable.path)
    assert any(not np.allclose(a, b) for a, b in zip(save_state(_adapters(model)), adapters_before))


# Every model with LoRA under both policies, and Gemma with LoRA first (the order
# keras-hub's fine-tuning guides use); without LoRA one model under each policy (suite
# time). Without LoRA, Llama under both policies is in test_any_model.py.
MIXED_CASES = [
    *((name, True, "after", policy) for name in MODELS for policy in MIXED_POLICIES),
    *(("gemma_causal_lm", True, "before", policy) for policy in MIXED_POLICIES),
    ("bert_classifier", False, "after", "mixed_bfloat16"),
    ("gemma_causal_lm", False, "after", "mixed_float16"),
]


@pytest.mark.parametrize(
    ("name", "lora", "order", "mixed_policy"),
    MIXED_CASES,
    ids=[
        f"{policy}-{name}-{('lora_first' if order == 'before' else 'lora') if lora else 'no_lora'}"
        for name, lora, order, policy in MIXED_CASES
    ],
    indirect=["mixed_policy"],
)
def test_under_a_mixed_policy_trains_as_the_control(name, lora, order, mixed_policy, shared):
    """Each model under `mixed_bfloat16` and `mixed_float16` with LoRA after recompute,
    the Gemma causal LM also before; two models without LoRA, one policy each.

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
    trained = _adapters if lora else _trainable
    control, seeds, runs = _control_runs(shared, name, lora=lora)  # seeds: BERT's Dropout
    spread = max(error for error, _ in _per_tensor_errors(runs["eager"], runs["function"]))
    assert spread < 0.1  # a comparison that can still fail
    rtol = max(2 * spread, 1e-5)
    got = _run(model, x, seeds, trained, "function")
    assert_close_per_tensor(got, runs["function"], rtol=rtol)
    frozen = [v for v in model.weights if not v.trainable and "seed_generator" not in v.path]
    frozen_before = save_state(frozen)
    model.fit(x, y, batch_size=1, epochs=2, shuffle=False, verbose=0)
    key = ("fitted", name, lora, mixed_policy)
    if key not in shared:  # after its runs, as the model is
        control.fit(x, y, batch_size=1, epochs=2, shuffle=False, verbose=0)
        shared[key] = save_state(trained(control))
    for variable, before, after in zip(frozen, frozen_before, save_state(frozen)):
        np.testing.assert_array_equal(after, before, err_msg=variable.path)
    assert_close_per_tensor(save_state(trained(model)), shared[key], rtol=rtol)


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
