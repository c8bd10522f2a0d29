"""LoRA fine-tuning with checkpointing: keras-hub's `enable_lora` before or after `recompute`.

`enable_lora` freezes every layer of the backbone and unfreezes the adapted
projections inside the transformer layers. Each case builds the model twice from
one seed (the control is never checkpointed), gives the adapters non-zero values
(a fresh adapter's `B` is zero, which would leave `A` without gradient), and checks
that blocks are placed where the adapters' gradients need the layers' activations,
that the adapter gradients equal the control's eagerly and under `tf.function`, and
that `fit` moves the adapters as the control's and leaves every frozen weight where
it was.
"""

from __future__ import annotations

from typing import Any

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf

import tfrecompute
from tests import any_models
from tests.helpers import MODES, forward_and_grads, model_runner, recomputed_blocks, save_state

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


MODELS = {"llama": _llama, "bert_classifier": _bert_classifier}


def _build(name: str, order: str, checkpointed: bool) -> tuple[keras.Model, Any, Any, Any]:
    keras.utils.set_random_seed(0)
    model, backbone, x, y, loss = MODELS[name]()
    model(x)
    if checkpointed and order == "after":
        tfrecompute.recompute(model, "sqrt", sample=x)
    backbone.enable_lora(RANK)
    rng = np.random.default_rng(2)
    for variable in backbone.trainable_variables:
        if "lora_kernel" in variable.path:
            variable.assign(rng.normal(scale=0.1, size=variable.shape).astype("float32"))
    if checkpointed and order == "before":
        tfrecompute.recompute(model, "sqrt", sample=x)
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.5), loss=loss)
    return model, x, y, backbone


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


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("order", ["before", "after"], ids=["lora_first", "recompute_first"])
@pytest.mark.parametrize("name", list(MODELS))
def test_adapter_gradients_equal_the_control(name, order, mode):
    model, x, _, _ = _build(name, order, checkpointed=True)
    control, _, _, _ = _build(name, order, checkpointed=False)
    assert _recomputing(model, x) >= 2  # the frozen transformer layers are checkpointed
    flat = [tf.convert_to_tensor(v) for v in keras.tree.flatten(x)]
    got = forward_and_grads(model_runner(model, x), flat, _adapters(model), mode)
    want = forward_and_grads(model_runner(control, x), flat, _adapters(control), mode)
    assert len(got) == len(want)
    for index, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=str(index))
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
