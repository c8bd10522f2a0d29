"""tfrecompute: gradient checkpointing for Keras 3 on TensorFlow.

`import tfrecompute` imports TensorFlow and Keras and registers
`RecomputeBlock` for Keras serialization. The planner,
`tfrecompute.strategies`, is pure Python: it also imports where TensorFlow is
not installed, and then the TensorFlow parts are simply absent.

The modules follow the data path, each importing only those before it:
`errors` and `_messages` (pure Python), `strategies/` (the planner),
`_keras_internals` (every private Keras/TensorFlow symbol), `layers/`
(`RecomputeBlock`), `graph` (a model's layer graph), `call_costs` and
`costs` (`profile`: the graph's `Chain`), `rewrite` (a plan applied to a
model), `models` (`plan`, `recompute`), `measure` (`measure_step`,
`trace_step`), `precision` (`check_precision`), and `cli` on top.
"""

from __future__ import annotations

import importlib.util

from tfrecompute import strategies
from tfrecompute.errors import (
    InfeasibleBudgetError,
    NonReplayableRandomnessError,
    RecomputeMismatchError,
    TfrecomputeError,
)

__version__ = "0.1.0"

__all__ = [
    "InfeasibleBudgetError",
    "NonReplayableRandomnessError",
    "RecomputeMismatchError",
    "TfrecomputeError",
    "__version__",
    "strategies",
]

if importlib.util.find_spec("tensorflow") is not None:
    from tfrecompute.costs import profile
    from tfrecompute.layers import RecomputeBlock
    from tfrecompute.measure import Allocation, StepMeasurement, StepTrace, measure_step, trace_step
    from tfrecompute.models import plan, recompute
    from tfrecompute.precision import PrecisionFinding, check_precision

    __all__ += [
        "Allocation",
        "PrecisionFinding",
        "RecomputeBlock",
        "StepMeasurement",
        "StepTrace",
        "check_precision",
        "measure_step",
        "plan",
        "profile",
        "recompute",
        "trace_step",
    ]
