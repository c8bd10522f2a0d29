"""The planner: from a cost `Chain` to a recompute `Plan` under a memory budget.

Pure Python (plus numpy); it never imports TensorFlow or Keras, so it runs
anywhere and predicts a plan's peak memory before any GPU time is spent.

Its modules, each importing only those above it:

* `units`: `parse_budget` ("512MiB" to bytes), `format_bytes`.
* `chain`: `Chain`, per-link bytes and costs: all the planner sees.
* `simulate`: the memory model, `simulate`/`timeline`, which predicts a plan's peak.
* `plan`: `Plan`, which links to recompute, with its peak and cost;
  `reconciled_peak`, a calibrated prediction kept near its replay.
* `basic`: the strategies `none`, `uniform(k)`, `sqrt`, `heuristic`, plain
  callables `(chain, budget=None) -> Plan`.
* `optimize`: `optimal`, `frontier` (the Pareto set of peak and cost) and
  `min_peak`, on the exact search of `_solver`.
* `headroom`: `plan_within`, a model's budget less headroom for the allocator.
* `registry`: strategies by name, `get` and `available`.

Example:
    >>> from tfrecompute import strategies as st
    >>> chain = st.Chain.homogeneous(16, activation_bytes=1 << 20)
    >>> plan = st.optimal(chain, budget="10MiB")
    >>> plan.peak_bytes <= st.parse_budget("10MiB"), plan.recompute_cost
    (True, 11.0)
"""

from tfrecompute.errors import InfeasibleBudgetError
from tfrecompute.strategies.basic import heuristic, none, sqrt, uniform
from tfrecompute.strategies.chain import Chain
from tfrecompute.strategies.headroom import CALIBRATED_HEADROOM, DEFAULT_HEADROOM, plan_within
from tfrecompute.strategies.optimize import DEFAULT_MAX_WORK, frontier, min_peak, optimal
from tfrecompute.strategies.plan import REPLAY_MARGIN, Budget, Plan, Strategy, reconciled_peak
from tfrecompute.strategies.registry import available, get
from tfrecompute.strategies.simulate import Estimate, MemoryEvent, simulate, timeline
from tfrecompute.strategies.units import format_bytes, format_size, parse_budget

__all__ = [
    "CALIBRATED_HEADROOM",
    "DEFAULT_HEADROOM",
    "DEFAULT_MAX_WORK",
    "REPLAY_MARGIN",
    "Budget",
    "Chain",
    "Estimate",
    "InfeasibleBudgetError",
    "MemoryEvent",
    "Plan",
    "Strategy",
    "available",
    "format_bytes",
    "format_size",
    "frontier",
    "get",
    "heuristic",
    "min_peak",
    "none",
    "optimal",
    "parse_budget",
    "plan_within",
    "reconciled_peak",
    "simulate",
    "sqrt",
    "timeline",
    "uniform",
]
