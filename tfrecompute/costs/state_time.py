"""Measured recompute times of a call's cheaper states: under a policy, and its attention cores.

NOTE [ Measured state times ]
With `profile(..., measure_time=True)` a link's forward cost is its calls'
measured forward seconds (`measure_call`). The recompute of its third state
is measured too, rather than priced as a share of the forward by FLOPs,
which misprices it wherever time does not follow FLOPs: the attention cores
of the benchmark encoder (hidden 256, sequence 512) are a quarter of its
forward FLOPs and half of its CPU time (benchmarks/results/selective.md),
most of it the softmax and the Dropout mask on the scores, which have no
FLOPs of a product.

* Under a policy (`"dots"`, a function, `policy_recompute_seconds`): the
  call's forward with each product the policy keeps given instead of
  computed, as a block's recompute in backprop runs it (`Replayer`): the
  products are recorded once in a traced forward, then fed to the timed one,
  which returns every tensor it makes (the backward reads them; a function
  would skip the ops before a given product otherwise).
* Under `"attention"` (`attention_core_seconds`): the attention cores the
  call runs (NOTE [ Attention core recompute ]), alone, on the projected
  query, key, value and mask they were called with (captured once from a
  traced forward), in training mode, so their Dropout runs.

Each is timed as a forward is (`median_seconds`). The layer's non-trainable
state (seed generators, statistics) is restored afterwards. The traced
functions are returned by `_policy_replay` and `_cores_alone` too, for the
tests to read what they run (tests/costs/test_state_time.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfrecompute.costs.measured import (
    measurement_device,
    median_seconds,
    sample_tensor,
    step_function,
)
from tfrecompute.layers.attention import INLINE, attention_layers, core_method
from tfrecompute.layers.policy import Policy, Recorder, active, resolve_policy

__all__ = ["attention_core_seconds", "policy_recompute_seconds"]


def policy_recompute_seconds(
    layer: Any,
    args: Any,
    kwargs: Any,
    batch_size: int,
    policy: Policy,
    *,
    device: str | None = None,
) -> float:
    """The median time of one call's recompute under `policy` (see the NOTE).

    Args:
        layer: the layer called, or a plain Keras op.
        args, kwargs: the call's arguments, with `keras.KerasTensor`s for tensors.
        batch_size: the size of the leading `None` dimension.
        policy: the policy function (`layers.policy.resolve_policy`).
        device: `"CPU:0"` or `"GPU:0"`; by default `measurement_device()`.
    """
    name = device or measurement_device()
    with _state_restored(layer), tf.device(name):
        replay, inputs = _policy_replay(layer, args, kwargs, batch_size, policy)
        return median_seconds(replay, inputs, name)


def attention_core_seconds(
    layer: Any, args: Any, kwargs: Any, batch_size: int, *, device: str | None = None
) -> float:
    """The median time of the attention cores one call runs; 0.0 if it runs none."""
    if not isinstance(layer, keras.layers.Layer) or not attention_layers([layer]):
        return 0.0
    name = device or measurement_device()
    with _state_restored(layer), tf.device(name):
        cores, inputs = _cores_alone(layer, args, kwargs, batch_size)
        return 0.0 if cores is None else median_seconds(cores, inputs, name)


def _symbolic(args: Any, kwargs: Any) -> list[keras.KerasTensor]:
    flat = keras.tree.flatten((args, kwargs))
    return list({id(t): t for t in flat if isinstance(t, keras.KerasTensor)}.values())


@contextlib.contextmanager
def _state_restored(layer: Any) -> Iterator[None]:
    state = [v for v in getattr(layer, "variables", []) if not v.trainable]
    saved = [np.array(v.numpy()) for v in state]
    try:
        yield
    finally:
        for variable, value in zip(state, saved):
            variable.assign(value)


class _Given:
    """The replay's scope: gives the products the forward kept, runs the others."""

    def __init__(self, kept_at: list[bool], kept: list[tf.Tensor]) -> None:
        self.graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
        self.kept_at = kept_at
        self.kept = iter(kept)
        self.index = 0

    def handle(self, kind: str, original: Any, args: Any, kwargs: Any) -> Any:
        index = self.index
        self.index += 1
        if index < len(self.kept_at) and self.kept_at[index]:
            return next(self.kept)
        return original(*args, **kwargs)


def _policy_replay(
    layer: Any, args: Any, kwargs: Any, batch_size: int, policy: Policy
) -> tuple[Any, tuple[Any, ...]]:
    """`(replay, inputs)`: the call's forward given the products `policy` keeps."""
    symbolic = _symbolic(args, kwargs)
    run = step_function(layer, args, kwargs, symbolic)
    values = tuple(sample_tensor(t, batch_size) for t in symbolic)
    recorders: list[Recorder] = []

    def record(*inputs: tf.Tensor) -> list[tf.Tensor]:
        recorder = Recorder(getattr(layer, "name", "call"), policy)
        recorders.append(recorder)
        with active(recorder):
            run(inputs, False)
        return recorder.saved

    kept = list(tf.function(record, autograph=False)(*values))
    kept_at = [entry.saved is not None for entry in recorders[-1].entries]

    def replay(inputs: tuple[tf.Tensor, ...], products: list[tf.Tensor]) -> Any:
        graph = tf.compat.v1.get_default_graph()
        first = len(graph.get_operations())
        with active(_Given(kept_at, products)):
            run(inputs, False)
        # Every tensor it makes, not only the outputs: an output given (a kept
        # projection) would leave the ops before it unused, and a function
        # does not run unused ops; the backward reads them.
        made = graph.get_operations()[first:]
        return [t for op in made for t in op.outputs if t.dtype.is_floating]

    return tf.function(replay, autograph=False), (values, kept)


def _cores_alone(
    layer: Any, args: Any, kwargs: Any, batch_size: int
) -> tuple[Any, tuple[Any, ...]]:
    """`(cores, inputs)`: the attention cores the call runs, on their captured inputs;
    `(None, ())` if it runs none. An attention computed inline (NOTE [ Attention
    computed inline ]) runs its `call` given the products `"dots"` keeps, as its
    recompute does, and returns every tensor it makes (as `_policy_replay`)."""
    symbolic = _symbolic(args, kwargs)
    run = step_function(layer, args, kwargs, symbolic)
    values = tuple(sample_tensor(t, batch_size) for t in symbolic)
    calls: list[_CoreCall] = []

    def capture(*inputs: tf.Tensor) -> list[tf.Tensor]:
        calls.clear()
        with _cores_captured(attention_layers([layer]), calls):
            run(inputs, False)
        leaves = [leaf for call in calls for leaf in _tensors(call.structure)]
        return leaves + [t for call in calls for t in call.kept]

    captured = list(tf.function(capture, autograph=False)(*values))
    if not calls:
        return None, ()
    templates = [(call, keras.tree.flatten(call.structure)) for call in calls]

    def cores(tensors: list[tf.Tensor]) -> list[Any]:
        given = iter(tensors)
        filled_calls = [
            (call, [next(given) if tf.is_tensor(leaf) else leaf for leaf in leaves])
            for call, leaves in templates
        ]
        results = []
        for call, filled in filled_calls:
            core_args, core_kwargs = keras.tree.pack_sequence_as(call.structure, filled)
            if call.kept_at is None:
                results.append(call.core(*core_args, **core_kwargs))
                continue
            products = [next(given) for _ in call.kept]
            graph = tf.compat.v1.get_default_graph()
            first = len(graph.get_operations())
            with active(_Given(call.kept_at, products)):
                call.core(*core_args, **core_kwargs)
            made = graph.get_operations()[first:]
            results.append([t for op in made for t in op.outputs if t.dtype.is_floating])
        return keras.tree.flatten(results)

    return tf.function(cores, autograph=False), (captured,)


def _tensors(structure: Any) -> list[tf.Tensor]:
    return [leaf for leaf in keras.tree.flatten(structure) if tf.is_tensor(leaf)]


@dataclasses.dataclass
class _CoreCall:
    """One attention core run while captured: the method, its arguments, and for an
    attention computed inline what `"dots"` kept (`kept_at` per product, in order)."""

    core: Any
    structure: Any
    kept_at: list[bool] | None = None
    kept: list[tf.Tensor] = dataclasses.field(default_factory=list)


@contextlib.contextmanager
def _cores_captured(layers: list[Any], calls: list[_CoreCall]) -> Iterator[None]:
    """Inside, each of `layers` runs its class's core (`core_method`) and appends a
    `_CoreCall`; a core computed inline runs with the `"dots"` policy's `Recorder`."""
    dots = resolve_policy("profile", "dots")
    methods = {id(layer): core_method(layer) for layer in layers}
    before = {id(layer): vars(layer).get(methods[id(layer)]) for layer in layers}
    for layer in layers:
        method = methods[id(layer)]
        assert method is not None
        original = getattr(type(layer), method).__get__(layer, type(layer))

        def recording(*args: Any, _core: Any = original, _inline: bool = method == INLINE,
                      _name: str = layer.name, **kwargs: Any) -> Any:  # fmt: skip
            if not _inline:
                calls.append(_CoreCall(_core, (args, kwargs)))
                return _core(*args, **kwargs)
            recorder = Recorder(_name, dots)
            with active(recorder):
                result = _core(*args, **kwargs)
            kept_at = [entry.saved is not None for entry in recorder.entries]
            calls.append(_CoreCall(_core, (args, kwargs), kept_at, recorder.saved))
            return result

        object.__setattr__(layer, method, recording)  # untracked, removed on exit
    try:
        yield
    finally:
        for layer in layers:
            method, previous = methods[id(layer)], before[id(layer)]
            assert method is not None
            if previous is None:
                object.__delattr__(layer, method)
            else:
                object.__setattr__(layer, method, previous)
