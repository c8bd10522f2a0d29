"""Every private Keras and TensorFlow symbol tfrecompute uses, in one place.

Each entry says why the public API does not suffice. Tested with tensorflow
2.16 to 2.21 and keras 3.9 to 3.15; on an upgrade, this module and its
tests are what to check. Nothing else in the package imports `keras.src`,
`tensorflow.python` or `tensorflow.tsl` (tests/test_layout.py checks). One
private hook is overridden, not called: `RecomputeBlock._set_mask_metadata`
(see its comment).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import keras
import tensorflow as tf
from keras.src import backend as keras_backend
from keras.src.backend.common import global_state
from keras.src.backend.common.symbolic_scope import in_symbolic_scope
from keras.src.layers.layer import CallContext, CallSpec
from keras.src.ops import function as keras_function
from tensorflow.python import pywrap_tfe
from tensorflow.python.eager import context, record
from tensorflow.python.framework import op_callbacks
from tensorflow.python.ops import gradients_util
from tensorflow.tsl.profiler.protobuf import xplane_pb2

__all__ = [
    "VariableWatcher",
    "all_sublayers",
    "backing_variable",
    "build_as_called",
    "call_context",
    "call_has_mask_arg",
    "call_has_training_arg",
    "compute_output_spec",
    "device_scope",
    "direct_sublayers",
    "eager_function_def",
    "forward_accumulator_active",
    "functional_inputs",
    "functional_model",
    "functional_nodes",
    "functional_outputs",
    "get_keras_mask",
    "graph_gradients",
    "gradient_override_name",
    "identity_n_gradient",
    "in_control_flow_body",
    "in_symbolic_scope",
    "intercept_backend_ops",
    "loop_body_graph",
    "inbound_nodes",
    "is_functional",
    "keras_history_operation",
    "op_callback",
    "outside_stateless_scope",
    "own_variables",
    "record_operation",
    "recording_calls",
    "set_keras_mask",
    "set_mask_metadata",
    "should_record_backprop",
    "stop_recording",
    "tape_is_recording",
    "track_dependency",
    "xplane_pb2",
]

# ------------------------------------------------------------------ tapes
# TensorFlow's public API cannot tell whether a tape records the ops run now,
# nor stop recording on all tapes: `tf.GradientTape.stop_recording` stops one.


def onednn_enabled() -> bool:
    """Whether TensorFlow runs with oneDNN in this process (its CPU allocator then keeps
    statistics). Importing TensorFlow decides it; its runtime need not have started."""
    from tensorflow.python.util import _pywrap_util_port

    return bool(_pywrap_util_port.IsMklEnabled())


def runtime_started() -> bool:
    """Whether TensorFlow's eager runtime has started (its devices and allocators are fixed)."""
    return bool(context.context()._initialized)


def tape_is_recording() -> bool:
    """Whether any gradient tape or forward accumulator could record the ops run now.

    False inside `stop_recording()` (where a block makes the copies its
    forward runs on).
    """
    return bool(record.could_possibly_record()) and not pywrap_tfe.TFE_Py_TapeSetIsStopped()


def forward_accumulator_active(probe: tf.Tensor) -> bool:
    """Whether a `tf.autodiff.ForwardAccumulator` is active in this thread.

    `TFE_Py_PackJVPs` returns one entry per active accumulator, whatever the
    accumulator watches; `probe` is any tensor.
    """
    indices, _ = pywrap_tfe.TFE_Py_PackJVPs([probe])
    return bool(indices)


def should_record_backprop(tensors: list[tf.Tensor]) -> bool:
    """Whether some active tape watches one of `tensors`."""
    return bool(record.should_record_backprop(tensors))


stop_recording = record.stop_recording
"""Context manager: no tape or accumulator records the ops run inside."""

VariableWatcher = record.VariableWatcher
"""Context manager: `.watched_variables()` are the trainable variables read inside."""


def record_operation(
    op_type: str, outputs: list[tf.Tensor], inputs: list[tf.Tensor], backward: Any
) -> None:
    """Records `outputs = op(inputs)` on every tape that watches an input.

    `backward(*output_grads)` returns one gradient (or None) per input. This
    is what `tf.custom_gradient` does; recording directly lets a block choose
    its inputs after its forward ran (the tensors it turned out to capture).
    """
    record.record_operation(op_type, outputs, inputs, backward)


# ----------------------------------------------------------- graph gradients
# `tf.custom_gradient` registers each graph-mode gradient function in TF's
# global gradient registry under a fresh name, where it stays for the life of
# the process with everything its closure holds. An op's own
# `_gradient_function` (what `tf.function` call ops use) lives as long as the
# op's graph.


@contextlib.contextmanager
def identity_n_gradient(graph: tf.Graph, gradient: Any) -> Iterator[None]:
    """`IdentityN` ops created inside get `gradient(op, *grads)` as their gradient function."""
    with graph._override_gradient_function({"IdentityN": gradient}):
        yield


def graph_gradients(
    targets: list[tf.Tensor],
    sources: list[Any],
    output_gradients: list[tf.Tensor],
    unconnected: tf.UnconnectedGradients,
    graph: tf.Graph,
    leaves: list[tf.Tensor],
) -> list[Any]:
    """Symbolic gradients of `targets` at `sources`, through the ops of `graph` below `leaves`.

    What `tf.while_loop` and `tf.cond` use to differentiate a body from the
    graph of their gradient (`tf.gradients` only differentiates the default
    graph). A tape kept with the graph instead would be a reference cycle
    through C++ that Python cannot collect. `leaves` are held constant, as a
    tape's watched tensors are: a graph's total derivative would also run
    through them into the ops that made them.
    """
    return list(
        gradients_util._GradientsHelper(
            targets,
            sources,
            grad_ys=output_gradients,
            stop_gradients=leaves,
            unconnected_gradients=unconnected,
            src_graph=graph,
        )
    )


def gradient_override_name(op: tf.Operation) -> str | None:
    """The gradient an op was given by `gradient_override_map` (`tf.custom_gradient`), or None."""
    try:
        return op.get_attr("_gradient_op_type").decode()
    except ValueError:
        return None


def in_control_flow_body() -> bool:
    """Whether ops are being built in the body of a `tf.while_loop` or `tf.cond` branch.

    No tape records the ops of such a body: the loop's gradient is built
    symbolically, so `should_record_backprop` cannot tell whether a gradient
    will reach a tensor there.
    """
    graph = tf.compat.v1.get_default_graph()
    return bool(getattr(graph, "is_control_flow_graph", False))


def device_scope() -> str:
    """The device the enclosing `tf.device` scopes request for new ops ("" for none).

    Eagerly TensorFlow keeps it in the context; in a graph it is a stack of
    device functions, resolved here the way TensorFlow resolves it for an op.
    """
    if tf.executing_eagerly():
        return context.context().device_name or ""
    graph = tf.compat.v1.get_default_graph()
    if not graph._device_function_stack.peek_objs():
        return ""
    with stop_recording():
        return tf.no_op(name="device_probe").device


# ------------------------------------------------------------ eager ops
# Eagerly there is no graph to inspect: the ops a forward runs are seen only
# as they run. TensorFlow's op callbacks (what `tf.debugging.
# enable_check_numerics` uses) are thread-local and receive every op's
# inputs and outputs.


@contextlib.contextmanager
def op_callback(callback: Any) -> Iterator[None]:
    """Calls `callback(op_type, inputs, attrs, outputs, op_name=None, graph=None)` per op."""
    op_callbacks.add_op_callback(callback)
    try:
        yield
    finally:
        op_callbacks.remove_op_callback(callback)


def eager_function_def(name: str) -> Any:
    """The `FunctionDef` of a function the eager context knows by `name`, or None."""
    ctx = context.context()
    if not ctx.has_function(name):
        return None
    return ctx.get_function_def(name)


# ------------------------------------------------------------ Keras calls
# A block's recompute runs during backprop, outside the call of the model that
# holds it, where Keras's call context (which carries `training` down to
# nested layers) is gone; Keras has no public way to make one.


@contextlib.contextmanager
def call_context(entry_layer: keras.layers.Layer, training: Any) -> Iterator[None]:
    """Runs Keras layer calls as if inside `entry_layer(..., training=training)`."""
    previous = global_state.get_global_attribute("current_call_ctx")
    context = CallContext(entry_layer=entry_layer)
    context.set_value("training", training)
    global_state.set_global_attribute("current_call_ctx", context)
    try:
        yield
    finally:
        global_state.set_global_attribute("current_call_ctx", previous)


def current_training() -> Any:
    """The `training` value of the Keras layer call in progress (None outside any)."""
    context = global_state.get_global_attribute("current_call_ctx")
    return None if context is None else context.get_value("training")


def build_as_called(
    layer: keras.layers.Layer, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """Builds `layer` as `layer(*args, **kwargs)` would, without calling it.

    Keras builds a layer in its `__call__` (`_maybe_build`: its `build()` on
    the shapes of the arguments, or for a layer without one a symbolic run
    of `call()`); no public API runs that step alone. A block builds a layer
    there when its first call comes inside a stateless scope (NOTE [ Layers
    built by the forward ] in `layers/frame.py`).
    """
    if hasattr(layer, "_call_context_args"):  # keras 3.15; older ones take no such list
        spec = CallSpec(layer._call_signature, layer._call_context_args, args, kwargs)
    else:
        spec = CallSpec(layer._call_signature, args, kwargs)
    with layer._open_name_scope():
        layer._maybe_build(spec)


@contextlib.contextmanager
def outside_stateless_scope() -> Iterator[None]:
    """Runs what is inside as if no Keras stateless scope were active.

    A Keras variable created inside a stateless scope is left uninitialized
    and reads as a fresh draw of its initializer until the outermost scope
    exits; Keras has no public way to step out of a scope.
    """
    scope = global_state.get_global_attribute("stateless_scope")
    global_state.set_global_attribute("stateless_scope", None)
    try:
        yield
    finally:
        global_state.set_global_attribute("stateless_scope", scope)


def backing_variable(variable: Any) -> Any:
    """The `tf.Variable` behind a Keras variable (what TensorFlow's tapes and watchers see)."""
    return getattr(variable, "_value", variable)


def call_has_training_arg(layer: Any) -> bool:
    """Whether `layer.call` takes `training` (Keras inspects the signature once)."""
    return bool(getattr(layer, "_call_has_training_arg", False))


def call_has_mask_arg(layer: Any) -> bool:
    """Whether `layer.call` takes `mask`."""
    return bool(getattr(layer, "_call_has_mask_arg", False))


def compute_output_spec(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Traces `fn` on `KerasTensor`s (building the layers it calls); returns its output specs.

    `keras.Layer.compute_output_spec` traces one layer; a block traces a
    function of several.
    """
    return keras.src.backend.compute_output_spec(fn, *args, **kwargs)


def get_keras_mask(tensor: Any) -> Any:
    """The Keras mask attached to `tensor`, or None."""
    return keras.src.backend.get_keras_mask(tensor)


def set_keras_mask(tensor: Any, mask: Any) -> None:
    """Attaches a Keras mask to `tensor` (as a layer's output masks are)."""
    keras.src.backend.set_keras_mask(tensor, mask)


def set_mask_metadata(layer: keras.layers.Layer, inputs: Any, outputs: Any, mask: Any) -> None:
    """Keras's own attaching of `layer.compute_mask(inputs, mask)` to `outputs`."""
    keras.layers.Layer._set_mask_metadata(layer, inputs, outputs, mask)


# ----------------------------------------------------------- layer graphs
# Keras exposes a Functional model's layers, not its nodes (which call of a
# shared layer consumed which tensor), nor which layer made a KerasTensor.


def is_functional(model: Any) -> bool:
    """Whether `model` has a node graph (a Functional model, or a Sequential's inner one)."""
    return isinstance(model, keras.Sequential) or hasattr(model, "_nodes_by_depth")


def functional_nodes(model: keras.Model) -> list[Any]:
    """The nodes of a Sequential or Functional model, inputs first, in a topological order.

    A node has `operation` (the layer or `keras.ops` operation called),
    `arguments` (`.args`, `.kwargs`, `.keras_tensors`), `outputs` and `is_input`.
    """
    functional = model._functional if isinstance(model, keras.Sequential) else model
    depths = sorted(functional._nodes_by_depth, reverse=True)
    return [node for depth in depths for node in functional._nodes_by_depth[depth]]


def functional_inputs(model: keras.Model) -> list[Any]:
    """The input tensors of the graph `functional_nodes(model)` walks."""
    functional = model._functional if isinstance(model, keras.Sequential) else model
    return list(functional.inputs)


def functional_outputs(model: keras.Model) -> list[Any]:
    """The output tensors of the graph `functional_nodes(model)` walks."""
    functional = model._functional if isinstance(model, keras.Sequential) else model
    return list(functional.outputs)


def keras_history_operation(tensor: Any) -> Any:
    """The layer or operation that produced a symbolic tensor, or None."""
    history = getattr(tensor, "_keras_history", None)
    return None if history is None else history.operation


def functional_model(inputs: Any, outputs: Any, *, name: str) -> keras.Model:
    """`keras.Model(inputs, outputs)`, also when two of its layers share a name.

    Keras requires the operation names of a Functional model to be unique, for
    its serialization. A model rebuilt from a larger one's layers (CLIP's two
    encoders each have a layer 'embedding') is never serialized, so the
    duplicates get distinct names while it is built and their own back after.
    Variable paths are fixed when variables are made and do not change.
    """
    # The operations Keras's own check walks (`keras.src.ops.function.map_graph`).
    _, operations = keras_function._build_map(inputs, outputs)
    counts: dict[str, int] = {}
    renamed: list[tuple[Any, str]] = []
    for operation in operations:
        counts[operation.name] = counts.get(operation.name, 0) + 1
        if counts[operation.name] > 1:
            renamed.append((operation, operation.name))
            operation.name = f"{operation.name}__{counts[operation.name]}"
    try:
        return keras.Model(inputs, outputs, name=name)
    finally:
        for operation, original in renamed:
            operation.name = original


def inbound_nodes(layer: Any) -> list[Any]:
    """The nodes at which `layer` was called symbolically."""
    return list(getattr(layer, "_inbound_nodes", []))


def all_sublayers(layer: Any) -> list[Any]:
    """`layer` and every layer it holds, at any depth (what `model.losses` walks)."""
    return list(layer._flatten_layers(include_self=True, recursive=True))


def direct_sublayers(layer: Any) -> list[Any]:
    """The layers `layer` holds as attributes, one level down, in creation order."""
    return list(layer._flatten_layers(include_self=False, recursive=False))


def own_variables(layer: Any) -> list[Any]:
    """The variables `layer` created itself (not its sublayers')."""
    return list(layer._trainable_variables) + list(layer._non_trainable_variables)


def track_dependency(parent: Any, child: Any, name: str) -> None:
    """Makes `child` a named dependency of `parent` in TensorFlow's object graph.

    Keras's `TrackedList` attributes are not followed by TensorFlow's object
    graph (keras-team/keras#19425), and no public API adds a dependency.
    """
    parent._track_trackable(child, name=name, overwrite=True)


# ------------------------------------------------------------- recording
# Keras has no hook on layer calls. Tracing a model's call once with one
# patched in is how the call tree of any model, subclassed ones included,
# is read: every layer and operation call goes through these two methods.


@contextlib.contextmanager
def recording_calls(recorder: Any) -> Iterator[None]:
    """Reports every layer and operation call made inside to `recorder`.

    `recorder.enter(operation, args, kwargs)` is called as a call starts, with
    the arguments as its caller passed them, and returns a token;
    `recorder.received(args, kwargs)` gives the innermost layer call's
    arguments after Keras converted them (cast to its compute dtype, masks
    added): what its `call` sees; `recorder.exit(token, outputs)` follows with
    the outputs. Calls nest: a layer's sub-layer calls are made between its enter
    and exit. Not thread-safe: record in one thread at a time.
    """
    layer_call = keras.layers.Layer.__call__
    operation_call = keras.Operation.__call__

    def on_layer_call(self: Any, *args: Any, **kwargs: Any) -> Any:
        token = recorder.enter(self, args, kwargs)
        outputs = layer_call(self, *args, **kwargs)
        recorder.exit(token, outputs)
        return outputs

    def on_operation_call(self: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(self, keras.layers.Layer):  # reached from Layer.__call__, converted
            recorder.received(args, kwargs)
            return operation_call(self, *args, **kwargs)
        token = recorder.enter(self, args, kwargs)
        outputs = operation_call(self, *args, **kwargs)
        recorder.exit(token, outputs)
        return outputs

    keras.layers.Layer.__call__ = on_layer_call
    keras.Operation.__call__ = on_operation_call
    try:
        yield
    finally:
        keras.layers.Layer.__call__ = layer_call
        keras.Operation.__call__ = operation_call


# ------------------------------------------------------------ backend ops
# A recompute policy sees the products a block computes (NOTE [ Recompute
# policies ] in `layers/policy.py`). Keras layers compute them through
# `keras.ops.matmul`, `einsum`, `conv`, ..., each of which calls its backend
# function as an attribute of the backend module at call time
# (`backend.numpy.matmul(x1, x2)`), so replacing those attributes sees every
# call, however the layer imported `keras.ops`. The backend functions call
# each other (`einsum` may call `matmul`): a wrapper must pass nested calls
# through. Keras's `compute_output_spec` runs the same functions on
# placeholders inside a `SymbolicScope` (`in_symbolic_scope`, imported above).
# Tested with keras 3.9 to 3.15 (TensorFlow backend).

BACKEND_OPS = (
    ("numpy", "matmul"),
    ("numpy", "einsum"),
    ("numpy", "dot"),
    ("numpy", "tensordot"),
    ("nn", "conv"),
    ("nn", "depthwise_conv"),
    ("nn", "separable_conv"),
    ("nn", "conv_transpose"),
)
"""(backend module, function): the products a recompute policy sees, by kind."""


def intercept_backend_ops(wrap: Any) -> None:
    """Replaces each `BACKEND_OPS` function `f` of Keras's backend by `wrap(kind, f)`, once.

    Idempotent: a function already replaced is left alone. The replacement
    stays for the life of the process (it passes calls straight through
    outside a block that has a policy).
    """
    for module_name, name in BACKEND_OPS:
        module = getattr(keras_backend, module_name)
        current = getattr(module, name)
        if getattr(current, "_tfrecompute_original", None) is not None:
            continue
        replacement = wrap(name, current)
        replacement._tfrecompute_original = current
        setattr(module, name, replacement)


# `xplane_pb2` (imported above): `tf.profiler` writes XSpace protobufs but
# offers no reader for them; `trace_step` parses the allocator's events.


def loop_body_graph(op: tf.Operation) -> Any:
    """The graph of a `While`/`StatelessWhile` op's body (None if it cannot be found).

    `tf.while_loop` in a `tf.function` stores its body as a function of the
    outer graph, named in the op's `body` attribute; TensorFlow has no public
    way to read that function's graph back from the op.
    """
    try:
        function = op.graph._get_function(op.get_attr("body").name)
    except (AttributeError, ValueError, KeyError):
        return None
    return getattr(function, "graph", None)
