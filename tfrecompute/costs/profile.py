"""`profile()`: a model's cost chain, assembled in named phases.

The data path: the model's `LayerGraph` (its calls in topological order),
each call's costs read from its traced gradient graph (`call_memory`), the
calls grouped into links, and per link the bytes and costs of a
`strategies.Chain`. Each phase below is one function whose docstring is the
NOTE that explains it. The chain's `source` is a `ProfiledModel`: the map
from its links to the model's calls, with which `tfrecompute.rewrite.apply` applies
a plan without profiling the model again.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import keras
import tensorflow as tf

from tfrecompute import strategies
from tfrecompute._keras_internals import all_sublayers
from tfrecompute._messages import as_bool, cause, fail
from tfrecompute.costs.call_memory import CallMemory, TracedStep, traced_call_memory
from tfrecompute.costs.measured import corrected, measure_call
from tfrecompute.costs.optimizer import compiled_or_adam, optimizer_costs
from tfrecompute.costs.policy_state import kept_products, policy_link_costs
from tfrecompute.costs.state_time import attention_core_seconds, policy_recompute_seconds
from tfrecompute.graph.call_tree import trace_model
from tfrecompute.graph.expand import Selection, expand, selected, selection
from tfrecompute.graph.layer_graph import (
    Call,
    LayerGraph,
    cost_keys,
    tensor_bytes,
    trainable_variables,
)
from tfrecompute.graph.trace import (
    as_defined,
    batch_of,
    check_batch_size,
    traced_graph,
)
from tfrecompute.layers import RecomputeBlock
from tfrecompute.layers.attention import attention_layers
from tfrecompute.layers.block import as_passed
from tfrecompute.layers.in_place import checkpointed_in_place, unrouted
from tfrecompute.layers.policy import planned_policies, policy_label, policy_scope, resolve_policy

__all__ = [
    "COMPILED",
    "ProfiledModel",
    "batch_of",
    "check_batch_size",
    "profile",
    "profile_graph",
    "profiled_model",
    "traced_graph",
]

COMPILED: Any = "compiled"
"""`profile(..., optimizer=COMPILED)`: model the optimizer the model was compiled with (Adam
if not compiled)."""

Progress = Callable[[int, int], None]


@dataclasses.dataclass(frozen=True, eq=False)
class ProfiledModel:
    """What a chain was profiled from: the model's graph, and which calls each link is.

    Attributes:
        graph: the model's layer graph.
        links: link `k` is the calls `links[k][0]` up to (not including) `links[k][1]`.
        batch_size: the batch size the chain's bytes are for.
        policies: the recompute policies the chain's policy states are for, in
            order (`Chain.policy_states`); () without any. A plan weighing them
            is applied with these when `recompute` is given none.
    """

    graph: LayerGraph
    links: tuple[tuple[int, int], ...]
    batch_size: int
    policies: tuple[Any, ...] = ()

    def call_segments(self, segments: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        """Segments of links as ranges of the graph's calls."""
        return [(self.links[s][0], self.links[e - 1][1]) for s, e in segments]


def profiled_model(chain: strategies.Chain, model: keras.Model) -> ProfiledModel | None:
    """The `ProfiledModel` of `chain` if `profile` made it for this very `model`, else None."""
    source = chain.source
    if isinstance(source, ProfiledModel) and source.graph.model is model:
        return source
    return None


def profile(
    model: keras.Model,
    batch_size: int | None = None,
    *,
    sample: Any = None,
    optimizer: Any = COMPILED,
    depth: int | None = None,
    where: Any = None,
    progress: Progress | None = None,
    policy: Any = None,
    measure: bool | None = None,
    measure_time: bool = False,
) -> strategies.Chain:
    """The cost chain of any Keras model at a batch size.

    The model's call is traced once on placeholders (nothing runs) and its
    calls make the links of the chain (NOTE [ Expanding the call tree ] in
    `tfrecompute.graph.expand`): a Functional or Sequential model's layer and
    `keras.ops` calls, nested Functional models' calls in their place, the
    blocks of a container layer such as keras-hub's `ViTEncoder`, the
    sub-layer calls of a subclassed model. A call whose outputs no backward
    pass reads joins the link of the call after it (BatchNormalization
    feeding a ReLU); a link's name joins its calls' names with "+". Per
    link: the bytes of its outputs (from their shapes and the compute dtype,
    so they halve under a float16 or bfloat16 policy), the bytes it keeps
    alive for its backward (read from the calls' traced gradient graphs: what
    TensorFlow really keeps, e.g. a Dropout's boolean mask, a GELU's
    intermediates), and its forward cost in estimated FLOPs. `Chain.max_stop`
    says which links a segment may hold.

    Args:
        model: a built Keras model: Sequential, Functional or subclassed.
        batch_size: the training batch size; by default the sample's.
        sample: one batch as the model is called with (an array, a list or
            dict of arrays, or `(x, y)` as passed to `fit`): fixes the shapes
            the model's inputs leave unknown (a keras-hub backbone's
            `(None, None)` token ids) and is needed for a subclassed model.
            Only shapes and dtypes are read.
        optimizer: the optimizer whose handling of weight gradients to model:
            one that needs all of them before any update (global norm
            clipping, a `LossScaleOptimizer`, gradient accumulation) keeps
            them until the step's end; any other applies each as it is
            computed. Its updates' temporaries are measured once per
            optimizer configuration (NOTE [ The optimizer's update
            workspace ] in `tfrecompute.costs.optimizer`). By default the
            optimizer the model was compiled with, or Adam if it is not
            compiled yet; None models none (gradients applied as computed,
            no temporaries).
        depth: how many levels of nested calls to look into below the
            model's own (None: as deep as they can be checkpointed; 0: the
            model's own calls only).
        where: only the calls of these layers may become blocks, one each: a
            layer class, a tuple of classes, a list of layer names, or a
            predicate `(layer) -> bool`; layers holding them are looked into.
        progress: called as `progress(done, total)` after each layer call is
            analysed (for a progress bar).
        policy: a recompute policy (see `RecomputeBlock`): the chain then
            has the third state, each link's `policy_kept_bytes` and
            `policy_forward_cost` under it (`tfrecompute.costs.policy_state`).
            A list of policies (e.g. `["attention", "dots"]`) gives a state
            each, in order (`Chain.policy_states`, named in
            `Chain.policy_names`).
        measure: whether to run calls and read the allocator
            (`tfrecompute.costs.measured`): None (the default) measures only
            the calls whose graph does not show what they allocate (XLA
            functions such as Keras's grouped `Conv2D`, custom gradients,
            shapes known only at run time); True every call; False none.
            Each distinct call (layer and input specs) runs once, on the
            GPU when there is one.
        measure_time: replace the estimated FLOPs of each link's forward by
            its measured time in seconds (each call's forward timed on
            tensors of the real shapes, median of a few runs), and with a
            `policy`, the cost of each link's recompute under it by its
            measured time too (NOTE [ Measured state times ] in
            `tfrecompute.costs.state_time`).

    Returns:
        A `tfrecompute.strategies.Chain` with the calls' names as `names`.

    Example:

    ```python
    chain = tfrecompute.profile(model, batch_size=32)
    print(chain.n, sum(chain.saved_bytes))
    backbone = keras_hub.models.BertBackbone(...)   # (None, None) token ids
    chain = tfrecompute.profile(backbone, sample=batch)  # shapes from the batch
    ```
    """
    planned_policies("profile", policy)
    as_bool("profile", "measure_time", measure_time)
    if measure is not None:
        as_bool("profile", "measure", measure, fix="Pass measure=None, True or False")
    graph = traced_graph("profile", model, sample, batch_size, depth=depth, where=where)
    return profile_graph(
        graph,
        batch_of(graph),
        optimizer,
        progress,
        where=where,
        policy=policy,
        measure=measure,
        measure_time=measure_time,
    )


def profile_graph(
    graph: LayerGraph,
    batch_size: int,
    optimizer: Any = COMPILED,
    progress: Progress | None = None,
    *,
    where: Any = None,
    policy: Any = None,
    measure: bool | None = None,
    measure_time: bool = False,
    api: str = "profile",
) -> strategies.Chain:
    """`profile` on a traced graph; the chain's `source` is its `ProfiledModel`. `api`
    names the function called in warnings and errors."""
    measuring = _Measuring(measure, measure_time, api)
    with as_defined(graph.model):
        return _profile_graph(graph, batch_size, optimizer, progress, where, policy, measuring)


def _profile_graph(
    graph: LayerGraph,
    batch_size: int,
    optimizer: Any,
    progress: Progress | None,
    where: Any,
    policy: Any,
    measuring: _Measuring,
) -> strategies.Chain:
    memories, seconds = _call_memories(graph, batch_size, progress, measuring)
    needed = _read_by_backward(graph, memories)
    sizes = _Sizes(graph, batch_size, _differentiable(graph))
    links, unread = _links(graph, needed | _cast_for_backward(graph, memories), memories, sizes)
    link_of = [0] * len(graph.calls)
    for link, (first, stop) in enumerate(links):
        link_of[first:stop] = [link] * (stop - first)
    if optimizer is COMPILED:
        optimizer = compiled_or_adam(graph.model)
    updates = optimizer_costs(graph, link_of, len(links), optimizer)
    skips = _carries(graph, link_of, len(links), sizes)
    per_link = _link_costs(graph, links, _Reads(memories, needed, seconds, unread), sizes, skips)
    forward = [c.forward_cost for c in per_link]
    policies = planned_policies("profile", policy)
    traced = _Traced(measuring, memories, needed, sizes, skips, unread)
    forward, states = _policy_states(graph, links, batch_size, forward, policies, traced)
    first = states[0] if states else (None, None)
    return strategies.Chain(
        sizes.of(graph.inputs),
        [c.output for c in per_link],
        [c.saved for c in per_link],
        forward,
        workspace_bytes=[c.workspace for c in per_link],
        kept_grad_bytes=updates.kept_grad_bytes,
        applied_grad_bytes=updates.applied_grad_bytes,
        carries=skips.carries,
        carry_grads=skips.carry_grads,
        input_grad_bytes=[c.input_grad for c in per_link],
        input_copy_bytes=[c.input_copy for c in per_link],
        update_workspace_bytes=updates.update_workspace_bytes,
        applied_workspace_bytes=updates.applied_workspace_bytes,
        names=[c.name for c in per_link],
        max_stop=_max_stops(graph, links, sizes, selection("profile", where)),
        policy_kept_bytes=first[0],
        policy_forward_cost=first[1],
        more_policies=states[1:],
        policy_names=[policy_label(each) for each in policies],
        source=ProfiledModel(graph, tuple(links), batch_size, policies),
    )


@dataclasses.dataclass(frozen=True)
class _Traced:
    """What `_profile_graph` found of the calls, which a policy state traces again."""

    measuring: _Measuring
    memories: Any
    needed: Any
    sizes: _Sizes
    skips: Any
    unread: frozenset[int]  # links ending at an unread tensor (NOTE [ Links of the chain ])


def _policy_states(
    graph: LayerGraph, links: list[tuple[int, int]], batch_size: int, forward: list[float],
    policies: tuple[Any, ...], traced: _Traced,
) -> tuple[list[float], list[tuple[list[int], list[float]]]]:  # fmt: skip
    """The links' forward costs and, per policy, `(kept bytes, recompute cost)` per link.

    The attention state comes first whatever its place: by FLOPs it adds the cores to
    every link's forward (NOTE [ The attention state ]), which a "dots" recompute runs
    too, so a product state costs what it costs priced alone plus the cores.
    """
    found: dict[int, tuple[list[int], list[float]]] = {}
    alone = list(forward)
    for index in sorted(range(len(policies)), key=lambda i: policy_scope(policies[i]) is None):
        each = policies[index]
        if policy_scope(each) is not None:
            kept = _attention_kept(graph, links, batch_size, each, traced)
            forward, cheaper = _attention_costs(
                graph, links, batch_size, forward, timed=traced.measuring.time,
                holds_attention=_holds_attention(graph),
            )  # fmt: skip
        else:
            timed = traced.measuring.time
            kept, cheaper = _product_state(graph, links, batch_size, each, alone, timed)
            cheaper = [c + f - a for c, f, a in zip(cheaper, forward, alone)]
        found[index] = (kept, cheaper)
    return forward, [found[index] for index in range(len(policies))]


def _attention_kept(
    graph: LayerGraph, links: list[tuple[int, int]], batch_size: int, policy: Any,
    traced: _Traced,
) -> list[int]:  # fmt: skip
    """Per link, the bytes it keeps with its attention cores checkpointed: the calls that
    hold an attention layer traced again inside the policy's scope."""
    scope = policy_scope(policy)
    assert scope is not None
    holds = _holds_attention(graph)
    with scope([graph.model]):
        untimed = dataclasses.replace(traced.measuring, time=False)
        again, _ = _call_memories(
            graph, batch_size, None, untimed, redo=holds, reuse=traced.memories
        )
    reads = _Reads(again, traced.needed, None, traced.unread)
    return [c.saved for c in _link_costs(graph, links, reads, traced.sizes, traced.skips)]


def _product_state(
    graph: LayerGraph, links: list[tuple[int, int]], batch_size: int, policy: Any,
    forward: list[float], timed: bool,
) -> tuple[list[int], list[float]]:  # fmt: skip
    """Per link, what a policy that keeps products keeps, and its recompute's cost."""
    function = resolve_policy("profile", policy)
    assert function is not None
    flops = _link_flops(graph, links, batch_size)
    kept, cheaper = policy_link_costs(graph, links, batch_size, function, forward, flops)
    if timed:
        cheaper = _timed_state(
            graph,
            links,
            forward,
            lambda call: policy_recompute_seconds(
                call.layer, call.args, call.kwargs, batch_size, function
            ),
        )
    return kept, cheaper


def _link_flops(graph: LayerGraph, links: list[tuple[int, int]], batch_size: int) -> list[float]:
    """Each link's estimated forward FLOPs."""
    return [
        sum(_estimated_flops(call, batch_size) for call in graph.calls[first:stop])
        for first, stop in links
    ]


def _attention_costs(
    graph: LayerGraph, links: list[tuple[int, int]], batch_size: int, forward: list[float], *,
    timed: bool, holds_attention: Callable[[Call], bool],
) -> tuple[list[float], list[float]]:  # fmt: skip
    """(forward cost, recompute cost) per link in the attention state.

    NOTE [ The attention state ]
    A link under policy "attention" keeps what its calls keep with their
    attention cores checkpointed (`_profile_graph` traces the calls that hold
    an attention layer again inside the policy's scope), and its recompute
    runs the cores again: the products without a weight (`QK^T`, `AV`) in
    those calls. The forward's FLOP estimate leaves them out, which would
    price a full recompute of an attention link at no more than its cores
    alone; so each link's forward counts them too. In measured seconds (which
    include them), the cores are timed alone (NOTE [ Measured state times ]).
    """
    if timed:
        return forward, _timed_state(
            graph,
            links,
            forward,
            lambda call: (
                attention_core_seconds(call.layer, call.args, call.kwargs, batch_size)
                if holds_attention(call)
                else 0.0
            ),
        )
    no_weight = resolve_policy("profile", _takes_no_weight)
    assert no_weight is not None
    products = kept_products(graph, links, batch_size, no_weight, where=holds_attention)
    cores = [flops for _, flops in products]
    return [f + c for f, c in zip(forward, cores)], cores


def _timed_state(
    graph: LayerGraph,
    links: list[tuple[int, int]],
    forward: list[float],
    seconds_of: Callable[[Call], float],
) -> list[float]:
    """Per link, the measured seconds of its calls' recompute in a cheaper state, at most
    its measured forward's (NOTE [ Measured state times ]), timed once per layer and input
    signature (NOTE [ Calls that cost the same ]). Glue and blocks already in the model are
    not timed, as in `_measured`."""
    cache: dict[tuple[Any, ...], float] = {}
    keys = cost_keys(graph.calls)
    found = []
    for (first, stop), limit in zip(links, forward):
        total = 0.0
        for call, key in zip(graph.calls[first:stop], keys[first:stop]):
            if call.glue or isinstance(call.layer, RecomputeBlock):
                continue
            if key not in cache:
                cache[key] = seconds_of(call)
            total += cache[key]
        found.append(min(total, limit))
    return found


def _takes_no_weight(op: Any) -> bool:
    return not op.weight


def _holds_attention(graph: LayerGraph) -> Callable[[Call], bool]:
    """Whether a call's layer is or holds an attention layer (NOTE [ Attention core recompute ])."""
    found = {id(layer) for layer in attention_layers([graph.model])}

    def holds(call: Call) -> bool:
        layer = call.layer
        return isinstance(layer, keras.layers.Layer) and any(
            id(sub) in found for sub in all_sublayers(layer)
        )

    return holds


# ------------------------------------------------------------------ phases


@dataclasses.dataclass(frozen=True)
class _Measuring:
    calls: bool | None  # `profile(measure=)`: None for the calls the graph does not show
    time: bool  # `profile(measure_time=)`
    api: str  # the function called, for warnings and errors


def _call_memories(
    graph: LayerGraph,
    batch_size: int,
    progress: Progress | None,
    measuring: _Measuring,
    *,
    redo: Callable[[Call], bool] | None = None,
    reuse: Sequence[CallMemory] = (),
) -> tuple[list[CallMemory], list[float] | None]:
    """What each call keeps for its backward, traced (or measured) once per distinct call
    (NOTE [ Calls that cost the same ]); with `measuring.time`, each call's measured forward
    seconds too. With `redo`, only the calls it selects are traced; the others' memories
    come from `reuse`."""
    cache: dict[tuple[Any, ...], tuple[CallMemory, float]] = {}
    memories, seconds = [], []
    keys = cost_keys(graph.calls)
    for done, (call, key) in enumerate(zip(graph.calls, keys), start=1):
        if redo is not None and not redo(call):
            memories.append(reuse[done - 1])
            seconds.append(0.0)
            continue
        if key not in cache:
            memory, traced = _call_memory(call, batch_size)
            cache[key] = _measured(call, memory, traced, batch_size, measuring)
        memories.append(cache[key][0])
        seconds.append(cache[key][1])
        if progress is not None:
            progress(done, len(graph.calls))
    return memories, seconds if measuring.time else None


def _measured(
    call: Call,
    memory: CallMemory,
    traced: TracedStep | None,
    batch_size: int,
    measuring: _Measuring,
) -> tuple[CallMemory, float]:
    """The call's memory corrected by a measurement when one is wanted, and its forward time.

    Glue and blocks already in the model are modelled, never measured; a
    call of a layer without weights or differentiable inputs still runs. The
    measurement runs the step `traced` when given (the one `call_memory` read).
    """
    wanted = memory.opaque if measuring.calls is None else measuring.calls
    if call.glue or isinstance(call.layer, RecomputeBlock) or not (wanted or measuring.time):
        return memory, 0.0
    try:
        measured = measure_call(
            call.layer,
            call.args,
            call.kwargs,
            batch_size,
            time_forward=measuring.time,
            traced=traced,
            api=measuring.api,
        )
    except tf.errors.InvalidArgumentError as error:
        return _unmeasured(call, memory, measuring, error), 0.0
    return (corrected(memory, measured) if wanted else memory), measured.forward_seconds or 0.0


def _unmeasured(
    call: Call, memory: CallMemory, measuring: _Measuring, error: Exception
) -> CallMemory:
    """NOTE [ A call that cannot run on synthetic values ]

    A call is measured on synthetic tensors of its shapes (normal floats,
    zero ids), and some calls cannot run on them: a float input that becomes
    an index (keras-hub's SAM3 geometry encoder turns box coordinates into
    `GatherNd` indices, and a negative coordinate indexes out of range,
    which TensorFlow's CPU kernel rejects). Its memory is then the traced
    reading, with a warning that names the layer; measured time has no
    such fallback, so `measure_time=True` raises.
    """
    called = getattr(call.layer, "name", None) or getattr(call.layer, "__name__", "a call")
    what = (
        f"measuring the call of '{called}' on synthetic inputs (normal floats, zero ids) "
        f"failed ({cause(error)})"
    )
    if measuring.time:
        fix = "Profile with measure_time=False to price each link's forward by its FLOPs"
        fail(measuring.api, what, "measure_time", True, fix)
    warnings.warn(
        f"{measuring.api}: {what}, so its memory is the traced reading of its graph, which "
        "may miss buffers it allocates",
        stacklevel=2,
    )
    return memory


def _call_memory(call: Call, batch_size: int) -> tuple[CallMemory, TracedStep | None]:
    """What one call keeps for its backward (see `call_memory`), glue and blocks included,
    and its traced step (None for glue).

    Glue (a layer's own computation between its sub-layer calls) is taken
    to keep nothing: its element-wise adds and reshapes do not. A
    `RecomputeBlock` already in the model keeps only its inputs, and its
    backward holds what its layers keep while it recomputes them: that, the
    peak of its layers storing everything, is its workspace.
    """
    if call.glue:
        n_in, n_out = len(call.tensor_args), len(call.outputs)
        return CallMemory(0, 0, (False,) * n_in, (False,) * n_out), None
    memory, traced = traced_call_memory(
        call.layer, call.args, call.kwargs, call.outputs, batch_size
    )
    if isinstance(call.layer, RecomputeBlock):
        workspace = _block_workspace(call, batch_size)
        memory = dataclasses.replace(memory, workspace_bytes=workspace)
    return memory, traced


def _block_workspace(call: Call, batch_size: int) -> int:
    """The peak a block's backward adds: its layers recomputed, storing everything.

    An in-place block around a layer called with more than its input
    (DepthAnything's fusion stages take the stage's residual beside it) is
    priced from the layer's own call, traced past the block: what the layer
    keeps storing everything and its backward's workspace.
    """
    block = call.layer
    flat = keras.tree.flatten((call.args, call.kwargs))
    tensors = [t for t in flat if isinstance(t, keras.KerasTensor)]
    if len(call.args) != 1 or len(tensors) != len(keras.tree.flatten(call.args[0])):
        if checkpointed_in_place(block.inner[0]):
            layer = block.inner[0]
            args, kwargs = as_passed(call.args, call.kwargs)
            with unrouted(layer):
                inner, _ = traced_call_memory(layer, args, kwargs, call.outputs, batch_size)
            return inner.kept_bytes + inner.workspace_bytes
        fail(
            "profile",
            f"the RecomputeBlock {block.name!r} in the model takes extra arguments, so "
            "what its recompute holds cannot be modelled",
            "model",
            block,
            "Profile the model without its blocks (plan on the original model)",
            by_name=True,
        )
    specs = keras.tree.map_structure(
        lambda t: tf.TensorSpec(t.shape, keras.backend.standardize_dtype(t.dtype)), call.args[0]
    )
    inner = expand(block, trace_model(block, specs, api="profile"))
    chain = profile_graph(inner, batch_of(inner), None)
    return max(strategies.none(chain).peak_bytes - chain.input_bytes, 0)


def _read_by_backward(graph: LayerGraph, memories: list[CallMemory]) -> set[int]:
    """Ids of the tensors some call's backward reads (its inputs or its outputs)."""
    needed: set[int] = set()
    for call, memory in zip(graph.calls, memories):
        needed.update(id(t) for t, read in zip(call.outputs, memory.reads_outputs) if read)
        needed.update(id(t) for t, read in zip(call.tensor_args, memory.reads_inputs) if read)
    return needed


def _cast_for_backward(graph: LayerGraph, memories: list[CallMemory]) -> set[int]:
    """Ids of the tensors a consumer casts and its backward reads the cast of."""
    cast: set[int] = set()
    for call, memory in zip(graph.calls, memories):
        cast.update(id(t) for t, read in zip(call.tensor_args, memory.casts_inputs) if read)
    return cast


def _links(
    graph: LayerGraph, cut: set[int], memories: list[CallMemory], sizes: _Sizes
) -> tuple[list[tuple[int, int]], frozenset[int]]:
    """NOTE [ Links of the chain ]

    A tensor that no backward reads (a BatchNormalization output feeding a
    ReLU, whose gradient reads the ReLU's output) is freed as soon as its
    consumer ran. A segment boundary there would force keeping it (a block
    stores its inputs), so such a call is merged with the next one into one
    link. A link's saved bytes count each tensor that some backward reads
    once, at its producer, plus what its calls keep inside.

    A tensor whose consumer casts it and keeps the cast for its backward is
    no such tensor: keeping it instead of the cast costs no more. Under a
    mixed precision policy each keras-hub decoder layer casts its bfloat16
    input to float32 for its first norm, so that no layer output was read
    by a backward and a Llama's whole stack merged into one link. Such
    tensors (with the read ones: `cut`) end links.

    Merging is right where the tensor is small beside what the link keeps
    (BatchNormalization's output), wrong where whole layers are at stake:
    in a post-norm encoder quantized to int8 (BERT, RoBERTa) no backward
    reads a layer's output (the next layer's int8 projections read only
    their kernels, its residual add nothing), and FNet's Fourier mixing
    reads none in float32, so the whole stack was one link with nowhere
    to cut. So an unread tensor also ends a link when the calls of the link
    up to it keep at least `SPLIT_AT` times its bytes inside; storing that
    link is then priced with its output kept besides (it is, when a block
    starts there), which over-prices storing everything by that output
    (carried tensors included) per such boundary and never under-prices a
    plan. Returns the links and the
    indices of those ending at an unread tensor.
    """
    links: list[tuple[int, int]] = []
    unread: set[int] = set()
    start, kept = 0, 0
    for index, call in enumerate(graph.calls):
        read = [t for t in call.outputs if id(t) in cut or graph.tensors[id(t)].is_output]
        kept += memories[index].kept_bytes
        last = index == len(graph.calls) - 1
        split = not read and not last and kept >= SPLIT_AT * max(sizes.of(call.outputs), 1)
        if read or last or split:
            if split:
                unread.add(len(links))
            links.append((start, index + 1))
            start, kept = index + 1, 0
    return links, frozenset(unread)


SPLIT_AT = 2
"""How many times an unread tensor's bytes a link must keep to end there (NOTE
[ Links of the chain ])."""


def _differentiable(graph: LayerGraph) -> set[int]:
    """NOTE [ Which gradients exist ]

    A training step differentiates the loss with respect to the trainable
    variables only, so a tensor has a gradient only if it is a float that
    some trainable variable flows into: not the model's inputs, not a
    padding or rescaling of them, not integer ids. Returns their ids.
    """
    differentiable: set[int] = set()
    for call in graph.calls:
        if trainable_variables(call.layer) or any(
            id(t) in differentiable for t in call.tensor_args
        ):
            differentiable.update(
                id(t) for t in call.outputs if keras.backend.is_float_dtype(t.dtype)
            )
    return differentiable


@dataclasses.dataclass(frozen=True)
class _Sizes:
    """Bytes of the graph's tensors at the batch size, and which of them have gradients."""

    graph: LayerGraph
    batch_size: int
    differentiable: set[int]

    def of(self, tensors: Sequence[keras.KerasTensor]) -> int:
        return sum(tensor_bytes(t.shape, t.dtype, self.batch_size) for t in tensors)

    def floating(self, tensors: Sequence[keras.KerasTensor]) -> int:
        return self.of([t for t in tensors if keras.backend.is_float_dtype(t.dtype)])

    def gradients(self, tensors: Sequence[keras.KerasTensor]) -> int:
        return self.of([t for t in tensors if id(t) in self.differentiable])


@dataclasses.dataclass(frozen=True)
class _Skips:
    carries: list[tuple[int, int, int]]
    carry_grads: list[tuple[int, int, int]]
    carried_in: set[tuple[int, int]]  # (tensor id, consuming link) of each carry


def _carries(graph: LayerGraph, link_of: list[int], n: int, sizes: _Sizes) -> _Skips:
    """Skip connections: tensors used beyond the next link.

    A tensor used beyond the next link (a residual shortcut, a long skip) is
    an extra output of any segment that makes it but ends before its use.
    Its gradient (when it has one) is made by the backward of its last
    consumer and lives until the backward of its producer.
    """
    skips = _Skips([], [], set())
    for key, info in graph.tensors.items():
        if info.producer < 0:
            continue
        producer = link_of[info.producer]
        last = n if info.is_output else link_of[info.last_use]
        if last >= producer + 2:
            size = sizes.of([info.tensor])
            skips.carries.append((producer, last, size))
            skips.carried_in.update((key, link_of[c]) for c in info.consumers)
            if key in sizes.differentiable:
                skips.carry_grads.append((producer, last, size))
    return skips


@dataclasses.dataclass(frozen=True)
class _Reads:
    memories: list[CallMemory]  # per call, what its backward keeps and reads
    needed: set[int]  # ids of the tensors some backward reads
    seconds: list[float] | None = None  # per call, its measured forward time
    unread: frozenset[int] = frozenset()  # links ending at a tensor no backward reads


@dataclasses.dataclass(frozen=True)
class _LinkCosts:
    name: str
    output: int
    saved: int
    workspace: int
    input_grad: int
    input_copy: int
    forward_cost: float


def _link_costs(
    graph: LayerGraph,
    links: list[tuple[int, int]],
    reads: _Reads,
    sizes: _Sizes,
    skips: _Skips,
) -> list[_LinkCosts]:
    """The per-link numbers of the chain, link by link.

    `x_k`, the chain's activation between link `k - 1` and link `k`, is the
    tensors link `k - 1` hands on (the model's inputs for `k = 0`). A link
    saves what its calls keep inside and each of its outputs some backward
    reads, and at least its output; a link ending at a tensor no backward
    reads (NOTE [ Links of the chain ]) saves it besides what it keeps.
    """
    names = graph.names
    boundary = list(graph.inputs)
    costs = []
    for link, (first, stop) in enumerate(links):
        live_in, live_out = graph.segment_io(first, stop)
        input_grad = _input_gradient(sizes, boundary, set(live_in))
        input_copy = _input_copy(sizes, boundary)
        boundary = [graph.tensors[key].tensor for key in live_out]
        output = sizes.of(boundary)
        calls = range(first, stop)
        read = [t for i in calls for t in graph.calls[i].outputs if id(t) in reads.needed]
        saved = sum(reads.memories[i].kept_bytes for i in calls) + sizes.of(read)
        costs.append(
            _LinkCosts(
                name="+".join(names[first:stop]),
                output=output,
                saved=saved + output if link in reads.unread else max(saved, output),
                workspace=_workspace(graph, link, calls, reads, sizes, skips, output + input_grad),
                input_grad=input_grad,
                input_copy=input_copy,
                forward_cost=_forward_cost(graph, calls, reads, sizes.batch_size),
            )
        )
    return costs


def _input_gradient(sizes: _Sizes, boundary: list[keras.KerasTensor], reads: set[int]) -> int:
    """NOTE [ A link that skips its chain input ]

    The gradient a link makes for x_k covers only the tensors of x_k it
    reads. ResNet's projection shortcut reads the block's input, not the
    main path's last output, which only the Add after it reads: that
    tensor's gradient is then a carry gradient, not this link's.
    """
    return sizes.gradients([t for t in boundary if id(t) in reads])


def _input_copy(sizes: _Sizes, boundary: list[keras.KerasTensor]) -> int:
    """NOTE [ The recompute's input copy ]

    A block's recompute reads its floating inputs plus a zero that depends
    on the incoming gradient (`layers/custom_gradient.py`), so that
    TensorFlow cannot merge the recompute with the forward: a copy of them,
    which the first layer's backward can keep until it runs. The chain
    counts it as a copy of the floating tensors of x_k for a segment
    starting at link k (`Chain.input_copy_bytes`), an approximation: the
    block's inputs also hold the carries it reads (a long skip consumed
    inside), and not the tensors of x_k that only pass it by.
    tests/costs/test_profile.py test_the_recompute_copies_its_input checks it
    against traced steps.
    """
    return sizes.floating(boundary)


def _workspace(
    graph: LayerGraph,
    link: int,
    calls: range,
    reads: _Reads,
    sizes: _Sizes,
    skips: _Skips,
    link_gradients: int,
) -> int:
    """NOTE [ Backward inside a link ]

    The chain sees a link's backward as one moment with the gradients of
    its output and input live. Inside a link of several calls, one call's
    backward holds the gradients of that call's own outputs and inputs,
    which can be larger (an up-sampling merged with the concatenation
    after it: the gradient of the up-sampled tensor is 4x the link's
    input). The excess over the link's gradients counts as workspace.
    Carried inputs are left out: their gradients are `carry_grads`.
    `link_gradients` are the link's: of its output and of its input.
    """
    workspace = 0
    for i in calls:
        call = graph.calls[i]
        inputs = [t for t in call.tensor_args if (id(t), link) not in skips.carried_in]
        own = sizes.gradients(call.outputs) + sizes.gradients(inputs) - link_gradients
        workspace = max(workspace, reads.memories[i].workspace_bytes + max(own, 0))
    return workspace


def _forward_cost(graph: LayerGraph, calls: range, reads: _Reads, batch_size: int) -> float:
    """A link's forward cost: its calls' measured seconds, else their estimated FLOPs."""
    if reads.seconds is not None:
        return sum(reads.seconds[i] for i in calls)
    return sum(_estimated_flops(graph.calls[i], batch_size) for i in calls)


def _estimated_flops(call: Any, batch_size: int) -> float:
    """Forward FLOPs of a call, estimated from its weights and output size.

    A layer with weights does about 2 * weights multiply-adds per output
    position (Dense, convolutions, attention projections); a layer without
    weights (or a lookup like Embedding) about one operation per output element.
    """
    outputs = call.outputs
    elements = sum(math.prod(batch_size if d is None else d for d in o.shape) for o in outputs)
    weights = sum(math.prod(v.shape) for v in trainable_variables(call.layer))
    if not weights or isinstance(call.layer, keras.layers.Embedding) or not outputs:
        return float(max(elements, 1))
    channels = outputs[0].shape[-1] or 1
    return float(2 * weights * max(elements // channels, 1))


def _max_stops(
    graph: LayerGraph, links: list[tuple[int, int]], sizes: _Sizes, where: Selection | None
) -> list[int]:
    """`Chain.max_stop`: which links a segment may hold.

    A run of graph calls of one region may be one block (a region that
    something else calls too is not rebuilt); a subclassed layer's sub-layer
    call only alone, and only if nothing else calls its layer (it is
    checkpointed in place); glue and blocks already in the model never; with
    `where`, only the selected calls, each alone. A link that no gradient
    reaches (a weightless prefix: input rescaling, padding) gains nothing
    from a recompute and is never recomputed.
    """
    stops = _call_stops(graph.calls, where)
    limits = []
    for s, (first, stop) in enumerate(links):
        reached = any(
            trainable_variables(graph.calls[i].layer)
            or any(id(t) in sizes.differentiable for t in graph.calls[i].outputs)
            for i in range(first, stop)
        )
        e = s
        while reached and e < len(links) and links[e][1] <= stops[first]:
            e += 1
        limits.append(e)
    return limits


def _call_stops(calls: list[Call], where: Selection | None) -> list[int]:
    """Per call, the largest stop of a range of calls starting there that may be one block."""
    counts: dict[int, int] = {}
    for call in calls:
        counts[id(call.layer)] = counts.get(id(call.layer), 0) + 1

    def recomputable(call: Call) -> bool:
        if call.glue or isinstance(call.layer, RecomputeBlock):
            return False
        if call.in_place:  # checkpointed in place: a layer nothing else calls
            return isinstance(call.layer, keras.layers.Layer) and counts[id(call.layer)] == 1
        return call.region is not None and call.region.alone

    def joinable(i: int) -> bool:
        return not calls[i].in_place and recomputable(calls[i])

    stops = [0] * len(calls)
    run_end = len(calls)
    for i in range(len(calls) - 1, -1, -1):
        call = calls[i]
        if not joinable(i):
            run_end = i
        elif i + 1 == len(calls) or not joinable(i + 1) or calls[i + 1].region is not call.region:
            run_end = i + 1
        if not recomputable(call) or (where is not None and not selected(where, call.layer)):
            stops[i] = i
        elif call.in_place or where is not None:
            stops[i] = i + 1
        else:
            stops[i] = run_end
    return stops
