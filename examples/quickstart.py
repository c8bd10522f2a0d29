"""Quickstart: wrap layers in RecomputeBlock, train with model.fit, measure the memory.

Trains the same deep MLP twice, without and with recompute, and prints the
peak memory that one compiled training step added (read from TensorFlow's
allocator) and the step time.

    python examples/quickstart.py
"""

from __future__ import annotations

import argparse
import math
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tfrecompute  # noqa: E402


def build(depth: int, width: int, block_size: int | None) -> keras.Model:
    keras.utils.set_random_seed(0)
    layers = []
    for _ in range(depth):
        layers += [keras.layers.Dense(width, activation="relu"), keras.layers.Dropout(0.1)]
    if block_size:
        # Each RecomputeBlock keeps only its input; the activations inside are
        # recomputed during backprop, with the same dropout masks.
        size = 2 * block_size
        layers = [
            tfrecompute.RecomputeBlock(layers[i : i + size]) for i in range(0, len(layers), size)
        ]
    model = keras.Sequential([keras.Input((width,)), *layers, keras.layers.Dense(10)])
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=32, help="number of Dense layers")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=1024)
    args = parser.parse_args(argv)

    rng = np.random.default_rng(0)
    x = rng.normal(size=(4 * args.batch_size, args.width)).astype("float32")
    y = rng.integers(0, 10, size=(4 * args.batch_size,))
    block_size = max(1, round(math.sqrt(args.depth)))

    rows = []
    for label, size in (("no recompute", None), (f"RecomputeBlock x{block_size}", block_size)):
        model = build(args.depth, args.width, size)
        history = model.fit(x, y, batch_size=args.batch_size, epochs=1, verbose=0)
        step = tfrecompute.measure_step(model, x[: args.batch_size], y[: args.batch_size])
        rows.append((label, step, history.history["loss"][-1]))

    device = rows[0][1].device
    print(f"{args.depth} x Dense({args.width}) + Dropout, batch {args.batch_size}, on {device}")
    print(f"{'variant':<22}{'step memory':>14}{'step time':>12}{'loss':>10}")
    for label, step, loss in rows:
        memory, time_ms = step.peak_bytes / 2**20, step.seconds * 1e3
        print(f"{label:<22}{memory:>10.1f} MiB{time_ms:>9.1f} ms{loss:>10.4f}")
    base, blocked = rows[0][1], rows[1][1]
    if not base.peak_bytes:
        print("the allocator recorded no memory: use a larger --batch-size")
        return
    print(
        f"recompute used {blocked.peak_bytes / base.peak_bytes:.0%} of the memory "
        f"at {blocked.seconds / base.seconds:.2f}x the step time"
    )


if __name__ == "__main__":
    main()
