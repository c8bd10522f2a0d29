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
them itself then.

NOTE [ Attention computed inline ]
keras-hub's T5, Bloom, Falcon and XLNet attention compute the core inline in
`call`, between the calls of their projection sublayers: there is no method
that is the core alone to checkpoint. XLNet's `TwoStreamRelativeAttention`
inherits `_compute_attention` from `MultiHeadAttention` but its `call` never
calls it. For such a layer (a layer whose class name says attention, with
sublayers that have weights, holding no other attention layer, whose `call`
does not call `_compute_attention`)
the whole `call` is checkpointed under the `"dots"` policy (NOTE [ Recompute
policies ] in policy.py): its forward keeps the outputs of the products with
a weight (the query, key, value and output projections) and the recompute
runs everything between them, which is the core (the scores, bias and mask,
softmax, dropout, and the weighted sum of the values) and the reshapes.
What stays for backprop is what the core's checkpoint keeps, less the
core's output (the output projection's input), which runs again. A
projection the policy cannot see (an int8 kernel, which is not a trainable
variable; a `tf.linalg.matmul` called directly) runs again too, correctly.

The method changed is then `call`, which `checkpoint_in_place` may have
changed already (a plan's in-place block around the same layer applies the
policy while it runs): the checkpointed `call` goes over it and gives it
back on release (`change_attribute(..., over=True)`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import keras

from tfrecompute._keras_internals import all_sublayers
from tfrecompute.layers.function import Checkpointed
from tfrecompute.layers.in_place import change_attribute, checkpointed_in_place, release
from tfrecompute.layers.policy import register_scope

__all__ = [
    "CORE",
    "INLINE",
    "attention_layers",
    "checkpoint_attention",
    "core_method",
    "cores_checkpointed",
    "is_checkpointed",
]

CORE = "_compute_attention"
"""The method that computes an attention layer's core."""


INLINE = "call"
"""The method checkpointed (under `"dots"`) for attention computed inline."""


@functools.cache
def _calls_core(cls: type) -> bool:
    """Whether `cls` has the core method and its `call` calls it: the first `call` up the
    MRO that names `CORE`, or that names neither it nor `super` (a `call` returning
    `super().call(...)` is its parent's). Cached per class: `cores_checkpointed` asks
    it of every layer each time a block under the policy runs."""
    if not callable(getattr(cls, CORE, None)):
        return False
    for base in cls.__mro__:
        call = vars(base).get("call")
        if call is None:
            continue
        code = getattr(inspect.unwrap(call), "__code__", None)
        if code is None or CORE in code.co_names:
            return True
        if "super" not in code.co_names:
            return False
    return False


def _named_attention(layer: Any) -> bool:
    """A layer (not a model) whose class name says attention and whose sublayers have
    weights (its projections; a layer making an attention mask has none)."""
    return (
        isinstance(layer, keras.layers.Layer)
        and not isinstance(layer, keras.Model)
        and "attention" in type(layer).__name__.lower()
        and any(sub is not layer and sub.weights for sub in all_sublayers(layer))
    )


def core_method(layer: Any) -> str | None:
    """The method of `layer` that `policy="attention"` checkpoints: `CORE`, `INLINE`
    (NOTE [ Attention computed inline ]), or None for a layer that is no attention."""
    if _calls_core(type(layer)):
        return CORE
    if _named_attention(layer) and not any(
        sub is not layer and (_calls_core(type(sub)) or _named_attention(sub))
        for sub in all_sublayers(layer)
    ):
        return INLINE
    return None


def attention_layers(layers: Sequence[Any]) -> list[keras.layers.Layer]:
    """The layers among `layers` and their sublayers that compute an attention core: in
    `CORE`, or inline in their `call` (NOTE [ Attention computed inline ])."""
    found: dict[int, keras.layers.Layer] = {}
    for root in layers:
        for layer in all_sublayers(root):
            if core_method(layer) is not None:
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
    method = core_method(layer)
    assert method is not None
    applied = vars(layer).get(method)
    if isinstance(applied, Checkpointed):
        return applied
    original = getattr(type(layer), method).__get__(layer, type(layer))
    if method == INLINE:
        return Checkpointed(original, "dots", [layer])
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
    method = core_method(layer)
    return method is not None and isinstance(vars(layer).get(method), Checkpointed)


def checkpoint_attention(layer: keras.layers.Layer) -> Any:
    """Makes `layer`'s attention core recompute in backprop (NOTE [ Attention core recompute ]).

    Returns:
        The block the core runs through.
    """
    core = _core(layer)
    method = core_method(layer)
    assert method is not None
    over = method == INLINE and checkpointed_in_place(layer)
    change_attribute(layer, method, core, core.block, over=over)
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
            "policy='attention': no attention layer among "
            f"{[getattr(layer, 'name', layer) for layer in layers]}, so nothing is "
            "recomputed. The policy finds layers with a `_compute_attention` method "
            "(keras.layers.MultiHeadAttention, keras-hub's attention layers) and layers "
            "with projection sublayers whose class name says attention; checkpoint a "
            "custom layer's core with tfrecompute.checkpoint.",
            stacklevel=3,
        )
    changed = [layer for layer in found if not is_checkpointed(layer)]
    for layer in changed:
        checkpoint_attention(layer)
    try:
        yield changed
    finally:
        for layer in changed:
            method = core_method(layer)
            assert method is not None
            release(layer, method)


register_scope("attention", cores_checkpointed)
