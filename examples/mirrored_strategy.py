"""Data-parallel training with RecomputeBlocks under tf.distribute.MirroredStrategy.

Uses every GPU when there is one; otherwise splits the CPU into two logical
devices so that two replicas run on one machine. Builds the same model with
and without RecomputeBlocks (Dense + Dropout + BatchNormalization inside),
trains both with model.fit from the same initial weights, and prints how far
apart their weights end up (recompute changes the memory, not the result).

    python examples/mirrored_strategy.py
"""

from __future__ import annotations

import argparse
import sys

import tfrecompute

# Before keras starts TensorFlow: hide its start-up logs unless --verbose, and let its
# CPU allocator count bytes (measuring reads them).
tfrecompute.quiet_tensorflow(verbose="--verbose" in sys.argv)
tfrecompute.count_cpu_memory()

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402


def make_strategy() -> tf.distribute.MirroredStrategy:
    """All GPUs, else two logical CPUs (or the CPUs TensorFlow already has)."""
    if tf.config.list_physical_devices("GPU"):
        return tf.distribute.MirroredStrategy()  # every visible GPU
    cpu = tf.config.list_physical_devices("CPU")[0]
    try:
        # Must happen before TensorFlow initialises its devices (the first op
        # or device query); listing *physical* devices does not initialise.
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * 2
        )
    except RuntimeError:
        pass  # TensorFlow is already initialised: use the logical CPUs it has.
    return tf.distribute.MirroredStrategy([d.name for d in tf.config.list_logical_devices("CPU")])


def build(blocked: bool, *, depth: int, width: int) -> keras.Model:
    keras.utils.set_random_seed(0)
    body = []
    for _ in range(depth):
        layers = [
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dropout(0.1),
            keras.layers.BatchNormalization(),
        ]
        body += [tfrecompute.RecomputeBlock(layers)] if blocked else layers
    return keras.Sequential([keras.Input((width,)), *body, keras.layers.Dense(10)])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=8, help="number of blocks")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=256, help="global batch size")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--verbose", action="store_true", help="show TensorFlow's start-up logs")
    args = parser.parse_args(argv)

    strategy = make_strategy()  # first: it may still configure the devices
    print(
        f"{strategy.num_replicas_in_sync} replicas on {', '.join(strategy.extended.worker_devices)}"
    )

    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.samples, args.width)).astype("float32")
    y = rng.integers(0, 10, size=(args.samples,))

    models = []
    with strategy.scope():
        for blocked in (False, True):
            model = build(blocked, depth=args.depth, width=args.width)
            # Build the layers inside the blocks here, inside the scope, so
            # that all variables are mirrored.
            model(x[:1])
            model.compile(
                optimizer="adam",
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            )
            models.append(model)
        plain, blocked = models
        for target, source in zip(blocked.variables, plain.variables):
            target.assign(source)  # weights, BatchNorm statistics, dropout seeds

    for label, model in (("no recompute", plain), ("RecomputeBlock", blocked)):
        print(f"training {args.epochs} epochs: {label}", flush=True)
        history = model.fit(
            x, y, batch_size=args.batch_size, epochs=args.epochs, shuffle=False, verbose=1
        )
        print(f"{label:<16} loss per epoch: {[round(v, 4) for v in history.history['loss']]}")
    difference = max(
        float(np.max(np.abs(a - b))) for a, b in zip(plain.get_weights(), blocked.get_weights())
    )
    print(f"largest weight difference with and without recompute: {difference:.2e}")


if __name__ == "__main__":
    main()
