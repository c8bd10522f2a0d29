"""recompute() on real architectures: ResNet50, MobileNetV2, a Transformer encoder, a U-Net.

Each model is small enough for CPU tests (64x64 images, a 4-layer encoder),
yet large enough for TensorFlow's allocator statistics (which skip
allocations under 256 KiB) to see its activations.
"""

from __future__ import annotations

import pathlib
import sys

import keras
import pytest

import tfrecompute
from tests import models_zoo
from tests.helpers import (
    applied_blocks,
    as_defined,
    assert_same_training,
    median_requested_peak,
)
from tfrecompute import strategies

pytestmark = pytest.mark.slow

BATCH = 32

MODELS = {
    "resnet50": lambda: models_zoo.resnet50(64),
    "mobilenet_v2": lambda: models_zoo.mobilenet_v2(64),
    "encoder": lambda: models_zoo.transformer_encoder(layers=4, sequence=64, hidden=128),
    "unet": lambda: models_zoo.unet(size=64, base=16),
}

# The planner's memory model predicts the bytes the live tensors request; the
# target is 15% of the requested peak of traced steps (`trace_step`), measured
# by benchmarks/prediction_accuracy.py in a fresh process per model (each
# run's errors are in benchmarks/results/prediction_accuracy.md).
REQUESTED_TOLERANCE = 0.15
# Against the allocator's peak (`measure_step`), which adds TensorFlow's
# rounding of chunks (NOTE [ Requested and allocated bytes ] in
# tfrecompute/check/measure.py), different from step to step, the bounds are
# wider (the same table has the rounding and these errors over runs). The
# encoder's sqrt plan measured -7% to -21% against the allocator over five runs
# while staying at -3% against the requested peak: at its peak a 4 MiB request
# is handed a 6.25 MiB chunk in some runs and not in others.
TOLERANCE = {"encoder": 0.25, "unet": 0.4}
# U-Net's sqrt plan requests one of a few peaks by the order the inter-op
# threads run in, the largest about one step in four (a one-off count over 20
# traced steps, in the closing note of the change that set this): the largest
# of 5 traces missed it about one run in four; of 16, about one in a hundred.
TRACES = {"unet": 16}
# Under the load of a second test worker the largest order can be missed by all
# 16, so U-Net's bound against the requested peak is the gap to the next order.
REQUESTED_TOLERANCES = {"unet": 0.20}
# The sqrt rewrite's requested median against storing everything's; U-Net's orders
# (below) leave less room.
SQRT_RATIO, SQRT_RATIOS = 0.75, {"unet": 0.85}
# Memory is measured on three of the four: ResNet50's steps are the longest to
# trace, and benchmarks/prediction_accuracy.py measures all four (its results file).
MEASURED = sorted(set(MODELS) - {"resnet50"})
# The predicted peak against the allocator's, with the optimal and verified plans under
# a budget, on two of them: the encoder and U-Net, whose orders of ops move their peaks
# (suite time; MobileNetV2's predictions are in the same benchmark's results file).
PREDICTED = ["encoder", "unet"]


def _batch(model, batch=BATCH):
    return models_zoo.synthetic_batch(model, batch)


@pytest.fixture(scope="module", params=sorted(MODELS))
def real(request):
    keras.utils.set_random_seed(0)
    model = MODELS[request.param]()
    return request.param, model


def test_gradients_match_the_original(real):
    name, model = real
    tfrecompute.recompute(model, "sqrt", batch_size=BATCH)
    assert len(applied_blocks(model)) >= 3
    x, _ = _batch(model, batch=4)

    def run(m):
        return lambda x, training=None: m(x, training=training)

    assert_same_training(
        run(model),
        run(as_defined(model)),
        [x],
        model.trainable_variables,
        model.non_trainable_variables,
        "function",
        atol=1e-4,
    )


@pytest.mark.parametrize("name", MEASURED)
def test_sqrt_rewrite_fits_in_less_memory(name):
    keras.utils.set_random_seed(0)
    model = MODELS[name]()
    x, y = _batch(model)
    sqrt = tfrecompute.plan(model, "sqrt", batch_size=BATCH)
    model.compile(optimizer="sgd", loss="mse")
    tfrecompute.recompute(model, sqrt)
    model.fit(x, y, batch_size=BATCH // 2, epochs=1, verbose=0)

    def measured(plan, measure):
        tfrecompute.recompute(model, plan)  # the model itself, with and without checkpoints
        return measure(model, x, y)

    # Requested peaks, since the allocator's rounding moves a CNN's measured
    # peak by up to about a third from step to step (U-Net: sqrt at 0.64x to
    # 0.92x of storing everything over three runs), and medians of three
    # traces, since the order ops run in moves even those (U-Net, with other
    # jobs on the machine: 0.58x to 0.80x single traces, 0.67x the medians).
    # U-Net's sqrt step and its storing everything each request one of a few peaks by
    # that order; under a second worker's load the medians can meet at the high sqrt
    # and the low storing-everything orders.
    plain = measured("none", median_requested_peak)
    blocked = measured(sqrt, median_requested_peak)
    assert blocked <= SQRT_RATIOS.get(name, SQRT_RATIO) * plain, (name, blocked, plain)

    def step(model, x, y):
        return tfrecompute.measure_step(model, x, y, steps=3)

    plain_step = measured("none", step)
    blocked_step = measured(sqrt, step)
    assert blocked_step.peak_bytes < plain_step.peak_bytes, (name, blocked_step, plain_step)


def test_generous_budget_recomputes_nothing(real):
    name, model = real
    chain = tfrecompute.profile(model, batch_size=BATCH)
    none_peak = tfrecompute.strategies.simulate(chain, []).peak_bytes
    plan = tfrecompute.plan(model, "optimal", budget=none_peak, batch_size=BATCH, headroom=0)
    assert plan.segments == ()
    # With the default headroom of 0.3, a budget of twice that plans in 1.4x of it.
    tfrecompute.recompute(model, "optimal", budget=2 * none_peak, batch_size=BATCH)
    assert not tfrecompute.checkpoints(model)


@pytest.mark.parametrize("name", PREDICTED)
def test_predicted_peak_against_measured(name):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
    import prediction_accuracy

    # The requested peak is the largest of several traced steps per plan: the
    # order of the inter-op threads moves it (U-Net: see TRACES above).
    result = prediction_accuracy.run_in_subprocess(name, BATCH, traces=TRACES.get(name, 5))
    requested = {row["strategy"]: row["requested_error"] for row in result["rows"]}
    bound = REQUESTED_TOLERANCES.get(name, REQUESTED_TOLERANCE)
    assert all(abs(e) <= bound for e in requested.values()), (name, requested)
    errors = {row["strategy"]: row["error"] for row in result["rows"]}
    assert all(abs(e) <= TOLERANCE[name] for e in errors.values()), (name, errors)
    # The optimal plan is planned in 1 - headroom of its budget, and the step the
    # allocator measures fits the budget (NOTE [ Budget headroom ]).
    optimal = next(row for row in result["rows"] if row["strategy"] == "optimal")
    budget = optimal["budget_bytes"]
    assert optimal["predicted_bytes"] <= (1 - strategies.DEFAULT_HEADROOM) * budget
    assert optimal["measured_bytes"] <= budget, (name, optimal["measured_bytes"], budget)
    # A verified plan under the same budget fits it by measurement, in its own
    # measured steps and measured again after them (NOTE [ Re-planning with the
    # measured correction ] in tfrecompute/check/verified_plan.py).
    verified = next(row for row in result["rows"] if row["strategy"] == "verified")
    assert verified["verified_bytes"] <= budget, (name, verified["probes"], budget)
    assert verified["measured_bytes"] <= budget, (name, verified["measured_bytes"], budget)
