"""`RecomputeBlock`: a Keras layer whose activations are recomputed in backprop."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import keras
import tensorflow as tf
from keras.src.backend.common import global_state
from keras.src.layers.layer import CallContext
from tensorflow.python.eager import record

from tfrecompute.errors import NonReplayableRandomnessError
from tfrecompute.layers.randomness import find_stateful_random_ops
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
    """Whether any gradient tape could record the ops run now."""
    return bool(record.could_possibly_record())


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


@keras.saving.register_keras_serializable(package="tfrecompute")
class RecomputeBlock(keras.layers.Layer):
    """Wraps layers so that their activations are recomputed during backprop.

    In training under a gradient tape the block keeps only its inputs; the
    activations of the layers inside are dropped after the forward pass and
    computed again when backprop reaches the block (built on
    `tf.recompute_grad`). Outputs and gradients equal those of the same layers
    unwrapped: random numbers (Dropout, any Keras `SeedGenerator`) are replayed
    exactly, and non-trainable state updates (BatchNormalization statistics,
    seed generator states) are applied once per forward, not once per run. In
    inference, or without a gradient tape, the block is a plain call.

    Args:
        layers: one Keras layer, a list of layers applied in order, or a Keras
            Functional model (any number of inputs and outputs).
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

    def __init__(self, layers: keras.layers.Layer | Sequence[keras.layers.Layer], **kwargs: Any):
        # The inner layers cast their own inputs and variables; the block
        # casting first would change what a float32 layer inside sees.
        kwargs.setdefault("autocast", False)
        super().__init__(**kwargs)
        if isinstance(layers, keras.layers.Layer):
            self._single = True
            inner = [layers]
        elif isinstance(layers, (list, tuple)):
            if not layers:
                raise ValueError(
                    "RecomputeBlock: `layers` is empty. Received: layers="
                    f"{_describe(layers)}. Pass at least one Keras layer."
                )
            for index, layer in enumerate(layers):
                if not isinstance(layer, keras.layers.Layer):
                    raise TypeError(
                        f"RecomputeBlock: item {index} of `layers` is not a Keras "
                        f"layer. Received: layers[{index}]={_describe(layer)}. "
                        "Pass Keras layers only (keras.layers.Layer instances)."
                    )
            self._single = False
            inner = list(layers)
        else:
            raise TypeError(
                "RecomputeBlock: `layers` must be a Keras layer, a list of Keras "
                f"layers or a Keras Functional model. Received: layers={_describe(layers)}. "
                "Wrap the layers to recompute, e.g. RecomputeBlock([Dense(64), Dense(64)])."
            )
        for layer in inner:
            if isinstance(layer, RecomputeBlock) and layer is self:
                raise ValueError("RecomputeBlock: a block cannot wrap itself.")
        self.inner = inner
        self.supports_masking = all(layer.supports_masking for layer in inner)
        self._randomness_checked = False
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

    def build(self, *args: Any, **kwargs: Any) -> None:
        if not self._inner_built() and len(args) == 1 and not kwargs:
            specs = keras.tree.map_shape_structure(
                lambda shape: keras.KerasTensor(shape, dtype=self.input_dtype), args[0]
            )
            try:
                keras.src.backend.compute_output_spec(self._run_inner, specs, training=False)
            except Exception as error:  # retried with the real input dtypes in call()
                self._build_error = error
        self.built = True

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
                "not built after a symbolic call. Build them before training "
                "(call them once on a batch)."
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
        if not self._inner_built():
            self._build_inner_like(inputs, args, kwargs)
        if training is None or training is False or not _tape_is_recording():
            return self._run_inner(inputs, *args, training=training, mask=mask, **kwargs)
        return self._recomputed_call(inputs, args, kwargs, training, mask)

    def _state_variables(self) -> list[Any]:
        """Variables whose values a recompute must replay (not differentiated)."""
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
        # NOTE [ What crosses the tf.recompute_grad boundary ]
        # Only floating tensors are passed positionally to the recomputed
        # function: they are what gradients flow to. Everything else (integer
        # token ids, boolean masks, Python values, `training`) is bound by
        # closure; `tf.recompute_grad` rejects keyword arguments in graph mode
        # and cannot differentiate integers anyway. Likewise only the floating
        # outputs come back through it; other outputs (and Keras masks) are
        # taken from the forward run, as they carry no gradient.
        call_args = (inputs, args, kwargs)
        flat_call_args = keras.tree.flatten(call_args)
        float_positions = [i for i, v in enumerate(flat_call_args) if _is_float_tensor(v)]
        state_variables = self._state_variables()
        state_values = snapshot(state_variables)
        forward: dict[str, Any] = {}

        def execute(float_values: Sequence[tf.Tensor]) -> tuple[Any, RecordingStatelessScope]:
            values = list(flat_call_args)
            for position, value in zip(float_positions, float_values):
                values[position] = value
            run_inputs, run_args, run_kwargs = keras.tree.pack_sequence_as(call_args, values)
            with (
                _call_context(self, training),
                RecordingStatelessScope(zip(state_variables, state_values)) as scope,
            ):
                outputs = self._run_inner(
                    run_inputs, *run_args, training=training, mask=mask, **run_kwargs
                )
            return outputs, scope

        def differentiable(outputs: Any, scope: RecordingStatelessScope) -> list[tf.Tensor]:
            return [o for o in keras.tree.flatten(outputs) if _is_float_tensor(o)] + list(
                scope.losses
            )

        def run(*float_values: tf.Tensor) -> list[tf.Tensor]:
            # Called twice: by the forward pass, then by the recompute in backprop.
            first_run = not forward
            graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
            op_count = len(graph.get_operations()) if first_run and graph is not None else 0
            outputs, scope = execute(float_values)
            if first_run:
                forward.update(
                    outputs=outputs,
                    scope=scope,
                    masks=[
                        keras.src.backend.get_keras_mask(o) for o in keras.tree.flatten(outputs)
                    ],
                    n_losses=len(scope.losses),
                )
                if graph is not None:
                    self._check_randomness(graph, graph.get_operations()[op_count:])
            return differentiable(outputs, scope)

        float_inputs = [flat_call_args[i] for i in float_positions]
        if not self._randomness_checked and tf.executing_eagerly():
            # Eager mode has no graph to inspect: trace the forward once to check it.
            traced = tf.function(lambda *values: differentiable(*execute(values)), autograph=False)
            specs = [tf.TensorSpec(t.shape, t.dtype) for t in float_inputs]
            graph = traced.get_concrete_function(*specs).graph
            self._check_randomness(graph, graph.get_operations())
        results = tf.recompute_grad(run)(*float_inputs)
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
        return keras.tree.pack_sequence_as(forward["outputs"], merged)

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

    def compute_output_shape(self, input_shape: Any, *args: Any, **kwargs: Any) -> Any:
        if self._single:
            return self.inner[0].compute_output_shape(input_shape, *args, **kwargs)
        shape = input_shape
        for layer in self.inner:
            shape = layer.compute_output_shape(shape)
        return shape

    def compute_mask(self, inputs: Any, mask: Any = None) -> Any:
        if self._single:
            return self.inner[0].compute_mask(inputs, mask)
        for layer in self.inner:
            mask = layer.compute_mask(inputs, mask)
        return mask

    # ------------------------------------------------------- serialization

    def get_config(self) -> dict[str, Any]:
        base_config = super().get_config()
        base_config.pop("autocast", None)
        serialized = [keras.saving.serialize_keras_object(layer) for layer in self.inner]
        config = {"layers": serialized[0] if self._single else serialized}
        return {**base_config, **config}

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects: Any = None) -> RecomputeBlock:
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
