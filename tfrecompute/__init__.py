"""tfrecompute: gradient checkpointing for Keras 3 on TensorFlow.

`import tfrecompute` imports TensorFlow and Keras and registers
`RecomputeBlock` for Keras serialization. The planner,
`tfrecompute.strategies`, is pure Python: it also imports where TensorFlow is
not installed, and then the TensorFlow parts are simply absent.
"""

from __future__ import annotations

import importlib.util

from tfrecompute import strategies
from tfrecompute.errors import (
    InfeasibleBudgetError,
    NonReplayableRandomnessError,
    TfrecomputeError,
)

__version__ = "0.1.0"

__all__ = [
    "InfeasibleBudgetError",
    "NonReplayableRandomnessError",
    "TfrecomputeError",
    "__version__",
    "strategies",
]

if importlib.util.find_spec("tensorflow") is not None:
    from tfrecompute.layers import RecomputeBlock
    from tfrecompute.models import plan, profile, recompute
    from tfrecompute.precision import PrecisionFinding, check_precision
    from tfrecompute.profiling import StepMeasurement, measure_step
    from tfrecompute.tracing import Allocation, StepTrace, trace_step

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
