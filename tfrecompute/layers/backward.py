"""What runs when a gradient reaches a block: the recompute, its checks, and the VJPs.

A block's training call attaches two kinds of operations to its outputs
(`custom_gradient.attach_gradient`):

* one operation `O` from the block's sources (its floating inputs, the values
  of its weights and state, the tensors it captured) to hidden copies of its
  results (floating outputs, then losses), whose gradient recomputes the
  forward under a local tape (`BlockGradient.backward`);
* per result `j`, an operation `P_j` from the hidden copy (and from the results
  `j` is directly computed from) to the tensor the caller sees
  (`BlockGradient.output_backward`).

NOTE [ Unconnected gradients ]
Tapes give an operation zeros for the outputs that no gradient reaches, and a
variable that only such an output depends on would then get a zero gradient
where the layers unwrapped give None (optimizers skip None but apply zeros:
weight decay moves such weights). `P_j` runs only when a gradient reaches
result `j`; it marks the gradient it passes on, and `O` differentiates only
the results whose gradient is a marked one. The rest of the sources get None,
exactly where the unwrapped layers' tape gives None.

NOTE [ Gradients between outputs ]
When result `j` is computed from result `i` (`z = f(y)`, or the attention
output from the attention scores), the unwrapped tape can differentiate `z`
with respect to `y`. So `P_j` also takes the results `j` is directly computed
from (those reached first on the paths up from `j`) and gives each the VJP
along those direct paths (`_direct_vjps`). The gradient reaching result `i`
is then the caller's own plus these link terms; the local tape of `O` adds the
paths between results itself, so `O` subtracts the link terms first.

NOTE [ Early stop ]
A block whose plain backward would read nothing the forward computed (an
identity, a reshape of its input; see `watch.saves_nothing`) keeps the tape
its forward ran under and differentiates that instead of recomputing. Under
`tf.function`, a recompute's ops that no gradient reads are removed by
TensorFlow's graph optimizer, so only what the backward reads is recomputed;
eagerly a recompute runs the whole block.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from tfrecompute.errors import RecomputeMismatchError

__all__ = ["BlockGradient", "Replay", "check_metadata"]


Gradient = Callable[[list[tf.Tensor], list[Any], list[tf.Tensor], tf.UnconnectedGradients], Any]


@dataclasses.dataclass
class Replay:
    """A differentiable run of the forward: a recompute, or the forward itself.

    Attributes:
        gradient: `(targets, sources, output_gradients, unconnected)` to the
            gradients of `targets` with respect to `sources` (the tape's
            `gradient`, or symbolic gradients through a graph's ops).
        results: the run's results (floating outputs, then losses).
        sources: what the block's gradient is taken with respect to, one per
            source of the block's operation.
    """

    gradient: Gradient
    results: list[tf.Tensor]
    sources: list[Any]

    @classmethod
    def of_tape(cls, tape: tf.GradientTape, results: list[tf.Tensor], sources: list[Any]) -> Replay:
        """A run recorded on `tape`."""

        def gradient(targets: Any, sources: Any, output_gradients: Any, unconnected: Any) -> Any:
            return tape.gradient(
                targets,
                sources,
                output_gradients=output_gradients,
                unconnected_gradients=unconnected,
            )

        return cls(gradient, results, sources)


def _spec(tensor: tf.Tensor) -> str:
    return f"{tensor.dtype.name}{tensor.shape}"


def check_metadata(
    block_name: str, forward: Sequence[tuple[tf.DType, tf.TensorShape]], recomputed: Sequence[Any]
) -> None:
    """Raises if the recompute's results differ in count, dtype or static shape from the forward's.

    Runs in Python: eagerly on every recompute, in a graph once when the
    gradient is traced, so it costs nothing per step there.
    """
    got = [_spec(t) for t in recomputed]
    want = [f"{dtype.name}{shape}" for dtype, shape in forward]
    mismatch = len(got) != len(want) or any(
        t.dtype != dtype or not t.shape.is_compatible_with(shape)
        for t, (dtype, shape) in zip(recomputed, forward)
    )
    if mismatch:
        raise RecomputeMismatchError(
            f"RecomputeBlock '{block_name}': the recompute in backprop returned other tensors "
            f"than the forward, which returned {want!r}, so its gradients would be wrong. "
            f"Received: recomputed={got!r} (of type list). A layer inside computes "
            "something else when called again: make its call depend only on its inputs, its "
            "variables and Keras seed generators (no Python counters or values read from "
            "outside that change between calls), or keep it out of the block."
        )


def _ancestors(parents: Sequence[Sequence[int]], index: int) -> list[int]:
    """The results `index` is computed from, directly or not."""
    found: list[int] = []
    stack = list(parents[index])
    while stack:
        current = stack.pop()
        if current not in found:
            found.append(current)
            stack.extend(parents[current])
    return found


def _direct_vjps(
    replay: Replay, parents: Sequence[Sequence[int]], index: int, gradient: tf.Tensor
) -> dict[int, tf.Tensor]:
    """The VJP of result `index` with `gradient` along the direct paths to each of its parents.

    The tape gives totals: at an ancestor `a`, the sum over all paths to
    `index`. A path from parent `p` either reaches `index` directly or first
    meets another ancestor `k` that `p` is a direct parent of, so the direct
    part is the total at `p` minus the direct VJPs from those `k` of their
    own totals. (No subtraction happens when no such `k` exists, the usual
    case: `z = f(y)`, or a chain of results.)
    """
    ancestors = _ancestors(parents, index)
    totals = replay.gradient(
        [replay.results[index]],
        [replay.results[a] for a in ancestors],
        [gradient],
        tf.UnconnectedGradients.ZERO,
    )
    total = dict(zip(ancestors, totals))
    direct = {}
    for parent in parents[index]:
        value = total[parent]
        for other in ancestors:
            if other != parent and parent in parents[other]:
                value = value - _direct_vjps(replay, parents, other, total[other])[parent]
        direct[parent] = value
    return direct


class BlockGradient:
    """The backward of one block call: `O`'s and each `P_j`'s gradient functions.

    Holds what one backward pass shares between them: the gradients the
    `P_j` passed on, the link terms they sent up, and one recompute.

    Args:
        block_name: for error messages.
        specs: dtype and static shape of each forward result.
        parents: for each result, the results it is directly computed from.
        replay: returns a fresh `Replay` (a recompute) given the first
            incoming gradient and whether the tape must be persistent.
        kept: the forward's own `Replay` when it saved nothing, else None.
        ordered: per source, whether its gradient waits for all the others
            (see NOTE [ Variable gradients wait for the whole backward ]).
    """

    def __init__(
        self,
        block_name: str,
        specs: list[tuple[tf.DType, tf.TensorShape]],
        parents: list[list[int]],
        replay: Callable[[tf.Tensor, bool], Replay],
        kept: Replay | None,
        ordered: list[bool],
    ) -> None:
        self.block_name = block_name
        self.specs = specs
        self.parents = parents
        self._make_replay = replay
        self.kept = kept
        self.ordered = ordered
        self._reset()

    def _reset(self) -> None:
        self.passed: dict[int, tf.Tensor] = {}
        self.links: dict[int, list[tf.Tensor]] = {}
        self.replay: Replay | None = None

    def _replay(self, gradient: tf.Tensor) -> Replay:
        if self.kept is not None:
            return self.kept
        if self.replay is None:
            self.replay = self._make_replay(gradient, any(self.parents))
            check_metadata(self.block_name, self.specs, self.replay.results)
        return self.replay

    def output_backward(self, index: int) -> Callable[..., list[Any]]:
        """The gradient function of `P_index`: marks and passes on, plus the link terms."""

        def backward(gradient: tf.Tensor) -> list[Any]:
            passed = tf.identity(gradient)  # a tensor of its own: see NOTE [ Unconnected ... ]
            self.passed[index] = passed
            if not self.parents[index]:
                return [passed]
            direct = _direct_vjps(self._replay(gradient), self.parents, index, gradient)
            for parent, value in direct.items():
                self.links.setdefault(parent, []).append(value)
            return [passed] + [direct[parent] for parent in self.parents[index]]

        return backward

    def backward(self, *grads: tf.Tensor) -> list[Any]:
        """The gradient function of `O`: the sources' gradients from the marked results."""
        try:
            connected = [j for j, g in enumerate(grads) if _is_marked(self.passed.get(j), g)]
            if not connected:
                return [None] * len(self.ordered)
            own = [
                grads[j] - tf.add_n(self.links[j]) if j in self.links else grads[j]
                for j in connected
            ]
            replay = self._replay(grads[connected[0]])
            source_grads = replay.gradient(
                [replay.results[j] for j in connected],
                replay.sources,
                own,
                tf.UnconnectedGradients.NONE,
            )
            return _ordered(source_grads, self.ordered)
        finally:
            self._reset()


def _is_marked(passed: tf.Tensor | None, gradient: tf.Tensor | None) -> bool:
    """Whether `gradient` is the one a `P_j` passed on (not a tape's zeros)."""
    return passed is not None and gradient is passed


def _ordered(grads: list[Any], ordered: list[bool]) -> list[Any]:
    """The gradients, those marked `ordered` released only after all are computed.

    NOTE [ Variable gradients wait for the whole backward ]
    An optimizer in the same graph updates a variable as soon as its
    gradient exists. Released early, a block's variable gradients let an
    update reach a read in the block's backward, single or nested: freshly
    traced train steps then sometimes trained differently from the unwrapped
    layers (test_block.py test_variable_updates_in_the_same_step_do_not_reach_
    the_recompute). So they are released once every gradient of the block
    is computed; a segment holds them through its backward (the memory model
    counts that: `Chain.applied_grad_bytes`). The state values' gradients
    (a watched frozen variable's) wait too.

    So do the inputs' gradients, for memory: the previous segment's recompute
    starts from them, and released early they let it run while this
    segment's weight gradients, and so the recomputed activations they
    read, are still pending; the memory model assumes one segment's
    backward at a time. benchmarks/backward_order.py measures both rules:
    waiting costs no measurable time (0.96x to 1.02x the CPU time); spikes
    of the early rule (a sqrt plan of 64 Dense layers at 37.8 to 71.5 MiB
    in 3 of 40 measurements instead of 17, once, on a 2-core CPU shared with
    other training processes) did not recur in its runs, quiet or loaded.
    test_block.py test_a_blocks_input_gradient_waits_for_its_weight_gradients
    pins the order. Captured tensors' gradients do not wait.
    """
    if tf.executing_eagerly() or not any(ordered):
        return grads
    present = [g for g in grads if g is not None]
    with tf.control_dependencies(present):
        return [tf.identity(g) if g is not None and wait else g for g, wait in zip(grads, ordered)]
