"""Quickstart: wrap layers in RecomputeBlock, train with model.fit, measure the memory.

Builds the same deep MLP (Dense + Dropout) twice, without and with
RecomputeBlocks, from the same initial weights and dropout seeds; trains both
for a few steps with model.fit and prints what matters: the memory one
compiled training step added (read from TensorFlow's allocator), the step
time (wall and CPU), and how far apart the two models' weights ended up
(recompute changes the memory, not the training).

    python examples/quickstart.py            # --verbose shows TensorFlow's start-up logs
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import tfrecompute

# Before keras starts TensorFlow: hide its start-up logs unless --verbose, and let its
# CPU allocator count bytes (measuring reads them).
tfrecompute.quiet_tensorflow(verbose="--verbose" in sys.argv)
tfrecompute.count_cpu_memory()

import keras  # noqa: E402
import numpy as np  # noqa: E402


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
        optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    return model


def say(text: str, start: float) -> None:
    """A progress line: what the example does next, and the time since it started."""
    print(f"[{time.perf_counter() - start:5.0f} s] {text}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=32, help="number of Dense layers")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=4, help="training steps before comparing")
    parser.add_argument("--verbose", action="store_true", help="show TensorFlow's start-up logs")
    args = parser.parse_args(argv)
    start = time.perf_counter()

    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.steps * args.batch_size, args.width)).astype("float32")
    y = rng.integers(0, 10, size=(args.steps * args.batch_size,))
    block_size = max(1, round(math.sqrt(args.depth)))

    plain = build(args.depth, args.width, None)
    blocked = build(args.depth, args.width, block_size)
    for target, source in zip(blocked.variables, plain.variables):
        target.assign(source)  # the same initial weights and dropout seeds
    for model, label in ((plain, "without"), (blocked, "with")):
        say(f"training {args.steps} steps {label} recompute", start)
        model.fit(x, y, batch_size=args.batch_size, epochs=1, shuffle=False, verbose=1)
    difference = max(
        float(np.max(np.abs(a - b))) for a, b in zip(plain.get_weights(), blocked.get_weights())
    )

    batch = (x[: args.batch_size], y[: args.batch_size])
    say("measuring one compiled training step of each (5 steps after a warm-up)", start)
    rows = [
        ("no recompute", tfrecompute.measure_step(plain, *batch, steps=5)),
        (f"RecomputeBlock x{block_size}", tfrecompute.measure_step(blocked, *batch, steps=5)),
    ]
    device = rows[0][1].device
    print(f"{args.depth} x Dense({args.width}) + Dropout, batch {args.batch_size}, on {device}")
    print(f"{'variant':<22}{'step memory':>14}{'wall time':>12}{'CPU time':>12}")
    for label, step in rows:
        print(
            f"{label:<22}{step.peak_bytes / 2**20:>10.1f} MiB"
            f"{step.seconds * 1e3:>9.0f} ms{step.cpu_seconds * 1e3:>9.0f} ms"
        )
    base, checkpointed = rows[0][1], rows[1][1]
    if base.peak_bytes:
        print(
            f"recompute used {checkpointed.peak_bytes / base.peak_bytes:.0%} of the memory, at "
            f"{checkpointed.cpu_seconds / base.cpu_seconds:.2f}x the CPU time per step\n"
            f"  ({checkpointed.seconds / base.seconds:.2f}x the wall time, a noisier clock "
            "on a shared machine)"
        )
    else:
        print("the allocator recorded no memory: use a larger --batch-size")
    print(
        f"trained identically: after {args.steps} steps from the same weights, the largest\n"
        f"  weight difference with and without recompute is {difference:.2e}"
    )


if __name__ == "__main__":
    main()
