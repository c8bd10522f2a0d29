"""`tf.distribute`: where checkpointing meets a strategy, and the two helpers it needs.

NOTE [ Checkpointing under a tf.distribute strategy ]
Blocks need nothing of their own under a strategy: each replica runs its
copy of the train step, and a block's forward, custom gradient and
recompute run inside that replica (its variables are the replica's, its
seed generators and BatchNorm statistics update once per replica step, as
unwrapped layers' do). What needs care is everything that runs *beside* the
step on a model built in `strategy.scope()`:

- Tracing and pricing a model step out of the strategy's scope
  (`outside_strategy_scope`): in its cross-replica context a mirrored
  variable has no single handle to differentiate, and a trace of shapes and
  ops needs only the first replica's. An unbuilt model is built from the
  sample first, in the caller's scope, so that its variables are the
  strategy's (`tfrecompute.graph.trace.built_by_sample`).
- Anything that makes variables of its own while profiling (the optimizer's
  update probe, and Adam for a model not compiled yet) runs in a thread of
  its own (`in_own_thread`): stepping out of the scope clears the
  strategy stack but not the strategy's variable creator, and the probe's
  variables must not be distributed ones.
- Batches are per replica where memory is measured: Keras's
  `train_on_batch` gives every replica the whole batch (`fit` splits its
  batch), so `measure_step(model, x)` measures one replica's step on
  `len(x)` rows, a `fit` batch of `num_replicas_in_sync * len(x)`, and
  `max_batch_size` finds the batch per replica. Logical CPU devices share
  one allocator, so there the peak is the replicas' together; on GPUs it is
  replica 0's device.
- A plan is made once for every replica: `recompute` called in the scope
  applies it there, so the runtime model it builds and the blocks it places
  belong to the strategy.

Multi-worker training runs in a custom training loop
(`tests/layers/test_multiworker.py`); `MultiWorkerMirroredStrategy` +
`model.fit` fails in Keras 3.15 with or without checkpoints.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import tensorflow as tf

__all__ = ["in_own_thread", "outside_strategy_scope"]

T = TypeVar("T")


@contextlib.contextmanager
def outside_strategy_scope() -> Iterator[None]:
    """Runs the body as outside any `tf.distribute` strategy's scope (no-op outside one).

    NOTE [ Tracing costs inside a strategy's scope ]
    Inside `strategy.scope()` the thread is in the strategy's cross-replica
    context, where a mirrored variable has no single `handle`: the gradient
    that the cost tracer takes of a layer's call with respect to its weights
    fails ("DistributedVariable.handle is not available outside the replica
    context"). Outside the scope the same variable reads as its first
    replica's value, which is all a trace of shapes and ops needs. TensorFlow
    keeps the scope on a per-graph stack (`_distribution_strategy_stack`,
    copied into each function graph made while it is set), with no public
    way to step out of it.
    """
    graph = tf.compat.v1.get_default_graph()
    stack = getattr(graph, "_distribution_strategy_stack", None)
    if not stack:
        yield
        return
    saved = list(stack)
    stack.clear()
    try:
        yield
    finally:
        stack[:] = saved


def in_own_thread(function: Callable[..., T], *args: Any) -> T:
    """`function(*args)` in a new thread: outside the caller's `tf.distribute` strategy.

    A strategy's scope and its variable creator belong to the thread that
    entered it, so a new thread has neither: variables made there are plain
    ones (NOTE [ Checkpointing under a tf.distribute strategy ]). An
    exception is raised again in the caller's thread.
    """
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = function(*args)
        except Exception as error:  # raised again in the caller's thread
            outcome["error"] = error

    thread = threading.Thread(target=run, name="tfrecompute-own-thread")
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]  # type: ignore[no-any-return]
