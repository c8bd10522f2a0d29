"""How well the planner's predicted peak matches measured step memory.

For each model, plans `none`, `sqrt` and `optimal` (planned halfway between
the least feasible peak and storing everything: the budget is that over
`1 - strategies.DEFAULT_HEADROOM`, the share the planner plans in; the
measured peak over the budget shows whether the headroom held), rewrites the model,
and measures compiled training steps with `tfrecompute.measure_step` (the
allocator's peak) and `tfrecompute.trace_step` (the requested peak: the most
bytes the step's tensors asked for at any moment, without the allocator's
rounding of chunks; see NOTE [ Requested and allocated bytes ] in
tfrecompute/check/measure.py). Each model
is measured in a fresh process, so that no earlier allocation shapes the
allocator's state, and `--runs` times (each in its own process), since the
same plan's measured peak varies from run to run. Writes
`prediction_accuracy.json` (every run) and `.md` (each plan's errors over the
runs) to `benchmarks/results/` (or `--out`).

    python benchmarks/prediction_accuracy.py [--models encoder unet] [--batch-size 32] [--runs 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import platform
import sys
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # for `benchmarks._report` (and this checkout's tfrecompute)

from benchmarks import _report  # noqa: E402

MODELS = ("convnext_tiny", "efficientnet_b0", "encoder", "mobilenet_v2", "resnet50", "unet")
# ConvNeXtTiny at the batch of the issue that found its grouped convs' XLA buffer.
BATCH_SIZES = {"convnext_tiny": 16}
TRACES = 3  # traced steps per plan; the requested peak is the largest of them


def _model(name: str):  # noqa: ANN202 (keras is imported in the worker only)
    import keras

    from tests import models_zoo

    return {
        "convnext_tiny": lambda: keras.applications.ConvNeXtTiny(
            weights=None, input_shape=(64, 64, 3), classes=10
        ),
        "efficientnet_b0": lambda: keras.applications.EfficientNetB0(
            weights=None, input_shape=(64, 64, 3), classes=10
        ),
        "resnet50": lambda: models_zoo.resnet50(64),
        "mobilenet_v2": lambda: models_zoo.mobilenet_v2(64),
        "encoder": lambda: models_zoo.transformer_encoder(layers=4, sequence=64, hidden=128),
        "unet": lambda: models_zoo.unet(size=64, base=16),
    }[name]()


def measure(name: str, batch_size: int, traces: int = TRACES) -> dict[str, object]:
    """Predicted and measured peaks of one model's plans (run in a worker process)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.path.insert(0, str(ROOT))  # this checkout's tfrecompute and tests, not an installed one
    import keras

    import tfrecompute
    from tests.models_zoo import synthetic_batch
    from tfrecompute import strategies

    keras.utils.set_random_seed(0)
    model = _model(name)
    batch_size = BATCH_SIZES.get(name, batch_size)
    x, y = synthetic_batch(model, batch_size)
    chain = tfrecompute.profile(model, batch_size=batch_size)
    static = tfrecompute.profile(model, batch_size=batch_size, measure=False)
    halfway = (strategies.min_peak(chain) + strategies.simulate(chain, []).peak_bytes) // 2
    budget = int(halfway / (1 - strategies.DEFAULT_HEADROOM))
    rows = []
    for strategy in ("none", "sqrt", "optimal"):
        plan = tfrecompute.plan(
            model, strategy, budget=budget if strategy == "optimal" else None, batch_size=batch_size
        )
        tfrecompute.recompute(model, plan)
        model.compile(optimizer="sgd", loss="mse")
        rows.append(_row(strategy, plan, model, (x, y), static, traces))
        rows[-1]["budget_bytes"] = budget if strategy == "optimal" else None
        rows[-1]["headroom"] = strategies.DEFAULT_HEADROOM if strategy == "optimal" else None
    model.compile(optimizer="sgd", loss="mse")
    start = time.perf_counter()
    verified = tfrecompute.verified_plan(model, (x, y), budget=budget)
    seconds = time.perf_counter() - start
    rows.append(_row("verified", verified.plan, verified.model, (x, y), static, traces))
    rows[-1].update(
        budget_bytes=budget,
        headroom=None,
        verified_bytes=verified.peak_bytes,
        probes=[dataclasses.asdict(p) for p in verified.probes],
        verify_seconds=seconds,
    )
    return {"model": name, "batch_size": batch_size, "links": chain.n, "rows": rows}


def _row(strategy: str, plan, model, batch, static, traces: int) -> dict[str, Any]:  # noqa: ANN001
    """One plan's predicted peak (with and without measured costs) against its steps."""
    import tfrecompute
    from tfrecompute import strategies

    x, y = batch
    step = tfrecompute.measure_step(model, x, y)
    traced = [tfrecompute.trace_step(model, x, y, warmup=1) for _ in range(traces)]
    requested = max(max(t.requested_peak_bytes for t in traced), 1)
    static_bytes = strategies.simulate(static, plan.segments).peak_bytes
    return {
        "strategy": strategy,
        "segments": len(plan.segments),
        "predicted_bytes": plan.peak_bytes,
        "measured_bytes": step.peak_bytes,
        "error": plan.peak_bytes / step.peak_bytes - 1,
        "requested_bytes": requested,
        "requested_error": plan.peak_bytes / requested - 1,
        "allocator_overhead": [t.peak_bytes / max(t.requested_peak_bytes, 1) - 1 for t in traced],
        "trace_summary": max(traced, key=lambda t: t.peak_bytes).summary(top=5),
        "static_predicted_bytes": static_bytes,
        "static_error": static_bytes / step.peak_bytes - 1,
    }


def run_in_subprocess(name: str, batch_size: int, traces: int = TRACES) -> dict[str, object]:
    """Runs `measure` for one model in a fresh Python process."""
    args = ["--worker", name, "--batch-size", str(batch_size), "--traces", str(traces)]
    return _report.run_worker(pathlib.Path(__file__).resolve(), args, timeout=600)


def merge_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One model's result from several runs of `measure`: per plan, every run's peak and error.

    Each row keeps the first run's fields and adds, over the runs in order,
    `measured_bytes_runs`, `errors`, `error_min` and `error_max` (against the
    allocator's peak), `requested_bytes_runs`, `requested_errors`,
    `requested_error_min` and `requested_error_max` (against the requested
    peak), and `overhead_min` and `overhead_max` (over every traced step, its
    allocator peak over its requested peak, minus one).

    Raises:
        ValueError: no runs, or runs of different models or plans.
    """
    if not runs:
        raise ValueError("merge_runs: no runs. Received: runs=[]. Pass one or more results.")
    first = runs[0]
    plans = [row["strategy"] for row in first["rows"]]
    for run in runs[1:]:
        if run["model"] != first["model"] or [r["strategy"] for r in run["rows"]] != plans:
            raise ValueError(
                f"merge_runs: the runs differ in model or plans. Received: "
                f"{first['model']!r} {plans} and {run['model']!r} "
                f"{[r['strategy'] for r in run['rows']]}. Merge runs of one model only."
            )
    rows = []
    for i, row in enumerate(first["rows"]):
        errors = [run["rows"][i]["error"] for run in runs]
        requested_errors = [run["rows"][i]["requested_error"] for run in runs]
        overheads = [o for run in runs for o in run["rows"][i]["allocator_overhead"]]
        rows.append(
            {
                **row,
                "measured_bytes_runs": [run["rows"][i]["measured_bytes"] for run in runs],
                "errors": errors,
                "error_min": min(errors),
                "error_max": max(errors),
                "requested_bytes_runs": [run["rows"][i]["requested_bytes"] for run in runs],
                "requested_errors": requested_errors,
                "requested_error_min": min(requested_errors),
                "requested_error_max": max(requested_errors),
                "overhead_min": min(overheads),
                "overhead_max": max(overheads),
            }
        )
    return {**first, "runs": len(runs), "rows": rows}


def _markdown(results: list[dict[str, Any]]) -> str:
    runs = max(result["runs"] for result in results)
    traces = len(results[0]["rows"][0]["allocator_overhead"]) // results[0]["runs"]
    lines = [
        "# Predicted against measured step memory",
        "",
        f"Machine: {platform.platform()}, {os.cpu_count()} CPUs; each model measured "
        f"{runs} times, each time in a fresh process (SGD). Error = predicted / measured - 1.",
        "",
        "- *measured*: the allocator's peak over 3 steps (`measure_step`): what a step needs.",
        f"- *requested*: the largest requested peak of {traces} traced steps (`trace_step`): "
        "the most bytes the step's tensors asked for at any moment, without the "
        "allocator's rounding of chunks, which is what the memory model predicts.",
        "- *rounding*: each traced step's allocator peak over its requested peak, minus one "
        "(TensorFlow's BFC allocator hands out a free chunk of up to twice a request whole).",
        "",
        "| model | links | strategy | segments | predicted MiB | measured MiB, each run | "
        "error, each run | error range | requested MiB, each run | error vs requested | "
        "rounding |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for result in results:
        for row in result["rows"]:
            measured = ", ".join(f"{m / 2**20:.1f}" for m in row["measured_bytes_runs"])
            errors = ", ".join(f"{e:+.1%}" for e in row["errors"])
            requested = ", ".join(f"{m / 2**20:.1f}" for m in row["requested_bytes_runs"])
            lines.append(
                f"| {result['model']} | {result['links']} | {row['strategy']} | "
                f"{row['segments']} | {row['predicted_bytes'] / 2**20:.1f} | {measured} | "
                f"{errors} | {row['error_min']:+.0%} .. {row['error_max']:+.0%} | "
                f"{requested} | {row['requested_error_min']:+.0%} .. "
                f"{row['requested_error_max']:+.0%} | "
                f"{row['overhead_min']:+.0%} .. {row['overhead_max']:+.0%} |"
            )
    lines += [
        "",
        "## The optimal plans against their budget",
        "",
        "Each is planned in `1 - headroom` of its budget (the default headroom leaves the "
        "rest to the allocator's rounding); the measured peak over the budget, each run:",
        "",
        "| model | budget MiB | headroom | predicted / budget | measured / budget, each run |",
        "|---|---:|---:|---:|---:|",
    ]
    for result in results:
        for row in result["rows"]:
            if row["strategy"] == "optimal":
                budget = row["budget_bytes"]
                shares = ", ".join(f"{m / budget:.0%}" for m in row["measured_bytes_runs"])
                lines.append(
                    f"| {result['model']} | {budget / 2**20:.1f} | {row['headroom']:.0%} | "
                    f"{row['predicted_bytes'] / budget:.0%} | {shares} |"
                )
    lines += _measured_costs_section(results)
    lines += [
        "",
        "## The highest traced peak of each sqrt plan (first run)",
        "",
        "`trace_step(...).summary(top=5)`: the peak, the requested peak, and the five "
        "largest buffers live at the peak (allocated, then requested bytes).",
    ]
    for result in results:
        for row in result["rows"]:
            if row["strategy"] == "sqrt" and row.get("trace_summary"):
                lines += ["", f"{result['model']}:", "", "```", row["trace_summary"], "```"]
    return "\n".join(lines) + "\n"


def _measured_costs_section(results: list[dict[str, Any]]) -> list[str]:
    """Errors before and after measured costs, and the verified plans against their budget."""
    lines = [
        "",
        "## Before and after measured costs",
        "",
        "*static*: the same plan's peak on the chain read from the gradient graphs alone "
        "(`profile(measure=False)`); *measured costs*: the default, which runs the calls "
        "the graph does not show (XLA functions, custom gradients). Errors against the "
        "allocator's peak, each run.",
        "",
        "| model | strategy | static MiB | error, static | measured costs MiB | error |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for result in results:
        for row in result["rows"]:
            if "static_predicted_bytes" not in row:
                continue
            static = [row["static_predicted_bytes"] / m - 1 for m in row["measured_bytes_runs"]]
            lines.append(
                f"| {result['model']} | {row['strategy']} | "
                f"{row['static_predicted_bytes'] / 2**20:.1f} | "
                f"{', '.join(f'{e:+.0%}' for e in static)} | "
                f"{row['predicted_bytes'] / 2**20:.1f} | "
                f"{', '.join(f'{e:+.0%}' for e in row['errors'])} |"
            )
    lines += [
        "",
        "## Verified plans against their budget",
        "",
        "`verified_plan(model, (x, y), budget=...)` with the optimal rows' budget: the "
        "measured peak of the plan it keeps (in its own measurement, and measured again "
        "with the other rows), each run, and the plans it measured on the way "
        "(predicted -> measured MiB).",
        "",
        "| model | budget MiB | verified / budget | measured again / budget | probes |",
        "|---|---:|---:|---:|---|",
    ]
    for result in results:
        for row in result["rows"]:
            if row["strategy"] != "verified":
                continue
            budget = row["budget_bytes"]
            again = ", ".join(f"{m / budget:.0%}" for m in row["measured_bytes_runs"])
            probes = "; ".join(
                f"{p['predicted_bytes'] / 2**20:.0f} -> {p['measured_bytes'] / 2**20:.0f}"
                for p in row["probes"]
            )
            lines.append(
                f"| {result['model']} | {budget / 2**20:.1f} | "
                f"{row['verified_bytes'] / budget:.0%} | {again} | {probes} |"
            )
    return lines


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3, help="fresh processes per model")
    parser.add_argument("--out", type=pathlib.Path, default=_report.RESULTS)
    parser.add_argument("--traces", type=int, default=TRACES, help="traced steps per plan")
    parser.add_argument("--worker", choices=MODELS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(measure(args.worker, args.batch_size, args.traces)))
        return []
    if args.runs < 1:
        parser.error(f"--runs must be at least 1. Received: --runs={args.runs}.")
    results = [
        merge_runs(
            [run_in_subprocess(name, args.batch_size, args.traces) for _ in range(args.runs)]
        )
        for name in args.models
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    _report.write(args.out, "prediction_accuracy", results, _markdown(results))
    return results


if __name__ == "__main__":
    main()
