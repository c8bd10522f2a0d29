"""Detection of random numbers that a recompute cannot replay.

Keras layers draw random numbers statelessly from a `SeedGenerator` whose
state a `RecomputeBlock` snapshots and replays. Stateful TensorFlow random ops
(`tf.random.uniform`, `tf.random.Generator`, `tf.nn.dropout`, ...) keep their
state inside the op kernel or in a raw `tf.Variable`; running them again in the
recompute draws new numbers, and the gradients would be silently wrong. This
module finds such ops in a traced graph, including inside the function bodies
of control flow (`tf.while_loop`, `tf.cond`) and nested `tf.function`s.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import tensorflow as tf

__all__ = ["STATEFUL_RANDOM_OPS", "find_stateful_random_ops", "random_ops_in_function"]

# Op types whose output depends on hidden state that advances on every run.
STATEFUL_RANDOM_OPS = frozenset(
    {
        "Multinomial",
        "NonDeterministicInts",
        "ParameterizedTruncatedNormal",
        "RandomCrop",
        "RandomGamma",
        "RandomPoisson",
        "RandomPoissonV2",
        "RandomShuffle",
        "RandomStandardNormal",
        "RandomUniform",
        "RandomUniformInt",
        "RngReadAndSkip",
        "RngSkip",
        "SampleDistortedBoundingBox",
        "SampleDistortedBoundingBoxV2",
        "StatefulRandomBinomial",
        "StatefulStandardNormal",
        "StatefulStandardNormalV2",
        "StatefulTruncatedNormal",
        "StatefulUniform",
        "StatefulUniformFullInt",
        "StatefulUniformInt",
        "TruncatedNormal",
    }
)


class _FunctionScanner:
    """Finds stateful random ops in functions, by name, through `lookup(name) -> FunctionDef`."""

    def __init__(self, lookup: Callable[[str], Any]) -> None:
        self.lookup = lookup
        self.found: list[str] = []
        self.seen: set[str] = set()

    def visit_function(self, name: str) -> None:
        if name in self.seen:
            return
        self.seen.add(name)
        function = self.lookup(name)
        if function is None:
            return
        for node in function.node_def:
            if node.op in STATEFUL_RANDOM_OPS:
                self.found.append(f"{node.name} ({node.op}) in function {name}")
            elif function.signature.name != node.op:  # a call of another function
                self.visit_function(node.op)
            self.visit_attrs(node.attr)

    def visit_attrs(self, attrs: Any) -> None:
        for value in attrs.values():
            if value.HasField("func"):
                self.visit_function(value.func.name)
            elif value.HasField("list"):
                for func in value.list.func:
                    self.visit_function(func.name)


def find_stateful_random_ops(graph: tf.Graph, operations: Iterable[tf.Operation]) -> list[str]:
    """Names the stateful random ops among `operations`, looking into functions.

    Args:
        graph: the graph that holds `operations` and their function library.
        operations: the ops to inspect (for example the ops a block's forward
            added to the graph).

    Returns:
        `"<op name> (<op type>)"` for each stateful random op found, in the
        order found; an empty list when there is none.
    """
    library: dict[str, Any] = {}

    def lookup(name: str) -> Any:
        if not library:  # serialise the function library only when needed
            library.update((f.signature.name, f) for f in graph.as_graph_def().library.function)
        return library.get(name)

    scanner = _FunctionScanner(lookup)
    for op in operations:
        if op.type in STATEFUL_RANDOM_OPS:
            scanner.found.append(f"{op.name} ({op.type})")
        scanner.visit_attrs(op.node_def.attr)
    return scanner.found


def random_ops_in_function(name: str, lookup: Callable[[str], Any]) -> list[str]:
    """The stateful random ops of the function `name` and the functions it calls.

    `lookup(name)` returns a `FunctionDef` or None (eagerly: the context's
    functions, which is how an eagerly called `tf.function` runs: one op
    named after its function).
    """
    scanner = _FunctionScanner(lookup)
    scanner.visit_function(name)
    return scanner.found
