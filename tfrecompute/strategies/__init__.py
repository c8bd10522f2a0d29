"""The planner: from a cost `Chain` to a recompute `Plan` under a memory budget.

Pure Python (plus numpy); it never imports TensorFlow or Keras, so it runs
anywhere and predicts a plan's peak memory before any GPU time is spent.

* `Chain`: per-layer bytes and costs; `Plan`: which layers to recompute.
* `simulate`/`timeline`: the memory model that predicts a plan's peak.
* Strategies, plain callables `(chain, budget=None) -> Plan`: `none`,
  `uniform(k)`, `sqrt`, `heuristic`, `optimal`; by name with `get`.
* `frontier`: the Pareto set of (peak, cost); `min_peak`: the least peak.
* `plan_within`: plan under a model's budget, leaving headroom for the allocator.

Example:
    >>> from tfrecompute import strategies as st
    >>> chain = st.Chain.homogeneous(16, activation_bytes=1 << 20)
    >>> plan = st.optimal(chain, budget="10MiB")
    >>> plan.peak_bytes <= st.parse_budget("10MiB"), plan.recompute_cost
    (True, 11.0)
"""

from tfrecompute.errors import InfeasibleBudgetError
from tfrecompute.strategies.budget import DEFAULT_HEADROOM, format_bytes, parse_budget, plan_within
from tfrecompute.strategies.chain import Chain
from tfrecompute.strategies.memory import Estimate, MemoryEvent, simulate, timeline
from tfrecompute.strategies.optimize import DEFAULT_MAX_WORK, frontier, min_peak, optimal
from tfrecompute.strategies.plan import Budget, Plan, Strategy
from tfrecompute.strategies.registry import available, get
from tfrecompute.strategies.simple import heuristic, none, sqrt, uniform

__all__ = [
    "DEFAULT_HEADROOM",
    "DEFAULT_MAX_WORK",
    "Budget",
    "Chain",
    "Estimate",
    "InfeasibleBudgetError",
    "MemoryEvent",
    "Plan",
    "Strategy",
    "available",
    "format_bytes",
    "frontier",
    "get",
    "heuristic",
    "min_peak",
    "none",
    "optimal",
    "parse_budget",
    "plan_within",
    "simulate",
    "sqrt",
    "timeline",
    "uniform",
]
