"""Why a block's input gradients wait for its weight gradients: the spread of step peaks.

Usage:
    python benchmarks/backward_order.py          # benchmarks/results/backward_order.{json,md}
    python benchmarks/backward_order.py --smoke  # a small chain, to a temporary directory

The model is a `keras.Sequential` of L `Dense(width, tanh)` layers under a
`sqrt` plan (full run: L = 64, width 256, batch 1024: 1 MiB per activation),
compiled with SGD and MSE, in two variants:

* `wait`: as the library builds blocks: a block releases its inputs'
  gradients only once its weight gradients are computed (NOTE [ Variable
  gradients wait for the whole backward ] in `tfrecompute/layers/backward.py`);
* `early`: the inputs' gradients released as soon as they exist, as before
  that rule (`backward._ordered` patched while the train step is traced, so
  that the one input of each block does not wait).

Memory: each variant in a fresh process, `--measurements` calls of
`tfrecompute.measure_step` of 5 steps each (the largest peak of each call);
reported are the median, the largest and how many calls peaked above 1.5x
the median. Such spikes depend on how the executor's threads interleave,
so on a quiet machine `early` may show none. Time: both variants in one
more process, in alternating rounds, the median step time of `wait` over
that of `early` in CPU time (`time.process_time()`) and wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import _report  # noqa: E402

NAME = "backward_order"
MIB = 1 << 20
VARIANTS = ("wait", "early")
FULL = {"depth": 64, "width": 256, "batch": 1024, "measurements": 40, "rounds": 15}
SMOKE = {"depth": 16, "width": 128, "batch": 512, "measurements": 4, "rounds": 3}


def _model(config: dict[str, int], variant: str) -> tuple[Any, Any, Any]:
    """The variant's compiled sqrt-planned model, traced, and a batch."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import numpy as np
    import tensorflow as tf

    import tfrecompute
    from tfrecompute.layers import backward

    keras.utils.set_random_seed(0)
    width = config["width"]
    layers = [keras.layers.Dense(width, activation="tanh") for _ in range(config["depth"])]
    model = keras.Sequential([keras.Input((width,)), *layers])
    tfrecompute.recompute(model, "sqrt", batch_size=config["batch"])
    model.compile(optimizer="sgd", loss="mse")
    rng = np.random.default_rng(0)
    x = tf.constant(rng.random((config["batch"], width), dtype="float32"))
    y = tf.constant(rng.random((config["batch"], width), dtype="float32"))
    ordered = backward._ordered
    if variant == "early":  # each block's first source is its one input
        backward._ordered = lambda grads, wait: ordered(grads, [False, *wait[1:]])
    try:
        model.train_on_batch(x, y)  # traced here, with the variant's rule
    finally:
        backward._ordered = ordered
    return model, x, y


def memory(config: dict[str, int], variant: str) -> dict[str, Any]:
    """The variant's step peaks in this (fresh) process."""
    import tfrecompute

    model, x, y = _model(config, variant)
    peaks = [
        tfrecompute.measure_step(model, x, y, steps=5).peak_bytes
        for _ in range(config["measurements"])
    ]
    median = statistics.median(peaks)
    return {
        "variant": variant,
        "peaks": peaks,
        "median_bytes": median,
        "max_bytes": max(peaks),
        "spikes": sum(p > 1.5 * median for p in peaks),
    }


def timing(config: dict[str, int]) -> dict[str, float]:
    """Step time of `wait` over `early`, both in this process, in alternating rounds."""
    built = [_model(config, variant) for variant in VARIANTS]
    times = [_report.StepTimes() for _ in VARIANTS]

    def turn(model: Any, x: Any, y: Any) -> Any:
        def run(clock: _report.StepTimes) -> None:
            for _ in range(3):
                clock.time(lambda: model.train_on_batch(x, y))

        return run

    turns = [turn(*b) for b in built]
    _report.interleaved_rounds(turns, times, rounds=config["rounds"], alternate=True)
    wait, early = times
    ratio = statistics.median
    return {
        "cpu_ratio": ratio(w / e for w, e in zip(wait.cpu_per_round(), early.cpu_per_round())),
        "wall_ratio": ratio(w / e for w, e in zip(wait.wall_per_round(), early.wall_per_round())),
    }


def markdown(report: dict[str, Any]) -> str:
    info, config = report["machine"], report["config"]
    lines = [
        "# Backward order: a block's input gradients wait for its weight gradients",
        "",
        f"Machine: {info['platform']}, {info['cpu_count']} CPUs; tensorflow "
        f"{report['versions']['tensorflow']}, keras {report['versions']['keras']}.",
        "",
        f"`sqrt` plan of {config['depth']} x `Dense({config['width']}, tanh)`, batch "
        f"{config['batch']}; per variant, in a fresh process, {config['measurements']} "
        "`measure_step` calls of 5 steps (each call's largest peak).",
        "",
        "| variant | median MiB | largest MiB | calls above 1.5x the median |",
        "|---|---:|---:|---:|",
    ]
    for row in report["memory"]:
        lines.append(
            f"| {row['variant']} | {row['median_bytes'] / MIB:.1f} | "
            f"{row['max_bytes'] / MIB:.1f} | {row['spikes']} of {len(row['peaks'])} |"
        )
    time = report["time"]
    lines += [
        "",
        f"Step time, wait / early: {_report.ratios(time['cpu_ratio'], time['wall_ratio'])} "
        f"(median over {config['rounds']} alternating rounds of 3 steps, one process).",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a small chain, few measurements")
    parser.add_argument("--out", type=Path, default=None, help="output directory")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    config = SMOKE if args.smoke else FULL
    if args.worker:
        result = timing(config) if args.worker == "time" else memory(config, args.worker)
        print(json.dumps(result))
        return {}
    script = Path(__file__).resolve()
    smoke = ["--smoke"] if args.smoke else []
    rows = [_report.run_worker(script, [*smoke, "--worker", v], timeout=1800) for v in VARIANTS]
    report = {
        "machine": _report.machine(),
        "versions": _report.versions("tensorflow", "keras"),
        "config": config,
        "memory": rows,
        "time": _report.run_worker(script, [*smoke, "--worker", "time"], timeout=1800),
    }
    out = _report.output_dir(args.out, smoke=args.smoke, name=NAME)
    _report.write(out, NAME, report, markdown(report))
    return report


if __name__ == "__main__":
    main()
