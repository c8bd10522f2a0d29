"""The call tree of a model: every layer and operation call of one traced forward.

`trace_model(model, inputs)` calls the model once in training mode inside a
`tf.function` trace (nothing runs) on placeholders of the given specs, and
records each call Keras makes through `Layer.__call__` or
`Operation.__call__`: the model's own call at the root, a Functional model's
node calls below it, a subclassed layer's sub-layer calls below that, and so
on. Each call keeps the arguments as its caller passed them, the tensors its
`call` received after Keras's conversions, and its outputs, all graph tensors
of the one trace, so a tensor passed from one call to another is the same
object in both. `tfrecompute.graph.layer_graph` turns the tree into a `LayerGraph`.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import keras
import tensorflow as tf

from tfrecompute._keras_internals import is_functional, recording_calls
from tfrecompute._messages import cause, fail, received
from tfrecompute.errors import UntraceableModelError
from tfrecompute.graph.layer_graph import declared_input

__all__ = [
    "TracedCall",
    "TracedOps",
    "flat_tensors",
    "forward_digest",
    "in_declared_order",
    "input_specs",
    "is_traced_tensor",
    "not_a_batch",
    "sample_inputs",
    "trace_model",
]


@dataclasses.dataclass(frozen=True, eq=False)
class TracedOps:
    """The ops one call added to the graph of a trace: `graph.get_operations()[start:stop]`
    (`graph.version` counts the ops added so far)."""

    graph: Any
    start: int
    stop: int


# Attributes that name things (colocation, resources, a custom gradient's
# registration): they differ between calls that compute the same.
_NAMING_ATTRS = frozenset(
    {"_class", "_gradient_op_type", "_user_specified_name", "container", "shared_name"}
)


def forward_digest(traced: TracedOps, operations: list[Any]) -> str:
    """A digest of the ops `traced` names (`operations`: all of its graph's, in order):
    their types, attributes (names aside), output dtypes and shapes, and how they connect,
    to each other and to tensors made before them."""
    ops = operations[traced.start : traced.stop]
    local = {op.name: index for index, op in enumerate(ops)}
    made = {t.ref(): (index, j) for index, op in enumerate(ops) for j, t in enumerate(op.outputs)}
    outside: dict[Any, tuple[Any, ...]] = {}
    items = []
    for op in ops:
        inputs = [
            made.get(t.ref())
            or outside.setdefault(t.ref(), ("in", len(outside), t.dtype.name, str(t.shape)))
            for t in op.inputs
        ]
        controls = sorted(local.get(c.name, -1) for c in op.control_inputs)  # -1: made before
        attrs = sorted(
            (name, value.SerializeToString(deterministic=True))
            for name, value in op.node_def.attr.items()
            if name not in _NAMING_ATTRS
        )
        outputs = [(t.dtype.name, str(t.shape)) for t in op.outputs]
        items.append((op.type, inputs, controls, attrs, outputs))
    return hashlib.sha256(repr(items).encode()).hexdigest()


@dataclasses.dataclass(eq=False)
class TracedCall:
    """One recorded call.

    Attributes:
        operation: the layer or operation called.
        args, kwargs: the arguments as the caller passed them.
        received: for a layer, the `(args, kwargs)` its `call` received after
            Keras converted them; the caller's for a plain operation.
        outputs: what the call returned.
        children: the calls made while this one ran, in order.
        traced_ops: the ops the call added to the trace's graph (None if it
            began and ended in different graphs).
    """

    operation: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    received: tuple[tuple[Any, ...], dict[str, Any]] | None = None
    outputs: Any = None
    children: list[TracedCall] = dataclasses.field(default_factory=list)
    traced_ops: TracedOps | None = None

    @property
    def name(self) -> str:
        return str(getattr(self.operation, "name", type(self.operation).__name__))


class _Recorder:
    def __init__(self) -> None:
        self.root: TracedCall | None = None
        self.stack: list[TracedCall] = []

    def enter(self, operation: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> TracedCall:
        graph = tf.compat.v1.get_default_graph()
        call = TracedCall(operation, args, dict(kwargs))
        call.traced_ops = TracedOps(graph, graph.version, graph.version)
        if self.stack:
            self.stack[-1].children.append(call)
        elif self.root is None:
            self.root = call
        self.stack.append(call)
        return call

    def received(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.stack and self.stack[-1].received is None:
            self.stack[-1].received = (args, dict(kwargs))

    def exit(self, call: TracedCall, outputs: Any) -> None:
        call.outputs = outputs
        began, graph = call.traced_ops, tf.compat.v1.get_default_graph()
        if began is not None:
            same = graph is began.graph
            call.traced_ops = TracedOps(graph, began.start, graph.version) if same else None
        if call.received is None:
            call.received = (call.args, call.kwargs)
        while self.stack and self.stack.pop() is not call:
            pass


def is_traced_tensor(value: Any) -> bool:
    """Whether `value` is a tensor a traced call computes with, not a variable.

    Layers pass variables too (CLIP's embedding layer is called on its
    `position_ids` weight); a variable is state, not an activation, and Keras
    variables have no `ref()`.
    """
    return tf.is_tensor(value) and not isinstance(value, (keras.Variable, tf.Variable))


def flat_tensors(structure: Any) -> list[tf.Tensor]:
    """The tensors in a nested structure, in flatten order (variables and other leaves left out)."""
    return [t for t in keras.tree.flatten(structure) if is_traced_tensor(t)]


def trace_model(model: keras.Model, inputs: Any, *, api: str = "profile") -> TracedCall:
    """Traces `model(inputs, training=True)` without running it; returns the root call.

    Args:
        model: any built Keras model.
        inputs: a structure of `tf.TensorSpec`s, as the model is called with.

    Raises:
        UntraceableModelError: the model's call cannot be traced (a
            ValueError); names the layer whose call raised and the cause.
    """
    recorder = _Recorder()

    def forward(values: Any) -> Any:
        with recording_calls(recorder):
            return model(values, training=True)

    try:
        tf.function(forward, autograph=False).get_concrete_function(inputs)
    except Exception as error:
        where = recorder.stack[-1].name if recorder.stack else model.name
        raise UntraceableModelError(
            f"{api}: the model's call cannot be traced symbolically (on graph tensors of the "
            f"sample's shapes, in training mode): layer {where!r} raised {cause(error)}"
            f" {received('model', model, by_name=True)}. Make that call traceable by "
            "tf.function (no Python branches on tensor values, no .numpy()), or wrap its "
            "traceable parts in tfrecompute.RecomputeBlock yourself."
        ) from error
    assert recorder.root is not None
    return recorder.root


def input_specs(api: str, model: keras.Model, sample: Any, batch_size: int | None) -> Any:
    """The specs to trace `model` with: from a sample batch, or the model's declared inputs.

    Args:
        api: the public function, for error messages.
        model: the model.
        sample: None, or a batch as passed to `model(...)` (an array, or a
            list or dict of them), or `(x, y)` / `(x, y, sample_weight)` as
            passed to `fit`, of which `x` is taken.
        batch_size: the batch size to trace at: replaces the sample's leading
            dimension, or the model inputs' unknown one (1 when None).

    Returns:
        A structure of `tf.TensorSpec`s shaped like the model's input.
    """
    if sample is None:
        if not is_functional(model) or not model.built or not model.inputs:
            fail(
                api,
                "a subclassed or unbuilt model has no declared inputs to trace it with",
                "model",
                model,
                "Pass sample=<one batch as you call the model with>",
                error=ValueError,
                by_name=True,
            )
        x = declared_input(model)
        for tensor in model.inputs:
            if None in tuple(tensor.shape)[1:]:
                fail(
                    api,
                    f"the model input {tensor.name!r} has shape {tuple(tensor.shape)}, and "
                    "every dimension but the batch must be known, since activation bytes come "
                    "from shapes",
                    "model",
                    model,
                    "Pass sample=<one batch at the shape you train at> (e.g. token ids of "
                    "your sequence length), or give the inputs fixed shapes",
                    by_name=True,
                )
    else:
        x = sample_inputs(sample)
        if is_functional(model) and model.built and model.inputs:
            x = in_declared_order(model, x)

    def spec(value: Any) -> tf.TensorSpec:
        shape = list(value.shape)
        if shape and (batch_size is not None or shape[0] is None):
            shape[0] = batch_size or 1
        dtype = keras.backend.standardize_dtype(value.dtype)
        return tf.TensorSpec(shape, dtype)

    try:
        specs = keras.tree.map_structure(spec, x)
    except (AttributeError, TypeError) as error:
        not_a_batch(api, sample, error)
    if sample is not None and is_functional(model) and model.built and model.inputs:
        _check_against_inputs(api, model, specs, sample)
    return specs


def sample_inputs(sample: Any) -> Any:
    """The model's inputs of a sample: `x` of `(x, y)` or `(x, y, sample_weight)` as passed
    to `fit`, else the sample itself."""
    return sample[0] if isinstance(sample, tuple) and len(sample) in (2, 3) else sample


def not_a_batch(api: str, sample: Any, error: Exception) -> None:
    """Raises the error of a sample whose inputs are not arrays (`error` says why)."""
    fail(
        api,
        f"the sample is not a batch of arrays ({type(error).__name__}: {error})",
        "sample",
        sample,
        "Pass one batch as you call the model with: an array, a list or a dict of "
        "arrays, or (x, y) as passed to fit",
        error=TypeError,
    )


def in_declared_order(model: keras.Model, x: Any) -> Any:
    """`x` in the structure of the model's declared inputs, as Keras reads it.

    A model whose inputs are declared as a list (keras-hub's `Gemma3nCausalLM`)
    takes a dict keyed by the inputs' names too: Keras puts the values in the
    declared order. Anything else is returned as it is.
    """
    declared = declared_input(model)
    if not isinstance(x, dict) or not isinstance(declared, (list, tuple)):
        return x
    names = [getattr(tensor, "name", None) for tensor in declared]
    if sorted(map(str, names)) != sorted(map(str, x)):
        return x
    return type(declared)(x[name] for name in names)


def _check_against_inputs(api: str, model: keras.Model, specs: Any, sample: Any) -> None:
    """Raises unless the sample's structure, ranks and known dimensions fit the model's inputs."""
    declared = declared_input(model)
    try:
        keras.tree.assert_same_structure(specs, declared)
        pairs = list(zip(keras.tree.flatten(specs), keras.tree.flatten(declared)))
    except (TypeError, ValueError):
        fail(
            api,
            f"the sample's inputs ({_structure(specs)}) do not match the model's inputs "
            f"({_structure(declared)})",
            "sample",
            sample,
            "Pass the inputs in the structure the model takes (the same dict keys or list "
            "length), or (x, y) as passed to fit",
        )
    names = _input_names(declared)
    for (got, want), name in zip(pairs, names):
        fits = len(got.shape) == len(want.shape) and all(
            w is None or g == w for g, w in zip(list(got.shape)[1:], list(want.shape)[1:])
        )
        if not fits:
            fail(
                api,
                f"a sample input of shape {tuple(got.shape)} does not fit {name} of shape "
                f"{tuple(want.shape)}",
                "sample",
                sample,
                "Pass a batch of the shape the model takes",
            )


def _structure(inputs: Any) -> str:
    """How a structure of inputs reads in an error: dict keys, a list's length, one tensor."""
    if isinstance(inputs, dict):
        return f"a dict with keys {sorted(map(str, inputs))}"
    if isinstance(inputs, (list, tuple)):
        return f"a {type(inputs).__name__} of {len(inputs)}"
    return "one tensor"


def _input_names(declared: Any) -> list[str]:
    """The model's inputs as an error names them, in flatten order: a dict's keys, an
    input's own name where it was given one, else its position ("the model's input" for
    a model of one input)."""
    if isinstance(declared, dict):
        return [f"the model input {key!r}" for key in sorted(declared)]  # flatten's order
    flat = keras.tree.flatten(declared)
    found = []
    for index, tensor in enumerate(flat):
        name = str(getattr(tensor, "name", "") or "")
        if name and not name.startswith("keras_tensor"):
            found.append(f"the model input {name!r}")
        else:
            found.append(f"the model input #{index}" if len(flat) > 1 else "the model's input")
    return found
