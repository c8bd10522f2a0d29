"""Models nobody here designed, and the common styles of Keras code, CI-sized.

keras-hub backbones as built (random init, no downloads), a subclassed
transformer model that loops over a list of blocks, a subclassed layer that
holds a `keras.Sequential`, and a Functional model that calls a nested
Functional backbone once. Each entry builds the model and a sample batch
`(x, y)` for it. `MORE_MODELS` (ALBERT's shared layer, Llama, T5's
encoder-decoder, a layer called twice, a masked LSTM, two
`keras.applications`) are checked for exactness only: their `y` is None.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import keras_hub
import numpy as np


def _tokens(batch: int, sequence: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "token_ids": rng.integers(1, 100, (batch, sequence)).astype("int32"),
        "padding_mask": np.ones((batch, sequence), "int32"),
    }


def bert(*, layers: int = 2, hidden: int = 64, sequence: int = 32, batch: int = 4) -> Any:
    model = keras_hub.models.BertBackbone(
        vocabulary_size=100,
        num_layers=layers,
        num_heads=2,
        hidden_dim=hidden,
        intermediate_dim=2 * hidden,
        max_sequence_length=max(64, sequence),
    )
    x = {**_tokens(batch, sequence), "segment_ids": np.zeros((batch, sequence), "int32")}
    rng = np.random.default_rng(1)
    y = {
        "pooled_output": rng.normal(size=(batch, hidden)).astype("float32"),
        "sequence_output": rng.normal(size=(batch, sequence, hidden)).astype("float32"),
    }
    return model, (x, y)


def gpt2(*, layers: int = 2, hidden: int = 64, sequence: int = 32, batch: int = 4) -> Any:
    model = keras_hub.models.GPT2Backbone(
        vocabulary_size=100,
        num_layers=layers,
        num_heads=2,
        hidden_dim=hidden,
        intermediate_dim=2 * hidden,
        max_sequence_length=max(64, sequence),
    )
    y = np.random.default_rng(1).normal(size=(batch, sequence, hidden)).astype("float32")
    return model, (_tokens(batch, sequence), y)


def vit(*, layers: int = 4, hidden: int = 64, image: int = 32, batch: int = 4) -> Any:
    model = keras_hub.models.ViTBackbone(
        image_shape=(image, image, 3),
        patch_size=8,
        num_layers=layers,
        num_heads=2,
        hidden_dim=hidden,
        mlp_dim=2 * hidden,
    )
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, image, image, 3)).astype("float32")
    y = rng.normal(size=(batch, (image // 8) ** 2 + 1, hidden)).astype("float32")
    return model, (x, y)


@keras.saving.register_keras_serializable(package="tfrecompute_tests")
class Block(keras.layers.Layer):
    """A pre-norm transformer block written as research code writes it."""

    def __init__(self, hidden: int, heads: int, dropout: float = 0.1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.hidden, self.heads, self.dropout_rate = hidden, heads, dropout
        self.norm_1 = keras.layers.LayerNormalization()
        self.attention = keras.layers.MultiHeadAttention(heads, hidden // heads, dropout=dropout)
        self.norm_2 = keras.layers.LayerNormalization()
        self.up = keras.layers.Dense(2 * hidden, activation="gelu")
        self.down = keras.layers.Dense(hidden)
        self.dropout = keras.layers.Dropout(dropout)

    def call(self, x: Any, training: Any = None) -> Any:
        h = self.norm_1(x)
        x = x + self.attention(h, h, training=training)
        h = self.down(self.up(self.norm_2(x)))
        return x + self.dropout(h, training=training)

    def get_config(self) -> dict[str, Any]:
        return {
            **super().get_config(),
            "hidden": self.hidden,
            "heads": self.heads,
            "dropout": self.dropout_rate,
        }


@keras.saving.register_keras_serializable(package="tfrecompute_tests")
class LoopTransformer(keras.Model):
    """A subclassed model that loops over a list of blocks, then pools and classifies."""

    def __init__(self, layers: int = 4, hidden: int = 64, vocab: int = 100, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.depth, self.hidden, self.vocab = layers, hidden, vocab
        self.embedding = keras.layers.Embedding(vocab, hidden)
        self.blocks = [Block(hidden, 2, name=f"block_{i}") for i in range(layers)]
        self.norm = keras.layers.LayerNormalization()
        self.head = keras.layers.Dense(2)

    def call(self, ids: Any, training: Any = None) -> Any:
        x = self.embedding(ids)
        for block in self.blocks:
            x = block(x, training=training)
        return self.head(keras.ops.mean(self.norm(x), axis=1))

    def get_config(self) -> dict[str, Any]:
        return {"layers": self.depth, "hidden": self.hidden, "vocab": self.vocab}


def loop_transformer(*, layers: int = 4, hidden: int = 64, sequence: int = 32, batch: int = 4):  # noqa: ANN201
    model = LoopTransformer(layers, hidden)
    ids = np.random.default_rng(0).integers(0, 100, (batch, sequence)).astype("int32")
    model(ids[:1])
    return model, (ids, np.random.default_rng(1).normal(size=(batch, 2)).astype("float32"))


@keras.saving.register_keras_serializable(package="tfrecompute_tests")
class Tower(keras.layers.Layer):
    """A subclassed layer holding a keras.Sequential, with a residual around it."""

    def __init__(self, width: int, depth: int = 4, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.width, self.depth = width, depth
        layers: list[keras.layers.Layer] = []
        for _ in range(depth):
            layers += [keras.layers.Dense(width, activation="tanh"), keras.layers.Dropout(0.1)]
        self.body = keras.Sequential(layers)
        self.norm = keras.layers.BatchNormalization()

    def call(self, x: Any, training: Any = None) -> Any:
        return self.norm(self.body(x, training=training), training=training)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "width": self.width, "depth": self.depth}


def tower_model(*, width: int = 64, batch: int = 8):  # noqa: ANN201
    inputs = keras.Input((width,))
    x = Tower(width, name="tower_1")(inputs)
    x = Tower(width, name="tower_2")(x)
    model = keras.Model(inputs, keras.layers.Dense(3)(x), name="towers")
    rng = np.random.default_rng(0)
    return model, (
        rng.normal(size=(batch, width)).astype("float32"),
        rng.normal(size=(batch, 3)).astype("float32"),
    )


def nested_backbone(*, width: int = 64, batch: int = 8):  # noqa: ANN201
    """A Functional classifier calling a Functional backbone (with BatchNorm) once."""
    inner_in = keras.Input((width,))
    h = inner_in
    for _ in range(4):
        h = keras.layers.Dense(width, activation="relu")(h)
        h = keras.layers.BatchNormalization()(h)
    backbone = keras.Model(inner_in, h, name="backbone")
    inputs = keras.Input((width,))
    features = backbone(keras.layers.Dense(width)(inputs))
    model = keras.Model(inputs, keras.layers.Dense(3)(features), name="classifier")
    rng = np.random.default_rng(0)
    return model, (
        rng.normal(size=(batch, width)).astype("float32"),
        rng.normal(size=(batch, 3)).astype("float32"),
    )


def albert(*, layers: int = 4, hidden: int = 32, sequence: int = 16, batch: int = 2) -> Any:
    """One transformer layer applied `layers` times: a layer shared across depth."""
    model = keras_hub.models.AlbertBackbone(
        vocabulary_size=100,
        num_layers=layers,
        num_heads=2,
        num_groups=1,
        num_inner_repetitions=1,
        embedding_dim=16,
        hidden_dim=hidden,
        intermediate_dim=2 * hidden,
        max_sequence_length=sequence,
    )
    x = {**_tokens(batch, sequence), "segment_ids": np.zeros((batch, sequence), "int32")}
    return model, (x, None)


def llama(*, layers: int = 2, hidden: int = 32, sequence: int = 16, batch: int = 2) -> Any:
    """Grouped-query attention with rotary embeddings and RMS norms."""
    model = keras_hub.models.LlamaBackbone(
        vocabulary_size=100,
        num_layers=layers,
        num_query_heads=2,
        num_key_value_heads=1,
        hidden_dim=hidden,
        intermediate_dim=2 * hidden,
    )
    return model, (_tokens(batch, sequence), None)


def t5(*, layers: int = 2, hidden: int = 32, sequence: int = 8, batch: int = 2) -> Any:
    """An encoder-decoder: two token inputs, cross-attention, relative position bias."""
    model = keras_hub.models.T5Backbone(
        vocabulary_size=100,
        num_layers=layers,
        num_heads=2,
        hidden_dim=hidden,
        intermediate_dim=2 * hidden,
    )
    encoder, decoder = _tokens(batch, sequence), _tokens(batch, sequence, seed=1)
    x = {
        "encoder_token_ids": encoder["token_ids"],
        "encoder_padding_mask": encoder["padding_mask"],
        "decoder_token_ids": decoder["token_ids"],
        "decoder_padding_mask": decoder["padding_mask"],
    }
    return model, (x, None)


class SharedTwice(keras.Model):
    """A subclassed model that calls one layer twice, the second time on a residual."""

    def __init__(self, width: int = 32, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.first = keras.layers.Dense(width, activation="relu")
        self.shared = keras.layers.Dense(width, activation="tanh")
        self.head = keras.layers.Dense(4)

    def call(self, x: Any) -> Any:
        h = self.shared(self.first(x))
        return self.head(self.shared(h) + h)


def shared_twice(*, batch: int = 4) -> Any:
    x = np.random.default_rng(0).normal(size=(batch, 16)).astype("float32")
    return SharedTwice(), (x, None)


def masked_lstm(*, batch: int = 4, sequence: int = 12) -> Any:
    """A mask made by `Embedding(mask_zero=True)` and consumed by an LSTM."""
    ids = keras.Input((sequence,), dtype="int32")
    h = keras.layers.Embedding(50, 16, mask_zero=True)(ids)
    h = keras.layers.LSTM(16, return_sequences=True)(h)
    h = keras.layers.Dense(16, activation="relu")(h)
    model = keras.Model(ids, keras.layers.Dense(3)(keras.layers.GlobalAveragePooling1D()(h)))
    x = np.random.default_rng(0).integers(1, 50, (batch, sequence)).astype("int32")
    x[:, sequence * 2 // 3 :] = 0  # padding
    return model, (x, None)


def _application(constructor: Callable[..., Any], size: int = 32, batch: int = 2) -> Any:
    model = constructor(weights=None, input_shape=(size, size, 3), classes=10)
    x = np.random.default_rng(0).normal(size=(batch, size, size, 3)).astype("float32")
    return model, (x, None)


def mobilenet_v3_small() -> Any:
    """Hard-swish, squeeze-excite, a Rescaling and BatchNorm in every block."""
    return _application(keras.applications.MobileNetV3Small)


def convnext_tiny() -> Any:
    """Depthwise convs that Keras runs as grouped convolutions under XLA, LayerScale."""
    return _application(keras.applications.ConvNeXtTiny)


def clip(*, layers: int = 2, hidden: int = 32, sequence: int = 8, batch: int = 2) -> Any:
    """Two towers; an embedding layer called on a weight (`position_ids`), not a tensor."""
    common = dict(num_layers=layers, num_heads=2, hidden_dim=hidden, intermediate_dim=2 * hidden)
    vision = keras_hub.models.CLIPVisionEncoder(
        patch_size=8, image_shape=(16, 16, 3), intermediate_activation="quick_gelu", **common
    )
    text = keras_hub.models.CLIPTextEncoder(
        vocabulary_size=100,
        embedding_dim=hidden,
        max_sequence_length=sequence,
        intermediate_activation="quick_gelu",
        **common,
    )
    model = keras_hub.models.CLIPBackbone(vision, text, projection_dim=16)
    rng = np.random.default_rng(0)
    x = {
        "images": rng.random((batch, 16, 16, 3)).astype("float32"),
        "token_ids": rng.integers(1, 100, (batch, sequence)).astype("int32"),
    }
    return model, (x, None)


def rwkv7(*, layers: int = 2, hidden: int = 32, sequence: int = 8, batch: int = 2) -> Any:
    """A recurrence over the sequence in Python (`for t in range(T)`): it traces only
    at a known sequence length, though the model is built with an unknown one."""
    model = keras_hub.models.RWKV7Backbone(
        hidden_size=hidden,
        head_size=16,
        num_layers=layers,
        vocabulary_size=100,
        intermediate_dim=2 * hidden,
        gate_lora=8,
        mv_lora=8,
        aaa_lora=8,
        decay_lora=8,
    )
    return model, (_tokens(batch, sequence), None)


def deit(*, layers: int = 2, hidden: int = 32, image: int = 16, batch: int = 2) -> Any:
    """An encoder holding its blocks that also returns empty placeholders it makes
    from shapes; its blocks return `(y, None)`."""
    model = keras_hub.models.DeiTBackbone(
        image_shape=(image, image, 3),
        patch_size=8,
        num_layers=layers,
        num_heads=2,
        hidden_dim=hidden,
        intermediate_dim=2 * hidden,
    )
    x = np.random.default_rng(0).random((batch, image, image, 3)).astype("float32")
    return model, (x, None)


def hgnetv2(*, image: int = 64, batch: int = 2) -> Any:
    """keras-hub's own test configuration (two stages, a block each): subclassed layers
    three deep (stages hold blocks hold conv, norm and activation layers), no glue
    between them."""
    stages = [[32, 16, 64, 1, 1, 3], [64, 32, 128, 1, 1, 3]]
    model = keras_hub.models.HGNetV2Backbone(
        embedding_size=32,
        stem_channels=[3, 16, 32],
        hidden_act="relu",
        use_learnable_affine_block=False,
        image_shape=(image, image, 3),
        depths=[1, 1],
        hidden_sizes=[64, 128],
        stackwise_stage_filters=stages,
        apply_downsample=[False, True],
        use_lightweight_conv_block=[False, False],
        out_features=["stem", "stage1", "stage2"],
    )
    x = np.random.default_rng(0).random((batch, image, image, 3)).astype("float32")
    return model, (x, None)


# More models, checked for exactness only (each costs seconds to plan).
MORE_MODELS: dict[str, Callable[..., Any]] = {
    "albert": albert,
    "llama": llama,
    "t5": t5,
    "shared_twice": shared_twice,
    "masked_lstm": masked_lstm,
    "mobilenet_v3_small": mobilenet_v3_small,
    "convnext_tiny": convnext_tiny,
    "clip": clip,
    "rwkv7": rwkv7,
    "deit": deit,
    "hgnetv2": hgnetv2,
}

MODELS: dict[str, Callable[..., Any]] = {
    "bert": bert,
    "gpt2": gpt2,
    "vit": vit,
    "loop_transformer": loop_transformer,
    "towers": tower_model,
    "nested_backbone": nested_backbone,
}
