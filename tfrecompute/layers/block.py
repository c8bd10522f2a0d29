"""`RecomputeBlock`: a Keras layer whose activations are recomputed in backprop."""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfrecompute._keras_internals import (
    all_sublayers,
    backing_variable,
    call_has_mask_arg,
    call_has_training_arg,
    compute_output_spec,
    forward_accumulator_active,
    get_keras_mask,
    in_control_flow_body,
    set_mask_metadata,
    should_record_backprop,
    stop_recording,
    tape_is_recording,
    track_dependency,
)
from tfrecompute._messages import as_bool, describe, fail, received
from tfrecompute.errors import NonReplayableRandomnessError
from tfrecompute.layers.debug import debug_enabled
from tfrecompute.layers.dtypes import block_dtype_findings
from tfrecompute.layers.frame import (
    RecomputeFrame,
    build_before_call,
    in_block_forward,
    is_float_tensor,
)
from tfrecompute.layers.policy import (
    boundary,
    deserialize_policy,
    policy_scope,
    resolve_policy,
    serialize_policy,
)
from tfrecompute.layers.state import RecordingStatelessScope, snapshot

__all__ = ["RecomputeBlock", "apply_in_order", "as_passed"]


_local = threading.local()


def _calling() -> list[int]:
    """The ids of the blocks whose `__call__` runs in this thread (replicas trace in threads)."""
    if not hasattr(_local, "calling"):
        _local.calling = []
    calling: list[int] = _local.calling
    return calling


def _is_symbolic(structure: Any) -> bool:
    return any(isinstance(t, keras.KerasTensor) for t in keras.tree.flatten(structure))


def _check_training(name: str, training: Any) -> None:
    if training is None or isinstance(training, (bool, np.bool_)) or tf.is_tensor(training):
        return
    fail(
        f"RecomputeBlock '{name}'",
        "`training` must be None, a bool or a boolean tensor",
        "training",
        training,
        "Pass training=True or training=False",
        error=TypeError,
    )


# NOTE [ Extra call arguments ]
# Keras binds `call(self, inputs, *args, **kwargs)` as two nested arguments,
# `args` and `kwargs`, and rejects a nested argument that mixes tensors and
# other values ("In a nested call() argument, you cannot mix tensors and
# non-tensors"). So a single-layer block's `__call__` routes the extra
# arguments into separate ones before Keras sees them: tensors (and what
# Keras turns into tensors: numpy arrays and scalars) into `_tensor_kwargs`,
# Python values and None into `_python_kwargs`, Python positional values into
# `_python_args`. `call` puts them back as the caller passed them, so the
# wrapped layer gets exactly the arguments it would get unwrapped.
_ROUTED = ("_tensor_kwargs", "_python_kwargs", "_python_args")
_KERAS_ARGUMENTS = ("training", "mask", *_ROUTED)


def _is_tensor_like(value: Any) -> bool:
    """A tensor, or what Keras converts to one (a numpy array or scalar)."""
    symbolic = isinstance(value, keras.KerasTensor)
    return tf.is_tensor(value) or symbolic or hasattr(value, "__array__")


def _kind(value: Any) -> str:
    """ "tensor", "python" or "mixed": how Keras will see a call argument."""
    leaves = [leaf for leaf in keras.tree.flatten(value) if leaf is not None]
    tensors = [leaf for leaf in leaves if _is_tensor_like(leaf)]
    if not tensors:
        return "python"
    return "tensor" if len(tensors) == len(leaves) else "mixed"


def _route(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Splits extra call arguments by kind (NOTE [ Extra call arguments ])."""
    routed = {name: value for name, value in kwargs.items() if name in _KERAS_ARGUMENTS}
    tensors, python = {}, {}
    for name, value in kwargs.items():
        if name in _KERAS_ARGUMENTS:
            continue
        kind = _kind(value)
        if kind == "mixed":  # Keras rejects it unwrapped too: leave it to say so
            routed[name] = value
        else:
            (tensors if kind == "tensor" else python)[name] = value
    positional = [args[0]]
    python_args = []
    for index, value in enumerate(args[1:], start=1):
        if _kind(value) == "python":
            python_args.append([index, value])
        else:
            positional.append(value)
    for name, value in zip(_ROUTED, (tensors, python, python_args)):
        if value:
            routed[name] = value
    return tuple(positional), routed


def _unroute(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    tensor_kwargs: dict[str, Any] | None,
    python_kwargs: dict[str, Any] | None,
    python_args: list[Any] | None,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The extra call arguments as the caller passed them."""
    positional = list(args)
    for index, value in python_args or []:
        positional.insert(index - 1, value)
    return tuple(positional), {**kwargs, **(tensor_kwargs or {}), **(python_kwargs or {})}


def as_passed(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A single-layer block call's arguments as its caller passed them to the layer
    (the block's input first; NOTE [ Extra call arguments ])."""
    kwargs = dict(kwargs)
    routed = [kwargs.pop(name, None) for name in _ROUTED]
    extra, kwargs = _unroute(tuple(args[1:]), kwargs, *routed)
    return (args[0], *extra), kwargs


def _shape_to_spec(shape: Any, dtype: Any) -> Any:
    """A `KerasTensor` for a shape, None for a None leaf (an optional input left out)."""
    return None if shape is None else keras.KerasTensor(shape, dtype=dtype)


def _held_graph_tensors(layers: Sequence[keras.layers.Layer]) -> dict[int, tuple[Any, str]]:
    """The graph tensors `layers` and their sublayers hold as attributes (one level into
    lists, tuples and dicts), by id: `(tensor, "<layer>.<attribute>")`."""
    found: dict[int, tuple[Any, str]] = {}
    for layer in layers:
        for sublayer in all_sublayers(layer):
            for name, value in vars(sublayer).items():
                if isinstance(value, (list, tuple)):
                    leaves = list(value)
                elif isinstance(value, dict):
                    leaves = list(value.values())
                else:
                    leaves = [value]
                for leaf in leaves:
                    if isinstance(leaf, tf.Tensor) and tf.is_symbolic_tensor(leaf):
                        found[id(leaf)] = (leaf, f"{sublayer.name}.{name}")
    return found


def _instance_hint(value: Any, otherwise: str) -> str:
    """The fix for a layer argument: an instance instead of a class, else `otherwise`."""
    if isinstance(value, type) and issubclass(value, keras.layers.Layer):
        return f"Pass an instance, e.g. {value.__name__}(...), not the class"
    return otherwise


def _check_layers(layers: Any) -> list[keras.layers.Layer]:
    """Validates the `layers` argument of `RecomputeBlock`; returns them as a list."""
    api = "RecomputeBlock"
    if isinstance(layers, keras.layers.Layer):
        candidates, single = [layers], True
    elif isinstance(layers, (list, tuple)):
        if not layers:
            fail(api, "`layers` is empty", "layers", layers, "Pass at least one Keras layer")
        candidates, single = list(layers), False
    else:
        hint = "Wrap the layers to recompute, e.g. RecomputeBlock([Dense(64), Dense(64)])"
        fail(
            api,
            "`layers` must be a Keras layer, a list of Keras layers or a Keras Functional model",
            "layers",
            layers,
            _instance_hint(layers, hint),
            error=TypeError,
        )
    for index, layer in enumerate(candidates):
        where = "layers" if single else f"layers[{index}]"
        if not isinstance(layer, keras.layers.Layer):
            hint = _instance_hint(layer, "Pass Keras layers only (keras.layers.Layer instances)")
            what = f"item {index} of `layers` is not a Keras layer"
            fail(api, what, where, layer, hint, error=TypeError)
        if isinstance(layer, keras.layers.InputLayer):
            fail(
                api,
                f"item {index} of `layers` is an InputLayer, which only declares a model input",
                where,
                layer,
                "Leave keras.Input/InputLayer out of the block and wrap the layers after it",
            )
    return candidates


def _track_for_tensorflow(block: keras.layers.Layer, inner: list[keras.layers.Layer]) -> None:
    """NOTE [ A block in TensorFlow's object graph ]

    Keras wraps a list attribute (`self.inner`) in a `TrackedList`, which
    Keras's own saving (`.keras`, `.weights.h5`) walks but TensorFlow's
    object graph does not follow (keras-team/keras#19425): without more, a
    block has no checkpoint children, so `tf.train.Checkpoint(model=model)`
    records none of its layers' variables, and a restore leaves them (and
    BatchNormalization's moving statistics) as they were while
    `assert_existing_objects_matched()` passes. Each wrapped layer is
    therefore also a TensorFlow dependency of the block, named `inner_<i>`
    (`model/.../inner_0/...` in a checkpoint), as a Keras wrapper's `layer`
    attribute is. SavedModel export, which converts Keras lists itself,
    sees the same layers once more under `inner`; `.keras` files are
    unchanged.
    """
    for index, layer in enumerate(inner):
        track_dependency(block, layer, f"inner_{index}")


def apply_in_order(
    layers: Sequence[keras.layers.Layer],
    inputs: Any,
    *args: Any,
    training: Any = None,
    mask: Any = None,
    **kwargs: Any,
) -> Any:
    """Calls `layers` one after the other, as a block runs them: the first with the
    call's arguments and mask, each with `training` where its call takes it."""
    first = layers[0]
    call_kwargs = dict(kwargs)
    if mask is not None and call_has_mask_arg(first):
        call_kwargs["mask"] = mask
    if training is not None and call_has_training_arg(first):
        call_kwargs["training"] = training
    if not first.built:  # NOTE [ Layers built by the forward ] in frame.py
        build_before_call(first, (inputs, *args), call_kwargs)
    outputs = first(inputs, *args, **call_kwargs)
    for layer in layers[1:]:
        layer_kwargs = {}
        if training is not None and call_has_training_arg(layer):
            layer_kwargs["training"] = training
        if not layer.built:
            build_before_call(layer, (outputs,), layer_kwargs)
        outputs = layer(outputs, **layer_kwargs)
    return outputs


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
    give the same results as the layers unwrapped, and so do gradients that
    are None unwrapped, tensors the layers capture from outside the block, a
    tape opened inside a layer, gradients between the block's outputs, eager
    Python control flow, and blocks inside `tf.while_loop` or `tf.scan`
    bodies and RNN cells. A single wrapped layer gets extra call arguments
    (tensors, Python values, numpy scalars, None) as it would unwrapped.

    Args:
        layers: one Keras layer, a list of layers applied in order, or a Keras
            Functional model (any number of inputs and outputs).
        policy: what the forward keeps besides the block's inputs (NOTE
            [ Recompute policies ] in `policy.py`). None or "nothing": nothing,
            the whole block is recomputed. "dots": the outputs of the
            matmuls, einsums and convolutions that take a trainable variable
            (a `Dense`'s or `Conv2D`'s kernel, attention's projections); the
            recompute runs only the cheap ops between them. A function
            `policy(op: tfrecompute.layers.OpInfo) -> bool` decides per
            product (its kind, whether it takes a weight, its output shape
            and dtype). "attention": the block recomputes nothing as a
            whole; the attention core of every attention layer inside
            (`keras.layers.MultiHeadAttention` and subclasses, keras-hub's
            attention layers) keeps only its inputs and runs again in
            backprop, everything else is kept (NOTE [ Attention core
            recompute ] in `attention.py`). Products a layer computes with TensorFlow directly
            (`tf.linalg.matmul`) are not seen and are recomputed. Saved with
            the model as a name, or as a function registered with
            `keras.saving.register_keras_serializable`.
        debug: check in every recompute that it reproduces the values of
            the forward's tensors and fail with an error naming the block if
            not. Slow (the forward's outputs are kept for the comparison);
            off by default. Their count, dtypes and static shapes are checked
            always (in a graph when the gradient is traced, at no cost per
            step). `tfrecompute.layers.set_debug(True)` turns it on for all
            blocks.
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
    encoder_layer = tfrecompute.RecomputeBlock(transformer_layer, policy="dots")
    ```
    """

    # The layer whose `add_loss` gets the losses made inside the recomputed
    # forward (a weak reference; None: this block). A block no model tracks
    # (NOTE [ In-place checkpoints ]) hands them to the layer a model does.
    _loss_owner: Any = None
    # The end of the error for a variable assigned inside that the block does not own.
    _foreign_state_fix = "Or keep that layer out of the block"
    # Whether building warns of layers computing in different dtypes: a block
    # placed by `recompute()` does not (what it holds is the model's own
    # layer, which the user did not split; `check_precision` still reports it).
    _warns_of_dtypes = True

    def __init__(
        self,
        layers: keras.layers.Layer | Sequence[keras.layers.Layer],
        *,
        policy: Any = None,
        debug: bool = False,
        **kwargs: Any,
    ):
        inner = _check_layers(layers)
        resolved = resolve_policy("RecomputeBlock", policy)
        debug = as_bool(
            "RecomputeBlock",
            "debug",
            debug,
            fix="Pass debug=True to check every recompute, or leave it False",
        )
        # The inner layers cast their own inputs and variables; the block
        # casting first would change what a float32 layer inside sees.
        kwargs.setdefault("autocast", False)
        super().__init__(**kwargs)
        self._single = isinstance(layers, keras.layers.Layer)
        self.inner = inner
        _track_for_tensorflow(self, inner)
        self.debug = debug
        self.policy = policy
        self._recompute_policy = resolved
        self._policy_scope = policy_scope(policy)
        # The block hands masks to its first layer and attaches the masks its
        # layers compute to its outputs; each inner layer warns for itself
        # when it drops a mask.
        self.supports_masking = True
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

    def unrouted(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Arguments Keras recorded for a call of the block, as its caller passed them.

        NOTE [ Extra call arguments ]: a Functional model's node of a block
        holds the routed arguments; this gives back those of the wrapped layer.
        """
        kwargs = dict(kwargs)
        routed = [kwargs.pop(name, None) for name in _ROUTED]
        extra, kwargs = _unroute(tuple(args[1:]), kwargs, *routed)
        return (*args[:1], *extra), kwargs

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._single and args and (len(args) > 1 or kwargs):
            args, kwargs = _route(args, kwargs)
        calling = _calling()
        calling.append(id(self))
        try:
            return super().__call__(*args, **kwargs)
        finally:
            calling.pop()

    # ---------------------------------------------------------------- build

    def _inner_built(self) -> bool:
        return all(layer.built for layer in self.inner)

    def build(self, input_shape: Any = None, *args: Any, **kwargs: Any) -> None:
        # Keras passes the first input's shape only to a build() that names a
        # parameter; inside strategy.scope() this is where the inner layers
        # must create their (distributed) variables. Called by the block's own
        # `__call__`, it leaves them to be built where they are called (NOTE
        # [ Layers built by the forward ] in frame.py): a symbolic call here
        # would run each layer's `call()` once more than unwrapped.
        if (
            not self._inner_built()
            and id(self) not in _calling()
            and input_shape is not None
            and not args
            and not kwargs
        ):
            specs = keras.tree.map_shape_structure(
                lambda shape: _shape_to_spec(shape, self.input_dtype), input_shape
            )
            with self._no_escaped_tensors():
                try:
                    compute_output_spec(self._run_inner, specs, training=False)
                except Exception as error:  # retried with the real input dtypes in call()
                    self._build_error = error
        self.built = True
        if self._warns_of_dtypes:
            for finding in block_dtype_findings(self, self.name):
                warnings.warn(str(finding), stacklevel=2)

    def _build_symbolically(
        self,
        inputs: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        layer: keras.layers.Layer | None = None,
    ) -> None:
        """Builds the wrapped layers (or one of them, `layer`) by a symbolic call.

        The call gets specs of the real arguments. It runs `call()` once more
        than the layers unwrapped would, so the first call of a block uses it
        only where building as called cannot work (see `build_layer` in
        frame.py).
        """

        def spec(value: Any) -> Any:
            if tf.is_tensor(value) or hasattr(value, "shape") and hasattr(value, "dtype"):
                return keras.KerasTensor(
                    tuple(value.shape), dtype=keras.backend.standardize_dtype(value.dtype)
                )
            return value

        fn, targets = (self._run_inner, self.inner) if layer is None else (layer, [layer])
        if layer is None or call_has_training_arg(layer):
            kwargs = {**kwargs, "training": False}
        with self._no_escaped_tensors():
            try:
                compute_output_spec(
                    fn,
                    keras.tree.map_structure(spec, inputs),
                    *keras.tree.map_structure(spec, args),
                    **keras.tree.map_structure(spec, kwargs),
                )
            except Exception as error:
                raise ValueError(
                    f"RecomputeBlock '{self.name}': could not build the wrapped layers by "
                    "tracing them symbolically, so their variables are unknown before the "
                    f"recomputed call. {received('layers', self.unwrap())}. Build the "
                    "wrapped layers or model first (call it once on a batch), or wrap its "
                    "traceable parts in RecomputeBlocks instead. Cause: "
                    f"{type(error).__name__}: {error}"
                ) from (self._build_error or error)
        unbuilt = [target.name for target in targets if not target.built]
        if unbuilt:
            raise ValueError(
                f"RecomputeBlock '{self.name}': the wrapped layers {unbuilt} are still "
                "not built after a symbolic call, so their variables are unknown before "
                f"the recomputed call. {received('layers', self.unwrap())}. Build "
                "them before training (call them once on a batch)."
            )

    @contextlib.contextmanager
    def _no_escaped_tensors(self) -> Iterator[None]:
        """Fails if a symbolic call left graph tensors on the layers.

        NOTE [ Tensors kept from a symbolic call ]
        A layer that keeps a tensor from its `call()` on itself (a cache, the
        first input it saw) keeps, from a symbolic call, a tensor of a graph
        that is gone; its next eager call fails with TensorFlow's "... is out
        of scope and cannot be used here" (JAX's escaped tracer), far from
        the cause. The block's first call runs no symbolic call that the
        layers unwrapped would not run (NOTE [ Layers built by the forward ]
        in frame.py); where it still builds them symbolically (`build()`
        called directly, a block in a loop body, a layer whose own build
        leaves sublayers unbuilt), it names such tensors instead.
        """
        before = _held_graph_tensors(self.inner)
        yield
        after = _held_graph_tensors(self.inner)
        escaped = [where for key, (_, where) in after.items() if key not in before]
        if escaped:
            fail(
                f"RecomputeBlock '{self.name}'",
                "building the wrapped layers by a symbolic call left graph tensors on "
                f"them ({', '.join(escaped[:5])}), which a later call cannot use (TensorFlow: "
                "'... is out of scope')",
                "layers",
                self.unwrap(),
                "Build the layers by calling them once on a batch before training, or keep "
                "tensors computed in call() off the layer (return them instead)",
            )

    # ----------------------------------------------------------------- call

    def _run_inner(
        self, inputs: Any, *args: Any, training: Any = None, mask: Any = None, **kwargs: Any
    ) -> Any:
        """Applies the wrapped layers (no recompute)."""
        return apply_in_order(self.inner, inputs, *args, training=training, mask=mask, **kwargs)

    def call(
        self,
        inputs: Any,
        *args: Any,
        training: Any = None,
        mask: Any = None,
        _tensor_kwargs: dict[str, Any] | None = None,
        _python_kwargs: dict[str, Any] | None = None,
        _python_args: list[Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        args, kwargs = _unroute(args, kwargs, _tensor_kwargs, _python_kwargs, _python_args)
        with boundary():  # what runs inside is this block's (NOTE [ Recompute policies ])
            return self._call(inputs, args, kwargs, training, mask)

    def _call(
        self, inputs: Any, args: tuple[Any, ...], kwargs: dict[str, Any], training: Any, mask: Any
    ) -> Any:
        if (args or kwargs) and not self._single:
            raise TypeError(
                f"RecomputeBlock '{self.name}': extra call arguments go to a single "
                "wrapped layer, but this block wraps a list of "
                f"{len(self.inner)} layers. {received('args', args)}, "
                f"kwargs={describe(kwargs)}. Wrap the layer that takes them on its own, "
                "or wrap a Functional model that takes them as inputs."
            )
        _check_training(self.name, training)
        if self._policy_scope is not None:  # the layers run, inside it ("attention")
            with self._policy_scope(self.inner):
                return self._run_inner(inputs, *args, training=training, mask=mask, **kwargs)
        if not self._may_recompute(inputs, args, kwargs, training):
            return self._run_inner(inputs, *args, training=training, mask=mask, **kwargs)
        in_loop = in_control_flow_body()
        if in_loop and not self._inner_built():  # the recompute reads the weights read before
            self._build_symbolically(inputs, args, kwargs)
        state_variables = self._state_variables()
        # A loop body or cond branch is not recorded by any tape: whether a
        # gradient reaches the block there is known only once the loop's
        # gradient is built, so the block checkpoints.
        if not in_loop and not self._gradient_may_reach((inputs, args, kwargs), state_variables):
            return self._call_without_gradient(
                inputs, args, kwargs, training, mask, state_variables
            )
        frame = RecomputeFrame(
            self,
            (inputs, args, kwargs),
            training=training,
            mask=mask,
            state_variables=state_variables,
            loop_weights=list(self.trainable_variables) if in_loop else [],
            debug=self.debug or debug_enabled(),
            policy=self._recompute_policy,
        )
        return self._recomputed_call(frame)

    def _gradient_may_reach(self, call: Any, state_variables: list[Any]) -> bool:
        """Whether a gradient may reach this call (NOTE [ Frozen blocks ]).

        NOTE [ Frozen blocks ]
        A block whose wrapped weights are all frozen (Keras `trainable=False`)
        and whose floating inputs no tape watches gets no gradient, and a
        recompute in backprop would only cost time. Whether a tape watches
        its weights must be decided without reading them: Keras leaves a
        frozen layer's `tf.Variable`s `trainable=True` (frozen after it was
        built, or built outside a stateless scope), and a tape that watches
        the variables it sees read (every train step's) would watch them at
        the first read. So the block asks whether a tape already watches a
        state variable's handle (`tape.watch(layer.kernel.value)`, or a read
        earlier in the step). If nothing is watched it runs its layers once,
        in a stateless scope that maps its state variables to values read
        with the tapes stopped: no tape records the block (nothing is kept
        for backprop) and nothing is recomputed. Where an input or a state
        variable is watched, or a wrapped weight is trainable, or the layers
        are not built yet (`RecomputeFrame.run` decides again once its
        forward built them), it checkpoints as usual.

        The one difference from the layers unwrapped: there the first read
        of such a frozen variable makes the tape watch it, so
        `tape.gradient(loss, layer.kernel.value)` gives a tensor, where
        through the block it gives None (Keras's optimizers and `fit` ask
        only for `trainable_variables`). In a graph the block's ops are
        plain ops on the variables' reads, so a gradient built from the graph
        later (a `tf.function` called under an eager tape, where no tape
        inside watches anything) is exact.
        """
        if not self._inner_built() or self.trainable_variables:
            return True  # unbuilt: its trainable variables are not known yet
        floats = [v for v in keras.tree.flatten(call) if is_float_tensor(v)]
        handles = []
        for variable in state_variables:
            backing = backing_variable(variable)
            if not backing.dtype.is_floating:
                continue
            try:
                handles.append(backing.handle)
            except (AttributeError, ValueError, RuntimeError):
                return True  # no single handle (a distributed variable outside a replica)
        return should_record_backprop(floats + handles)

    def _call_without_gradient(
        self,
        inputs: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        training: Any,
        mask: Any,
        state_variables: list[Any],
    ) -> Any:
        """Runs the layers once, unseen by the tapes (NOTE [ Frozen blocks ])."""
        with stop_recording():
            values = snapshot(state_variables)
        with RecordingStatelessScope(list(zip(state_variables, values))) as scope:
            outputs = self._run_inner(inputs, *args, training=training, mask=mask, **kwargs)
        for variable in scope.assigned.values():  # nothing replays them: every update applies
            variable.assign(scope.get_current_value(variable))
        self._add_losses(scope.losses)
        self._warn_if_unrecorded(outputs)
        return outputs

    def _warn_if_unrecorded(self, outputs: Any) -> None:
        floats = [o for o in keras.tree.flatten(outputs) if is_float_tensor(o)]
        if not should_record_backprop(floats):  # else it read a watched tensor it captured
            self._warn_pointless()

    def _may_recompute(
        self, inputs: Any, args: tuple[Any, ...], kwargs: dict[str, Any], training: Any
    ) -> bool:
        """Whether this call may checkpoint; if not, it is a plain call of the layers."""
        # NOTE [ Nested blocks ]
        # A block inside another block's forward is a plain call (the
        # enclosing forward keeps nothing for backprop anyway). In the
        # enclosing block's recompute a tape records, so the inner block
        # checkpoints, and recomputes once more when that recompute
        # backprops through it. So per training step a layer at nesting
        # depth d (1 directly inside a block) runs d + 1 times: the forward,
        # plus one run per enclosing recompute; an inner block never runs
        # more than once per recompute of the block around it. This is what
        # nesting is for: an inner block that kept its activations during the
        # enclosing recompute would save nothing there.
        if training is None or training is False or not tape_is_recording():
            return False
        if in_block_forward():
            return False
        tensors = [v for v in keras.tree.flatten((inputs, args, kwargs)) if tf.is_tensor(v)]
        if tensors and forward_accumulator_active(tensors[0]):
            # NOTE [ Forward-mode autodiff ]
            # A `tf.autodiff.ForwardAccumulator` gets the JVP of a recorded
            # operation by transposing its gradient function. That fails for
            # a gradient function that recomputes: `tf.recompute_grad`
            # raises "recompute_grad tried to transpose grad of ...", and one
            # that recomputes under a local tape gets no JVP eagerly and a
            # wrong one in a graph (measured, TensorFlow 2.21). Forward mode
            # keeps no activations, so there is nothing to save: the block
            # runs its layers plainly under an accumulator. The JVPs are then
            # exact, and so is the gradient of a GradientTape inside the
            # accumulator (forward-over-backward), without recompute.
            return False
        return True

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
        """The non-trainable variables of the wrapped layers, whose values a recompute replays.

        A frozen layer's (`trainable=False`) weights are among them: read from
        the snapshot, they get a gradient where a tape watches them, as the
        layers unwrapped.
        """
        seen: set[int] = set()
        state = []
        for layer in self.inner:
            for variable in layer.non_trainable_variables:
                if id(variable) not in seen:
                    seen.add(id(variable))
                    state.append(variable)
        return state

    def _recomputed_call(self, frame: RecomputeFrame) -> Any:
        forward = frame.run()
        if forward.random_ops:
            self._reject_randomness(forward.random_ops)
        assert forward.scope is not None
        self._commit_state(forward.scope, frame.state_variables)
        outputs, losses = frame.pack()
        self._add_losses(losses)
        if not forward.attached:  # the layers it built are frozen: as `_call_without_gradient`
            self._warn_if_unrecorded(outputs)
        return outputs

    def _add_losses(self, losses: list[Any]) -> None:
        """Adds the losses the layers made inside the block's stateless scope."""
        if losses:
            owner = self._loss_owner() if self._loss_owner is not None else self
            for loss in losses:
                owner.add_loss(loss)

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
                f"(`seed=self.seed_generator`). {self._foreign_state_fix}."
            )
        for variable in state_variables:
            if scope.changed(variable):
                variable.assign(scope.get_current_value(variable))
        for key, variable in scope.assigned.items():
            if key in trainable:
                variable.assign(scope.get_current_value(variable))

    # ------------------------------------------------------------ randomness

    def _reject_randomness(self, found: list[str]) -> None:
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
        passed, kwargs = self.unrouted((inputs, *args), kwargs)
        inputs, args = passed[0], passed[1:]
        try:
            return compute_output_spec(self._run_inner, inputs, *args, training=False, **kwargs)
        except Exception as error:
            # NOTE [ Output specs at unknown dimensions ]
            # Tracing the layers' calls at unknown dimensions fails for code
            # that needs them concrete (RWKV7's `for t in range(T)` over the
            # sequence), though such a layer gives its spec by its own
            # `compute_output_spec`/`compute_output_shape`, as the model it is
            # in was built with. Those are asked, layer by layer, instead.
            try:
                return self._layers_output_spec(inputs, args, kwargs)
            except Exception:
                raise error from None

    def _layers_output_spec(
        self, inputs: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """The wrapped layers' own output specs, chained (what a Functional model asks)."""
        first = self.inner[0]
        outputs = first.compute_output_spec(inputs, *args, **kwargs)
        for layer in self.inner[1:]:
            outputs = layer.compute_output_spec(outputs)
        return outputs

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
        return keras.tree.map_structure(get_keras_mask, outputs)

    def _set_mask_metadata(self, inputs: Any, outputs: Any, previous_mask: Any) -> None:
        # Keras calls this after `call` to attach `compute_mask(inputs,
        # previous_mask)` to outputs that have no mask. On real tensors the
        # outputs already carry exactly the masks the layers computed (a
        # missing one means the layers attached none), and `compute_mask`
        # would run the layers again; on symbolic outputs it is a cheap trace.
        if _is_symbolic(outputs):
            set_mask_metadata(self, inputs, outputs, previous_mask)

    # ------------------------------------------------------- serialization

    def get_config(self) -> dict[str, Any]:
        base_config = super().get_config()
        base_config.pop("autocast", None)
        serialized = [keras.saving.serialize_keras_object(layer) for layer in self.inner]
        config = {
            "layers": serialized[0] if self._single else serialized,
            "policy": serialize_policy("RecomputeBlock.get_config", self.policy),
            "debug": self.debug,
        }
        return {**base_config, **config}

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects: Any = None) -> RecomputeBlock:
        if not isinstance(config, dict) or "layers" not in config:
            fail(
                "RecomputeBlock.from_config",
                "`config` must be a dict with a 'layers' entry, as returned by "
                "RecomputeBlock.get_config()",
                "config",
                config,
                "Pass block.get_config() of a RecomputeBlock",
            )
        config = dict(config)
        layers = config.pop("layers")
        config["policy"] = deserialize_policy(config.get("policy"), custom_objects)
        if isinstance(layers, list):
            inner: Any = [
                keras.saving.deserialize_keras_object(c, custom_objects=custom_objects)
                for c in layers
            ]
        else:
            inner = keras.saving.deserialize_keras_object(layers, custom_objects=custom_objects)
        return cls(inner, **config)
