"""How training-step memory grows with depth: no recompute, sqrt and optimal plans.

Usage:
    python benchmarks/depth_scaling.py          # benchmarks/results/depth_scaling.{json,md,png}
    python benchmarks/depth_scaling.py --smoke  # L = 4, 8, width 128, to a temporary dir
    python benchmarks/depth_scaling.py --out DIR --depths 8 16 32 --width 256 --batch-size 1024

The model is a `keras.Sequential` of L `Dense(width, activation="tanh")`
layers on a `width`-wide input (full run: L = 8, 16, 32, 64, 128, width 256,
batch 1024, so every activation is 1 MiB, well above the 256 KiB under which
TensorFlow's oneDNN CPU allocator statistics record nothing; smoke: width 128, batch
1024, 512 KiB activations). For each L three plans are made with
`tfrecompute.plan` from the profiled chain at that batch size:

* `none`: store everything (the original model, no blocks);
* `sqrt`: about sqrt(L) equal segments (Chen et al. 2016);
* `optimal`: the least recompute cost under the budget
  `min(2 * strategies.min_peak(chain), none's predicted peak)`. Twice the least
  feasible peak is a budget a user might pick for "save most of the memory,
  but not at any price"; as `min_peak` grows like sqrt(L) on such a chain, so
  does this budget. At small L, where twice the least peak exceeds storing
  everything, the cap makes `optimal` store everything too. The budget is one
  of predicted peaks, so it is planned with `headroom=0` (no share left for
  the allocator's rounding, NOTE [ Budget headroom ]).

Each plan's model (`tfrecompute.recompute(build(), plan)`, or the original for a
plan without segments) is compiled with SGD and MSE and measured as
`tfrecompute.measure_step` does (`_report.measure_steps`: one warm-up step,
then `--steps` steps: the largest peak the step added and the median step time,
in wall time, `time.perf_counter()`, and in CPU time, `time.process_time()`,
all threads of the process). Each plan's memory is measured in a fresh
process of its own, so that neither earlier depths nor the other plans leave
the allocator in a state that shapes its peak (a plan measured after the two
others in one process once peaked at 2x its own fresh-process peak). Its time
is measured with all plans of one L side by side in one more fresh process:
`--rounds` measurements take turns between the plans; a plan's time is
reported as the median over the rounds of its step time divided by that of
`none` in the same round (plans of one round ran close in time, so a burst of
load from other processes slows them alike), since an absolute time says little
on a shared machine; the CPU-time ratio is steadier than the wall-time one. The
JSON also keeps every round's times, and the peaks of those shared-process
rounds beside the fresh-process one.

Then the growth exponent k of peak ~ c * L^k is fitted per plan by least squares
on log(peak) against log(L), for the measured and for the predicted peaks, over
all depths and over the deeper half (where the constant terms, the input and
the last layers' gradients, weigh less). Expected: about 1 for `none` and 0.5
for `sqrt` and `optimal`.

Writes `depth_scaling.json` (every number, the machine and the settings) and
`depth_scaling.md`, and `depth_scaling.png` (memory against L, log-log) when
matplotlib is installed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # for `benchmarks._report` (and this checkout's tfrecompute)

from benchmarks import _report  # noqa: E402

VARIANTS = ("none", "sqrt", "optimal")
FULL = {"depths": (8, 16, 32, 64, 128), "width": 256, "batch_size": 1024, "steps": 5, "rounds": 5}
SMOKE = {"depths": (4, 8), "width": 128, "batch_size": 1024, "steps": 3, "rounds": 2}
SEED = 0
MiB = 2**20


def fit_exponent(depths: Sequence[float], values: Sequence[float]) -> float:
    """The exponent k of the least-squares fit of log(value) = log(c) + k * log(depth).

    Args:
        depths: at least two distinct positive depths.
        values: one positive value per depth.

    Returns:
        The fitted exponent k (the slope in log-log coordinates).

    Raises:
        ValueError: fewer than two points, lengths differ, a depth or value is
            not positive, or all depths are equal.

    Example:
        >>> round(fit_exponent([4, 16, 64], [10, 20, 40]), 6)
        0.5
    """
    if len(depths) != len(values):
        raise ValueError(
            f"fit_exponent: depths and values differ in length. Received: "
            f"len(depths)={len(depths)}, len(values)={len(values)}. Pass one value per depth."
        )
    if len(depths) < 2:
        raise ValueError(
            f"fit_exponent: at least two points are needed. Received: depths={list(depths)!r}. "
            "Pass two or more depths."
        )
    if any(d <= 0 for d in depths) or any(v <= 0 for v in values):
        raise ValueError(
            f"fit_exponent: depths and values must be positive. Received: "
            f"depths={list(depths)!r}, values={list(values)!r}. Drop the non-positive points."
        )
    xs = [math.log(d) for d in depths]
    ys = [math.log(v) for v in values]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mean_x) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError(
            f"fit_exponent: all depths are equal. Received: depths={list(depths)!r}. "
            "Pass at least two distinct depths."
        )
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sxx


def measure_depth(
    depth: int,
    width: int,
    batch_size: int,
    steps: int,
    rounds: int,
    variants: Sequence[str] = VARIANTS,
) -> dict[str, Any]:
    """Plans and measures `variants` for one depth (run in a worker process)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.path.insert(0, str(ROOT))  # this checkout's tfrecompute, not an installed one
    import keras
    import numpy as np

    import tfrecompute
    from tfrecompute import strategies

    start = time.perf_counter()

    def build() -> Any:
        keras.utils.set_random_seed(SEED)
        dense = [
            keras.layers.Dense(width, activation="tanh", name=f"dense_{i}") for i in range(depth)
        ]
        return keras.Sequential([keras.Input((width,)), *dense], name=f"mlp_{depth}")

    model = build()
    rng = np.random.default_rng(SEED)
    x = rng.standard_normal((batch_size, width)).astype("float32")
    y = rng.standard_normal((batch_size, width)).astype("float32")

    chain = tfrecompute.profile(model, batch_size=batch_size)
    least = strategies.min_peak(chain)
    store_all = strategies.simulate(chain, []).peak_bytes
    budget = min(2 * least, store_all)
    forward = chain.total_forward_cost

    def turn(variant_model: Any) -> Callable[[_report.StepTimes], int]:
        return lambda times: _report.measure_steps(variant_model, x, y, times, steps=steps)

    plans, turns, first = [], [], []
    times = [_report.StepTimes() for _ in variants]
    for variant, variant_times in zip(variants, times):
        plan = tfrecompute.plan(
            model,
            variant,
            budget=budget if variant == "optimal" else None,
            batch_size=batch_size,
            headroom=0 if variant == "optimal" else None,
        )
        # Each plan checkpoints a model of its own (built alike), so that they take turns.
        variant_model = tfrecompute.recompute(build(), plan)
        variant_model.compile(optimizer="sgd", loss="mse")
        plans.append(plan)
        turns.append(turn(variant_model))
        # The first round right after the plan's model is built: its memory is reported.
        first.append(_report.interleaved_rounds(turns[-1:], [variant_times], rounds=1)[0])
    # Timing rounds: the plans take turns, so that a burst of load from other
    # processes slows the plans of one round alike.
    later = _report.interleaved_rounds(turns, times, rounds=rounds - 1)
    rows = []
    for variant, plan, variant_times, peaks, more in zip(variants, plans, times, first, later):
        peaks += more
        peak = peaks[0]  # the first run of each plan: its memory is reported
        wall, cpu = variant_times.wall_per_round(), variant_times.cpu_per_round()
        rows.append(
            {
                "variant": variant,
                "segments": len(plan.segments),
                "segment_layers": [e - s for s, e in plan.segments],
                "budget_bytes": budget if variant == "optimal" else None,
                "predicted_bytes": plan.peak_bytes,
                "measured_bytes": peak,
                "measured_bytes_rounds": peaks,
                "error": plan.peak_bytes / peak - 1 if peak else None,
                "recompute_cost": plan.recompute_cost,
                "recompute_share": plan.recompute_cost / forward if forward else 0.0,
                "seconds": min(wall),
                "seconds_rounds": wall,
                "cpu_seconds": min(cpu),
                "cpu_seconds_rounds": cpu,
            }
        )
    base = rows[0]
    for row in rows:  # the ratio within each round (run close in time), then the median
        for key in ("", "cpu_"):
            ratios = zip(row[f"{key}seconds_rounds"], base[f"{key}seconds_rounds"])
            row[f"{key}time_ratio"] = statistics.median(t / b for t, b in ratios)
    return {
        "depth": depth,
        "links": chain.n,
        "activation_bytes": chain.output_bytes[0],
        "min_peak_bytes": least,
        "store_all_bytes": store_all,
        "device": _report.default_device(),
        "worker_seconds": time.perf_counter() - start,
        "rows": rows,
    }


def run_in_subprocess(
    depth: int, width: int, batch_size: int, steps: int, rounds: int, variants: Sequence[str]
) -> dict[str, Any]:
    """Runs `measure_depth` in a fresh Python process and returns its result."""
    args = [f"--worker={depth}", f"--width={width}", f"--batch-size={batch_size}"]
    args += [f"--steps={steps}", f"--rounds={rounds}", f"--variants={','.join(variants)}"]
    return _report.run_worker(Path(__file__).resolve(), args, timeout=900)


def measure_in_fresh_processes(
    depth: int, width: int, batch_size: int, steps: int, rounds: int
) -> dict[str, Any]:
    """Times all plans side by side in one process, and each plan's memory alone in its own."""
    result = run_in_subprocess(depth, width, batch_size, steps, rounds, VARIANTS)
    for row in result["rows"]:
        alone = run_in_subprocess(depth, width, batch_size, steps, 1, [row["variant"]])
        peak = alone["rows"][0]["measured_bytes"]
        row["measured_bytes_shared_rounds"] = row.pop("measured_bytes_rounds")
        row["measured_bytes"] = peak
        row["error"] = row["predicted_bytes"] / peak - 1 if peak else None
    return result


def exponents(results: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Fitted exponents per variant: measured and predicted, all depths and the deeper half.

    Also of `min_peak` (the least feasible predicted peak), which the `optimal`
    budget follows.
    """
    depths = [r["depth"] for r in results]
    deep = len(depths) - max(2, (len(depths) + 1) // 2)  # index of the first "deep" depth
    fits: dict[str, dict[str, float | None]] = {}
    for i, variant in enumerate(VARIANTS):
        measured = [r["rows"][i]["measured_bytes"] for r in results]
        predicted = [r["rows"][i]["predicted_bytes"] for r in results]
        fit: dict[str, float | None] = {}
        for key, values in (("measured", measured), ("predicted", predicted)):
            usable = len(depths) >= 2 and all(v > 0 for v in values)
            fit[key] = fit_exponent(depths, values) if usable else None
            fit[f"{key}_deep"] = fit_exponent(depths[deep:], values[deep:]) if usable else None
        fits[variant] = fit
    least = [r["min_peak_bytes"] for r in results]  # what the optimal budget follows
    fits["min_peak"] = {
        "measured": None,
        "predicted": fit_exponent(depths, least) if len(depths) >= 2 else None,
        "measured_deep": None,
        "predicted_deep": fit_exponent(depths[deep:], least[deep:]) if len(depths) >= 2 else None,
    }
    return fits


def _exp(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def markdown(report: dict[str, Any]) -> str:
    info, settings = report["machine"], report["settings"]
    results = report["results"]
    deep_from = results[len(results) - max(2, (len(results) + 1) // 2)]["depth"]
    lines = [
        "# Memory against depth",
        "",
        f"Machine: {info['platform']}, {info['processor']}, {info['cpu_count']} CPUs; "
        f"Python {info['python']}, tensorflow {info['tensorflow']}, keras {info['keras']}.",
        "",
        f"Model: `keras.Sequential` of L `Dense({settings['width']}, tanh)` at batch "
        f"{settings['batch_size']} ({format(results[0]['activation_bytes'] / MiB, '.2f')} MiB "
        "per activation); one compiled SGD training step measured as `measure_step` does "
        f"(memory: the largest of {settings['steps']} steps after a warm-up, each plan in a "
        f"fresh process; time: {settings['rounds']} rounds taking turns, each L's plans side "
        "by side in one more fresh process). `optimal` budget: min(2 x least feasible peak, "
        "peak of storing everything). Error = predicted / measured - 1; time x none = median "
        "over the rounds of the median step time / that of `none` in the same round, in CPU "
        "time (`time.process_time()`, all threads) and in wall time; "
        "recompute = recomputed forward cost in % of one forward pass.",
        "",
        "| L | plan | segments | measured MiB | predicted MiB | error | time x none | "
        "recompute % |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for result in results:
        for row in result["rows"]:
            error = "-" if row["error"] is None else f"{row['error']:+.1%}"
            lines.append(
                f"| {result['depth']} | {row['variant']} | {row['segments']} | "
                f"{row['measured_bytes'] / MiB:.1f} | {row['predicted_bytes'] / MiB:.1f} | "
                f"{error} | {_report.ratios(row['cpu_time_ratio'], row['time_ratio'])} | "
                f"{100 * row['recompute_share']:.0f} |"
            )
    lines += [
        "",
        "Growth exponent k of peak ~ c * L^k, least squares on log(peak) against log(L), "
        f"over all L and over L >= {deep_from}:",
        "",
        f"| plan | measured k | predicted k | measured k, L >= {deep_from} | "
        f"predicted k, L >= {deep_from} |",
        "|---|---:|---:|---:|---:|",
    ]
    names = {"min_peak": "least feasible peak (`min_peak`)"}
    for variant, fit in report["exponents"].items():
        lines.append(
            f"| {names.get(variant, variant)} | {_exp(fit['measured'])} | "
            f"{_exp(fit['predicted'])} | {_exp(fit['measured_deep'])} | "
            f"{_exp(fit['predicted_deep'])} |"
        )
    lines += [
        "",
        f"Total wall time {report['wall_seconds']:.0f} s "
        f"(`python benchmarks/depth_scaling.py{' --smoke' if report['smoke'] else ''}`).",
    ]
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: Path) -> bool:
    """Draws measured (solid) and predicted (dashed) peaks against L, log-log; False without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    results = report["results"]
    depths = [r["depth"] for r in results]
    figure, axes = plt.subplots(figsize=(6.4, 4.6))
    for i, (variant, color) in enumerate(zip(VARIANTS, ("tab:red", "tab:blue", "tab:green"))):
        measured = [r["rows"][i]["measured_bytes"] / MiB for r in results]
        predicted = [r["rows"][i]["predicted_bytes"] / MiB for r in results]
        k = report["exponents"][variant]["measured"]
        label = f"{variant} measured (k = {_exp(k)})"
        axes.plot(depths, measured, "o-", color=color, label=label)
        axes.plot(depths, predicted, "x--", color=color, alpha=0.6, label=f"{variant} predicted")
    axes.set_xscale("log", base=2)
    axes.set_yscale("log", base=2)
    axes.set_xticks(depths, [str(d) for d in depths])
    axes.set_xlabel("depth L (Dense layers)")
    axes.set_ylabel("peak memory of one training step (MiB)")
    settings = report["settings"]
    axes.set_title(
        f"Dense({settings['width']}, tanh) x L, batch {settings['batch_size']}", fontsize=10
    )
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs the benchmark; returns the report written to `<out>/depth_scaling.json`."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="L = 4, 8 at width 128")
    parser.add_argument("--out", type=Path, default=None, help="output directory")
    parser.add_argument("--depths", type=int, nargs="+", default=None)
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None, help="measured steps per plan")
    parser.add_argument("--rounds", type=int, default=None, help="timing rounds per plan")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--variants", default=",".join(VARIANTS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    defaults = SMOKE if args.smoke else FULL
    depths = tuple(args.depths or defaults["depths"])
    width = args.width or defaults["width"]
    batch_size = args.batch_size or defaults["batch_size"]
    steps = args.steps or defaults["steps"]
    rounds = args.rounds or defaults["rounds"]
    if args.worker is not None:
        variants = args.variants.split(",")
        print(json.dumps(measure_depth(args.worker, width, batch_size, steps, rounds, variants)))
        return {}

    out = _report.output_dir(args.out, smoke=args.smoke, name="depth_scaling")

    start = time.perf_counter()
    results = [
        measure_in_fresh_processes(depth, width, batch_size, steps, rounds) for depth in depths
    ]
    report: dict[str, Any] = {
        "machine": {**_report.machine(), **_report.versions("tensorflow", "keras")},
        "smoke": args.smoke,
        "settings": {
            "model": "Sequential of Dense(width, tanh)",
            "depths": list(depths),
            "width": width,
            "batch_size": batch_size,
            "steps": steps,
            "rounds": rounds,
            "optimizer": "sgd",
            "loss": "mse",
            "optimal_budget": "min(2 * min_peak(chain), simulate(chain, []).peak_bytes)",
            "seed": SEED,
        },
        "results": results,
        "exponents": exponents(results),
        "wall_seconds": time.perf_counter() - start,
    }
    _report.write(out, "depth_scaling", report, markdown(report))
    if plot(report, out / "depth_scaling.png"):
        print(f"wrote {out / 'depth_scaling.png'}")
    return report


if __name__ == "__main__":
    main()
