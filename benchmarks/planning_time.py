"""How long planning takes, beside the model's size: `plan`, then `recompute` on the same sample.

Each model is built with random weights in a fresh process (nothing cached
from another model), then `tfrecompute.plan(model, sample=x)` is timed on the
wall clock (`time.perf_counter`) and in CPU time (`time.process_time`, every
thread of the process), and `tfrecompute.recompute(model, sample=x)` right
after it: the chain the plan holds is reused (NOTE [ The pipeline ] in
`tfrecompute/pipeline.py`), so the second call plans and applies without
profiling again. Reported per model: parameters, layer calls traced, links of
the chain, both times of each call. Writes `planning_time.json` and `.md` to
`benchmarks/results/` (or `--out`).

    python benchmarks/planning_time.py [--models mlp bert_base resnet152] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # for `benchmarks._report` (and this checkout's tfrecompute)

from benchmarks import _report  # noqa: E402

MODELS = (
    "mlp",
    "bert_tiny",
    "qwen3_5_tiny",
    "gpt2_small",
    "bert_base",
    "resnet50",
    "resnet152",
)
SMOKE_MODELS = ("mlp", "bert_tiny")


def _tokens(batch: int, sequence: int) -> dict[str, Any]:
    import numpy as np

    rng = np.random.default_rng(0)
    return {
        "token_ids": rng.integers(1, 100, (batch, sequence)).astype("int32"),
        "padding_mask": np.ones((batch, sequence), "int32"),
    }


def _build(name: str) -> tuple[Any, Any, str]:
    """The model, a sample batch, and the size it was built at."""
    import keras
    import keras_hub
    import numpy as np

    rng = np.random.default_rng(0)
    if name == "mlp":
        model = keras.Sequential(
            [keras.Input((256,))] + [keras.layers.Dense(256, activation="relu") for _ in range(8)]
        )
        return model, rng.normal(size=(64, 256)).astype("float32"), "8 x Dense(256), batch 64"
    if name in ("bert_tiny", "bert_base"):
        layers, hidden = (2, 32) if name == "bert_tiny" else (12, 768)
        model = keras_hub.models.BertBackbone(
            vocabulary_size=30522 if name == "bert_base" else 100,
            num_layers=layers,
            num_heads=max(2, hidden // 64),
            hidden_dim=hidden,
            intermediate_dim=4 * hidden,
            max_sequence_length=128,
        )
        x = {**_tokens(8, 128), "segment_ids": np.zeros((8, 128), "int32")}
        return model, x, f"{layers} layers, hidden {hidden}, sequence 128, batch 8"
    if name == "gpt2_small":
        model = keras_hub.models.GPT2Backbone(
            vocabulary_size=50257, num_layers=12, num_heads=12, hidden_dim=768,
            intermediate_dim=3072, max_sequence_length=128,
        )  # fmt: skip
        return model, _tokens(8, 128), "12 layers, hidden 768, sequence 128, batch 8"
    if name == "qwen3_5_tiny":
        model = keras_hub.models.Qwen3_5Backbone(**_qwen3_5_tiny())
        return model, _tokens(2, 8), "4 layers, hidden 32, sequence 8, batch 2"
    if name in ("resnet50", "resnet152"):
        build = keras.applications.ResNet50 if name == "resnet50" else keras.applications.ResNet152
        model = build(weights=None, input_shape=(224, 224, 3), classes=1000)
        x = rng.normal(size=(8, 224, 224, 3)).astype("float32")
        return model, x, "224x224 images, batch 8"
    raise ValueError(f"planning_time: unknown model. Received: name={name!r}.")


def _qwen3_5_tiny() -> dict[str, Any]:
    """A small Qwen3.5 (its linear-attention layers keep their default heads)."""
    return {
        "vocabulary_size": 100,
        "num_layers": 4,
        "num_query_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_dim": 32,
        "intermediate_dim": 64,
    }


def _timed(run: Any) -> tuple[Any, float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    result = run()
    return result, time.perf_counter() - wall, time.process_time() - cpu


def worker(name: str) -> dict[str, Any]:
    """Builds `name` and times `plan` then `recompute` on one sample (in this process)."""
    import warnings

    import tfrecompute
    from tfrecompute.costs.profile import ProfiledModel

    model, x, size = _build(name)
    model(x)  # built and run once: the times below are planning's alone
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan, plan_wall, plan_cpu = _timed(lambda: tfrecompute.plan(model, sample=x))
        _, again_wall, again_cpu = _timed(lambda: tfrecompute.recompute(model, sample=x))
    source = plan.chain.source
    calls = len(source.graph.calls) if isinstance(source, ProfiledModel) else None
    return {
        "model": name,
        "size": size,
        "parameters": int(model.count_params()),
        "calls": calls,
        "links": plan.chain.n,
        "segments": len(plan.segments),
        "plan_wall_s": plan_wall,
        "plan_cpu_s": plan_cpu,
        "recompute_after_plan_wall_s": again_wall,
        "recompute_after_plan_cpu_s": again_cpu,
    }


def _table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model | size | parameters | calls | links | `plan` wall / CPU | "
        "`recompute` after it, wall / CPU |",
        "|---|---|---:|---:|---:|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['model']} | {row['size']} | {row['parameters'] / 1e6:.2f} M | "
            f"{row['calls']} | {row['links']} | "
            f"{row['plan_wall_s']:.1f} s / {row['plan_cpu_s']:.1f} s | "
            f"{row['recompute_after_plan_wall_s']:.1f} s / "
            f"{row['recompute_after_plan_cpu_s']:.1f} s |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=MODELS)
    parser.add_argument("--smoke", action="store_true", help="two small models, to a temp dir")
    parser.add_argument("--out", type=pathlib.Path)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker)))
        return
    names = args.models or (SMOKE_MODELS if args.smoke else MODELS)
    rows, loads = [], []
    for name in names:
        print(f"planning_time: {name} ...", file=sys.stderr, flush=True)
        loads.append(os.getloadavg()[0])
        rows.append(_report.run_worker(pathlib.Path(__file__), ["--worker", name], timeout=1800))
    report = {
        "machine": _report.machine(),
        "load_average_at_each_model": loads,
        "versions": _report.versions("tensorflow", "keras", "keras-hub"),
        "rows": rows,
    }
    out = _report.output_dir(args.out, smoke=args.smoke, name="planning_time")
    header = (
        "# Planning time\n\nEach model in a fresh process, random init; `plan` profiles "
        "the model (trace, price, plan), `recompute` right after it on the same sample "
        "reuses the chain the plan holds. Wall and CPU seconds; on a shared machine the "
        "wall clock stretches with the load, CPU time much less. Load (1-minute average, "
        f"{os.cpu_count()} cores) as each model began: {', '.join(f'{x:.1f}' for x in loads)}."
        "\n\n"
    )
    for path in _report.write(out, "planning_time", report, header + _table(rows)):
        print(path)


if __name__ == "__main__":
    main()
