"""tfrecompute: gradient checkpointing for Keras 3 on TensorFlow.

`import tfrecompute` is quick and pure Python: it imports the planner,
`tfrecompute.strategies`, the exception types, `quiet_tensorflow` and `count_cpu_memory`. The
TensorFlow parts (`RecomputeBlock`, `profile`, `plan`, `recompute`,
`measure_step`, ...) are imported the first time one of them is used, all
together, which also registers `RecomputeBlock` for Keras serialization. When
Keras is imported before `tfrecompute` (as in most scripts), they are imported
with the package; otherwise load a saved model with blocks after
`from tfrecompute import RecomputeBlock` (or any other use of the TensorFlow
parts). Where TensorFlow is not
installed they are absent from `__all__`, and using one raises the
`ImportError` of TensorFlow.

The folders follow the data path, each importing only from those before
it: `errors`, `_messages` and `startup` (`quiet_tensorflow`, `count_cpu_memory`) at the base;
`strategies/` (the planner, pure Python); `_keras_internals` (every private
Keras/TensorFlow symbol); `layers/` (`RecomputeBlock`, `checkpoint`,
in-place and attention-core checkpoints); then a model's path: `graph/`
(its call graph), `costs/` (`profile`: the graph as a `Chain`), `rewrite/`
(a plan applied in the model itself; `unwrap`), `check/` (`measure_step`,
`trace_step`, `verified_plan`, `max_batch_size`, `check_precision`);
`whole_model` (`plan`, `recompute`) on top of them, and `cli/` (the
command line and its plots) last.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

from tfrecompute import strategies
from tfrecompute.errors import (
    InfeasibleBudgetError,
    NonReplayableRandomnessError,
    RecomputeMismatchError,
    TfrecomputeError,
    UntraceableModelError,
)
from tfrecompute.startup import count_cpu_memory, quiet_tensorflow

__version__ = "0.1.0"

_TENSORFLOW_PARTS = (
    "Allocation",
    "BatchProbe",
    "Checkpoints",
    "MaxBatch",
    "PrecisionFinding",
    "RecomputeBlock",
    "StepMeasurement",
    "StepTrace",
    "VerifiedPlan",
    "check_precision",
    "checkpoint",
    "checkpoints",
    "max_batch_size",
    "measure_step",
    "plan",
    "profile",
    "recompute",
    "trace_step",
    "unwrap",
    "verified_plan",
)

__all__ = [
    "InfeasibleBudgetError",
    "NonReplayableRandomnessError",
    "RecomputeMismatchError",
    "TfrecomputeError",
    "UntraceableModelError",
    "__version__",
    "count_cpu_memory",
    "quiet_tensorflow",
    "strategies",
]
if importlib.util.find_spec("tensorflow") is not None:
    __all__ += _TENSORFLOW_PARTS


def _import_tensorflow_parts() -> dict[str, Any]:
    """Imports every TensorFlow part at once (so that `RecomputeBlock` is registered)."""
    from tfrecompute.check.max_batch import BatchProbe, MaxBatch, max_batch_size
    from tfrecompute.check.measure import (
        Allocation,
        StepMeasurement,
        StepTrace,
        measure_step,
        trace_step,
    )
    from tfrecompute.check.precision import PrecisionFinding, check_precision
    from tfrecompute.check.verified_plan import VerifiedPlan, verified_plan
    from tfrecompute.costs.profile import profile
    from tfrecompute.layers import RecomputeBlock
    from tfrecompute.layers.function import checkpoint
    from tfrecompute.layers.in_place import Checkpoints
    from tfrecompute.rewrite.unwrap import unwrap
    from tfrecompute.whole_model import checkpoints, plan, recompute

    return {
        "Allocation": Allocation,
        "Checkpoints": Checkpoints,
        "checkpoint": checkpoint,
        "checkpoints": checkpoints,
        "unwrap": unwrap,
        "PrecisionFinding": PrecisionFinding,
        "RecomputeBlock": RecomputeBlock,
        "StepMeasurement": StepMeasurement,
        "StepTrace": StepTrace,
        "check_precision": check_precision,
        "measure_step": measure_step,
        "plan": plan,
        "profile": profile,
        "recompute": recompute,
        "trace_step": trace_step,
        "VerifiedPlan": VerifiedPlan,
        "BatchProbe": BatchProbe,
        "MaxBatch": MaxBatch,
        "max_batch_size": max_batch_size,
        "verified_plan": verified_plan,
    }


def __getattr__(name: str) -> Any:
    """The TensorFlow parts, imported on first use (PEP 562)."""
    if name not in _TENSORFLOW_PARTS:
        raise AttributeError(f"module 'tfrecompute' has no attribute {name!r}")
    parts = _import_tensorflow_parts()
    globals().update(parts)  # later lookups find them without this function
    return parts[name]


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


if sys.modules.get("keras") is not None and sys.modules.get("tensorflow") is not None:
    # Keras is loaded already (a script imports it first), so the TensorFlow
    # parts cost nothing more to import now, and `keras.models.load_model`
    # then finds `RecomputeBlock` after a plain `import tfrecompute`.
    globals().update(_import_tensorflow_parts())
