"""`RecomputeBlock` and what it needs, bottom-up.

* `custom_gradient`: `recompute_grad`, the custom gradient that recomputes.
* `state`: snapshot, replay and commit of the non-trainable state.
* `randomness`: finding random ops a recompute cannot replay.
* `debug`: comparing each recompute with its forward (`set_debug`).
* `tree`, `dtypes`: walking a tree of layers; a block's dtype checks.
* `frame`: `RecomputeFrame`, the state of one recomputed call.
* `block`: `RecomputeBlock`, the Keras layer.
"""

from tfrecompute.errors import RecomputeMismatchError
from tfrecompute.layers.block import RecomputeBlock
from tfrecompute.layers.debug import debug_enabled, set_debug

__all__ = ["RecomputeBlock", "RecomputeMismatchError", "debug_enabled", "set_debug"]
