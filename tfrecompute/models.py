"""Checkpoint whole models: `plan` and `recompute` (orchestration only).

`plan` profiles the model (`tfrecompute.costs`) and runs a strategy on its
chain; `recompute` applies a plan (`tfrecompute.rewrite`). A plan made by
`plan` or on a chain from `profile` knows the model's calls through its
chain's `source`, so `recompute(model, plan)` does not profile again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras

from tfrecompute import strategies
from tfrecompute._messages import fail
from tfrecompute.costs import (
    COMPILED,
    ProfiledModel,
    check_batch_size,
    profile_graph,
    profiled_model,
)
from tfrecompute.graph import LayerGraph
from tfrecompute.rewrite import rewrite

__all__ = ["plan", "recompute"]

StrategyLike = str | Callable[..., strategies.Plan] | strategies.Plan


def _resolve_plan(
    api: str,
    model: keras.Model,
    strategy: StrategyLike,
    budget: Any,
    batch_size: Any,
    headroom: Any,
) -> tuple[strategies.Plan, ProfiledModel]:
    """The plan to apply, and the profile of the model's calls it refers to."""
    batch_size = check_batch_size(
        api, batch_size, required_for="a memory budget" if budget is not None else None
    )
    if isinstance(strategy, strategies.Plan):
        for name, value in (("budget", budget), ("headroom", headroom)):
            if value is not None:
                fail(
                    api,
                    f"a Plan already fixes the segments, so a {name} has no effect",
                    name,
                    value,
                    "Pass either a Plan or a strategy name with a budget",
                )
        return strategy, _profile_of_plan(api, model, strategy)
    chosen = strategies.get(strategy)
    # Without a batch size the bytes are those of one sample: the proportions,
    # which is all a budget-free strategy needs.
    chain = profile_graph(LayerGraph.of(model, api=api), batch_size or 1, COMPILED, api=api)
    made = strategies.plan_within(api, chosen, chain, budget, headroom)
    profiled = profiled_model(made.chain, model)
    assert profiled is not None  # strategies plan the chain they are given
    return made, profiled


def _profile_of_plan(api: str, model: keras.Model, plan: strategies.Plan) -> ProfiledModel:
    """Which calls of `model` the links of `plan` are; profiles only a plan made elsewhere.

    A plan on a chain `profile` made for this model carries the map. A plan on
    any other chain (built by hand, or profiled from another model object)
    applies if this model's chain has the same link names.
    """
    known = profiled_model(plan.chain, model)
    if known is not None:
        return known
    chain = profile_graph(LayerGraph.of(model, api=api), 1, COMPILED, api=api)
    if plan.chain.names != chain.names:
        fail(
            api,
            f"the plan was made for another model: its chain has {plan.chain.n} links "
            f"({plan.chain.names[0]} ...), this model's has {chain.n} ({chain.names[0]} ...)",
            "strategy",
            plan,
            "Make the plan with tfrecompute.plan(model, ...) for this model",
        )
    profiled = profiled_model(chain, model)
    assert profiled is not None
    return profiled


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
    chosen, _ = _resolve_plan("plan", model, strategy, budget, batch_size, headroom)
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
    chosen, profiled = _resolve_plan("recompute", model, strategy, budget, batch_size, headroom)
    return rewrite(profiled.graph, profiled.call_segments(chosen.segments))
