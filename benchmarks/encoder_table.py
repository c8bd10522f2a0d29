"""The checkpointing table for a BERT-style encoder: largest batch, step memory, throughput.

Usage:
    python benchmarks/encoder_table.py          # benchmarks/results/encoder_table.{json,md}
    python benchmarks/encoder_table.py --smoke  # tiny encoder, to a temporary directory
    python benchmarks/encoder_table.py --out DIR [--cap-mib 512] [--fixed-batch 32]

The model is `tests/models_zoo.transformer_encoder`: 12 post-norm layers,
hidden 256, sequence 128, 4 heads, MLP 4 x hidden with GELU, dropout 0.1
(vocabulary 1000; the embedding is not what checkpointing is about). Four
variants of the same model, trained with SGD on a mean squared error loss:

* `none`: the model itself, every activation stored;
* `uniform`: `"uniform:<k>"` with k the links of one encoder layer (attention,
  norm, two MLP Denses, norm), so one `RecomputeBlock` per encoder layer;
* `optimal`: `"optimal"` under a budget (below);
* `optimal_bf16`: the same under `mixed_bfloat16`, the model built after
  setting the policy.

Columns:

* Largest batch under a memory cap: an exponential then binary search over
  batch sizes in multiples of `granularity`. A candidate batch B is profiled,
  planned at B (the optimal rows with budget = the cap; a cap below the least
  feasible peak means B does not fit, without running it), rewritten with
  `tfrecompute.recompute`, compiled and measured with `tfrecompute.measure_step`.
  B fits iff the measured peak is at most the cap. The binary search assumes
  that fitting is monotone in B; every probe (batch, measured and predicted
  peak) is in the JSON. The result is always a probe that fit.
* Step memory at a fixed batch: measured peak and the planner's predicted
  peak. Here the optimal rows use budget = the cap, or, where the cap is below
  the least feasible peak at that batch, halfway between that least peak and
  the peak of storing everything.
* Samples per second at the fixed batch, relative to `none`: all four models
  live in one process and are timed in interleaved rounds (median step time
  over the rounds), each step in wall time (`time.perf_counter()`) and in CPU
  time (`time.process_time()`, all threads of the process, steadier on a
  shared machine); a ratio says more than an absolute time on a shared machine.
  The steps are measured as `tfrecompute.measure_step` does
  (`_report.measure_steps`), which also gives the step memory.

Each row's search runs in its own fresh process (clearing the Keras session
between probes), the fixed-batch column in one more, so that no earlier
model shapes another row's allocator state. `--smoke` runs everything in one
worker process, with at most three probes per row.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # for `benchmarks._report` (and this checkout's tfrecompute)

from benchmarks import _report  # noqa: E402

MIB = 1 << 20

ROWS: dict[str, dict[str, Any]] = {
    "none": {"label": "no recompute", "strategy": "none", "policy": "float32"},
    "uniform": {
        "label": "uniform, a block per encoder layer",
        "strategy": "uniform",
        "policy": "float32",
    },
    "optimal": {"label": "optimal", "strategy": "optimal", "policy": "float32"},
    "optimal_bf16": {
        "label": "optimal, mixed_bfloat16",
        "strategy": "optimal",
        "policy": "mixed_bfloat16",
    },
}

FULL: dict[str, Any] = {
    "model": {
        "layers": 12,
        "hidden": 256,
        "sequence": 128,
        "heads": 4,
        "vocab": 1000,
        "dropout": 0.1,
    },
    "cap_bytes": 512 * MIB,
    "granularity": 4,
    "max_batch": 512,
    "max_probes": 12,
    "search_steps": 2,
    "fixed_batch": 32,
    "timing_rounds": 3,
    "timing_steps": 2,
    "process_per_row": True,
}

SMOKE: dict[str, Any] = {
    "model": {"layers": 2, "hidden": 64, "sequence": 32, "heads": 4, "vocab": 100, "dropout": 0.1},
    "cap_bytes": 24 * MIB,
    "granularity": 32,
    "max_batch": 256,
    "max_probes": 3,
    "search_steps": 1,
    "fixed_batch": 64,
    "timing_rounds": 1,
    "timing_steps": 1,
    "process_per_row": False,
}


# ------------------------------------------------------------------ the search


def search_max_batch(
    measure: Callable[[int], dict[str, Any]],
    cap_bytes: int,
    *,
    granularity: int,
    max_batch: int,
    max_probes: int | None = None,
) -> dict[str, Any]:
    """The largest batch, a multiple of `granularity`, whose measured peak fits `cap_bytes`.

    Doubles the batch from `granularity` until one does not fit (or
    `max_batch` fits), then halves the interval between the largest batch
    that fit and the smallest that did not, down to `granularity`. Assumes
    that fitting is monotone in the batch size.

    Args:
        measure: `measure(batch)` returns a dict with `"measured_bytes"`, the
            measured peak (None when the batch cannot run, e.g. no plan fits
            the budget), and anything else to record.
        cap_bytes: the memory cap.
        granularity: batches probed are multiples of it.
        max_batch: the largest batch probed, a multiple of `granularity`.
        max_probes: stop after this many probes (None: no limit).

    Returns:
        A dict: `max_batch` (the largest batch that fit, None when even
        `granularity` did not), `probes` (each probe's dict from `measure`
        plus `batch` and `fits`, in order), `capped` (`max_batch` itself fit,
        the true largest may be higher) and `stopped` (`max_probes` ended the
        search before it converged).
    """
    if granularity < 1 or max_batch < granularity or max_batch % granularity:
        raise ValueError(
            "search_max_batch: max_batch must be a positive multiple of granularity. "
            f"Received: granularity={granularity!r}, max_batch={max_batch!r}."
        )
    probes: list[dict[str, Any]] = []

    def fits(batch: int) -> bool:
        record = dict(measure(batch))
        measured = record.get("measured_bytes")
        record["batch"] = batch
        record["fits"] = measured is not None and measured <= cap_bytes
        probes.append(record)
        return bool(record["fits"])

    def out_of_probes() -> bool:
        return max_probes is not None and len(probes) >= max_probes

    best: int | None = None  # the largest batch that fit
    above: int | None = None  # the smallest batch that did not fit
    capped = stopped = False
    batch = granularity
    while True:
        if out_of_probes():
            stopped = True
            break
        if not fits(batch):
            above = batch
            break
        best = batch
        if batch >= max_batch:
            capped = True
            break
        batch = min(2 * batch, max_batch)
    if best is not None and above is not None:
        while above - best > granularity:
            if out_of_probes():
                stopped = True
                break
            middle = best + (above - best) // (2 * granularity) * granularity
            if fits(middle):
                best = middle
            else:
                above = middle
    return {"max_batch": best, "probes": probes, "capped": capped, "stopped": stopped}


# ------------------------------------------------------------- worker processes


def _worker_setup() -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))  # this checkout's tfrecompute and tests


def _log(message: str) -> None:
    print(f"[encoder_table] {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _policy(name: str) -> Iterator[None]:
    """Sets the global dtype policy for building, rewriting and compiling; float32 after."""
    import keras

    keras.mixed_precision.set_global_policy(name)
    try:
        yield
    finally:
        keras.mixed_precision.set_global_policy("float32")


def _build(config: dict[str, Any]):  # noqa: ANN202 (keras is imported in the worker only)
    """A fresh encoder under the current global dtype policy."""
    import keras

    from tests import models_zoo

    keras.utils.set_random_seed(0)
    return models_zoo.transformer_encoder(**config["model"])


def _strategy_name(row: str, chain: Any, config: dict[str, Any]) -> str:
    strategy = ROWS[row]["strategy"]
    if strategy == "uniform":
        # Links: the embedding, then the same number per encoder layer, then the head.
        per_layer = max(1, (chain.n - 2) // config["model"]["layers"])
        return f"uniform:{per_layer}"
    return strategy


def _plan_row(row: str, chain: Any, config: dict[str, Any], budget: int | None):  # noqa: ANN202
    """The row's plan for `chain`; raises InfeasibleBudgetError when the budget is too low."""
    from tfrecompute import strategies

    name = _strategy_name(row, chain, config)
    return strategies.get(name)(chain, budget=budget if name == "optimal" else None)


def search_row(row: str, config: dict[str, Any]) -> dict[str, Any]:
    """Runs the batch search of one row (in a worker process)."""
    _worker_setup()
    import gc

    import keras

    import tfrecompute
    from tests.models_zoo import synthetic_batch
    from tfrecompute import strategies

    cap = config["cap_bytes"]

    def measure(batch: int) -> dict[str, Any]:
        keras.backend.clear_session()
        gc.collect()
        with _policy(ROWS[row]["policy"]):
            model = _build(config)
            chain = tfrecompute.profile(model, batch_size=batch)
            record: dict[str, Any] = {
                "links": chain.n,
                "min_peak_bytes": strategies.min_peak(chain),
                "none_peak_bytes": strategies.simulate(chain, []).peak_bytes,
            }
            try:
                plan = _plan_row(row, chain, config, cap)
            except tfrecompute.InfeasibleBudgetError:
                record.update(
                    strategy=_strategy_name(row, chain, config),
                    infeasible=True,
                    measured_bytes=None,
                    predicted_bytes=None,
                )
                _log(
                    f"{row} batch {batch}: no plan fits the cap (least peak "
                    f"{record['min_peak_bytes'] / MIB:.1f} MiB)"
                )
                return record
            tfrecompute.recompute(model, plan)
            model.compile(optimizer="sgd", loss="mse")
            x, y = synthetic_batch(model, batch)
            step = tfrecompute.measure_step(model, x, y, steps=config["search_steps"])
        record.update(
            strategy=plan.strategy,
            infeasible=False,
            segments=len(plan.segments),
            recompute_share=plan.recompute_cost / (chain.total_forward_cost or 1.0),
            measured_bytes=step.peak_bytes,
            predicted_bytes=plan.peak_bytes,
            seconds=step.seconds,
        )
        _log(
            f"{row} batch {batch}: measured {step.peak_bytes / MIB:.1f} MiB, predicted "
            f"{plan.peak_bytes / MIB:.1f} MiB, {len(plan.segments)} segments, {step.seconds:.2f} s"
        )
        return record

    start = time.perf_counter()
    result = search_max_batch(
        measure,
        cap,
        granularity=config["granularity"],
        max_batch=config["max_batch"],
        max_probes=config["max_probes"],
    )
    result["seconds"] = time.perf_counter() - start
    keras.backend.clear_session()
    gc.collect()
    return result


def fixed_batch(config: dict[str, Any]) -> dict[str, Any]:
    """Memory and time of all rows at the fixed batch, in one process (a worker)."""
    _worker_setup()
    import keras
    import tensorflow as tf

    import tfrecompute
    from tests.models_zoo import synthetic_batch
    from tfrecompute import strategies

    start = time.perf_counter()
    batch, cap = config["fixed_batch"], config["cap_bytes"]
    models: dict[str, Any] = {}  # a model per row, built alike, so that the rows take turns
    results: dict[str, dict[str, Any]] = {}
    for row, spec in ROWS.items():
        with _policy(spec["policy"]):
            model = _build(config)
            chain = tfrecompute.profile(model, batch_size=batch)
            low, high = strategies.min_peak(chain), strategies.simulate(chain, []).peak_bytes
            budget = cap if cap >= low else (low + high) // 2
            plan = _plan_row(row, chain, config, budget)
            tfrecompute.recompute(model, plan)
            model.compile(optimizer="sgd", loss="mse")
        models[row] = model
        results[row] = {
            "batch": batch,
            "links": chain.n,
            "strategy": plan.strategy,
            "budget_bytes": budget if plan.strategy == "optimal" else None,
            "min_peak_bytes": low,
            "none_peak_bytes": high,
            "segments": len(plan.segments),
            "recompute_share": plan.recompute_cost / (chain.total_forward_cost or 1.0),
            "predicted_bytes": plan.peak_bytes,
            "measured_bytes_per_round": [],
            "seconds_per_round": [],
            "cpu_seconds_per_round": [],
        }
    x, y = synthetic_batch(next(iter(models.values())), batch)

    def turn(row: str) -> Callable[[_report.StepTimes], int]:
        def measure(times: _report.StepTimes) -> int:
            peak = _report.measure_steps(models[row], x, y, times, steps=config["timing_steps"])
            _log(
                f"batch {batch}, round {len(times.wall) - 1}, {row}: {peak / MIB:.1f} MiB, "
                f"{statistics.median(times.wall[-1]):.3f} s wall, "
                f"{statistics.median(times.cpu[-1]):.3f} s CPU"
            )
            return peak

        return measure

    # Alternate the order, so that no row always runs right after the same one.
    times = {row: _report.StepTimes() for row in ROWS}
    peaks = _report.interleaved_rounds(
        [turn(row) for row in ROWS],
        list(times.values()),
        rounds=config["timing_rounds"],
        alternate=True,
    )
    for row, row_peaks in zip(ROWS, peaks):
        results[row]["measured_bytes_per_round"] = row_peaks
        results[row]["seconds_per_round"] = times[row].wall_per_round()
        results[row]["cpu_seconds_per_round"] = times[row].cpu_per_round()
    none = results["none"]
    none_seconds = statistics.median(none["seconds_per_round"])
    none_cpu_seconds = statistics.median(none["cpu_seconds_per_round"])
    for result in results.values():
        seconds = statistics.median(result["seconds_per_round"])
        cpu_seconds = statistics.median(result["cpu_seconds_per_round"])
        result["measured_bytes"] = max(result["measured_bytes_per_round"])
        result["seconds"] = seconds
        result["cpu_seconds"] = cpu_seconds
        result["samples_per_second"] = batch / seconds
        result["throughput_ratio"] = none_seconds / seconds
        result["cpu_throughput_ratio"] = none_cpu_seconds / cpu_seconds
        result["error"] = result["predicted_bytes"] / result["measured_bytes"] - 1
    return {
        "rows": results,
        "versions": {"tensorflow": tf.__version__, "keras": keras.__version__},
        "seconds": time.perf_counter() - start,
    }


def run_all(config: dict[str, Any]) -> dict[str, Any]:
    """Every row's search and then the fixed-batch column, in this one process."""
    searches = {row: search_row(row, config) for row in ROWS}
    return {"searches": searches, "fixed": fixed_batch(config)}


def run_worker(task: list[str], config: dict[str, Any]) -> dict[str, Any]:
    """Runs one worker task in a fresh Python process; its progress goes to stderr."""
    args = ["--worker", *task, "--config", json.dumps(config)]
    return _report.run_worker(Path(__file__).resolve(), args, timeout=3600, echo_stderr=True)


# ----------------------------------------------------------------------- report


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / MIB:.1f}"


def markdown(report: dict[str, Any]) -> str:
    info, settings = report["machine"], report["settings"]
    model = settings["model"]
    versions = report["versions"]
    batch = settings["fixed_batch"]
    cap = settings["cap_bytes"]
    lines = [
        "# Checkpointing a BERT-style encoder",
        "",
        f"Encoder: {model['layers']} layers, hidden {model['hidden']}, sequence "
        f"{model['sequence']}, {model['heads']} heads, MLP {4 * model['hidden']}, dropout "
        f"{model['dropout']}; SGD, mean squared error. Machine: {info['platform']}, "
        f"{info['processor']}, {info['cpu_count']} CPUs; Python {info['python']}, "
        f"tensorflow {versions['tensorflow']}, keras {versions['keras']}."
        + (" Smoke configuration." if settings["smoke"] else ""),
        "",
        f"Max batch: the largest multiple of {settings['granularity']} (up to "
        f"{settings['max_batch']}) whose measured step peak fits the {_mib(cap)} MiB cap, "
        "found by an exponential then binary search; the optimal rows plan at each batch "
        "with budget = the cap. Memory and throughput at batch "
        f"{batch}: measured as `measure_step` does (the peak the step adds to the allocator), "
        "predicted by the planner; the optimal rows there plan with budget = the cap "
        "(halfway between the least feasible peak and storing everything when the cap is "
        f"infeasible). Throughput: median of {settings['timing_rounds']} interleaved rounds "
        "in one process, relative to no recompute, in CPU time (`time.process_time()`, all "
        "threads) and in wall time; samples/s in wall time. Recompute: the recomputed share of "
        "one forward pass.",
        "",
        f"| variant | max batch under {_mib(cap)} MiB | probes | segments @{batch} | "
        f"recompute @{batch} | measured MiB @{batch} | predicted MiB @{batch} | error | "
        f"samples/s @{batch} | x none |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in report["rows"]:
        search, fixed = row["search"], row["fixed"]
        best = search["max_batch"]
        best_text = "none fits" if best is None else str(best)
        if search["capped"]:
            best_text += " (the largest probed)"
        if search["stopped"]:
            best_text += " (probe limit)"
        lines.append(
            f"| {row['label']} (`{fixed['strategy']}`) | {best_text} | "
            f"{len(search['probes'])} | {fixed['segments']} | "
            f"{100 * fixed['recompute_share']:.0f}% | {_mib(fixed['measured_bytes'])} | "
            f"{_mib(fixed['predicted_bytes'])} | {fixed['error']:+.1%} | "
            f"{fixed['samples_per_second']:.1f} | "
            f"{_report.ratios(fixed['cpu_throughput_ratio'], fixed['throughput_ratio'])} |"
        )
    lines += [
        "",
        "Search probes, in order: batch measured / predicted MiB (fits: yes or no; "
        "infeasible: no plan fits the cap, not run).",
        "",
        "| variant | probes |",
        "|---|---|",
    ]
    for row in report["rows"]:
        probes = []
        for probe in row["search"]["probes"]:
            if probe.get("infeasible"):
                probes.append(f"{probe['batch']}: infeasible")
            else:
                probes.append(
                    f"{probe['batch']}: {_mib(probe['measured_bytes'])} / "
                    f"{_mib(probe['predicted_bytes'])} {'yes' if probe['fits'] else 'no'}"
                )
        lines.append(f"| {row['label']} | {'; '.join(probes)} |")
    lines += [
        "",
        f"Run time: {report['runtime_seconds']:.0f} s in all.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs the benchmark; returns the report written to `<out>/encoder_table.json`."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny encoder, few probes")
    parser.add_argument("--out", type=Path, default=None, help="output directory")
    parser.add_argument("--cap-mib", type=int, default=None, help="the memory cap in MiB")
    parser.add_argument("--fixed-batch", type=int, default=None, help="batch of columns 2 and 3")
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        config = json.loads(args.config)
        if args.worker[0] == "search":
            result = search_row(args.worker[1], config)
        elif args.worker[0] == "fixed":
            result = fixed_batch(config)
        else:
            result = run_all(config)
        print(json.dumps(result))
        return result

    config = dict(SMOKE if args.smoke else FULL)
    if args.cap_mib is not None:
        config["cap_bytes"] = args.cap_mib * MIB
    if args.fixed_batch is not None:
        config["fixed_batch"] = args.fixed_batch
    out = _report.output_dir(args.out, smoke=args.smoke, name="encoder_table")

    start = time.perf_counter()
    if config["process_per_row"]:
        searches = {row: run_worker(["search", row], config) for row in ROWS}
        fixed = run_worker(["fixed"], config)
    else:
        both = run_worker(["all"], config)
        searches, fixed = both["searches"], both["fixed"]
    report = {
        "machine": _report.machine(),
        "versions": fixed["versions"],
        "settings": {**config, "smoke": args.smoke},
        "rows": [
            {"name": row, **ROWS[row], "search": searches[row], "fixed": fixed["rows"][row]}
            for row in ROWS
        ],
        "runtime_seconds": time.perf_counter() - start,
    }
    _report.write(out, "encoder_table", report, markdown(report))
    return report


if __name__ == "__main__":
    main()
