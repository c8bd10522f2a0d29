"""`RecomputeBlock` and what it needs, bottom-up.

* `custom_gradient`: `attach_gradient`, the gradient primitive, and the recompute's ordering guards.
* `state`: snapshot, replay and commit of the non-trainable state.
* `randomness`: finding random ops a recompute cannot replay.
* `debug`: comparing each recompute with its forward (`set_debug`).
* `watch`: what a forward ran: its ops, captured tensors, random ops.
* `backward`: the recompute, its metadata check, and the VJPs of a block.
* `policy`: recompute policies, which products a block's forward keeps (`OpInfo`).
* `tree`, `dtypes`: walking a tree of layers; a block's dtype checks.
* `frame`: `RecomputeFrame`, the state of one recomputed call.
* `block`: `RecomputeBlock`, the Keras layer.
* `function`: `checkpoint(fn)`, a function recomputed through a block.
* `in_place`: checkpoints applied where layers stand (a model stays what it is).
* `attention`: the attention cores of layers, recomputed (`policy="attention"`).
"""

from tfrecompute.errors import RecomputeMismatchError
from tfrecompute.layers import attention  # noqa: F401  (registers policy="attention")
from tfrecompute.layers.block import RecomputeBlock
from tfrecompute.layers.debug import debug_enabled, set_debug
from tfrecompute.layers.policy import OpInfo, dots, nothing

__all__ = [
    "OpInfo",
    "RecomputeBlock",
    "RecomputeMismatchError",
    "debug_enabled",
    "dots",
    "nothing",
    "set_debug",
]
