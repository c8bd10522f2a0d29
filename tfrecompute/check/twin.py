"""A model's train step, measured without touching the model's own optimizer.

`verified_plan` and `calibrate` measure a compiled train step of a model
while the user's model keeps its optimizer and weights: they compile a twin
(the same layers, as a Functional model over the model's graph, or the
model a rewrite runs) with a fresh copy of the optimizer, and restore the
weights after the step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import keras
import numpy as np

from tfrecompute._messages import fail
from tfrecompute.graph.layer_graph import declared_input, declared_output

__all__ = [
    "check_compiled",
    "compiled_like",
    "functional_twin",
    "labelled",
    "weights_restored",
]


def labelled(api: str, sample: Any) -> tuple[Any, Any]:
    """`(x, y)` of a sample given as `(x, y)` or `(x, y, sample_weight)`; else an error."""
    if not isinstance(sample, tuple) or len(sample) not in (2, 3) or sample[1] is None:
        fail(
            api,
            "measuring a train step needs a sample batch with its labels",
            "sample",
            sample,
            "Pass sample=(x, y) as passed to fit, with y one batch of targets",
        )
    return sample[0], sample[1]


def check_compiled(api: str, model: keras.Model) -> None:
    """Raises unless `model` is compiled: its train step is what is measured."""
    if not getattr(model, "compiled", False) or getattr(model, "optimizer", None) is None:
        fail(
            api,
            "the model is not compiled, so its train step (optimizer and loss) is unknown",
            "model",
            model,
            'Call model.compile(optimizer=..., loss=...) first, e.g. model.compile("sgd", "mse")',
            by_name=True,
        )


def functional_twin(model: keras.Model) -> keras.Model:
    """A Functional model over `model`'s graph: the same layers, called the same way."""
    return keras.Model(declared_input(model), declared_output(model), name=f"{model.name}_measured")


def compiled_like(api: str, model: keras.Model, rewritten: keras.Model) -> keras.Model:
    """`rewritten`, compiled with a fresh copy of `model`'s optimizer and its loss."""
    check_compiled(api, model)
    optimizer = type(model.optimizer).from_config(model.optimizer.get_config())
    rewritten.compile(
        optimizer=optimizer,
        loss=model.loss,
        jit_compile=bool(getattr(model, "jit_compile", False)),
        run_eagerly=bool(getattr(model, "run_eagerly", False)),
    )
    return rewritten


@contextlib.contextmanager
def weights_restored(model: keras.Model) -> Iterator[None]:
    """Every variable of `model` (weights, statistics, seed states) set back to its value
    on entry when the block ends, also on an error: a twin trains the same variables."""
    values = [np.array(v.numpy()) for v in model.variables]
    try:
        yield
    finally:
        for variable, value in zip(model.variables, values):
            variable.assign(value)
