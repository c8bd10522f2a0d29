"""The optimizer's part of a step's memory: the gradients it holds, what its updates make.

`optimizer_costs` gives the `Chain` fields that depend on the optimizer:
which weight gradients are kept to the step's end or applied as they come
(NOTE [ Parameter gradients ]), and the temporaries of its updates (NOTE
[ The optimizer's update workspace ]), measured once per optimizer
configuration by `update_workspace_ratio`.

NOTE [ The optimizer's update workspace ]
An update makes temporaries of its variable's size on top of the gradient:
Adam squares the gradient and takes the root of its second moment. Measured
here (tensorflow 2.21, CPU, float32) in variables' sizes: SGD 0, Adam and
AdamW 2 to 3 (tests/costs/test_optimizer.py). Where the weights are large
beside the activations (a small batch, a large vocabulary) an update is the
step's peak: one Dense(2048) at batch 1 under Adam peaks at 48 MiB, its
16 MiB gradient and two temporaries of the kernel's size.

`update_workspace_ratio` measures it: a clone of the optimizer (its slots
are not the model's) updates a 16 MiB float32 variable from a gradient made
inside the same function, as the train step's gradients are (so that the
update may reuse the gradient's buffer, as it does in the step); the
allocator's peak above the variable, less the gradient, over the variable's
bytes, the most of three updates (the order its ops run in moves it by a
variable's size either way). The chain counts the ratio times
the largest trainable variable: as `Chain.applied_workspace_bytes` at every
backward moment when gradients are applied as they come, and on top of
`Chain.update_workspace_bytes` at the step's end when the optimizer keeps
them all. A model not compiled yet is modelled with Adam
(`compiled_or_adam`). Global clipping and accumulation are left out of the
clone (those copies are the keep-all workspace already); a loss-scale
optimizer is measured by its inner one. The probe runs in a thread of its
own (`tfrecompute.distribute.in_own_thread`), outside any `tf.distribute` strategy of the caller:
its optimizer and variable are not the model's.
tests/costs/test_optimizer.py checks the ratios and the predicted peaks of
small-batch steps against measured ones.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from typing import Any

import keras
import tensorflow as tf

from tfrecompute import strategies
from tfrecompute.costs.measured import measurement_device, memory_info
from tfrecompute.distribute import in_own_thread
from tfrecompute.graph.layer_graph import LayerGraph, tensor_bytes, trainable_variables

__all__ = [
    "OptimizerCosts",
    "compiled_or_adam",
    "keeps_all_gradients",
    "optimizer_costs",
    "update_workspace_ratio",
    "whole_variables",
]

PROBE_ELEMENTS = 1 << 22  # 16 MiB of float32: other threads' allocations are small beside it
PROBE_RUNS = 3  # the first update after others can reuse their buffers: the most of three
PROBE_SLACK = 0.25  # of a variable: what other threads allocate meanwhile, rounded away
_KEEP_ALL_OPTIONS = ("global_clipnorm", "gradient_accumulation_steps")
_ratios: dict[tuple[str, str, str], float] = {}
_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class OptimizerCosts:
    """The `Chain` fields that follow from the optimizer (passed as keyword arguments)."""

    kept_grad_bytes: list[int] | None
    applied_grad_bytes: list[int] | None
    update_workspace_bytes: int
    applied_workspace_bytes: int


def compiled_or_adam(model: keras.Model) -> Any:
    """The optimizer `model` was compiled with; Adam's (the common choice) if not compiled yet.

    Models are often checkpointed before `compile`, and a plan that leaves
    out the updates' temporaries can save less than it predicts where the
    weights are large beside the activations (see the NOTE above).
    """
    compiled = getattr(model, "optimizer", None)
    if compiled is not None:
        return compiled
    # Made in a thread of its own: Adam's `iterations` variable would otherwise be made
    # by a `tf.distribute` strategy whose scope profiling stepped out of (NOTE above).
    return in_own_thread(keras.optimizers.Adam)


def keeps_all_gradients(optimizer: Any) -> bool:
    """Whether `optimizer` needs every gradient before any update."""
    if optimizer is None:
        return False
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return True
    return bool(any(getattr(optimizer, option, None) for option in _KEEP_ALL_OPTIONS))


def update_workspace_ratio(optimizer: Any, *, device: str | None = None) -> float:
    """The temporaries of one update of `optimizer`, in its variable's bytes (see the NOTE).

    0.0 for None (no optimizer known), and for an optimizer that cannot be
    cloned from its config (logged: its updates are then not counted).
    """
    if optimizer is None:
        return 0.0
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer
    name = device or measurement_device()
    try:
        config = {k: v for k, v in optimizer.get_config().items() if k not in _KEEP_ALL_OPTIONS}
        options = {k: v for k, v in config.items() if k != "name"}
        key = (type(optimizer).__qualname__, json.dumps(options, sort_keys=True, default=str), name)
        if key not in _ratios:
            _ratios[key] = in_own_thread(_measured_ratio, type(optimizer), config, name)
    except Exception as error:  # a custom optimizer's config, or its update, failed
        _log.warning(
            "profile: the updates of %s were not measured (%s); the predicted peak leaves "
            "out their temporaries.",
            type(optimizer).__name__,
            error,
        )
        return 0.0
    return _ratios[key]


def _measured_ratio(optimizer_class: Any, config: dict[str, Any], device: str) -> float:
    # Made here, in the probe's thread: an optimizer keeps the strategy it is made in.
    clone = optimizer_class.from_config(config)
    with tf.device(device):
        variable = keras.Variable(tf.zeros([PROBE_ELEMENTS]), dtype="float32", name="probe")
        clone.build([variable])

        def update(value: tf.Tensor) -> None:
            clone.apply([tf.fill([PROBE_ELEMENTS], value)], [variable])

        step = tf.function(update, autograph=False)
        value = tf.constant(1e-3)
        step(value)  # traces it
        peaks = []
        for _ in range(PROBE_RUNS):
            before = memory_info("profile", device)["current"]
            tf.config.experimental.reset_memory_stats(device)
            step(value)
            peaks.append(memory_info("profile", device)["peak"] - before)
    return whole_variables(peaks, 4 * PROBE_ELEMENTS)


def whole_variables(peaks: list[int], variable_bytes: int) -> float:
    """The most temporaries, in whole variables, of updates that peaked at `peaks` bytes.

    Less the gradient itself. An elementwise update's temporaries are whole
    variables; what is left over is not the update's but another thread's,
    such as a `tf.data` pipeline of an earlier `fit` still prefetching: up
    to `PROBE_SLACK` of a variable is rounded away.
    """
    most = max(peaks) / variable_bytes - 1
    return float(max(math.floor(most + PROBE_SLACK), 0))


def optimizer_costs(
    graph: LayerGraph, link_of: list[int], n: int, optimizer: Any
) -> OptimizerCosts:
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
    tests/costs/test_profile.py test_parameter_gradients_follow_the_optimizer checks
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
    largest = sorted(variable_grads, reverse=True)
    update = round(update_workspace_ratio(optimizer) * largest[0]) if largest else 0
    if keeps_all_gradients(optimizer):
        copies = sum(largest[: strategies.Chain.UPDATE_LAG])
        return OptimizerCosts(per_link, None, copies + update, 0)
    return OptimizerCosts(None, per_link, 0, update)
