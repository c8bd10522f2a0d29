"""The layer graph of a Sequential or Functional model, as a chain of calls (analysis only).

`LayerGraph.of(model)` lists the model's layer calls (Keras nodes) in a
topological order and records, for every tensor, which call produced it and
which calls consume it. A recompute plan is a set of half-open ranges over
that order: `tfrecompute.costs` measures them, `tfrecompute.rewrite` turns
them into `RecomputeBlock`s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

from tfrecompute._keras_internals import functional_inputs, functional_nodes, is_functional
from tfrecompute._messages import fail

__all__ = ["Call", "LayerGraph", "TensorInfo", "tensor_bytes", "trainable_variables"]


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

    @property
    def last_use(self) -> int:
        return max(self.consumers, default=self.producer)


@dataclasses.dataclass
class Call:
    """One call of the model's graph (a Keras node).

    Attributes:
        layer: the layer called, or a plain Keras operation (`keras.ops` on
            symbolic tensors).
        args, kwargs: the call's arguments, with `keras.KerasTensor`s for tensors.
        inputs: ids of the KerasTensors it consumes, in argument order.
        outputs: its symbolic outputs.
    """

    layer: keras.layers.Layer | keras.Operation
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    inputs: list[int]
    outputs: list[keras.KerasTensor]

    @property
    def tensor_args(self) -> list[keras.KerasTensor]:
        """The distinct KerasTensors among the arguments, in argument order."""
        flat = keras.tree.flatten((self.args, self.kwargs))
        return list({id(t): t for t in flat if isinstance(t, keras.KerasTensor)}.values())


class LayerGraph:
    """The calls of a Sequential or Functional model in topological order."""

    def __init__(self, model: keras.Model, calls: list[Call]) -> None:
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
            fail(
                api,
                "`model` must be a Keras Sequential or Functional model",
                "model",
                model,
                "Pass a keras.Model",
                error=TypeError,
            )
        if not is_functional(model):
            fail(
                api,
                "a subclassed model cannot be traced into a layer graph",
                "model",
                model,
                "Wrap its parts in tfrecompute.RecomputeBlock inside the model's __init__ "
                "instead, or build it as a Functional model",
                error=TypeError,
                by_name=True,
            )
        if not model.built or not model.inputs:
            fail(
                api,
                "the model is not built, so its layer graph is unknown",
                "model",
                model,
                "Give it an input shape (keras.Input(...) as its first layer) or call "
                "model.build(input_shape)",
                by_name=True,
            )
        calls = [
            Call(
                layer=node.operation,
                args=node.arguments.args,
                kwargs=node.arguments.kwargs,
                inputs=[id(t) for t in node.arguments.keras_tensors],
                outputs=list(node.outputs),
            )
            for node in functional_nodes(model)
            if not node.is_input
        ]
        graph = cls(model, calls)
        if isinstance(model, keras.Sequential):
            # The Sequential's own Input tensors stand for its functional ones.
            graph.tensors.update(
                {
                    id(t): graph.tensors[id(f)]
                    for t, f in zip(model.inputs, functional_inputs(model))
                }
            )
        return graph

    def check_static_shapes(self, api: str) -> None:
        """Raises unless every dimension but the batch is known (bytes come from shapes)."""
        for info in self.tensors.values():
            if None not in tuple(info.tensor.shape)[1:]:
                continue
            if info.producer < 0:
                made_by = "a model input"
                fix = (
                    "Give the model's inputs the fixed shape you train at, e.g. "
                    "keras.Input(shape=(128, 64)) instead of (None, 64)"
                )
            else:
                op = self.calls[info.producer].layer
                kind = "layer" if isinstance(op, keras.layers.Layer) else "op"
                made_by = f"{kind} {self.names[info.producer]!r}"
                fix = (
                    f"Make that {kind}'s output shape static (e.g. a fixed target shape), "
                    "with the model's inputs of the fixed shape you train at"
                )
            fail(
                api,
                "every dimension but the batch must be known, since activation bytes come "
                f"from shapes; a tensor from {made_by} has shape {tuple(info.tensor.shape)}",
                "model",
                self.model,
                fix,
                by_name=True,
            )

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
