"""The layer graph of a Sequential or Functional model, as a chain of calls.

`LayerGraph.of(model)` lists the model's layer calls (Keras nodes) in a
topological order and records, for every tensor, which call produced it and
which calls consume it. A recompute plan is a set of half-open ranges over
that order; `LayerGraph.rewrite(segments)` builds the checkpointed model, each
range becoming a `RecomputeBlock` around a Functional sub-model whose inputs
are the tensors the range consumes from before it and whose outputs are the
tensors later calls (or the model's outputs) need from it. Tensors that only
pass by a range (a U-Net's long skip) go around its block.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

from tfrecompute.layers import RecomputeBlock

__all__ = ["LayerGraph", "TensorInfo", "tensor_bytes", "trainable_variables"]


def _is_subclassed(model: keras.Model) -> bool:
    return not isinstance(model, keras.Sequential) and not hasattr(model, "_nodes_by_depth")


def tensor_bytes(shape: Sequence[int | None], dtype: Any, batch_size: int) -> int:
    """Bytes of a tensor of `shape` (None as the leading dimension = batch) and `dtype`.

    Only the batch may be unknown: `LayerGraph.of` refuses models with other
    unknown dimensions.
    """
    size = tf.as_dtype(keras.backend.standardize_dtype(dtype)).size
    for index, dim in enumerate(shape):
        size *= batch_size if index == 0 and dim is None else dim
    return int(size)


def trainable_variables(operation: Any) -> list[Any]:
    """The trainable variables of a call's operation: none for a plain op.

    A Functional model's nodes are layers or plain Keras operations: the
    `keras.ops` functions applied to symbolic tensors (`keras.ops.add(x, y)`,
    or the `not_equal` that computes an Embedding's padding mask).
    """
    return list(getattr(operation, "trainable_variables", ()))


def _no_mask_of_its_own(inputs: Any, previous_mask: Any = None) -> None:
    """`compute_mask` of a segment's sub-model: its outputs carry their layers' masks."""
    return None


@dataclasses.dataclass
class TensorInfo:
    """A symbolic tensor of the model's graph.

    Attributes:
        tensor: the Keras symbolic tensor.
        producer: index of the call that produces it, -1 for a model input.
        consumers: indices of the calls that take it as an argument.
        is_output: whether it is one of the model's outputs.
    """

    tensor: keras.KerasTensor
    producer: int
    consumers: list[int] = dataclasses.field(default_factory=list)
    is_output: bool = False

    def bytes(self, batch_size: int) -> int:
        return tensor_bytes(self.tensor.shape, self.tensor.dtype, batch_size)

    @property
    def last_use(self) -> int:
        return max(self.consumers, default=self.producer)


@dataclasses.dataclass
class _Call:
    layer: keras.layers.Layer | keras.Operation  # a plain op for `keras.ops` calls
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    inputs: list[int]  # ids of the KerasTensors it consumes, in argument order
    outputs: list[keras.KerasTensor]


class LayerGraph:
    """The calls of a Sequential or Functional model in topological order."""

    def __init__(self, model: keras.Model, calls: list[_Call]) -> None:
        self.model = model
        self.calls = calls
        self.sequential = isinstance(model, keras.Sequential)
        self.tensors: dict[int, TensorInfo] = {}
        for tensor in model.inputs:
            self.tensors[id(tensor)] = TensorInfo(tensor, producer=-1)
        for index, call in enumerate(calls):
            for key in dict.fromkeys(call.inputs):
                self.tensors[key].consumers.append(index)
            for tensor in call.outputs:
                self.tensors[id(tensor)] = TensorInfo(tensor, producer=index)
        for tensor in model.outputs:
            self.tensors[id(tensor)].is_output = True

    @classmethod
    def of(cls, model: keras.Model, *, api: str = "tfrecompute") -> LayerGraph:
        """Analyses `model`; raises a clear error for models that cannot be traced."""
        if not isinstance(model, keras.Model):
            raise TypeError(
                f"{api}: `model` must be a Keras Sequential or Functional model. Received: "
                f"model={model!r} (of type {type(model).__name__}). Pass a keras.Model."
            )
        if _is_subclassed(model):
            raise TypeError(
                f"{api}: a subclassed model cannot be traced into a layer graph. Received: "
                f"model={model.name!r} (of type {type(model).__name__}). Wrap its parts in "
                "tfrecompute.RecomputeBlock inside the model's __init__ instead, or build it "
                "as a Functional model."
            )
        if not model.built or not model.inputs:
            raise ValueError(
                f"{api}: the model is not built, so its layer graph is unknown. Received: "
                f"model={model.name!r} (of type {type(model).__name__}). Give it an input "
                "shape (keras.Input(...) as its first layer) or call model.build(input_shape)."
            )
        functional = model._functional if isinstance(model, keras.Sequential) else model
        depths = sorted(functional._nodes_by_depth, reverse=True)
        nodes = [node for depth in depths for node in functional._nodes_by_depth[depth]]
        calls = []
        for node in nodes:
            if node.is_input:
                continue
            calls.append(
                _Call(
                    layer=node.operation,
                    args=node.arguments.args,
                    kwargs=node.arguments.kwargs,
                    inputs=[id(t) for t in node.arguments.keras_tensors],
                    outputs=list(node.outputs),
                )
            )
        graph = cls(model, calls)
        for info in graph.tensors.values():
            if None in tuple(info.tensor.shape)[1:]:
                if info.producer < 0:
                    made_by = "a model input"
                    fix = (
                        "Give the model's inputs the fixed shape you train at, e.g. "
                        "keras.Input(shape=(128, 64)) instead of (None, 64)."
                    )
                else:
                    op = graph.calls[info.producer].layer
                    kind = "layer" if isinstance(op, keras.layers.Layer) else "op"
                    made_by = f"{kind} {graph.names[info.producer]!r}"
                    fix = (
                        f"Make that {kind}'s output shape static (e.g. a fixed target shape), "
                        "with the model's inputs of the fixed shape you train at."
                    )
                raise ValueError(
                    f"{api}: every dimension but the batch must be known, since activation "
                    f"bytes come from shapes; a tensor from {made_by} has shape "
                    f"{tuple(info.tensor.shape)}. Received: model={model.name!r} (of type "
                    f"{type(model).__name__}). {fix}"
                )
        if isinstance(model, keras.Sequential):
            # The Sequential's own Input tensors stand for its functional ones.
            graph.tensors.update(
                {id(t): graph.tensors[id(f)] for t, f in zip(model.inputs, functional.inputs)}
            )
        return graph

    def __len__(self) -> int:
        return len(self.calls)

    @property
    def names(self) -> list[str]:
        """One name per call: the layer's name, with `#k` for the k-th call of a shared layer."""
        seen: dict[int, int] = {}
        names = []
        for call in self.calls:
            count = seen.get(id(call.layer), 0)
            seen[id(call.layer)] = count + 1
            names.append(call.layer.name if count == 0 else f"{call.layer.name}#{count}")
        return names

    def live_after(self, index: int) -> list[TensorInfo]:
        """Tensors alive between call `index` and call `index + 1`."""
        return [
            info
            for info in self.tensors.values()
            if info.producer <= index and (info.last_use > index or info.is_output)
        ]

    # ------------------------------------------------------------- rewrite

    def segment_io(self, start: int, stop: int) -> tuple[list[int], list[int]]:
        """Ids of the tensors calls [start, stop) take from before, and that others need after."""
        inputs: dict[int, None] = {}
        outputs: dict[int, None] = {}
        for index in range(start, stop):
            for key in self.calls[index].inputs:
                if self.tensors[key].producer < start:
                    inputs[key] = None
            for tensor in self.calls[index].outputs:
                info = self.tensors[id(tensor)]
                if info.is_output or info.last_use >= stop:
                    outputs[id(tensor)] = None
        return list(inputs), list(outputs)

    def _replay(self, index: int, mapping: dict[int, Any]) -> None:
        call = self.calls[index]

        def substitute(value: Any) -> Any:
            if isinstance(value, keras.KerasTensor):
                return mapping[id(value)]
            return value

        args = keras.tree.map_structure(substitute, call.args)
        kwargs = keras.tree.map_structure(substitute, call.kwargs)
        outputs = keras.tree.flatten(call.layer(*args, **kwargs))
        for original, new in zip(call.outputs, outputs):
            mapping[id(original)] = new

    def _block(
        self, start: int, stop: int, name: str
    ) -> tuple[RecomputeBlock, list[int], list[int]]:
        input_ids, output_ids = self.segment_io(start, stop)
        mapping: dict[int, Any] = {}
        sub_inputs = []
        for key in input_ids:
            tensor = self.tensors[key].tensor
            sub_input = keras.Input(batch_shape=tensor.shape, dtype=tensor.dtype)
            mapping[key] = sub_input
            sub_inputs.append(sub_input)
        for index in range(start, stop):
            self._replay(index, mapping)
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

    def rewrite(
        self, segments: Sequence[tuple[int, int]], *, name: str | None = None
    ) -> keras.Model:
        """A new model sharing this one's layers, each segment wrapped in a `RecomputeBlock`."""
        name = name or f"{self.model.name}_recompute"
        starts = dict(segments)
        # Block names become TensorFlow name scopes: no "#" from a shared layer's call.
        names = [n.replace("#", "_call") for n in self.names]
        if self.sequential:
            # A Sequential's graph also holds the ops its layers' masks are
            # computed with (an Embedding's `not_equal`); the Sequential runs
            # those itself, so only its layers are placed.
            placed = [isinstance(c.layer, keras.layers.Layer) for c in self.calls]
            layers: list[keras.layers.Layer] = []
            index = 0
            while index < len(self.calls):
                stop = starts.get(index, index + 1)
                members = [k for k in range(index, stop) if placed[k]]
                if index in starts and members:
                    block_layers = [self.calls[k].layer for k in members]
                    block_name = f"recompute_{names[members[0]]}"
                    layers.append(RecomputeBlock(block_layers, name=block_name))
                else:
                    layers += [self.calls[k].layer for k in members]
                index = stop
            source = self.model.inputs[0]
            return keras.Sequential(
                [keras.Input(batch_shape=source.shape, dtype=source.dtype), *layers], name=name
            )

        mapping: dict[int, Any] = {id(t): t for t in self.model.inputs}
        index = 0
        while index < len(self.calls):
            if index not in starts:
                self._replay(index, mapping)
                index += 1
                continue
            stop = starts[index]
            block, input_ids, output_ids = self._block(index, stop, f"recompute_{names[index]}")
            block_inputs = [mapping[key] for key in input_ids]
            results = block(block_inputs if len(block_inputs) != 1 else block_inputs[0])
            for key, result in zip(output_ids, keras.tree.flatten(results)):
                mapping[key] = result
            index = stop
        outputs = keras.tree.map_structure(lambda t: mapping[id(t)], self.model.output)
        return keras.Model(self.model.input, outputs, name=name)
