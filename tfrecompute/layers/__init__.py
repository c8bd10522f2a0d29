"""Keras layers of tfrecompute: `RecomputeBlock` and what it needs."""

from tfrecompute.layers.debug import RecomputeMismatchError, debug_enabled, set_debug
from tfrecompute.layers.recompute_block import RecomputeBlock

__all__ = ["RecomputeBlock", "RecomputeMismatchError", "debug_enabled", "set_debug"]
