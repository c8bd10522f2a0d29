"""Checkpointing a layer's calls in place, inside code that cannot be rebuilt.

NOTE [ In-place checkpoints ]
A subclassed layer's `call` is Python: a rewrite cannot regroup the calls it
makes. `checkpoint_in_place(layer)` makes every call of `layer` a recomputed
block where it stands, and `route_call(model, replacement)` makes a
Functional model that such code calls compute through a rebuilt model with
blocks (sharing its layers): the layer object stays in its parent (its weights,
its path in a saved model, its config), and its `call` is routed through a
`RecomputeBlock` that wraps it. The block is untracked (no Keras attribute
holds it), so nothing the model saves changes; a model loaded from a file has
no in-place checkpoints (apply them again). The block runs the layer through
`Layer.__call__` as usual, with the routing bypassed while the block's own
forward or recompute runs, so casts, masks and `training` are Keras's own
in both runs.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import keras

from tfrecompute.layers.block import RecomputeBlock

__all__ = ["checkpoint_in_place", "checkpointed_in_place", "route_call"]

_blocks: weakref.WeakKeyDictionary[Any, RecomputeBlock] = weakref.WeakKeyDictionary()
_bypass = threading.local()


@contextlib.contextmanager
def _bypassed(layer: Any) -> Iterator[None]:
    active: set[int] = getattr(_bypass, "layers", set())
    _bypass.layers = active | {id(layer)}
    try:
        yield
    finally:
        _bypass.layers = active


def _is_bypassed(layer: Any) -> bool:
    return id(layer) in getattr(_bypass, "layers", set())


class _InPlaceBlock(RecomputeBlock):
    """A block around one layer whose own `call` routes here (never serialized)."""

    def _run_inner(self, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        with _bypassed(self.inner[0]):
            return super()._run_inner(inputs, *args, **kwargs)


def checkpointed_in_place(layer: Any) -> bool:
    """Whether `checkpoint_in_place(layer)` was applied."""
    return layer in _blocks


def checkpoint_in_place(layer: keras.layers.Layer, *, policy: Any = None) -> None:
    """Makes every call of `layer` recompute in backprop, where the layer stands.

    See NOTE [ In-place checkpoints ]. Applying it twice does nothing more.

    Args:
        layer: a built Keras layer.
        policy: the block's recompute policy (see `RecomputeBlock`).
    """
    if checkpointed_in_place(layer):
        return
    block = _InPlaceBlock(layer, policy=policy, name=f"{layer.name}_in_place")
    original = layer.call

    @functools.wraps(original)
    def call(*args: Any, **kwargs: Any) -> Any:
        if _is_bypassed(layer):
            return original(*args, **kwargs)
        return block(*args, **kwargs)

    _blocks[layer] = block
    object.__setattr__(layer, "call", call)  # an instance attribute; Keras tracks nothing


def route_call(model: keras.Model, replacement: keras.Model) -> None:
    """Makes `model`'s calls run `replacement`, a rebuilt model sharing its layers.

    See NOTE [ In-place checkpoints ]: `model` stays where it is (its weights,
    its config); only what its `call` computes through changes. Routing again
    replaces the previous replacement.
    """
    original = _routes.setdefault(model, model.call)

    @functools.wraps(original)
    def call(inputs: Any, *args: Any, **kwargs: Any) -> Any:
        return replacement(inputs, *args, **kwargs)

    object.__setattr__(model, "call", call)


_routes: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
