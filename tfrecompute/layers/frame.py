"""`RecomputeFrame`: the state of one recomputed call of a block.

A block's training call makes one frame. The frame runs the forward, hands
the custom gradient a function that runs the same forward again in backprop
(`RecomputeFrame.run`), and puts the block's outputs back together. What the
forward and the recompute must share (the call's arguments, the replayed
state) and what the forward leaves for the recompute (how many losses, and in
debug mode its tensors) are named attributes of the frame, not entries of a
dict shared by closures.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

from tfrecompute._keras_internals import call_context, get_keras_mask, set_keras_mask
from tfrecompute.layers.custom_gradient import depend_on
from tfrecompute.layers.debug import verify_recompute
from tfrecompute.layers.state import RecordingStatelessScope, snapshot

__all__ = ["Forward", "RecomputeFrame", "is_float_tensor"]


def is_float_tensor(value: Any) -> bool:
    """Whether `value` is a floating tensor (what gradients flow to)."""
    return tf.is_tensor(value) and value.dtype.is_floating


@dataclasses.dataclass
class Forward:
    """What the forward run of a frame left.

    Attributes:
        outputs: the outputs as the wrapped layers returned them (released
            once the block's outputs are packed: backprop must not keep them).
        scope: the stateless scope the forward ran in: its state updates and
            losses (released with `outputs`).
        masks: the Keras mask of each flat output (released with `outputs`).
        n_losses: how many losses the layers added; the recompute returns
            them after the floating outputs.
        results: in debug mode, the forward's tensors, which every recompute
            is compared with; None otherwise.
        operations: in graph mode, the ops the forward added to the graph
            (the block checks them for randomness it cannot replay).
    """

    outputs: Any
    scope: RecordingStatelessScope | None
    masks: list[Any] | None
    n_losses: int
    results: list[tf.Tensor] | None
    operations: list[tf.Operation]


class RecomputeFrame:
    """One recomputed call: its arguments, the replayed state and the forward's record.

    NOTE [ What crosses the recompute boundary ]
    Only floating tensors are passed positionally to the recomputed function:
    they are what gradients flow to. Everything else (integer token ids,
    boolean masks, Python values, `training`) is held by the frame; a
    graph-mode custom gradient rejects keyword arguments and cannot
    differentiate integers anyway. Likewise only the floating outputs come back
    through it; other outputs (and Keras masks) are taken from the forward run,
    as they carry no gradient.

    The recompute receives copies of the floating inputs (so that its tape
    watches tensors of its own), and copies carry no Keras mask. A layer that
    reads its masks from its inputs' `_keras_mask` (the `query_mask` and
    `value_mask` of MultiHeadAttention, any layer called with several tensors)
    would then attend over padding in the recompute only, and the gradients
    would be wrong. So `execute` attaches each input's mask to its copy.

    Args:
        block: the `RecomputeBlock` being called.
        call: `(inputs, args, kwargs)` of the call.
        training: the call's `training` value.
        mask: the call's incoming Keras mask.
        state_variables: the variables the recompute replays (see `state.py`).
        debug: compare every recompute with the forward.
    """

    def __init__(
        self,
        block: keras.layers.Layer,
        call: tuple[Any, tuple[Any, ...], dict[str, Any]],
        *,
        training: Any,
        mask: Any,
        state_variables: list[Any],
        debug: bool,
    ) -> None:
        self.block = block
        self.call = call
        self.flat = keras.tree.flatten(call)
        self.float_positions = [i for i, v in enumerate(self.flat) if is_float_tensor(v)]
        self.input_masks = [get_keras_mask(self.flat[i]) for i in self.float_positions]
        self.training = training
        self.mask = mask
        self.state_variables = state_variables
        self.state_values = snapshot(state_variables)
        self.debug = debug
        self.forward: Forward | None = None

    @property
    def float_inputs(self) -> list[tf.Tensor]:
        """The floating tensors among the call's arguments, in flat order."""
        return [self.flat[i] for i in self.float_positions]

    def execute(
        self, float_values: Sequence[tf.Tensor], after: tf.Tensor | None = None
    ) -> tuple[Any, RecordingStatelessScope]:
        """Runs the wrapped layers on `float_values` from the snapshot state.

        `after` (in a graph-mode recompute) orders everything the frame holds
        after the incoming gradient: see `custom_gradient.recompute_grad`.
        """
        values = [depend_on(v, after) for v in self.flat]
        for position, value, input_mask in zip(
            self.float_positions, float_values, self.input_masks
        ):
            if input_mask is not None and value is not self.flat[position]:
                set_keras_mask(value, depend_on(input_mask, after))
            values[position] = value
        inputs, args, kwargs = keras.tree.pack_sequence_as(self.call, values)
        mask = keras.tree.map_structure(lambda m: depend_on(m, after), self.mask)
        replayed = [depend_on(v, after) for v in self.state_values]
        with (
            call_context(self.block, self.training),
            RecordingStatelessScope(zip(self.state_variables, replayed)) as scope,
        ):
            outputs = self.block._run_inner(
                inputs, *args, training=self.training, mask=mask, **kwargs
            )
        return outputs, scope

    @staticmethod
    def differentiable(outputs: Any, scope: RecordingStatelessScope) -> list[tf.Tensor]:
        """The tensors the custom gradient returns: floating outputs, then losses."""
        floats = [o for o in keras.tree.flatten(outputs) if is_float_tensor(o)]
        return floats + list(scope.losses)

    def run(self, *float_values: tf.Tensor, after: tf.Tensor | None = None) -> list[tf.Tensor]:
        """The checkpointed function: the forward on its first call, then each recompute."""
        if self.forward is not None:  # a recompute
            results = self.differentiable(*self.execute(float_values, after))
            if self.debug:
                return verify_recompute(self.block.name, self.forward.results or [], results)
            return results
        graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
        known = len(graph.get_operations()) if graph is not None else 0
        outputs, scope = self.execute(float_values, after)
        results = self.differentiable(outputs, scope)
        self.forward = Forward(
            outputs=outputs,
            scope=scope,
            masks=[get_keras_mask(o) for o in keras.tree.flatten(outputs)],
            n_losses=len(scope.losses),
            results=results if self.debug else None,
            operations=graph.get_operations()[known:] if graph is not None else [],
        )
        return results

    def pack(self, results: Sequence[tf.Tensor]) -> tuple[Any, list[tf.Tensor]]:
        """The block's outputs from the custom gradient's `results`, and the losses.

        Non-floating outputs come from the forward; each output gets the mask
        the layers attached to it. Releases the forward's outputs, scope and
        masks: the backward pass needs none of them.
        """
        forward = self.forward
        assert forward is not None and forward.masks is not None
        split = len(results) - forward.n_losses
        floats, losses = list(results[:split]), list(results[split:])
        flat_outputs = keras.tree.flatten(forward.outputs)
        merged = [floats.pop(0) if is_float_tensor(o) else o for o in flat_outputs]
        for tensor, output_mask in zip(merged, forward.masks):
            if output_mask is not None:
                set_keras_mask(tensor, output_mask)
        packed = keras.tree.pack_sequence_as(forward.outputs, merged)
        forward.outputs = forward.scope = forward.masks = None
        forward.operations = []
        return packed, losses
