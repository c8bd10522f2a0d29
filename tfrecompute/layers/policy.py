"""Recompute policies: which products of a block its forward keeps instead of recomputing.

NOTE [ Recompute policies ]
A block without a policy keeps only its inputs and recomputes everything
inside. With one, its forward also keeps the outputs of the products the
policy chooses (`"dots"`: the matmuls, einsums and convolutions that take a
trainable variable), and the recompute uses them instead of computing them
again: only the cheap ops between them (bias adds, activations, norms,
softmax, dropout, attention's `QK^T` and `AV`, which take no weight) run
again.

How: Keras layers compute products through `keras.ops` (`matmul`, `einsum`,
`conv`, ...), which call Keras's backend functions; `intercept_backend_ops`
(`_keras_internals.py`) routes those through `_intercepted`. Outside a
block's forward or recompute it calls the function itself. In a block's
forward (`Recorder`) it runs the product, describes it (`OpInfo`), asks the
policy, and keeps the output if told to; every intercepted call is one entry,
in call order. In the recompute (`Replayer`) the same Python code makes the
same calls in the same order: entry `i` either runs again or returns the kept
tensor through an operation whose gradient is the product's own VJP at the
recompute's inputs (`_saved`). The VJP of a product needs its inputs and the
incoming gradient, not its output, so under `tf.function` and XLA the
product that the VJP's local tape computes is never read and TensorFlow
prunes it: the backward runs only the two gradient products, as without
recompute. Eagerly nothing is pruned, so the VJP runs in a `tf.function` of
its own (`_eager_vjp`).

Calls a policy sees only from the block itself: calls inside a nested
block belong to that block (`boundary`), calls inside a `tf.function` or a
control flow body the layers build (another graph than the block's) and
calls Keras makes on placeholders are passed through uncounted. What a
policy cannot see is recomputed, correctly: a layer calling
`tf.linalg.matmul` or `tf.nn.conv2d` directly, or TensorFlow ops of its own.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfrecompute._keras_internals import (
    in_symbolic_scope,
    intercept_backend_ops,
    stop_recording,
)
from tfrecompute._messages import fail, received
from tfrecompute.errors import RecomputeMismatchError
from tfrecompute.layers.custom_gradient import attach_gradient, depend_on

__all__ = [
    "DOT_KINDS",
    "OpInfo",
    "Policy",
    "Recorder",
    "Replayer",
    "active",
    "boundary",
    "dots",
    "nothing",
    "deserialize_policy",
    "policy_scope",
    "register_scope",
    "planned_policies",
    "policy_label",
    "resolve_policy",
    "serialize_policy",
]

DOT_KINDS = frozenset(
    {
        "matmul",
        "einsum",
        "dot",
        "tensordot",
        "conv",
        "depthwise_conv",
        "separable_conv",
        "conv_transpose",
    }
)
"""The kinds of product a policy is asked about (Keras backend function names)."""


@dataclasses.dataclass(frozen=True)
class OpInfo:
    """What a policy sees of one product a block's forward computed.

    Attributes:
        kind: the `keras.ops` function: "matmul", "einsum", "dot",
            "tensordot", "conv", "depthwise_conv", "separable_conv" or
            "conv_transpose".
        weight: whether an operand is a trainable variable (a layer's kernel).
        shape: the output's static shape (None for unknown dimensions).
        dtype: the output's dtype name ("float32", "bfloat16", ...).
    """

    kind: str
    weight: bool
    shape: tuple[int | None, ...]
    dtype: str

    @property
    def nbytes(self) -> int | None:
        """The output's size in bytes, None if a dimension is unknown."""
        if any(d is None for d in self.shape):
            return None
        return int(np.prod(self.shape, dtype=np.int64)) * tf.as_dtype(self.dtype).size


Policy = Callable[[OpInfo], bool]


def nothing(op: OpInfo) -> bool:
    """Keeps no product: the whole block is recomputed (the default)."""
    return False


def dots(op: OpInfo) -> bool:
    """Keeps the products with a trainable variable operand (JAX's `dots_saveable` for weights)."""
    return op.weight and op.kind in DOT_KINDS


_NAMED: dict[str, Policy] = {"nothing": nothing, "dots": dots}

# Named policies that change how a block runs instead of which products its
# forward keeps: name -> a context manager factory taking the block's layers,
# inside which they run (registered by the module that implements each:
# "attention", NOTE [ Attention core recompute ] in `attention.py`).
_SCOPES: dict[str, Callable[[Any], Any]] = {}


def register_scope(name: str, scope: Callable[[Any], Any]) -> None:
    """Registers a named policy that runs a block's layers inside `scope(layers)`."""
    _SCOPES[name] = scope


def policy_scope(policy: Any) -> Callable[[Any], Any] | None:
    """The scope of a named policy registered with `register_scope`; None for others."""
    return _SCOPES.get(policy) if isinstance(policy, str) else None


def resolve_policy(api: str, policy: Any) -> Policy | None:
    """The function of `policy` (None, "nothing", "dots" or a callable); None for "nothing".

    A scope policy ("attention") keeps no product itself: None too.
    """
    if policy is None or policy_scope(policy) is not None:
        return None
    if isinstance(policy, str):
        if policy not in _NAMED:
            fail(
                api,
                "unknown recompute policy",
                "policy",
                policy,
                "Use None or 'nothing' (recompute everything), 'dots' (keep the products "
                "with a weight), 'attention' (recompute only the attention cores), or a "
                "function taking a tfrecompute.layers.OpInfo and returning a bool",
            )
        found = _NAMED[policy]
        if found is nothing:
            return None
        intercept_backend_ops(_intercepted)
        return found
    if not callable(policy):
        fail(
            api,
            "`policy` must be None, a policy name or a callable",
            "policy",
            policy,
            "Pass 'dots', or a function taking a tfrecompute.layers.OpInfo and returning "
            "whether to keep that product",
            error=TypeError,
        )
    intercept_backend_ops(_intercepted)
    return policy


def planned_policies(api: str, policy: Any) -> tuple[Any, ...]:
    """The policies a planner weighs, one state each: () for None or "nothing", `(policy,)`
    for one, the entries of a list or tuple of several (e.g. `["attention", "dots"]`).

    Each entry is checked as `resolve_policy` checks one; an entry that recomputes
    everything (None, "nothing": the planner's own whole-recompute state) or that repeats
    is refused.
    """
    if not isinstance(policy, (list, tuple)):
        return (policy,) if _keeps_something(api, policy) else ()
    if not policy:
        fail(api, "the list of policies is empty", "policy", policy,
             "Pass one or more policies, e.g. ['attention', 'dots'], or None")  # fmt: skip
    for index, each in enumerate(policy):
        if isinstance(each, (list, tuple)):
            fail(api, f"policy[{index}] is a list; policies do not nest", "policy", policy,
                 "Pass a flat list, e.g. ['attention', 'dots']", error=TypeError)  # fmt: skip
        if not _keeps_something(api, each):
            fail(
                api,
                f"policy[{index}] ({each!r}) recomputes everything, which the planner "
                "already weighs for every segment",
                "policy",
                policy,
                "Leave it out of the list: pass only policies that keep something, "
                "e.g. ['attention', 'dots']",
            )
    if len(set(map(_identity, policy))) != len(policy):
        fail(api, "a policy appears twice in the list", "policy", policy,
             "Pass each policy once")  # fmt: skip
    return tuple(policy)


def _keeps_something(api: str, policy: Any) -> bool:
    """Whether `policy` (checked) keeps anything: not None or "nothing"."""
    return resolve_policy(api, policy) is not None or policy_scope(policy) is not None


def policy_label(policy: Any) -> str:
    """A policy's name for summaries: its name, or a function's `__name__`."""
    return policy if isinstance(policy, str) else getattr(policy, "__name__", repr(policy))


def _identity(policy: Any) -> Any:
    return policy if isinstance(policy, str) else id(policy)


def serialize_policy(api: str, policy: Any) -> Any:
    """`policy` for a layer config: a name, None, or a registered function serialized by Keras."""
    if policy is None or isinstance(policy, str):
        return policy
    name = keras.saving.get_registered_name(policy)
    if keras.saving.get_registered_object(name) is not policy:
        fail(
            api,
            "a callable recompute policy can be saved only as a registered Keras object",
            "policy",
            policy,
            "Decorate the function with @keras.saving.register_keras_serializable(), "
            "or use a policy name ('dots')",
        )
    return keras.saving.serialize_keras_object(policy)


def deserialize_policy(config: Any, custom_objects: Any = None) -> Any:
    """The inverse of `serialize_policy`."""
    if config is None or isinstance(config, str):
        return config
    return keras.saving.deserialize_keras_object(config, custom_objects=custom_objects)


# ------------------------------------------------------------ the scopes

_local = threading.local()


def _stack() -> list[Any]:
    if not hasattr(_local, "stack"):
        _local.stack = []
        _local.inside = False
    stack: list[Any] = _local.stack
    return stack


@contextmanager
def active(scope: Any) -> Iterator[Any]:
    """Makes `scope` (a `Recorder`, a `Replayer` or None) see the products computed inside."""
    stack = _stack()
    stack.append(scope)
    try:
        yield scope
    finally:
        stack.pop()


def boundary() -> Any:
    """A nested block's calls: no enclosing block's policy sees what runs inside."""
    return active(None)


def _current_graph() -> tf.Graph | None:
    return None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()


def _intercepted(kind: str, original: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        stack = _stack()
        scope = stack[-1] if stack else None
        if scope is None or _local.inside or in_symbolic_scope():
            return original(*args, **kwargs)
        if _current_graph() is not scope.graph:  # a tf.function or loop body inside
            return original(*args, **kwargs)
        _local.inside = True
        try:
            return scope.handle(kind, original, args, kwargs)
        finally:
            _local.inside = False

    call.__name__ = getattr(original, "__name__", kind)
    call.__doc__ = getattr(original, "__doc__", None)
    return call


def _is_weight(value: Any) -> bool:
    return isinstance(value, (keras.Variable, tf.Variable)) and bool(value.trainable)


@dataclasses.dataclass
class _Entry:
    kind: str
    saved: tf.Tensor | None


class Recorder:
    """The forward's scope: runs each product, asks the policy, keeps what it says.

    Args:
        block_name: for error messages.
        policy: the policy function.
    """

    def __init__(self, block_name: str, policy: Policy) -> None:
        self.block_name = block_name
        self.policy = policy
        self.graph = _current_graph()
        self.entries: list[_Entry] = []

    def handle(self, kind: str, original: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        output = original(*args, **kwargs)
        saved = None
        if isinstance(output, tf.Tensor) and output.dtype.is_floating:
            leaves = keras.tree.flatten((args, kwargs))
            info = OpInfo(
                kind=kind,
                weight=any(_is_weight(leaf) for leaf in leaves),
                shape=tuple(output.shape.as_list()) if output.shape.rank is not None else (),
                dtype=output.dtype.name,
            )
            if self._ask(info):
                # A tensor of its own: the tapes' record of `output` (which
                # holds the product's inputs) dies with the forward.
                with stop_recording():
                    saved = tf.identity(output)
        self.entries.append(_Entry(kind, saved))
        return output

    def _ask(self, info: OpInfo) -> bool:
        answer = self.policy(info)
        if not isinstance(answer, (bool, np.bool_)):
            fail(
                f"RecomputeBlock '{self.block_name}'",
                "the recompute policy must return True (keep the product) or False "
                f"(recompute it); asked about {info}, it returned something else",
                "answer",
                answer,
                "Return a bool from the policy function",
                error=TypeError,
            )
        return bool(answer)

    @property
    def saved(self) -> list[tf.Tensor]:
        """The tensors kept."""
        return [e.saved for e in self.entries if e.saved is not None]


class Replayer:
    """The recompute's scope: gives each product kept by the forward in place of running it.

    Args:
        block_name: for error messages.
        entries: the forward's `Recorder.entries`.
        dependency: the recompute's ordering guard (`custom_gradient.after`), or None.
    """

    def __init__(self, block_name: str, entries: list[_Entry], dependency: Any) -> None:
        self.block_name = block_name
        self.entries = entries
        self.dependency = dependency
        self.graph = _current_graph()
        self.index = 0

    def handle(self, kind: str, original: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        index = self.index
        self.index += 1
        if index >= len(self.entries) or self.entries[index].kind != kind:
            made = [e.kind for e in self.entries]
            raise RecomputeMismatchError(
                f"RecomputeBlock '{self.block_name}': the recompute in backprop computed "
                f"other products than the forward, whose products were {made!r}, so the "
                f"products its policy kept cannot be used. {received('call', (index, kind))}. "
                "A layer inside computes something else when called again: make its call "
                "depend only on its inputs, its variables and Keras seed generators, or "
                "keep it out of the block."
            )
        saved = self.entries[index].saved
        if saved is None:
            return original(*args, **kwargs)
        return _saved(original, args, kwargs, depend_on(saved, self.dependency))


def _saved(original: Callable[..., Any], args: Any, kwargs: Any, value: tf.Tensor) -> tf.Tensor:
    """`value` (the kept product) with the gradient of `original(*args, **kwargs)`."""
    structure = (args, kwargs)
    leaves = keras.tree.flatten(structure)
    positions = tuple(
        i for i, leaf in enumerate(leaves) if tf.is_tensor(leaf) or isinstance(leaf, keras.Variable)
    )
    tensors = [tf.convert_to_tensor(keras.ops.convert_to_tensor(leaves[i])) for i in positions]
    floats = tuple(i for i, t in enumerate(tensors) if tf.as_dtype(t.dtype).is_floating)
    static = [_TENSOR if i in positions else leaf for i, leaf in enumerate(leaves)]
    # Holds no tensor (a cached eager VJP keeps it).
    template = keras.tree.pack_sequence_as(structure, static)
    product = _Product(original, template, static, positions)

    def backward(gradient: tf.Tensor) -> list[Any]:
        if tf.executing_eagerly():
            with _quiet_retracing():
                return list(_eager_vjp(product, floats)(tensors, gradient))
        return _vjp(product, floats, tensors, gradient)

    inputs = [tensors[i] for i in floats]
    (output,) = attach_gradient([value], inputs, backward, op_type="RecomputeKeptProduct")
    return output


class _Placeholder:
    def __repr__(self) -> str:
        return "<tensor>"


_TENSOR = _Placeholder()


@dataclasses.dataclass(frozen=True)
class _Product:
    """A backend product with its Python arguments bound: `(*tensors) -> output`."""

    original: Callable[..., Any]
    structure: Any
    static: list[Any]
    positions: tuple[int, ...]

    def __call__(self, *tensors: tf.Tensor) -> Any:
        flat = list(self.static)
        for position, tensor in zip(self.positions, tensors):
            flat[position] = tensor
        call_args, call_kwargs = keras.tree.pack_sequence_as(self.structure, flat)
        return self.original(*call_args, **call_kwargs)

    def key(self) -> str:
        """Equal for products that compute alike (the static arguments' repr)."""
        return f"{id(self.original)}:{self.positions}:{self.static!r}"


def _vjp(
    product: _Product, floats: tuple[int, ...], tensors: list[tf.Tensor], gradient: Any
) -> list[Any]:
    """The VJP of `product` at `tensors` for the floating ones (its product is left unread)."""
    with tf.GradientTape() as tape:
        watched = [tensors[i] for i in floats]
        tape.watch(watched)
        output = product(*tensors)
    return list(tape.gradient(output, watched, output_gradients=gradient))


_EAGER_VJPS: dict[tuple[str, tuple[int, ...]], Any] = {}


class _RetracingFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "triggered tf.function retracing" not in record.getMessage()


@contextmanager
def _quiet_retracing() -> Iterator[None]:
    """Hides TensorFlow's warning that the eager VJPs trace often.

    Each kind of product has its VJP function, traced once per input
    signature: a bounded number of traces, which TensorFlow's detector of
    functions made in a loop (it counts by the function's code) reports as
    "excessive". Only while a VJP is called.
    """
    logger = tf.get_logger()
    quiet = _RetracingFilter()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def _eager_vjp(product: _Product, floats: tuple[int, ...]) -> Any:
    """`_vjp` as a `tf.function`, so that eagerly too the product itself is never computed.

    One function per kind of product (its static arguments), traced once per
    input signature: the cached function holds no tensor.
    """
    key = (product.key(), floats)
    if key not in _EAGER_VJPS:

        @tf.function(autograph=False)
        def vjp(tensors: list[tf.Tensor], gradient: tf.Tensor) -> list[Any]:
            return _vjp(product, floats, list(tensors), gradient)

        _EAGER_VJPS[key] = vjp
    return _EAGER_VJPS[key]
