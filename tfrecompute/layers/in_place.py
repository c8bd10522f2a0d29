"""Checkpoints applied where the layers stand, at run time: a model stays what it is.

NOTE [ In-place checkpoints ]
A subclassed layer's `call` is Python: a rewrite cannot regroup the calls it
makes. `checkpoint_in_place(layer)` makes every call of `layer` a recomputed
block where it stands, and `route_call(model, replacement)` makes a
Functional or Sequential model compute through a rebuilt model with blocks
(sharing its layers): the layer or model object stays in its parent (its
weights, its path in a saved model, its config), and only its `call` changes,
as an instance attribute that runs a `RecomputeBlock`. The blocks are
untracked (no Keras or TensorFlow attribute holds them), so nothing the model
saves changes. The block runs the layer through `Layer.__call__` as usual,
with the routing bypassed while the block's own forward or recompute runs, so
casts, masks and `training` are Keras's own in both runs.

Losses made inside a recomputed forward (`add_loss` in a layer's `call`, an
activity regularizer) come out of the block; an untracked block hands them to
a layer a model tracks (the checkpointed layer, or a layer inside the block), where
`model.losses` finds them and Keras clears them at the next call. The
layer's own `Layer.__call__` around the routed call applies its activity
regularizer to the block's output, so the run inside leaves it out.

NOTE [ A checkpointed model is the model ]
`tfrecompute.recompute(model)` applies a plan with these two means only, and
records what it changed (`Checkpoints`): the model object is returned, its
layers, variables, weight paths, config and saved files the original's. So
every way of saving, restoring, exporting and exchanging weights behaves as
without checkpointing, and a model loaded from a file is the plain model
(recompute it again). `remove(model)` undoes everything recorded for it, and
`suspended(model)` does so for a while (to trace the model as it was
defined). The model's compiled train, test and predict functions are
dropped whenever its checkpoints change, so that `fit` traces them again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import keras

from tfrecompute._keras_internals import all_sublayers
from tfrecompute.layers.block import RecomputeBlock

__all__ = [
    "Checkpoints",
    "checkpoint_in_place",
    "checkpointed_in_place",
    "checkpoints",
    "record",
    "remove",
    "restored_on_error",
    "route_call",
    "suspended",
    "unrouted",
]

_MISSING = object()
_bypass = threading.local()


@dataclasses.dataclass(frozen=True)
class Checkpoints:
    """What `tfrecompute.recompute` applied to a model (NOTE [ A checkpointed model is the model ]).

    Attributes:
        plan: the `strategies.Plan` applied.
        runtime: the model with blocks that the model's own call runs: a
            Functional or Sequential model sharing its layers, never saved;
            None for a subclassed model, whose calls are checkpointed where
            its code makes them.
        blocks: every `RecomputeBlock` applied, in call order: those of
            `runtime` (and of the models routed inside it) and those around
            layers checkpointed in place.
        changed: the layers and models whose `call` was changed; empty when
            nothing is applied (`tfrecompute.checkpoints` of a model left as
            it was), and then the record is false.
        note: when nothing is applied, why (e.g. the budget is above the
            predicted peak of storing everything).
    """

    plan: Any
    runtime: keras.Model | None
    blocks: tuple[RecomputeBlock, ...]
    changed: tuple[Any, ...]
    note: str = ""

    @property
    def applied(self) -> bool:
        """Whether anything is applied: `bool(checkpoints)` says the same."""
        return bool(self.changed)

    def __bool__(self) -> bool:
        return self.applied

    def summary(self) -> str:
        """One line of what is applied (then the plan's table), or why nothing is."""
        if not self.applied:
            return f"No checkpoints applied: {self.note or 'nothing was applied to this model'}"
        blocks = f"{len(self.blocks)} recompute block{'s' if len(self.blocks) != 1 else ''}"
        if self.plan is None:
            return f"Checkpoints applied: {blocks} around attention cores, without a plan"
        head = f"Checkpoints applied: {blocks} of plan {self.plan.strategy!r}"
        return f"{head}\n{self.plan.summary()}"


@dataclasses.dataclass
class _Change:
    """One changed attribute (`call`, or an attention layer's core): what it was, is, runs."""

    previous: Any
    call: Any
    runs: Any


# NOTE [ Records off the model's attributes ]
# What was changed is recorded on the replacement itself (the function set as
# `call`, or an attention core), never as an attribute of the layer or model:
# `dir(model)`, `vars` beyond the replaced method, `get_config()` and saved files
# stay the original's (keras-hub's serialization tests compare `dir(model)` with
# a rebuilt copy). A global map would hold the records, and through their
# closures the models, forever; on the replacement they live and die with it.
_CHANGE = "__tfrecompute_change__"  # on a replacement: the `_Change` it makes
_APPLIED = "__tfrecompute_applied__"  # on a model's replacement `call`: its `Checkpoints`


def _record_of(value: Any, key: str) -> Any:
    """What is recorded under `key` on a replacement `value`; None for anything else."""
    try:
        return vars(value).get(key)
    except (TypeError, AttributeError):  # no __dict__: not a replacement of ours
        return None


def _changes_of(target: Any) -> dict[str, _Change]:
    found = {name: _record_of(value, _CHANGE) for name, value in list(vars(target).items())}
    return {name: change for name, change in found.items() if isinstance(change, _Change)}


@contextlib.contextmanager
def unrouted(layer: Any) -> Iterator[None]:
    """Within it, calls of `layer` run the layer's own `call`, not the in-place block
    routed around it (as the block itself runs it)."""
    active: set[int] = getattr(_bypass, "layers", set())
    _bypass.layers = active | {id(layer)}
    try:
        yield
    finally:
        _bypass.layers = active


def _is_bypassed(layer: Any) -> bool:
    return id(layer) in getattr(_bypass, "layers", set())


@contextlib.contextmanager
def _without_activity_regularizer(layer: Any) -> Iterator[None]:
    """The layer's `__call__` around the routed call applies it (NOTE [ In-place checkpoints ])."""
    regularizer = getattr(layer, "activity_regularizer", None)
    if regularizer is None:
        yield
        return
    object.__setattr__(layer, "activity_regularizer", None)
    try:
        yield
    finally:
        object.__setattr__(layer, "activity_regularizer", regularizer)


class _InPlaceBlock(RecomputeBlock):
    """A block around one layer whose own `call` routes here (never serialized)."""

    _warns_of_dtypes = False  # placed by `recompute()` around the model's own layer

    def _run_inner(self, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        layer = self.inner[0]
        with unrouted(layer), _without_activity_regularizer(layer):
            return super()._run_inner(inputs, *args, **kwargs)


def change_attribute(
    target: Any, attribute: str, value: Any, runs: Any, *, over: bool = False
) -> None:
    """Sets `target.<attribute>` as an instance attribute that Keras and TensorFlow do not track.

    Keras's `.keras` saving walks a layer's attributes but saves only layers,
    variables and other Keras objects, never a plain function: `value` is one.
    `runs` is what it runs (a block, a rebuilt model), recorded with it.
    A change already there is undone first, or, with `over`, kept under the
    new one and given back by `release`.
    """
    if vars(target).get(attribute) is value:
        return  # applied already (a layer shared by two models): one change, one release
    if not over:
        release(target, attribute)
    vars(value)[_CHANGE] = _Change(vars(target).get(attribute, _MISSING), value, runs)
    object.__setattr__(target, attribute, value)


def release(target: Any, attribute: str | None = None) -> None:
    """Gives `target` back what `change_attribute` replaced (every attribute if None)."""
    changes = _changes_of(target)
    for name in list(changes) if attribute is None else [attribute]:
        change = changes.get(name)
        if change is None:
            continue
        if change.previous is _MISSING:
            object.__delattr__(target, name)
        else:
            object.__setattr__(target, name, change.previous)


def checkpointed_in_place(layer: Any) -> bool:
    """Whether `checkpoint_in_place(layer)` applies to `layer` now."""
    change = _changes_of(layer).get("call")
    return change is not None and isinstance(change.runs, _InPlaceBlock)


def checkpoint_in_place(layer: keras.layers.Layer, *, policy: Any = None) -> RecomputeBlock:
    """Makes every call of `layer` recompute in backprop, where the layer stands.

    See NOTE [ In-place checkpoints ]. Applying it again replaces the block
    (with the new policy).

    Args:
        layer: a built Keras layer.
        policy: the block's recompute policy (see `RecomputeBlock`).

    Returns:
        The untracked block that the layer's calls now run through.
    """
    release(layer, "call")
    block = _InPlaceBlock(layer, policy=policy, name=f"{layer.name}_in_place")
    object.__setattr__(block, "_loss_owner", weakref.ref(layer))
    original = layer.call
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    first = next(iter(inspect.signature(original).parameters.values()), None)
    first = first.name if first is not None and first.kind in positional else None

    @functools.wraps(original)
    def call(*args: Any, **kwargs: Any) -> Any:
        if _is_bypassed(layer):
            return original(*args, **kwargs)
        if not args and first is not None and first in kwargs:  # `layer(hidden_states=x)`
            args = (kwargs.pop(first),)
        return block(*args, **kwargs)

    change_attribute(layer, "call", call, block)
    return block


def route_call(
    model: keras.Model, replacement: keras.Model, *, blocks: Sequence[RecomputeBlock] = ()
) -> None:
    """Makes `model`'s calls run `replacement`, a rebuilt model sharing its layers.

    See NOTE [ In-place checkpoints ]: `model` stays where it is (its weights,
    its config); only what its `call` computes through changes. The losses
    made inside `blocks` (the blocks placed in `replacement`) go to `model`.
    Routing again replaces the previous replacement.
    """
    release(model, "call")
    for block in blocks:
        holder = _loss_holder(block)
        if holder is not None:
            object.__setattr__(block, "_loss_owner", weakref.ref(holder))
    original = model.call

    @functools.wraps(original)
    def call(inputs: Any, *args: Any, **kwargs: Any) -> Any:
        return replacement(inputs, *args, **kwargs)

    change_attribute(model, "call", call, replacement)


def _loss_holder(block: RecomputeBlock) -> keras.layers.Layer | None:
    """A layer of the block that the model tracks and whose `add_loss` takes losses.

    Keras's Functional models refuse `add_loss`, so the losses of a block in a
    rebuilt model go to one of its own layers (the model collects every layer's).
    None when the block runs only operations (e.g. `x[:, 0]`): those make no losses.
    """
    for layer in all_sublayers(block):
        if layer is not block and not isinstance(layer, (keras.Model, keras.layers.InputLayer)):
            return layer
    return None


def _drop_compiled_functions(model: keras.Model) -> None:
    """Makes `fit`, `evaluate` and `predict` trace `model`'s call again."""
    for name in ("train_function", "test_function", "predict_function"):
        if getattr(model, name, None) is not None:
            setattr(model, name, None)


def record(model: keras.Model, applied: Checkpoints) -> None:
    """Records what was applied to `model` (after `remove(model)` undid the previous).

    The record rides on the model's replacement `call` (NOTE [ Records off the
    model's attributes ]); a model whose own call runs as defined (a subclassed
    model checkpointed inside) gets a `call` that only passes through, to carry it.
    """
    call = _changed_call(model)
    if call is None:
        original = model.call

        @functools.wraps(original)
        def call(*args: Any, **kwargs: Any) -> Any:
            return original(*args, **kwargs)

        change_attribute(model, "call", call, None)
    if all(target is not model for target in applied.changed):
        applied = dataclasses.replace(applied, changed=(*applied.changed, model))
    vars(call)[_APPLIED] = applied
    _drop_compiled_functions(model)


def _changed_call(model: Any) -> Any:
    """The model's replacement `call`, None if its call is its own."""
    try:
        call = vars(model).get("call")
    except TypeError:
        return None
    return call if isinstance(_record_of(call, _CHANGE), _Change) else None


def checkpoints(model: Any) -> Checkpoints | None:
    """What `tfrecompute.recompute` applied to `model` and is in force; None if nothing."""
    applied = _record_of(_changed_call(model), _APPLIED)
    return applied if isinstance(applied, Checkpoints) else None


def remove(model: keras.Model) -> Checkpoints | None:
    """Undoes what was recorded for `model`; returns it (None if nothing was)."""
    applied = checkpoints(model)
    if applied is not None:
        for target in reversed(applied.changed):
            release(target)
        _drop_compiled_functions(model)
    return applied


def _saved_changes(applied: Checkpoints) -> list[tuple[Any, str, _Change]]:
    return [
        (target, attribute, change)
        for target in applied.changed
        for attribute, change in _changes_of(target).items()
    ]


def _redo(saved: list[tuple[Any, str, _Change]]) -> None:
    for target, attribute, change in saved:
        change_attribute(target, attribute, change.call, change.runs)


@contextlib.contextmanager
def restored_on_error(model: keras.Model) -> Iterator[None]:
    """Gives `model` back the checkpoints it had on entry if the body raises."""
    applied = checkpoints(model)
    saved = [] if applied is None else _saved_changes(applied)
    try:
        yield
    except BaseException:
        remove(model)
        _redo(saved)
        if applied is not None:
            record(model, applied)
        raise


@contextlib.contextmanager
def suspended(model: keras.Model) -> Iterator[None]:
    """`model` as it was defined while inside: its recorded checkpoints undone, then redone."""
    applied = checkpoints(model)
    if applied is None:
        yield
        return
    saved = _saved_changes(applied)
    for target, attribute, _ in reversed(saved):
        release(target, attribute)
    try:
        yield
    finally:
        _redo(saved)
