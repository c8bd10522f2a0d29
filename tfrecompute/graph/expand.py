"""Any Keras model as the chain of calls a plan chooses among: its call tree, expanded.

NOTE [ Expanding the call tree ]
`trace.trace_model` records every call of one traced forward. The planner
sees the leaves of that tree after expanding it from the root down:

* A Functional or Sequential model (the root, or one called by one) is
  expanded into its node calls. Its node calls replay on new tensors, so a
  rewrite can group any run of them into a block, across nested models
  (their nodes are inlined into the rewritten model): "graph" calls. A
  nested model's inputs pair with what it was given as `Functional.call`
  pairs them, positionally or by the keyword `inputs=` (keras-hub's
  `Gemma3CausalLM` calls `backbone(inputs=inputs)`), a dict by name.
* A subclassed layer whose call runs sub-layers is expanded into those
  sub-layer calls when every tensor they take is one its call received or
  one an earlier sub-layer call returned, and it returns only such tensors:
  a container such as keras-hub's `ViTEncoder`, which loops over its
  blocks, or HGNetV2's stages. It is expanded only while some sub-layer
  itself runs sub-layers: a layer whose sub-layers are all single calls
  (HGNetV2's conv, norm and activation layer; its stem) stays one call,
  since a call in code is recomputed alone (below), and one such call
  recomputed saves nothing its neighbours do not keep anyway. A Functional
  or Sequential model that such code calls is kept whole: the user's own
  grouping, recomputed as one block. Its Python code cannot be rebuilt, so a
  sub-layer call is checkpointed in place, one call at a time, and only if
  its layer is called once in the whole model: "in-place" calls. A layer
  whose call computes between its sub-layer calls (a residual block) stays
  one call: the natural block to recompute whole.
* A subclassed root model is always expanded (there is nothing else to
  plan), and so is every layer on the way to a layer `where` selects. There,
  the tensors its code computes between sub-layer calls become "glue"
  calls, found by walking the traced graph back to the tensors they are made
  from; glue is never recomputed.
* A `RecomputeBlock` already in the model is never expanded: it is one call,
  which the planner does not place inside another block.

`depth` bounds the expansion (0: the root's own calls only); `where`
replaces the rule for subclassed layers by the user's selection.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf

from tfrecompute._keras_internals import (
    functional_inputs,
    functional_nodes,
    functional_outputs,
    is_functional,
)
from tfrecompute._messages import fail
from tfrecompute.graph.call_tree import (
    TracedCall,
    TracedOps,
    flat_tensors,
    forward_digest,
    is_traced_tensor,
)
from tfrecompute.graph.layer_graph import (
    Call,
    LayerGraph,
    Region,
    Unit,
    call_signature,
    declared_input,
    declared_output,
)
from tfrecompute.layers import RecomputeBlock

__all__ = ["Selection", "expand", "selected", "selection"]

Selection = Callable[[Any], bool]
"""`where` as a predicate on layers."""

_GLUE_WALK = 10_000  # graph ops a glue walk may visit


class _Glue:
    """The operation of a glue call: tensors a layer's own code computes (never recomputed)."""

    trainable_variables: list[Any] = []

    def __init__(self, name: str) -> None:
        self.name = name


@dataclasses.dataclass
class _Expander:
    depth: int | None
    where: Selection | None
    counts: dict[int, int]  # calls of each layer object in the whole trace
    calls: list[Call] = dataclasses.field(default_factory=list)
    proxies: dict[Any, keras.KerasTensor] = dataclasses.field(default_factory=dict)
    traced: dict[int, TracedOps | None] = dataclasses.field(default_factory=dict)  # by id(Call)

    def proxy(self, tensor: tf.Tensor) -> keras.KerasTensor:
        """The KerasTensor standing for a traced tensor (one per tensor)."""
        key = tensor.ref()
        if key not in self.proxies:
            dtype = keras.backend.standardize_dtype(tensor.dtype)
            self.proxies[key] = keras.KerasTensor(tuple(tensor.shape), dtype=dtype)
        return self.proxies[key]

    def fresh(self, tensor: tf.Tensor) -> keras.KerasTensor:
        """A new proxy for a graph call's output (a layer may return its input as is)."""
        dtype = keras.backend.standardize_dtype(tensor.dtype)
        proxy = keras.KerasTensor(tuple(tensor.shape), dtype=dtype)
        self.proxies.setdefault(tensor.ref(), proxy)
        return proxy

    def expands(self, call: TracedCall, level: int) -> bool:
        """Whether `call` (at `level`, the root's calls at 1) is expanded into its calls."""
        layer = call.operation
        if not call.children or isinstance(layer, RecomputeBlock):
            return False
        if self.depth is not None and level > self.depth:
            return False
        if self.where is not None:
            return not selected(self.where, layer) and _contains(self.where, call)
        if isinstance(layer, keras.Model) and is_functional(layer):
            return _nodes_match(call)
        # A layer that only runs keras.ops (ZeroPadding2D's pad) is one call,
        # and so is one whose sub-layers are all single calls (NOTE [ Expanding
        # the call tree ]: a block of conv, norm and activation layers).
        return any(_composite(c) for c in call.children) and _glue_free(call)

    # -------------------------------------------------------------- graph calls

    def graph(self, call: TracedCall, model: keras.Model, known: dict[int, Any], level: int,
              path: str, region: Region) -> None:  # fmt: skip
        """Expands a Functional or Sequential model's call into its node calls.

        `known` maps the model's symbolic tensors (by id) to proxies: its
        inputs on entry, its node outputs as they are made. Nested Functional
        models' calls join `region`.
        """
        nodes = [node for node in functional_nodes(model) if not node.is_input]
        for node, child in zip(nodes, call.children):
            args = _substitute(node.arguments.args, known)
            kwargs = _substitute(node.arguments.kwargs, known)
            produced = flat_tensors(child.outputs)
            layer = node.operation
            sub_path = f"{path}{layer.name}/"
            if not self.expands(child, level + 1):
                outputs = [self.fresh(t) for t in produced]
                call_ = Call(layer, args, kwargs, outputs=outputs, node=node, region=region)
                self.calls.append(dataclasses.replace(call_, level=level, path=path))
                self.traced[id(self.calls[-1])] = child.traced_ops
            elif isinstance(layer, keras.Model) and is_functional(layer):
                passed = _flat_proxies(_model_inputs(layer, args, kwargs))
                inner = dict(zip(map(id, functional_inputs(layer)), passed))
                self.graph(child, layer, inner, level + 1, sub_path, region)
                outputs = [inner[id(t)] for t in functional_outputs(layer)]
            else:
                unit = Unit(node=node, args=args, kwargs=kwargs, region=region)
                received = _received_proxies(child, args, kwargs)
                self.in_code(child, unit, received, level + 1, sub_path)
                outputs = unit.outputs = [self.proxies[t.ref()] for t in produced]
            known.update(zip(map(id, node.outputs), outputs))

    # ---------------------------------------------------------- calls in code

    def in_code(self, call: TracedCall, unit: Unit, received: dict[Any, Any], level: int,
                path: str) -> None:  # fmt: skip
        """Expands a subclassed layer's call into its sub-layer calls (and glue).

        `received` maps the tensors its `call` received (by ref) to proxies.
        A Functional model called once there becomes a region of its own.
        """
        self.proxies.update(received)
        for child in call.children:
            self.glue_for(flat_tensors((child.args, child.kwargs)), call, unit, level, path)
            passed = _substitute_refs((child.args, child.kwargs), self.proxies)
            layer = child.operation
            sub_path = f"{path}{child.name}/"
            if not self.expands(child, level + 1):
                outputs = [self.proxy(t) for t in flat_tensors(child.outputs)]
                call_ = Call(layer, *passed, outputs=outputs, unit=unit, level=level, path=path)
                self.calls.append(call_)
                self.traced[id(call_)] = child.traced_ops
            elif isinstance(layer, keras.Model) and is_functional(layer):
                self.model_in_code(child, unit, passed, level + 1, sub_path)
            else:
                self.in_code(child, unit, _received_proxies(child, *passed), level + 1, sub_path)
        self.glue_for(flat_tensors(call.outputs), call, unit, level, path)

    def model_in_code(self, call: TracedCall, unit: Unit, passed: Any, level: int,
                      path: str) -> None:  # fmt: skip
        """A Functional model that code calls: its own region, rebuilt and routed in place."""
        model = call.operation
        received = _received_proxies(call, *passed)
        got = _model_inputs(model, *(call.received or (call.args, call.kwargs)))
        inputs = [received[t.ref()] for t in flat_tensors(got)]
        region = Region(model, inputs=inputs, unit=unit, alone=self.counts[id(model)] == 1)
        known = dict(zip(map(id, functional_inputs(model)), inputs))
        self.graph(call, model, known, level, path, region)
        region.outputs = [known[id(t)] for t in functional_outputs(model)]
        region.structure = keras.tree.pack_sequence_as(declared_output(model), region.outputs)
        for tensor, proxy in zip(flat_tensors(call.outputs), region.outputs):
            self.proxies[tensor.ref()] = proxy

    def glue_for(
        self, tensors: list[tf.Tensor], parent: TracedCall, unit: Unit, level: int, path: str
    ) -> None:
        """Adds a glue call for each of `tensors` no call made (a layer's own computation)."""
        for tensor in tensors:
            if tensor.ref() in self.proxies:
                continue
            sources = _sources(tensor, set(self.proxies))
            self.calls.append(
                Call(
                    _Glue(f"{parent.name}_ops"),
                    tuple(self.proxies[s.ref()] for s in sources),
                    {},
                    outputs=[self.proxy(tensor)],
                    unit=unit,
                    level=level,
                    path=path,
                    glue=True,
                )
            )


def expand(
    model: keras.Model,
    root: TracedCall,
    *,
    depth: int | None = None,
    where: Selection | None = None,
) -> LayerGraph:
    """The layer graph of `model` from its traced call tree (NOTE [ Expanding the call tree ]).

    Args:
        model: the model traced.
        root: `trace.trace_model(model, ...)`.
        depth: how many levels below the root's own calls to expand (None: all).
        where: a predicate selecting the layers whose calls to make blocks of;
            their calls are leaves, and every layer on the way to one is expanded.
    """
    expander = _Expander(depth, where, _call_counts(root))
    if is_functional(model) and _nodes_match(root):
        passed = _model_inputs(model, root.args, root.kwargs)
        inputs = [expander.proxy(t) for t in flat_tensors(passed)]
        region = Region(model, inputs=inputs)
        known = dict(zip(map(id, functional_inputs(model)), inputs))
        expander.graph(root, model, known, 1, "", region)
        region.outputs = [known[id(t)] for t in functional_outputs(model)]
        region.structure = keras.tree.pack_sequence_as(declared_output(model), region.outputs)
        outputs, structure, root_region = region.outputs, region.structure, region
    else:  # a subclassed model: its own calls are checkpointed in place
        inputs = [expander.proxy(t) for t in flat_tensors(root.received)]
        unit = Unit(node=None, args=(), kwargs={})
        expander.in_code(root, unit, {}, 1, "")
        unit.outputs = outputs = [expander.proxies[t.ref()] for t in flat_tensors(root.outputs)]
        structure = keras.tree.map_structure(
            lambda t: expander.proxies[t.ref()] if is_traced_tensor(t) else t, root.outputs
        )
        root_region = None
    _digest_twins(expander.calls, expander.traced)
    return LayerGraph(
        model,
        expander.calls,
        inputs=inputs,
        outputs=outputs,
        structure=structure,
        root=root_region,
    )


# ------------------------------------------------------------------- helpers


def selection(api: str, where: Any) -> Selection | None:
    """`where` as a predicate: a layer class, a tuple of classes, layer names, or a predicate."""
    if where is None:
        return None
    if isinstance(where, type) or (
        isinstance(where, tuple) and where and all(isinstance(w, type) for w in where)
    ):
        classes = where
        return lambda layer: isinstance(layer, classes)
    if isinstance(where, (list, set, frozenset)) and all(isinstance(w, str) for w in where):
        names = set(where)
        return lambda layer: layer.name in names
    if callable(where) and not isinstance(where, str):
        return where
    fail(
        api,
        "`where` must be a layer class, a tuple of classes, a list of layer names or a "
        "predicate (layer) -> bool",
        "where",
        where,
        "Pass e.g. where=keras_hub.layers.TransformerEncoder or where=['block_0', 'block_1']",
        error=TypeError,
    )


def selected(where: Selection, layer: Any) -> bool:
    """Whether `where` selects `layer` (only layers are selected, never plain operations)."""
    return isinstance(layer, keras.layers.Layer) and bool(where(layer))


# ------------------------------------------------------------------- helpers


def _call_counts(root: TracedCall) -> dict[int, int]:
    """How many times the trace calls each layer or operation object."""
    counts: dict[int, int] = {}
    pending = [root]
    while pending:
        call = pending.pop()
        counts[id(call.operation)] = counts.get(id(call.operation), 0) + 1
        pending.extend(call.children)
    return counts


def _contains(where: Selection, call: TracedCall) -> bool:
    return any(selected(where, c.operation) or _contains(where, c) for c in call.children)


def _nodes_match(call: TracedCall) -> bool:
    """Whether a Functional model's recorded calls are its nodes, in order."""
    model = call.operation
    if not is_functional(model):
        return False
    nodes = [node for node in functional_nodes(model) if not node.is_input]
    return len(nodes) == len(call.children) and all(
        node.operation is child.operation for node, child in zip(nodes, call.children)
    )


def _composite(call: TracedCall) -> bool:
    """Whether `call` is a layer's call that runs sub-layers."""
    layer = call.operation
    return isinstance(layer, keras.layers.Layer) and any(
        isinstance(c.operation, keras.layers.Layer) for c in call.children
    )


def _glue_free(call: TracedCall) -> bool:
    """Whether `call`'s sub-layer calls take and give only each other's and its own tensors.

    Tensors its code makes from shapes alone (DeiT's encoder returns empty
    placeholders `ops.empty((0, seq_len, hidden))` beside its output) are no
    computation to keep or recompute, and do not count.
    """
    known = {t.ref() for t in flat_tensors(call.received)}
    for child in call.children:
        if not all(_known_or_shaped(t, known) for t in flat_tensors((child.args, child.kwargs))):
            return False
        known.update(t.ref() for t in flat_tensors(child.outputs))
    return all(_known_or_shaped(t, known) for t in flat_tensors(call.outputs))


_SHAPE_OPS = frozenset({"Shape", "ShapeN", "Size", "Rank"})


def _known_or_shaped(tensor: tf.Tensor, known: set[Any]) -> bool:
    """Whether `tensor` is known, or made from no tensor's values (shapes and constants)."""
    if tensor.ref() in known:
        return True
    seen: set[Any] = set()
    pending = [tensor]
    while pending:
        current = pending.pop()
        if isinstance(current, tf.__internal__.EagerTensor):
            continue  # a constant the traced code was given
        if current.ref() in seen or current.op.type in _SHAPE_OPS:
            continue
        seen.add(current.ref())
        if current.ref() in known or len(seen) > _GLUE_WALK:
            return False  # reads a value the call received or a sub-layer made
        if current.op.type in ("Placeholder", "VarHandleOp", "ReadVariableOp"):
            return False
        pending.extend(current.op.inputs)
    return True


def _substitute(structure: Any, known: dict[int, Any]) -> Any:
    """`structure` with each KerasTensor replaced by its proxy in `known` (by id)."""

    def swap(value: Any) -> Any:
        return known[id(value)] if isinstance(value, keras.KerasTensor) else value

    return keras.tree.map_structure(swap, structure)


def _substitute_refs(structure: Any, proxies: dict[Any, Any]) -> Any:
    """`structure` with each traced tensor replaced by its proxy (by ref)."""

    def swap(value: Any) -> Any:
        return proxies[value.ref()] if is_traced_tensor(value) else value

    return keras.tree.map_structure(swap, structure)


def _model_inputs(model: keras.Model, args: Any, kwargs: dict[str, Any]) -> list[Any]:
    """A Functional model's call arguments as the flat list of its inputs, in their order.

    The inputs are the first positional argument or the keyword `inputs`
    (keras-hub tasks call their backbone as `backbone(inputs=inputs)`), and
    they pair with `functional_inputs(model)` as `Functional.call` pairs
    them: flattened, or, for a dict given to a model declared with a list
    of inputs, taken by the inputs' names.
    """
    passed = args[0] if args else kwargs.get("inputs")
    declared = declared_input(model)
    if isinstance(passed, dict) and not isinstance(declared, dict):
        names = [getattr(t, "name", None) for t in keras.tree.flatten(declared)]
        if all(name in passed for name in names):
            return [passed[name] for name in names]
    return list(keras.tree.flatten(passed))


def _flat_proxies(structure: Any) -> list[keras.KerasTensor]:
    return [t for t in keras.tree.flatten(structure) if isinstance(t, keras.KerasTensor)]


def _received_proxies(call: TracedCall, args: Any, kwargs: dict[str, Any]) -> dict[Any, Any]:
    """The proxies of the tensors `call` received, from those its caller passed (`args`).

    Keras converts a layer's arguments position by position (a cast under a
    mixed policy) before its `call` sees them; the received tensor at a
    position stands for the passed one.
    """
    received_args, received_kwargs = call.received or (call.args, call.kwargs)
    pairs = list(zip(keras.tree.flatten(args), keras.tree.flatten(received_args)))
    for key, value in kwargs.items():
        if key in received_kwargs:
            pairs += zip(keras.tree.flatten(value), keras.tree.flatten(received_kwargs[key]))
    return {
        got.ref(): passed
        for passed, got in pairs
        if isinstance(passed, keras.KerasTensor) and is_traced_tensor(got)
    }


def _sources(tensor: tf.Tensor, known: set[Any]) -> list[tf.Tensor]:
    """The known tensors `tensor` is computed from, walking its traced graph back."""
    found: dict[Any, tf.Tensor] = {}
    seen: set[Any] = set()
    pending = list(tensor.op.inputs)
    while pending and len(seen) < _GLUE_WALK:
        current = pending.pop()
        if current.ref() in seen:
            continue
        seen.add(current.ref())
        if current.ref() in known:
            found[current.ref()] = current
        else:
            pending.extend(current.op.inputs)
    return list(found.values())


def _digest_twins(calls: list[Call], traced: dict[int, TracedOps | None]) -> None:
    """Sets `forward_digest` on each call of a layer that has a possible twin: another layer
    of its class called on the same input specs (NOTE [ Calls that cost the same ])."""
    layers: dict[tuple[Any, ...], set[int]] = {}
    for call in calls:
        layers.setdefault((type(call.layer), call_signature(call)), set()).add(id(call.layer))
    listed: dict[int, list[Any]] = {}  # each traced graph's ops, listed once
    for call in calls:
        ops = traced.get(id(call))
        if ops is None or call.glue or len(layers[(type(call.layer), call_signature(call))]) < 2:
            continue
        if id(ops.graph) not in listed:
            listed[id(ops.graph)] = ops.graph.get_operations()
        if len(listed[id(ops.graph)]) == ops.graph.version:  # what `TracedOps` relies on
            call.forward_digest = forward_digest(ops, listed[id(ops.graph)])
