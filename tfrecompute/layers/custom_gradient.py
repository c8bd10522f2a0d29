"""The gradient primitive of a block: `attach_gradient`, and the ordering guards of a recompute.

NOTE [ Why not tf.recompute_grad ]
`tf.recompute_grad` wraps its gradient function in a second
`tf.custom_gradient` whose own gradient raises `NotImplementedError`
("recompute_grad tried to transpose grad of ..."). TensorFlow reaches that
second level for higher-order gradients (a gradient penalty differentiates
the gradient), for `tf.saved_model.save` of a function that takes gradients
through the block, and for forward-mode autodiff. A block's gradient function
is plain TensorFlow (a recompute under a local tape, and that tape's
gradient), so an enclosing tape records it and can differentiate it again.
Forward mode still cannot transpose it (see NOTE [ Forward-mode autodiff ] in
`block.py`: a block runs plainly under an accumulator).

NOTE [ Why not tf.custom_gradient ]
`tf.custom_gradient` fixes the inputs of the operation before its function
runs, and a block learns what it must differentiate only by running its
forward: the tensors the wrapped code captures (closes over), the variables it
reads directly. It also asks for every input and variable gradient at once,
so outputs without an incoming gradient are given zeros, and in graph mode it
registers each gradient function in TensorFlow's global registry, which keeps
the function's closure (and the graph tensors it holds) alive for the life of
the process. `attach_gradient` records an operation whose inputs are chosen
after the forward, and in a graph gives the op its own gradient function,
which lives as long as the op's graph. A SavedModel does not save such a
gradient function: a restored function differentiates through the forward's
own ops (the same numbers, without the recompute).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from tfrecompute._keras_internals import identity_n_gradient, record_operation, stop_recording

__all__ = ["after", "attach_gradient", "depend_on"]


def after(gradient: tf.Tensor) -> tf.Tensor:
    """A zero that depends on the value of `gradient`.

    XLA ignores control dependencies, so without a data dependency on the
    incoming gradient it may schedule the recompute as early as the forward
    and keep its activations alive, which would undo the memory saving. This
    is the guard `tf.recompute_grad` uses: `reduce_max` of at most one element
    (`-inf` for an empty tensor), and `where(e == e, 0, nan)` so that XLA
    cannot fold it to a constant zero.
    """
    element = tf.reduce_max(tf.reshape(gradient, [-1])[:1])
    element = tf.cast(element, tf.bool)
    return tf.where(tf.equal(element, element), 0.0, float("nan"))


def depend_on(value: Any, after: tf.Tensor | None) -> Any:
    """`value` unchanged, but depending on the scalar zero `after` if it is a tensor."""
    if after is None or not tf.is_tensor(value):
        return value
    if value.dtype == tf.bool:
        return tf.logical_or(value, tf.cast(after, tf.bool))
    if value.dtype.is_floating or value.dtype.is_integer or value.dtype.is_complex:
        return value + tf.cast(after, value.dtype)
    return value


def attach_gradient(
    values: Sequence[tf.Tensor],
    inputs: Sequence[tf.Tensor],
    backward: Callable[..., Sequence[Any]],
    *,
    op_type: str = "RecomputeBlock",
) -> list[tf.Tensor]:
    """Returns tensors equal to `values` whose gradient with respect to `inputs` is `backward`.

    `backward(*grads)` gets one gradient per returned tensor and returns one
    gradient (or None) per input. Nothing connects the returned tensors to
    how `values` were computed: backprop reaches `inputs` only through
    `backward`. Eagerly the operation is recorded on the tapes that watch an
    input; in a graph it is an `IdentityN` op whose gradient function is
    `backward` (for gradients built from the graph, e.g. of a `tf.function`
    called under an eager tape, or of a `tf.while_loop` body), recorded on the
    graph's tapes as well.

    See NOTE [ Why not tf.custom_gradient ] above.
    """
    values, inputs = list(values), list(inputs)
    if tf.executing_eagerly():
        with stop_recording():
            outputs = [tf.identity(v) for v in values]
    else:
        count = len(values)

        def graph_gradient(op: tf.Operation, *grads: Any) -> list[Any]:
            return [None] * count + list(backward(*grads[:count]))

        graph = tf.compat.v1.get_default_graph()
        with stop_recording(), identity_n_gradient(graph, graph_gradient):
            outputs = list(tf.identity_n(values + inputs)[:count])
    record_operation(op_type, outputs, inputs, backward)
    return outputs
