"""Checking what a plan gives, by measurement: the step after applying it.

`measure` (`measure_step`, `trace_step`: a train step's allocator peak and
events), `verified_plan` (a plan for a budget, kept only once its measured
step fits), `max_batch` (`max_batch_size`: the largest batch whose measured
step fits, with `_probe`, one probe in a process of its own) and `precision`
(`check_precision`: mixed-precision findings of a checkpointed model).
"""
