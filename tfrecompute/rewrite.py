"""A plan applied to a model: the one place above `layers/` that builds `RecomputeBlock`s.

`rewrite(graph, segments)` builds the checkpointed model: each half-open
range of the graph's calls becomes a `RecomputeBlock` around a Functional
sub-model whose inputs are the tensors the range consumes from before it and
whose outputs are the tensors later calls (or the model's outputs) need from
it. Tensors that only pass by a range (a U-Net's long skip) go around its
block. A Sequential model gets a Sequential back, its blocks wrapping lists of
layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras

from tfrecompute.graph import LayerGraph
from tfrecompute.layers import RecomputeBlock

__all__ = ["rewrite"]


def rewrite(
    graph: LayerGraph, segments: Sequence[tuple[int, int]], *, name: str | None = None
) -> keras.Model:
    """A new model sharing the graph's layers, each range of calls wrapped in a block.

    Args:
        graph: the layer graph of the model to rewrite.
        segments: sorted, disjoint half-open ranges `(start, stop)` of call indices.
        name: the new model's name; `<model name>_recompute` by default.

    Returns:
        A `keras.Sequential` for a Sequential model, else a Functional `keras.Model`.
    """
    name = name or f"{graph.model.name}_recompute"
    # Block names become TensorFlow name scopes: no "#" from a shared layer's call.
    names = [n.replace("#", "_call") for n in graph.names]
    if graph.sequential:
        return _rewrite_sequential(graph, dict(segments), names, name)
    mapping: dict[int, Any] = {id(t): t for t in graph.model.inputs}
    starts = dict(segments)
    index = 0
    while index < len(graph.calls):
        if index not in starts:
            _replay(graph, index, mapping)
            index += 1
            continue
        stop = starts[index]
        block, input_ids, output_ids = _block(graph, index, stop, f"recompute_{names[index]}")
        block_inputs = [mapping[key] for key in input_ids]
        results = block(block_inputs if len(block_inputs) != 1 else block_inputs[0])
        for key, result in zip(output_ids, keras.tree.flatten(results)):
            mapping[key] = result
        index = stop
    outputs = keras.tree.map_structure(lambda t: mapping[id(t)], graph.model.output)
    return keras.Model(graph.model.input, outputs, name=name)


def _rewrite_sequential(
    graph: LayerGraph, starts: dict[int, int], names: list[str], name: str
) -> keras.Sequential:
    # A Sequential's graph also holds the ops its layers' masks are computed
    # with (an Embedding's `not_equal`); the Sequential runs those itself, so
    # only its layers are placed.
    placed = [isinstance(c.layer, keras.layers.Layer) for c in graph.calls]
    layers: list[keras.layers.Layer] = []
    index = 0
    while index < len(graph.calls):
        stop = starts.get(index, index + 1)
        members = [k for k in range(index, stop) if placed[k]]
        if index in starts and members:
            block_layers = [graph.calls[k].layer for k in members]
            layers.append(RecomputeBlock(block_layers, name=f"recompute_{names[members[0]]}"))
        else:
            layers += [graph.calls[k].layer for k in members]
        index = stop
    source = graph.model.inputs[0]
    return keras.Sequential(
        [keras.Input(batch_shape=source.shape, dtype=source.dtype), *layers], name=name
    )


def _replay(graph: LayerGraph, index: int, mapping: dict[int, Any]) -> None:
    """Calls call `index`'s layer again on the tensors `mapping` gives for its arguments."""
    call = graph.calls[index]

    def substitute(value: Any) -> Any:
        if isinstance(value, keras.KerasTensor):
            return mapping[id(value)]
        return value

    args = keras.tree.map_structure(substitute, call.args)
    kwargs = keras.tree.map_structure(substitute, call.kwargs)
    outputs = keras.tree.flatten(call.layer(*args, **kwargs))
    for original, new in zip(call.outputs, outputs):
        mapping[id(original)] = new


def _no_mask_of_its_own(inputs: Any, previous_mask: Any = None) -> None:
    """`compute_mask` of a segment's sub-model: its outputs carry their layers' masks."""
    return None


def _block(
    graph: LayerGraph, start: int, stop: int, name: str
) -> tuple[RecomputeBlock, list[int], list[int]]:
    """The block of calls [start, stop), and the ids of the tensors it takes and gives."""
    input_ids, output_ids = graph.segment_io(start, stop)
    mapping: dict[int, Any] = {}
    sub_inputs = []
    for key in input_ids:
        tensor = graph.tensors[key].tensor
        sub_input = keras.Input(batch_shape=tensor.shape, dtype=tensor.dtype)
        mapping[key] = sub_input
        sub_inputs.append(sub_input)
    for index in range(start, stop):
        _replay(graph, index, mapping)
    sub_outputs = [mapping[key] for key in output_ids]
    sub_model = keras.Model(
        sub_inputs if len(sub_inputs) != 1 else sub_inputs[0],
        sub_outputs if len(sub_outputs) != 1 else sub_outputs[0],
        name=f"{name}_layers",
    )
    # A Functional model hands its input masks to its layers, and their
    # output masks stay on its outputs, yet Keras warns that it "will
    # destroy the mask" when given a masked input, as it lacks
    # `supports_masking`. The segment's masks are its layers' own: it
    # supports masking and adds none.
    sub_model.supports_masking = True
    sub_model.compute_mask = _no_mask_of_its_own
    return RecomputeBlock(sub_model, name=name), input_ids, output_ids
