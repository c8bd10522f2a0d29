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
from tests.helpers import assert_same_training, highest_requested_trace
from tfrecompute import RecomputeBlock

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
# by benchmarks/prediction_accuracy.py in a fresh process per model (seen over
# three runs of none / sqrt / optimal on the four models: -5% to +13%).
REQUESTED_TOLERANCE = 0.15
# One known gap: a block releases its weight gradients only once its whole
# backward is computed (NOTE [ Variable gradients wait for the whole backward ]
# in tfrecompute/layers/recompute.py), so a recomputed segment holds them
# through its backward; the memory model does not count that yet. Segments
# with large weights are under-predicted: ResNet50 sqrt (conv5's 9 MiB
# kernels) at -16% to -24%.
REQUESTED_GAPS = {("resnet50", "sqrt"): 0.3}
# Against the allocator's peak (`measure_step`), which adds TensorFlow's
# rounding of chunks (NOTE [ Requested and allocated bytes ] in
# tfrecompute/tracing.py: up to +53% over the requested peak in traced
# steps, varying from step to step), the bounds are wider: errors seen over
# runs were encoder -9% to +8%, MobileNetV2 -24% to -2%, ResNet50 -27% to -8%
# (sqrt aside), U-Net -31% to +6%.
TOLERANCE = {"encoder": 0.2, "mobilenet_v2": 0.4, "resnet50": 0.4, "unet": 0.4}
# The gap of REQUESTED_GAPS, with the allocator's rounding on top: -30% to -36%
# in the stored runs.
GAPS = {("resnet50", "sqrt"): 0.5}


def _batch(model, batch=BATCH):
    return models_zoo.synthetic_batch(model, batch)


@pytest.fixture(scope="module", params=sorted(MODELS))
def real(request):
    keras.utils.set_random_seed(0)
    model = MODELS[request.param]()
    return request.param, model


def test_gradients_match_the_original(real):
    name, model = real
    rewritten = tfrecompute.recompute(model, "sqrt", batch_size=BATCH)
    assert len([layer for layer in rewritten.layers if isinstance(layer, RecomputeBlock)]) >= 3
    x, _ = _batch(model, batch=4)

    def run(m):
        return lambda x, training=None: m(x, training=training)

    assert_same_training(
        run(rewritten),
        run(model),
        [x],
        model.trainable_variables,
        model.non_trainable_variables,
        "function",
        atol=1e-4,
    )


def test_sqrt_rewrite_fits_in_less_memory(real):
    name, model = real
    x, y = _batch(model)
    rewritten = tfrecompute.recompute(model, "sqrt", batch_size=BATCH)
    model.compile(optimizer="sgd", loss="mse")
    rewritten.compile(optimizer="sgd", loss="mse")
    rewritten.fit(x, y, batch_size=BATCH // 2, epochs=1, verbose=0)
    # Requested peaks, since the allocator's rounding moves a CNN's measured
    # peak by up to about a third from step to step (U-Net: sqrt at 0.64x to
    # 0.92x of storing everything over three runs, requested 0.67x each time).
    plain = highest_requested_trace(model, x, y)
    blocked = highest_requested_trace(rewritten, x, y)
    assert blocked.requested_peak_bytes <= 0.75 * plain.requested_peak_bytes, (
        name,
        blocked.summary(),
        plain.summary(),
    )
    assert blocked.peak_bytes < plain.peak_bytes, (name, blocked.summary(), plain.summary())


def test_generous_budget_recomputes_nothing(real):
    name, model = real
    chain = tfrecompute.profile(model, batch_size=BATCH)
    none_peak = tfrecompute.strategies.simulate(chain, []).peak_bytes
    plan = tfrecompute.plan(model, "optimal", budget=none_peak, batch_size=BATCH)
    assert plan.segments == ()
    rewritten = tfrecompute.recompute(model, "optimal", budget=2 * none_peak, batch_size=BATCH)
    assert not [layer for layer in rewritten.layers if isinstance(layer, RecomputeBlock)]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_predicted_peak_against_measured(name):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))
    import prediction_accuracy

    # The requested peak is the largest of 5 traced steps per plan: the order of
    # the inter-op threads moves it (MobileNetV2 sqrt: 74 to 86 MiB).
    result = prediction_accuracy.run_in_subprocess(name, BATCH, traces=5)
    requested = {row["strategy"]: row["requested_error"] for row in result["rows"]}
    bounds = {s: REQUESTED_GAPS.get((name, s), REQUESTED_TOLERANCE) for s in requested}
    assert all(abs(e) <= bounds[s] for s, e in requested.items()), (name, requested)
    errors = {row["strategy"]: row["error"] for row in result["rows"]}
    bounds = {s: GAPS.get((name, s), TOLERANCE[name]) for s in errors}
    assert all(abs(e) <= bounds[s] for s, e in errors.items()), (name, errors)
    optimal = next(row for row in result["rows"] if row["strategy"] == "optimal")
    assert optimal["predicted_bytes"] <= optimal["budget_bytes"]
