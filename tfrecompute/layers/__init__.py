"""Keras layers of tfrecompute: `RecomputeBlock` and what it needs."""

from tfrecompute.layers.recompute_block import RecomputeBlock

__all__ = ["RecomputeBlock"]
