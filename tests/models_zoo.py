"""Small real models for the whole-model tests: an MLP, CNNs, a Transformer encoder, a U-Net."""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf


def tanh_mlp(*, depth: int = 8, width: int = 32, dropout: bool = True) -> keras.Sequential:
    """`depth` Dense(width, tanh), each followed by Dropout(0.2) if `dropout`; then Dense(3)."""
    layers: list[keras.layers.Layer] = []
    for _ in range(depth):
        layers.append(keras.layers.Dense(width, activation="tanh"))
        if dropout:
            layers.append(keras.layers.Dropout(0.2))
    return keras.Sequential([keras.Input((width,)), *layers, keras.layers.Dense(3)])


def transformer_encoder(
    *,
    layers: int = 4,
    sequence: int = 32,
    hidden: int = 64,
    heads: int = 4,
    vocab: int = 100,
    dropout: float = 0.1,
) -> keras.Model:
    """A BERT-style encoder: embeddings, then attention + MLP blocks with residual adds."""
    ids = keras.Input((sequence,), dtype="int32", name="ids")
    x = keras.layers.Embedding(vocab, hidden)(ids)
    for _ in range(layers):
        attention = keras.layers.MultiHeadAttention(heads, hidden // heads, dropout=dropout)(x, x)
        attention = keras.layers.Dropout(dropout)(attention)
        x = keras.layers.LayerNormalization()(keras.layers.Add()([x, attention]))
        mlp = keras.layers.Dense(4 * hidden, activation="gelu")(x)
        mlp = keras.layers.Dense(hidden)(mlp)
        mlp = keras.layers.Dropout(dropout)(mlp)
        x = keras.layers.LayerNormalization()(keras.layers.Add()([x, mlp]))
    pooled = keras.layers.GlobalAveragePooling1D()(x)
    return keras.Model(ids, keras.layers.Dense(2)(pooled), name="encoder")


def unet(*, size: int = 32, channels: int = 3, base: int = 8, depth: int = 3) -> keras.Model:
    """A U-Net: each encoder stage's output reaches its decoder stage through a long skip."""
    inputs = keras.Input((size, size, channels), name="image")
    x = inputs
    skips = []
    for level in range(depth):
        x = keras.layers.Conv2D(base * 2**level, 3, padding="same", activation="relu")(x)
        x = keras.layers.BatchNormalization()(x)
        x = keras.layers.Conv2D(base * 2**level, 3, padding="same", activation="relu")(x)
        skips.append(x)
        x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.Conv2D(base * 2**depth, 3, padding="same", activation="relu")(x)
    x = keras.layers.Dropout(0.2)(x)
    for level in reversed(range(depth)):
        x = keras.layers.UpSampling2D()(x)
        x = keras.layers.Concatenate()([x, skips[level]])
        x = keras.layers.Conv2D(base * 2**level, 3, padding="same", activation="relu")(x)
    return keras.Model(inputs, keras.layers.Conv2D(1, 1)(x), name="unet")


def resnet50(size: int = 64) -> keras.Model:
    return keras.applications.ResNet50(weights=None, input_shape=(size, size, 3), classes=10)


def mobilenet_v2(size: int = 64) -> keras.Model:
    return keras.applications.MobileNetV2(weights=None, input_shape=(size, size, 3), classes=10)


def synthetic_batch(model: keras.Model, batch: int, *, seed: int = 0):  # noqa: ANN201
    """Random inputs (token ids below 50 for integer inputs) and a target for `model`."""
    rng = np.random.default_rng(seed)
    inputs = []
    for tensor in model.inputs:
        shape = (batch, *tensor.shape[1:])
        if "int" in str(tensor.dtype):
            inputs.append(rng.integers(0, 50, size=shape).astype("int32"))
        else:
            inputs.append(rng.normal(size=shape).astype("float32"))
    target = rng.normal(size=(batch, *model.outputs[0].shape[1:])).astype("float32")
    return inputs[0] if len(inputs) == 1 else inputs, target


class Untraceable(keras.Model):
    """A subclassed model whose call branches on a tensor value: not traceable."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(2)

    def call(self, x):
        if float(tf.reduce_sum(x)) > 0:
            return self.dense(x)
        return x
