"""The custom gradient of a block: `recompute_grad`, whose gradient is itself differentiable.

NOTE [ Why not tf.recompute_grad ]
`tf.recompute_grad` wraps its gradient function in a second
`tf.custom_gradient` whose own gradient raises `NotImplementedError`
("recompute_grad tried to transpose grad of ..."). TensorFlow reaches that
second level for

1. higher-order gradients: a gradient penalty differentiates the gradient;
2. `tf.saved_model.save` of a function that takes gradients through the
   block: SavedModel traces the gradient of every custom gradient it finds;
3. forward-mode autodiff: `tf.autodiff.ForwardAccumulator` transposes the
   gradient function to get a JVP.

The gradient function below is plain TensorFlow (a recompute under a local
tape, and that tape's gradient), so an enclosing tape records it and can
differentiate it again: cases 1 and 2 then give the same numbers as the layers
unwrapped. Case 3 still cannot be transposed (see NOTE [ Forward-mode
autodiff ] in `block.py`: a block runs plainly under an accumulator).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from tfrecompute._keras_internals import stop_recording

__all__ = ["depend_on", "recompute_grad"]


def _after(gradient: tf.Tensor) -> tf.Tensor:
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


def recompute_grad(fn: Callable[..., Sequence[tf.Tensor]]) -> Callable[..., list[tf.Tensor]]:
    """Returns `fn` checkpointed: its activations are recomputed in backprop.

    `fn` takes floating tensors positionally and returns a list of floating
    tensors. Its forward runs without recording on any tape; when a gradient
    reaches the outputs, `fn` runs again on the same inputs under a local tape
    and that tape's gradient is returned. Variables `fn` reads get their
    gradients as with `tf.custom_gradient`.

    In graph mode the recompute is called as `fn(*inputs, after=zero)`, where
    `zero` is a float scalar 0 that depends on the incoming gradient (the
    forward is called with `after=None`). The inputs already depend on it;
    `fn` must make every other tensor it captured (integer ids, masks, the
    replayed random seeds) depend on it too. Otherwise TensorFlow's common
    subexpression elimination merges the recompute of those ops with the
    forward's, and keeps their activations alive from the forward on: a block
    whose inputs are all integer token ids saved no memory at all (measured:
    560 MiB against 376 MiB for a 4-layer encoder at batch 256).

    Args:
        fn: the function to checkpoint. It must compute the same values when
            called again (the caller replays randomness and state).

    Returns:
        A function with the signature of `fn`.
    """

    @tf.custom_gradient
    def checkpointed(*args: tf.Tensor) -> Any:
        with stop_recording():
            result = list(fn(*args, after=None))

        def gradient(*result_grads: tf.Tensor, variables: Sequence[Any] | None = None) -> Any:
            variables = list(variables or [])
            # Outputs with no incoming gradient are left out of the targets
            # rather than given zeros_like(output): that would keep the
            # forward's outputs alive until backprop, just for their shapes.
            connected = [i for i, g in enumerate(result_grads) if g is not None]
            with tf.GradientTape() as tape:
                inputs = [tf.identity(a) for a in args]
                dependency = None
                if not tf.executing_eagerly() and connected:
                    dependency = _after(result_grads[connected[0]])
                    inputs = [a + tf.cast(dependency, a.dtype) for a in inputs]
                tape.watch(inputs)
                tape.watch(variables)
                recomputed = list(fn(*inputs, after=dependency))
            grads = tape.gradient(
                [recomputed[i] for i in connected],
                inputs + variables,
                output_gradients=[result_grads[i] for i in connected],
                unconnected_gradients=tf.UnconnectedGradients.ZERO,
            )
            if variables and not tf.executing_eagerly():
                # NOTE [ Variable gradients wait for the whole backward ]
                # An optimizer in the same graph updates a variable as soon as
                # its gradient exists. Released early, a block's variable
                # gradients let an update reach a read of the block's backward,
                # single or nested: freshly traced train steps then sometimes
                # trained differently from the unwrapped layers, never when the
                # updates ran after the gradient function (test_block.py
                # test_variable_updates_in_the_same_step_do_not_reach_the_
                # recompute). So they are released once every gradient of the
                # block is computed; a segment holds them through its backward
                # (the memory model counts that: `Chain.applied_grad_bytes`).
                with tf.control_dependencies(grads):
                    grads = grads[: len(inputs)] + [tf.identity(g) for g in grads[len(inputs) :]]
            return grads[: len(inputs)], grads[len(inputs) :]

        return result, gradient

    return checkpointed
