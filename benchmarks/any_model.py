"""recompute() on models nobody here designed: keras-hub backbones as built, subclassed code.

For each model of `tests/any_models.py` (keras-hub BERT, GPT-2 and ViT
backbones built from their constructors with random init, a subclassed
transformer that loops over its blocks, a Functional model of subclassed
layers that each hold a Sequential, a classifier calling a nested Functional
backbone), at benchmark sizes:

* memory: the allocator peak one compiled training step added (`measure_step`)
  without recompute, with the default plan (`recompute(model, sample=...)`,
  optimal: the least peak at the least recompute) and with `sqrt`, each
  variant in a fresh process, with the predicted peak beside it;
* time: the step time of the default plan against no recompute, measured in
  one process in alternating rounds on two copies of the model with the same
  weights (an in-place checkpoint changes the model it is applied to), as
  CPU-time and wall-clock ratios.

Writes `any_model.json` and `any_model.md` to benchmarks/results/.

    python benchmarks/any_model.py            # about 6 minutes
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
}
SMOKE = {
    "bert": {"layers": 2, "hidden": 64, "sequence": 64, "batch": 8},
    "loop_transformer": {"layers": 2, "hidden": 64, "sequence": 64, "batch": 8},
}
MiB = 2**20


def _build(name: str, sizes: dict[str, int]) -> Any:
    import keras

    from tests import any_models

    keras.utils.set_random_seed(0)
    model, (x, y) = any_models.MODELS[name](**sizes)
    model(x)
    model.compile(optimizer="sgd", loss="mse")
    return model, x, y


def _checkpointed(model: Any, variant: str, x: Any, y: Any) -> tuple[Any, Any]:
    """The model of a variant and its plan (None without recompute)."""
    import tfrecompute

    if variant == "none":
        return model, None
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
    _report.write(out, NAME, report, _markdown(report))
    return report


if __name__ == "__main__":
    main()
