"""A plan applied to a model: the one place above `layers/` that builds `RecomputeBlock`s.

`rewrite(graph, segments)` applies segments of the graph's calls:

* A segment of graph calls (calls of the model's Functional or Sequential
  graph, nested Functional models inlined) becomes a `RecomputeBlock`
  around a Functional sub-model of those calls, in a new model that shares
  the original's layers and variables. The sub-model's inputs are the
  tensors the segment consumes from before it, its outputs the tensors later
  calls (or the model's outputs) need from it; tensors that only pass by a
  segment (a U-Net's long skip) go around its block. A Sequential model
  gets a Sequential back, its blocks wrapping lists of layers.
* A Functional model that a subclassed layer's code calls is a region of
  its own: it is rebuilt the same way, and its `call` routed in place to the
  rebuilt model (NOTE [ In-place checkpoints ] in `layers/in_place.py`).
* A segment of one call made by a subclassed layer's code is checkpointed
  in place: the layer object stays, so this also holds wherever else it is
  used, the original model included. A subclassed model gets itself back,
  changed in place; a Functional model a new one, whose subclassed layers
  (shared with the original) are changed in place.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import keras

from tfrecompute import strategies
from tfrecompute._keras_internals import functional_inputs
from tfrecompute._messages import fail
from tfrecompute.graph import Call, LayerGraph, Region, Unit
from tfrecompute.layers import RecomputeBlock
from tfrecompute.layers.in_place import checkpoint_in_place, route_call

__all__ = ["block_policies", "rewrite"]


def rewrite(
    graph: LayerGraph,
    segments: Sequence[tuple[int, int]],
    *,
    name: str | None = None,
    policies: Sequence[Any] | None = None,
) -> keras.Model:
    """The model with each range of calls recomputed (see the module docstring).

    Args:
        graph: the layer graph of the model to rewrite.
        segments: sorted, disjoint half-open ranges `(start, stop)` of call
            indices: runs of graph calls of one region, or single calls made
            by a subclassed layer's code.
        name: the new model's name; `<model name>_recompute` by default.
        policies: the recompute policy of each segment's block (see
            `RecomputeBlock`); None for none.

    Returns:
        The model itself for a subclassed model; else a new `keras.Sequential`
        for a Sequential model whose calls are all its own layers, or a new
        Functional `keras.Model`.
    """
    starts: dict[int, int] = {}
    policy_at: dict[int, Any] = {}
    for (start, stop), policy in zip(segments, policies or [None] * len(segments)):
        policy_at[start] = policy
        if graph.calls[start].in_place:
            checkpoint_in_place(graph.calls[start].layer, policy=policy)
        else:
            starts[start] = stop
    # Block names become TensorFlow name scopes: no "#" or "/" from call names.
    names = [n.replace("#", "_call").replace("/", "_") for n in graph.names]
    root = graph.root
    for region in _regions(graph):
        if region is root or not any(graph.calls[k].region is region for k in starts):
            continue
        replacement = _rebuild(
            graph, region, (starts, policy_at), names, f"{region.model.name}_recompute"
        )
        route_call(region.model, replacement)
    if root is None:
        return graph.model  # a subclassed model, checkpointed in place
    if graph.sequential:
        return _rewrite_sequential(
            graph, (starts, policy_at), names, name or f"{graph.model.name}_recompute"
        )
    rebuilt = _rebuild(
        graph, root, (starts, policy_at), names, name or f"{graph.model.name}_recompute"
    )
    _warn_if_unloadable(rebuilt)
    return rebuilt


def block_policies(api: str, plan: strategies.Plan, policy: Any) -> list[Any]:
    """Each segment's policy, for `rewrite(..., policies=...)`.

    A plan that weighed the third state (`optimal` on a chain with policy
    costs) says per segment (`Plan.selective`); any other plan's blocks all
    get `policy`: the user chose the segments and asked for the policy.
    """
    weighed = bool(plan.selective) or (plan.chain.has_policy and plan.strategy == "optimal")
    if not weighed:
        return [policy] * len(plan.segments)
    if policy is None:
        fail(
            api,
            "the plan recomputes segments under a recompute policy, but no policy is given",
            "policy",
            policy,
            f"Pass the policy the plan was made with, e.g. {api}(model, plan, policy='dots')",
        )
    return [policy if plan.is_selective(i) else None for i in range(len(plan.segments))]


def _warn_if_unloadable(model: keras.Model) -> None:
    """NOTE [ A layer in two blocks ]

    A layer called in two segments (ALBERT's one transformer layer, applied
    at every depth) sits in two blocks' sub-models, or in one and in the
    model around it. Training is exact, and `save_weights`/`load_weights`
    round-trip, but Keras 3.15 cannot load a `.keras` file in which one
    layer is shared between nested Functional models ("Output with path ``
    is not connected to `inputs`"), with or without blocks. Saying so now
    beats finding out when loading a trained model.
    """
    owners: dict[int, set[str]] = {}
    names: dict[int, str] = {}
    containers = [model]
    while containers:
        container = containers.pop()
        for layer in container.layers:
            if isinstance(layer, RecomputeBlock):
                containers += [inner for inner in layer.layers if isinstance(inner, keras.Model)]
                continue
            owners.setdefault(id(layer), set()).add(container.name)
            names[id(layer)] = layer.name
    shared = sorted(names[key] for key, found in owners.items() if len(found) > 1)
    if shared:
        more = f" (and {len(shared) - 1} more)" if len(shared) > 1 else ""
        warnings.warn(
            f"recompute: layer {shared[0]!r}{more} is called in more than one block, or in "
            "a block and outside it. Training is exact, but Keras cannot load such a model "
            "from a .keras file. Save and load its weights instead (model.save_weights, "
            "then load_weights into the same model rewritten by the same plan).",
            stacklevel=4,
        )


def _regions(graph: LayerGraph) -> list[Region]:
    """The regions of the graph's calls, outermost first."""
    found: dict[int, Region] = {}
    for call in graph.calls:
        if call.region is not None:
            found.setdefault(id(call.region), call.region)
    return list(found.values())


Segments = tuple[dict[int, int], dict[int, Any]]
"""The segments by start: their stop, and their block's policy."""


def _rebuild(
    graph: LayerGraph, region: Region, segments: Segments, names: list[str], name: str
) -> keras.Model:
    """A Functional model computing `region` from its model's inputs, with the blocks placed."""
    starts, policy_at = segments
    model = region.model
    mapping: dict[int, Any] = dict(zip(map(id, region.inputs), functional_inputs(model)))
    replayed: set[int] = set()
    index = 0
    while index < len(graph.calls):
        anchor = graph.calls[index].anchor(region)
        if isinstance(anchor, Unit):
            if id(anchor) not in replayed:
                replayed.add(id(anchor))
                _replay(anchor, mapping)
            index += 1
        elif anchor is None:
            index += 1
        elif index in starts:
            stop = starts[index]
            block_name = f"recompute_{names[index]}"
            _apply_block(graph, (index, stop), block_name, mapping, policy_at[index])
            index = stop
        else:
            _replay(anchor, mapping)
            index += 1
    outputs = keras.tree.map_structure(lambda t: mapping[id(t)], region.structure)
    # A Sequential's graph starts at its inner functional inputs, not its own Input.
    inputs = functional_inputs(model)[0] if isinstance(model, keras.Sequential) else model.input
    return keras.Model(inputs, outputs, name=name)


def _rewrite_sequential(
    graph: LayerGraph, segments: Segments, names: list[str], name: str
) -> keras.Sequential:
    # A Sequential's graph also holds the ops its layers' masks are computed
    # with (an Embedding's `not_equal`); the Sequential runs those itself, so
    # only its layers are placed.
    starts, policy_at = segments
    placed = [isinstance(c.layer, keras.layers.Layer) for c in graph.calls]
    layers: list[keras.layers.Layer] = []
    index = 0
    while index < len(graph.calls):
        stop = starts.get(index, index + 1)
        members = [k for k in range(index, stop) if placed[k]]
        if index in starts and members:
            block_layers = [graph.calls[k].layer for k in members]
            block_name = f"recompute_{names[members[0]]}"
            layers.append(RecomputeBlock(block_layers, policy=policy_at[index], name=block_name))
        else:
            layers += [graph.calls[k].layer for k in members]
        index = stop
    source = graph.model.inputs[0]
    return keras.Sequential(
        [keras.Input(batch_shape=source.shape, dtype=source.dtype), *layers], name=name
    )


def _substituted(structure: Any, mapping: dict[int, Any]) -> Any:
    def substitute(value: Any) -> Any:
        return mapping[id(value)] if isinstance(value, keras.KerasTensor) else value

    return keras.tree.map_structure(substitute, structure)


def _replay(call: Call | Unit, mapping: dict[int, Any]) -> None:
    """Calls a node's operation again on the tensors `mapping` gives for its arguments."""
    operation = call.layer if isinstance(call, Call) else call.node.operation
    args = _substituted(call.args, mapping)
    kwargs = _substituted(call.kwargs, mapping)
    outputs = keras.tree.flatten(operation(*args, **kwargs))
    for original, new in zip(call.outputs, outputs):
        mapping[id(original)] = new


def _no_mask_of_its_own(inputs: Any, previous_mask: Any = None) -> None:
    """`compute_mask` of a segment's sub-model: its outputs carry their layers' masks."""
    return None


def _apply_block(
    graph: LayerGraph, segment: tuple[int, int], name: str, mapping: dict[int, Any], policy: Any
) -> None:
    """Wraps calls [start, stop) in a block called on the mapped tensors; maps its outputs."""
    start, stop = segment
    input_ids, output_ids = graph.segment_io(start, stop)
    inner: dict[int, Any] = {}
    sub_inputs = []
    for key in input_ids:
        outer = mapping[key]  # the rewritten model's tensor: its shape, unknown dims included
        sub_input = keras.Input(batch_shape=outer.shape, dtype=outer.dtype)
        inner[key] = sub_input
        sub_inputs.append(sub_input)
    for index in range(start, stop):
        _replay(graph.calls[index], inner)
    sub_outputs = [inner[key] for key in output_ids]
    sub_model = keras.Model(
        sub_inputs if len(sub_inputs) != 1 else sub_inputs[0],
        sub_outputs if len(sub_outputs) != 1 else sub_outputs[0],
        name=f"{name}_layers",
    )
    # A Functional model hands its input masks to its layers, and their
    # output masks stay on its outputs, yet Keras warns that it "will
    # destroy the mask" when given a masked input, as it lacks
    # `supports_masking`. The segment's masks are its layers' own: it
    # supports masking and adds none.
    sub_model.supports_masking = True
    sub_model.compute_mask = _no_mask_of_its_own
    block = RecomputeBlock(sub_model, policy=policy, name=name)
    block_inputs = [mapping[key] for key in input_ids]
    results = block(block_inputs if len(block_inputs) != 1 else block_inputs[0])
    for key, result in zip(output_ids, keras.tree.flatten(results)):
        mapping[key] = result
