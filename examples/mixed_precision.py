"""Mixed precision with RecomputeBlocks: check the policies, then train.

Builds a checkpointed model under a mixed dtype policy twice: first with
three common mistakes (a float32 layer in front of a block, which keeps that
block's checkpoint in float32; a float32 softmax inside a block; float16
without loss scaling), then fixed. Prints what `check_precision`
finds in each, and trains the fixed one briefly.

    python examples/mixed_precision.py --policy mixed_float16
"""

from __future__ import annotations

import argparse
import sys
import time

import tfrecompute

# Before keras starts TensorFlow: hide its start-up logs unless --verbose, and let its
# CPU allocator count bytes (measuring reads them).
tfrecompute.quiet_tensorflow(verbose="--verbose" in sys.argv)
tfrecompute.count_cpu_memory()

import keras  # noqa: E402
import numpy as np  # noqa: E402

from tfrecompute.check.precision import check_precision  # noqa: E402


def build(*, depth: int, width: int, fixed: bool) -> keras.Model:
    keras.utils.set_random_seed(0)
    blocks = []
    for index in range(depth):
        layers = [
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(width, activation="relu"),
        ]
        if fixed:
            # Normalisation in the block's policy, inside the block: the
            # block keeps a 16-bit input.
            layers.insert(0, keras.layers.LayerNormalization())
        else:
            # Mistake: a float32 layer in front of the block, so the block
            # keeps a float32 checkpoint (twice the bytes).
            blocks.append(keras.layers.LayerNormalization(dtype="float32"))
        if not fixed and index == depth - 1:
            # Mistake: a float32 softmax inside a 16-bit block.
            layers.append(keras.layers.Dense(10, activation="softmax", dtype="float32"))
        blocks.append(tfrecompute.RecomputeBlock(layers, name=f"block_{index}"))
    head = [] if not fixed else [keras.layers.Dense(10, activation="softmax", dtype="float32")]
    name = "fixed" if fixed else "naive"
    return keras.Sequential(
        [keras.Input((width,)), keras.layers.Dense(width), *blocks, *head], name=name
    )


def report(model: keras.Model, optimizer: keras.optimizers.Optimizer | None = None) -> None:
    findings = check_precision(model, optimizer=optimizer)
    print(f"check_precision({model.name}): {len(findings)} finding(s)")
    for finding in findings:
        print(f"  {finding.severity:<7} {finding.path}: {finding.message}")
        print(f"          fix: {finding.fix}")


def say(text: str, start: float) -> None:
    """A progress line: what the example does next, and the time since it started."""
    print(f"[{time.perf_counter() - start:5.0f} s] {text}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--policy", choices=["mixed_float16", "mixed_bfloat16"], default="mixed_float16"
    )
    parser.add_argument("--depth", type=int, default=4, help="number of blocks")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--verbose", action="store_true", help="show TensorFlow's start-up logs")
    args = parser.parse_args(argv)
    start = time.perf_counter()

    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.samples, args.width)).astype("float32")
    y = rng.integers(0, 10, size=(args.samples,))

    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(args.policy)  # before creating any layer
    try:
        say(f"building a model with three mistakes under {args.policy}", start)
        naive = build(depth=args.depth, width=args.width, fixed=False)
        naive(x[:1])
        # Mistake: an optimizer without loss scaling (matters for float16).
        report(naive, keras.optimizers.Adam())

        say("building it fixed", start)
        model = build(depth=args.depth, width=args.width, fixed=True)
        model(x[:1])
        # Under a mixed_float16 model policy, compile wraps the optimizer in a
        # LossScaleOptimizer (auto_scale_loss=True).
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
        report(model)

        say(
            f"training the fixed model {args.epochs} epochs (16-bit matrix products are slow "
            "on many CPUs: minutes at the default size)",
            start,
        )
        history = model.fit(x, y, batch_size=args.batch_size, epochs=args.epochs, verbose=1)
        print(f"trained {model.name} under {args.policy}: loss {history.history['loss']}")
        if isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer):
            print(f"loss scale now {float(model.optimizer.dynamic_scale.numpy()):g}")
    finally:
        keras.config.set_dtype_policy(previous)


if __name__ == "__main__":
    main()
