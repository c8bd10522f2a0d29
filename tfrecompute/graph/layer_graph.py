"""The layer graph of a Sequential or Functional model, as a chain of calls (analysis only).

`LayerGraph.of(model)` lists the model's layer calls (Keras nodes) in a
topological order and records, for every tensor, which call produced it and
which calls consume it. A recompute plan is a set of half-open ranges over
that order: `tfrecompute.costs.profile` measures them, `tfrecompute.rewrite.apply` turns
them into `RecomputeBlock`s.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

from tfrecompute._keras_internals import (
    functional_inputs,
    functional_nodes,
    functional_outputs,
    is_functional,
)
from tfrecompute._messages import fail

__all__ = [
    "Call",
    "LayerGraph",
    "Region",
    "TensorInfo",
    "Unit",
    "call_signature",
    "cost_keys",
    "declared_input",
    "declared_output",
    "tensor_bytes",
    "trainable_variables",
]


def tensor_bytes(shape: Sequence[int | None], dtype: Any, batch_size: int) -> int:
    """Bytes of a tensor of `shape` (None as the leading dimension = batch) and `dtype`.

    Only the batch may be unknown: `LayerGraph.of` refuses models with other
    unknown dimensions.
    """
    size = tf.as_dtype(keras.backend.standardize_dtype(dtype)).size
    for index, dim in enumerate(shape):
        size *= batch_size if index == 0 and dim is None else dim
    return int(size)


def declared_input(model: keras.Model) -> Any:
    """A built model's symbolic input, in the structure it is called with."""
    return model.inputs[0] if isinstance(model, keras.Sequential) else model.input


def declared_output(model: keras.Model) -> Any:
    """A built model's symbolic output, in the structure it returns."""
    return model.outputs[0] if isinstance(model, keras.Sequential) else model.output


def stable_name(operation: Any) -> str:
    """A call's operation by a name that survives saving and loading the model.

    Layers keep their names in a saved model; a `keras.ops` operation in a
    Functional graph (`x[:, 0]`, `a + b`) is named by a process-wide counter
    when it is made, so the same model loaded from a file names it anew
    (`get_item` becomes `get_item_1`). It is named by its kind instead
    (`get_item`); `LayerGraph.names` numbers repeats in call order.
    """
    if isinstance(operation, keras.Operation) and not isinstance(operation, keras.layers.Layer):
        kind = re.sub(r"(?<!^)(?=[A-Z])", "_", type(operation).__name__).lower()
        return kind or str(operation.name)
    return str(getattr(operation, "name", type(operation).__name__))


def trainable_variables(operation: Any) -> list[Any]:
    """The trainable variables of a call's operation: none for a plain op.

    A Functional model's nodes are layers or plain Keras operations: the
    `keras.ops` functions applied to symbolic tensors (`keras.ops.add(x, y)`,
    or the `not_equal` that computes an Embedding's padding mask).

    Trainable as the optimizer sees them: a model trains every variable whose
    own `trainable` is set, whatever the layers between say. keras-hub's
    `enable_lora` freezes each transformer layer (`layer.trainable = False`,
    so its `trainable_variables` is empty) and then unfreezes the adapted
    projections inside it; their adapters train, and the layer's
    activations are needed for their gradients.
    """
    if not isinstance(operation, keras.layers.Layer):
        return list(getattr(operation, "trainable_variables", ()))
    return [variable for variable in operation.weights if variable.trainable]


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


@dataclasses.dataclass(eq=False)
class Region:
    """A Functional or Sequential model whose calls a rewrite can regroup into blocks.

    The root model when it is Functional (with the calls of nested Functional
    models inlined), or a Functional model that a subclassed layer's code
    calls (rebuilt, and routed to in place).

    Attributes:
        model: the model.
        inputs, outputs: the graph's tensors for the model's inputs and outputs;
            `structure`: the outputs in the structure the model returns.
        unit: for a model called by code, the unit whose code calls it.
        alone: whether nothing else calls the model (else it is not rebuilt).
    """

    model: Any
    inputs: list[keras.KerasTensor]
    outputs: list[keras.KerasTensor] = dataclasses.field(default_factory=list)
    structure: Any = None
    unit: Unit | None = None
    alone: bool = True


def call_signature(call: Call) -> tuple[tuple[tuple[int | None, ...], str], ...]:
    """The shape and dtype of each distinct tensor argument of a call."""
    return tuple((tuple(t.shape), str(t.dtype)) for t in call.tensor_args)


def cost_keys(calls: Sequence[Call]) -> list[tuple[Any, ...]]:
    """Per call, a key that calls sharing it share every cost of (what they keep, measure,
    time, and keep under a policy): NOTE [ Calls that cost the same ].

    NOTE [ Calls that cost the same ]
    What a call keeps for its backward, what measuring it shows and what a
    policy keeps of it follow from the ops its forward makes, the shapes and
    dtypes they see, and which of its variables train. Calls of one layer on
    the same input specs share them; so do calls of different layers of one
    class whose forward ops in the model's trace match op for op (type,
    attributes, output dtypes and shapes, connections; names, colocation and
    custom-gradient ids aside: `Call.forward_digest`, which `expand` sets
    where a layer of the same class takes the same input specs) and whose
    weights match in shape, dtype and trainability. The repeated blocks of
    a deep model are then traced, measured and timed once, not once per
    layer: keras-hub's Qwen3.5 linear-attention decoder layer unrolls a
    63-step Python loop into thousands of ops, ResNet152's 50 bottleneck
    blocks repeat a few convolutions.
    A layer called more than once is keyed by its first call.
    """
    first: dict[tuple[Any, ...], tuple[Any, ...]] = {}
    keys = []
    for call in calls:
        signature = call_signature(call)
        identity = (id(call.layer), signature)
        if identity not in first:
            if call.forward_digest is None:
                first[identity] = identity
            else:
                weights = tuple(
                    (tuple(v.shape), str(v.dtype), bool(v.trainable))
                    for v in getattr(call.layer, "weights", ())
                )
                first[identity] = (type(call.layer), call.forward_digest, weights, signature)
        keys.append(first[identity])
    return keys


@dataclasses.dataclass(eq=False)
class Unit:
    """A graph call whose inside is checkpointed in place (see `Call.unit`).

    Attributes:
        node: the Keras node that replays the whole call in a rewrite; None
            for a subclassed root model (the rewrite returns that model).
        args, kwargs: the node's arguments, with the graph's tensors.
        region: the region the node belongs to (None for the root model's call).
        outputs: the graph's tensors for the call's outputs.
    """

    node: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    region: Region | None = None
    outputs: list[keras.KerasTensor] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(eq=False)
class Call:
    """One call the planner sees: a layer (or operation) call of the model.

    Attributes:
        layer: the layer called, or a plain Keras operation (`keras.ops` on
            symbolic tensors).
        args, kwargs: the call's arguments, with `keras.KerasTensor`s for tensors.
        outputs: its symbolic outputs.
        node: for a call of a Functional or Sequential graph, the Keras node
            that replays it (its arguments are `args`, `kwargs`).
        region: for such a call, the region it belongs to.
        unit: for a call made by a subclassed layer's code, the graph call
            that contains it: a rewrite replays the unit whole and
            checkpoints this call in place.
        level: how deep the call sits (1: a call of the model itself).
        path: the names of the calls it sits in, each followed by "/".
        glue: a layer's own computation between its sub-layer calls (never
            recomputed).
        inputs: ids of the KerasTensors it consumes, in argument order.
        forward_digest: a digest of the ops its call made in the model's
            trace, set by `expand` where a twin may exist (NOTE [ Calls that
            cost the same ]); None otherwise.
    """

    layer: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outputs: list[keras.KerasTensor]
    node: Any = None
    region: Region | None = None
    unit: Unit | None = None
    level: int = 1
    path: str = ""
    glue: bool = False
    forward_digest: str | None = None
    inputs: list[int] = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        flat = keras.tree.flatten((self.args, self.kwargs))
        self.inputs = [id(t) for t in flat if isinstance(t, keras.KerasTensor)]

    @property
    def tensor_args(self) -> list[keras.KerasTensor]:
        """The distinct KerasTensors among the arguments, in argument order."""
        flat = keras.tree.flatten((self.args, self.kwargs))
        return list({id(t): t for t in flat if isinstance(t, keras.KerasTensor)}.values())

    @property
    def in_place(self) -> bool:
        """Whether the call can only be checkpointed in place (it has no node)."""
        return self.node is None

    def anchor(self, region: Region) -> Call | Unit | None:
        """What a rewrite of `region` replays for this call: the call itself, a unit, or None.

        A call of `region` is replayed (or grouped into a block); a call made
        deeper, by the code of one of the region's calls, is replayed as that
        whole call (its unit).
        """
        if self.region is region:
            return self
        unit = self.unit if self.region is None else self.region.unit
        while unit is not None:
            if unit.region is region:
                return unit
            unit = None if unit.region is None else unit.region.unit
        return None


class LayerGraph:
    """The calls of a model in execution order, and the tensors between them.

    Attributes:
        model: the model.
        calls: the calls, in an order in which each runs after its inputs exist.
        inputs: the model's input tensors; `outputs` its output tensors, and
            `structure` those in the structure the model returns.
        tensors: every tensor by id: who makes it, who uses it.
        sequential: whether a rewrite can return a Sequential (a Sequential
            model whose calls are all its own layers).
        root: the region of the model's own calls when it is Functional or
            Sequential; None for a subclassed model.
        specs: the input specs the model was traced at (set by the tracer), in
            the structure the model is called with: what a plan made on this
            graph fixes of the inputs' shapes.
    """

    def __init__(
        self,
        model: keras.Model,
        calls: list[Call],
        *,
        inputs: Sequence[keras.KerasTensor] | None = None,
        outputs: Sequence[keras.KerasTensor] | None = None,
        structure: Any = None,
        root: Region | None = None,
    ) -> None:
        self.model = model
        self.root = root
        self.specs: Any = None
        self.calls = calls
        self.inputs = list(model.inputs if inputs is None else inputs)
        self.outputs = list(model.outputs if outputs is None else outputs)
        self.structure = declared_output(model) if structure is None else structure
        self.sequential = isinstance(model, keras.Sequential) and all(
            call.node is not None and call.level == 1 for call in calls
        )
        self.tensors: dict[int, TensorInfo] = {}
        for tensor in self.inputs:
            self.tensors[id(tensor)] = TensorInfo(tensor, producer=-1)
        for index, call in enumerate(calls):
            for key in dict.fromkeys(call.inputs):
                self.tensors[key].consumers.append(index)
            for tensor in call.outputs:
                self.tensors.setdefault(id(tensor), TensorInfo(tensor, producer=index))
        for tensor in self.outputs:
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
                node.operation,
                node.arguments.args,
                node.arguments.kwargs,
                outputs=list(node.outputs),
                node=node,
            )
            for node in functional_nodes(model)
            if not node.is_input
        ]
        return cls(model, calls, inputs=functional_inputs(model), outputs=functional_outputs(model))

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
        """One name per call: its path and layer name, with `#k` for the k-th repeat."""
        seen: dict[str, int] = {}
        names = []
        for call in self.calls:
            name = f"{call.path}{stable_name(call.layer)}"
            count = seen.get(name, 0)
            seen[name] = count + 1
            names.append(name if count == 0 else f"{name}#{count}")
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
