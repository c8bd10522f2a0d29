"""The dtype checks of one `RecomputeBlock`, which it runs when it is built.

`tfrecompute.check_precision` runs them for every block of a model, with the
model-level checks (NOTE [ What precision means for a recompute block ] in
`tfrecompute.check.precision`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import keras

from tfrecompute.layers.tree import leaves

__all__ = ["PrecisionFinding", "block_dtype_findings", "compute_dtype", "name_list"]

Severity = Literal["error", "warning", "info"]


@dataclasses.dataclass(frozen=True)
class PrecisionFinding:
    """One precision problem found by `check_precision`.

    Attributes:
        severity: `"error"` (training will go wrong, e.g. float16 without loss
            scaling), `"warning"` (wasted memory or a precision mismatch) or
            `"info"` (worth knowing, nothing to fix).
        path: the layer concerned, as names from the model down, e.g.
            `"model/recompute_block/dense_3"`.
        message: what is wrong.
        fix: how to fix it.

    Example:

    ```python
    for finding in tfrecompute.check_precision(model):
        print(finding.severity, finding.path, finding.message, finding.fix)
    ```
    """

    severity: Severity
    path: str
    message: str
    fix: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message} Fix: {self.fix}"


def compute_dtype(layer: Any) -> str:
    """The dtype `layer` computes in, e.g. `"bfloat16"` under `mixed_bfloat16`."""
    return str(keras.backend.standardize_dtype(layer.dtype_policy.compute_dtype))


def name_list(items: list[tuple[Any, str]], limit: int = 3) -> str:
    """`'a', 'b', 'c' and 2 more`: the names of `(layer, path)` items."""
    names = [f"'{layer.name}'" for layer, _ in items[:limit]]
    return ", ".join(names) + (f" and {len(items) - limit} more" if len(items) > limit else "")


def block_dtype_findings(block: keras.layers.Layer, path: str) -> list[PrecisionFinding]:
    """The dtype findings of one block at `path` (`precision.block_precision_findings`)."""
    inner = leaves(block, path)
    if not inner:
        return []
    by_dtype: dict[str, list[tuple[Any, str]]] = {}
    for layer, layer_path in inner:
        by_dtype.setdefault(compute_dtype(layer), []).append((layer, layer_path))
    findings = []
    if len(by_dtype) > 1:
        summary = "; ".join(f"{dtype}: {name_list(items)}" for dtype, items in by_dtype.items())
        findings.append(
            PrecisionFinding(
                severity="warning",
                path=path,
                message=(
                    f"the layers inside block '{block.name}' compute in different dtypes "
                    f"({summary}). Parts of the block run in another precision than the "
                    "rest, and every cast between them runs twice (forward and recompute)."
                ),
                fix=(
                    "Give every layer in the block the same dtype policy, and keep layers "
                    "that must run in float32 (e.g. a final softmax) outside the block."
                ),
            )
        )
    own = compute_dtype(block)
    if own not in by_dtype:
        dtypes = ", ".join(by_dtype)
        policies = sorted({layer.dtype_policy.name for layer, _ in inner})
        findings.append(
            PrecisionFinding(
                severity="warning",
                path=path,
                message=(
                    f"block '{block.name}' has the dtype policy "
                    f"'{block.dtype_policy.name}' (compute dtype {own}) but its layers "
                    f"compute in {dtypes}. Keras builds the layers from {own} inputs and "
                    f"reports the block's outputs as {own}, which is not what runs."
                ),
                fix=(
                    f"Create the block with its layers' policy, e.g. "
                    f"RecomputeBlock(layers, dtype='{policies[0]}'), or call "
                    "keras.config.set_dtype_policy(...) before creating both."
                ),
            )
        )
    return findings
