"""`checkpoint(fn)`: a function, or a layer's method, recomputed in backprop.

NOTE [ Checkpointed functions ]
`tfrecompute.checkpoint(fn)` runs `fn` through a `_FunctionBlock`: a
`RecomputeBlock` around a layer whose call is `fn`, so the recompute frame,
the custom gradient, the replay of randomness and the single commit of state
are the block's own (NOTE [ What crosses the recompute boundary ] in
`frame.py`). What a block learns from the layers it wraps, a function cannot
say; so:

* State. The non-trainable variables the recompute replays (seed generator
  states, BatchNormalization's statistics) are those of what `fn` can reach:
  the layer a method is bound to, the layers, seed generators and variables
  its closure and the globals it names hold, and `state=`. They are tracked
  by the function's layer, never by the model. A function that assigns a
  variable none of these holds fails (`NonReplayableRandomnessError`) rather
  than replay it wrong. Trainable variables are read as variables, and every
  one the forward reads gets its gradient, as in a block.
* When. The function is checkpointed whenever a tape records and the Keras
  call it runs in is not in inference (`training=False`), as
  `torch.utils.checkpoint` checkpoints whenever autograd records; outside any
  Keras call, `training` is None and layers inside take their own default.
* Arguments go to `fn` exactly as passed, never through Keras's `__call__`
  (no conversion, no rule on nested arguments).
* Losses a layer adds inside go to the layer the method is bound to (the
  first layer `fn` reaches); a plain function that reaches no layer and adds
  a loss fails.
* Nothing is saved. The block is held by the `Checkpointed` object, and a
  decorated method caches its bound `Checkpointed` on the instance as an
  attribute that is neither a Keras object nor a `tf.function`: Keras's
  saving, TensorFlow's object graph and SavedModel export skip it.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np

from tfrecompute._keras_internals import current_training
from tfrecompute._messages import fail
from tfrecompute.layers.block import RecomputeBlock
from tfrecompute.layers.policy import boundary, resolve_policy

__all__ = ["Checkpointed", "checkpoint", "reachable_state"]

_STATEFUL = (keras.layers.Layer, keras.random.SeedGenerator, keras.Variable)


def _held(value: Any) -> list[Any]:
    """The layers, seed generators and variables in `value` (a list, tuple or dict of them)."""
    if isinstance(value, _STATEFUL):
        return [value]
    if isinstance(value, (list, tuple)):
        return [item for item in value if isinstance(item, _STATEFUL)]
    if isinstance(value, dict):
        return [item for item in value.values() if isinstance(item, _STATEFUL)]
    return []


def reachable_state(fn: Any) -> list[Any]:
    """What `fn` can reach: layers, seed generators, variables (NOTE [ Checkpointed functions ])."""
    found: dict[int, Any] = {}
    _reach(fn, found, set(), depth=4)
    return list(found.values())


def _reach(fn: Any, found: dict[int, Any], seen: set[int], depth: int) -> None:
    """Adds what `fn` holds, and what the functions in its closure hold, `depth` levels down."""
    if id(fn) in seen or depth < 0:
        return
    seen.add(id(fn))
    for value in _held(fn) + _held(getattr(fn, "__self__", None)):
        found.setdefault(id(value), value)
    values: list[Any] = []
    if isinstance(fn, functools.partial):
        values = [fn.func, *fn.args, *fn.keywords.values()]
    elif inspect.isfunction(function := getattr(fn, "__func__", fn)):
        names = inspect.getclosurevars(function)
        values = [*names.nonlocals.values(), *names.globals.values()]
    for value in values:
        for held in _held(value):
            found.setdefault(id(held), held)
        if callable(value) and not isinstance(value, (type, *_STATEFUL)):
            _reach(value, found, seen, depth - 1)


class _FunctionLayer(keras.layers.Layer):
    """Calls the checkpointed function; tracks what it reaches (never saved by a model)."""

    def __init__(self, fn: Callable[..., Any], holders: Sequence[Any], **kwargs: Any) -> None:
        super().__init__(autocast=False, **kwargs)
        self._fn = fn
        self.holders = list(holders)  # their variables are the block's
        self.built = True

    def call(self, *args: Any, **kwargs: Any) -> Any:
        return self._fn(*args, **kwargs)


def _block_name(fn: Any) -> str:
    name = getattr(fn, "__name__", None) or type(fn).__name__
    return "checkpoint_" + re.sub(r"[^A-Za-z0-9_.-]", "_", name)


class _FunctionBlock(RecomputeBlock):
    """The block a checkpointed function runs through (NOTE [ Checkpointed functions ])."""

    _foreign_state_fix = (
        "Pass the layers or seed generators it uses as `state=` to tfrecompute.checkpoint, "
        "or checkpoint a method of the layer that owns them"
    )

    def __init__(
        self, fn: Callable[..., Any], *, holders: Sequence[Any], policy: Any, name: str
    ) -> None:
        super().__init__(_FunctionLayer(fn, holders, name=f"{name}_fn"), policy=policy, name=name)
        self.built = True
        self._fn = fn
        owner = next((h for h in holders if isinstance(h, keras.layers.Layer)), None)
        self._loss_owner = (lambda: owner) if owner is not None else self._no_loss_owner

    def _no_loss_owner(self) -> Any:
        fail(
            "tfrecompute.checkpoint",
            f"the function '{self._fn!r}' added a loss (`add_loss`, an activity "
            "regularizer) but reaches no layer that a model tracks, so the loss would be lost",
            "fn",
            self._fn,
            "Checkpoint a method of the layer instead, or pass that layer as `state=`",
        )

    def run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Calls the function, checkpointed when a tape records in training."""
        training = kwargs.get("training")
        if not isinstance(training, (bool, np.bool_)):
            training = current_training()
        with boundary():  # what runs inside is this function's (NOTE [ Recompute policies ])
            return self._call((args, kwargs), (), {}, training, None)

    def _run_inner(self, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        call_args, call_kwargs = inputs
        return self._fn(*call_args, **call_kwargs)

    def _unbuilt(self) -> bool:
        """Whether a layer the function reaches is not built yet."""
        holders = self.inner[0].holders
        return any(isinstance(h, keras.layers.Layer) and not h.built for h in holders)

    def _call(
        self, inputs: Any, args: tuple[Any, ...], kwargs: dict[str, Any], training: Any, mask: Any
    ) -> Any:
        # A block builds the layers it calls just before calling them (NOTE [ Layers built
        # by the forward ] in frame.py); the layers a function reaches are called by the
        # function, inside the forward's stateless scope, where Keras would leave their
        # variables uninitialized. They are built first, by a symbolic call.
        if self._unbuilt() and self._may_recompute(inputs, args, kwargs, training):
            self._build_symbolically(inputs, args, kwargs)
        return super()._call(inputs, args, kwargs, training, mask)

    def _may_recompute(
        self, inputs: Any, args: tuple[Any, ...], kwargs: dict[str, Any], training: Any
    ) -> bool:
        recompute_in = True if training is None else training
        return super()._may_recompute(inputs, args, kwargs, recompute_in)


class Checkpointed:
    """A function recomputed in backprop: what `tfrecompute.checkpoint` returns.

    Called, it runs the function; as a method decorator, each instance gets
    its own (cached on the instance, untracked).
    """

    def __init__(self, fn: Callable[..., Any], policy: Any, state: Sequence[Any]) -> None:
        functools.update_wrapper(self, fn)
        self._fn = fn
        self._policy = policy
        self._state = list(state)
        self._block: _FunctionBlock | None = None

    def __repr__(self) -> str:
        return f"tfrecompute.checkpoint({self._fn!r})"

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        if instance is None:
            return self
        key = f"_tfrecompute_checkpoint_{id(self)}"
        bound = vars(instance).get(key)
        if bound is None:
            bound = Checkpointed(self._fn.__get__(instance, owner), self._policy, self._state)
            object.__setattr__(instance, key, bound)  # untracked: NOTE [ Checkpointed functions ]
        return bound

    @property
    def block(self) -> _FunctionBlock:
        """The block the function runs through (made on first use)."""
        if self._block is None:
            holders = reachable_state(self._fn)
            holders += [s for s in self._state if all(s is not h for h in holders)]
            self._block = _FunctionBlock(
                self._fn, holders=holders, policy=self._policy, name=_block_name(self._fn)
            )
        return self._block

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.block.run(args, kwargs)


def _check_state(state: Any) -> list[Any]:
    values = list(state) if isinstance(state, (list, tuple)) else [state]
    for value in values:
        if not isinstance(value, _STATEFUL):
            fail(
                "tfrecompute.checkpoint",
                "`state` must hold Keras layers, seed generators or variables",
                "state",
                state,
                "Pass the layers (or keras.random.SeedGenerator objects) whose state the "
                "function reads or updates, e.g. state=[dropout_layer]",
                error=TypeError,
            )
    return values


def checkpoint(fn: Callable[..., Any] | None = None, *, policy: Any = None, state: Any = ()) -> Any:
    """Makes `fn` recompute in backprop what it computed, keeping only its arguments.

    The function counterpart of `RecomputeBlock` (as `torch.utils.checkpoint`
    and `jax.checkpoint` are of theirs), with the same guarantees: the same
    outputs and gradients as `fn` itself, eagerly, under `tf.function`, XLA
    and `tf.distribute` strategies; Dropout masks and every Keras
    `SeedGenerator` draw replayed exactly; state updates (BatchNormalization)
    applied once; every trainable variable `fn` reads gets its gradient.
    Works on a plain function, a bound method, and as a decorator of a
    method in a class body (each instance then gets its own). Custom layers
    use it to recompute only part of their call, e.g. an attention core
    (Megatron-LM's selective recompute; `policy="attention"` does this for
    Keras and keras-hub attention layers).

    The state `fn` replays is that of what it reaches: the layer of a bound
    method, and the layers, seed generators and variables in its closure and
    the globals it names (NOTE [ Checkpointed functions ] in
    `tfrecompute/layers/function.py`). `fn` is checkpointed while a gradient
    tape records, unless the Keras call around it is in inference.

    Args:
        fn: the function. Without it, returns a decorator.
        policy: None (keep only the arguments) or "dots" (also keep the
            products with a weight), as for `RecomputeBlock`.
        state: more layers, seed generators or variables whose state `fn`
            reads or updates, if it reaches them some other way.

    Returns:
        A callable (`Checkpointed`) that runs `fn`.

    Example:

    ```python
    class Attention(keras.layers.Layer):
        ...
        @tfrecompute.checkpoint
        def core(self, q, k, v):
            scores = keras.ops.softmax(keras.ops.einsum("bqhd,bkhd->bhqk", q, k))
            return keras.ops.einsum("bhqk,bkhd->bqhd", self.dropout(scores), v)

    ffn = tfrecompute.checkpoint(lambda x: dense_2(dropout(dense_1(x))))
    ```
    """
    if fn is None:
        return functools.partial(checkpoint, policy=policy, state=state)
    if not callable(fn):
        fail(
            "tfrecompute.checkpoint",
            "`fn` must be callable",
            "fn",
            fn,
            "Pass a function or a method, or use @tfrecompute.checkpoint as a decorator",
            error=TypeError,
        )
    if policy == "attention":
        fail(
            "tfrecompute.checkpoint",
            "policy 'attention' selects attention layers inside a block or model; a "
            "checkpointed function recomputes what it computes",
            "policy",
            policy,
            "Checkpoint the attention core function itself (policy=None), or use "
            "RecomputeBlock(layer, policy='attention')",
        )
    resolve_policy("tfrecompute.checkpoint", policy)
    return Checkpointed(fn, policy, _check_state(state))
