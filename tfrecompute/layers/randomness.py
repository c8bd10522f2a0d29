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

from collections.abc import Iterable

import tensorflow as tf

__all__ = ["STATEFUL_RANDOM_OPS", "find_stateful_random_ops"]

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
    found: list[str] = []
    seen_functions: set[str] = set()
    library: dict[str, object] = {}

    def visit_function(name: str) -> None:
        if not library:  # serialise the function library only when needed
            library.update((f.signature.name, f) for f in graph.as_graph_def().library.function)
        if name in seen_functions or name not in library:
            return
        seen_functions.add(name)
        for node in library[name].node_def:  # type: ignore[attr-defined]
            if node.op in STATEFUL_RANDOM_OPS:
                found.append(f"{node.name} ({node.op}) in function {name}")
            visit_attrs(node.attr)

    def visit_attrs(attrs: object) -> None:
        for value in attrs.values():  # type: ignore[attr-defined]
            if value.HasField("func"):
                visit_function(value.func.name)
            elif value.HasField("list"):
                for func in value.list.func:
                    visit_function(func.name)

    for op in operations:
        if op.type in STATEFUL_RANDOM_OPS:
            found.append(f"{op.name} ({op.type})")
        visit_attrs(op.node_def.attr)
    return found
