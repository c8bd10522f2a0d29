"""recompute() on models nobody here designed: keras-hub backbones as built, subclassed code.

For models of `tests/any_models.py` (keras-hub BERT, GPT-2, ViT, CLIP, DeiT
and RWKV7 backbones built from their constructors with random init, a
subclassed transformer that loops over its blocks, a Functional model of
subclassed layers that each hold a Sequential, a classifier calling a nested
Functional backbone; SGD) and a few built here (a Llama with LoRA adapters,
one under `mixed_bfloat16`, a Gemma causal LM with LoRA under
`mixed_bfloat16`, a BERT classifier with LoRA and one under `mixed_float16`,
ResNet50V2 on 32x32 images at batch 2 and a
2-layer decoder with a 32,000-token vocabulary, whose steps peak in the
weights' updates; Adam), and the BERT and the subclassed transformer built,
compiled and checkpointed inside a `MirroredStrategy` over two logical CPUs
(`*_mirrored`; `measure_step`'s `train_on_batch` gives each replica the
whole batch, and both allocate from the one CPU allocator it reads, so
their peaks are about twice the single-device rows and the per-replica
predictions half), at benchmark sizes:

* memory: the allocator peak one compiled training step added (`measure_step`)
  without recompute, with the default plan (`recompute(model, sample=...)`,
  optimal: the least peak at the least recompute) and with `sqrt`, each
  variant in a fresh process, with the predicted peak beside it;
* time: the step time of the default plan against no recompute, measured in
  one process in alternating rounds on two copies of the model with the same
  weights (an in-place checkpoint changes the model it is applied to), as
  CPU-time and wall-clock ratios.

Writes `any_model.json` and `any_model.md` to benchmarks/results/.

    python benchmarks/any_model.py            # about 20 minutes
    python benchmarks/any_model.py --smoke    # small sizes, a temporary folder
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
    sys.path.insert(0, str(ROOT))  # for `benchmarks._report`, `tests.any_models`

from benchmarks import _report  # noqa: E402

NAME = "any_model"
VARIANTS = ("none", "default", "sqrt")
FULL = {
    "bert": {"layers": 4, "hidden": 128, "sequence": 128, "batch": 16},
    "gpt2": {"layers": 4, "hidden": 128, "sequence": 128, "batch": 16},
    "vit": {"layers": 6, "hidden": 128, "image": 64, "batch": 32},
    "loop_transformer": {"layers": 6, "hidden": 128, "sequence": 128, "batch": 16},
    "towers": {"width": 1024, "batch": 512},
    "nested_backbone": {"width": 1024, "batch": 512},
    "clip": {"layers": 4, "hidden": 128, "sequence": 77, "batch": 16},
    "llama_lora": {"layers": 4, "hidden": 128, "sequence": 256, "batch": 4},
    "llama_bfloat16": {"layers": 4, "hidden": 128, "sequence": 256, "batch": 4},
    "resnet50v2_32px": {"batch": 2},
    "qwen3_32k_vocab": {"layers": 2, "hidden": 128, "sequence": 32, "batch": 2},
    "deit": {"layers": 4, "hidden": 128, "image": 64, "batch": 32},
    "rwkv7": {"layers": 4, "hidden": 256, "sequence": 32, "batch": 64},
    "gemma_lm_lora_bfloat16": {"layers": 4, "hidden": 128, "sequence": 256, "batch": 4},
    "bert_classifier_lora": {"layers": 4, "hidden": 128, "sequence": 128, "batch": 16},
    "bert_classifier_float16": {"layers": 4, "hidden": 128, "sequence": 128, "batch": 16},
    "bert_mirrored": {"layers": 4, "hidden": 128, "sequence": 128, "batch": 16},
    "loop_transformer_mirrored": {"layers": 6, "hidden": 128, "sequence": 128, "batch": 16},
}
# The smoke run's one model runs every step of the others, in a strategy's scope too.
SMOKE = {"bert_mirrored": {"layers": 2, "hidden": 64, "sequence": 64, "batch": 8}}
MIRRORED = "_mirrored"
"""A model name's suffix: built, compiled and checkpointed in a two-replica MirroredStrategy."""
MiB = 2**20


def _llama_lora(**sizes: int) -> tuple[Any, Any, Any, str]:
    """LoRA rank 4 on every decoder layer; the rest frozen."""
    from tests import any_models

    model, (x, y) = any_models.llama(**sizes)
    model.enable_lora(4)
    return model, x, y, "adam"


def _llama_bfloat16(**sizes: int) -> tuple[Any, Any, Any, str]:
    import keras

    from tests import any_models

    keras.config.set_dtype_policy("mixed_bfloat16")  # this worker's process only
    model, (x, y) = any_models.llama(**sizes)
    return model, x, y, "adam"


def _resnet50v2_32px(batch: int) -> tuple[Any, Any, Any, str]:
    """Weights beside tiny activations: the step peaks in Adam's updates."""
    import keras
    import numpy as np

    model = keras.applications.ResNet50V2(weights=None, input_shape=(32, 32, 3), classes=10)
    x = np.random.default_rng(0).random((batch, 32, 32, 3), dtype=np.float32)
    return model, x, np.zeros((batch, 10), "float32"), "adam"


def _qwen3_32k_vocab(layers: int, hidden: int, sequence: int, batch: int) -> Any:
    """A 2-layer decoder and a 32,000-token head: the embeddings are most of the step."""
    import keras
    import keras_hub
    import numpy as np

    backbone = keras_hub.models.Qwen3Backbone(
        vocabulary_size=32000, num_layers=layers, num_query_heads=4, num_key_value_heads=2,
        head_dim=hidden // 4, hidden_dim=hidden, intermediate_dim=2 * hidden,
    )  # fmt: skip
    inputs = {
        name: keras.Input((sequence,), dtype="int32", name=name)
        for name in ("token_ids", "padding_mask")
    }
    model = keras.Model(inputs, keras.layers.Dense(32000)(backbone(inputs)))
    rng = np.random.default_rng(0)
    x = {
        "token_ids": rng.integers(0, 32000, (batch, sequence)).astype("int32"),
        "padding_mask": np.ones((batch, sequence), "int32"),
    }
    return model, x, np.zeros((batch, sequence, 32000), "float32"), "adam"


def _gemma_lm_lora_bfloat16(layers: int, hidden: int, sequence: int, batch: int) -> Any:
    """A causal LM whose token embedding is tied to its logits, LoRA rank 4, `mixed_bfloat16`."""
    import keras
    import keras_hub
    import numpy as np

    keras.config.set_dtype_policy("mixed_bfloat16")  # this worker's process only
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=1000, num_layers=layers, num_query_heads=4, num_key_value_heads=1,
        hidden_dim=hidden, intermediate_dim=2 * hidden, head_dim=hidden // 4,
    )  # fmt: skip
    model = keras_hub.models.GemmaCausalLM(backbone, preprocessor=None)
    backbone.enable_lora(4)
    x = {
        "token_ids": np.random.default_rng(0).integers(1, 1000, (batch, sequence)).astype("int32"),
        "padding_mask": np.ones((batch, sequence), "int32"),
    }
    return model, x, np.zeros((batch, sequence, 1000), "float32"), "adam"


def _bert_classifier_lora(layers: int, hidden: int, sequence: int, batch: int) -> Any:
    """keras-hub's BERT classifier with LoRA rank 4 on its backbone."""
    model, x, y, optimizer = _bert_classifier_float16(layers, hidden, sequence, batch, "float32")
    model.backbone.enable_lora(4)
    return model, x, y, optimizer


def _bert_classifier_float16(
    layers: int, hidden: int, sequence: int, batch: int, policy: str = "mixed_float16"
) -> Any:
    """keras-hub's BERT classifier, under `mixed_float16` by default (loss scaling)."""
    import keras
    import keras_hub
    import numpy as np

    keras.config.set_dtype_policy(policy)  # this worker's process only

    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=1000, num_layers=layers, num_heads=4, hidden_dim=hidden,
        intermediate_dim=4 * hidden, max_sequence_length=sequence,
    )  # fmt: skip
    model = keras_hub.models.BertTextClassifier(backbone, num_classes=2, preprocessor=None)
    rng = np.random.default_rng(0)
    x = {
        "token_ids": rng.integers(1, 1000, (batch, sequence)).astype("int32"),
        "segment_ids": np.zeros((batch, sequence), "int32"),
        "padding_mask": np.ones((batch, sequence), "int32"),
    }
    return model, x, np.zeros((batch, 2), "float32"), "adam"


# Models built here, each with the optimizer it is trained with; the others come
# from tests/any_models.py and train with SGD.
BUILDERS = {
    "llama_lora": _llama_lora,
    "llama_bfloat16": _llama_bfloat16,
    "resnet50v2_32px": _resnet50v2_32px,
    "qwen3_32k_vocab": _qwen3_32k_vocab,
    "gemma_lm_lora_bfloat16": _gemma_lm_lora_bfloat16,
    "bert_classifier_lora": _bert_classifier_lora,
    "bert_classifier_float16": _bert_classifier_float16,
}


def _scope(name: str) -> Any:
    """The scope a model is built, compiled and checkpointed in: a `MirroredStrategy` over
    two logical CPUs for a `*_mirrored` name (this worker's process only), else none."""
    import contextlib

    import tensorflow as tf

    if not name.endswith(MIRRORED):
        return contextlib.nullcontext()
    if not _STRATEGY:  # one per process: strategies made later would reuse its collective keys
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()]
        )
        _STRATEGY.append(tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"]))
    return _STRATEGY[0].scope()


_STRATEGY: list[Any] = []


def _build(name: str, sizes: dict[str, int]) -> Any:
    """The model compiled, one batch; a `*_mirrored` model in its strategy's scope, which the
    caller enters again to checkpoint it."""
    with _scope(name):
        return _build_model(name.removesuffix(MIRRORED), sizes)


def _build_model(name: str, sizes: dict[str, int]) -> Any:
    import keras
    import numpy as np

    from tests import any_models

    keras.utils.set_random_seed(0)
    if name in BUILDERS:
        model, x, y, optimizer = BUILDERS[name](**sizes)
    else:
        model, (x, y) = {**any_models.MODELS, **any_models.MORE_MODELS}[name](**sizes)
        optimizer = "sgd"
    outputs = model(x)
    if y is None and name not in any_models.MODELS:  # targets for every output (CLIP: named)
        y = keras.tree.map_structure(lambda t: np.zeros(t.shape, "float32"), outputs)
    # No metrics (None would keep those a keras-hub task compiled itself with).
    model.compile(optimizer=optimizer, loss="mse", metrics=[], weighted_metrics=[])
    return model, x, y


def _checkpointed(model: Any, variant: str, x: Any, y: Any) -> tuple[Any, Any]:
    """The model of a variant and its plan (None without recompute), in the model's
    strategy's scope if it has one."""
    import tfrecompute

    if variant == "none":
        return model, None
    with model.distribute_strategy.scope():  # the default strategy's for most models
        plan = tfrecompute.plan(model, None if variant == "default" else variant, sample=(x, y))
        return tfrecompute.recompute(model, plan), plan


def measure_memory(name: str, variant: str, sizes: dict[str, int]) -> dict[str, Any]:
    """Worker: one variant of one model, in this (fresh) process."""
    import tfrecompute
    from tfrecompute import strategies

    model, x, y = _build(name, sizes)
    predicted_none = strategies.none(tfrecompute.profile(model, sample=(x, y))).peak_bytes
    checkpointed, plan = _checkpointed(model, variant, x, y)
    step = tfrecompute.measure_step(checkpointed, x, y, steps=3)
    chain = plan.chain if plan is not None else None
    return {
        "model": name,
        "variant": variant,
        "peak_bytes": step.peak_bytes,
        "predicted_bytes": plan.peak_bytes if plan is not None else predicted_none,
        "recompute_share": plan.recompute_cost / chain.total_forward_cost if plan else 0.0,
        "segments": len(plan.segments) if plan is not None else 0,
        "links": chain.n if chain is not None else None,
        "same_object": checkpointed is model,
        "device": step.device,
    }


def measure_time(name: str, sizes: dict[str, int], rounds: int, steps: int) -> dict[str, Any]:
    """Worker: step times without recompute and with the default plan, in alternating rounds."""
    import numpy as np

    plain, x, y = _build(name, sizes)
    other, _, _ = _build(name, sizes)
    for variable, value in zip(other.weights, [np.asarray(v) for v in plain.weights]):
        variable.assign(value)
    checkpointed, _ = _checkpointed(other, "default", x, y)
    models = [plain, checkpointed]
    for model in models:
        model.train_on_batch(x, y)  # trace the train functions

    def turn(model: Any) -> Any:
        def run(times: _report.StepTimes) -> None:
            for _ in range(steps):
                times.time(lambda: model.train_on_batch(x, y))

        return run

    times = [_report.StepTimes(), _report.StepTimes()]
    _report.interleaved_rounds([turn(m) for m in models], times, rounds=rounds, alternate=True)
    cpu = [statistics.median(t.cpu_per_round()) for t in times]
    wall = [statistics.median(t.wall_per_round()) for t in times]
    return {
        "model": name,
        "cpu_seconds": cpu,
        "wall_seconds": wall,
        "cpu_time_ratio": cpu[1] / cpu[0],
        "wall_time_ratio": wall[1] / wall[0],
    }


def _markdown(report: dict[str, Any]) -> str:
    rows = {(r["model"], r["variant"]): r for r in report["memory"]}
    times = {t["model"]: t for t in report["time"]}
    lines = [
        "# recompute() on keras-hub backbones and subclassed models",
        "",
        f"Machine: {report['machine']['processor']}, {report['machine']['cpu_count']} cores; "
        f"tensorflow {report['versions']['tensorflow']}, keras {report['versions']['keras']}, "
        f"keras-hub {report['versions']['keras-hub']}. Memory: the allocator peak of one "
        "compiled training step, each variant in a fresh process (predicted in brackets). "
        "Time: the default plan's step time over no recompute, alternating rounds in one "
        "process.",
        "",
        "| model | sizes | none MiB | default MiB (x none, recompute) | sqrt MiB (x none) | "
        "default time x none |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for name, sizes in report["sizes"].items():
        none, best, sqrt = (rows[(name, v)] for v in VARIANTS)
        base = none["peak_bytes"] or 1
        t = times.get(name)
        lines.append(
            f"| {name} | {', '.join(f'{k} {v}' for k, v in sizes.items())} | "
            f"{none['peak_bytes'] / MiB:.1f} ({none['predicted_bytes'] / MiB:.1f}) | "
            f"{best['peak_bytes'] / MiB:.1f} ({best['predicted_bytes'] / MiB:.1f}), "
            f"{best['peak_bytes'] / base:.2f}x, {best['recompute_share']:.0%} | "
            f"{sqrt['peak_bytes'] / MiB:.1f} ({sqrt['predicted_bytes'] / MiB:.1f}), "
            f"{sqrt['peak_bytes'] / base:.2f}x | "
            + (_report.ratios(t["cpu_time_ratio"], t["wall_time_ratio"]) if t else "-")
            + " |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="small sizes, a temporary folder")
    parser.add_argument("--out", type=Path, help="the folder to write to")
    parser.add_argument(
        "--models",
        nargs="+",
        choices=sorted(FULL),
        help="only these models; their rows replace theirs in the results already written",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        task = json.loads(args.worker)
        result = (
            measure_time(task["model"], task["sizes"], task["rounds"], task["steps"])
            if task["kind"] == "time"
            else measure_memory(task["model"], task["variant"], task["sizes"])
        )
        print(json.dumps(result))
        return result
    sizes = SMOKE if args.smoke else FULL
    if args.models:
        sizes = {name: FULL[name] for name in args.models}
    rounds, steps = (2, 1) if args.smoke else (5, 3)
    script = Path(__file__).resolve()
    memory = [
        _report.run_worker(script, ["--worker", json.dumps(task)], timeout=1800)
        for task in (
            {"kind": "memory", "model": m, "variant": v, "sizes": s}
            for m, s in sizes.items()
            for v in VARIANTS
        )
    ]
    time = [
        _report.run_worker(
            script,
            [
                "--worker",
                json.dumps(
                    {"kind": "time", "model": m, "sizes": s, "rounds": rounds, "steps": steps}
                ),
            ],
            timeout=1800,
        )
        for m, s in sizes.items()
    ]
    report = {
        "machine": _report.machine(),
        "versions": _report.versions("tensorflow", "keras", "keras-hub"),
        "sizes": sizes,
        "memory": memory,
        "time": time,
    }
    out = _report.output_dir(args.out, smoke=args.smoke, name=NAME)
    if args.models:
        report = _merged(out / f"{NAME}.json", report)
    _report.write(out, NAME, report, _markdown(report))
    return report


def _merged(path: Path, report: dict[str, Any]) -> dict[str, Any]:
    """`report`'s rows in place of their models' rows in the report at `path`, if any."""
    if not path.exists():
        return report
    old = json.loads(path.read_text())
    new = set(report["sizes"])
    sizes = {**old["sizes"], **report["sizes"]}
    order = [name for name in FULL if name in sizes]
    return {
        **report,
        "sizes": {name: sizes[name] for name in order},
        "memory": [r for r in old["memory"] if r["model"] not in new] + report["memory"],
        "time": [t for t in old["time"] if t["model"] not in new] + report["time"],
    }


if __name__ == "__main__":
    main()
