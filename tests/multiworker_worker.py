"""One worker of the multi-worker tests (tests/layers/test_multiworker.py).

Run as a script with TF_CONFIG set, it creates a `MultiWorkerMirroredStrategy`
and trains; `tests/layers/test_multiworker.py` starts two of them on 127.0.0.1. The
model, data and training loop are plain functions so that the tests also run
them in-process under `MirroredStrategy` (the single-process reference).

    python tests/multiworker_worker.py --mode loop --out worker0.npz

Modes:
    loop: a custom training loop (`strategy.run` in a `tf.function`) for the
        same model with and without RecomputeBlocks; saves both models'
        variables to `--out`.
    keras: `model.fit` and `model.train_on_batch` of a model with blocks;
        saves which of them raised what (JSON) to `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tfrecompute import RecomputeBlock  # noqa: E402

FEATURES = 8
GLOBAL_BATCH = 16
STEPS = 4


def mirrored_strategy(devices: list[str]) -> tf.distribute.MirroredStrategy:
    """A `MirroredStrategy` whose collective keys no other one in this process uses.

    NOTE [ One process, several MirroredStrategy objects ]
    Each `MirroredStrategy` numbers its collective ops (group and instance
    keys) from the same start, and TensorFlow's collective executor is
    process-wide: when a second strategy's first all-reduce has another shape
    than the first strategy's (a BatchNorm(synchronized=True) statistic
    against a pack of gradients), the collective aborts ("Shape mismatch in
    the collective instance 100") and every later collective in the process
    fails. TensorFlow's own tests offset `_collective_key_base` per strategy
    ("Only set this in tests"); so do these, before and after, so that a
    strategy made elsewhere later does not reuse this one's keys either.
    """
    tf.distribute.MirroredStrategy._collective_key_base += 1000
    strategy = tf.distribute.MirroredStrategy(devices)
    tf.distribute.MirroredStrategy._collective_key_base += 1000
    return strategy


def build_model(blocked: bool, policy: str | None = None) -> keras.Model:
    """Dense + Dropout + BatchNorm, in two RecomputeBlocks (with `policy`) or unwrapped."""
    keras.utils.set_random_seed(0)
    layers = [
        keras.layers.Dense(16, activation="relu"),
        keras.layers.Dropout(0.5, seed=3),
        keras.layers.BatchNormalization(momentum=0.5),
        keras.layers.Dense(16, activation="tanh"),
    ]
    halves = (layers[:2], layers[2:])
    body = [RecomputeBlock(h, policy=policy) for h in halves] if blocked else layers
    return keras.Sequential([keras.Input((FEATURES,)), *body, keras.layers.Dense(3)])


def batches() -> list[tuple[np.ndarray, np.ndarray]]:
    """The global batches, the same in every process."""
    rng = np.random.default_rng(0)
    return [
        (
            rng.normal(size=(GLOBAL_BATCH, FEATURES)).astype("float32"),
            rng.normal(size=(GLOBAL_BATCH, 3)).astype("float32"),
        )
        for _ in range(STEPS)
    ]


def build_pair(strategy: tf.distribute.Strategy) -> tuple[keras.Model, keras.Model]:
    """(unwrapped, blocked) models with equal variables, created in `strategy.scope()`."""
    x = np.zeros((2, FEATURES), "float32")
    with strategy.scope():
        plain = build_model(blocked=False)
        blocked = build_model(blocked=True)
        # Builds the layers inside the blocks here, in the scope (they are
        # built lazily), so that their variables are distributed too.
        plain(x)
        blocked(x)
        for target, source in zip(blocked.variables, plain.variables):
            target.assign(source)
    return plain, blocked


def train_custom_loop(strategy: tf.distribute.Strategy, model: keras.Model) -> list[float]:
    """Trains with `strategy.run`; replica r gets the r-th slice of each global batch."""
    with strategy.scope():
        optimizer = keras.optimizers.SGD(0.1)
    replicas = strategy.num_replicas_in_sync

    def replica_step(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            predictions = model(x, training=True)
            per_example = keras.losses.mean_squared_error(y, predictions)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return loss

    @tf.function
    def step(x: Any, y: Any) -> tf.Tensor:
        losses = strategy.run(replica_step, args=(x, y))
        return strategy.reduce("SUM", losses, axis=None)

    losses = []
    for x, y in batches():
        xs, ys = np.split(x, replicas), np.split(y, replicas)
        dx = strategy.experimental_distribute_values_from_function(
            lambda context, xs=xs: tf.constant(xs[context.replica_id_in_sync_group])
        )
        dy = strategy.experimental_distribute_values_from_function(
            lambda context, ys=ys: tf.constant(ys[context.replica_id_in_sync_group])
        )
        losses.append(float(step(dx, dy)))
    return losses


def replica_values(model: keras.Model) -> list[np.ndarray]:
    """Each variable's values on the local replicas, stacked (replicas, ...), in order.

    The unwrapped and the blocked models list their variables in the same
    order (weights, seed generator states, BatchNorm statistics), so lists of
    two models compare entry by entry. BatchNorm's moving statistics are not
    synchronised across replicas by Keras (aggregation "none"): each replica
    keeps its own, hence all replicas are kept.
    """
    values = []
    for variable in model.variables:
        value = variable.value
        parts = getattr(value, "values", None) or (value,)
        values.append(np.stack([np.asarray(p.numpy()) for p in parts]))
    return values


def _keras_apis(strategy: tf.distribute.Strategy) -> dict[str, str]:
    """Tries model.fit and model.train_on_batch; returns {api: "ok" or the error}."""
    x, y = (np.concatenate(a) for a in zip(*batches()))
    results = {}
    for api in ("fit", "train_on_batch"):
        _, model = build_pair(strategy)
        with strategy.scope():
            model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        try:
            if api == "fit":
                model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
            else:
                model.train_on_batch(x[: GLOBAL_BATCH // 2], y[: GLOBAL_BATCH // 2])
            results[api] = "ok"
        except Exception as error:  # reported to the test, which decides
            results[api] = f"{type(error).__name__}: {error}"[:2000]
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["loop", "keras"], required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    if args.mode == "loop":
        plain, blocked = build_pair(strategy)
        arrays = {}
        for name, model in (("plain", plain), ("blocked", blocked)):
            arrays[f"{name}:losses"] = np.array(train_custom_loop(strategy, model))
            for index, value in enumerate(replica_values(model)):
                arrays[f"{name}:{index}"] = value
        np.savez(args.out, **arrays)
    else:
        with open(args.out, "w") as file:
            json.dump(_keras_apis(strategy), file)


if __name__ == "__main__":
    main()
