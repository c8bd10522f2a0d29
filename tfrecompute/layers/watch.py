"""What a block's forward ran: its ops, the tensors it captured, its random ops.

A block learns what it must differentiate only by running its forward. In a
graph the forward's ops are the ops it added to the graph; eagerly there is no
graph, so the ops are watched as they run (TensorFlow's op callbacks), without
tracing the forward: a layer with Python control flow on tensor values runs
exactly as it would unwrapped.

From the ops a `ForwardWatch` answers:

* which tensors from outside the forward it captured (NOTE [ Captured
  tensors ] in `frame.py`),
* which stateful random ops it ran (see `randomness.py`),
* which of its outputs were computed from which (NOTE [ Gradients between
  outputs ] in `backward.py`),
* whether a plain backward would keep anything beyond what the block keeps
  anyway (NOTE [ Early stop ] in `backward.py`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import tensorflow as tf

from tfrecompute._keras_internals import (
    VariableWatcher,
    eager_function_def,
    gradient_override_name,
    op_callback,
    should_record_backprop,
)
from tfrecompute.layers.randomness import (
    STATEFUL_RANDOM_OPS,
    find_stateful_random_ops,
    random_ops_in_function,
)

__all__ = ["ForwardWatch", "OpRecord", "saves_nothing"]

# Ops whose gradient reads none of their inputs and outputs.
GRADIENT_READS_NOTHING = frozenset(
    {
        "AddN",
        "BiasAdd",
        "Identity",
        "IdentityN",
        "Neg",
        "NoOp",
        "PreventGradient",
        "ReadVariableOp",
        "StopGradient",
    }
)
# Ops whose gradient reads their inputs (or only their shapes), never their outputs
# (checked against tensorflow/python/ops/{array,math,nn}_grad.py, TF 2.21).
GRADIENT_READS_INPUTS = frozenset(
    {
        "Abs",
        "Add",
        "AddV2",
        "BatchMatMulV2",
        "BatchMatMulV3",
        "BroadcastTo",
        "Cast",
        "ConcatV2",
        "Conv2D",
        "Cos",
        "ExpandDims",
        "Log",
        "MatMul",
        "Mean",
        "Mul",
        "Pack",
        "Pad",
        "Reshape",
        "Sin",
        "Slice",
        "Softplus",
        "Square",
        "Squeeze",
        "StridedSlice",
        "Sub",
        "Sum",
        "Tile",
        "Transpose",
    }
)


@dataclasses.dataclass(frozen=True)
class OpRecord:
    """One op the forward ran (eagerly) or added (in a graph)."""

    type: str
    inputs: tuple[Any, ...]
    outputs: tuple[Any, ...]


def _is_float(tensor: Any) -> bool:
    return tf.is_tensor(tensor) and tensor.dtype.is_floating


class ForwardWatch:
    """What a block's forward ran; `ForwardWatch.around()` records it.

    Eagerly the records hold the forward's tensors until the watch is
    dropped, so tensor ids stay unique while they are read.

    Attributes:
        ops: the ops, in the order they ran or were created.
        variables: the trainable variables read directly inside (not through
            a Keras stateless scope): their gradients must be taken too.
    """

    def __init__(self) -> None:
        self.ops: list[OpRecord] = []
        self.variables: list[Any] = []
        self._graph: tf.Graph | None = None
        self._graph_ops: list[tf.Operation] = []
        self._paused = 0
        self._skipped: list[tuple[int, int]] = []  # graph op positions made while paused

    @classmethod
    @contextlib.contextmanager
    def around(cls) -> Iterator[ForwardWatch]:
        """Records the ops run (eagerly) or created (in a graph) inside."""
        watch = cls()
        with VariableWatcher() as watcher:
            if tf.executing_eagerly():
                with op_callback(watch._record):
                    yield watch
            else:
                graph = tf.compat.v1.get_default_graph()
                known = len(graph.get_operations())
                yield watch
                added = [
                    op
                    for position, op in enumerate(graph.get_operations()[known:], start=known)
                    if not any(start <= position < end for start, end in watch._skipped)
                ]
                watch._graph, watch._graph_ops = graph, added
                watch.ops = [OpRecord(op.type, tuple(op.inputs), tuple(op.outputs)) for op in added]
            watch.variables = list(watcher.watched_variables())

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """What runs inside is not the forward's (a layer building its variables)."""
        graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
        start = 0 if graph is None else len(graph.get_operations())
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1
            if graph is not None:
                self._skipped.append((start, len(graph.get_operations())))

    def _record(
        self,
        op_type: str,
        inputs: Sequence[Any],
        attrs: Any,
        outputs: Sequence[Any],
        op_name: str | None = None,
        graph: tf.Graph | None = None,
    ) -> None:
        if self._paused:
            return
        if graph is None:  # an eager op, not one built into a function traced meanwhile
            name = op_type.decode() if isinstance(op_type, bytes) else op_type  # fast path: bytes
            self.ops.append(OpRecord(name, tuple(inputs), tuple(outputs)))

    # ------------------------------------------------------------ queries

    def produced(self) -> set[int]:
        """Ids of the tensors the forward's ops produced."""
        return {id(t) for op in self.ops for t in op.outputs}

    def captures(self, known: Sequence[Any]) -> list[tf.Tensor]:
        """Floating tensors from outside the forward that its ops read, other than `known`.

        Eagerly only those some tape watches (the others cannot get a
        gradient); in a graph all but constants, since a gradient built from
        the graph later (a `tf.function` called under an eager tape) may ask
        for any of them.
        """
        skip = self.produced() | {id(t) for t in known}
        found: dict[int, tf.Tensor] = {}
        for op in self.ops:
            for tensor in op.inputs:
                if id(tensor) not in skip and id(tensor) not in found and _is_float(tensor):
                    found[id(tensor)] = tensor
        if self._graph is None:
            return [t for t in found.values() if should_record_backprop([t])]
        return [t for t in found.values() if t.op.type != "Const"]

    def custom_gradients_of_variables(self) -> bool:
        """Whether a graph forward ran a `tf.custom_gradient` that read a variable in its body.

        `tf.custom_gradient` appends such variables to the inputs of the
        `IdentityN` op it creates, read afresh there: a `ReadVariableOp`
        output that nothing but that op consumes (an argument read from a
        variable is also used by the function's body).
        """
        for op in self._graph_ops:
            if op.type != "IdentityN" or not gradient_override_name(op):
                continue
            for tensor in op.inputs:
                if tensor.op.type == "ReadVariableOp" and tensor.consumers() == [op]:
                    return True
        return False

    def random_ops(self) -> list[str]:
        """The stateful random ops the forward ran, as `"<name> (<type>)"`."""
        if self._graph is not None:
            return find_stateful_random_ops(self._graph, self._graph_ops)
        found: list[str] = []
        seen: set[str] = set()
        for op in self.ops:
            if op.type in STATEFUL_RANDOM_OPS:
                found.append(f"{op.type} (eager op)")
            elif op.type not in seen:  # an eagerly called tf.function runs as one op
                seen.add(op.type)
                found += random_ops_in_function(op.type, eager_function_def)
        return found

    def direct_parents(self, results: Sequence[tf.Tensor]) -> list[list[int]]:
        """For each result, the earlier-listed or upstream results it is computed from directly.

        Result `i` is a direct parent of result `j` when a path of ops leads
        from `i` to `j` without passing through another result (the same
        tensor listed twice counts: the later one is computed from the
        earlier).
        """
        producer = {id(t): op for op in self.ops for t in op.outputs}
        where: dict[int, list[int]] = {}
        for index, tensor in enumerate(results):
            where.setdefault(id(tensor), []).append(index)
        parents = []
        for index, tensor in enumerate(results):
            found = {i for i in where[id(tensor)] if i < index}
            parents.append(sorted(found | _results_above(tensor, producer, where, index)))
        return parents

    def iter_float_ops(self) -> Iterator[OpRecord]:
        """The ops with a floating output (the ones a backward goes through)."""
        return (op for op in self.ops if any(_is_float(t) for t in op.outputs))


def _results_above(
    tensor: Any, producer: dict[int, OpRecord], where: dict[int, list[int]], index: int
) -> set[int]:
    """The results met first on the paths up from `tensor` (not passing beyond them)."""
    found: set[int] = set()
    seen: set[int] = set()
    stack = list(producer[id(tensor)].inputs) if id(tensor) in producer else []
    while stack:
        current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if id(current) in where:
            found.update(i for i in where[id(current)] if i != index)
            continue
        if id(current) in producer:
            stack.extend(producer[id(current)].inputs)
    return found


def saves_nothing(watch: ForwardWatch, results: Sequence[tf.Tensor]) -> bool:
    """Whether a plain backward of the forward reads no tensor the forward computed.

    True when every op with a floating output has a gradient that reads
    nothing, or reads only its inputs and those come from outside the
    forward (the block's inputs, constants), are a variable's value or are
    among the block's `results`, which are kept anyway. A conservative
    table: any other op counts as saving.
    """
    kept = {id(t) for t in results}
    produced = {
        id(t)
        for op in watch.ops
        if op.type != "ReadVariableOp"
        for t in op.outputs
        if id(t) not in kept
    }
    for op in watch.iter_float_ops():
        if op.type in GRADIENT_READS_NOTHING:
            continue
        if op.type not in GRADIENT_READS_INPUTS:
            return False
        if any(id(t) in produced for t in op.inputs if _is_float(t)):
            return False
    return True
