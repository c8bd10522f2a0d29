"""A plan applied to a model: the one place above `layers/` that builds `RecomputeBlock`s.

`apply(graph, segments)` checkpoints segments of the graph's calls in the
model itself (NOTE [ A checkpointed model is the model ] in
`layers/in_place.py`):

* A segment of graph calls (calls of the model's Functional or Sequential
  graph, nested Functional models inlined) becomes a `RecomputeBlock`
  around a Functional sub-model of those calls, in a rebuilt model that
  shares the model's layers and variables and that the model's own call is
  routed to. The sub-model's inputs are the tensors the segment consumes
  from before it, its outputs the tensors later calls (or the model's
  outputs) need from it; tensors that only pass by a segment (a U-Net's
  long skip) go around its block. A Sequential model is routed to a
  Sequential, its blocks wrapping lists of layers.
* A Functional model that a subclassed layer's code calls is a region of
  its own: it is rebuilt the same way, and its `call` routed to the rebuilt
  model.
* A segment of one call made by a subclassed layer's code is checkpointed
  in place: the layer object stays, so this also holds wherever else it is
  used.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import keras

from tfrecompute import strategies
from tfrecompute._keras_internals import (
    functional_inputs,
    functional_model,
)
from tfrecompute._messages import fail
from tfrecompute.graph.layer_graph import (
    Call,
    LayerGraph,
    Region,
    Unit,
)
from tfrecompute.layers import RecomputeBlock
from tfrecompute.layers.in_place import (
    Checkpoints,
    checkpoint_in_place,
    record,
    remove,
    route_call,
)
from tfrecompute.layers.policy import planned_policies, policy_label

__all__ = ["apply", "block_policies", "substituted"]


@dataclasses.dataclass
class _Placement:
    """The segments to place, by start: their stop and policy; the blocks made so far."""

    starts: dict[int, int]
    policy_at: dict[int, Any]
    names: list[str]
    blocks: list[RecomputeBlock] = dataclasses.field(default_factory=list)


def apply(
    graph: LayerGraph,
    segments: Sequence[tuple[int, int]],
    *,
    plan: Any = None,
    policies: Sequence[Any] | None = None,
) -> Checkpoints | None:
    """Checkpoints each range of calls of the graph's model, in the model itself.

    NOTE [ A checkpointed model is the model ] in `layers/in_place.py`: what
    was applied to the model before is removed first; the model's own call is
    then routed to a rebuilt model with the blocks placed (a Functional or
    Sequential model's calls), and calls made by a subclassed layer's code
    are checkpointed where they are made.

    Args:
        graph: the layer graph of the model, traced as it was defined.
        segments: sorted, disjoint half-open ranges `(start, stop)` of call
            indices: runs of graph calls of one region, or single calls made
            by a subclassed layer's code.
        plan: the plan the segments come from, recorded with them.
        policies: the recompute policy of each segment's block (see
            `RecomputeBlock`); None for none.

    Returns:
        What was applied (`Checkpoints`), None when no segment was given.
    """
    model = graph.model
    remove(model)
    if not segments:
        return None
    # Block names become TensorFlow name scopes: no "#" or "/" from call names.
    names = [n.replace("#", "_call").replace("/", "_") for n in graph.names]
    placement = _Placement({}, {}, names)
    changed: list[Any] = []
    for (start, stop), policy in zip(segments, policies or [None] * len(segments)):
        placement.policy_at[start] = policy
        if graph.calls[start].in_place:
            layer = graph.calls[start].layer
            placement.blocks.append(checkpoint_in_place(layer, policy=policy))
            changed.append(layer)
        else:
            placement.starts[start] = stop
    runtime = None
    for region in _regions(graph):
        if not any(graph.calls[k].region is region for k in placement.starts):
            continue
        made = len(placement.blocks)
        name = f"{region.model.name}_recompute"
        if region is graph.root and graph.sequential:
            replacement: keras.Model = _rewrite_sequential(graph, placement, name)
        else:
            replacement = _rebuild(graph, region, placement, name)
        route_call(region.model, replacement, blocks=placement.blocks[made:])
        changed.append(region.model)
        if region is graph.root:
            runtime = replacement
    applied = Checkpoints(plan, runtime, tuple(placement.blocks), tuple(changed))
    record(model, applied)
    return applied


def block_policies(api: str, plan: strategies.Plan, policy: Any) -> list[Any]:
    """Each segment's policy, for `rewrite(..., policies=...)`.

    A plan that weighed policy states (`optimal` on a chain with policy
    costs) says per segment (`Plan.selective`: state `k` is the `k`-th
    policy of `policy`, a list when there are several); any other plan's
    blocks all get `policy`: the user chose the segments and asked for one.
    Without `policy`, a weighed plan's segments get the policies its chain was
    profiled with (`ProfiledModel.policies`), which a chain built by hand lacks.
    """
    given = planned_policies(api, policy)
    if not plan.segments:
        return []
    weighed = bool(plan.selective) or (plan.chain.has_policy and plan.strategy == "optimal")
    if weighed and not given:
        given = _own_policies(api, plan, policy)
    if not weighed:
        if len(given) > 1:
            fail(
                api,
                f"plan {plan.strategy!r} chose the segments without weighing policies, so "
                "each block can get one policy, not a list",
                "policy",
                policy,
                "Pass one policy, or let the planner weigh several (the default strategy "
                "or 'optimal', with a budget or none)",
            )
        return [given[0] if given else None] * len(plan.segments)
    if not given:
        fail(
            api,
            "the plan recomputes segments under a recompute policy, but no policy is given "
            "and its chain does not record one (it was not profiled from a model)",
            "policy",
            policy,
            f"Pass the policy the plan was made with, e.g. {api}(model, plan, policy='dots')",
        )
    chain = plan.chain
    wanted = chain.policy_names or None
    if len(given) != len(chain.policy_states) or (
        wanted is not None and tuple(map(policy_label, given)) != wanted
    ):
        made = list(wanted) if wanted else f"{len(chain.policy_states)} policies"
        example = (wanted[0] if len(wanted) == 1 else list(wanted)) if wanted else "dots"
        fail(
            api,
            f"the plan recomputes segments under the policies it was made with ({made}), "
            f"which policy={policy!r} does not match",
            "policy",
            policy,
            f"Pass the policies the plan was made with, e.g. {api}(model, plan, "
            f"policy={example!r})",
        )
    return [given[plan.state(i) - 1] if plan.state(i) else None for i in range(len(plan.segments))]


def _own_policies(api: str, plan: strategies.Plan, policy: Any) -> tuple[Any, ...]:
    """The policies a weighed plan's chain was profiled with, for a call given none; a
    policy that turns them off ("nothing") is refused for a plan that uses them."""
    if policy is not None and any(plan.selective):
        fail(
            api,
            "the plan recomputes segments under policy states, which the policy given turns off",
            "policy",
            policy,
            f"Pass no policy to apply the plan's own states, or make the plan with "
            f"policy={policy!r}",
        )
    return tuple(getattr(plan.chain.source, "policies", ()))


def _regions(graph: LayerGraph) -> list[Region]:
    """The regions of the graph's calls, outermost first."""
    found: dict[int, Region] = {}
    for call in graph.calls:
        if call.region is not None:
            found.setdefault(id(call.region), call.region)
    return list(found.values())


def _rebuild(graph: LayerGraph, region: Region, placement: _Placement, name: str) -> keras.Model:
    """A Functional model computing `region` from its model's inputs, with the blocks placed."""
    starts = placement.starts
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
            _apply_block(graph, (index, stop), placement, mapping)
            index = stop
        else:
            _replay(anchor, mapping)
            index += 1
    outputs = keras.tree.map_structure(lambda t: mapping[id(t)], region.structure)
    # A Sequential's graph starts at its inner functional inputs, not its own Input.
    inputs = functional_inputs(model)[0] if isinstance(model, keras.Sequential) else model.input
    return functional_model(inputs, outputs, name=name)


def _rewrite_sequential(graph: LayerGraph, placement: _Placement, name: str) -> keras.Sequential:
    # A Sequential's graph also holds the ops its layers' masks are computed
    # with (an Embedding's `not_equal`); the Sequential runs those itself, so
    # only its layers are placed.
    starts = placement.starts
    placed = [isinstance(c.layer, keras.layers.Layer) for c in graph.calls]
    layers: list[keras.layers.Layer] = []
    index = 0
    while index < len(graph.calls):
        stop = starts.get(index, index + 1)
        members = [k for k in range(index, stop) if placed[k]]
        if index in starts and members:
            block_layers = [graph.calls[k].layer for k in members]
            block_name = f"recompute_{placement.names[members[0]]}"
            block = RecomputeBlock(block_layers, policy=placement.policy_at[index], name=block_name)
            block._warns_of_dtypes = False  # placed by the plan, not the user
            placement.blocks.append(block)
            layers.append(block)
        else:
            layers += [graph.calls[k].layer for k in members]
        index = stop
    source = graph.model.inputs[0]
    return keras.Sequential(
        [keras.Input(batch_shape=source.shape, dtype=source.dtype), *layers], name=name
    )


def substituted(structure: Any, mapping: dict[int, Any]) -> Any:
    def substitute(value: Any) -> Any:
        return mapping[id(value)] if isinstance(value, keras.KerasTensor) else value

    return keras.tree.map_structure(substitute, structure)


def _replay(call: Call | Unit, mapping: dict[int, Any]) -> None:
    """Calls a node's operation again on the tensors `mapping` gives for its arguments."""
    operation = call.layer if isinstance(call, Call) else call.node.operation
    args = substituted(call.args, mapping)
    kwargs = substituted(call.kwargs, mapping)
    outputs = keras.tree.flatten(operation(*args, **kwargs))
    for original, new in zip(call.outputs, outputs):
        mapping[id(original)] = new


def _declared_as_traced(declared: Any, traced: Any) -> tuple[int | None, ...]:
    """A tensor's shape as Keras declared it, unknown where the trace contradicts it.

    The rewritten model's tensors carry the shapes their layers declare
    (`compute_output_shape`), which the original model never checks, while a
    block's sub-model checks its inputs against its `keras.Input`s. Some
    declarations are wrong: keras-hub's `SigLIPVisionEmbedding` counts a class
    token SigLIP does not add (197 positions for 196), and
    `Gemma3InterleaveEmbeddings` declares its image embeddings' shape for the
    text sequence it returns. A dimension the traced tensor (at the sample's
    shapes) contradicts is left unknown; a rank it contradicts, all of them.
    """
    declared, traced = tuple(declared), tuple(traced)
    if len(declared) != len(traced):
        return (None,) * len(traced)
    return tuple(d if d is None or t is None or d == t else None for d, t in zip(declared, traced))


def _no_mask_of_its_own(inputs: Any, previous_mask: Any = None) -> None:
    """`compute_mask` of a segment's sub-model: its outputs carry their layers' masks."""
    return None


def _apply_block(
    graph: LayerGraph, segment: tuple[int, int], placement: _Placement, mapping: dict[int, Any]
) -> None:
    """Wraps calls [start, stop) in a block called on the mapped tensors; maps its outputs."""
    start, stop = segment
    name = f"recompute_{placement.names[start]}"
    input_ids, output_ids = graph.segment_io(start, stop)
    inner: dict[int, Any] = {}
    sub_inputs = []
    for key in input_ids:
        outer = mapping[key]  # the rewritten model's tensor: its shape, unknown dims included
        shape = _declared_as_traced(outer.shape, graph.tensors[key].tensor.shape)
        sub_input = keras.Input(batch_shape=shape, dtype=outer.dtype)
        inner[key] = sub_input
        sub_inputs.append(sub_input)
    for index in range(start, stop):
        _replay(graph.calls[index], inner)
    sub_outputs = [inner[key] for key in output_ids]
    sub_model = functional_model(
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
    block = RecomputeBlock(sub_model, policy=placement.policy_at[start], name=name)
    block._warns_of_dtypes = False  # placed by the plan, not the user
    placement.blocks.append(block)
    block_inputs = [mapping[key] for key in input_ids]
    results = block(block_inputs if len(block_inputs) != 1 else block_inputs[0])
    for key, result in zip(output_ids, keras.tree.flatten(results)):
        mapping[key] = result
