"""What a `tf.while_loop` keeps for its backward: one tensor per iteration, in a list.

NOTE [ What a loop keeps for its backward ]
Keras's recurrent layers (`LSTM`, `GRU`, `SimpleRNN`, `keras.layers.RNN`
over a cell) run their steps in a `tf.while_loop`, as does `keras.ops.scan`
or `fori_loop`. To differentiate the loop, TensorFlow adds to it one
accumulator per intermediate the gradient needs (a `TensorList` the body
pushes that tensor onto, every iteration), which the loop returns and the
gradient loop pops. In the call's traced graph an accumulator is one scalar
`variant` output of the `While` op: its buffers (a stacked LSTM's gates,
cell states and inputs, step by step) are invisible to shapes. Sized here:
the element's shape and dtype (the accumulator starts as an
`EmptyTensorList` of that element shape) times the loop's iterations (the
length of the lists it reads or writes a step at a time,
`TensorListFromTensor`/`TensorListReserve`, else a constant
`maximum_iterations`). A pushed tensor that shares a buffer held anyway (a
variable's value, a shape) costs nothing; an item of a list the loop steps
through (an RNN's inputs) keeps that list, a copy of the tensor it was made
from: counted once, as that tensor read by the backward
(`stepped_source`), so that the RNN's input ends a link of the chain as an
input its backward reads would.

Where the element shape or the iterations are unknown until run time the
accumulator cannot be sized: the call is measured instead
(`tfrecompute.costs.measured`), as for the calls NOTE [ Calls the graph does
not show ] in `call_memory` lists.
"""

from __future__ import annotations

import math
from typing import Any

import tensorflow as tf

from tfrecompute._keras_internals import loop_body_graph

__all__ = ["LOOPS", "accumulated_bytes", "stepped_source"]

LOOPS = frozenset({"While", "StatelessWhile"})

# Pushed values that share a buffer the step holds anyway, or are a few bytes.
_SHARED = frozenset(
    {
        "ReadVariableOp",
        "TensorListGetItem",
        "TensorListElementShape",
        "TensorListLength",
        "Shape",
        "Const",
    }
)
_LIST_INPUTS = frozenset({"TensorListFromTensor", "TensorListReserve"})


def accumulated_bytes(tensor: tf.Tensor) -> int | None:
    """The bytes a loop's accumulator `tensor` holds at the end of the loop.

    0 for any tensor that is not a loop's accumulator (or accumulates a
    shared buffer); None when it is one whose size cannot be known from the
    graph (NOTE [ What a loop keeps for its backward ]).
    """
    op = tensor.op
    if tensor.dtype != tf.variant or op.type not in LOOPS:
        return 0
    start = op.inputs[tensor.value_index].op
    if start.type != "EmptyTensorList":
        return 0  # not an accumulator: a list the loop reads or writes
    pushed = _pushed(op, tensor.value_index)
    if pushed is not None and pushed.op.type in _SHARED:
        return 0
    shape = tf.get_static_value(start.inputs[0])
    if shape is None or any(int(d) < 0 for d in tf.nest.flatten(shape.tolist())):
        return None
    iterations = _iterations(op)
    if iterations is None:
        return None
    element = math.prod(int(d) for d in tf.nest.flatten(shape.tolist()))
    return iterations * element * tf.as_dtype(start.get_attr("element_dtype")).size


def _iterations(op: tf.Operation) -> int | None:
    """How many times the loop runs, read from the lists it steps through, or its bound."""
    lengths = []
    for tensor in op.inputs:
        source = tensor.op
        if source.type == "TensorListReserve":
            lengths.append(tf.get_static_value(source.inputs[1]))
        elif source.type == "TensorListFromTensor":
            shape = source.inputs[0].shape
            lengths.append(shape[0] if shape.rank else None)
    known = [int(n) for n in lengths if n is not None and int(n) >= 0]
    if known:
        return max(known)
    bound = tf.get_static_value(op.inputs[1]) if len(op.inputs) > 1 else None
    return int(bound) if bound is not None and int(bound) >= 0 else None


def stepped_source(tensor: tf.Tensor) -> tf.Tensor | None:
    """For a loop's accumulator of the items of a list the loop steps through (an RNN's
    inputs, time step by time step), the tensor that list was made from: the list, a copy
    of it, is kept for the backward. None for any other tensor."""
    if tensor.dtype != tf.variant or tensor.op.type not in LOOPS:
        return None
    pushed = _pushed(tensor.op, tensor.value_index)
    if pushed is None or pushed.op.type != "TensorListGetItem":
        return None
    body = pushed.graph
    listed = pushed.op.inputs[0]
    index = next((i for i, t in enumerate(body.inputs) if t is listed), None)
    if index is None:
        return None
    source = tensor.op.inputs[index].op
    return source.inputs[0] if source.type == "TensorListFromTensor" else None


def _pushed(op: tf.Operation, index: int) -> tf.Tensor | None:
    """What the loop's body pushes onto loop variable `index` (identities looked through)."""
    body: Any = loop_body_graph(op)
    if body is None or index >= len(body.inputs):
        return None
    variable = body.inputs[index]
    for inner in body.get_operations():
        if inner.type == "TensorListPushBack" and inner.inputs[0] is variable:
            pushed = inner.inputs[1]
            while pushed.op.type == "Identity":
                pushed = pushed.op.inputs[0]
            return pushed
    return None
