"""The attention core of a layer, recomputed in backprop (`policy="attention"`).

NOTE [ Attention core recompute ]
Megatron-LM's selective recompute (Korthikanti et al. 2022): attention's
s²-sized tensors (the scores, the softmax, the dropout mask and the dropped
probabilities) are much of a transformer's activation memory, and at the
widths it trains little of its compute, so it keeps everything but them and
recomputes only the attention core. At small widths and long sequences the
core is a large share of the time (benchmarks/results/selective.md: 54% of
the forward's CPU time at hidden 256, sequence 512). Keras's `MultiHeadAttention` and its
subclasses (keras-hub's `CachedMultiHeadAttention` in BERT, GPT-2,
RoBERTa..., the attention of ViT, DeiT and CLIP) compute the core in
`_compute_attention(query, key, value, attention_mask, training, ...)`,
after the projections, and keras-hub's own attention layers (Llama, Gemma,
Mistral, Qwen, Phi-3, GPT-NeoX, DeBERTa-v3 ...) have a method of that name
doing the same. `checkpoint_attention(layer)` sets that method as an
instance attribute (`in_place.change_attribute`) that runs the layer's own
method through a checkpointed function bound to the layer (NOTE
[ Checkpointed functions ] in `function.py`): the projections run and keep
their activations as without recompute; the core keeps only its inputs (the
projected query, key and value, and the mask) and runs again in backprop,
its Dropout mask replayed.

Keras's core returns the attention scores beside its output even when the
caller drops them (`return_attention_scores=False`); as an output of the
checkpointed function they would be kept for backprop, so the core drops
them itself then. Attention layers without the method (T5's, Bloom's,
Falcon's) are not found and run as they are.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import keras

from tfrecompute._keras_internals import all_sublayers
from tfrecompute.layers.function import Checkpointed
from tfrecompute.layers.in_place import change_attribute, release
from tfrecompute.layers.policy import register_scope

__all__ = [
    "CORE",
    "attention_layers",
    "checkpoint_attention",
    "cores_checkpointed",
    "is_checkpointed",
]

CORE = "_compute_attention"
"""The method that computes an attention layer's core."""


def attention_layers(layers: Sequence[Any]) -> list[keras.layers.Layer]:
    """The layers among `layers` and their sublayers whose class computes attention in `CORE`."""
    found: dict[int, keras.layers.Layer] = {}
    for root in layers:
        for layer in all_sublayers(root):
            if callable(getattr(type(layer), CORE, None)):
                found.setdefault(id(layer), layer)
    return list(found.values())


def _drops_scores(signature: inspect.Signature | None) -> Any:
    """A function of a core call's arguments: whether the caller drops the returned scores."""
    if signature is None or "return_attention_scores" not in signature.parameters:
        return lambda args, kwargs: False

    def drops(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return False
        bound.apply_defaults()
        return not bound.arguments["return_attention_scores"]

    return drops


def _core(layer: keras.layers.Layer) -> Checkpointed:
    """The layer's core as a checkpointed function: the one in force, else a new one
    (nothing is cached on the layer: NOTE [ Records off the model's attributes ])."""
    applied = vars(layer).get(CORE)
    if isinstance(applied, Checkpointed):
        return applied
    original = getattr(type(layer), CORE).__get__(layer, type(layer))
    try:
        signature: inspect.Signature | None = inspect.signature(original)
    except (TypeError, ValueError):
        signature = None
    drops = _drops_scores(signature)

    def attention_core(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        if isinstance(result, tuple) and len(result) == 2 and drops(args, kwargs):
            return result[0], None
        return result

    return Checkpointed(attention_core, None, [layer])


def is_checkpointed(layer: keras.layers.Layer) -> bool:
    """Whether `layer`'s attention core runs checkpointed now."""
    return isinstance(vars(layer).get(CORE), Checkpointed)


def checkpoint_attention(layer: keras.layers.Layer) -> Any:
    """Makes `layer`'s attention core recompute in backprop (NOTE [ Attention core recompute ]).

    Returns:
        The block the core runs through.
    """
    core = _core(layer)
    change_attribute(layer, CORE, core, core.block)
    return core.block


@contextlib.contextmanager
def cores_checkpointed(layers: Sequence[Any]) -> Iterator[list[keras.layers.Layer]]:
    """Inside, the attention cores of `layers` (and their sublayers) recompute in backprop.

    Cores already checkpointed (by `recompute(model, policy="attention")`)
    stay so on exit.
    """
    found = attention_layers(layers)
    if not found:
        warnings.warn(
            "policy='attention': no attention layer with a `_compute_attention` method "
            f"among {[getattr(layer, 'name', layer) for layer in layers]}, so nothing is "
            "recomputed. The policy finds keras.layers.MultiHeadAttention (and subclasses) "
            "and keras-hub's attention layers; checkpoint a custom layer's core with "
            "tfrecompute.checkpoint.",
            stacklevel=3,
        )
    changed = [layer for layer in found if not is_checkpointed(layer)]
    for layer in changed:
        checkpoint_attention(layer)
    try:
        yield changed
    finally:
        for layer in changed:
            release(layer, CORE)


register_scope("attention", cores_checkpointed)
