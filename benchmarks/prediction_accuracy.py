"""How well the planner's predicted peak matches measured step memory.

For each model, plans `none`, `sqrt` and `optimal` (at a budget halfway
between the least feasible peak and storing everything), rewrites the model,
and measures one compiled training step with `tfrecompute.measure_step`.
Each model is measured in a fresh process, so that no earlier allocation
shapes the allocator's state. Writes `prediction_accuracy.json` and `.md` to
`benchmarks/results/` (or `--out`).

    python benchmarks/prediction_accuracy.py [--models encoder unet] [--batch-size 32]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # for `benchmarks._report` (and this checkout's tfrecompute)

from benchmarks import _report  # noqa: E402

MODELS = ("encoder", "mobilenet_v2", "resnet50", "unet")


def _model(name: str):  # noqa: ANN202 (keras is imported in the worker only)
    from tests import models_zoo

    return {
        "resnet50": lambda: models_zoo.resnet50(64),
        "mobilenet_v2": lambda: models_zoo.mobilenet_v2(64),
        "encoder": lambda: models_zoo.transformer_encoder(layers=4, sequence=64, hidden=128),
        "unet": lambda: models_zoo.unet(size=64, base=16),
    }[name]()


def measure(name: str, batch_size: int) -> dict[str, object]:
    """Predicted and measured peaks of one model's plans (run in a worker process)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.path.insert(0, str(ROOT))  # this checkout's tfrecompute and tests, not an installed one
    import keras

    import tfrecompute
    from tests.models_zoo import synthetic_batch
    from tfrecompute import strategies

    keras.utils.set_random_seed(0)
    model = _model(name)
    x, y = synthetic_batch(model, batch_size)
    chain = tfrecompute.profile(model, batch_size=batch_size)
    budget = (strategies.min_peak(chain) + strategies.simulate(chain, []).peak_bytes) // 2
    rows = []
    for strategy in ("none", "sqrt", "optimal"):
        plan = tfrecompute.plan(
            model, strategy, budget=budget if strategy == "optimal" else None, batch_size=batch_size
        )
        rewritten = tfrecompute.recompute(model, plan) if plan.segments else model
        rewritten.compile(optimizer="sgd", loss="mse")
        step = tfrecompute.measure_step(rewritten, x, y)
        rows.append(
            {
                "strategy": strategy,
                "segments": len(plan.segments),
                "predicted_bytes": plan.peak_bytes,
                "measured_bytes": step.peak_bytes,
                "error": plan.peak_bytes / step.peak_bytes - 1,
                "budget_bytes": budget if strategy == "optimal" else None,
            }
        )
    return {"model": name, "batch_size": batch_size, "links": chain.n, "rows": rows}


def run_in_subprocess(name: str, batch_size: int) -> dict[str, object]:
    """Runs `measure` for one model in a fresh Python process."""
    command = [sys.executable, __file__, "--worker", name, "--batch-size", str(batch_size)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    if result.returncode != 0:
        raise RuntimeError(f"measuring {name} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def _markdown(results: list[dict[str, object]]) -> str:
    lines = [
        "# Predicted against measured step memory",
        "",
        f"Machine: {platform.platform()}, {os.cpu_count()} CPUs; each model measured in a "
        "fresh process with `measure_step` (SGD). Error = predicted / measured - 1.",
        "",
        "| model | links | strategy | segments | predicted MiB | measured MiB | error |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for result in results:
        for row in result["rows"]:  # type: ignore[union-attr]
            lines.append(
                f"| {result['model']} | {result['links']} | {row['strategy']} | "
                f"{row['segments']} | {row['predicted_bytes'] / 2**20:.1f} | "
                f"{row['measured_bytes'] / 2**20:.1f} | {row['error']:+.1%} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict[str, object]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--out", type=pathlib.Path, default=_report.RESULTS)
    parser.add_argument("--worker", choices=MODELS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(measure(args.worker, args.batch_size)))
        return []
    results = [run_in_subprocess(name, args.batch_size) for name in args.models]
    args.out.mkdir(parents=True, exist_ok=True)
    _report.write(args.out, "prediction_accuracy", results, _markdown(results))
    return results


if __name__ == "__main__":
    main()
