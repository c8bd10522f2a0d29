"""Debug mode of `RecomputeBlock`: checks that the recompute repeats the forward.

A recompute is only correct if it computes what the forward computed. The
block replays randomness and state, but a layer can still break this, for
example one whose output depends on a Python counter or on a value read from
outside the block that changes between the forward and backprop. Such a layer
makes gradients silently wrong. In debug mode every recompute compares its
tensors with the forward's (count, dtype, shape, values within a tolerance)
and fails with an error naming the block.

Debug mode is off by default and then costs nothing: no check, no extra op,
and the forward's tensors are not kept for the backward pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import TracebackType
from typing import Any

import numpy as np
import tensorflow as tf

from tfrecompute._messages import as_bool
from tfrecompute.errors import RecomputeMismatchError

__all__ = ["RecomputeMismatchError", "debug_enabled", "set_debug", "verify_recompute"]

# The name scope of the checks in a graph (tests look for it).
CHECK_SCOPE = "recompute_debug_check"


class _State:
    # Global, not thread-local: MirroredStrategy traces replicas in threads.
    enabled = False


_state = _State()


def debug_enabled() -> bool:
    """Whether debug mode is on for every block (see `set_debug`)."""
    return _state.enabled


class set_debug:  # A class used like a function, as `torch.set_grad_enabled`.
    """Turns debug mode on or off for all `RecomputeBlock`s.

    Called as a function it sets the mode until changed again; used as a
    context manager it restores the previous mode on exit. A block's own
    `debug=True` applies whatever this says. The mode is read when a block
    runs, which under `tf.function` means when it is traced: retrace (or
    recompile the model) after changing it.

    Args:
        enabled: `True` to check every recompute, `False` to stop checking.

    Example:

    ```python
    with tfrecompute.layers.set_debug(True):
        model.fit(x, y, epochs=1)  # fails fast if a recompute differs
    ```
    """

    def __init__(self, enabled: bool) -> None:
        value = as_bool("set_debug", "enabled", enabled, fix="Pass True or False")
        self._previous = _state.enabled
        _state.enabled = value

    def __enter__(self) -> set_debug:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        _state.enabled = self._previous


def _tolerance(dtype: tf.DType) -> tuple[float, float]:
    """(rtol, atol): reruns may differ in the last bits (GPU reductions)."""
    return (1e-2, 1e-2) if dtype.size <= 2 else (1e-4, 1e-5)


def verify_recompute(
    block_name: str, forward: Sequence[tf.Tensor], recomputed: Sequence[tf.Tensor]
) -> list[tf.Tensor]:
    """Checks the recomputed tensors against the forward's; returns them.

    Count, dtypes and known shapes are checked in Python (eagerly, or when a
    `tf.function` is traced). Values, and shapes known only at run time, are
    checked eagerly in Python, or in a graph by assertions the returned tensors
    depend on. XLA ignores assertions, so under `jit_compile=True` only the
    Python-side checks run.

    Raises:
        RecomputeMismatchError: eagerly or at tracing time, on a mismatch.
        tf.errors.InvalidArgumentError: in a graph, when an assertion fails.
    """
    prefix = f"RecomputeBlock '{block_name}' (debug mode): the recompute in backprop"
    fix = (
        "A layer inside computes something else when called again: make its call "
        "depend only on its inputs, its variables and Keras seed generators (no Python "
        "counters or values read from outside that change between calls), or keep it "
        "out of the block."
    )
    if len(forward) != len(recomputed):
        raise RecomputeMismatchError(
            f"{prefix} returned {len(recomputed)} tensors, the forward {len(forward)}. {fix}"
        )
    for index, (want, got) in enumerate(zip(forward, recomputed)):
        if want.dtype != got.dtype:
            raise RecomputeMismatchError(
                f"{prefix} gave tensor {index} dtype {got.dtype.name}, the forward "
                f"{want.dtype.name}. {fix}"
            )
        if not want.shape.is_compatible_with(got.shape):
            raise RecomputeMismatchError(
                f"{prefix} gave tensor {index} shape {got.shape}, the forward {want.shape}. {fix}"
            )
    if tf.executing_eagerly():
        for index, (want, got) in enumerate(zip(forward, recomputed)):
            rtol, atol = _tolerance(want.dtype)
            a, b = np.asarray(want, np.float64), np.asarray(got, np.float64)
            if a.shape != b.shape:
                raise RecomputeMismatchError(
                    f"{prefix} gave tensor {index} shape {b.shape}, the forward {a.shape}. {fix}"
                )
            if not np.allclose(b, a, rtol=rtol, atol=atol, equal_nan=True):
                raise RecomputeMismatchError(
                    f"{prefix} gave tensor {index} other values than the forward (largest "
                    f"difference {np.nanmax(np.abs(a - b)):.3g}, tolerance rtol={rtol}, "
                    f"atol={atol}). {fix}"
                )
        return list(recomputed)
    # Assertion messages get a period appended by TensorFlow.
    fix = fix.rstrip(".")
    checks: list[Any] = []
    with tf.name_scope(CHECK_SCOPE):
        for index, (want, got) in enumerate(zip(forward, recomputed)):
            rtol, atol = _tolerance(want.dtype)
            same_shape = tf.debugging.assert_equal(
                tf.shape(got),
                tf.shape(want),
                message=f"{prefix} gave tensor {index} another shape than the forward. {fix}",
            )
            with tf.control_dependencies([same_shape]):
                checks.append(
                    tf.debugging.assert_near(
                        tf.cast(got, tf.float32),
                        tf.cast(want, tf.float32),
                        rtol=rtol,
                        atol=atol,
                        message=f"{prefix} gave tensor {index} other values than the "
                        f"forward. {fix}",
                    )
                )
        with tf.control_dependencies(checks):
            return [tf.identity(t) for t in recomputed]
