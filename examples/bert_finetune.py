"""Fine-tune a keras-hub BERT classifier under a memory budget.

Builds `keras_hub.models.BertTextClassifier` around a `BertBackbone` (random
init here; `from_preset` loads real weights the same way), lets
`tfrecompute.recompute` plan which of its calls to recompute so that a
training step fits the budget, and trains it and a plain classifier from
the same weights to show the memory each step took and that they trained
alike; the checkpointed classifier stays a `BertTextClassifier`, whose
saved weights load into one built without checkpointing.

    python examples/bert_finetune.py --budget 128MiB  # --verbose shows TensorFlow's logs
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import tfrecompute

# Before keras starts TensorFlow: hide its start-up logs unless --verbose, and let its
# CPU allocator count bytes (measuring reads them).
tfrecompute.quiet_tensorflow(verbose="--verbose" in sys.argv)
tfrecompute.count_cpu_memory()

import keras  # noqa: E402
import keras_hub  # noqa: E402
import numpy as np  # noqa: E402


def build(args: argparse.Namespace) -> keras.Model:
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=1000,
        num_layers=args.layers,
        num_heads=4,
        hidden_dim=args.hidden,
        intermediate_dim=4 * args.hidden,
        max_sequence_length=args.sequence,
    )
    return keras_hub.models.BertTextClassifier(backbone, num_classes=2, preprocessor=None)


def batch(args: argparse.Namespace) -> tuple[dict[str, np.ndarray], np.ndarray]:
    rng = np.random.default_rng(0)
    shape = (args.batch_size, args.sequence)
    x = {
        "token_ids": rng.integers(1, 1000, shape).astype("int32"),
        "padding_mask": np.ones(shape, "int32"),
        "segment_ids": np.zeros(shape, "int32"),
    }
    return x, rng.integers(0, 2, args.batch_size)


def compile_for_training(model: keras.Model) -> None:
    model.compile(
        optimizer=keras.optimizers.AdamW(1e-4),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )


def train(
    model: keras.Model, x: dict[str, np.ndarray], y: np.ndarray, steps: int
) -> tuple[float, float]:
    """Compiles `model` afresh and trains it `steps` steps: (wall, CPU) seconds taken."""
    compile_for_training(model)
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        model.train_on_batch(x, y)
    return time.perf_counter() - wall, time.process_time() - cpu


def say(text: str, start: float) -> None:
    """A progress line: what the example does next, and the time since it started."""
    print(f"[{time.perf_counter() - start:5.0f} s] {text}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--sequence", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--budget", default="128MiB", help="the most memory a step may take")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--verbose", action="store_true", help="show TensorFlow's start-up logs")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    x, y = batch(args)

    say("building the plain classifier and measuring its training step", start)
    plain = build(args)
    plain(x)
    initial = [v.numpy() for v in plain.weights]
    train(plain, x, y, 1)
    before = tfrecompute.measure_step(plain, x, y)

    say(f"planning the checkpointed classifier under {args.budget}", start)
    model = build(args)
    model(x)
    for variable, value in zip(model.weights, initial):
        variable.assign(value)
    plan = tfrecompute.plan(model, budget=args.budget, sample=(x, y))
    print(plan.summary())
    tfrecompute.recompute(model, plan)  # the same classifier, checkpointed
    say("measuring its training step", start)
    train(model, x, y, 1)
    after = tfrecompute.measure_step(model, x, y)

    say(f"training both {args.steps} steps from the same weights", start)
    for variable, value in zip(plain.weights, initial):
        variable.assign(value)
    for variable, value in zip(model.weights, initial):
        variable.assign(value)
    (wall, cpu), (plain_wall, plain_cpu) = (
        train(model, x, y, args.steps),
        train(plain, x, y, args.steps),
    )
    difference = max(float(np.max(np.abs(a - b))) for a, b in zip(plain.weights, model.weights))
    say("saving it and loading the file into a classifier built without checkpointing", start)
    loaded = save_and_load(model, args, x)
    share = after.peak_bytes / tfrecompute.strategies.parse_budget(args.budget)
    print(
        f"BERT classifier, {args.layers} layers, hidden {args.hidden}, sequence "
        f"{args.sequence}, batch {args.batch_size}, on {before.device}"
    )
    print(f"step memory without recompute: {before.peak_bytes / 2**20:.1f} MiB")
    print(
        f"step memory with the plan:      {after.peak_bytes / 2**20:.1f} MiB, "
        f"{share:.0%} of the {args.budget} budget"
    )
    print(
        f"time of {args.steps} steps: {cpu / max(plain_cpu, 1e-9):.2f}x the CPU time without "
        f"recompute ({wall / max(plain_wall, 1e-9):.2f}x the wall time, a noisier clock on a "
        "shared machine)"
    )
    print(f"largest weight difference after {args.steps} steps: {difference:.2e}")
    print(
        f"{type(model).__name__} saved with checkpointing, loaded into one built without: "
        f"largest weight difference {loaded:.2e} (optimizer state included)"
    )


def save_and_load(model: keras.Model, args: argparse.Namespace, x: dict[str, np.ndarray]) -> float:
    """Checkpointing changes how the classifier runs, not what it is: its weights file
    is the plain classifier's and loads into one built without it. The file holds the
    optimizer's state too, so the new classifier gets the same optimizer, built, to
    load it into (keras-hub compiles a task with a default Adam, which has no slots
    yet: Keras would skip the saved optimizer's variables, with a warning)."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "classifier.weights.h5")
        model.save_weights(path)
        served = build(args)
        served(x)
        compile_for_training(served)
        served.optimizer.build(served.trainable_variables)
        served.load_weights(path)
    pairs = [*zip(served.weights, model.weights)]
    pairs += zip(served.optimizer.variables, model.optimizer.variables)
    return max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in pairs)


if __name__ == "__main__":
    main()
