"""Exception types raised by tfrecompute.

This module is pure Python (no TensorFlow import) so that the planner in
`tfrecompute.strategies` can use it without TensorFlow installed.
"""

from __future__ import annotations

__all__ = [
    "InfeasibleBudgetError",
    "NonReplayableRandomnessError",
    "RecomputeMismatchError",
    "TfrecomputeError",
    "UntraceableModelError",
]


class TfrecomputeError(Exception):
    """Base class of the errors specific to tfrecompute."""


class InfeasibleBudgetError(TfrecomputeError, ValueError):
    """A memory budget is below the least peak any plan can reach.

    Attributes:
        budget: the budget that was asked for, in bytes.
        minimum: the least feasible budget, in bytes.
    """

    def __init__(self, message: str, *, budget: int, minimum: int) -> None:
        super().__init__(message)
        self.budget = budget
        self.minimum = minimum


class NonReplayableRandomnessError(TfrecomputeError, ValueError):
    """A recomputed block draws random numbers that cannot be replayed.

    Stateful TensorFlow random ops (`tf.random.uniform` without a seed
    generator, `tf.random.Generator`, unseeded `keras.random` calls that use the
    global seed generator) would draw different numbers in the recompute than
    in the forward pass, which makes gradients silently wrong.
    """


class RecomputeMismatchError(TfrecomputeError, RuntimeError):
    """A recompute produced other tensors than the forward (debug mode only)."""


class UntraceableModelError(TfrecomputeError, ValueError):
    """A model's call cannot be traced in training mode, so its calls cannot be planned.

    tfrecompute finds a model's calls by tracing `model(x, training=True)` once
    in a `tf.function`; a call that branches in Python on a tensor's value, or
    whose ops have no kernel for the dtypes of a mixed-precision policy, stops
    that trace (a Python branch on a tensor's value stops `model.fit`'s compiled
    step too).
    `recompute` without a budget leaves such a model as it was and warns;
    `plan`, a budget or `verify=True` raise this error.
    """
