"""recompute() on keras-hub tasks and backbones whose graphs the rewrite misread.

* A Functional model called with its inputs as the keyword `inputs=`: keras-hub's
  `Gemma3CausalLM` and `PaliGemmaCausalLM` call their backbone as
  `backbone(inputs=inputs)` (and then its token embedding reversed, for the
  logits). The expansion took a nested model's inputs from its positional
  arguments only, found none, and failed with `KeyError` at the backbone's
  first node (`token_embedding`). A dict given to a model declared with a
  list of inputs is paired by name, as Keras pairs it.
* A layer whose declared output shape (`compute_output_shape`) is not what it
  returns: keras-hub's `SigLIPVisionEmbedding` declares a class token SigLIP
  does not have (17 positions for 16 here, 197 for 196 at 224 px), and
  `Gemma3InterleaveEmbeddings` the image embeddings' shape for the text
  sequence it returns. The model never checks intermediate shapes; a block
  whose sub-model took its inputs' shapes from those declarations refused
  the real tensors when the model ran (`recompute` itself succeeded). An int8
  `SigLIPBackbone` met it through its default plan, which, with the quantized
  layers' costs, starts a block at the first encoder layer. Fixed in
  `rewrite/apply.py` (a block's inputs take the declared shape, unknown where
  the trace contradicts it).

Each model is compared with itself before it was checkpointed, in training
mode, eagerly and under `tf.function` (tests/whole_model/test_any_model.py).
"""

from __future__ import annotations

import warnings
from typing import Any

import keras
import keras_hub
import numpy as np
import pytest

import tfrecompute
from tests.helpers import (
    MODES,
    quantize,
)
from tests.whole_model.test_any_model import assert_trains_like_before


def _tokens(batch: int, sequence: int) -> np.ndarray:
    return np.random.default_rng(0).integers(1, 100, (batch, sequence)).astype("int32")


def _images(*shape: int) -> np.ndarray:
    return np.random.default_rng(1).random(shape).astype("float32")


# ------------------------------------------------------------------ models


def _gemma3_causal_lm() -> tuple[keras.Model, Any, type]:
    """Text only: `backbone(inputs=inputs)`, then the tied embedding reversed."""
    from keras_hub.src.models.gemma3.gemma3_decoder_block import Gemma3DecoderBlock

    backbone = keras_hub.models.Gemma3Backbone(
        vocabulary_size=100, image_size=16, num_layers=2, num_query_heads=2,
        num_key_value_heads=1, hidden_dim=32, intermediate_dim=64, head_dim=16,
    )  # fmt: skip
    model = keras_hub.models.Gemma3CausalLM(backbone=backbone, preprocessor=None)
    x = {"token_ids": _tokens(2, 8), "padding_mask": np.ones((2, 8), "int32")}
    return model, x, Gemma3DecoderBlock


def _gemma3_vision_causal_lm() -> tuple[keras.Model, Any, type]:
    """With a vision encoder: also `Gemma3InterleaveEmbeddings`, which declares the
    image embeddings' shape (None, 4, 32) for the (None, 12, 32) it returns."""
    from keras_hub.src.models.gemma3.gemma3_decoder_block import Gemma3DecoderBlock

    encoder = keras_hub.models.Gemma3VisionEncoder(
        image_size=16, patch_size=4, num_heads=2, hidden_dim=16, num_layers=2,
        intermediate_dim=32, output_dim=32, pool_size=2,
    )  # fmt: skip
    backbone = keras_hub.models.Gemma3Backbone(
        vocabulary_size=100, image_size=16, num_layers=2, num_query_heads=2,
        num_key_value_heads=1, hidden_dim=32, intermediate_dim=64, head_dim=16,
        vision_encoder=encoder,
    )  # fmt: skip
    model = keras_hub.models.Gemma3CausalLM(backbone=backbone, preprocessor=None)
    tokens = encoder.num_vision_tokens_per_image  # 4: (16 / 4)^2 patches pooled by 2 x 2
    vision_mask = np.zeros((2, 12), "int32")
    vision_mask[:, 1 : 1 + tokens] = 1
    x = {
        "token_ids": _tokens(2, 12),
        "padding_mask": np.ones((2, 12), "int32"),
        "images": _images(2, 1, 16, 16, 3),
        "vision_indices": np.tile(np.arange(1, 1 + tokens, dtype="int32"), (2, 1)),
        "vision_mask": vision_mask,
    }
    return model, x, Gemma3DecoderBlock


def _pali_gemma_causal_lm() -> tuple[keras.Model, Any, type]:
    """`backbone(inputs=inputs)` with a ViT inside (its encoder checkpointed in place)."""
    from keras_hub.src.models.pali_gemma.pali_gemma_decoder_block import PaliGemmaDecoderBlock

    backbone = keras_hub.models.PaliGemmaBackbone(
        vocabulary_size=100, image_size=16, num_layers=2, num_query_heads=2,
        num_key_value_heads=1, hidden_dim=32, intermediate_dim=64, head_dim=16,
        vit_patch_size=4, vit_num_heads=2, vit_hidden_dim=16, vit_num_layers=2,
        vit_intermediate_dim=32,
    )  # fmt: skip
    model = keras_hub.models.PaliGemmaCausalLM(backbone=backbone, preprocessor=None)
    x = {
        "token_ids": _tokens(2, 8),
        "padding_mask": np.ones((2, 8), "int32"),
        "response_mask": np.zeros((2, 8), "int32"),
        "images": _images(2, 16, 16, 3),
    }
    return model, x, PaliGemmaDecoderBlock


def _siglip_int8() -> tuple[keras.Model, Any, type]:
    """`SigLIPBackbone` quantized to int8. Its vision embedding declares 17 positions
    for the 16 patches it returns; each encoder layer passes the declaration on."""
    from keras_hub.src.models.siglip.siglip_layers import SigLIPEncoderLayer

    vision = keras_hub.models.SigLIPVisionEncoder(
        patch_size=4, hidden_dim=32, num_layers=2, num_heads=2, intermediate_dim=64,
        image_shape=(16, 16, 3),
    )  # fmt: skip
    text = keras_hub.models.SigLIPTextEncoder(
        vocabulary_size=100, embedding_dim=32, hidden_dim=32, num_layers=2, num_heads=2,
        intermediate_dim=64, max_sequence_length=8,
    )  # fmt: skip
    model = keras_hub.models.SigLIPBackbone(vision, text)
    x = {"images": _images(2, 16, 16, 3), "token_ids": _tokens(2, 8)}
    model(x)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Layer .* does not have a `quantize` method")
        quantize(model, "int8")
    return model, x, SigLIPEncoderLayer


MODELS = {
    "gemma3_causal_lm": _gemma3_causal_lm,
    "pali_gemma_causal_lm": _pali_gemma_causal_lm,
    "gemma3_vision_causal_lm": _gemma3_vision_causal_lm,
    "siglip_int8": _siglip_int8,
}


def _build(name: str) -> tuple[keras.Model, Any, type]:
    keras.utils.set_random_seed(0)
    model, x, block_class = MODELS[name]()
    model(x)
    return model, x, block_class


# ------------------------------------------------------------------ keras-hub


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(MODELS))
def test_a_keras_hub_task_trains_like_the_original(name, mode):
    """Blocks on the decoder (encoder) layers, selected with `where=` so that they
    do not depend on measured costs."""
    model, x, block_class = _build(name)
    recompute = lambda m: tfrecompute.recompute(m, sample=x, where=block_class)  # noqa: E731
    assert_trains_like_before(model, x, mode, recompute, blocks=2)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gemma3_causal_lm", "pali_gemma_causal_lm"])
def test_the_default_plan_applies_to_a_task_calling_its_backbone_by_keyword(name):
    """The call reported failing: `recompute(model, sample=x)` (which blocks it places
    depends on measured costs); the model then predicts as before."""
    model, x, _ = _build(name)
    before = keras.tree.flatten(model(x))
    assert tfrecompute.recompute(model, sample=x) is model
    for got, want in zip(keras.tree.flatten(model(x)), before):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------- the same in plain Keras


def _backbone_and_task() -> tuple[keras.Model, Any]:
    """A task over a Functional backbone as keras-hub builds one: the backbone's own
    inputs, `backbone(inputs=inputs)`, then a backbone layer called again (tied)."""
    a = keras.Input((6,), name="a")
    b = keras.Input((8,), name="b")
    h = keras.layers.Dense(16, activation="tanh", name="from_a")(a)
    h = keras.layers.Add()([h, keras.layers.Dense(16, name="from_b")(b)])
    for index in range(3):
        h = keras.layers.Dense(16, activation="tanh", name=f"hidden_{index}")(h)
    backbone = keras.Model({"a": a, "b": b}, h, name="backbone")
    hidden = backbone(inputs=backbone.input)
    tied = backbone.get_layer("hidden_0")
    model = keras.Model(backbone.input, tied(hidden), name="task")
    rng = np.random.default_rng(0)
    x = {"a": rng.normal(size=(4, 6)).astype("float32"), "b": rng.normal(size=(4, 8))}
    return model, {k: v.astype("float32") for k, v in x.items()}


def _list_backbone_given_a_dict() -> tuple[keras.Model, Any]:
    """A backbone declared with a list of inputs (`b` first), given a dict by name,
    which Keras pairs by the inputs' names (sorted keys would pair them the other way)."""
    a = keras.Input((6,), name="a")
    b = keras.Input((8,), name="b")
    h = keras.layers.Concatenate()([keras.layers.Dense(8, name="from_b")(b), a])
    for index in range(3):
        h = keras.layers.Dense(16, activation="tanh", name=f"hidden_{index}")(h)
    backbone = keras.Model([b, a], h, name="backbone")
    inputs = {"a": keras.Input((6,), name="a"), "b": keras.Input((8,), name="b")}
    model = keras.Model(inputs, keras.layers.Dense(3, name="head")(backbone(inputs)))
    rng = np.random.default_rng(0)
    x = {"a": rng.normal(size=(4, 6)), "b": rng.normal(size=(4, 8))}
    return model, {k: v.astype("float32") for k, v in x.items()}


class _CallsByKeyword(keras.layers.Layer):
    """A layer whose code calls a Functional model with `inputs=` (its own region)."""

    def __init__(self, inner: keras.Model, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.inner = inner

    def call(self, x: Any) -> Any:
        return self.inner(inputs=x)


def _model_called_by_keyword_in_code() -> tuple[keras.Model, Any]:
    inner_input = keras.Input((8,))
    h = inner_input
    for index in range(4):
        h = keras.layers.Dense(16, activation="tanh", name=f"hidden_{index}")(h)
    inner = keras.Model(inner_input, h, name="inner")
    inputs = keras.Input((8,))
    h = _CallsByKeyword(inner, name="wrapper")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(3, name="head")(h))
    return model, np.random.default_rng(0).normal(size=(4, 8)).astype("float32")


class _Patches(keras.layers.Layer):
    """Flattens a grid into positions and declares one more (a class token it does not
    add), as keras-hub's `SigLIPVisionEmbedding` does."""

    def call(self, x: Any) -> Any:
        return keras.ops.reshape(x, (keras.ops.shape(x)[0], -1, x.shape[-1]))

    def compute_output_shape(self, shape: Any) -> Any:
        return (shape[0], shape[1] * shape[2] + 1, shape[3])


def _declared_one_position_more() -> tuple[keras.Model, Any]:
    inputs = keras.Input((4, 4, 8))
    h = _Patches(name="patches")(inputs)
    for index in range(3):
        h = keras.layers.Dense(8, activation="tanh", name=f"hidden_{index}")(h)
    model = keras.Model(inputs, h)
    assert tuple(model.output.shape) == (None, 17, 8)  # as declared: 16 are returned
    return model, np.random.default_rng(0).normal(size=(2, 4, 4, 8)).astype("float32")


KERAS_MODELS = {
    "backbone_by_keyword": _backbone_and_task,
    "list_backbone_given_a_dict": _list_backbone_given_a_dict,
    "model_by_keyword_in_code": _model_called_by_keyword_in_code,
    "declared_shape_wrong": _declared_one_position_more,
}


# Blocks on every Dense of a model this small save no memory, and recompute says so.
@pytest.mark.filterwarnings("ignore:recompute. no plan lowers:UserWarning")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(KERAS_MODELS))
def test_a_nested_model_trains_like_the_original(name, mode):
    """The same causes in plain Keras, blocks on every `Dense` call."""
    keras.utils.set_random_seed(0)
    model, x = KERAS_MODELS[name]()
    model(x)
    recompute = lambda m: tfrecompute.recompute(m, sample=x, where=keras.layers.Dense)  # noqa: E731
    assert_trains_like_before(model, x, mode, recompute, blocks=2)
