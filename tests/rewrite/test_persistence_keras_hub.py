"""keras-hub models checkpointed by `recompute()` save, resume, export and exchange
weights as without checkpointing, and a task stays the task.

Before a checkpointed model was the model itself, `recompute()` returned a plain
Functional model of the backbone's layers: Qwen3 and DeiT could not be loaded from
its `.keras` file, nor GPT2CausalLM, which had lost `generate` and `score`. Each case
here is compared with the same model built without checkpointing (equal weights),
CI-sized, random init.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf

import tfrecompute
from tests import multiworker_worker as worker
from tests.helpers import applied_blocks, assert_same_weights, recomputed_blocks

pytestmark = pytest.mark.usefixtures("collect_garbage")  # see tests/conftest.py

RNG = np.random.default_rng(0)
BATCH, SEQUENCE, VOCABULARY = 4, 8, 64


def _tokens() -> dict[str, np.ndarray]:
    return {
        "token_ids": RNG.integers(1, VOCABULARY, (BATCH, SEQUENCE)).astype("int32"),
        "padding_mask": np.ones((BATCH, SEQUENCE), "int32"),
    }


def qwen3() -> tuple[keras.Model, Any, Any, Any]:
    model = keras_hub.models.Qwen3Backbone(
        vocabulary_size=VOCABULARY, num_layers=2, num_query_heads=2, num_key_value_heads=1,
        head_dim=8, hidden_dim=16, intermediate_dim=32,
    )  # fmt: skip
    y = RNG.normal(size=(BATCH, SEQUENCE, 16)).astype("float32")
    return model, _tokens(), y, "mse"


def deit() -> tuple[keras.Model, Any, Any, Any]:
    model = keras_hub.models.DeiTBackbone(
        image_shape=(16, 16, 3), patch_size=4, num_layers=2, num_heads=2, hidden_dim=16,
        intermediate_dim=32, dropout_rate=0.1,
    )  # fmt: skip
    x = RNG.normal(size=(BATCH, 16, 16, 3)).astype("float32")
    y = RNG.normal(size=(BATCH, 18, 16)).astype("float32")
    return model, x, y, "mse"


def gpt2_causal_lm() -> tuple[keras.Model, Any, Any, Any]:
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCABULARY, num_layers=2, num_heads=2, hidden_dim=16,
        intermediate_dim=32, max_sequence_length=16,
    )  # fmt: skip
    model = keras_hub.models.GPT2CausalLM(backbone, preprocessor=None)
    y = RNG.integers(1, VOCABULARY, (BATCH, SEQUENCE)).astype("int32")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return model, _tokens(), y, loss


def bert_classifier() -> tuple[keras.Model, Any, Any, Any]:
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=VOCABULARY, num_layers=2, num_heads=2, hidden_dim=16,
        intermediate_dim=32, max_sequence_length=16,
    )  # fmt: skip
    model = keras_hub.models.BertTextClassifier(backbone, num_classes=2, preprocessor=None)
    x = {**_tokens(), "segment_ids": np.zeros((BATCH, SEQUENCE), "int32")}
    y = RNG.integers(0, 2, BATCH)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return model, x, y, loss


# How each is checkpointed (default: the default plan).
_OPTIONS: dict[str, dict[str, Any]] = {
    "bert_classifier": {"strategy": "uniform:2"},
}

MODELS: dict[str, Callable[[], tuple[keras.Model, Any, Any, Any]]] = {
    "qwen3": qwen3,
    "deit": deit,
    "gpt2_causal_lm": gpt2_causal_lm,
    "bert_classifier": bert_classifier,
}


def _optimizer() -> keras.optimizers.Optimizer:
    """SGD with momentum: an optimizer with state. Adam would turn the float noise of
    gradients that are mathematically zero (different in the last bits from run to run
    of the same model, as TensorFlow's threads sum in another order) into whole steps,
    and the models would part by more than float noise after a few steps."""
    return keras.optimizers.SGD(1e-2, momentum=0.9)


def _build(name: str, *, checkpointed: bool, strategy: Any = None) -> tuple[keras.Model, Any, Any]:
    with (strategy or tf.distribute.get_strategy()).scope():
        keras.utils.set_random_seed(0)
        model, x, y, loss = MODELS[name]()
        model(x)
        model.compile(optimizer=_optimizer(), loss=loss)
    if checkpointed:
        _checkpoint(name, model, x)
    return model, x, y


def _checkpoint(name: str, model: keras.Model, x: Any) -> None:
    options = dict(_OPTIONS.get(name, {}))
    assert tfrecompute.recompute(model, options.pop("strategy", None), sample=x, **options) is model

    def run() -> None:
        with tf.GradientTape():
            model(x, training=True)

    assert applied_blocks(model) and recomputed_blocks(model, run) > 0


def _pair(name: str, strategy: Any = None) -> tuple[keras.Model, keras.Model, Any, Any]:
    model, x, y = _build(name, checkpointed=True, strategy=strategy)
    control, _, _ = _build(name, checkpointed=False, strategy=strategy)
    control.set_weights(model.get_weights())
    return model, control, x, y


def _same_dropout_streams(loaded: keras.Model, loaded_control: keras.Model) -> None:
    """keras-hub's Dropout layers take no seed, and a `.keras` load gives each a new one
    (Keras 3.15, without checkpointing too): the control draws the model's masks."""
    for a, b in zip(loaded.variables, loaded_control.variables):
        if "seed_generator_state" in a.path:
            b.assign(a)


def _fit(model: keras.Model, x: Any, y: Any, epochs: int = 1) -> None:
    model.fit(x, y, batch_size=2, epochs=epochs, shuffle=False, verbose=0)


@pytest.mark.parametrize("name", list(MODELS))
def test_the_keras_file_loads_and_training_resumes_as_without_checkpointing(name, tmp_path):
    model, control, x, y = _pair(name)
    for m in (model, control):
        _fit(m, x, y, 2)
    assert_same_weights(model, control)
    model.save(tmp_path / "model.keras")
    control.save(tmp_path / "control.keras")
    loaded = keras.models.load_model(tmp_path / "model.keras")
    loaded_control = keras.models.load_model(tmp_path / "control.keras")
    assert type(loaded) is type(model) and not tfrecompute.checkpoints(loaded)
    _same_dropout_streams(loaded, loaded_control)
    _checkpoint(name, loaded, x)
    for m in (loaded, loaded_control):
        if not m.compiled:  # a keras-hub task's custom compile is not restored from the file
            m.compile(optimizer=_optimizer(), loss=model.loss)
        _fit(m, x, y, 1)
    assert_same_weights(loaded, loaded_control)


@pytest.mark.parametrize("name", list(MODELS))
def test_weights_move_between_the_model_and_its_control_both_ways(name, tmp_path):
    model, control, x, y = _pair(name)
    _fit(model, x, y)
    model.save_weights(tmp_path / "model.weights.h5")
    control.load_weights(tmp_path / "model.weights.h5")
    assert_same_weights(control, model)
    _fit(control, x, y)
    control.save_weights(tmp_path / "control.weights.h5")
    model.load_weights(tmp_path / "control.weights.h5")
    assert_same_weights(model, control)


@pytest.mark.parametrize("name", list(MODELS))
def test_tf_train_checkpoint_restores_the_model_and_its_optimizer(name, tmp_path):
    model, control, x, y = _pair(name)
    _fit(model, x, y)
    checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
    path = checkpoint.save(tmp_path / "model")
    variables = [
        v for v in [*model.variables, *model.optimizer.variables]
        if "seed_generator_state" not in v.path  # Keras does not track them (test_persistence)
    ]  # fmt: skip
    saved = [np.array(v.numpy()) for v in variables]
    for v in variables:
        v.assign(tf.cast(tf.fill(v.shape, 3), v.dtype))
    checkpoint.restore(path).assert_existing_objects_matched()
    for v, value in zip(variables, saved):
        np.testing.assert_array_equal(v.numpy(), value, err_msg=v.path)
    # The plain model's checkpoint restores into the checkpointed one: the same names.
    _fit(control, x, y)
    tf.train.Checkpoint(model=model).restore(
        tf.train.Checkpoint(model=control).save(tmp_path / "control")
    ).assert_existing_objects_matched()
    assert_same_weights(model, control)


def test_an_export_serves_what_the_control_serves(tmp_path):
    model, control, x, y = _pair("qwen3")
    _fit(model, x, y)
    control.set_weights(model.get_weights())
    model.export(tmp_path / "export", verbose=False)
    served = tf.saved_model.load(str(tmp_path / "export"))
    np.testing.assert_allclose(served.serve(x), control(x), atol=1e-5)


def test_a_causal_lm_still_generates_and_scores_as_the_control():
    model, control, x, y = _pair("gpt2_causal_lm")
    assert isinstance(model, keras_hub.models.GPT2CausalLM) and model.backbone is not None
    _fit(model, x, y)
    control.set_weights(model.get_weights())
    prompt = {"token_ids": x["token_ids"], "padding_mask": np.zeros_like(x["padding_mask"])}
    prompt["padding_mask"][:, :3] = 1
    got = model.generate(prompt, max_length=SEQUENCE, stop_token_ids=None)
    want = control.generate(prompt, max_length=SEQUENCE, stop_token_ids=None)
    np.testing.assert_array_equal(got["token_ids"], want["token_ids"])
    np.testing.assert_allclose(
        model.score(x["token_ids"], x["padding_mask"]),
        control.score(x["token_ids"], x["padding_mask"]),
        atol=1e-5,
    )
    _fit(model, x, y)  # generating left the checkpointed training as it was
    assert recomputed_blocks(model, lambda: _taped(model, x)) > 0


def _taped(model: keras.Model, x: Any) -> None:
    with tf.GradientTape():
        model(x, training=True)


def test_under_mirrored_strategy_the_keras_file_loads_and_training_resumes(tmp_path):
    strategy = worker.mirrored_strategy(["CPU:0", "CPU:1"])
    model, control, x, y = _pair("qwen3", strategy=strategy)
    for m in (model, control):
        _fit(m, x, y, 1)
    assert_same_weights(model, control)
    model.save(tmp_path / "model.keras")
    control.save(tmp_path / "control.keras")
    with strategy.scope():
        loaded = keras.models.load_model(tmp_path / "model.keras")
        loaded_control = keras.models.load_model(tmp_path / "control.keras")
    _same_dropout_streams(loaded, loaded_control)
    _checkpoint("qwen3", loaded, x)  # outside the scope, as a user may call it
    for m in (loaded, loaded_control):
        _fit(m, x, y, 1)
    assert_same_weights(loaded, loaded_control)
