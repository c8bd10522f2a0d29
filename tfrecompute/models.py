"""Checkpoint whole models: `profile`, `plan` and `recompute`."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import keras

from tfrecompute import strategies
from tfrecompute.graph import LayerGraph, tensor_bytes, trainable_variables
from tfrecompute.profiling import CallMemory, call_memory

__all__ = ["plan", "profile", "recompute"]

StrategyLike = str | Callable[..., strategies.Plan] | strategies.Plan


def _check_batch_size(api: str, batch_size: Any, *, required_for: str | None = None) -> int | None:
    if batch_size is None:
        if required_for:
            raise ValueError(
                f"{api}: {required_for} needs the batch size, because activation bytes grow "
                "with it. Received: batch_size=None (of type NoneType). Pass the batch size "
                "you train with, e.g. batch_size=64."
            )
        return None
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(
            f"{api}: `batch_size` must be a positive integer. Received: batch_size="
            f"{batch_size!r} (of type {type(batch_size).__name__}). Pass e.g. batch_size=64."
        )
    return batch_size


def _optimizer_keeps_all_gradients(model: keras.Model) -> bool:
    """Whether the compiled optimizer needs every gradient before any update."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        return False
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return True
    return bool(
        getattr(optimizer, "global_clipnorm", None)
        or getattr(optimizer, "gradient_accumulation_steps", None)
    )


def _estimated_flops(
    layer: keras.layers.Layer | keras.Operation, outputs: list[Any], batch_size: int
) -> float:
    """Forward FLOPs of a call, estimated from its weights and output size.

    A layer with weights does about 2 * weights multiply-adds per output
    position (Dense, convolutions, attention projections); a layer without
    weights (or a lookup like Embedding) about one operation per output element.
    """
    elements = sum(math.prod(batch_size if d is None else d for d in o.shape) for o in outputs)
    weights = sum(math.prod(v.shape) for v in trainable_variables(layer))
    if not weights or isinstance(layer, keras.layers.Embedding) or not outputs:
        return float(max(elements, 1))
    channels = outputs[0].shape[-1] or 1
    return float(2 * weights * max(elements // channels, 1))


@dataclasses.dataclass(frozen=True)
class _ModelChain:
    """A model's chain: links are runs of layer calls (`groups[k]` = calls [start, stop))."""

    graph: LayerGraph
    chain: strategies.Chain
    groups: tuple[tuple[int, int], ...]

    def call_segments(self, segments: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        return [(self.groups[s][0], self.groups[e - 1][1]) for s, e in segments]


def _symbolic_args(call: Any) -> list[keras.KerasTensor]:
    flat = keras.tree.flatten((call.args, call.kwargs))
    return list({id(t): t for t in flat if isinstance(t, keras.KerasTensor)}.values())


def _profile_graph(
    graph: LayerGraph,
    batch_size: int,
    progress: Callable[[int, int], None] | None = None,
) -> _ModelChain:
    # NOTE [ Links of the chain ]
    # A tensor that no backward reads (a BatchNormalization output feeding a
    # ReLU, whose gradient reads the ReLU's output) is freed as soon as its
    # consumer ran. A segment boundary there would force keeping it (a block
    # stores its inputs), so such a call is merged with the next one into one
    # link. A link's saved bytes count each tensor that some backward reads
    # once, at its producer, plus what its calls keep inside.
    cache: dict[tuple[Any, ...], CallMemory] = {}
    memories = []
    call_args = [_symbolic_args(call) for call in graph.calls]
    for done, (call, args) in enumerate(zip(graph.calls, call_args), start=1):
        key = (id(call.layer), tuple((tuple(t.shape), str(t.dtype)) for t in args))
        if key not in cache:
            cache[key] = call_memory(call.layer, call.args, call.kwargs, call.outputs, batch_size)
        memories.append(cache[key])
        if progress is not None:
            progress(done, len(graph.calls))
    needed: set[int] = set()
    for call, args, memory in zip(graph.calls, call_args, memories):
        needed.update(id(t) for t, read in zip(call.outputs, memory.reads_outputs) if read)
        needed.update(id(t) for t, read in zip(args, memory.reads_inputs) if read)

    def size(tensor: keras.KerasTensor) -> int:
        return tensor_bytes(tensor.shape, tensor.dtype, batch_size)

    groups: list[tuple[int, int]] = []
    start = 0
    for index, call in enumerate(graph.calls):
        transient = all(
            id(t) not in needed and not graph.tensors[id(t)].is_output for t in call.outputs
        )
        if not transient or index == len(graph.calls) - 1:
            groups.append((start, index + 1))
            start = index + 1

    link_of = [0] * len(graph.calls)
    for link, (first, stop) in enumerate(groups):
        link_of[first:stop] = [link] * (stop - first)
    n = len(groups)

    # NOTE [ Parameter gradients ]
    # In a compiled step each variable's update runs as soon as its gradient
    # exists, unless the optimizer needs all gradients first (global norm
    # clipping, loss scaling, gradient accumulation). So by default a link's
    # weight gradients are applied ones (`Chain.update_grad_bytes`): alive
    # through the backward of the next `Chain.UPDATE_LAG` links, and through
    # the rest of its segment's backward when the link is recomputed (NOTE
    # [ Variable gradients wait for the whole backward ]); with such an
    # optimizer they stay live until the step's end (`Chain.grad_bytes`).
    # test_models.py test_parameter_gradients_follow_the_optimizer checks both
    # against traced steps of 8 Dense(2048) (128 MiB of weights).
    grads = [0] * n
    last_call: dict[int, tuple[int, Any]] = {}
    for index, call in enumerate(graph.calls):
        for variable in trainable_variables(call.layer):
            last_call[id(variable)] = (index, variable)
    variable_grads = []
    for index, variable in last_call.values():
        variable_grads.append(tensor_bytes(variable.shape, variable.dtype, 1))
        grads[link_of[index]] += variable_grads[-1]
    keep_all = _optimizer_keeps_all_gradients(graph.model)
    # Such an optimizer then makes new tensors of the gradients (the clipped
    # or unscaled ones, and the squares of a global norm) as it updates, a
    # few at a time: counted as the largest `Chain.UPDATE_LAG` gradients,
    # the updates in flight at once (`Chain.update_workspace_bytes`).
    update_workspace = sum(sorted(variable_grads, reverse=True)[: strategies.Chain.UPDATE_LAG])

    # NOTE [ Which gradients exist ]
    # A training step differentiates the loss with respect to the trainable
    # variables only, so a tensor has a gradient only if it is a float that
    # some trainable variable flows into: not the model's inputs, not a
    # padding or rescaling of them, not integer ids.
    differentiable: set[int] = set()
    for call, args in zip(graph.calls, call_args):
        if trainable_variables(call.layer) or any(id(t) in differentiable for t in args):
            differentiable.update(
                id(t) for t in call.outputs if keras.backend.is_float_dtype(t.dtype)
            )

    def gradients(tensors: Sequence[keras.KerasTensor]) -> int:
        return sum(size(t) for t in tensors if id(t) in differentiable)

    # A tensor used beyond the next link (a residual shortcut, a long skip) is
    # an extra output of any segment that makes it but ends before its use.
    # Its gradient (when it has one) is made by the backward of its last
    # consumer and lives until the backward of its producer.
    carries, carry_grads = [], []
    carried_in: set[tuple[int, int]] = set()  # (tensor id, consuming link) of carries
    for key, info in graph.tensors.items():
        if info.producer < 0:
            continue
        producer = link_of[info.producer]
        last = n if info.is_output else link_of[info.last_use]
        if last >= producer + 2:
            carries.append((producer, last, size(info.tensor)))
            carried_in.update((key, link_of[c]) for c in info.consumers)
            if key in differentiable:
                carry_grads.append((producer, last, size(info.tensor)))

    names = graph.names
    input_bytes = sum(size(t) for t in graph.model.inputs)
    output_bytes, saved_bytes, workspace_bytes, costs, link_names = [], [], [], [], []
    input_grads: list[int] = []
    boundary = list(graph.model.inputs)  # x_k's tensors: what the link before hands on
    copies: list[int] = []
    for first, stop in groups:
        live_in, live_out = graph.segment_io(first, stop)
        # NOTE [ A link that skips its chain input ]
        # The gradient a link makes for x_k covers only the tensors of x_k it
        # reads. ResNet's projection shortcut reads the block's input, not the
        # main path's last output, which only the Add after it reads: that
        # tensor's gradient is then a carry gradient, not this link's.
        reads = set(live_in)
        input_grads.append(gradients([t for t in boundary if id(t) in reads]))
        # NOTE [ The recompute's input copy ]
        # A block's recompute reads its floating inputs plus a zero that
        # depends on the incoming gradient (layers/recompute.py), so that
        # TensorFlow cannot merge the recompute with the forward: a copy of
        # them, which the first layer's backward can keep until it runs. The
        # chain counts it as a copy of the floating tensors of x_k for a
        # segment starting at link k (`Chain.input_copy_bytes`), an
        # approximation: the block's inputs also hold the carries it reads
        # (a long skip consumed inside), and not the tensors of x_k that only
        # pass it by. tests/test_models.py test_the_recompute_copies_its_input
        # checks it against traced steps.
        copies.append(sum(size(t) for t in boundary if keras.backend.is_float_dtype(t.dtype)))
        boundary = [graph.tensors[key].tensor for key in live_out]
        out = sum(size(graph.tensors[key].tensor) for key in live_out)
        saved = sum(memories[i].kept_bytes for i in range(first, stop))
        saved += sum(
            size(t) for i in range(first, stop) for t in graph.calls[i].outputs if id(t) in needed
        )
        output_bytes.append(out)
        saved_bytes.append(max(saved, out))
        link = len(workspace_bytes)
        # NOTE [ Backward inside a link ]
        # The chain sees a link's backward as one moment with the gradients of
        # its output and input live. Inside a link of several calls, one call's
        # backward holds the gradients of that call's own outputs and inputs,
        # which can be larger (an up-sampling merged with the concatenation
        # after it: the gradient of the up-sampled tensor is 4x the link's
        # input). The excess over the link's gradients counts as workspace.
        # Carried inputs are left out: their gradients are `carry_grads`.
        link_in = input_grads[-1]
        workspace = 0
        for i in range(first, stop):
            inputs = [t for t in call_args[i] if (id(t), link) not in carried_in]
            own = gradients(graph.calls[i].outputs) + gradients(inputs) - out - link_in
            workspace = max(workspace, memories[i].workspace_bytes + max(own, 0))
        workspace_bytes.append(workspace)
        costs.append(
            sum(
                _estimated_flops(graph.calls[i].layer, graph.calls[i].outputs, batch_size)
                for i in range(first, stop)
            )
        )
        link_names.append("+".join(names[first:stop]))
    chain = strategies.Chain(
        input_bytes,
        output_bytes,
        saved_bytes,
        costs,
        workspace_bytes=workspace_bytes,
        grad_bytes=grads if keep_all else None,
        update_grad_bytes=None if keep_all else grads,
        carries=carries,
        carry_grads=carry_grads,
        input_grad_bytes=input_grads,
        input_copy_bytes=copies,
        update_workspace_bytes=update_workspace if keep_all else 0,
        names=link_names,
    )
    return _ModelChain(graph, chain, tuple(groups))


def profile(
    model: keras.Model,
    batch_size: int,
    *,
    progress: Callable[[int, int], None] | None = None,
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
    batch_size = _check_batch_size("profile", batch_size, required_for="profile")
    assert batch_size is not None
    return _profile_graph(LayerGraph.of(model, api="profile"), batch_size, progress).chain


def _resolve_plan(
    api: str,
    graph: LayerGraph,
    strategy: StrategyLike,
    budget: Any,
    batch_size: Any,
    headroom: Any,
) -> tuple[strategies.Plan, _ModelChain]:
    batch_size = _check_batch_size(
        api, batch_size, required_for="a memory budget" if budget is not None else None
    )
    if isinstance(strategy, strategies.Plan):
        for name, value in (("budget", budget), ("headroom", headroom)):
            if value is not None:
                raise ValueError(
                    f"{api}: a Plan already fixes the segments, so a {name} has no effect. "
                    f"Received: {name}={value!r} (of type {type(value).__name__}). Pass "
                    "either a Plan or a strategy name with a budget."
                )
    else:
        chosen = strategies.get(strategy)
    # Without a batch size the bytes are those of one sample: the proportions,
    # which is all a budget-free strategy needs.
    model_chain = _profile_graph(graph, batch_size or 1)
    if isinstance(strategy, strategies.Plan):
        if strategy.chain.names != model_chain.chain.names:
            raise ValueError(
                f"{api}: the plan was made for another model: its chain has "
                f"{strategy.chain.n} links ({strategy.chain.names[0]} ...), this model's has "
                f"{model_chain.chain.n} ({model_chain.chain.names[0]} ...). Received: "
                f"strategy={strategy!r} (of type Plan). Make the plan with "
                "tfrecompute.plan(model, ...) for this model."
            )
        return strategy, model_chain
    return strategies.plan_within(api, chosen, model_chain.chain, budget, headroom), model_chain


def plan(
    model: keras.Model,
    strategy: StrategyLike = "sqrt",
    *,
    budget: int | str | None = None,
    batch_size: int | None = None,
    headroom: float | None = None,
) -> strategies.Plan:
    """Plans which layer calls of a model to recompute, without changing the model.

    Args:
        model: a built `keras.Sequential` or Functional model.
        strategy: a strategy name (see `tfrecompute.strategies.available()`), a
            strategy callable `(chain, budget=None) -> Plan`, or a `Plan`.
        budget: the most memory the step may use, as the allocator counts it
            (`measure_step`), in bytes or as a string like `"2GiB"`; needs
            `batch_size`.
        batch_size: the training batch size.
        headroom: the share of `budget` left for the allocator's rounding of
            chunks: the predicted peak stays under `budget * (1 - headroom)`
            (default `strategies.DEFAULT_HEADROOM`, 0.3; 0 plans to the
            budget itself). Only with a budget.

    Returns:
        The `Plan`; `plan.summary()` names the layers of each segment and gives
        the predicted peak and recompute cost.

    Example:

    ```python
    p = tfrecompute.plan(model, "optimal", budget="1GiB", batch_size=64)
    print(p.summary())
    ```
    """
    chosen, _ = _resolve_plan(
        "plan", LayerGraph.of(model, api="plan"), strategy, budget, batch_size, headroom
    )
    return chosen


def recompute(
    model: keras.Model,
    strategy: StrategyLike = "sqrt",
    *,
    budget: int | str | None = None,
    batch_size: int | None = None,
    headroom: float | None = None,
) -> keras.Model:
    """Returns a checkpointed model: runs of layers grouped into `RecomputeBlock`s.

    The new model shares the original's layers and variables (no copies):
    training one trains the other. Each segment of the plan becomes a
    `RecomputeBlock` around a Functional sub-model of those layer calls (a
    plain list of layers for a Sequential model); tensors that only pass by a
    segment (long skip connections) go around its block.

    Args:
        model: a built `keras.Sequential` or Functional model. Subclassed
            models cannot be traced: wrap their parts in `RecomputeBlock`.
        strategy: a strategy name, a strategy callable, or a `Plan` made by
            `tfrecompute.plan` for this model.
        budget: the most memory the step may use, as the allocator counts it
            (`measure_step`), in bytes or as a string like `"2GiB"`; needs
            `batch_size`.
        batch_size: the training batch size.
        headroom: the share of `budget` left for the allocator's rounding of
            chunks: the predicted peak stays under `budget * (1 - headroom)`
            (default `strategies.DEFAULT_HEADROOM`, 0.3; 0 plans to the
            budget itself). Only with a budget.

    Returns:
        A new `keras.Model` (a `keras.Sequential` for a Sequential model).

    Example:

    ```python
    checkpointed = tfrecompute.recompute(model, "optimal", budget="1GiB", batch_size=64)
    checkpointed.compile(optimizer="adam", loss="mse")
    checkpointed.fit(x, y, batch_size=64)
    ```
    """
    graph = LayerGraph.of(model, api="recompute")
    chosen, model_chain = _resolve_plan("recompute", graph, strategy, budget, batch_size, headroom)
    return graph.rewrite(model_chain.call_segments(chosen.segments))
