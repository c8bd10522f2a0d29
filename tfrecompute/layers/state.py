"""Snapshot, replay and commit of a block's non-trainable state.

NOTE [ Why a block runs statelessly ]
A recomputed block runs its forward twice: once in the forward pass and once
again during backprop. Two things go wrong if the layers simply run twice:

1. Randomness. Dropout and every layer that draws from a Keras
   `SeedGenerator` advance the generator's state variable on each draw, so the
   recompute would see other random numbers than the forward (a different
   dropout mask), and the gradients would be silently wrong.
2. State updates. BatchNormalization assigns its moving statistics on every
   training forward; running the forward twice would apply the update twice.

The fix: before the forward, read the block's non-trainable variables into a
snapshot of tensors. Both the forward and the recompute run inside a
`keras.StatelessScope` that maps each of those variables to its snapshot value:
every read sees the snapshot and every assignment is collected by the scope
instead of being applied. The forward's collected new values are then assigned
once. The recompute starts from the same snapshot, so it draws the same random
numbers and computes the same statistics, and its collected updates are
discarded.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

__all__ = ["RecordingStatelessScope", "snapshot"]


class RecordingStatelessScope(keras.StatelessScope):
    """A `keras.StatelessScope` that remembers which variables were assigned.

    Keras keys its collected updates by `id(variable)`; keeping the variables
    themselves lets the caller name a variable that was assigned but is not
    part of the state it can replay (for example the global seed generator).
    """

    def __init__(self, state_mapping: Sequence[tuple[Any, Any]]) -> None:
        super().__init__(state_mapping=list(state_mapping), collect_losses=True)
        self.initial_values = dict(self.state_mapping)
        self.assigned: dict[int, Any] = {}

    def add_update(self, update: tuple[Any, Any]) -> None:
        variable, _ = update
        self.assigned[id(variable)] = variable
        super().add_update(update)

    def changed(self, variable: Any) -> bool:
        """Whether `variable` was assigned a new value inside the scope."""
        return self.state_mapping.get(id(variable)) is not self.initial_values.get(id(variable))


def snapshot(variables: Sequence[Any]) -> list[tf.Tensor]:
    """Reads the current values of `variables` as tensors, without autocast.

    The values are materialised tensors (not variable handles), so later
    assignments to the variables do not change them. Inside an enclosing
    stateless scope (a block nested in another block) the enclosing scope's
    values are read, which is what the enclosing block replays. A block is
    built with `autocast=False`, so no autocast scope is active when it reads.
    """
    return [tf.convert_to_tensor(v.value) for v in variables]
