"""Keras's own rematerialization (`keras.RematScope`) next to tfrecompute.

Usage:
    python benchmarks/vs_keras_remat.py          # benchmarks/results/vs_keras_remat.{json,md}
    python benchmarks/vs_keras_remat.py --smoke  # tiny models, to a temporary directory
    python benchmarks/vs_keras_remat.py --models dense_chain --out DIR

The same models, each built fresh with the same seed (so weights and dropout
seeds match), trained by the compiled (graph-mode) train step:

* no recompute;
* `keras.RematScope` in its modes `"full"`, `"activations"`, `"larger_than"`
  (Keras's default `output_size_threshold=1024` elements) and
  `"list_of_layers"` (the layers with the largest activations), the scope
  wrapping the construction of the whole model as a user would write it:
  a layer reads the scope once, in `Operation.__init__`
  (`keras/src/ops/operation.py`), and `Operation.__call__` then wraps its
  `call` in `tf.recompute_grad` (`keras/src/backend/tensorflow/core.py`);
* two placements of `"full"` that show where the scope acts: around the
  construction of the layers only (the model object built outside it), and
  around the training calls only (the layers built outside it: no effect);
* `tfrecompute.recompute(model, "sqrt")` and `"optimal"` at a budget halfway
  between the planner's least feasible peak and the peak of storing
  everything.

For each: the peak bytes one training step added (`tfrecompute.measure_step`,
the train function `model.fit` runs) and the median time of that step over
rounds taking the variants in turn, in wall time (`time.perf_counter()`) and in
CPU time (`time.process_time()`, steadier on a shared machine), as ratios to
the no-recompute row of the same model in the same process; whether
`model.fit(x, y, epochs=1)` runs in graph mode (and, for the Keras modes,
with `run_eagerly=True`); and the largest difference between the variant's
gradients of one batch (under `tf.function`, in training mode) and the
no-recompute model's. Where a variant cannot take a graph-mode gradient, the
gradient is taken eagerly and compared with the eager reference. A variant
that fails is reported with the exception type and the first lines of its
message; the others still run. Each model runs in a fresh process, and the
peak of each variant whose step ran is measured again in a process of its own
(reported; the shared process's peak stays in the JSON), so that neither
another model nor another variant leaves the allocator in a state that shapes
it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # for `benchmarks._report` (and this checkout's tfrecompute)

from benchmarks import _report  # noqa: E402

MODELS = ("dense_chain", "encoder", "cnn")
KERAS_MODES = ("full", "activations", "larger_than", "list_of_layers")
SEED = 0
ROUNDS = {"full": 9, "smoke": 3}  # timed train steps per variant, the variants in turn

# Sizes: activations must stay >= 256 KiB, oneDNN's CPU allocator statistics skip
# smaller allocations.
CONFIGS: dict[str, dict[str, dict[str, int]]] = {
    "full": {
        "dense_chain": {"layers": 16, "width": 512, "batch": 1024},
        "encoder": {"layers": 4, "sequence": 64, "hidden": 128, "batch": 64},
        # Four convolutions per stage: memory spread over many layers, so that
        # checkpointing has something to save (with two, the first stage's
        # backward set the predicted peak of every plan).
        "cnn": {"blocks": 2, "convs": 4, "size": 32, "filters": 32, "batch": 64},
    },
    "smoke": {
        "dense_chain": {"layers": 8, "width": 256, "batch": 1024},
        "encoder": {"layers": 1, "sequence": 64, "hidden": 64, "batch": 32},
        "cnn": {"blocks": 1, "convs": 2, "size": 32, "filters": 16, "batch": 32},
    },
}

# (name, family, what the row shows)
VARIANTS: tuple[tuple[str, str, str], ...] = (
    ("none", "baseline", "no recompute"),
    ("keras full", "keras", 'RematScope("full") around the model construction'),
    ("keras activations", "keras", 'RematScope("activations") around the model construction'),
    (
        "keras larger_than",
        "keras",
        'RematScope("larger_than", output_size_threshold=1024) around the model construction',
    ),
    (
        "keras list_of_layers",
        "keras",
        'RematScope("list_of_layers", layer_names=[largest layers]) around the model construction',
    ),
    (
        "keras full, layers only",
        "keras",
        'RematScope("full") around the layers\' construction; the model object built outside',
    ),
    (
        "keras full, call only",
        "keras",
        'RematScope("full") around the training calls only; the model built outside',
    ),
    ("tfrecompute sqrt", "tfrecompute", 'tfrecompute.recompute(model, "sqrt")'),
    (
        "tfrecompute optimal",
        "tfrecompute",
        'tfrecompute.recompute(model, plan(model, "optimal", budget=halfway))',
    ),
)


# ------------------------------------------------------------------ the models


def _dense_chain(layers: int, width: int) -> Any:
    import keras

    hidden = [
        keras.layers.Dense(width, activation="tanh", name=f"dense_{i}") for i in range(layers)
    ]
    return keras.Sequential(
        [keras.Input((width,)), *hidden, keras.layers.Dense(width, name="head")],
        name="dense_chain",
    )


def _cnn(blocks: int, convs: int, size: int, filters: int) -> Any:
    import keras

    layers: list[Any] = [keras.Input((size, size, 3))]
    for block in range(blocks):
        channels = filters * 2**block
        layers += [
            keras.layers.Conv2D(channels, 3, padding="same", activation="relu")
            for _ in range(convs)
        ]
        layers.append(keras.layers.MaxPooling2D())
    layers += [keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(10)]
    return keras.Sequential(layers, name="cnn")


def build(name: str, config: dict[str, int]) -> Any:
    """A fresh model of the benchmark (without a scope, seeds set by the caller)."""
    if name == "dense_chain":
        return _dense_chain(config["layers"], config["width"])
    if name == "cnn":
        return _cnn(config["blocks"], config["convs"], config["size"], config["filters"])
    from tests import models_zoo

    return models_zoo.transformer_encoder(
        layers=config["layers"], sequence=config["sequence"], hidden=config["hidden"]
    )


def largest_layers(name: str, model: Any) -> list[str]:
    """The layer names a user would give `"list_of_layers"`: those with the largest outputs."""
    import keras

    if name == "dense_chain":  # every other hidden layer
        return [layer.name for layer in model.layers[:-1:2]]
    if name == "cnn":
        return [layer.name for layer in model.layers if isinstance(layer, keras.layers.Conv2D)]
    widest = max(
        layer.units for layer in model.layers if isinstance(layer, keras.layers.Dense)
    )  # the encoder's MLP up-projections (4 x hidden, GELU)
    return [
        layer.name
        for layer in model.layers
        if isinstance(layer, keras.layers.Dense) and layer.units == widest
    ]


# ----------------------------------------------------------------- one process


def _error(exc: BaseException) -> str:
    """The exception type and the first lines of its message, without terminal colours."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    message = " / ".join(lines[:2])
    if len(message) > 300:
        message = message[:297] + "..."
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def _fresh() -> None:
    import keras

    keras.backend.clear_session()  # the same auto-generated names in every variant
    keras.utils.set_random_seed(SEED)  # the same weights and dropout seeds


def _gradients(model: Any, x: Any, y: Any, *, graph: bool) -> dict[str, Any]:
    """The gradients of one training-mode batch, by variable path."""
    import keras
    import tensorflow as tf

    variables = model.trainable_variables

    def step(x: Any, y: Any) -> list[Any]:
        with tf.GradientTape() as tape:
            loss = keras.ops.mean(keras.losses.mean_squared_error(y, model(x, training=True)))
        return tape.gradient(loss, variables)

    # autograph=False keeps the original exception type and message.
    fn = tf.function(step, autograph=False) if graph else step
    grads = fn(x, y)  # an embedding's gradient is IndexedSlices: made dense
    return {
        v.path: (None if g is None else tf.convert_to_tensor(g).numpy())
        for v, g in zip(variables, grads)
    }


def _compare(grads: dict[str, Any], reference: dict[str, Any]) -> tuple[float, float]:
    """(largest absolute difference, share of entries not close) against the reference."""
    import numpy as np

    if sorted(grads) != sorted(reference):
        raise ValueError(
            f"the variables differ from the reference's: {sorted(set(grads) ^ set(reference))}"
        )
    diff, wrong, total = 0.0, 0, 0
    for path, value in reference.items():
        if (grads[path] is None) != (value is None):
            raise ValueError(f"{path} has a gradient in only one of the two models")
        if value is None:
            continue
        delta = np.abs(grads[path] - value)
        diff = max(diff, float(np.max(delta)))
        wrong += int(np.sum(delta > 1e-5 + 1e-3 * np.abs(value)))
        total += value.size
    return diff, wrong / max(total, 1)


def _make(
    variant: str, name: str, config: dict[str, int], layer_names: list[str]
) -> tuple[Any, dict[str, Any], contextlib.AbstractContextManager[Any]]:
    """Builds one variant: (model, details for the report, scope around the training calls)."""
    import keras

    import tfrecompute
    from tfrecompute import strategies

    details: dict[str, Any] = {}
    no_scope: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if variant == "none":
        return build(name, config), details, no_scope
    if variant == "keras full, call only":
        return build(name, config), details, keras.RematScope(mode="full")
    if variant == "keras full, layers only":
        with keras.RematScope(mode="full"):
            inner = build(name, config)
        # A new model object over the same layers, outside the scope: only the
        # layers keep the mode they read when they were created.
        return keras.Model(inner.inputs, inner.outputs, name=inner.name), details, no_scope
    if variant.startswith("keras "):
        mode = variant.split()[1]
        options: dict[str, Any] = {}
        if mode == "larger_than":
            options["output_size_threshold"] = 1024
        if mode == "list_of_layers":
            options["layer_names"] = layer_names
            details["layer_names"] = layer_names
        with keras.RematScope(mode=mode, **options):
            model = build(name, config)
        return model, details, no_scope

    base = build(name, config)
    base.compile(optimizer="sgd", loss="mse")
    batch_size = config["batch"]
    if variant == "tfrecompute sqrt":
        plan = tfrecompute.plan(base, "sqrt", batch_size=batch_size)
    else:

        def halfway(chain: strategies.Chain, budget: Any = None) -> strategies.Plan:
            # halfway between the least feasible peak and storing everything
            budget = (strategies.min_peak(chain) + strategies.simulate(chain, []).peak_bytes) // 2
            details["budget_bytes"] = budget
            return strategies.optimal(chain, budget)

        plan = tfrecompute.plan(base, halfway, batch_size=batch_size)  # profiles once
    details["links"] = plan.chain.n
    details["segments"] = len(plan.segments)
    details["predicted_bytes"] = plan.peak_bytes
    return tfrecompute.recompute(base, plan), details, no_scope


def _interleaved_times(
    timed: list[tuple[dict[str, Any], Any, Any]], x: Any, y: Any, rounds: int
) -> None:
    """Median train-step wall and CPU seconds per variant, the variants in turn in each round.

    `_report.interleaved_rounds`: one step per variant and round, after an
    untimed round that traces the train functions again.
    """
    import statistics

    import tensorflow as tf

    x = tf.nest.map_structure(tf.convert_to_tensor, x)
    y = tf.convert_to_tensor(y)

    def turn(model: Any, scope: Any) -> Any:
        def step(times: _report.StepTimes) -> None:
            with scope:
                times.time(lambda: model.train_on_batch(x, y))

        return step

    times = [_report.StepTimes() for _ in timed]
    turns = [turn(model, scope) for _, model, scope in timed]
    _report.interleaved_rounds(turns, times, rounds=rounds, untimed=1)
    for (row, _, _), variant in zip(timed, times):
        row["seconds"] = statistics.median(variant.wall_per_round())
        row["cpu_seconds"] = statistics.median(variant.cpu_per_round())


def _worker(name: str, config_name: str) -> tuple[dict[str, int], list[str], Any, Any]:
    """A worker process's start: the model's config, its largest layers and a batch."""
    config = CONFIGS[config_name][name]
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.path.insert(0, str(ROOT))  # this checkout's tfrecompute and tests, not an installed one
    import warnings

    import tensorflow as tf

    from tests.models_zoo import synthetic_batch

    tf.get_logger().setLevel("ERROR")  # retracing warnings: every variant is a new model
    warnings.filterwarnings("ignore", message=".*RematScope at call time.*")
    _fresh()
    probe = build(name, config)
    layer_names = largest_layers(name, probe)
    x, y = synthetic_batch(probe, config["batch"], seed=SEED)
    del probe
    return config, layer_names, x, y


def measure(name: str, config_name: str) -> dict[str, Any]:
    """All variants of one model (run in a worker process)."""
    config, layer_names, x, y = _worker(name, config_name)
    import tfrecompute

    references: dict[bool, dict[str, Any]] = {}
    rows = []
    timed = []  # (row, model, scope) of the variants whose train step ran
    for variant, family, description in VARIANTS:
        started = time.perf_counter()
        row: dict[str, Any] = {
            "variant": variant,
            "family": family,
            "description": description,
            "error": None,
            "error_stage": None,
            "peak_bytes": None,
            "seconds": None,
            "cpu_seconds": None,
            "measure_step_seconds": None,
            "fit_graph": None,
            "fit_graph_error": None,
            "fit_eager": None,
            "fit_eager_error": None,
            "grad_max_diff": None,
            "grad_wrong_share": None,
            "grad_mode": None,
            "grad_graph_error": None,
            "grad_error": None,
        }
        rows.append(row)
        _fresh()
        try:
            model, details, scope = _make(variant, name, config, layer_names)
        except Exception as exc:  # noqa: BLE001 (every failure is a result)
            row.update(error=_error(exc), error_stage="build")
            continue
        row.update(details)

        # Gradients first, while the dropout seed generators are in their initial state.
        with scope:
            if variant == "none":  # the references; the baseline must work
                references[True] = _gradients(model, x, y, graph=True)
                _fresh()  # the eager reference from the same initial state
                model, _, _ = _make(variant, name, config, layer_names)
                references[False] = _gradients(model, x, y, graph=False)
                _fresh()  # and the row's own model: its difference shows the determinism
                model, _, _ = _make(variant, name, config, layer_names)
            for graph in (True, False):
                try:
                    grads = _gradients(model, x, y, graph=graph)
                except Exception as exc:  # noqa: BLE001
                    row["grad_graph_error" if graph else "grad_error"] = _error(exc)
                    continue  # eagerly, after a graph-mode failure
                row["grad_mode"] = "graph" if graph else "eager"
                try:
                    row["grad_max_diff"], row["grad_wrong_share"] = _compare(
                        grads, references[graph]
                    )
                except ValueError as exc:
                    row["grad_error"] = _error(exc)
                break

            model.compile(optimizer="sgd", loss="mse")
            try:
                step = tfrecompute.measure_step(model, x, y)
                row.update(peak_bytes=step.peak_bytes, measure_step_seconds=step.seconds)
            except Exception as exc:  # noqa: BLE001
                row.update(error=_error(exc), error_stage="train step")
            try:
                model.fit(x, y, epochs=1, batch_size=config["batch"], verbose=0)
                row["fit_graph"] = True
            except Exception as exc:  # noqa: BLE001
                row.update(fit_graph=False, fit_graph_error=_error(exc))
            if family == "keras":
                model.compile(optimizer="sgd", loss="mse", run_eagerly=True)
                try:
                    model.fit(x, y, epochs=1, batch_size=config["batch"], verbose=0)
                    row["fit_eager"] = True
                except Exception as exc:  # noqa: BLE001
                    row.update(fit_eager=False, fit_eager_error=_error(exc))
                model.compile(optimizer="sgd", loss="mse")  # graph mode again
            if row["peak_bytes"] is not None:
                timed.append((row, model, scope))
        row["variant_seconds"] = time.perf_counter() - started

    _interleaved_times(timed, x, y, ROUNDS[config_name])

    none = rows[0]
    for row in rows:
        if row["peak_bytes"] is not None and none["peak_bytes"]:
            row["memory_ratio"] = row["peak_bytes"] / none["peak_bytes"]
            row["time_ratio"] = row["seconds"] / none["seconds"]
            row["cpu_time_ratio"] = row["cpu_seconds"] / none["cpu_seconds"]
        else:
            row["memory_ratio"] = row["time_ratio"] = row["cpu_time_ratio"] = None
    links = next((row["links"] for row in rows if row.get("links")), None)
    return {"model": name, "config": config, "links": links, "rows": rows}


def measure_alone(name: str, config_name: str, variant: str) -> dict[str, Any]:
    """One variant's step peak, measured in a process that built nothing else."""
    config, layer_names, x, y = _worker(name, config_name)
    import tfrecompute

    _fresh()
    model, _, scope = _make(variant, name, config, layer_names)
    with scope:
        model.compile(optimizer="sgd", loss="mse")
        step = tfrecompute.measure_step(model, x, y)
    return {"model": name, "variant": variant, "peak_bytes": step.peak_bytes}


def run_in_subprocesses(names: Sequence[str], config_name: str, jobs: int) -> list[dict[str, Any]]:
    """Runs `measure` for each model in a fresh Python process, `jobs` at a time; then
    `measure_alone` for each variant whose step ran, and reports that peak."""
    script = Path(__file__).resolve()
    tasks = [["--worker", name, "--config", config_name] for name in names]
    results = _report.run_workers(script, tasks, jobs=jobs, timeout=1800)
    rows = {
        (result["model"], row["variant"]): row
        for result in results
        for row in result["rows"]
        if row["peak_bytes"] is not None
    }
    tasks = [
        ["--worker", name, "--config", config_name, "--alone", variant] for name, variant in rows
    ]
    for alone in _report.run_workers(script, tasks, jobs=jobs, timeout=1800):
        row = rows[alone["model"], alone["variant"]]
        row["peak_bytes_shared_process"] = row["peak_bytes"]
        row["peak_bytes"] = alone["peak_bytes"]
    for result in results:
        none = result["rows"][0]
        for row in result["rows"]:
            if row["peak_bytes"] is not None and none["peak_bytes"]:
                row["memory_ratio"] = row["peak_bytes"] / none["peak_bytes"]
    return results


# --------------------------------------------------------------------- report


def _yes_no(value: bool | None) -> str:
    return "-" if value is None else ("yes" if value else "**no**")


def _config_text(config: dict[str, int]) -> str:
    return ", ".join(f"{key} {value}" for key, value in config.items())


def _short(error: str) -> str:
    return re.sub(r"Exception encountered when calling (\S+)\. / ", r"in \1: ", error)


def _table_error(row: dict[str, Any]) -> str:
    """The graph-mode failure, then an eager one where that differs."""
    graph = row["error"] or row["fit_graph_error"] or row["grad_graph_error"]
    eager = row["fit_eager_error"] or row["grad_error"]
    parts = [_short(graph)] if graph else []
    if eager and eager != graph:
        parts.append(f"eagerly: {_short(eager)}")
    return "; ".join(parts).replace("|", "\\|")


def markdown(report: dict[str, Any]) -> str:
    info, found = report["machine"], report["versions"]
    lines = [
        "# keras.RematScope against tfrecompute",
        "",
        f"Machine: {info['platform']}, {info['processor']}, {info['cpu_count']} CPUs; "
        f"Python {info['python']}, tensorflow {found['tensorflow']}, keras {found['keras']}. "
        f"Config `{report['config']}`; each model in a fresh process, all its variants in that "
        "process, each variant a fresh model with the same seed; each variant's step MiB "
        "measured again in a fresh process of its own. Runtime "
        f"{report['seconds']:.0f} s.",
        "",
        "Step MiB: the peak one compiled training step added (`tfrecompute.measure_step`, "
        "SGD, the train function `model.fit` runs). x none: ratios to the no-recompute row "
        "of the same model; time: the median train step over interleaved rounds, in CPU "
        "time (`time.process_time()`, all threads of the process) and in wall time "
        "(`time.perf_counter()`). fit: `model.fit(x, y, epochs=1)` compiled (graph) / with "
        "`run_eagerly=True`. Gradient diff: the largest absolute difference from the "
        "no-recompute model's gradients of one training-mode batch with the same weights and "
        "dropout seeds, under `tf.function` (graph) or, where that fails, eagerly; "
        "off: the share of gradient entries further than 1e-5 + 1e-3 |reference| from the "
        "reference. Error: the exception type and the first lines of its message.",
        "",
    ]
    for result in report["results"]:
        lines += [
            f"## {result['model']} ({_config_text(result['config'])}; "
            f"{result['links']} links in tfrecompute's chain)",
            "",
            "| variant | fit graph | fit eager | step MiB | x none | time x none | "
            "gradient diff | error |",
            "|---|:---:|:---:|---:|---:|---:|---:|---|",
        ]
        for row in result["rows"]:
            mib = "-" if row["peak_bytes"] is None else f"{row['peak_bytes'] / 2**20:.1f}"
            memory = "-" if row["memory_ratio"] is None else f"{row['memory_ratio']:.2f}"
            speed = _report.ratios(row["cpu_time_ratio"], row["time_ratio"])
            grad = "-"
            if row["grad_max_diff"] is not None:
                off = row["grad_wrong_share"]
                grad = f"{row['grad_max_diff']:.1e} ({row['grad_mode']}"
                grad += f", {off:.0%} off)" if off else ")"
            error = _table_error(row)
            lines.append(
                f"| {row['variant']} | {_yes_no(row['fit_graph'])} | "
                f"{_yes_no(row['fit_eager'])} | {mib} | {memory} | {speed} | {grad} | "
                f"{error} |"
            )
        lines.append("")
    lines += ["Variants:", ""]
    for variant, _, description in VARIANTS:
        lines.append(f"- {variant}: {description}.")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs the benchmark; returns the report written to `<out>/vs_keras_remat.json`."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny models")
    parser.add_argument(
        "--models", nargs="+", choices=MODELS, help="default: all; with --smoke, no cnn"
    )
    parser.add_argument("--out", type=Path, default=None, help="output directory")
    parser.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="models measured at once, each in its own process (default: 1; 2 with --smoke)",
    )
    parser.add_argument("--worker", choices=MODELS, help=argparse.SUPPRESS)
    parser.add_argument("--config", choices=sorted(CONFIGS), help=argparse.SUPPRESS)
    parser.add_argument("--alone", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker and args.alone:
        print(json.dumps(measure_alone(args.worker, args.config, args.alone)))
        return {}
    if args.worker:
        print(json.dumps(measure(args.worker, args.config)))
        return {}

    config_name = "smoke" if args.smoke else "full"
    out = _report.output_dir(args.out, smoke=args.smoke, name="vs_keras_remat")

    started = time.perf_counter()
    models = args.models or [m for m in MODELS if not (args.smoke and m == "cnn")]
    jobs = args.jobs or (2 if args.smoke else 1)
    results = run_in_subprocesses(models, config_name, jobs)
    report = {
        "machine": _report.machine(),
        "versions": _report.versions("tensorflow", "keras", "numpy"),
        "config": config_name,
        "seed": SEED,
        "jobs": jobs,
        "seconds": time.perf_counter() - started,
        "results": results,
    }
    _report.write(out, "vs_keras_remat", report, markdown(report))
    return report


if __name__ == "__main__":
    main()
