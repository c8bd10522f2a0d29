"""Checkpoint a whole Functional model under a memory budget.

Builds a small BERT-style encoder (Embedding, then attention and MLP blocks
with residual adds), asks the planner for the cheapest plan whose predicted
peak fits a budget (less the headroom left for TensorFlow's allocator), prints
the plan, checkpoints the model by it (the same model object: saving it
saves the encoder as defined), and measures one training step before and
after.

    python examples/functional_rewrite.py --batch-size 64
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

from tfrecompute.strategies import (  # noqa: E402
    DEFAULT_HEADROOM,
    format_bytes,
    min_peak,
    simulate,
)


def encoder(*, layers: int, sequence: int, hidden: int, vocab: int = 1000) -> keras.Model:
    ids = keras.Input((sequence,), dtype="int32", name="ids")
    x = keras.layers.Embedding(vocab, hidden)(ids)
    for _ in range(layers):
        attention = keras.layers.MultiHeadAttention(4, hidden // 4, dropout=0.1)(x, x)
        x = keras.layers.LayerNormalization()(keras.layers.Add()([x, attention]))
        mlp = keras.layers.Dense(4 * hidden, activation="gelu")(x)
        mlp = keras.layers.Dropout(0.1)(keras.layers.Dense(hidden)(mlp))
        x = keras.layers.LayerNormalization()(keras.layers.Add()([x, mlp]))
    logits = keras.layers.Dense(2)(keras.layers.GlobalAveragePooling1D()(x))
    return keras.Model(ids, logits, name="encoder")


def say(text: str, start: float) -> None:
    """A progress line: what the example does next, and the time since it started."""
    print(f"[{time.perf_counter() - start:5.0f} s] {text}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--sequence", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument(
        "--budget-share",
        type=float,
        default=0.3,
        help="planned peak between the least feasible one (0) and storing everything (1)",
    )
    parser.add_argument("--verbose", action="store_true", help="show TensorFlow's start-up logs")
    args = parser.parse_args(argv)
    start = time.perf_counter()

    keras.utils.set_random_seed(0)
    model = encoder(layers=args.layers, sequence=args.sequence, hidden=args.hidden)
    say(f"profiling the encoder's {len(model.layers)} layers at batch {args.batch_size}", start)
    chain = tfrecompute.profile(model, batch_size=args.batch_size)
    low, high = min_peak(chain), simulate(chain, []).peak_bytes
    # The planner keeps the predicted peak under budget * (1 - headroom).
    budget = int((low + args.budget_share * (high - low)) / (1 - DEFAULT_HEADROOM))
    plan = tfrecompute.plan(model, "optimal", budget=budget, batch_size=args.batch_size)
    print(
        f"budget {format_bytes(budget)}, planned in {1 - DEFAULT_HEADROOM:.0%} of it "
        f"(predicted peak storing everything: {format_bytes(high)})"
    )
    print(plan.summary())

    rng = np.random.default_rng(0)
    x = rng.integers(0, 1000, size=(args.batch_size, args.sequence)).astype("int32")
    y = rng.integers(0, 2, size=(args.batch_size,))
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(True))
    rows = []
    for label in ("original", "checkpointed"):
        if label == "checkpointed":
            tfrecompute.recompute(model, plan)  # the same model object, checkpointed
        say(f"measuring a compiled training step, {label}", start)
        step = tfrecompute.measure_step(model, x, y)
        rows.append((label, step))
        print(
            f"{label:<14}{format_bytes(step.peak_bytes):>12}{step.seconds * 1e3:>10.1f} ms wall"
            f"{step.cpu_seconds * 1e3:>10.1f} ms CPU"
        )
    base, after = rows[0][1], rows[1][1]
    print(
        f"measured {after.peak_bytes / base.peak_bytes:.0%} of the memory at "
        f"{after.cpu_seconds / base.cpu_seconds:.2f}x the CPU time per step "
        f"({after.seconds / base.seconds:.2f}x the wall time, a noisier clock on a shared "
        f"machine); predicted peak {format_bytes(plan.peak_bytes)}; the checkpointed step took "
        f"{after.peak_bytes / budget:.0%} of the budget"
    )


if __name__ == "__main__":
    main()
