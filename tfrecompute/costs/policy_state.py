"""A link's third state: what it keeps and costs when recomputed under a recompute policy.

`policy_link_costs` traces each layer call of a profiled graph once more, in
a `tf.function` without running it, with the policy's `Recorder` active (NOTE
[ Recompute policies ] in `layers/policy.py`): the products the policy keeps
are those a block's forward would keep. Per link, their output bytes are
`Chain.policy_kept_bytes`, and the link's forward cost less their FLOPs is
`Chain.policy_forward_cost`, what its recompute still costs.

A product's FLOPs are `2 * output elements * contraction size`, the
contraction read from its operands: the last dimension of a matmul's first
operand, the letters an einsum sums over, a convolution kernel's size without
its output channels (without its multiplier for a depthwise one). The link's
forward cost is the profile's estimate (about two FLOPs per weight and output
position), so the difference is floored at zero.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import keras
import tensorflow as tf

from tfrecompute._keras_internals import call_has_training_arg
from tfrecompute.graph.layer_graph import Call, LayerGraph, cost_keys
from tfrecompute.layers.policy import Policy, Recorder, active

__all__ = ["kept_products", "policy_link_costs"]


def _contraction(kind: str, args: Any) -> int:
    """The number of multiply-adds per output element of a product."""
    shapes = [tuple(a.shape) for a in keras.tree.flatten(args) if hasattr(a, "shape")]
    if kind == "einsum" and isinstance(args[0], str):
        inputs, _, output = args[0].replace(" ", "").partition("->")
        sizes: dict[str, int] = {}
        for letters, shape in zip(inputs.split(","), shapes):
            for letter, size in zip(letters, shape):
                sizes[letter] = int(size or 1)
        summed = set("".join(inputs.split(","))) - set(output)
        return math.prod(sizes.get(letter, 1) for letter in summed)
    if kind in ("matmul", "dot", "tensordot") and shapes and shapes[0]:
        return int(shapes[0][-1] or 1)
    if len(shapes) >= 2 and shapes[1]:
        kernel = shapes[1]
        return math.prod(int(d or 1) for d in kernel[:-2]) * (
            1 if kind == "depthwise_conv" else int(kernel[-2] or 1)
        )
    return 1


class _Measuring(Recorder):
    """A `Recorder` that also adds up the bytes and FLOPs of the products it keeps."""

    def __init__(self, policy: Policy) -> None:
        super().__init__("profile", policy)
        self.kept_bytes = 0
        self.kept_flops = 0.0

    def handle(self, kind: str, original: Any, args: Any, kwargs: Any) -> Any:
        count = len(self.saved)
        output = super().handle(kind, original, args, kwargs)
        if len(self.saved) > count:
            elements = output.shape.num_elements() or 0
            self.kept_bytes += elements * output.dtype.size
            self.kept_flops += 2.0 * elements * _contraction(kind, args)
        return output


def _call_products(call: Call, batch_size: int, policy: Policy) -> tuple[int, float]:
    """(bytes, FLOPs) of the products `policy` keeps in one traced call."""
    if call.glue:
        return 0, 0.0
    flat = keras.tree.flatten((call.args, call.kwargs))
    symbolic = list({id(t): t for t in flat if isinstance(t, keras.KerasTensor)}.values())
    specs = [
        tf.TensorSpec(
            [batch_size if d is None else d for d in t.shape],
            keras.backend.standardize_dtype(t.dtype),
        )
        for t in symbolic
    ]
    found: list[_Measuring] = []

    def step(*values: tf.Tensor) -> None:
        mapping = {id(t): v for t, v in zip(symbolic, values)}

        def substitute(value: Any) -> Any:
            return mapping[id(value)] if isinstance(value, keras.KerasTensor) else value

        kwargs = keras.tree.map_structure(substitute, call.kwargs)
        if call_has_training_arg(call.layer):
            kwargs["training"] = True
        recorder = _Measuring(policy)
        found.append(recorder)
        with active(recorder):
            call.layer(*keras.tree.map_structure(substitute, call.args), **kwargs)

    tf.function(step, autograph=False).get_concrete_function(*specs)
    return found[-1].kept_bytes, found[-1].kept_flops


def kept_products(
    graph: LayerGraph,
    links: Sequence[tuple[int, int]],
    batch_size: int,
    policy: Policy,
    *,
    where: Callable[[Call], bool] | None = None,
) -> list[tuple[int, float]]:
    """Per link, the (bytes, FLOPs) of the products `policy` keeps in its calls (those
    `where` selects), traced once per distinct call (NOTE [ Calls that cost the same ])."""
    cache: dict[tuple[Any, ...], tuple[int, float]] = {}
    keys = cost_keys(graph.calls)
    found = []
    for first, stop in links:
        link_bytes, link_flops = 0, 0.0
        for call, key in zip(graph.calls[first:stop], keys[first:stop]):
            if where is not None and not where(call):
                continue
            if key not in cache:
                cache[key] = _call_products(call, batch_size, policy)
            link_bytes += cache[key][0]
            link_flops += cache[key][1]
        found.append((link_bytes, link_flops))
    return found


def policy_link_costs(
    graph: LayerGraph,
    links: Sequence[tuple[int, int]],
    batch_size: int,
    policy: Policy,
    forward_costs: Sequence[float],
    estimated_flops: Sequence[float],
) -> tuple[list[int], list[float]]:
    """Per link, the bytes the policy keeps and the cost of its recompute under the policy.

    The recompute under the policy costs the link's forward cost less the
    share of its estimated FLOPs that the kept products make up, so that it
    is in the forward cost's units whether those are estimated FLOPs or
    measured seconds (`profile(..., measure_time=True)`).

    Args:
        graph: the profiled layer graph.
        links: each link's calls, `(first, stop)`.
        batch_size: the size of the leading `None` dimension.
        policy: the policy function (see `layers.policy.resolve_policy`).
        forward_costs: each link's forward cost, as profiled.
        estimated_flops: each link's estimated forward FLOPs.
    """
    kept, costs = [], []
    products = kept_products(graph, links, batch_size, policy)
    for (link_bytes, link_flops), forward, flops in zip(products, forward_costs, estimated_flops):
        kept.append(link_bytes)
        costs.append(forward * max(0.0, 1.0 - link_flops / flops) if flops > 0 else forward)
    return kept, costs
