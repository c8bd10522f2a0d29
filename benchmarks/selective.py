"""Selective recompute: the attention core alone, the weight products kept, and full blocks.

Three models:

* a BERT-style encoder of one Functional sub-model per layer (12 layers,
  hidden 256, 4 heads, sequence 512, dropout 0.1 and attention dropout 0.1;
  batch 4 to keep the run short on 2 cores);
* keras-hub's `BertBackbone` at BERT-base width cut to 4 layers (hidden 768,
  12 heads, sequence 256, batch 4; dropout 0.1) under a 2-unit head;
* a Conv-BN-ReLU CNN (10 layers of Conv2D(64, 3) + BatchNormalization +
  ReLU on 64x64 images, batch 16).

Variants: `none` (no recompute), `full` (one `RecomputeBlock` per layer),
`dots` (one `RecomputeBlock(policy="dots")` per layer), `attention`
(`recompute(model, policy="attention")`: every attention core recomputes,
nothing else; the transformers only), `plan@<f>`: `recompute(model,
policy="dots", budget=f x the predicted peak of none, headroom=0)`, the
`optimal` planner weighing the third state, `attn@<f>`: the same with
`policy="attention"` as the third state, and `mix@<f>`: with
`policy=["attention", "dots"]`, four states per segment (the last two on the
transformers only); all profiled with measured times (`measure_time=True`:
each link's forward and its recompute under each policy).

* memory: the allocator peak one compiled training step added
  (`measure_step`), each variant in a fresh process, with the planner's
  prediction beside it;
* time: every variant's step time in one process, in alternating rounds, as
  CPU-time ratios (steady on a shared machine) beside wall-clock ratios to
  `none`;
* op counts: the bytes the forward keeps without recompute and under
  "dots", and the FLOPs a full and a "dots" recompute run, from the profiled
  chain (`profile(model, policy="dots")`);
* op times (the transformers): the CPU time of the train step, of its
  forward, and of one attention core with and without its dropout, each
  traced once and timed 10 times.

Writes `selective.json` and `selective.md` to benchmarks/results/.

    python benchmarks/selective.py            # about 30 minutes on 2 cores
    python benchmarks/selective.py --smoke    # small sizes, a temporary folder
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # for `benchmarks._report`

from benchmarks import _report  # noqa: E402

NAME = "selective"
BASE_VARIANTS = ("none", "full", "dots", "attention")
FULL = {
    "encoder": {"layers": 12, "hidden": 256, "heads": 4, "sequence": 512, "batch": 4},
    "bert": {"layers": 4, "hidden": 768, "heads": 12, "sequence": 256, "batch": 4},
    "cnn": {"layers": 10, "filters": 64, "image": 64, "batch": 16},
}
SMOKE = {
    "encoder": {"layers": 2, "hidden": 32, "heads": 2, "sequence": 64, "batch": 2},
    "bert": {"layers": 2, "hidden": 32, "heads": 2, "sequence": 32, "batch": 2},
    "cnn": {"layers": 2, "filters": 8, "image": 16, "batch": 2},
}
BUDGETS = (0.3, 0.45, 0.6)
POLICIES: dict[str, Any] = {"plan": "dots", "attn": "attention", "mix": ["attention", "dots"]}
"""The policies each planned variant's kind plans with."""
MiB = 2**20


def _encoder_layer(hidden: int, heads: int, sequence: int, index: int) -> Any:
    import keras

    x = inputs = keras.Input((sequence, hidden))
    attention = keras.layers.MultiHeadAttention(heads, hidden // heads, dropout=0.1)(x, x)
    attention = keras.layers.Dropout(0.1)(attention)
    x = keras.layers.LayerNormalization()(keras.layers.Add()([x, attention]))
    mlp = keras.layers.Dense(4 * hidden, activation="gelu")(x)
    mlp = keras.layers.Dropout(0.1)(keras.layers.Dense(hidden)(mlp))
    x = keras.layers.LayerNormalization()(keras.layers.Add()([x, mlp]))
    return keras.Model(inputs, x, name=f"encoder_layer_{index}")


def _conv_layer(filters: int, image: int, channels: int, index: int) -> Any:
    import keras

    inputs = keras.Input((image, image, channels))
    x = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False)(inputs)
    x = keras.layers.ReLU()(keras.layers.BatchNormalization()(x))
    return keras.Model(inputs, x, name=f"conv_layer_{index}")


def variants_of(
    name: str, budgets: Sequence[float], kinds: Sequence[str] = tuple(POLICIES)
) -> list[str]:
    """The variants measured on a model: "attention", "attn@" and "mix@" on the transformers
    only; of the planned ones, those of `kinds`."""
    if name == "cnn":
        return [*BASE_VARIANTS[:3], *(f"plan@{b}" for b in budgets)]
    return [*BASE_VARIANTS, *(f"{kind}@{b}" for kind in kinds for b in budgets)]


def _bert(sizes: dict[str, int]) -> tuple[Any, Any]:
    """keras-hub's BERT under a small head, and its inputs."""
    import keras
    import keras_hub
    import numpy as np

    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=1000,
        num_layers=sizes["layers"],
        num_heads=sizes["heads"],
        hidden_dim=sizes["hidden"],
        intermediate_dim=4 * sizes["hidden"],
        max_sequence_length=sizes["sequence"],
    )
    outputs = keras.layers.Dense(2)(backbone.output["pooled_output"])
    model = keras.Model(backbone.input, outputs, name="bert")
    batch, sequence = sizes["batch"], sizes["sequence"]
    rng = np.random.default_rng(0)
    data = {
        "token_ids": rng.integers(1, 1000, (batch, sequence)).astype("int32"),
        "segment_ids": np.zeros((batch, sequence), "int32"),
        "padding_mask": np.ones((batch, sequence), "int32"),
    }
    return model, data


def _stack(name: str, sizes: dict[str, int], variant: str) -> tuple[Any, Any]:
    """The encoder or the CNN, one `RecomputeBlock` per layer unless `variant` is none."""
    import keras
    import numpy as np

    from tfrecompute import RecomputeBlock

    rng = np.random.default_rng(0)
    batch = sizes["batch"]
    if name == "encoder":
        hidden, sequence = sizes["hidden"], sizes["sequence"]
        layers = [
            _encoder_layer(hidden, sizes["heads"], sequence, i) for i in range(sizes["layers"])
        ]
        ids = keras.Input((sequence,), dtype="int32")
        x = keras.layers.Embedding(1000, hidden)(ids)
        inputs, data = ids, rng.integers(0, 1000, (batch, sequence)).astype("int32")
    else:
        image, filters = sizes["image"], sizes["filters"]
        layers = [
            _conv_layer(filters, image, 3 if i == 0 else filters, i) for i in range(sizes["layers"])
        ]
        inputs = x = keras.Input((image, image, 3))
        data = rng.normal(size=(batch, image, image, 3)).astype("float32")
    for layer in layers:
        if variant in ("none", "attention"):
            x = layer(x)
        else:
            x = RecomputeBlock(layer, policy=None if variant == "full" else "dots")(x)
    pooled = keras.layers.GlobalAveragePooling1D() if name == "encoder" else None
    pooled = pooled or keras.layers.GlobalAveragePooling2D()
    outputs = keras.layers.Dense(2)(pooled(x))
    return keras.Model(inputs, outputs, name=name), data


def build(name: str, sizes: dict[str, int], variant: str) -> tuple[Any, Any, Any]:
    """The model of a base variant (`none`, `full`, `dots`, `attention`), a batch and targets."""
    import keras
    import numpy as np

    import tfrecompute

    keras.utils.set_random_seed(0)
    if name == "bert":
        model, data = _bert(sizes)
        if variant in ("full", "dots"):
            import keras_hub

            where = keras_hub.layers.TransformerEncoder
            tfrecompute.recompute(
                model, sample=data, where=where, policy="dots" if variant == "dots" else None
            )
    else:
        model, data = _stack(name, sizes, variant)
    if variant == "attention":
        tfrecompute.recompute(model, policy="attention")
    model.compile(optimizer="sgd", loss="mse")
    targets = np.random.default_rng(1).normal(size=(sizes["batch"], 2)).astype("float32")
    return model, data, targets


def _variant(name: str, sizes: dict[str, int], variant: str) -> tuple[Any, Any, Any, Any]:
    """The model of any variant, its data, and its plan (None for the base variants)."""
    import tfrecompute
    from tfrecompute import strategies

    if variant in BASE_VARIANTS:
        return (*build(name, sizes, variant), None)
    model, x, y = build(name, sizes, "none")
    kind, share = variant.split("@")
    policy = POLICIES[kind]
    # Each state priced by measured time: the forward and the recompute under the policy
    # (NOTE [ Measured state times ] in tfrecompute/costs/state_time.py).
    chain = tfrecompute.profile(model, sample=x, policy=policy, measure_time=True)
    budget = max(int(float(share) * strategies.none(chain).peak_bytes), strategies.min_peak(chain))
    plan = strategies.plan_within("selective", strategies.optimal, chain, budget, 0.0)
    return tfrecompute.recompute(model, plan, policy=policy), x, y, plan


def measure_memory(name: str, sizes: dict[str, int], variant: str) -> dict[str, Any]:
    """The step memory of one variant (a worker runs it in a fresh process)."""
    import tfrecompute

    model, x, y, plan = _variant(name, sizes, variant)
    step = tfrecompute.measure_step(model, x, y, steps=3)
    row: dict[str, Any] = {"model": name, "variant": variant, "peak_bytes": step.peak_bytes}
    if plan is not None:
        row.update(
            predicted_bytes=plan.peak_bytes,
            segments=len(plan.segments),
            states={
                plan.chain.policy_name(k): sum(1 for s in plan.selective if s == k)
                for k in range(1, len(plan.chain.policy_states) + 1)
            },
            recompute_share=plan.recompute_cost / plan.chain.total_forward_cost,
        )
    return row


def measure_time(
    name: str, sizes: dict[str, int], variants: Sequence[str], rounds: int, steps: int
) -> dict[str, Any]:
    """Worker: every variant's step time, in alternating rounds in this process."""
    built = [_variant(name, sizes, v) for v in variants]
    for model, x, y, _ in built:
        model.train_on_batch(x, y)  # trace the train functions

    def turn(model: Any, x: Any, y: Any) -> Any:
        def run(times: _report.StepTimes) -> None:
            for _ in range(steps):
                times.time(lambda: model.train_on_batch(x, y))

        return run

    times = [_report.StepTimes() for _ in variants]
    turns = [turn(m, x, y) for m, x, y, _ in built]
    _report.interleaved_rounds(turns, times, rounds=rounds, alternate=True)
    cpu = [statistics.median(t.cpu_per_round()) for t in times]
    wall = [statistics.median(t.wall_per_round()) for t in times]
    return {
        "model": name,
        "variants": list(variants),
        "cpu_seconds": cpu,
        "wall_seconds": wall,
        "ops": op_counts(built[0][0], built[0][1]),
        "op_times": op_times(built[0][0], built[0][1], sizes) if name != "cnn" else None,
    }


def _cpu_ms(fn: Any, runs: int = 10) -> float:
    """The median CPU time of `fn()` in milliseconds, after one call (tracing)."""
    import time

    fn()
    times = []
    for _ in range(runs):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return 1000 * statistics.median(times)


def op_times(model: Any, x: Any, sizes: dict[str, int]) -> dict[str, Any]:
    """CPU milliseconds of the model's forward, its train step, and its attention cores
    (each core once, with and without its dropout, on projected inputs of the real shapes)."""
    import tensorflow as tf

    from tfrecompute.layers.attention import attention_layers

    cores = attention_layers([model])
    layer = cores[0]
    shape = (sizes["batch"], sizes["sequence"], layer._num_heads, layer._key_dim)
    q = tf.random.normal(shape)
    forward = tf.function(lambda: model(x, training=True))

    def step() -> Any:
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(o) for o in tf.nest.flatten(model(x, training=True))])
        return tape.gradient(loss, model.trainable_variables)

    core = tf.function(lambda: layer._compute_attention(q, q, q, None, True)[0])
    dropout, layer._dropout = layer._dropout, 0.0
    without_dropout = tf.function(lambda: layer._compute_attention(q, q, q, None, True, True)[0])
    without_dropout()  # traced without the dropout
    layer._dropout = dropout
    return {
        "attention_layers": len(cores),
        "forward_ms": _cpu_ms(forward),
        "step_ms": _cpu_ms(tf.function(step)),
        "core_ms": _cpu_ms(core),
        "core_without_dropout_ms": _cpu_ms(without_dropout),
    }


def op_counts(model: Any, sample: Any) -> dict[str, Any]:
    """What the forward keeps for the backward and what each recompute computes, profiled."""
    import tfrecompute
    from tfrecompute import strategies

    chain = tfrecompute.profile(model, sample=sample, policy="dots")
    kept = chain.policy_kept_bytes or ()
    cheaper = chain.policy_forward_cost or ()
    return {
        "links": chain.n,
        "saved_bytes": sum(chain.saved_bytes),
        "dots_kept_bytes": sum(kept),
        "forward_flops": chain.total_forward_cost,
        "dots_recompute_flops": sum(cheaper),
        "predicted_none_bytes": strategies.none(chain).peak_bytes,
    }


def _op_time_lines(times: dict[str, Any] | None) -> list[str]:
    if not times:
        return []
    cores = times["attention_layers"] * times["core_ms"]
    return [
        f"Measured CPU time: the train step {times['step_ms']:.1f} ms, its forward "
        f"{times['forward_ms']:.1f} ms, of which the {times['attention_layers']} attention "
        f"cores {cores:.1f} ms ({cores / max(times['forward_ms'], 1e-9):.0%}; one core "
        f"{times['core_ms']:.2f} ms, {times['core_without_dropout_ms']:.2f} ms without its "
        f"dropout): recomputing every core adds {cores / max(times['step_ms'], 1e-9):.0%} "
        "of a step.",
        "",
    ]


def _states(row: dict[str, Any]) -> str:
    """How many segments each state has: "6 dots, 7 whole"."""
    states = row.get("states", {})
    whole = row["segments"] - sum(states.values())
    return ", ".join([*(f"{count} {name}" for name, count in states.items()), f"{whole} whole"])


def _markdown(report: dict[str, Any]) -> str:
    lines = [
        "# Selective recompute: the attention core, the weight products kept, full blocks",
        "",
        f"Machine: {report['machine']['processor']}, {report['machine']['cpu_count']} cores; "
        f"tensorflow {report['versions']['tensorflow']}, keras {report['versions']['keras']}. "
        "Memory: the allocator peak of one compiled training step, each variant in a fresh "
        "process (the planner's prediction in brackets). Time: step time over `none`, all "
        "variants in alternating rounds in one process, CPU time / wall clock.",
        "",
    ]
    for name, sizes in report["sizes"].items():
        memory = {r["variant"]: r for r in report["memory"] if r["model"] == name}
        timing = next(t for t in report["time"] if t["model"] == name)
        counts = timing["ops"]
        base = memory["none"]["peak_bytes"] or 1
        cpu0, wall0 = timing["cpu_seconds"][0], timing["wall_seconds"][0]
        lines += [
            f"## {name}: {', '.join(f'{k} {v}' for k, v in sizes.items())}",
            "",
            "| variant | step MiB | x none | time x none | plan |",
            "|---|---:|---:|---|---|",
        ]
        for variant, cpu, wall in zip(
            timing["variants"], timing["cpu_seconds"], timing["wall_seconds"]
        ):
            row = memory[variant]
            plan = (
                f"{row['segments']} segments ({_states(row)}), "
                f"{row['recompute_share']:.0%} recompute, predicted "
                f"{row['predicted_bytes'] / MiB:.1f} MiB"
                if "segments" in row
                else "-"
            )
            lines.append(
                f"| {variant} | {row['peak_bytes'] / MiB:.1f} | {row['peak_bytes'] / base:.2f}x | "
                f"{_report.ratios(cpu / cpu0, wall / wall0)} | {plan} |"
            )
        lines += ["", *_op_time_lines(timing.get("op_times"))]
        lines += [
            f"Profiled ({counts['links']} links): the forward keeps "
            f"{counts['saved_bytes'] / MiB:.1f} MiB for the backward without recompute; under "
            f'"dots" a block keeps {counts["dots_kept_bytes"] / MiB:.1f} MiB of weight '
            f"products ({counts['dots_kept_bytes'] / max(counts['saved_bytes'], 1):.0%}); a "
            f"full recompute runs {counts['forward_flops'] / 1e9:.2f} GFLOPs again, a "
            f'"dots" one {counts["dots_recompute_flops"] / 1e9:.3f} GFLOPs (estimated).',
            "",
        ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="small sizes, a temporary folder")
    parser.add_argument("--out", type=Path, help="the folder to write to")
    parser.add_argument("--models", nargs="+", choices=sorted(FULL), help="only these models")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        task = json.loads(args.worker)
        result: Any = {}
        if "variants" in task:
            result["memory"] = [
                measure_memory(task["model"], task["sizes"], v) for v in task["variants"]
            ]
        if "timed" in task:
            result["time"] = measure_time(
                task["model"], task["sizes"], task["timed"], task["rounds"], task["steps"]
            )
        print(json.dumps(result))
        return result
    sizes = SMOKE if args.smoke else FULL
    if args.models:
        sizes = {name: sizes[name] for name in args.models}
    rounds, steps = (2, 1) if args.smoke else (5, 2)
    budgets = BUDGETS[1:2] if args.smoke else BUDGETS
    # The smoke run plans the transformers with both policies at once only: it runs the
    # code of each and of the planner's states.
    kinds = ("mix",) if args.smoke else tuple(POLICIES)
    script = Path(__file__).resolve()

    def run(task: dict[str, Any]) -> Any:
        return _report.run_worker(script, ["--worker", json.dumps(task)], timeout=1800)

    def timing(model: str) -> dict[str, Any]:
        return {"rounds": rounds, "steps": steps, "timed": variants_of(model, budgets, kinds)}

    if args.smoke:  # one process per model measures everything, to keep it short
        results = [
            run({"model": m, "sizes": s, "variants": variants_of(m, budgets, kinds), **timing(m)})
            for m, s in sizes.items()
        ]
    else:  # each variant's memory in a fresh process, then the times in one
        results = [
            run({"model": m, "sizes": s, "variants": [v]})
            for m, s in sizes.items()
            for v in variants_of(m, budgets, kinds)
        ]
        results += [run({"model": m, "sizes": s, **timing(m)}) for m, s in sizes.items()]
    memory = [row for result in results for row in result.get("memory", [])]
    time = [result["time"] for result in results if "time" in result]
    report = {
        "machine": _report.machine(),
        "versions": _report.versions("tensorflow", "keras"),
        "sizes": sizes,
        "budgets": list(BUDGETS),
        "memory": memory,
        "time": time,
    }
    out = _report.output_dir(args.out, smoke=args.smoke, name=NAME)
    _report.write(out, NAME, report, _markdown(report))
    return report


if __name__ == "__main__":
    main()
