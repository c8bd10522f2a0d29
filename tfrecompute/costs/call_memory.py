"""What one layer call keeps for its backward, read from its traced gradient graph.

`call_memory` traces a call and its gradient in a `tf.function`, without
running them, and reads which forward tensors the gradient ops use: what
TensorFlow keeps between the two passes. `tfrecompute.costs.profile` assembles these
per-call costs into a model's `Chain`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import keras
import tensorflow as tf

from tfrecompute._keras_internals import call_has_training_arg
from tfrecompute.costs.loop_memory import accumulated_bytes, stepped_source
from tfrecompute.graph.layer_graph import trainable_variables

__all__ = ["CallMemory", "TracedStep", "call_memory", "traced_call_memory"]


def _spec(tensor: Any, batch_size: int) -> tf.TensorSpec:
    shape = [batch_size if dim is None else dim for dim in tensor.shape]
    return tf.TensorSpec(shape, keras.backend.standardize_dtype(tensor.dtype))


def _static_bytes(tensor: tf.Tensor) -> int:
    if not tensor.shape.is_fully_defined():
        return 0
    return int(tensor.shape.num_elements()) * tensor.dtype.size


# Forward ops whose outputs are not activations: inputs, variable reads, constants.
_NOT_ACTIVATIONS = frozenset({"Placeholder", "ReadVariableOp", "Const", "Shape", "VarHandleOp"})
# Ops whose output shares its input's buffer: a kept output of one is its input.
_ALIASES = frozenset({"Identity", "IdentityN", "Reshape", "Squeeze", "ExpandDims", "StopGradient"})


def _buffer(tensor: tf.Tensor) -> tf.Tensor:
    """The tensor whose buffer `tensor` shares (itself unless it is a view).

    An eager tensor (a constant the layer made before tracing and returns as
    it is, as D-FINE's anchors) has no op: it is its own buffer, no activation.
    """
    if not hasattr(tensor, "op"):  # an eager tensor's `op` raises AttributeError
        return tensor
    while tensor.op.type in _ALIASES and tensor.op.inputs:
        tensor = tensor.op.inputs[0 if tensor.op.type != "IdentityN" else tensor.value_index]
    return tensor


@dataclasses.dataclass(frozen=True)
class CallMemory:
    """What one layer call keeps for its backward, read from its gradient graph.

    Attributes:
        kept_bytes: activations made inside the call (neither its inputs nor
            its outputs) that its backward reads.
        workspace_bytes: the largest other temporary its backward creates.
        reads_inputs: per tensor argument, whether its backward reads it.
        reads_outputs: per output, whether its backward reads it.
        casts_inputs: per tensor argument, whether its backward reads a cast
            of it (a layer computing in float32 on a bfloat16 input).
        opaque: whether reading the graph cannot see all the call allocates
            (NOTE [ Calls the graph does not show ]): then
            `tfrecompute.costs.measured` measures it.
    """

    kept_bytes: int
    workspace_bytes: int
    reads_inputs: tuple[bool, ...]
    reads_outputs: tuple[bool, ...]
    opaque: bool = False
    casts_inputs: tuple[bool, ...] = ()


@dataclasses.dataclass(frozen=True)
class TracedStep:
    """A call's forward and backward as `call_memory` traced them, to run.

    `function(*arguments, *output_gradients)` (a concrete function of
    `specs`: the call's tensor arguments, then one gradient per output)
    returns `(outputs, gradients)`: the call's tensor outputs and the
    gradients of its floating arguments and trainable variables.
    `tfrecompute.costs.measured.measure_call` runs it rather than tracing
    the call again.
    """

    function: Any
    specs: tuple[tf.TensorSpec, ...]
    arguments: int


@dataclasses.dataclass
class _TracedCall:
    """A call and its gradient, traced into one graph (filled in while tracing)."""

    specs: list[tf.TensorSpec]
    forward_ops: int = 0  # the forward's ops come first in the graph
    step_ops: int = 0  # the forward's and backward's; the function's returns follow
    arguments: int = 0
    function: Any = None
    inputs: list[Any] = dataclasses.field(default_factory=list)  # buffers of the tensor inputs
    outputs: list[Any] = dataclasses.field(default_factory=list)  # buffers of the outputs
    gradients: list[Any] = dataclasses.field(default_factory=list)  # buffers of the gradients
    operations: list[tf.Operation] = dataclasses.field(default_factory=list)


def call_memory(
    layer: keras.layers.Layer | keras.Operation,
    args: Any,
    kwargs: Any,
    outputs: Any,
    batch_size: int,
) -> CallMemory:
    """Finds what one layer call keeps alive for its backward.

    See `traced_call_memory`, which also returns the traced step.
    """
    return traced_call_memory(layer, args, kwargs, outputs, batch_size)[0]


def traced_call_memory(
    layer: keras.layers.Layer | keras.Operation,
    args: Any,
    kwargs: Any,
    outputs: Any,
    batch_size: int,
) -> tuple[CallMemory, TracedStep]:
    """Finds what one layer call keeps alive for its backward; also returns its traced step.

    Traces the call (in training mode) and its gradient with respect to its
    floating inputs and trainable variables in a `tf.function`, without running
    it. A forward tensor that a gradient op reads is kept from the forward to
    the backward; a view (a reshape, an identity) counts as the buffer it
    shares. This is what TensorFlow keeps between the two passes.

    Args:
        layer: the layer called, or a plain Keras op (`keras.ops` on symbolic tensors).
        args, kwargs: the call's arguments, with `keras.KerasTensor`s for tensors.
        outputs: the call's symbolic outputs.
        batch_size: the size of the leading `None` dimension.
    """
    traced = _trace(layer, args, kwargs, outputs, batch_size)
    step = TracedStep(traced.function, tuple(traced.specs), traced.arguments)
    read = _read_by_backward(traced)
    boundary = set(traced.inputs) | set(traced.outputs)
    kept = [
        t for key, t in read.items() if key not in boundary and t.op.type not in _NOT_ACTIVATIONS
    ]
    kept += [t for key, t in _made_early(traced).items() if key not in read]
    # The memory model counts the gradients the call returns, for its inputs
    # (also when made in another shape and reshaped, as a Conv1D's or a
    # Dense's on 3-D inputs is) and for its variables (`Chain.applied_grad_bytes`
    # or `kept_grad_bytes`), and temporaries shaped like its inputs or outputs as
    # those gradients; the workspace is the largest other temporary.
    io_shapes = {tuple(spec.shape) for spec in traced.specs}
    returned = set(traced.gradients)
    backward = [
        t
        for op in traced.operations[traced.forward_ops :]
        if op.type not in _ALIASES
        for t in op.outputs
        if tuple(t.shape) not in io_shapes and t.ref() not in returned
    ]
    loops = [accumulated_bytes(t) for t in kept]  # NOTE [ What a loop keeps for its backward ]
    memory = CallMemory(
        kept_bytes=sum(_static_bytes(t) for t in kept) + sum(n or 0 for n in loops),
        workspace_bytes=max((_static_bytes(t) for t in backward), default=0),
        reads_inputs=tuple(key in read for key in traced.inputs),
        reads_outputs=tuple(key in read for key in traced.outputs),
        opaque=any(_opaque(op) for op in traced.operations) or None in loops,
        casts_inputs=tuple(key in _cast_sources(read) for key in traced.inputs),
    )
    return memory, step


def _made_early(traced: _TracedCall) -> dict[Any, tf.Tensor]:
    """NOTE [ Gradient ops that run early ]

    TensorFlow runs an op as soon as its inputs exist, so a gradient op that
    needs neither the incoming gradient nor an activation runs in the forward,
    and its output stays until the gradient op that reads it runs in the
    backward. A dequantized int8 kernel is one: Keras's int8 `Dense` and
    `EinsumDense` compute `cast(kernel) / scale`, transposed, in their custom
    gradient, from the variables alone (4 MiB per 1024x1024 kernel, held by
    every such layer until its backward; tests/costs/test_quantized.py
    checks the predicted peak of a quantized stack within 15%). Such
    tensors count as kept: the outputs of backward ops that depend on no
    placeholder (the inputs and the output gradients; an `IdentityN` passes
    each input to its own output), read by a backward op that does.
    """
    operations = traced.operations
    from_data: set[Any] = set()  # tensors that depend on a placeholder
    for op in operations:
        if op.type == "IdentityN":
            pairs = zip(op.inputs, op.outputs)
            from_data.update(out.ref() for inp, out in pairs if inp.ref() in from_data)
            continue
        sources = [*op.inputs, *(t for c in op.control_inputs for t in c.outputs)]
        argument = op.type == "Placeholder" and op.outputs[0].dtype != tf.resource  # not a variable
        if argument or any(t.ref() in from_data for t in sources):
            from_data.update(t.ref() for t in op.outputs)
    backward = operations[traced.forward_ops :]
    made = {t.ref() for op in backward for t in op.outputs if op.type not in _NOT_ACTIVATIONS}
    returned = set(traced.gradients)
    early: dict[Any, tf.Tensor] = {}
    for op in backward:
        if any(t.ref() in from_data for t in op.outputs):
            for tensor in map(_buffer, op.inputs):
                key = tensor.ref()
                if key in made and key not in from_data and key not in returned:
                    early[key] = tensor
    return early


def _cast_sources(read: dict[Any, tf.Tensor]) -> set[Any]:
    """The buffers that a read tensor is a cast of (by reference), or for the list a loop
    steps through (`stepped_source`), a transpose of: an RNN keeps its inputs time-major."""
    stepped = {_buffer(s).ref() for s in map(stepped_source, read.values()) if s is not None}
    found = set()
    for key, tensor in read.items():
        copies = ("Cast", "Transpose") if key in stepped else ("Cast",)
        if tensor.op.type in copies and tensor.op.inputs:
            found.add(_buffer(tensor.op.inputs[0]).ref())
    return found


# Ops that run a function body the reading above does not look into.
_FUNCTION_CALLS = frozenset({"PartitionedCall", "StatefulPartitionedCall", "XlaLaunch"})


def _opaque(op: tf.Operation) -> bool:
    """NOTE [ Calls the graph does not show ]

    Reading a call's gradient graph sees the buffers of its top-level ops.
    It misses what runs inside a function call op (Keras's TensorFlow
    backend runs every grouped `Conv2D` in a `tf.function(jit_compile=True)`,
    whose XLA backward allocates a 2*k*k*C^2 float buffer that no op of the
    graph names: 220.5 MiB at C=768, k=7), ops compiled by XLA, a
    `tf.custom_gradient` (its gradient function is traced as a function),
    and floating tensors whose shape is unknown until the op runs. Such a call is
    measured instead (`tfrecompute.costs.measured`).
    """
    attrs = op.node_def.attr
    if op.type in _FUNCTION_CALLS or "_gradient_op_type" in attrs:
        return True
    if "_XlaMustCompile" in attrs and attrs["_XlaMustCompile"].b:
        return True
    return any(not t.shape.is_fully_defined() for t in op.outputs if t.dtype.is_floating)


def _trace(layer: Any, args: Any, kwargs: Any, outputs: Any, batch_size: int) -> _TracedCall:
    """Traces the call in training mode and its gradient, without running either."""
    flat = keras.tree.flatten((args, kwargs))
    symbolic = list({id(t): t for t in flat if isinstance(t, keras.KerasTensor)}.values())
    flat_outputs = keras.tree.flatten(outputs)
    traced = _TracedCall(specs=[_spec(t, batch_size) for t in [*symbolic, *flat_outputs]])
    traced.arguments = len(symbolic)

    def step(*values: tf.Tensor) -> tuple[list[tf.Tensor], list[tf.Tensor]]:
        inputs, output_grads = values[: len(symbolic)], values[len(symbolic) :]
        mapping = {id(t): v for t, v in zip(symbolic, inputs)}

        def substitute(value: Any) -> Any:
            return mapping[id(value)] if isinstance(value, keras.KerasTensor) else value

        call_kwargs = keras.tree.map_structure(substitute, kwargs)
        if call_has_training_arg(layer):  # a plain op has none
            call_kwargs["training"] = True
        with tf.GradientTape() as tape:
            tape.watch([value for value in inputs if value.dtype.is_floating])
            returned = layer(*keras.tree.map_structure(substitute, args), **call_kwargs)
            # the tensors only, as `outputs` holds them (DeiT's blocks return `(y, None)`)
            results = [r for r in keras.tree.flatten(returned) if tf.is_tensor(r)]
        traced.forward_ops = len(tf.compat.v1.get_default_graph().get_operations())
        traced.inputs = [_buffer(v).ref() for v in inputs]
        traced.outputs = [_buffer(r).ref() for r in results]
        # A call may return another float dtype alone than the model recorded (a
        # tied embedding's reverse call under a mixed policy): its gradient has its own.
        pairs = [
            (r, tf.cast(g, r.dtype)) for r, g in zip(results, output_grads) if r.dtype.is_floating
        ]
        sources = [v for v in inputs if v.dtype.is_floating] + trainable_variables(layer)
        parts = []
        if pairs and sources:
            grads = tape.gradient(
                [r for r, _ in pairs], sources, output_gradients=[g for _, g in pairs]
            )
            parts = [  # IndexedSlices too
                part for part in tf.nest.flatten(grads, expand_composites=True) if part is not None
            ]
            traced.gradients = [_buffer(part).ref() for part in parts]
        traced.step_ops = len(tf.compat.v1.get_default_graph().get_operations())
        return results, parts

    function = tf.function(step, autograph=False).get_concrete_function(*traced.specs)
    # what the function adds to return its results (identities) is not the call's
    traced.operations = function.graph.get_operations()[: traced.step_ops]
    traced.function = function
    return traced


def _read_by_backward(traced: _TracedCall) -> dict[Any, tf.Tensor]:
    """The forward buffers that some gradient op reads, by reference."""
    operations = traced.operations
    forward = {t.ref() for op in operations[: traced.forward_ops] for t in op.outputs}
    read: dict[Any, tf.Tensor] = {}
    for op in operations[traced.forward_ops :]:
        for tensor in op.inputs:
            if tensor.ref() in forward:
                root = _buffer(tensor)
                read[root.ref()] = root
    for tensor in list(read.values()):  # NOTE [ What a loop keeps for its backward ]
        source = stepped_source(tensor)
        if source is not None:
            root = _buffer(source)
            read[root.ref()] = root
    return read
