"""`profile()`: a model's cost chain, assembled in named phases.

The data path: the model's `LayerGraph` (its calls in topological order),
each call's costs read from its traced gradient graph (`call_costs`), the
calls grouped into links, and per link the bytes and costs of a
`strategies.Chain`. Each phase below is one function whose docstring is the
NOTE that explains it. The chain's `source` is a `ProfiledModel`: the map
from its links to the model's calls, with which `tfrecompute.rewrite` applies
a plan without profiling the model again.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import keras

from tfrecompute import strategies
from tfrecompute._messages import as_positive_int, fail
from tfrecompute.call_costs import CallMemory, call_memory
from tfrecompute.graph import LayerGraph, tensor_bytes, trainable_variables

__all__ = [
    "COMPILED",
    "ProfiledModel",
    "check_batch_size",
    "profile",
    "profile_graph",
    "profiled_model",
]

COMPILED: Any = "compiled"
"""`profile(..., optimizer=COMPILED)`: model the optimizer the model was compiled with."""

Progress = Callable[[int, int], None]


@dataclasses.dataclass(frozen=True, eq=False)
class ProfiledModel:
    """What a chain was profiled from: the model's graph, and which calls each link is.

    Attributes:
        graph: the model's layer graph.
        links: link `k` is the calls `links[k][0]` up to (not including) `links[k][1]`.
        batch_size: the batch size the chain's bytes are for.
    """

    graph: LayerGraph
    links: tuple[tuple[int, int], ...]
    batch_size: int

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
    batch_size: int,
    *,
    optimizer: Any = COMPILED,
    progress: Progress | None = None,
) -> strategies.Chain:
    """The cost chain of a Sequential or Functional model at a batch size.

    The model's layer calls (and `keras.ops` calls, which have no weights),
    in topological order, make the links of the chain: one call per link,
    except that a call whose outputs no backward pass reads joins the link of
    the call after it (BatchNormalization feeding a ReLU); a link's name joins
    its calls' names with "+". Per link: the bytes of its outputs (from their
    shapes and the compute dtype, so they halve under a float16 or bfloat16
    policy), the bytes it keeps alive for its backward (read from the calls'
    traced gradient graphs: what TensorFlow really keeps, e.g. a Dropout's
    boolean mask, a GELU's intermediates), and its forward cost in estimated
    FLOPs. Every dimension but the batch must be known.

    Args:
        model: a built `keras.Sequential` or Functional model.
        batch_size: the training batch size.
        optimizer: the optimizer whose handling of weight gradients to model:
            one that needs all of them before any update (global norm
            clipping, a `LossScaleOptimizer`, gradient accumulation) keeps
            them until the step's end; any other applies each as it is
            computed. By default the optimizer the model was compiled with
            (none if it is not compiled: gradients applied as computed).
        progress: called as `progress(done, total)` after each layer call is
            analysed (for a progress bar).

    Returns:
        A `tfrecompute.strategies.Chain` with the layer names as `names`.

    Example:

    ```python
    chain = tfrecompute.profile(model, batch_size=32)
    print(chain.n, sum(chain.saved_bytes))
    ```
    """
    checked = check_batch_size("profile", batch_size, required_for="profile")
    assert checked is not None  # required: None raised
    return profile_graph(LayerGraph.of(model, api="profile"), checked, optimizer, progress)


def check_batch_size(api: str, batch_size: Any, *, required_for: str | None = None) -> int | None:
    """Validates a batch size; None passes unless `required_for` names what needs it."""
    if batch_size is None:
        if required_for:
            fail(
                api,
                f"{required_for} needs the batch size, because activation bytes grow with it",
                "batch_size",
                batch_size,
                "Pass the batch size you train with, e.g. batch_size=64",
            )
        return None
    return as_positive_int(api, "batch_size", batch_size, example="batch_size=64")


def profile_graph(
    graph: LayerGraph,
    batch_size: int,
    optimizer: Any = COMPILED,
    progress: Progress | None = None,
    *,
    api: str = "profile",
) -> strategies.Chain:
    """`profile` on an analysed graph; the chain's `source` is its `ProfiledModel`."""
    graph.check_static_shapes(api)
    memories = _call_memories(graph, batch_size, progress)
    needed = _read_by_backward(graph, memories)
    links = _links(graph, needed)
    link_of = [0] * len(graph.calls)
    for link, (first, stop) in enumerate(links):
        link_of[first:stop] = [link] * (stop - first)
    sizes = _Sizes(graph, batch_size, _differentiable(graph))
    if optimizer is COMPILED:
        optimizer = getattr(graph.model, "optimizer", None)
    keep_all = _keeps_all_gradients(optimizer)
    weights = _weight_gradients(graph, link_of, len(links), keep_all=keep_all)
    skips = _carries(graph, link_of, len(links), sizes)
    per_link = _link_costs(graph, links, _Reads(memories, needed), sizes, skips)
    return strategies.Chain(
        sizes.of(graph.model.inputs),
        [c.output for c in per_link],
        [c.saved for c in per_link],
        [c.forward_cost for c in per_link],
        workspace_bytes=[c.workspace for c in per_link],
        kept_grad_bytes=weights.per_link if keep_all else None,
        applied_grad_bytes=None if keep_all else weights.per_link,
        carries=skips.carries,
        carry_grads=skips.carry_grads,
        input_grad_bytes=[c.input_grad for c in per_link],
        input_copy_bytes=[c.input_copy for c in per_link],
        update_workspace_bytes=weights.update_workspace if keep_all else 0,
        names=[c.name for c in per_link],
        source=ProfiledModel(graph, tuple(links), batch_size),
    )


# ------------------------------------------------------------------ phases


def _call_memories(
    graph: LayerGraph, batch_size: int, progress: Progress | None
) -> list[CallMemory]:
    """What each call keeps for its backward, traced once per layer and input signature."""
    cache: dict[tuple[Any, ...], CallMemory] = {}
    memories = []
    for done, call in enumerate(graph.calls, start=1):
        signature = tuple((tuple(t.shape), str(t.dtype)) for t in call.tensor_args)
        key = (id(call.layer), signature)
        if key not in cache:
            cache[key] = call_memory(call.layer, call.args, call.kwargs, call.outputs, batch_size)
        memories.append(cache[key])
        if progress is not None:
            progress(done, len(graph.calls))
    return memories


def _read_by_backward(graph: LayerGraph, memories: list[CallMemory]) -> set[int]:
    """Ids of the tensors some call's backward reads (its inputs or its outputs)."""
    needed: set[int] = set()
    for call, memory in zip(graph.calls, memories):
        needed.update(id(t) for t, read in zip(call.outputs, memory.reads_outputs) if read)
        needed.update(id(t) for t, read in zip(call.tensor_args, memory.reads_inputs) if read)
    return needed


def _links(graph: LayerGraph, needed: set[int]) -> list[tuple[int, int]]:
    """NOTE [ Links of the chain ]

    A tensor that no backward reads (a BatchNormalization output feeding a
    ReLU, whose gradient reads the ReLU's output) is freed as soon as its
    consumer ran. A segment boundary there would force keeping it (a block
    stores its inputs), so such a call is merged with the next one into one
    link. A link's saved bytes count each tensor that some backward reads
    once, at its producer, plus what its calls keep inside.
    """
    links: list[tuple[int, int]] = []
    start = 0
    for index, call in enumerate(graph.calls):
        transient = all(
            id(t) not in needed and not graph.tensors[id(t)].is_output for t in call.outputs
        )
        if not transient or index == len(graph.calls) - 1:
            links.append((start, index + 1))
            start = index + 1
    return links


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


def _keeps_all_gradients(optimizer: Any) -> bool:
    """Whether `optimizer` needs every gradient before any update."""
    if optimizer is None:
        return False
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return True
    return bool(
        getattr(optimizer, "global_clipnorm", None)
        or getattr(optimizer, "gradient_accumulation_steps", None)
    )


@dataclasses.dataclass(frozen=True)
class _WeightGradients:
    per_link: list[int]  # bytes of the weight gradients each link's backward makes
    update_workspace: int  # `Chain.update_workspace_bytes` under an optimizer keeping all


def _weight_gradients(
    graph: LayerGraph, link_of: list[int], n: int, *, keep_all: bool
) -> _WeightGradients:
    """NOTE [ Parameter gradients ]

    In a compiled step each variable's update runs as soon as its gradient
    exists, unless the optimizer needs all gradients first (global norm
    clipping, loss scaling, gradient accumulation). So by default a link's
    weight gradients are applied ones (`Chain.applied_grad_bytes`): alive
    through the backward of the next `Chain.UPDATE_LAG` links, and through
    the rest of its segment's backward when the link is recomputed (NOTE
    [ Variable gradients wait for the whole backward ]); with such an
    optimizer they stay live until the step's end (`Chain.kept_grad_bytes`).
    Such an optimizer then makes new tensors of the gradients (the clipped
    or unscaled ones, and the squares of a global norm) as it updates, a few
    at a time: counted as the largest `Chain.UPDATE_LAG` gradients, the
    updates in flight at once (`Chain.update_workspace_bytes`). A variable
    used by several calls gets its gradient at its last call's link.
    tests/test_costs.py test_parameter_gradients_follow_the_optimizer checks
    both against traced steps of 8 Dense(2048) (128 MiB of weights).
    """
    per_link = [0] * n
    last_call: dict[int, tuple[int, Any]] = {}
    for index, call in enumerate(graph.calls):
        for variable in trainable_variables(call.layer):
            last_call[id(variable)] = (index, variable)
    variable_grads = []
    for index, variable in last_call.values():
        variable_grads.append(tensor_bytes(variable.shape, variable.dtype, 1))
        per_link[link_of[index]] += variable_grads[-1]
    largest = sorted(variable_grads, reverse=True)[: strategies.Chain.UPDATE_LAG]
    return _WeightGradients(per_link, sum(largest) if keep_all else 0)


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
    reads, and at least its output.
    """
    names = graph.names
    boundary = list(graph.model.inputs)
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
                saved=max(saved, output),
                workspace=_workspace(graph, link, calls, reads, sizes, skips, output + input_grad),
                input_grad=input_grad,
                input_copy=input_copy,
                forward_cost=sum(_estimated_flops(graph.calls[i], sizes.batch_size) for i in calls),
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
    tests/test_costs.py test_the_recompute_copies_its_input checks it
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
