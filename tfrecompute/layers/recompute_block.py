"""`RecomputeBlock`: a Keras layer whose activations are recomputed in backprop."""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from keras.src.backend.common import global_state
from keras.src.layers.layer import CallContext
from tensorflow.python import pywrap_tfe
from tensorflow.python.eager import record

from tfrecompute.errors import NonReplayableRandomnessError
from tfrecompute.layers.debug import debug_enabled, verify_recompute
from tfrecompute.layers.randomness import find_stateful_random_ops
from tfrecompute.layers.recompute import depend_on, recompute_grad
from tfrecompute.layers.state import RecordingStatelessScope, snapshot

__all__ = ["RecomputeBlock"]

_logger = logging.getLogger(__name__)


def _describe(value: Any) -> str:
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{text} (of type {type(value).__name__})"


def _is_float_tensor(value: Any) -> bool:
    return tf.is_tensor(value) and value.dtype.is_floating


def _tape_is_recording() -> bool:
    """Whether any gradient tape or forward accumulator could record the ops run now.

    Not inside `record.stop_recording()`, where the forward of an enclosing
    block runs: a block nested in another is a plain call there.
    """
    return bool(record.could_possibly_record()) and not pywrap_tfe.TFE_Py_TapeSetIsStopped()


def _forward_accumulator_active(probe: tf.Tensor) -> bool:
    """Whether a `tf.autodiff.ForwardAccumulator` is active in this thread.

    `TFE_Py_PackJVPs` returns one entry per active accumulator, whatever the
    accumulator watches; `probe` is any tensor.
    """
    indices, _ = pywrap_tfe.TFE_Py_PackJVPs([probe])
    return bool(indices)


def _is_symbolic(structure: Any) -> bool:
    return any(isinstance(t, keras.KerasTensor) for t in keras.tree.flatten(structure))


def _check_training(name: str, training: Any) -> None:
    if training is None or isinstance(training, (bool, np.bool_)) or tf.is_tensor(training):
        return
    raise TypeError(
        f"RecomputeBlock '{name}': `training` must be None, a bool or a boolean tensor. "
        f"Received: training={_describe(training)}. Pass training=True or training=False."
    )


@contextlib.contextmanager
def _call_context(entry_layer: keras.layers.Layer, training: Any) -> Iterator[None]:
    """Runs Keras layer calls as if inside `entry_layer(..., training=training)`.

    The recompute runs during backprop, outside the call of the model that
    holds the block, so Keras's call context (which carries `training` down to
    nested layers that do not take it as an argument) is gone. The forward and
    the recompute both run in a context made here, so both see the same value.
    """
    previous = global_state.get_global_attribute("current_call_ctx")
    context = CallContext(entry_layer=entry_layer)
    context.set_value("training", training)
    global_state.set_global_attribute("current_call_ctx", context)
    try:
        yield
    finally:
        global_state.set_global_attribute("current_call_ctx", previous)


def _check_layers(layers: Any) -> list[keras.layers.Layer]:
    """Validates the `layers` argument of `RecomputeBlock`; returns them as a list."""
    if isinstance(layers, keras.layers.Layer):
        candidates, single = [layers], True
    elif isinstance(layers, (list, tuple)):
        if not layers:
            raise ValueError(
                "RecomputeBlock: `layers` is empty. Received: layers="
                f"{_describe(layers)}. Pass at least one Keras layer."
            )
        candidates, single = list(layers), False
    else:
        hint = (
            f"Pass an instance, e.g. {layers.__name__}(...), not the class."
            if isinstance(layers, type) and issubclass(layers, keras.layers.Layer)
            else "Wrap the layers to recompute, e.g. RecomputeBlock([Dense(64), Dense(64)])."
        )
        raise TypeError(
            "RecomputeBlock: `layers` must be a Keras layer, a list of Keras "
            f"layers or a Keras Functional model. Received: layers={_describe(layers)}. {hint}"
        )
    for index, layer in enumerate(candidates):
        where = "layers" if single else f"layers[{index}]"
        if not isinstance(layer, keras.layers.Layer):
            hint = (
                f"Pass an instance, e.g. {layer.__name__}(...), not the class."
                if isinstance(layer, type) and issubclass(layer, keras.layers.Layer)
                else "Pass Keras layers only (keras.layers.Layer instances)."
            )
            raise TypeError(
                f"RecomputeBlock: item {index} of `layers` is not a Keras layer. "
                f"Received: {where}={_describe(layer)}. {hint}"
            )
        if isinstance(layer, keras.layers.InputLayer):
            raise ValueError(
                f"RecomputeBlock: item {index} of `layers` is an InputLayer, which only "
                f"declares a model input. Received: {where}={_describe(layer)}. Leave "
                "keras.Input/InputLayer out of the block and wrap the layers after it."
            )
    return candidates


@keras.saving.register_keras_serializable(package="tfrecompute")
class RecomputeBlock(keras.layers.Layer):
    """Wraps layers so that their activations are recomputed during backprop.

    In training under a gradient tape the block keeps only its inputs; the
    activations of the layers inside are dropped after the forward pass and
    computed again when backprop reaches the block (a custom gradient like
    `tf.recompute_grad`, but differentiable again). Outputs and gradients equal
    those of the same layers unwrapped: random numbers (Dropout, any Keras
    `SeedGenerator`) are replayed exactly, and non-trainable state updates
    (BatchNormalization statistics, seed generator states) are applied once per
    forward, not once per run. In
    inference, or without a gradient tape, the block is a plain call.

    Keras masks pass through: the incoming mask reaches the first layer and
    the masks the layers compute are attached to the block's outputs. Nested
    blocks, shared and frozen layers, recurrent layers, XLA
    (`jit_compile=True`), higher-order gradients and forward-mode autodiff
    (where the block runs as a plain call: forward mode keeps no activations)
    give the same results as the layers unwrapped.

    Args:
        layers: one Keras layer, a list of layers applied in order, or a Keras
            Functional model (any number of inputs and outputs).
        debug: check in every recompute that it reproduces the forward's
            tensors (dtypes, shapes and values) and fail with an error naming
            the block if not. Slow (the forward's outputs are kept for the
            comparison); off by default. `tfrecompute.layers.set_debug(True)`
            turns it on for all blocks.
        **kwargs: base `keras.layers.Layer` arguments (`name`, `dtype`, ...).

    Example:

    ```python
    model = keras.Sequential([
        keras.Input((784,)),
        tfrecompute.RecomputeBlock([
            keras.layers.Dense(1024, activation="relu"),
            keras.layers.Dropout(0.1),
            keras.layers.Dense(1024, activation="relu"),
        ]),
        keras.layers.Dense(10),
    ])
    model.compile(optimizer="adam", loss="mse")
    model.fit(x, y)
    ```
    """

    def __init__(
        self,
        layers: keras.layers.Layer | Sequence[keras.layers.Layer],
        *,
        debug: bool = False,
        **kwargs: Any,
    ):
        inner = _check_layers(layers)
        if not isinstance(debug, (bool, np.bool_)):
            raise TypeError(
                f"RecomputeBlock: `debug` must be a bool. Received: debug={_describe(debug)}. "
                "Pass debug=True to check every recompute, or leave it False."
            )
        # The inner layers cast their own inputs and variables; the block
        # casting first would change what a float32 layer inside sees.
        kwargs.setdefault("autocast", False)
        super().__init__(**kwargs)
        self._single = isinstance(layers, keras.layers.Layer)
        self.inner = inner
        self.debug = bool(debug)
        # The block hands masks to its first layer and attaches the masks its
        # layers compute to its outputs; each inner layer warns for itself
        # when it drops a mask.
        self.supports_masking = True
        self._randomness_checked = False
        self._warned_pointless = False
        self._build_error: Exception | None = None

    # ------------------------------------------------------------------ API

    @property
    def layers(self) -> list[keras.layers.Layer]:
        """The wrapped layers, in call order (shown by `summary(expand_nested=True)`)."""
        return list(self.inner)

    def unwrap(self) -> keras.layers.Layer | list[keras.layers.Layer]:
        """Returns what the block wraps: the single layer or model, or the list of layers."""
        return self.inner[0] if self._single else list(self.inner)

    # ---------------------------------------------------------------- build

    def _inner_built(self) -> bool:
        return all(layer.built for layer in self.inner)

    def build(self, input_shape: Any = None, *args: Any, **kwargs: Any) -> None:
        # Keras passes the first input's shape only to a build() that names a
        # parameter; inside strategy.scope() this is where the inner layers
        # must create their (distributed) variables.
        if not self._inner_built() and input_shape is not None and not args and not kwargs:
            specs = keras.tree.map_shape_structure(
                lambda shape: keras.KerasTensor(shape, dtype=self.input_dtype), input_shape
            )
            try:
                keras.src.backend.compute_output_spec(self._run_inner, specs, training=False)
            except Exception as error:  # retried with the real input dtypes in call()
                self._build_error = error
        self.built = True
        from tfrecompute.precision import block_precision_findings  # noqa: PLC0415 (cycle)

        for finding in block_precision_findings(self):
            warnings.warn(str(finding), stacklevel=2)

    def _build_inner_like(self, inputs: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Builds the inner layers by a symbolic call on specs of the real inputs."""

        def spec(value: Any) -> Any:
            if tf.is_tensor(value) or hasattr(value, "shape") and hasattr(value, "dtype"):
                return keras.KerasTensor(
                    tuple(value.shape), dtype=keras.backend.standardize_dtype(value.dtype)
                )
            return value

        try:
            keras.src.backend.compute_output_spec(
                self._run_inner,
                keras.tree.map_structure(spec, inputs),
                *keras.tree.map_structure(spec, args),
                training=False,
                **keras.tree.map_structure(spec, kwargs),
            )
        except Exception as error:
            raise ValueError(
                f"RecomputeBlock '{self.name}': could not build the wrapped layers by "
                "tracing them symbolically, so their variables are unknown before the "
                f"recomputed call. Received: layers={_describe(self.unwrap())}. Build the "
                "wrapped layers or model first (call it once on a batch), or wrap its "
                "traceable parts in RecomputeBlocks instead. Cause: "
                f"{type(error).__name__}: {error}"
            ) from (self._build_error or error)
        if not self._inner_built():
            unbuilt = [layer.name for layer in self.inner if not layer.built]
            raise ValueError(
                f"RecomputeBlock '{self.name}': the wrapped layers {unbuilt} are still "
                "not built after a symbolic call, so their variables are unknown before "
                f"the recomputed call. Received: layers={_describe(self.unwrap())}. Build "
                "them before training (call them once on a batch)."
            )

    # ----------------------------------------------------------------- call

    def _run_inner(
        self, inputs: Any, *args: Any, training: Any = None, mask: Any = None, **kwargs: Any
    ) -> Any:
        """Applies the wrapped layers (no recompute)."""
        first = self.inner[0]
        call_kwargs = dict(kwargs)
        if mask is not None and first._call_has_mask_arg:
            call_kwargs["mask"] = mask
        if training is not None and first._call_has_training_arg:
            call_kwargs["training"] = training
        outputs = first(inputs, *args, **call_kwargs)
        for layer in self.inner[1:]:
            if training is not None and layer._call_has_training_arg:
                outputs = layer(outputs, training=training)
            else:
                outputs = layer(outputs)
        return outputs

    def call(
        self, inputs: Any, *args: Any, training: Any = None, mask: Any = None, **kwargs: Any
    ) -> Any:
        if (args or kwargs) and not self._single:
            raise TypeError(
                f"RecomputeBlock '{self.name}': extra call arguments go to a single "
                "wrapped layer, but this block wraps a list of "
                f"{len(self.inner)} layers. Received: args={_describe(args)}, "
                f"kwargs={_describe(kwargs)}. Wrap the layer that takes them on its own, "
                "or wrap a Functional model that takes them as inputs."
            )
        _check_training(self.name, training)
        if not self._inner_built():
            self._build_inner_like(inputs, args, kwargs)
        # NOTE [ Nested blocks ]
        # A block inside another block's forward sees recording stopped (the
        # enclosing forward runs under `record.stop_recording()`) and is a plain
        # call. In the enclosing block's recompute a tape records, so the inner
        # block checkpoints, and recomputes once more when that recompute
        # backprops through it. So per training step a layer at nesting depth d
        # (1 directly inside a block) runs d + 1 times: the forward, plus one
        # run per enclosing recompute; an inner block never runs more than once
        # per recompute of the block around it. This is what nesting is for:
        # an inner block that kept its activations during the enclosing
        # recompute would save nothing there.
        if training is None or training is False or not _tape_is_recording():
            return self._run_inner(inputs, *args, training=training, mask=mask, **kwargs)
        flat_call_args = keras.tree.flatten((inputs, args, kwargs))
        tensors = [v for v in flat_call_args if tf.is_tensor(v)]
        if tensors and _forward_accumulator_active(tensors[0]):
            # NOTE [ Forward-mode autodiff ]
            # A `tf.autodiff.ForwardAccumulator` gets the JVP of a custom
            # gradient by transposing its gradient function. That fails for a
            # gradient function that recomputes: `tf.recompute_grad` raises
            # "recompute_grad tried to transpose grad of ...", and the one in
            # `recompute.py`, which recomputes under a local tape, gets no JVP
            # eagerly and a wrong one in a graph (measured, TensorFlow 2.21).
            # Forward mode keeps no activations, so there is nothing to save:
            # the block runs its layers plainly under an accumulator. The JVPs
            # are then exact, and so is the gradient of a GradientTape inside
            # the accumulator (forward-over-backward), without recompute.
            return self._run_inner(inputs, *args, training=training, mask=mask, **kwargs)
        if not self.trainable_variables and not record.should_record_backprop(
            [t for t in tensors if _is_float_tensor(t)]
        ):
            # Nothing inside needs a gradient and no tape watches the inputs:
            # the tape records nothing here, so a recompute would only cost time.
            self._warn_pointless()
            return self._run_inner(inputs, *args, training=training, mask=mask, **kwargs)
        return self._recomputed_call(inputs, args, kwargs, training, mask)

    def _warn_pointless(self) -> None:
        if self._warned_pointless:
            return
        self._warned_pointless = True
        warnings.warn(
            f"RecomputeBlock '{self.name}': recompute is pointless here: the wrapped "
            "layers have no trainable variables and no gradient tape watches the block's "
            "inputs, so backprop never reaches the block. It runs as a plain call. Leave "
            "frozen layers at the start of a model out of RecomputeBlocks.",
            stacklevel=2,
        )

    def _state_variables(self) -> list[Any]:
        """Variables whose values a recompute must replay (not differentiated).

        A frozen layer's (`trainable=False`) weights are among them: read from
        the snapshot, they get no gradient, as Keras intends for frozen layers.
        """
        seen: set[int] = set()
        state = []
        for layer in self.inner:
            for variable in layer.non_trainable_variables:
                if id(variable) not in seen:
                    seen.add(id(variable))
                    state.append(variable)
        return state

    def _recomputed_call(
        self,
        inputs: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        training: Any,
        mask: Any,
    ) -> Any:
        # NOTE [ What crosses the recompute boundary ]
        # Only floating tensors are passed positionally to the recomputed
        # function: they are what gradients flow to. Everything else (integer
        # token ids, boolean masks, Python values, `training`) is bound by
        # closure; a graph-mode custom gradient rejects keyword arguments and
        # cannot differentiate integers anyway. Likewise only the floating
        # outputs come back through it; other outputs (and Keras masks) are
        # taken from the forward run, as they carry no gradient.
        #
        # The recompute receives copies of the floating inputs (so that its
        # tape watches tensors of its own), and copies carry no Keras mask. A
        # layer that reads its masks from its inputs' `_keras_mask` (the
        # `query_mask`/`value_mask` of MultiHeadAttention, any layer called
        # with several tensors) would then attend over padding in the
        # recompute only, and the gradients would be wrong. So `execute`
        # attaches each input's mask to its copy.
        call_args = (inputs, args, kwargs)
        flat_call_args = keras.tree.flatten(call_args)
        float_positions = [i for i, v in enumerate(flat_call_args) if _is_float_tensor(v)]
        input_masks = [keras.src.backend.get_keras_mask(flat_call_args[i]) for i in float_positions]
        state_variables = self._state_variables()
        state_values = snapshot(state_variables)
        debug = self.debug or debug_enabled()
        forward: dict[str, Any] = {}

        def execute(
            float_values: Sequence[tf.Tensor], after: tf.Tensor | None = None
        ) -> tuple[Any, RecordingStatelessScope]:
            # `after` (in a graph-mode recompute) orders everything captured
            # after the incoming gradient: see `recompute_grad`.
            values = [depend_on(v, after) for v in flat_call_args]
            for position, value, input_mask in zip(float_positions, float_values, input_masks):
                if input_mask is not None and value is not flat_call_args[position]:
                    keras.src.backend.set_keras_mask(value, depend_on(input_mask, after))
                values[position] = value
            run_inputs, run_args, run_kwargs = keras.tree.pack_sequence_as(call_args, values)
            run_mask = keras.tree.map_structure(lambda m: depend_on(m, after), mask)
            replayed = [depend_on(v, after) for v in state_values]
            with (
                _call_context(self, training),
                RecordingStatelessScope(zip(state_variables, replayed)) as scope,
            ):
                outputs = self._run_inner(
                    run_inputs, *run_args, training=training, mask=run_mask, **run_kwargs
                )
            return outputs, scope

        def differentiable(outputs: Any, scope: RecordingStatelessScope) -> list[tf.Tensor]:
            return [o for o in keras.tree.flatten(outputs) if _is_float_tensor(o)] + list(
                scope.losses
            )

        def run(*float_values: tf.Tensor, after: tf.Tensor | None = None) -> list[tf.Tensor]:
            # Called by the forward pass, then by each recompute in backprop.
            first_run = "done" not in forward
            graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
            op_count = len(graph.get_operations()) if first_run and graph is not None else 0
            outputs, scope = execute(float_values, after)
            results = differentiable(outputs, scope)
            if not first_run:
                return (
                    verify_recompute(self.name, forward["results"], results) if debug else results
                )
            forward.update(
                done=True,
                outputs=outputs,
                scope=scope,
                masks=[keras.src.backend.get_keras_mask(o) for o in keras.tree.flatten(outputs)],
                n_losses=len(scope.losses),
            )
            if debug:
                forward["results"] = results
            if graph is not None:
                self._check_randomness(graph, graph.get_operations()[op_count:])
            return results

        float_inputs = [flat_call_args[i] for i in float_positions]
        if not self._randomness_checked and tf.executing_eagerly():
            # Eager mode has no graph to inspect: trace the forward once to check it.
            traced = tf.function(lambda *values: differentiable(*execute(values)), autograph=False)
            specs = [tf.TensorSpec(t.shape, t.dtype) for t in float_inputs]
            with record.stop_recording():  # nothing to differentiate: blocks inside run plainly
                graph = traced.get_concrete_function(*specs).graph
            self._check_randomness(graph, graph.get_operations())
        results = recompute_grad(run)(*float_inputs)
        self._commit_state(forward["scope"], state_variables)

        n_losses = forward["n_losses"]
        float_results = list(results[: len(results) - n_losses])
        for loss in results[len(results) - n_losses :]:
            self.add_loss(loss)
        flat_outputs = keras.tree.flatten(forward["outputs"])
        merged = [float_results.pop(0) if _is_float_tensor(o) else o for o in flat_outputs]
        for tensor, output_mask in zip(merged, forward["masks"]):
            if output_mask is not None:
                keras.src.backend.set_keras_mask(tensor, output_mask)
        packed = keras.tree.pack_sequence_as(forward["outputs"], merged)
        # The backward pass needs only the flag (and, in debug mode, the
        # forward's tensors): do not keep the forward's outputs alive for it.
        for key in ("outputs", "scope", "masks"):
            del forward[key]
        return packed

    def _commit_state(self, scope: RecordingStatelessScope, state_variables: list[Any]) -> None:
        """Applies the forward's state updates once; rejects ones it cannot replay."""
        owned = {id(v) for v in state_variables}
        trainable = {id(v) for layer in self.inner for v in layer.trainable_variables}
        foreign = [
            v for key, v in scope.assigned.items() if key not in owned and key not in trainable
        ]
        if foreign:
            names = ", ".join(sorted(v.path for v in foreign))
            raise NonReplayableRandomnessError(
                f"RecomputeBlock '{self.name}': the wrapped layers assigned variables that "
                f"the block does not own: {names}. Their values cannot be snapshotted, so the "
                "recompute would not replay them (an unseeded `keras.random` call uses the "
                "global seed generator this way). Give each random call a "
                "`keras.random.SeedGenerator` created in the layer's __init__ "
                "(`seed=self.seed_generator`), or keep that layer out of the block."
            )
        for variable in state_variables:
            if scope.changed(variable):
                variable.assign(scope.get_current_value(variable))
        for key, variable in scope.assigned.items():
            if key in trainable:
                variable.assign(scope.get_current_value(variable))

    # ------------------------------------------------------------ randomness

    def _check_randomness(self, graph: tf.Graph, operations: Sequence[tf.Operation]) -> None:
        self._randomness_checked = True
        found = find_stateful_random_ops(graph, operations)
        if found:
            raise NonReplayableRandomnessError(
                f"RecomputeBlock '{self.name}': the wrapped layers use stateful TensorFlow "
                f"random ops, which the recompute cannot replay: {', '.join(found[:5])}"
                f"{' ...' if len(found) > 5 else ''}. Their gradients would be silently "
                "wrong. Draw random numbers with `keras.random.*(..., seed=<a "
                "keras.random.SeedGenerator owned by the layer>)` or TensorFlow's "
                "stateless ops (`tf.random.stateless_*`), or keep that layer out of the block."
            )

    # ------------------------------------------------------------- shapes

    def compute_output_spec(self, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        # Traced, not derived from compute_output_shape: the outputs have the
        # dtypes of the inner layers, not the block's own compute dtype.
        kwargs.pop("training", None)
        return keras.src.backend.compute_output_spec(
            self._run_inner, inputs, *args, training=False, **kwargs
        )

    def compute_output_shape(self, input_shape: Any, *args: Any, **kwargs: Any) -> Any:
        if self._single:
            return self.inner[0].compute_output_shape(input_shape, *args, **kwargs)
        shape = input_shape
        for layer in self.inner:
            shape = layer.compute_output_shape(shape)
        return shape

    def compute_mask(self, inputs: Any, mask: Any = None) -> Any:
        if self._single:
            layer = self.inner[0]
            return layer.compute_mask(inputs, mask) if layer.supports_masking else None
        # NOTE [ Masks of a list of layers ]
        # A layer's mask may depend on its own input (Masking, Embedding), and
        # only the first layer's input is the block's. So the masks are those
        # the layers attach when they run, each on its real input. On
        # symbolic inputs the layers are called on them, so that the masks
        # are ops of the caller's graph: an Embedding's mask is then
        # `not_equal` of the block's input, which a later layer of a
        # Functional or Sequential model can take (a spec traced apart has no
        # producer there: "Graph disconnected"). The layer calls made for it
        # stay out of the model unless a mask needs them. At run time the
        # block's call attaches its layers' masks to its outputs itself (see
        # `_set_mask_metadata`), so this runs the layers only when called
        # directly.
        outputs = self._run_inner(inputs, training=False, mask=mask)
        return keras.tree.map_structure(keras.src.backend.get_keras_mask, outputs)

    def _set_mask_metadata(self, inputs: Any, outputs: Any, previous_mask: Any) -> None:
        # Keras calls this after `call` to attach `compute_mask(inputs,
        # previous_mask)` to outputs that have no mask. On real tensors the
        # outputs already carry exactly the masks the layers computed (a
        # missing one means the layers attached none), and `compute_mask`
        # would run the layers again; on symbolic outputs it is a cheap trace.
        if _is_symbolic(outputs):
            super()._set_mask_metadata(inputs, outputs, previous_mask)

    # ------------------------------------------------------- serialization

    def get_config(self) -> dict[str, Any]:
        base_config = super().get_config()
        base_config.pop("autocast", None)
        serialized = [keras.saving.serialize_keras_object(layer) for layer in self.inner]
        config = {"layers": serialized[0] if self._single else serialized, "debug": self.debug}
        return {**base_config, **config}

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects: Any = None) -> RecomputeBlock:
        if not isinstance(config, dict) or "layers" not in config:
            raise ValueError(
                "RecomputeBlock.from_config: `config` must be a dict with a 'layers' "
                "entry, as returned by RecomputeBlock.get_config(). Received: "
                f"config={_describe(config)}. Pass block.get_config() of a RecomputeBlock."
            )
        config = dict(config)
        layers = config.pop("layers")
        if isinstance(layers, list):
            inner: Any = [
                keras.saving.deserialize_keras_object(c, custom_objects=custom_objects)
                for c in layers
            ]
        else:
            inner = keras.saving.deserialize_keras_object(layers, custom_objects=custom_objects)
        return cls(inner, **config)
