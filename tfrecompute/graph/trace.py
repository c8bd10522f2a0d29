"""From a model to its layer graph: the tracing every model-level entry point starts with.

`traced_graph` checks the model and the sample (building an unbuilt model
from the sample, as `fit` would), traces the model's call once on
placeholders of the sample's shapes, and expands the recorded calls into the
`LayerGraph` that costs are read from and plans are applied to. It sees the
model as defined (`as_defined`: checkpoints suspended, outside any
`tf.distribute` strategy's scope).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import keras

from tfrecompute._messages import as_count, as_positive_int, fail
from tfrecompute.distribute import outside_strategy_scope
from tfrecompute.graph.call_tree import input_specs, not_a_batch, sample_inputs, trace_model
from tfrecompute.graph.expand import expand, selected, selection
from tfrecompute.graph.layer_graph import LayerGraph
from tfrecompute.layers.in_place import suspended

__all__ = [
    "as_defined",
    "batch_of",
    "built_by_sample",
    "check_batch_size",
    "check_model",
    "traced_graph",
]


def check_model(api: str, model: Any) -> None:
    """Raises unless `model` is a Keras model."""
    if not isinstance(model, keras.Model):
        fail(api, "`model` must be a Keras model", "model", model, "Pass a keras.Model",
             error=TypeError)  # fmt: skip


@contextlib.contextmanager
def as_defined(model: keras.Model) -> Iterator[None]:
    """Traces and profiles see `model` as it was defined (NOTE [ A checkpointed model is
    the model ]), outside a strategy's scope (NOTE [ Tracing costs inside a strategy's
    scope ])."""
    with suspended(model), outside_strategy_scope():
        yield


def traced_graph(
    api: str,
    model: keras.Model,
    sample: Any,
    batch_size: Any,
    *,
    depth: Any = None,
    where: Any = None,
) -> LayerGraph:
    """The model's `LayerGraph`, from one trace at the sample's (or its inputs') shapes."""
    check_model(api, model)
    if not model.built and sample is not None:
        built_by_sample(api, model, sample)
    if not model.built:
        fail(
            api,
            "the model is not built, so its calls are unknown",
            "model",
            model,
            "Call it on a batch first, give it an input shape (keras.Input(...)), or pass sample=",
            by_name=True,
        )
    checked = check_batch_size(api, batch_size)
    depth = None if depth is None else as_count(api, "depth", depth)
    chosen = selection(api, where)
    with as_defined(model):
        specs = input_specs(api, model, sample, checked)
        root = trace_model(model, specs, api=api)
        graph = expand(model, root, depth=depth, where=chosen)
        graph.specs = specs
    graph.check_static_shapes(api)
    if chosen is not None and not any(selected(chosen, c.layer) for c in graph.calls):
        fail(
            api,
            "`where` selects no layer call of the model",
            "where",
            where,
            "Pass a layer class, names or a predicate that some layer the model calls "
            "matches (see model.summary(expand_nested=True))",
        )
    return graph


def built_by_sample(api: str, model: keras.Model, sample: Any) -> None:
    """Builds an unbuilt model as `fit` would: one call on the sample's first example.

    A subclassed model, or a Sequential one without `keras.Input`, makes its
    variables on its first call; the call runs here, in the caller's strategy
    scope (so its variables are the strategy's), before tracing steps out of it.
    """
    try:
        first = keras.tree.map_structure(lambda value: value[:1], sample_inputs(sample))
    except (TypeError, IndexError) as error:
        not_a_batch(api, sample, error)
    model(first, training=False)


def batch_of(graph: LayerGraph) -> int:
    """The batch size the graph was traced at: the leading dimension of its first input."""
    for tensor in graph.inputs:
        if tensor.shape and tensor.shape[0] is not None:
            return int(tensor.shape[0])
    return 1


def check_batch_size(api: str, batch_size: Any, *, required_for: str | None = None) -> int | None:
    """Validates a batch size; None passes unless `required_for` names what needs it."""
    if batch_size is None:
        if required_for:
            fail(
                api,
                f"{required_for} needs the batch size, because activation bytes grow with it",
                "batch_size",
                batch_size,
                "Pass the batch size you train with, e.g. batch_size=64, or a sample batch "
                "(sample=)",
            )
        return None
    return as_positive_int(api, "batch_size", batch_size, example="batch_size=64")
