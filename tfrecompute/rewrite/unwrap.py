"""`unwrap`: a model with hand-placed `RecomputeBlock`s as the same model without them.

The other direction of `tfrecompute.rewrite.apply`: each block is replaced by
what it wraps, sharing the layer objects, so weights save under the paths of
the model as defined.
"""

from __future__ import annotations

from typing import Any

import keras

from tfrecompute._keras_internals import (
    all_sublayers,
    functional_inputs,
    functional_nodes,
    is_functional,
)
from tfrecompute._messages import fail
from tfrecompute.graph.layer_graph import declared_input, declared_output
from tfrecompute.layers import RecomputeBlock
from tfrecompute.layers.block import apply_in_order
from tfrecompute.rewrite.apply import substituted

__all__ = ["unwrap"]


def unwrap(model: keras.Model) -> keras.Model:
    """The same model without `RecomputeBlock`s, sharing its layers and variables.

    A model with blocks written by hand saves its weights under the blocks'
    paths (`layers/recompute_block/inner/dense/...`), which the same model
    without blocks does not have. `unwrap(model)` is that model: each block
    replaced by what it wraps (its layers called in order, its single layer
    or its Functional model), nested models unwrapped too, the same layer
    objects, so the same variables. Save, export or exchange weights through
    it, both ways:

    ```python
    tfrecompute.unwrap(model).save_weights("plain.weights.h5")  # loads into the plain model
    tfrecompute.unwrap(model).load_weights("plain.weights.h5")  # loads into `model`'s blocks
    ```

    A model without blocks is returned as it is: that includes a model
    checkpointed by `tfrecompute.recompute`, which keeps the model's own
    layers and paths (turn its checkpointing off with `recompute(model,
    "none")`).

    Args:
        model: a Sequential or Functional model.

    Returns:
        `model` if it holds no block, else a new model of the same kind and
        name, sharing its layers.

    Raises:
        ValueError: a block is held by a subclassed model's or layer's code,
            which cannot be rebuilt.
    """
    if not isinstance(model, keras.Model):
        fail("unwrap", "`model` must be a Keras model", "model", model,
             "Pass the keras.Model that holds the RecomputeBlocks", error=TypeError)  # fmt: skip
    if not _holds_blocks(model):
        return model
    if isinstance(model, keras.Sequential):
        plain = [p for layer in model.layers for p in _plain_layers(layer)]
        source = functional_inputs(model)[0]
        inputs = keras.Input(batch_shape=source.shape, dtype=source.dtype)
        unwrapped: keras.Model = keras.Sequential([inputs, *plain], name=model.name)
    elif is_functional(model):
        mapping: dict[int, Any] = {id(t): t for t in functional_inputs(model)}
        for node in functional_nodes(model):
            if not node.is_input:
                _unwrapped_node(node, mapping)
        outputs = keras.tree.map_structure(lambda t: mapping[id(t)], declared_output(model))
        unwrapped = keras.Model(declared_input(model), outputs, name=model.name)
    else:
        unwrapped = model
    left = [layer.name for layer in all_sublayers(unwrapped) if isinstance(layer, RecomputeBlock)]
    if left:
        fail(
            "unwrap",
            f"RecomputeBlock {left[0]!r} is held by a subclassed layer's or model's code, "
            "which unwrap cannot rebuild",
            "model",
            model,
            "Leave blocks out of subclassed code and checkpoint it with "
            "tfrecompute.recompute(model, where=...), which keeps the model's own weight paths",
            by_name=True,
        )
    return unwrapped


def _holds_blocks(layer: Any) -> bool:
    return any(isinstance(sub, RecomputeBlock) for sub in all_sublayers(layer))


def _plain_layers(layer: Any) -> list[Any]:
    """What `layer` is without blocks, as layers applied in order."""
    if isinstance(layer, RecomputeBlock):
        return [p for inner in layer.layers for p in _plain_layers(inner)]
    if isinstance(layer, keras.Model) and _holds_blocks(layer):
        return [unwrap(layer)]
    return [layer]


def _unwrapped_node(node: Any, mapping: dict[int, Any]) -> None:
    """Calls a node's operation, without blocks, on the tensors `mapping` gives."""
    args = substituted(node.arguments.args, mapping)
    kwargs = substituted(node.arguments.kwargs, mapping)
    operation = node.operation
    if isinstance(operation, RecomputeBlock):
        args, kwargs = operation.unrouted(args, kwargs)
        outputs = apply_in_order(_plain_layers(operation), *args, **kwargs)
    elif isinstance(operation, keras.Model) and _holds_blocks(operation):
        outputs = unwrap(operation)(*args, **kwargs)
    else:
        outputs = operation(*args, **kwargs)
    for original, new in zip(node.outputs, keras.tree.flatten(outputs)):
        mapping[id(original)] = new
