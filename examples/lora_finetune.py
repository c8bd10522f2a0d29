"""LoRA fine-tuning with checkpointing: keras-hub's `enable_lora`, then `recompute`.

Builds a small keras-hub Llama backbone twice from one seed, enables LoRA on
both (the backbone frozen, rank-r adapters on the attention projections), and
checkpoints one of them. Both train on the same batches; the example prints
how many transformer layers are checkpointed, that the frozen weights did not
move, and how far apart the two models' adapters ended.

    python examples/lora_finetune.py --layers 4 --hidden 128 --sequence 256
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
import keras_hub  # noqa: E402
import numpy as np  # noqa: E402


def build(args: argparse.Namespace) -> keras.Model:
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=1000,
        num_layers=args.layers,
        num_query_heads=4,
        num_key_value_heads=2,
        hidden_dim=args.hidden,
        intermediate_dim=2 * args.hidden,
    )
    backbone.enable_lora(args.rank)  # freezes the backbone, adds trainable adapters
    return backbone


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--sequence", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)

    rng = np.random.default_rng(0)
    samples = args.batch_size * args.steps
    x = {
        "token_ids": rng.integers(1, 1000, (samples, args.sequence)).astype("int32"),
        "padding_mask": np.ones((samples, args.sequence), "int32"),
    }
    y = rng.normal(size=(samples, args.sequence, args.hidden)).astype("float32")
    batch = keras.tree.map_structure(lambda a: a[: args.batch_size], x)

    print("building two LoRA backbones and planning one of them", flush=True)
    model, control = build(args), build(args)
    tfrecompute.recompute(model, sample=batch)  # the same model, checkpointed
    applied = tfrecompute.checkpoints(model)  # what was applied, or why nothing was
    print(applied.summary().splitlines()[0])
    segments = applied.plan.segments if applied else ()
    recomputed = {i for start, stop in segments for i in range(start, stop)}
    layers = sum("transformer_layer" in applied.plan.chain.names[i] for i in recomputed)
    print(f"{layers} of {args.layers} frozen transformer layers checkpointed")

    frozen = [v.numpy() for v in model.non_trainable_weights]
    for m, label in ((model, "checkpointed"), (control, "control")):
        print(f"training the {label} model {args.steps} steps", flush=True)
        m.compile(optimizer=keras.optimizers.AdamW(1e-3), loss="mse")
        m.fit(x, y, batch_size=args.batch_size, epochs=1, shuffle=False, verbose=1)
    moved = max(
        float(np.max(np.abs(v.numpy() - before)))
        for v, before in zip(model.non_trainable_weights, frozen)
        if "seed_generator" not in v.path
    )
    print(f"{len(model.trainable_weights)} adapter weights trained; frozen weights moved {moved}")
    difference = max(
        float(np.max(np.abs(a.numpy() - b.numpy())))
        for a, b in zip(model.trainable_weights, control.trainable_weights)
    )
    print(f"largest adapter difference with and without checkpointing: {difference:.2e}")


if __name__ == "__main__":
    main()
