"""Budget headroom: plan a model's budget less a share for the allocator's rounding."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from fractions import Fraction
from typing import Any

from tfrecompute._messages import fail, received
from tfrecompute.errors import InfeasibleBudgetError
from tfrecompute.strategies.chain import Chain
from tfrecompute.strategies.optimize import least_replayed, optimal
from tfrecompute.strategies.plan import Plan, chain_budget
from tfrecompute.strategies.units import budget_share, format_budget, format_size

__all__ = [
    "CALIBRATED_HEADROOM",
    "DEFAULT_HEADROOM",
    "check_headroom",
    "headroom_of",
    "plan_within",
]

DEFAULT_HEADROOM = 0.3
"""Share of a model's budget the planner leaves for the allocator's rounding.

NOTE [ Budget headroom ]
The memory model predicts the bytes a step's tensors request. TensorFlow's
BFC allocator serves each request from a free chunk of up to twice its size
(NOTE [ Requested and allocated bytes ] in tfrecompute/check/measure.py), so what
the allocator holds, which is what runs out on a GPU, is more: +2% to +35%
over the requested peak in benchmarks/results/prediction_accuracy.md (the
most under `sqrt` plans), different from step to step, while the requested
peak itself can exceed the prediction by several percent. A budget given for
a model (`plan`, `recompute`, the CLI) is therefore planned as
`budget * (1 - headroom)`: 1 / 0.7 covers +43% over an exact prediction, and
the optimal plans of that benchmark measured 69% to 90% of their budget
(ConvNeXtTiny's 124%: its recomputed segments hold XLA buffers the model
does not predict; a verified plan, `tfrecompute.check.verified_plan`, measures them). It
is a margin, not a bound: a prediction under the requested peak and a large
rounding can together exceed it. tests/whole_model/test_real_models.py checks that the
optimal plan's measured allocator peak stays under the budget.

A budget given as a share of the predicted peak of storing everything
(NOTE [ A budget as a share of storing everything ] in `units`) is planned
without headroom unless one is given: it is a share of a prediction, and the
plan's predicted peak is held to that share of it directly (`budget=0.5`: a
plan predicted at half of storing everything), the allocator's rounding
weighing on both sides.
"""


CALIBRATED_HEADROOM = 0.1
"""Share of a model's budget left when the chain is calibrated (`Chain.calibration`).

A calibrated chain predicts storing everything at its measured allocator
peak (NOTE [ Calibrating against a measured step ] in
tfrecompute/check/calibrate.py): the rounding of that step is in the
prediction, and what is left is how much one plan's peak varies from step to
step, about 10% (the margin a verified plan keeps, NOTE [ Re-planning with
the measured correction ]).
"""


def plan_within(
    api: str,
    strategy: Callable[..., Plan],
    chain: Chain,
    budget: object,
    headroom: object,
) -> Plan:
    """Plans `chain` with `strategy` under a model's budget, leaving `headroom` of it.

    The strategy gets `floor(budget * (1 - headroom))` bytes (NOTE [ Budget
    headroom ]). Without a budget it gets none, and `headroom` must be None; `optimal`'s
    plan of a calibrated chain is then the one of the least replayed peak (NOTE [ The
    least peak of a calibrated chain ] in `optimize`).

    Args:
        api: the public function, for error messages.
        strategy: `(chain, budget=None) -> Plan`.
        chain: the chain to plan.
        budget: None, bytes, a string like `"2GiB"`, or a share of the chain's predicted
            peak of storing everything such as `0.5` (NOTE [ A budget as a share of storing
            everything ] in `units`).
        headroom: None for `DEFAULT_HEADROOM` (0 for a budget given as a share), or a
            share in `[0, 1)`.

    Returns:
        The strategy's plan.

    Raises:
        TypeError: `budget` or `headroom` has the wrong type.
        ValueError: `budget` is not positive or malformed, or `headroom` is outside
            `[0, 1)` or given without a budget.
        InfeasibleBudgetError: the strategy cannot meet the reduced budget;
            `minimum` is the least budget (headroom included) it meets.

    Example:
        >>> from tfrecompute.strategies import Chain, optimal
        >>> chain = Chain.homogeneous(16, activation_bytes=100)
        >>> plan_within("plan", optimal, chain, 1200, 0.25).peak_bytes  # planned in 900
        900
    """
    if budget is None:
        if headroom is not None:
            fail(
                api,
                "headroom only applies to a budget",
                "headroom",
                headroom,
                "Pass a budget too, or leave headroom=None",
            )
        made = strategy(chain, budget=None)
        return least_replayed(chain, made) if strategy is optimal else made
    total = chain_budget(api, chain, budget)
    share = headroom_of(api, budget, headroom, chain)
    planned = math.floor(total * (1 - share))
    try:
        return strategy(chain, budget=max(planned, 1))
    except InfeasibleBudgetError as error:
        least = math.ceil(error.minimum / (1 - share))
        message = (
            f"{api}: the plan must fit in {format_size(max(planned, 1))}, the budget "
            f"{format_budget(budget, total)} less {float(share) * 100:.3g}% headroom for the "
            "allocator, but the least predicted peak the strategy reaches is "
            f"{format_size(error.minimum)}. "
            f"{received('budget', budget)}, headroom={headroom!r}. Raise the budget to at "
            f"least {format_size(least)}, lower the headroom, or reduce the batch size."
        )
        raise InfeasibleBudgetError(message, budget=total, minimum=least) from None


def headroom_of(api: str, budget: object, headroom: object, chain: Chain | None = None) -> Fraction:
    """The headroom `budget` is planned with: `headroom` if given, else `DEFAULT_HEADROOM`
    for bytes (`CALIBRATED_HEADROOM` for a calibrated `chain`) and 0 for a share of
    storing everything (NOTE [ Budget headroom ]).

    Example:
        >>> float(headroom_of("plan", "2GiB", None)), float(headroom_of("plan", 0.5, None))
        (0.3, 0.0)
    """
    if headroom is not None:
        return check_headroom(api, headroom)
    shared = budget is not None and budget_share(budget, api=api, name="budget") is not None
    if shared:
        return Fraction(0)
    calibrated = chain is not None and chain.calibration is not None
    return check_headroom(api, CALIBRATED_HEADROOM if calibrated else DEFAULT_HEADROOM)


def check_headroom(api: str, value: Any) -> Fraction:
    """Validates a headroom: a real number in `[0, 1)` (TypeError for other types)."""
    fix = "Pass a share of the budget in [0, 1), e.g. headroom=0.3 (0 plans to the budget)"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        fail(api, "headroom must be a real number", "headroom", value, fix, error=TypeError)
    share = float(value)
    if not math.isfinite(share) or not 0 <= share < 1:
        fail(api, "headroom must be in [0, 1)", "headroom", value, fix)
    return Fraction(share)
