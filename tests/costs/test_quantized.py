"""int8-quantized kernels with LoRA adapters: what their backward keeps, and training them.

Keras's int8 `Dense` dequantizes its kernel in its custom gradient from the
variables alone, so TensorFlow computes it in the forward and holds it until
the layer's backward (NOTE [ Gradient ops that run early ] in
costs/call_memory.py). Compared with the requested peaks of traced steps.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfrecompute
from tests.helpers import MODES, forward_and_grads, highest_requested_trace, model_runner
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
        model.quantize("int8")
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
