"""Budgets checked by measurement: `verified_plan`, and the steps `max_batch_size` repeats.

A plan made from predictions alone keeps a fixed share of its budget for
the allocator's rounding (NOTE [ Budget headroom ] in
`tfrecompute/strategies/headroom.py`). With a labelled sample batch the plan
can be measured instead: `verified_plan` checkpoints the model, runs its
compiled train step (`measure_step`), and re-plans with the measured
correction until the measured step fits the budget and uses most of it.
`max_batch_size` searches for the largest batch whose verified plan fits.

NOTE [ Re-planning with the measured correction ]
The first plan is made under `budget * (1 - DEFAULT_HEADROOM)`, which the
measured step fits on most models of the benchmarks. Its measured peak M
over its planned budget P says how far this model's allocator sits above
the prediction; the next plan is made under `P * AIM * budget / M`, and so
on, for at most `ROUNDS` measured steps, stopping once a measured step
fits and uses at least `FULL` of the budget, or when the next plan is one
already measured. A measured step fits when it is within `1 - MARGIN` of
the budget: the same plan measured again later in the same process, after
other steps left the allocator in another state, took about 10% more
(ResNet50 in benchmarks/results/prediction_accuracy.md). The plan returned
is the least recompute among those whose measured step fitted. Each
measured step runs on the model's weights, which are restored afterwards,
with a fresh copy of its optimizer.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import keras
import numpy as np

from tfrecompute import strategies
from tfrecompute._messages import fail
from tfrecompute.check.measure import measured_step
from tfrecompute.check.twin import (
    check_compiled,
    compiled_like,
    functional_twin,
    labelled,
    weights_restored,
)
from tfrecompute.costs.profile import ProfiledModel
from tfrecompute.errors import InfeasibleBudgetError
from tfrecompute.layers.in_place import Checkpoints, restored_on_error
from tfrecompute.pipeline import apply_plan, budget_chain, check_options
from tfrecompute.strategies.plan import chain_budget
from tfrecompute.strategies.units import check_budget, format_budget

__all__ = ["Probe", "VerifiedPlan", "planner", "verified_plan", "verify"]

MARGIN = 0.1  # a measured step fits when within (1 - MARGIN) of the budget
AIM = 0.87  # the share of the budget a re-plan aims its measured peak at
FULL = 0.8  # a fitting measured step at or above this share of the budget ends the search
ROUNDS = 4  # at most this many measured steps per verified plan
OVER = 1.25  # a least predicted peak up to this share of the budget is still measured


@dataclasses.dataclass(frozen=True)
class Probe:
    """One measured step of a candidate plan.

    Attributes:
        planned_bytes: the budget the plan was made under (of predicted bytes).
        predicted_bytes: the plan's predicted peak.
        measured_bytes: the allocator's peak of its compiled train step.
        recompute_cost: the plan's recompute cost.
        state_bytes: the model's weights and its optimizer's variables: what
            the device holds besides the step (not part of the budget).
    """

    planned_bytes: int
    predicted_bytes: int
    measured_bytes: int
    recompute_cost: float
    state_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class VerifiedPlan:
    """A plan whose compiled train step was measured to fit its budget.

    Attributes:
        plan: the plan (predicted peak and recompute cost as any plan).
        model: the model, checkpointed by the plan (the same object, as
            `tfrecompute.recompute` returns it).
        peak_bytes: the allocator's peak of its measured train step.
        budget_bytes: the budget.
        probes: every plan measured on the way, in order.
    """

    plan: strategies.Plan
    model: keras.Model
    peak_bytes: int
    budget_bytes: int
    probes: tuple[Probe, ...]

    @property
    def state_bytes(self) -> int:
        """The weights and optimizer variables the device holds besides the step's budget."""
        return max(p.state_bytes for p in self.probes)

    @property
    def share(self) -> float:
        """The measured peak as a share of the budget."""
        return self.peak_bytes / self.budget_bytes


def _measured(model: keras.Model, applied: Checkpoints | None) -> keras.Model:
    """A model that runs as `model` now does, to compile and measure without touching
    `model`'s own optimizer: the rebuilt model its call runs, else a Functional model
    over its graph (whose calls checkpointed in place run as in `model`)."""
    if applied is not None and applied.runtime is not None:
        return applied.runtime
    return functional_twin(model)


@dataclasses.dataclass
class _Planner:
    """What a verified plan needs at one batch: the chain, its calls, the strategy."""

    api: str
    model: keras.Model
    chain: strategies.Chain
    strategy: Callable[..., strategies.Plan]
    x: Any
    y: Any
    policy: Any = None

    @property
    def profiled(self) -> ProfiledModel:
        source = self.chain.source
        assert isinstance(source, ProfiledModel)
        return source

    def apply(self, plan: strategies.Plan) -> Checkpoints | None:
        """Checkpoints the model by `plan` (replacing what was applied before)."""
        return apply_plan(self.api, plan, self.policy)

    def measure(self, plan: strategies.Plan, planned: int) -> Probe:
        """Measures `plan`'s compiled step; the model's weights are restored afterwards."""
        with weights_restored(self.model):
            measured = compiled_like(self.api, self.model, _measured(self.model, self.apply(plan)))
            step = measured_step(self.api, measured, self.x, self.y, steps=2)
            state = _bytes(measured.variables) + _bytes(measured.optimizer.variables)
        return Probe(planned, plan.peak_bytes, step.peak_bytes, plan.recompute_cost, state)


def _bytes(variables: Any) -> int:
    return sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in variables)


def planner(
    api: str,
    model: keras.Model,
    sample: Any,
    strategy: Any,
    *,
    depth: Any = None,
    where: Any = None,
    policy: Any = None,
) -> _Planner:
    """Checks the sample and the model, and profiles the model at the sample's shapes."""
    check_options(api, model, policy=policy, where=where)
    x, y = labelled(api, sample)
    check_compiled(api, model)
    chosen = strategies.get(strategy, api=api, argument="strategy")
    chain = budget_chain(  # verified for a budget
        api, model, sample, None, chosen, depth=depth, where=where, policy=policy, budgeted=True
    )
    source = chain.source
    assert isinstance(source, ProfiledModel)
    if source.graph.root is None:
        fail(
            api,
            "a verified plan measures the compiled train step of a Functional model that runs "
            "as the checkpointed model does, with a fresh copy of its optimizer, and a "
            "subclassed model's call cannot be rebuilt into one",
            "model",
            model,
            "Plan it with tfrecompute.recompute(model, budget=..., sample=...) and the default "
            "headroom, or measure a plan yourself with tfrecompute.measure_step",
            by_name=True,
        )
    return _Planner(api, model, chain, chosen, x, y, policy)


def verify(
    planner: _Planner, budget: Any, *, progress: Callable[[Probe], None] | None = None
) -> VerifiedPlan:
    """NOTE [ Re-planning with the measured correction ] for a profiled model."""
    total = chain_budget(planner.api, planner.chain, budget)
    with restored_on_error(planner.model):
        return _verify(planner, total, budget, progress)


def _verify(
    planner: _Planner, total: int, budget: Any, progress: Callable[[Probe], None] | None
) -> VerifiedPlan:
    planned, first = _first_plan(planner, total, budget)
    plan: strategies.Plan | None = first
    # A plan is its segments and their states: re-planning can change only the states.
    measured: dict[tuple[Any, ...], Probe] = {}
    plans: dict[tuple[Any, ...], strategies.Plan] = {}
    probes: list[Probe] = []
    limit = math.floor(total * (1 - MARGIN))
    while plan is not None and _key(plan) not in measured and len(probes) < ROUNDS:
        probe = planner.measure(plan, planned)
        measured[_key(plan)], plans[_key(plan)] = probe, plan
        probes.append(probe)
        if progress is not None:
            progress(probe)
        if FULL * total <= probe.measured_bytes <= limit:
            break
        planned = math.floor(planned * AIM * total / max(probe.measured_bytes, 1))
        plan = _plan_or_none(planner, planned)
    fitting = [key for key, p in measured.items() if p.measured_bytes <= limit]
    if not fitting:
        _none_fits(planner.api, budget, total, probes)
    best = min(fitting, key=lambda s: (measured[s].recompute_cost, -measured[s].measured_bytes))
    chosen = plans[best]
    planner.apply(chosen)
    return VerifiedPlan(chosen, planner.model, measured[best].measured_bytes, total, tuple(probes))


def _key(plan: strategies.Plan) -> tuple[Any, ...]:
    """What tells measured plans apart: the segments and each one's state."""
    return (plan.segments, plan.selective)


def _first_plan(planner: _Planner, total: int, budget: Any) -> tuple[int, strategies.Plan]:
    """The first plan: under the default headroom, or as low as plans go when that is
    infeasible. Predictions can exceed the measured peak, so the least-peak plan is
    measured even when predicted up to `OVER` times the budget; beyond that
    `InfeasibleBudgetError` is raised."""
    try:
        # `budget` as given (its bytes are `total`), for the error to quote it
        within = strategies.plan_within(planner.api, planner.strategy, planner.chain, budget, 0)
    except InfeasibleBudgetError as error:
        if error.minimum > OVER * total:
            raise
        least = planner.strategy(planner.chain, budget=None)  # measured: it may still fit
        return least.peak_bytes, least
    planned = max(
        math.floor(total * (1 - strategies.DEFAULT_HEADROOM)), strategies.min_peak(planner.chain)
    )
    plan = _plan_or_none(planner, planned)
    return (planned, plan) if plan is not None else (total, within)


def _plan_or_none(planner: _Planner, planned: int) -> strategies.Plan | None:
    """The strategy's plan under `planned` predicted bytes, None if none fits there."""
    try:
        return planner.strategy(planner.chain, budget=max(planned, 1))
    except InfeasibleBudgetError:
        return None


def _none_fits(api: str, budget: Any, total: int, probes: list[Probe]) -> None:
    least = min(probes, key=lambda p: p.measured_bytes)
    needed = math.ceil(least.measured_bytes / (1 - MARGIN))
    fmt = strategies.format_size
    raise InfeasibleBudgetError(
        f"{api}: no measured train step fits the budget {format_budget(budget, total)} (less "
        f"{MARGIN:.0%} for the allocator's variation between steps): the least of "
        f"{len(probes)} measured plans took {fmt(least.measured_bytes)} (predicted "
        f"{fmt(least.predicted_bytes)}). Received: budget={budget!r} (of type "
        f"{type(budget).__name__}). Raise the budget to at least {fmt(needed)}, "
        "or reduce the batch size.",
        budget=total,
        minimum=needed,
    )


def verified_plan(
    model: keras.Model,
    sample: Any,
    *,
    budget: int | float | str,
    strategy: Any = "optimal",
    depth: int | None = None,
    where: Any = None,
    policy: Any = None,
    progress: Callable[[Probe], None] | None = None,
) -> VerifiedPlan:
    """A plan whose compiled train step is measured to fit `budget`, using most of it.

    Plans `model` at the sample's shapes, checkpoints it, runs its compiled
    train step (the one `model.fit` runs, with a fresh copy of the model's
    optimizer and its loss) and reads the allocator's peak; then re-plans
    with the measured correction until the measured step fits within 90% of
    the budget (room for the allocator's variation between steps) and uses
    at least 80% of it (NOTE [ Re-planning with the measured correction ] in
    `tfrecompute.check.verified_plan`), at most 4 measured steps. The
    headroom thus comes from the measurement instead of the fixed
    `strategies.DEFAULT_HEADROOM` a plan without a sample keeps. The model's
    weights are restored after each measured step. `recompute(model,
    budget=..., sample=(x, y), verify=True)` returns its `.model`.

    Args:
        model: a built, compiled Keras model.
        sample: `(x, y)` (or `(x, y, sample_weight)`): one training batch at
            the batch size you train with, labels included.
        budget: the most memory the step may add, as `measure_step` counts
            it, in bytes or as a string like `"512MiB"`, or a share of the
            predicted peak of storing everything at the sample's batch size
            (`0.5` for half; `VerifiedPlan.budget_bytes` is its bytes).
        strategy: a strategy that takes a budget (`"optimal"`, `"heuristic"`),
            or `"none"`/`"sqrt"` to verify a fixed plan.
        depth, where, policy: as for `recompute`.
        progress: called with each `Probe` as it is measured.

    Returns:
        A `VerifiedPlan`: the plan, the model (checkpointed by it, as
        `recompute` leaves it; on an error the model keeps what it had),
        its measured peak.

    Raises:
        ValueError: the sample has no labels, or the model is not compiled.
        InfeasibleBudgetError: no plan is predicted to fit, or none of the
            measured ones fitted; the message gives the least measured peak.

    Example:

    ```python
    model.compile(optimizer="adam", loss="mse")
    verified = tfrecompute.verified_plan(model, (x[:64], y[:64]), budget="1GiB")
    print(verified.peak_bytes / 2**20, verified.share)
    verified.model.fit(x, y, batch_size=64)
    ```
    """
    check_budget(budget, api="verified_plan", name="budget")  # refused before any profiling
    made = planner(
        "verified_plan", model, sample, strategy, depth=depth, where=where, policy=policy
    )
    return verify(made, budget, progress=progress)
