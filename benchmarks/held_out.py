"""Predicted against measured peaks on models no test uses, each plan in a fresh process.

The held-out set of issue 37: keras-hub backbones of families the tests do
not build (GPT-NeoX, Mistral, OPT, ELECTRA), `keras.applications` CNNs
(Xception, VGG16, DenseNet121, InceptionV3), recurrent models (a stacked GRU
language model, a bidirectional LSTM tagger, a subclassed model stepping a
cell in a Python loop over time), a U-Net written here (transposed
convolutions, BatchNormalization, skip concatenations) and a CNN compiled
with `jit_compile=True`; Adam or SGD as listed in `MODELS`.

For each model and plan (`none`; the default, `recompute(model, sample=...)`;
`sqrt`; `optimal` under a budget halfway between the least peak a plan
reaches and storing everything, as `prediction_accuracy.py` sets it, with
whole segments; on the four keras-hub models also `optimal+policies`, the
same budget's default there, which weighs the attention and dots states; and
`next-up`, calibrated only: the plan of the chain's frontier just above the
one the budget's default chose, which the headroom ruled out), one
fresh process builds the model (seed 0), plans, applies the plan and
measures compiled training steps: the allocator's peak (`measure_step`) and
the largest requested peak of two traced steps (`trace_step`; what the
memory model predicts, without the allocator's rounding). Errors are
predicted / measured - 1. The planning CPU seconds (`time.process_time`)
are recorded beside them. Each plan is made twice, in processes of their
own: from the traced calls only, and with `calibrate=True` (the memory
model reconciled with one measured training step storing everything,
NOTE [ Calibrating against a measured step ] in
`tfrecompute/check/calibrate.py`); a model that cannot be calibrated (a
subclassed model) is listed with why.

With `--spread K` each model instead stores everything in K fresh
processes, one `measure_step` (the largest of three steps) each: the
spread of the quantity the table calls *measured* between processes. A
prediction cannot be held closer to one process's measurement than that.
`--spread-plan default` (`sqrt`, `optimal`) measures that plan so, planned
with `calibrate=True` in each process, its calibrated and replayed
predictions beside it.

Writes `held_out.json` and `held_out.md` to benchmarks/results/.

    python benchmarks/held_out.py                      # every model, about an hour on 2 cores
    python benchmarks/held_out.py --models gru_lm unet
    python benchmarks/held_out.py --models opt electra --plans optimal+policies
    python benchmarks/held_out.py --models gru_lm --plans optimal next-up
    python benchmarks/held_out.py --spread 5           # storing everything, 5 processes each
    python benchmarks/held_out.py --spread 3 --spread-plan default
    python benchmarks/held_out.py --smoke              # one small model, a temporary folder
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
from fractions import Fraction
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # for `benchmarks._report`

from benchmarks import _report  # noqa: E402
from tfrecompute.strategies import REPLAY_MARGIN, reconciled_peak  # noqa: E402

NAME = "held_out"
PLANS = ("none", "default", "sqrt", "optimal", "optimal+policies", "next-up")
# `optimal` plans whole segments (`policy="nothing"`); `optimal+policies` is what a budget
# plans by default on a model holding attention layers (NOTE [ Policy states under a
# budget ] in tfrecompute/pipeline.py), measured on those models only. `next-up`: of the
# calibrated chain's frontier, the plan just above the one the budget's default chose
# (its least-cost plan with a higher predicted peak), measured calibrated only: whether a
# plan the headroom ruled out would have used 85% to 105% of the budget.
APART = ("optimal+policies", "next-up")  # summarised apart from the first four plans
DEFAULT_PLANS = PLANS[:-1]  # next-up runs when asked for (`--plans next-up`)
ATTENTION_MODELS = ("gpt_neox", "mistral", "opt", "electra")
MEMORY = ("traced", "calibrated")  # how each plan's memory is predicted
SMOKE_PLANS = ("none", "sqrt")
TRACES = 2
MiB = 2**20
Built = tuple[Any, Any, Any, Any, str]  # model, x, y, loss, optimizer


def _tokens(batch: int, sequence: int, *, segments: bool = False) -> dict[str, Any]:
    import numpy as np

    rng = np.random.default_rng(0)
    x = {
        "token_ids": rng.integers(1, 1000, (batch, sequence)).astype("int32"),
        "padding_mask": np.ones((batch, sequence), "int32"),
    }
    if segments:
        x["segment_ids"] = np.zeros((batch, sequence), "int32")
    return x


def _hub(name: str, batch: int = 8, sequence: int = 128, hidden: int = 128) -> Built:
    import keras_hub
    import numpy as np

    common = {"vocabulary_size": 1000, "num_layers": 4, "hidden_dim": hidden}
    model = {
        "gpt_neox": lambda: keras_hub.models.GPTNeoXBackbone(
            **common, num_heads=4, intermediate_dim=4 * hidden, max_sequence_length=sequence
        ),
        "mistral": lambda: keras_hub.models.MistralBackbone(
            **common, num_query_heads=4, num_key_value_heads=2, intermediate_dim=2 * hidden
        ),
        "opt": lambda: keras_hub.models.OPTBackbone(
            **common, num_heads=4, intermediate_dim=4 * hidden, max_sequence_length=sequence
        ),
        "electra": lambda: keras_hub.models.ElectraBackbone(
            vocab_size=1000,
            num_layers=4,
            hidden_dim=hidden,
            num_heads=4,
            embedding_dim=hidden,
            intermediate_dim=4 * hidden,
            max_sequence_length=sequence,
        ),
    }[name]()
    x = _tokens(batch, sequence, segments=name == "electra")
    y = np.zeros((batch, sequence, hidden), "float32")
    if name == "electra":
        y = {"sequence_output": y, "pooled_output": np.zeros((batch, hidden), "float32")}
    return model, x, y, "mse", "adam" if name in ("gpt_neox", "opt") else "sgd"


def _application(name: str, batch: int = 16) -> Built:
    import keras
    import numpy as np

    cls, size, optimizer = {
        "xception": (keras.applications.Xception, 96, "sgd"),
        "vgg16": (keras.applications.VGG16, 64, "adam"),
        "densenet121": (keras.applications.DenseNet121, 64, "sgd"),
        "inception_v3": (keras.applications.InceptionV3, 96, "adam"),
    }[name]
    model = cls(weights=None, input_shape=(size, size, 3), classes=10)
    x = np.random.default_rng(0).random((batch, size, size, 3), dtype=np.float32)
    y = np.eye(10, dtype="float32")[np.arange(batch) % 10]
    return model, x, y, "categorical_crossentropy", optimizer


def _recurrent(name: str, batch: int = 256, sequence: int = 32, units: int = 512) -> Built:
    """A stacked GRU language model or a bidirectional LSTM tagger.

    Sized so that each time step's tensors are 256 KiB or more: oneDNN's
    CPU allocator statistics leave smaller allocations out, and a loop's
    per-step accumulators at batch 64 with 256 units (64 KiB each) measured
    nothing of what the backward keeps (storing everything: predicted 50.7
    MiB, traced 15.4 requested; at this size 319.5 against 298.0).
    """
    import keras
    import numpy as np

    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 1000, (batch, sequence)).astype("int32")
    inputs = keras.Input((sequence,), dtype="int32")
    x = keras.layers.Embedding(1000, 128)(inputs)
    if name == "gru_lm":
        for _ in range(2):
            x = keras.layers.GRU(units, return_sequences=True)(x)
        model = keras.Model(inputs, keras.layers.Dense(1000)(x))
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        return model, tokens, rng.integers(0, 1000, (batch, sequence)), loss, "adam"
    for _ in range(2):
        x = keras.layers.Bidirectional(keras.layers.LSTM(units // 2, return_sequences=True))(x)
    model = keras.Model(inputs, keras.layers.Dense(10)(x))
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return model, tokens, rng.integers(0, 10, (batch, sequence)), loss, "sgd"


def _python_loop_rnn(batch: int = 256, steps: int = 16, units: int = 256) -> Built:
    """A subclassed model stepping a Dense cell over time in a Python loop."""
    import keras
    import numpy as np

    class LoopRNN(keras.Model):
        def __init__(self) -> None:
            super().__init__()
            self.read = keras.layers.Dense(units)
            self.cell = keras.layers.Dense(units, activation="tanh")
            self.head = keras.layers.Dense(10)

        def call(self, x: Any) -> Any:
            state = keras.ops.zeros((keras.ops.shape(x)[0], units))
            for t in range(steps):
                state = self.cell(keras.ops.concatenate([self.read(x[:, t]), state], axis=-1))
            return self.head(state)

    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, steps, 64)).astype("float32")
    model = LoopRNN()
    model(x[:1])
    return model, x, rng.normal(size=(batch, 10)).astype("float32"), "mse", "adam"


def _unet(batch: int = 8, size: int = 64, base: int = 16) -> Built:
    import keras
    import numpy as np

    def block(x: Any, filters: int) -> Any:
        for _ in range(2):
            x = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False)(x)
            x = keras.layers.ReLU()(keras.layers.BatchNormalization()(x))
        return x

    inputs = keras.Input((size, size, 3))
    skips, x = [], inputs
    for level in range(3):
        x = block(x, base * 2**level)
        skips.append(x)
        x = keras.layers.MaxPooling2D()(x)
    x = block(x, base * 8)
    for level in reversed(range(3)):
        x = keras.layers.Conv2DTranspose(base * 2**level, 2, strides=2)(x)
        x = block(keras.layers.Concatenate()([x, skips[level]]), base * 2**level)
    model = keras.Model(inputs, keras.layers.Conv2D(2, 1)(x))
    rng = np.random.default_rng(0)
    x = rng.random((batch, size, size, 3), dtype=np.float32)
    return model, x, rng.random((batch, size, size, 2), dtype=np.float32), "mse", "adam"


def _jit_cnn(batch: int = 32, size: int = 64) -> Built:
    """Compiled with `jit_compile=True` (see `measure`)."""
    import keras
    import numpy as np

    layers: list[Any] = [keras.Input((size, size, 3))]
    for filters in (32, 64, 128):
        layers += [
            keras.layers.Conv2D(filters, 3, padding="same", activation="relu"),
            keras.layers.Conv2D(filters, 3, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(),
        ]
    layers += [keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(10)]
    x = np.random.default_rng(0).random((batch, size, size, 3), dtype=np.float32)
    return keras.Sequential(layers), x, np.zeros((batch, 10), "float32"), "mse", "sgd"


MODELS: dict[str, Callable[[], Built]] = {
    **{name: (lambda name=name: _hub(name)) for name in ("gpt_neox", "mistral", "opt", "electra")},
    **{
        name: (lambda name=name: _application(name))
        for name in ("xception", "vgg16", "densenet121", "inception_v3")
    },
    "gru_lm": lambda: _recurrent("gru_lm"),
    "bilstm_tagger": lambda: _recurrent("bilstm_tagger"),
    "python_loop_rnn": _python_loop_rnn,
    "unet": _unet,
    "jit_cnn": _jit_cnn,
}
SMOKE = {"gru_lm": lambda: _recurrent("gru_lm", batch=16, sequence=8, units=256)}


def _compiled(name: str, smoke: bool) -> tuple[Any, Any, Any, str]:
    """Model `name` built from seed 0 and compiled (XLA for the jit CNN): the model, its
    batch and its optimizer's name."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras

    keras.utils.set_random_seed(0)
    model, x, y, loss, optimizer = (SMOKE if smoke else MODELS)[name]()
    model.compile(optimizer=optimizer, loss=loss, jit_compile=name == "jit_cnn")
    return model, x, y, optimizer


def measure(name: str, plan_name: str, memory: str, smoke: bool) -> dict[str, Any]:
    """One model under one plan, its memory predicted as `memory` says: predicted and
    measured peaks (run in a worker process)."""
    import tfrecompute
    from tfrecompute import strategies

    model, x, y, optimizer = _compiled(name, smoke)
    start = time.process_time()
    plan, chain, budget = _planned(model, x, y, plan_name, memory == "calibrated")
    planning = time.process_time() - start  # listing the frontier below is not planning
    stored = strategies.none(chain).peak_bytes
    frontier = strategies.frontier(plan.chain) if budget else []  # the plans it chose among
    chosen = plan
    if plan_name == "next-up":
        higher = [p for p in frontier if p.peak_bytes > plan.peak_bytes]
        if not higher:
            raise RuntimeError(f"{name}: the budget's plan is the frontier's highest")
        plan = min(higher, key=lambda p: p.peak_bytes)
    start = time.process_time()
    tfrecompute.recompute(model, plan)
    planning += time.process_time() - start
    replayed = plan.replayed_peak_bytes
    above = [p.peak_bytes for p in frontier if p.peak_bytes > plan.peak_bytes]
    step = tfrecompute.measure_step(model, x, y)
    traced = [tfrecompute.trace_step(model, x, y, warmup=1) for _ in range(TRACES)]
    requested = max(t.requested_peak_bytes for t in traced)
    return {
        "model": name,
        "plan": plan_name,
        "memory": memory,
        "optimizer": optimizer,
        "links": chain.n,
        "segments": len(plan.segments),
        "predicted_bytes": plan.peak_bytes,
        "stored_predicted_bytes": stored,
        "measured_bytes": step.peak_bytes,
        "requested_bytes": requested,
        "error": plan.peak_bytes / max(step.peak_bytes, 1) - 1,
        "requested_error": plan.peak_bytes / max(requested, 1) - 1,
        "replayed_bytes": replayed,
        "replayed_error": None if replayed is None else replayed / max(step.peak_bytes, 1) - 1,
        "budget_bytes": budget,
        "next_predicted_bytes": min(above, default=None),
        "chosen_predicted_bytes": chosen.peak_bytes,
        "planning_cpu_seconds": planning,
    }


def _planned(model: Any, x: Any, y: Any, plan_name: str, calibrate: bool) -> tuple[Any, ...]:
    """Plan `plan_name` of `model`, its chain and its budget (the optimal plan's: halfway
    between the least peak and storing everything, plannable with the default headroom;
    None for the others)."""
    import tfrecompute
    from tfrecompute import strategies

    chain = tfrecompute.plan(model, "none", sample=(x, y), calibrate=calibrate).chain
    budget = None
    if plan_name.startswith("optimal") or plan_name == "next-up":
        halfway = (strategies.min_peak(chain) + strategies.none(chain).peak_bytes) // 2
        headroom = strategies.CALIBRATED_HEADROOM if calibrate else strategies.DEFAULT_HEADROOM
        # Exact: `plan_within` plans floor(budget * (1 - Fraction(headroom))) >= halfway.
        budget = math.ceil(halfway / (1 - Fraction(headroom)))
    strategy = {"none": "none", "default": None, "sqrt": "sqrt"}.get(plan_name, "optimal")
    policy = "nothing" if plan_name == "optimal" else None  # the budget's default otherwise
    # next-up: the budget's default plan, whose next plan up `measure` applies
    plan = tfrecompute.plan(
        model, strategy, budget=budget, sample=(x, y), calibrate=calibrate, policy=policy
    )
    return plan, chain, budget


def measure_spread(name: str, plan_name: str, smoke: bool) -> dict[str, Any]:
    """One model under one plan in a worker process (`--spread`): storing everything with
    its traced prediction, or another plan planned with `calibrate=True`, with its
    calibrated prediction and its replayed peak; and one measured step."""
    import tfrecompute

    model, x, y, _ = _compiled(name, smoke)
    plan, _, budget = _planned(model, x, y, plan_name, plan_name != "none")
    tfrecompute.recompute(model, plan)
    step = tfrecompute.measure_step(model, x, y)
    return {
        "model": name,
        "plan": plan_name,
        "segments": len(plan.segments),
        "predicted_bytes": plan.peak_bytes,
        "replayed_bytes": plan.replayed_peak_bytes,
        "measured_bytes": step.peak_bytes,
        "budget_bytes": budget,
    }


def _spread_lines(spread: Sequence[dict[str, Any]]) -> list[str]:
    """The spread section: per model and plan, measured in several processes."""
    if not spread:
        return []
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in spread:
        groups.setdefault((row["model"], row.get("plan", "none")), []).append(row)
    lines = [
        "",
        "## The measured peak's own spread",
        "",
        "Each model in several fresh processes (`--spread`), one `measure_step` each (the "
        "largest of three steps, as *measured* above): storing everything with its traced "
        "prediction, and the other plans planned with `calibrate=True` in each process (a "
        "plan can differ between processes) with their calibrated prediction and replayed "
        "peak (the optimal plan under its budget as above). Spread = largest / smallest - 1; "
        "errors are of the predictions' median against the measured median.",
        "",
        *_spread_summary(groups),
        "| model | plan | processes | measured MiB (least, median, most) | spread "
        "| predicted MiB | error vs median | replayed MiB | error vs median "
        "| median / budget |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for model, plan in sorted(groups, key=_spread_order):
        rows = groups[(model, plan)]
        peaks = sorted(r["measured_bytes"] for r in rows)
        median = statistics.median(peaks)
        predicted, replayed = _medians(rows)
        replay = (
            "- | -"
            if replayed is None
            else f"{replayed / MiB:.1f} | {replayed / max(median, 1) - 1:+.0%}"
        )
        budget = rows[0].get("budget_bytes")
        used = f"{median / budget:.0%}" if budget else "-"
        lines.append(
            f"| {model} | {plan} | {len(peaks)} | {peaks[0] / MiB:.1f}, {median / MiB:.1f}, "
            f"{peaks[-1] / MiB:.1f} | {peaks[-1] / max(peaks[0], 1) - 1:.0%} | "
            f"{predicted / MiB:.1f} | {predicted / max(median, 1) - 1:+.0%} | {replay} | "
            f"{used} |"
        )
    return lines + _default_against_sqrt(groups)


def _default_against_sqrt(groups: dict[tuple[str, str], list[dict[str, Any]]]) -> list[str]:
    """Per model measured in several processes under both, the default plan's median peak
    against `sqrt`'s, beside the larger of the two plans' spreads."""
    lines = []
    for model in MODELS:
        if (model, "default") not in groups or (model, "sqrt") not in groups:
            continue
        peaks = {
            plan: sorted(r["measured_bytes"] for r in groups[(model, plan)])
            for plan in ("default", "sqrt")
        }
        above = statistics.median(peaks["default"]) / statistics.median(peaks["sqrt"]) - 1
        spread = max(p[-1] / max(p[0], 1) - 1 for p in peaks.values())
        lines.append(
            f"| {model} | {above:+.0%} | {spread:.0%} | {'yes' if above > spread else 'no'} |"
        )
    if not lines:
        return []
    return [
        "",
        "The default plan's median against `sqrt`'s, beside the larger of their spreads:",
        "",
        "| model | default / sqrt - 1 | spread | above by more than the spread |",
        "|---|---:|---:|---|",
        *lines,
    ]


def _medians(rows: Sequence[dict[str, Any]]) -> tuple[float, float | None]:
    """The median predicted and replayed peaks of a model's plan over its processes."""
    predicted = statistics.median(r["predicted_bytes"] for r in rows)
    replays = [r["replayed_bytes"] for r in rows if r.get("replayed_bytes") is not None]
    return predicted, statistics.median(replays) if replays else None


def _spread_summary(groups: dict[tuple[str, str], list[dict[str, Any]]]) -> list[str]:
    """How close the calibrated plans' median predictions come to their measured median."""
    errors: dict[str, list[float]] = {"calibrated": [], "replayed": [], "reconciled": []}
    for (_, plan), rows in groups.items():
        if plan == "none":
            continue
        median = statistics.median(r["measured_bytes"] for r in rows)
        predicted, replayed = _medians(rows)
        errors["calibrated"].append(predicted / max(median, 1) - 1)
        if replayed is not None:
            errors["replayed"].append(replayed / max(median, 1) - 1)
            reconciled = statistics.median(
                reconciled_peak(r["predicted_bytes"], r["replayed_bytes"])
                for r in rows
                if r.get("replayed_bytes") is not None
            )
            errors["reconciled"].append(reconciled / max(median, 1) - 1)
    lines = [
        _accuracy(f"{kind} (median over processes, against the measured median)", "", found)
        for kind, found in errors.items()
        if found
    ]
    return [*lines, ""] if lines else []


def _accuracy(label: str, against: str, errors: Sequence[float]) -> str:
    """A summary line: how many of `errors` are within 10% and 25%, and the largest."""
    sizes = [abs(e) for e in errors]
    return (
        f"- {label}: within 10%{against} {sum(e <= 0.10 for e in sizes)} of {len(sizes)} "
        f"plans; within 25% {sum(e <= 0.25 for e in sizes)}; the largest error "
        f"{max(sizes, default=0):.0%}."
    )


def _added_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The summary of the `optimal+policies` rows, apart: measured after the lines above
    were, the margin of reconciling chosen on those."""
    lines = []
    for memory in MEMORY:
        errors = [r["error"] for r in rows if r.get("memory", "traced") == memory]
        if errors:
            label = f"optimal+policies ({memory}; a budget's default on the attention models)"
            lines.append(_accuracy(label, " of the allocator", errors))
    return lines


def _accuracy_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The table's summary: each way of predicting against the allocator's peak."""
    allocator = " of the allocator"
    by_memory = {m: [r["error"] for r in rows if r.get("memory", "traced") == m] for m in MEMORY}
    lines = [_accuracy(memory, allocator, errors) for memory, errors in by_memory.items()]
    replayed = [r for r in rows if r.get("replayed_bytes") is not None]
    if replayed:
        lines.append(
            _accuracy(
                "replayed (a calibrated plan's step replayed through the allocator, "
                "`Plan.replayed_peak_bytes`)",
                allocator,
                [r["replayed_error"] for r in replayed],
            )
        )
        lines.append(
            _accuracy(
                "reconciled (`Plan.reconciled_peak_bytes`: the calibrated prediction kept "
                f"between the replay and {REPLAY_MARGIN:.0%} above it, computed from the two "
                "columns; the margin was chosen on these runs)",
                allocator,
                [_reconciled_error(r) for r in replayed],
            )
        )
    return lines


def _spread_order(key: tuple[str, str]) -> tuple[int, int]:
    model, plan = key
    return (list(MODELS).index(model) if model in MODELS else -1, PLANS.index(plan))


def _markdown(
    rows: list[dict[str, Any]],
    runs: list[dict[str, Any]],
    failed: list[dict[str, Any]],
    spread: Sequence[dict[str, Any]] = (),
) -> str:
    """The Markdown report of every row, run, failure and spread measurement."""
    lines = [
        "# Predictions on held-out models",
        "",
        f"Runs: {'; '.join(_run_line(run) for run in runs)}.",
        "",
        "Each model and plan measured in a fresh process (seed 0), planned twice: *traced* "
        "predicts memory from the traced calls only, *calibrated* with `calibrate=True` (one "
        "measured training step storing everything reconciles the memory model first; the plan "
        "can differ). *measured*: the allocator's peak of a compiled training step "
        "(`measure_step`); *requested*: the largest requested peak of "
        f"{TRACES} traced steps (`trace_step`). Error = predicted / measured - 1. The optimal "
        "plans' budget is halfway between the least peak and storing everything (as each "
        "memory model predicts them), over `1 - headroom` (the default headroom: 0.3 traced, "
        '0.1 calibrated). *optimal* plans whole segments (`policy="nothing"`); '
        "*optimal+policies*, the same budget's default on the models holding attention layers, "
        "also weighs recomputing only the attention cores or all but the weight products. The "
        "summary lines before the table leave *optimal+policies* and *next-up* (the plan "
        "above the budget's default, below) out, measured later and apart.",
        "",
    ]
    lines += _accuracy_lines([r for r in rows if r["plan"] not in APART])
    lines += _added_lines([r for r in rows if r["plan"] == "optimal+policies"])
    lines += [
        "",
        "| model | optimizer | links | plan | memory | segments | predicted MiB | measured MiB "
        "| error | requested MiB | error vs requested | replayed MiB | error of replayed "
        "| error of reconciled | measured / budget | planning CPU s |",
        "|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(_row(r))
    lines += ["", *_above_storing_everything(rows), *_budget_lines(rows), *_next_up_lines(rows)]
    lines += _spread_lines(spread)
    if failed:
        lines += [
            "",
            "## Not measured",
            "",
            "| model | plan | memory | error (its last line) |",
            "|---|---|---|---|",
        ]
        for f in failed:
            text = f["error"].strip()
            last = text.splitlines()[-1] if text else ""
            lines.append(
                f"| {f['model']} | {f['plan']} | {f.get('memory', 'traced')} | {last[:300]} |"
            )
    return "\n".join(lines) + "\n"


def _row(r: dict[str, Any]) -> str:
    """One plan's line of the table."""
    budget = f"{r['measured_bytes'] / r['budget_bytes']:.0%}" if r["budget_bytes"] else "-"
    replayed = r.get("replayed_bytes")
    replay = (
        "- | - | -"
        if replayed is None
        else f"{replayed / MiB:.1f} | {r['replayed_error']:+.0%} | {_reconciled_error(r):+.0%}"
    )
    return (
        f"| {r['model']} | {r['optimizer']} | {r['links']} | {r['plan']} | "
        f"{r.get('memory', 'traced')} | {r['segments']} | {r['predicted_bytes'] / MiB:.1f} | "
        f"{r['measured_bytes'] / MiB:.1f} | {r['error']:+.0%} | "
        f"{r['requested_bytes'] / MiB:.1f} | {r['requested_error']:+.0%} | {replay} | {budget} | "
        f"{r['planning_cpu_seconds']:.1f} |"
    )


def _reconciled_error(r: dict[str, Any]) -> float:
    """A replayed row's reconciled prediction against its measured peak, minus one."""
    reconciled = reconciled_peak(r["predicted_bytes"], r["replayed_bytes"])
    return reconciled / max(r["measured_bytes"], 1) - 1


def _budget_lines(rows: list[dict[str, Any]]) -> list[str]:
    """How much of its budget each optimal plan used, and for the calibrated ones under 85%,
    where the next plan of the chain's frontier (the cheapest with a higher predicted peak)
    stood."""
    lines = ["", "## Budgets", ""]
    for plan, memory in [(p, m) for p in ("optimal", "optimal+policies") for m in MEMORY]:
        budgeted = [
            r
            for r in rows
            if r["budget_bytes"]
            and r.get("plan", "optimal") == plan
            and r.get("memory", "traced") == memory
        ]
        if not budgeted:
            continue
        used = sorted(r["measured_bytes"] / r["budget_bytes"] for r in budgeted)
        lines.append(
            f"- {memory}: the {plan} plans measured {used[0]:.0%} to {used[-1]:.0%} of their "
            f"budget; {sum(u > 1.05 for u in used)} over it by more than 5%, "
            f"{sum(u < 0.85 for u in used)} under 85% of it."
        )
        for r in budgeted if memory == "calibrated" else ():  # traced: 30% headroom
            if r["measured_bytes"] < 0.85 * r["budget_bytes"] and "next_predicted_bytes" in r:
                following = r["next_predicted_bytes"]
                where = (
                    "no plan with a higher predicted peak"
                    if following is None
                    else f"the next plan up predicted at {following / r['budget_bytes']:.0%}"
                )
                lines.append(
                    f"  - {r['model']}: {r['measured_bytes'] / r['budget_bytes']:.0%} of the "
                    f"budget, predicted {r['predicted_bytes'] / r['budget_bytes']:.0%}; {where}"
                )
    return lines if len(lines) > 3 else []


def _next_up_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Per model with a `next-up` row: the budget's calibrated default plan and the next
    plan up, each measured against the budget, and whether either used 85% to 105% of it."""
    calibrated = [r for r in rows if r.get("memory", "traced") == "calibrated"]
    default = {r["model"]: r for r in calibrated if r["plan"] == _budget_default(r["model"])}
    lines = []
    for r in (r for r in calibrated if r["plan"] == "next-up"):
        first = default.get(r["model"])
        if first is None:
            continue
        plan = first["plan"]
        used = [p["measured_bytes"] / p["budget_bytes"] for p in (first, r)]  # own budgets
        named = zip(("the plan chosen", "the next plan up"), used)
        within = [n for n, u in named if 0.85 <= u <= 1.05]
        there = r["chosen_predicted_bytes"] / r["budget_bytes"]
        lines.append(
            f"| {r['model']} | {plan} | "
            f"{first['predicted_bytes'] / first['budget_bytes']:.0%} | {used[0]:.0%} | "
            f"{there:.0%} | {r['predicted_bytes'] / r['budget_bytes']:.0%} | {used[1]:.0%} | "
            f"{', '.join(within) or 'neither'} |"
        )
    if not lines:
        return []
    return [
        "",
        "## The next plan up",
        "",
        "The budget's default plan (calibrated; policies on the attention models) and the "
        "plan of its chain's frontier just above it (the least-cost plan with a higher "
        "predicted peak, ruled out by the 10% headroom), each planned and measured in a fresh "
        "process against the budget set there as above (each process calibrates on its own "
        "step, so budgets and plans can differ a little: *chosen there* is the plan the "
        "next-up process chose, whose next plan up it measured): which of the two used 85% "
        "to 105% of it. The next-up rows' planning time leaves out listing the frontier.",
        "",
        "| model | chosen | chosen predicted / budget | chosen measured / budget "
        "| chosen there, predicted / budget | next up predicted / budget "
        "| next up measured / budget | 85% to 105% |",
        "|---|---|---:|---:|---:|---:|---:|---|",
        *lines,
    ]


def _budget_default(model: str) -> str:
    """The plan a budget makes by default on `model`: with policy states on the attention
    models."""
    return "optimal+policies" if model in ATTENTION_MODELS else "optimal"


def _above_storing_everything(rows: list[dict[str, Any]]) -> list[str]:
    """Per memory model, the default plans that measured above storing everything."""
    lines = []
    for memory in MEMORY:
        mine = [r for r in rows if r.get("memory", "traced") == memory]
        stored = {r["model"]: r["measured_bytes"] for r in mine if r["plan"] == "none"}
        over = [
            r["model"]
            for r in mine
            if r["plan"] == "default"
            and r["segments"]
            and r["measured_bytes"] > stored.get(r["model"], float("inf"))
        ]
        lines.append(
            f"Default plans ({memory}) that recompute something and measured above storing "
            f"everything: {', '.join(over) or 'none'}."
        )
    return lines


def _run_line(run: dict[str, Any]) -> str:
    what = {"plans": "", "spread": " (spread)"}.get(run.get("what", "plans"))
    what = f" ({run['what']} plan)" if what is None else what
    if run.get("plans"):
        what += f" ({', '.join(run['plans'])} only)"
    cpu = f", {run['cpu']}" if run.get("cpu") else ""
    return (
        f"{run['started']}{what} ({run['minutes']:.0f} min, load average before "
        f"{run['load_before']}, tfrecompute {run['commit']}{cpu}): {', '.join(run['models'])}"
    )


def _cpu() -> str:
    """Which vector instructions this CPU has, as oneDNN chooses kernels by them."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    return "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), help="default: all")
    parser.add_argument("--smoke", action="store_true", help="one small model, two plans")
    parser.add_argument(
        "--plans",
        nargs="+",
        choices=PLANS,
        help="measure only these plans (default: all but next-up)",
    )
    parser.add_argument("--out", type=Path, help="the folder to write to")
    parser.add_argument(
        "--spread", type=int, metavar="K", help="store everything in K processes per model"
    )
    parser.add_argument(
        "--worker", nargs=3, metavar=("MODEL", "PLAN", "MEMORY"), help=argparse.SUPPRESS
    )
    parser.add_argument(
        "--spread-plan",
        choices=[p for p in PLANS if p != "next-up"],
        default="none",
        help="with --spread: the plan measured (default: storing everything, traced; the "
        "others calibrated)",
    )
    parser.add_argument(
        "--spread-worker", nargs=2, metavar=("MODEL", "PLAN"), help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(measure(*args.worker, args.smoke)))
        return {}
    if args.spread_worker:
        print(json.dumps(measure_spread(*args.spread_worker, args.smoke)))
        return {}
    if args.spread is not None and args.spread < 2:
        parser.error(f"--spread: at least 2 processes. Received: --spread {args.spread}")
    names = list(SMOKE) if args.smoke else (args.models or list(MODELS))
    out = _report.output_dir(args.out, smoke=args.smoke, name=NAME)
    started, load = time.strftime("%Y-%m-%d %H:%M"), os.getloadavg()
    begin = time.perf_counter()
    spread = args.spread_plan if args.spread is not None else None
    previous = _previous(out / f"{NAME}.json", names, spread=spread, plans=args.plans)
    new: dict[str, list[dict[str, Any]]] = {"rows": [], "failed": [], "spread": []}
    report: dict[str, Any] = {}
    for index, name in enumerate(names):
        _measure_model(name, args, new)
        run = _run(started, begin, load, names[: index + 1], spread, args.plans)
        report = {  # written after each model, so that a stopped run keeps what it measured
            "machine": _report.machine(),
            "versions": _report.versions("tensorflow", "keras", "keras-hub"),
            "runs": previous["runs"] + [run],
            "rows": sorted(previous["rows"] + new["rows"], key=_order),
            "failed": previous["failed"] + new["failed"],
            "spread": previous["spread"] + new["spread"],
        }
        table = _markdown(report["rows"], report["runs"], report["failed"], report["spread"])
        _report.write(out, NAME, report, table)
    return report


def _run(
    started: str,
    begin: float,
    load: Sequence[float],
    models: Sequence[str],
    spread: str | None,
    plans: Sequence[str] | None,
) -> dict[str, Any]:
    """What a run records of itself beside its rows."""
    return {
        "started": started,
        "minutes": (time.perf_counter() - begin) / 60,
        "load_before": ", ".join(f"{value:.2f}" for value in load),
        "commit": _commit(),
        "models": list(models),
        "what": _what(spread),
        "plans": plans,
        "cpu": _cpu(),
    }


def _measure_model(name: str, args: Any, new: dict[str, list[dict[str, Any]]]) -> None:
    """Runs one model's workers: its plans, or with `--spread` its processes storing
    everything; adds their results (or failures) to `new`."""
    script, extra = Path(__file__).resolve(), ["--smoke"] if args.smoke else []
    if args.spread:
        for _ in range(args.spread):
            worker = ["--spread-worker", name, args.spread_plan, *extra]
            new["spread"].append(_report.run_worker(script, worker, timeout=1800))
        return
    for plan in SMOKE_PLANS if args.smoke else (args.plans or DEFAULT_PLANS):
        if plan == "optimal+policies" and name not in ATTENTION_MODELS:
            continue
        for memory in ("calibrated",) if plan == "next-up" else MEMORY:
            worker = ["--worker", name, plan, memory, *extra]
            try:
                new["rows"].append(_report.run_worker(script, worker, timeout=1800))
            except RuntimeError as error:  # recorded; the other models still run
                new["failed"].append(
                    {"model": name, "plan": plan, "memory": memory, "error": str(error)[-1500:]}
                )


def _order(row: dict[str, Any]) -> tuple[int, int, int]:
    order = list(MODELS)
    model = order.index(row["model"]) if row["model"] in order else -1
    return model, PLANS.index(row["plan"]), MEMORY.index(row.get("memory", "traced"))


def _previous(
    path: Path, names: Sequence[str], *, spread: str | None, plans: Sequence[str] | None = None
) -> dict[str, Any]:
    """The rows, runs, failures and spread of an earlier report, less what is run again
    (the plans of `names`, only `plans` of them if given, or with `spread`, a plan's name,
    their spread of that plan)."""
    if not path.exists():
        return {"rows": [], "runs": [], "failed": [], "spread": []}
    old = json.loads(path.read_text())
    kind = _what(spread)

    def kept(row: dict[str, Any]) -> bool:
        return bool(spread) or row["model"] not in names or bool(plans and row["plan"] not in plans)

    return {
        "rows": [r for r in old["rows"] if kept(r)],
        "runs": [
            run
            for run in old["runs"]
            if run.get("what", "plans") != kind
            or set(run["models"]) - set(names)
            or set(run.get("plans") or PLANS) - set(plans or PLANS)
        ],
        "failed": [f for f in old.get("failed", []) if kept(f)],
        "spread": [
            r
            for r in old.get("spread", [])
            if r.get("plan", "none") != spread or r["model"] not in names
        ],
    }


def _what(spread: str | None) -> str:
    """What a run measured: "plans", "spread" (storing everything) or "spread <plan>"."""
    if spread is None:
        return "plans"
    return "spread" if spread == "none" else f"spread {spread}"


def _commit() -> str:
    import subprocess

    done = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    )
    return done.stdout.strip() or "unknown"


if __name__ == "__main__":
    main()
