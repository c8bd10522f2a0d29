"""`RecomputeFrame`: the state of one recomputed call of a block.

A block's training call makes one frame. The frame reads the block's state,
runs the forward, finds what the forward captured and read, attaches the
block's gradient to its results (`backward.BlockGradient`) and puts the
block's outputs back together. What the forward and the recompute must share
(the call's arguments, the values of the state) and what the forward leaves
for the backward are named attributes, not entries of a dict shared by
closures.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import keras
import tensorflow as tf

from tfrecompute._keras_internals import (
    backing_variable,
    build_as_called,
    call_context,
    device_scope,
    direct_sublayers,
    get_keras_mask,
    graph_gradients,
    outside_stateless_scope,
    set_keras_mask,
    should_record_backprop,
    stop_recording,
)
from tfrecompute._messages import fail
from tfrecompute.layers.backward import BlockGradient, Replay
from tfrecompute.layers.custom_gradient import after, attach_gradient, depend_on
from tfrecompute.layers.debug import verify_recompute
from tfrecompute.layers.policy import Policy, Recorder, Replayer, active, boundary
from tfrecompute.layers.state import RecordingStatelessScope, snapshot
from tfrecompute.layers.watch import ForwardWatch, saves_nothing

__all__ = [
    "Forward",
    "RecomputeFrame",
    "build_before_call",
    "in_block_forward",
    "is_float_tensor",
]

_local = threading.local()


def is_float_tensor(value: Any) -> bool:
    """Whether `value` is a floating tensor (what gradients flow to)."""
    return tf.is_tensor(value) and value.dtype.is_floating


def in_block_forward() -> bool:
    """Whether a block's forward is running in this thread (a nested block is a plain call)."""
    return getattr(_local, "depth", 0) > 0


@contextlib.contextmanager
def _block_forward() -> Iterator[None]:
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


def build_before_call(
    layer: keras.layers.Layer, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """Builds `layer`, about to be called by a block's forward, outside the forward's scope.

    Outside a forward (a plain call of the layers) it does nothing: the layer
    builds itself in its `__call__`, as it would unwrapped.
    """
    builders = getattr(_local, "builders", None)
    if builders:
        builders[-1].build_layer(layer, args, kwargs)


@dataclasses.dataclass
class Forward:
    """What the forward run of a frame left.

    Attributes:
        outputs: the outputs as the wrapped layers returned them (released
            once the block's outputs are packed: backprop must not keep them).
        scope: the stateless scope the forward ran in: its state updates and
            losses (released with `outputs`).
        masks: the Keras mask of each flat output (released with `outputs`).
        results: the tensors the caller gets for the floating outputs and
            losses (the forward's own, or the same values with the block's
            gradient attached).
        random_ops: the stateful random ops the forward ran (none are looked
            for when the block's gradient is not attached: nothing replays them).
        attached: whether the block's gradient is attached to the results
            (not when the layers this forward built turn out frozen and no
            tape watches the block's inputs).
    """

    outputs: Any
    scope: RecordingStatelessScope | None
    masks: list[Any] | None
    results: list[tf.Tensor]
    random_ops: list[str]
    attached: bool = True


class RecomputeFrame:
    """One recomputed call: its arguments, the replayed state and the forward's record.

    NOTE [ What crosses the recompute boundary ]
    The block's gradient is taken with respect to its sources: the floating
    tensors among the call's arguments, the floating values of the wrapped
    layers' state (what a tape watching a frozen variable differentiates),
    the tensors the forward captured (NOTE [ Captured tensors ]) and the
    trainable variables it read. The state values are read before the
    forward, under the caller's tapes, and the forward and every recompute
    run on copies of them and of the call's inputs (`execute`; the state
    variables are mapped to their copies by a Keras stateless scope, which
    replays randomness and collects state updates). Everything else (integer
    token ids, boolean masks, Python values, `training`) is held by the frame.
    Only the floating outputs (and losses) get the block's gradient; other
    outputs (and Keras masks) are taken from the forward run, as they carry no
    gradient.

    The trainable variables are read as variables, in the forward and again
    in each recompute, not mapped to tensors: code that sees a variable as a
    variable (a `tf.custom_gradient` reading `self.kernel` in its body finds
    it by watching variable reads) then works as unwrapped. A `ForwardWatch`
    names the variables the forward read.

    Copies carry no Keras mask, and a layer that reads its masks from its
    inputs' `_keras_mask` (the `query_mask` and `value_mask` of
    MultiHeadAttention) would then attend over padding, so `execute` attaches
    each input's mask to its copy.

    NOTE [ Stop only the outer tapes ]
    The forward must not be recorded for backprop by the caller's tapes (they
    would keep its activations to the end of the step), but a tape the wrapped
    layers open themselves must record (a gradient penalty inside a layer).
    TensorFlow can stop all tapes of a thread, not some of them. So the
    forward runs with all tapes active, on copies made under
    `stop_recording()`, which no tape watches: a tape opened inside watches
    what it likes. A caller's tape still records the forward's ops that read
    a variable or a captured tensor it watches, but the block's outputs are
    not those ops' outputs, so backprop never reaches them, and they hold
    nothing past the forward: an eager tape drops an op's record once the
    op's outputs are gone (the forward's are dropped as soon as the block's
    outputs are made), and in a graph a tape's records exist only while it is
    traced.

    NOTE [ Captured tensors ]
    A layer may read a tensor computed outside the block (held on `self`,
    captured by a `Lambda`'s closure). Passed to nothing, it would be a
    constant to the block's gradient, and its own gradient silently lost.
    After the forward the watch names the floating tensors its ops read that
    were neither made by them nor the frame's copies; they become sources
    (JAX's closure conversion, done after the fact), and the recompute's tape
    watches them where the wrapped code reads them.

    Args:
        block: the `RecomputeBlock` being called.
        call: `(inputs, args, kwargs)` of the call.
        training: the call's `training` value.
        mask: the call's incoming Keras mask.
        state_variables: the non-trainable variables the recompute replays
            (see `state.py`).
        loop_weights: in a loop body or cond branch, the block's trainable
            variables, which the recompute reads from the forward's values
            (NOTE [ Blocks in loop bodies ]); empty elsewhere.
        debug: compare every recompute with the forward.
        policy: which products the forward keeps for the recompute (NOTE
            [ Recompute policies ] in `policy.py`), or None for none.
    """

    def __init__(
        self,
        block: keras.layers.Layer,
        call: tuple[Any, tuple[Any, ...], dict[str, Any]],
        *,
        training: Any,
        mask: Any,
        state_variables: list[Any],
        loop_weights: list[Any],
        debug: bool,
        policy: Policy | None = None,
    ) -> None:
        self.block = block
        self.call = call
        self.flat = keras.tree.flatten(call)
        self.float_positions = [i for i, v in enumerate(self.flat) if is_float_tensor(v)]
        self.input_masks = [get_keras_mask(self.flat[i]) for i in self.float_positions]
        self.training = training
        self.mask = mask
        self.state_variables = state_variables
        self.debug = debug
        self.device = device_scope()
        self.state_values = snapshot(state_variables)
        self.loop_weights = loop_weights
        self.loop_values = snapshot(loop_weights)
        self.float_state = [i for i, v in enumerate(self.state_values) if is_float_tensor(v)]
        self.forward: Forward | None = None
        self.captures: list[tf.Tensor] = []
        self.variables: list[Any] = []
        self.policy = policy
        self.products: list[Any] = []
        self._scope: RecordingStatelessScope | None = None  # while the forward runs
        self._watch: ForwardWatch | None = None
        self._built_here = False  # whether the forward built a layer

    # ------------------------------------------------------------ sources

    def own_sources(self) -> list[tf.Tensor]:
        """The call's floating tensors, then the floating state values."""
        return [self.flat[i] for i in self.float_positions] + [
            self.state_values[i] for i in self.float_state
        ]

    def _split(self, values: Sequence[tf.Tensor]) -> tuple[list[Any], list[Any]]:
        """`own_sources`-ordered values as (inputs, full state)."""
        inputs = list(values[: len(self.float_positions)])
        state = list(self.state_values)
        for position, value in zip(self.float_state, values[len(inputs) :]):
            state[position] = value
        return inputs, state

    def execute(
        self,
        values: Sequence[tf.Tensor],
        after: tf.Tensor | None = None,
        weights: Sequence[tf.Tensor] = (),
    ) -> tuple[Any, RecordingStatelessScope]:
        """Runs the wrapped layers on `own_sources`-ordered copies.

        `weights` are values for `loop_weights` (in a loop body's recompute).
        `after` (in a graph-mode recompute) orders everything the frame holds
        after the incoming gradient: see `custom_gradient.after`.
        """
        inputs, state = self._split(values)
        flat = [depend_on(v, after) for v in self.flat]
        for position, value, input_mask in zip(self.float_positions, inputs, self.input_masks):
            if input_mask is not None:
                set_keras_mask(value, depend_on(input_mask, after))
            flat[position] = value
        arguments, args, kwargs = keras.tree.pack_sequence_as(self.call, flat)
        mask = keras.tree.map_structure(lambda m: depend_on(m, after), self.mask)
        state = [depend_on(v, after) for v in state]
        mapping = list(zip(self.state_variables, state)) + list(zip(self.loop_weights, weights))
        with (
            call_context(self.block, self.training),
            RecordingStatelessScope(mapping) as scope,
        ):
            self._scope = scope
            outputs = self.block._run_inner(
                arguments, *args, training=self.training, mask=mask, **kwargs
            )
        return outputs, scope

    @staticmethod
    def differentiable(outputs: Any, scope: RecordingStatelessScope) -> list[tf.Tensor]:
        """The results: floating outputs, then losses."""
        floats = [o for o in keras.tree.flatten(outputs) if is_float_tensor(o)]
        return floats + list(scope.losses)

    # ------------------------------------------------------------ forward

    def run(self) -> Forward:
        """Runs the forward, attaches the block's gradient, and returns the `Forward`."""
        with stop_recording():
            copies = [tf.identity(v) for v in self.own_sources()]
        tape = tf.GradientTape(persistent=True)
        recorder = None if self.policy is None else Recorder(self.block.name, self.policy)
        with _block_forward(), tape, ForwardWatch.around() as watch, active(recorder):
            tape.watch(copies)
            with self._building(watch):
                outputs, scope = self.execute(copies)
        if recorder is not None and recorder.saved:
            self.products = recorder.entries
        results = self.differentiable(outputs, scope)
        self.captures = watch.captures(known=copies)
        self.variables = self._read_variables(watch)
        # Layers built by this forward may turn out frozen (NOTE [ Frozen blocks ]).
        attach = not self._built_here or self._gradient_may_reach()
        kept = None
        if attach and not self.captures and saves_nothing(watch, results):
            backing = [backing_variable(v) for v in self.loop_weights]
            kept = self._kept(tape, results, copies + backing + self.variables)
        self.forward = Forward(
            outputs=outputs,
            scope=scope,
            masks=[get_keras_mask(o) for o in keras.tree.flatten(outputs)],
            results=self._attach(results, watch.direct_parents(results), kept)
            if attach
            else results,
            random_ops=watch.random_ops() if attach else [],
            attached=attach,
        )
        return self.forward

    def _gradient_may_reach(self) -> bool:
        """Whether a gradient may reach the forward: through a tensor it captured, a
        variable it read that the block does not own, or the block's own sources."""
        own = {id(backing_variable(v)) for v in self.block.variables}
        if self.captures or any(id(v) not in own for v in self.variables):
            return True
        return bool(self.block._gradient_may_reach(self.call, self.state_variables))

    @contextlib.contextmanager
    def _building(self, watch: ForwardWatch) -> Iterator[None]:
        """Makes this frame build the layers its forward calls unbuilt."""
        builders = getattr(_local, "builders", None)
        if builders is None:
            builders = _local.builders = []
        builders.append(self)
        self._watch = watch
        try:
            yield
        finally:
            builders.pop()
            self._watch = self._scope = None  # the backward needs neither

    def build_layer(
        self, layer: keras.layers.Layer, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        """Builds a layer the forward is about to call for the first time.

        NOTE [ Layers built by the forward ]
        A layer not built yet creates its variables on its first call. In
        the forward that call comes inside the frame's stateless scope, where
        Keras would leave them uninitialized (each read a fresh draw of the
        initializer). Building the layers beforehand by a symbolic call runs
        each `call()` once more than unwrapped (Python side effects see it,
        and a tensor a layer keeps from that call belongs to a graph that is
        gone: "... is out of scope"). So the forward builds each layer just
        before calling it, as Keras's `__call__` would (`build()` on the
        shapes of its real arguments), outside the scope, unseen by the tapes,
        the forward's watch and the policy recorder. The state variables it
        creates (statistics, frozen weights) are then replayed like the
        others: their values as built are read now, the forward's scope maps
        them, and the recompute reads the same values. Its trainable
        variables are read as variables, so the watch finds them. A layer
        whose build leaves sublayers unbuilt (a `build()` that does not build
        them, or no `build()` at all where tracing fails) is then built by a
        symbolic call of the layer (see `RecomputeBlock._build_symbolically`).
        """
        scope = self._scope
        assert scope is not None and self._watch is not None
        known = {id(v) for v in self.state_variables} | set(scope.state_mapping)
        with outside_stateless_scope(), stop_recording(), self._watch.paused(), boundary():
            build_as_called(layer, args, kwargs)
            if not layer.built or any(not sub.built for sub in direct_sublayers(layer)):
                self.block._build_symbolically(args[0], args[1:], kwargs, layer)
            created = [v for v in layer.non_trainable_variables if id(v) not in known]
            values = snapshot(created)
        for variable, value in zip(created, values):
            scope.state_mapping[id(variable)] = value
            scope.initial_values[id(variable)] = value
        self.state_variables = [*self.state_variables, *created]
        self.state_values = [*self.state_values, *values]
        self._built_here = True

    def _attach(
        self, results: list[tf.Tensor], parents: list[list[int]], kept: Replay | None
    ) -> list[tf.Tensor]:
        """The results with the block's gradient attached (NOTE in `backward.py`)."""
        own = self.own_sources()
        reads = [tf.convert_to_tensor(v) for v in self.variables]
        sources = own + self.loop_values + self.captures + reads
        eager = tf.executing_eagerly()
        active = [i for i, s in enumerate(sources) if not eager or should_record_backprop([s])]
        if not active:
            return results
        captured = len(own) + len(self.loop_values)
        captures = range(captured, captured + len(self.captures))
        gradient = BlockGradient(
            self.block.name,
            specs=[(r.dtype, r.shape) for r in results],
            parents=parents,
            replay=lambda g, persistent: self._select(self.recompute(g, persistent), active),
            kept=None if kept is None else self._select(kept, active),
            ordered=[i not in captures for i in active],
        )
        hidden = attach_gradient(results, [sources[i] for i in active], gradient.backward)
        outputs: list[tf.Tensor | None] = [None] * len(results)
        for index in _topological(parents):
            links = [outputs[p] for p in parents[index]]
            (outputs[index],) = attach_gradient(
                [hidden[index]],
                [hidden[index], *links],
                gradient.output_backward(index),
                op_type="RecomputeBlockOutput",
            )
        return [o for o in outputs if o is not None]

    def _read_variables(self, watch: ForwardWatch) -> list[Any]:
        """The trainable variables the forward read, other than `loop_weights`.

        NOTE [ Blocks in loop bodies ]
        In the gradient of a `tf.while_loop` (or `tf.scan`, or a Keras RNN
        under `tf.function`) a variable read again in the recompute fails
        ("... is in list of internal_captures but not in
        internal_capture_to_output"): the loop's gradient can only use
        tensors of the forward's body. So there the recompute reads the
        block's weights from values read before the forward (`loop_weights`),
        mapped by the stateless scope. Two things then cannot be replayed and
        raise: a variable the block does not own (the recompute would read
        it again), and a `tf.custom_gradient` whose body reads a variable
        (given the mapped value, it would no longer see a variable, and its
        gradient for it would be lost).
        """
        found = list(watch.variables)
        if not self.loop_weights:
            return found
        owned = {id(backing_variable(v)) for v in self.loop_weights}
        foreign = [v for v in found if id(v) not in owned]
        if foreign or watch.custom_gradients_of_variables():
            what = (
                f"the wrapped layers read variables the block does not own ({foreign[0].name})"
                if foreign
                else "a tf.custom_gradient inside reads a variable in its body"
            )
            fail(
                f"RecomputeBlock '{self.block.name}'",
                f"{what}, which a recompute inside a loop body (tf.while_loop, tf.scan, an "
                "RNN cell under tf.function) cannot replay",
                "layers",
                self.block.unwrap(),
                "Pass such variables to the layers as arguments or weights of layers in the "
                "block, or keep that layer (or the block) out of the loop",
            )
        return []

    @staticmethod
    def _kept(tape: tf.GradientTape, results: list[tf.Tensor], sources: list[Any]) -> Replay:
        """The forward itself, to differentiate instead of a recompute (NOTE [ Early stop ])."""
        if tf.executing_eagerly():
            return Replay.of_tape(tape, results, sources)
        graph = tf.compat.v1.get_default_graph()
        leaves = [s for s in sources if isinstance(s, tf.Tensor)]

        def gradient(targets: Any, sources: Any, output_gradients: Any, unconnected: Any) -> Any:
            return graph_gradients(targets, sources, output_gradients, unconnected, graph, leaves)

        return Replay(gradient, results, sources)

    @staticmethod
    def _select(replay: Replay, active: list[int]) -> Replay:
        return Replay(replay.gradient, replay.results, [replay.sources[i] for i in active])

    # ------------------------------------------------------------ backward

    def recompute(self, gradient: tf.Tensor, persistent: bool) -> Replay:
        """Runs the forward again under a local tape, in the forward's device scope."""
        device = tf.device(self.device) if self.device else contextlib.nullcontext()
        with device, tf.GradientTape(persistent=persistent) as tape:
            dependency = None if tf.executing_eagerly() else after(gradient)
            copies = [depend_on(tf.identity(v), dependency) for v in self.own_sources()]
            with tf.control_dependencies([] if dependency is None else [dependency]):
                # An Identity aliases; `w + 0` would allocate a copy of every weight.
                weights = [tf.identity(v) for v in self.loop_values]
            tape.watch(copies + weights)
            tape.watch(self.captures)
            tape.watch(self.variables)
            name = self.block.name
            replayer = Replayer(name, self.products, dependency) if self.products else None
            with active(replayer):
                outputs, scope = self.execute(copies, dependency, weights)
            results = self.differentiable(outputs, scope)
            if self.debug:
                assert self.forward is not None
                results = verify_recompute(self.block.name, self.forward.results, results)
        return Replay.of_tape(tape, results, copies + weights + self.captures + self.variables)

    def pack(self) -> tuple[Any, list[tf.Tensor]]:
        """The block's outputs and its losses.

        Non-floating outputs come from the forward; each output gets the mask
        the layers attached to it. Releases the forward's outputs, scope and
        masks: the backward pass needs none of them.
        """
        forward = self.forward
        assert forward is not None and forward.masks is not None and forward.scope is not None
        split = len(forward.results) - len(forward.scope.losses)
        floats, losses = list(forward.results[:split]), list(forward.results[split:])
        flat_outputs = keras.tree.flatten(forward.outputs)
        merged = [floats.pop(0) if is_float_tensor(o) else o for o in flat_outputs]
        for tensor, output_mask in zip(merged, forward.masks):
            if output_mask is not None:
                set_keras_mask(tensor, output_mask)
        packed = keras.tree.pack_sequence_as(forward.outputs, merged)
        if not self.debug:
            forward.results = []
        forward.outputs = forward.masks = None
        return packed, losses


def _topological(parents: Sequence[Sequence[int]]) -> list[int]:
    """The result indices, each after the results it is computed from."""
    order: list[int] = []

    def visit(index: int) -> None:
        if index in order:
            return
        for parent in parents[index]:
            visit(parent)
        order.append(index)

    for index in range(len(parents)):
        visit(index)
    return order
