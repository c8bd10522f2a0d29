"""Quantized kernels (int8 with LoRA adapters, float8): what their backward keeps, and training.

Keras's int8 `Dense` dequantizes its kernel in its custom gradient from the
variables alone, so TensorFlow computes it in the forward and holds it until
the layer's backward (NOTE [ Gradient ops that run early ] in
costs/call_memory.py). Compared with the requested peaks of traced steps.

keras-hub backbones: a GPT-2 quantized to int8 with LoRA adapters (how large
models are fine-tuned on small cards) and one quantized to float8 (Keras
3.15's float8 layers refuse LoRA: "`_float8_call` doesn't support LoRA"),
checkpointed, have the gradients of the same model without checkpointing
(int8 + LoRA also its `fit`), and the default plan keeps at most half of its
step memory at batch 8, sequence 64, hidden 64, 4 layers.
"""

from __future__ import annotations

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf

import tfrecompute
from tests.helpers import (
    MODES,
    applied_blocks,
    assert_same_adamw_fit,
    forward_and_grads,
    highest_requested_trace,
    load_state,
    model_runner,
    quantize,
    save_state,
)
from tfrecompute import strategies

WIDTH, BATCH, DEPTH = 1024, 256, 8
KERNEL = WIDTH * WIDTH * 4  # a dequantized kernel, float32


def _quantized(seed: int = 0) -> keras.Model:
    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [
            keras.Input((WIDTH,)),
            *[keras.layers.Dense(WIDTH, activation="gelu") for _ in range(DEPTH)],
        ]
    )
    with pytest.warns(UserWarning, match="InputLayer does not have a `quantize` method"):
        quantize(model, "int8")
    rng = np.random.default_rng(seed)
    for layer in model.layers:
        layer.enable_lora(4)
        layer.lora_kernel_b.assign(rng.normal(scale=0.1, size=layer.lora_kernel_b.shape))
    model.compile(optimizer="sgd", loss="mse")
    return model


def _batch():
    rng = np.random.default_rng(1)
    return rng.random((BATCH, WIDTH), dtype=np.float32), rng.random(
        (BATCH, WIDTH), dtype=np.float32
    )


def test_each_dequantized_kernel_is_kept_and_the_peak_predicted():
    model = _quantized()
    x, y = _batch()
    chain = tfrecompute.profile(model, batch_size=BATCH)
    assert all(saved >= KERNEL for saved in chain.saved_bytes)
    measured = highest_requested_trace(model, x, y).requested_peak_bytes
    predicted = strategies.none(chain).peak_bytes
    assert abs(predicted / measured - 1) <= 0.15, (predicted, measured)
    tfrecompute.recompute(model, sample=(x, y))
    assert tfrecompute.checkpoints(model).plan.segments
    assert highest_requested_trace(model, x, y).requested_peak_bytes <= 0.5 * measured


@pytest.mark.parametrize("mode", MODES)
def test_adapter_gradients_through_quantized_blocks_equal_the_plain_model(mode):
    model, control = _quantized(), _quantized()
    x, _ = _batch()
    tfrecompute.recompute(model, "sqrt", sample=x)
    flat = [tf.convert_to_tensor(x)]
    got = forward_and_grads(model_runner(model, x), flat, model.trainable_variables, mode)
    want = forward_and_grads(model_runner(control, x), flat, control.trainable_variables, mode)
    assert len(got) == len(want) == 1 + 3 * DEPTH + 1  # output, LoRA A and B and bias, input
    for index, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=str(index))


# ------------------------------------------------------------ keras-hub backbones


def _hub_gpt2(
    mode: str, *, batch: int, sequence: int, hidden: int, layers: int = 2, seed: int = 0
) -> tuple:
    """A GPT-2 backbone quantized to `mode`; under int8 with LoRA adapters (their `B`
    set non-zero: a fresh one is zero and would leave `A` without gradient)."""
    keras.utils.set_random_seed(seed)
    model = keras_hub.models.GPT2Backbone(
        vocabulary_size=1000, num_layers=layers, num_heads=4, hidden_dim=hidden,
        intermediate_dim=4 * hidden, max_sequence_length=sequence,
    )  # fmt: skip
    rng = np.random.default_rng(seed)
    x = {
        "token_ids": rng.integers(1, 1000, (batch, sequence)).astype("int32"),
        "padding_mask": np.ones((batch, sequence), "int32"),
    }
    model(x)
    quantize(model, mode)
    if mode == "int8":
        model.enable_lora(4)
        for variable in model.trainable_variables:
            if "lora_kernel_b" in variable.path:
                variable.assign(rng.normal(scale=0.1, size=variable.shape))
    y = rng.normal(size=(batch, sequence, hidden)).astype("float32")
    return model, x, y


HUB_MODES = ["int8", "float8"]


@pytest.mark.parametrize(
    ("quantized", "mode"), [("int8", mode) for mode in MODES] + [("float8", "function")]
)
def test_a_quantized_keras_hub_backbone_has_the_gradients_of_the_control(quantized, mode):
    """Outputs and the gradients of what trains (int8: the adapters and what
    `enable_lora` leaves trainable; float8: every kernel) equal the same backbone
    without checkpointing; the float8 amax histories (state updated by each
    forward) too. Eagerly, Keras 3.15's float8 layers cannot be differentiated
    without checkpointing either (their custom gradient is handed `variables=`
    and returns one list: "too many values to unpack"); `fit` runs them under
    `tf.function`."""
    model, x, _ = _hub_gpt2(quantized, batch=2, sequence=16, hidden=32)
    control, _, _ = _hub_gpt2(quantized, batch=2, sequence=16, hidden=32)
    if quantized == "int8":
        assert sum("lora_kernel" in v.path for v in model.trainable_variables) >= 2 * 2
    tfrecompute.recompute(model, "sqrt", sample=x)
    assert applied_blocks(model)
    flat = [tf.convert_to_tensor(v) for v in keras.tree.flatten(x)]
    got = forward_and_grads(model_runner(model, x), flat, model.trainable_variables, mode)
    want = forward_and_grads(model_runner(control, x), flat, control.trainable_variables, mode)
    assert len(got) == len(want)
    for index, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=str(index))
    for g, w in zip(
        save_state(model.non_trainable_variables), save_state(control.non_trainable_variables)
    ):
        np.testing.assert_array_equal(g, w)


def test_an_int8_lora_keras_hub_backbone_fits_as_the_control():
    model, x, y = _hub_gpt2("int8", batch=8, sequence=16, hidden=32)
    control, _, _ = _hub_gpt2("int8", batch=8, sequence=16, hidden=32)
    tfrecompute.recompute(model, "sqrt", sample=x)
    assert applied_blocks(model)
    assert_same_adamw_fit([model, control], x, y, epochs=2)


@pytest.mark.slow
@pytest.mark.parametrize("quantized", HUB_MODES)
def test_a_quantized_keras_hub_backbone_keeps_less_than_storing_everything(quantized):
    """At batch 8, sequence 64, hidden 64 (where the CPU allocator sees the
    step's tensors): the default plan's traced step requests at most half of
    what storing everything does."""
    model, x, y = _hub_gpt2(quantized, batch=8, sequence=64, hidden=64, layers=4)
    model.compile(optimizer="adam", loss="mse")
    state = save_state(model.non_trainable_variables)
    stored = highest_requested_trace(model, x, y).requested_peak_bytes
    load_state(model.non_trainable_variables, state)
    tfrecompute.recompute(model, sample=(x, y))
    assert len(applied_blocks(model)) >= 2
    assert highest_requested_trace(model, x, y).requested_peak_bytes <= 0.5 * stored


# ------------------------------------------- post-norm encoders: links at unread tensors


def _int8_bert(*, batch: int, sequence: int, hidden: int, layers: int = 3, seed: int = 0):
    """A BERT backbone with int8 kernels, without LoRA: what trains is the biases and
    the norms (an adapter's `A` reads its layer's input, which ends a link anyway)."""
    keras.utils.set_random_seed(seed)
    model = keras_hub.models.BertBackbone(
        vocabulary_size=100, num_layers=layers, num_heads=2, hidden_dim=hidden,
        intermediate_dim=2 * hidden, max_sequence_length=sequence,
    )  # fmt: skip
    rng = np.random.default_rng(seed)
    x = {
        "token_ids": rng.integers(1, 100, (batch, sequence)).astype("int32"),
        "padding_mask": np.ones((batch, sequence), "int32"),
        "segment_ids": np.zeros((batch, sequence), "int32"),
    }
    model(x)
    with pytest.warns(UserWarning, match="does not have a `quantize` method"):
        quantize(model, "int8")
    return model, x


def _fnet(layers: int = 3):
    keras.utils.set_random_seed(0)
    model = keras_hub.models.FNetBackbone(
        vocabulary_size=100, num_layers=layers, hidden_dim=32, intermediate_dim=64,
        max_sequence_length=16,
    )  # fmt: skip
    rng = np.random.default_rng(0)
    x = {
        "token_ids": rng.integers(1, 100, (2, 16)).astype("int32"),
        "segment_ids": np.zeros((2, 16), "int32"),
    }
    return model, x


def test_a_post_norm_int8_encoder_and_fnet_get_a_link_per_layer():
    """No backward reads a post-norm int8 encoder layer's output (the next layer's
    int8 projections read their kernels only) nor an FNet layer's (Fourier mixing):
    each layer still ends a link (NOTE [ Links of the chain ]), priced with its
    output kept besides what it keeps, and a plan has somewhere to cut."""
    model, x = _int8_bert(batch=2, sequence=16, hidden=32)
    fnet, tokens = _fnet()
    for built, sample, layer in ((model, x, "transformer_layer"), (fnet, tokens, "f_net_layer")):
        chain = tfrecompute.profile(built, sample=sample)
        ends = [name.split("+")[-1] for name in chain.names]
        assert [end for end in ends if end.startswith(layer)] == [f"{layer}_{i}" for i in range(3)]
        assert tfrecompute.plan(built, "sqrt", sample=sample).segments


@pytest.mark.parametrize("mode", MODES)
def test_blocks_at_unread_tensors_have_the_gradients_of_the_control(mode):
    """Blocks starting at the second and third layers' inputs, outputs no backward reads
    (the links that end there are the split ones), train as the control."""
    model, x = _int8_bert(batch=2, sequence=16, hidden=32)
    control, _ = _int8_bert(batch=2, sequence=16, hidden=32)
    chain = tfrecompute.profile(model, sample=x)
    starts = [chain.names.index(f"transformer_layer_{i}") for i in (1, 2)]
    plan = strategies.Plan.from_segments(chain, [(start, start + 1) for start in starts])
    tfrecompute.recompute(model, plan)
    assert len(applied_blocks(model)) == 2
    flat = [tf.convert_to_tensor(v) for v in keras.tree.flatten(x)]
    state = save_state(model.non_trainable_variables)
    got = forward_and_grads(model_runner(model, x), flat, model.trainable_variables, mode)
    load_state(control.non_trainable_variables, state)
    want = forward_and_grads(model_runner(control, x), flat, control.trainable_variables, mode)
    for index, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=str(index))


@pytest.mark.slow
def test_a_post_norm_int8_encoder_keeps_less_than_storing_everything():
    """BERT with int8 kernels, 4 layers, batch 8, sequence 128, hidden 128: the
    default plan's traced step requests at most half of storing everything's, and
    storing everything is predicted within 15% (over, by a layer output per layer)."""
    model, x = _int8_bert(batch=8, sequence=128, hidden=128, layers=4)
    y = {
        "sequence_output": np.zeros((8, 128, 128), "float32"),
        "pooled_output": np.zeros((8, 128), "float32"),
    }
    model.compile(optimizer="adam", loss="mse")
    chain = tfrecompute.profile(model, sample=(x, y))
    state = save_state(model.non_trainable_variables)
    stored = highest_requested_trace(model, x, y).requested_peak_bytes
    assert abs(strategies.none(chain).peak_bytes / stored - 1) <= 0.15
    load_state(model.non_trainable_variables, state)
    tfrecompute.recompute(model, sample=(x, y))
    assert len(applied_blocks(model)) >= 2
    assert highest_requested_trace(model, x, y).requested_peak_bytes <= 0.5 * stored
