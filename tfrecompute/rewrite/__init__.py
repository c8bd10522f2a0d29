"""Applying a plan, the step after the planner (`strategies/`): blocks in the model itself.

`apply` (a plan's segments checkpointed in the model: the one place above
`layers/` that builds `RecomputeBlock`s) and `unwrap` (the other way: a model
with hand-placed blocks as the same model without them).
"""
