"""calibrate=True: the memory model reconciled with one measured training step."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import tfrecompute
from tfrecompute import strategies
from tfrecompute.strategies.headroom import headroom_of

MiB = 2**20


def _cnn(
    *, jit_compile: bool = False, optimizer: str = "sgd", dropout: float = 0.0, blocks: int = 4
) -> tuple[keras.Model, tuple]:
    """Conv, BatchNormalization and ReLU blocks: every activation 2 MiB (the CPU
    allocator's events leave out buffers under 256 KiB)."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((64, 64, 3))
    h = inputs
    for _ in range(blocks):
        h = keras.layers.Conv2D(16, 3, padding="same", use_bias=False)(h)
        h = keras.layers.BatchNormalization()(h)
        h = keras.layers.ReLU()(h)
        if dropout:
            h = keras.layers.Dropout(dropout, seed=1)(h)
    outputs = keras.layers.Dense(10)(keras.layers.GlobalAveragePooling2D()(h))
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=optimizer, loss="mse", jit_compile=jit_compile)
    rng = np.random.default_rng(0)
    x = rng.random((32, 64, 64, 3), dtype="float32")
    return model, (x, rng.random((32, 10), dtype="float32"))


def test_every_link_is_placed_and_storing_everything_is_predicted_as_measured():
    model, sample = _cnn()
    traced = tfrecompute.plan(model, "sqrt", sample=sample)
    planned = tfrecompute.plan(model, "sqrt", sample=sample, calibrate=True)
    chain, calibration = planned.chain, planned.chain.calibration
    assert traced.chain.calibration is None and calibration is not None
    # Each layer's buffers were found by its name scope: what a link keeps, as measured,
    # is what its traced calls say (the convolutions' outputs and BatchNorm+ReLU's).
    for name, saved, kept in zip(chain.names, traced.chain.saved_bytes, calibration.kept_bytes):
        if saved >= MiB:
            assert kept == pytest.approx(saved, rel=0.05), name
    # BatchNormalization's backward holds more than its traced gradient graph shows:
    # one more buffer the size of its input (8 MiB), but the last's, whose incoming
    # gradient is the pooling's broadcast.
    normalized = [i for i, name in enumerate(chain.names) if name.startswith("batch_norm")]
    activation = traced.chain.output_bytes[0]
    assert all(calibration.workspace_bytes[i] >= 0.99 * activation for i in normalized[:-1])
    assert calibration.workspace_bytes[0] == 0  # a convolution's backward is as traced
    stored = strategies.none(chain).peak_bytes
    assert stored >= calibration.measured_bytes  # by construction: never below the step
    assert calibration.excess_bytes or stored == pytest.approx(calibration.measured_bytes, 1e-3)
    # Calibrating only adds what was measured: every plan is predicted at least as high.
    assert planned.peak_bytes >= strategies.simulate(traced.chain, planned.segments).peak_bytes


def test_each_call_of_a_layer_called_in_a_loop_is_placed_in_its_own_link():
    """One Dense applied four times (as in a loop over time steps): each call's buffers
    belong to that call's link, not all to the first."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((512,))
    shared, h = keras.layers.Dense(512, activation="tanh"), inputs
    for _ in range(4):
        h = shared(h)
    model = keras.Model(inputs, keras.layers.Dense(10)(h))
    model.compile(optimizer="sgd", loss="mse")
    rng = np.random.default_rng(0)
    sample = (rng.random((256, 512), dtype="float32"), rng.random((256, 10), dtype="float32"))
    traced = tfrecompute.plan(model, "none", sample=sample)
    calibration = tfrecompute.plan(model, "none", sample=sample, calibrate=True).chain.calibration
    calls = [i for i, name in enumerate(traced.chain.names) if name.split("#")[0] == shared.name]
    assert len(calls) == 4
    for i in calls:  # each call keeps its output (tanh's gradient reads it): 512 KiB
        assert traced.chain.saved_bytes[i] >= 512 * 1024
        assert calibration.kept_bytes[i] == pytest.approx(traced.chain.saved_bytes[i], rel=0.05)
        assert calibration.raised_bytes[i] == 0


def test_a_step_compiled_by_xla_is_predicted_at_least_at_its_measured_peak():
    """XLA places its buffers itself: the traced calls do not see them, and the step's
    peak moves between runs, so the calibrated chain is held to the peak its own
    measured step took."""
    model, sample = _cnn(jit_compile=True)
    with pytest.warns(UserWarning, match="jit_compile=True"):
        tfrecompute.plan(model, "none", sample=sample)
    calibrated = tfrecompute.plan(model, "none", sample=sample, calibrate=True)
    calibration = calibrated.chain.calibration
    assert calibrated.peak_bytes >= calibration.measured_bytes
    if not calibration.excess_bytes:
        assert calibrated.peak_bytes == pytest.approx(calibration.measured_bytes, rel=1e-3)
    if calibration.rounding > 1:
        assert "more: the allocator's rounding, buffers unseen" in calibrated.summary()
    sqrt = tfrecompute.plan(model, "sqrt", sample=sample, calibrate=True)
    traced = strategies.simulate(calibration.traced, sqrt.segments).peak_bytes
    assert sqrt.peak_bytes >= traced  # calibrating never lowers a prediction


def test_calibrating_leaves_the_model_and_its_training_as_they_were():
    model, sample = _cnn(optimizer="adamw", dropout=0.2)
    control, _ = _cnn(optimizer="adamw", dropout=0.2)
    names = [layer.name for layer in model._flatten_layers()]
    control.set_weights(model.get_weights())
    plan = tfrecompute.plan(model, "sqrt", sample=sample, calibrate=True)
    assert [layer.name for layer in model._flatten_layers()] == names
    assert int(model.optimizer.iterations.numpy()) == 0
    assert not model.optimizer.built or all(
        not np.any(v.numpy()) for v in model.optimizer.variables if "iteration" not in v.path
    )
    for ours, theirs in zip(model.get_weights(), control.get_weights()):
        np.testing.assert_array_equal(ours, theirs)
    tfrecompute.recompute(model, plan)
    ours = model.fit(*sample, batch_size=16, epochs=2, shuffle=False, verbose=0).history["loss"]
    theirs = control.fit(*sample, batch_size=16, epochs=2, shuffle=False, verbose=0)
    np.testing.assert_allclose(ours, theirs.history["loss"], rtol=1e-5)
    for a, b in zip(model.get_weights(), control.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_a_failed_calibration_restores_the_layer_names_and_weights():
    model, (x, _) = _cnn()
    names = [layer.name for layer in model._flatten_layers()]
    weights = model.get_weights()
    with pytest.raises(Exception, match=r"(?i)shape|incompatible|dimensions"):
        tfrecompute.plan(model, "sqrt", sample=(x, np.zeros((32, 3), "float32")), calibrate=True)
    assert [layer.name for layer in model._flatten_layers()] == names
    for ours, theirs in zip(model.get_weights(), weights):
        np.testing.assert_array_equal(ours, theirs)


def test_a_plan_says_how_its_memory_was_predicted_and_a_chain_is_measured_once():
    model, sample = _cnn()
    assert "not measured (calibrate=True)" in tfrecompute.plan(model, sample=sample).summary()
    first = tfrecompute.plan(model, sample=sample, calibrate=True)
    summary = first.summary()
    assert "Memory calibrated by a measured step storing everything: " in summary
    again = tfrecompute.plan(model, "sqrt", budget=0.9, sample=sample, calibrate=True)
    assert again.chain is first.chain  # measured once while the calibrated chain is in use
    # policy="nothing" plans the same chain as None (no policy state), so it is not measured
    # again either
    whole = tfrecompute.plan(model, budget=0.9, sample=sample, calibrate=True, policy="nothing")
    assert whole.chain is first.chain


@pytest.mark.parametrize(
    "options, match",
    [
        ({"sample": None, "batch_size": 32}, r"plan: measuring a train step needs a sample"),
        ({"strategy": "plan"}, r"a Plan already fixes the segments, so a calibrate has no"),
        ({"calibrate": 1}, r"plan: `calibrate` must be a bool\. Received: calibrate=1"),
    ],
)
def test_calibrate_checks_its_arguments(options, match):
    model, sample = _cnn()
    arguments = {"sample": sample, "calibrate": True, **options}
    if arguments.pop("strategy", None) == "plan":
        arguments["strategy"] = tfrecompute.plan(model, "sqrt", sample=sample)
    with pytest.raises((TypeError, ValueError), match=match):
        tfrecompute.plan(model, **arguments)


def test_calibrate_measures_the_batch_the_plan_is_for():
    model, sample = _cnn()
    with pytest.raises(ValueError, match=r"plan: calibrating measures a step on the sample's 32 "):
        tfrecompute.plan(model, batch_size=64, sample=sample, calibrate=True)


def test_calibrate_needs_a_compiled_model_and_not_verify():
    model, sample = _cnn()
    uncompiled = keras.Model(model.inputs, model.outputs)
    with pytest.raises(ValueError, match=r"plan: the model is not compiled"):
        tfrecompute.plan(uncompiled, sample=sample, calibrate=True)
    with pytest.raises(ValueError, match=r"recompute: verify=True measures the checkpointed"):
        tfrecompute.recompute(model, budget=0.5, sample=sample, verify=True, calibrate=True)


def test_a_subclassed_model_is_calibrated_through_a_model_that_calls_it():
    from tests.any_models import loop_transformer

    keras.utils.set_random_seed(0)
    model, sample = loop_transformer(layers=2, hidden=256, sequence=128, batch=8)
    model.compile(optimizer="adamw", loss="mse")
    weights = model.get_weights()
    traced = tfrecompute.plan(model, sample=sample)
    planned = tfrecompute.plan(model, sample=sample, calibrate=True)
    calibration = planned.chain.calibration
    # Each block's buffers were found under the subclassed model's own scopes.
    blocks = [i for i, name in enumerate(planned.chain.names) if "block" in name]
    assert blocks and all(calibration.kept_bytes[i] >= 2**20 for i in blocks)
    for i in blocks:
        assert calibration.kept_bytes[i] == pytest.approx(traced.chain.saved_bytes[i], rel=0.25)
    assert strategies.none(planned.chain).peak_bytes >= calibration.measured_bytes
    for ours, theirs in zip(model.get_weights(), weights):
        np.testing.assert_array_equal(ours, theirs)
    assert model.optimizer.iterations.numpy() == 0


def test_a_calibrated_budget_keeps_a_tenth_for_the_variation_between_steps():
    model, sample = _cnn()
    calibrated = tfrecompute.plan(model, "none", sample=sample, calibrate=True).chain
    stored = strategies.none(calibrated).peak_bytes
    budget = int(stored / 0.85)  # holds storing everything less 10%, not less 30%
    assert not tfrecompute.plan(model, budget=budget, sample=sample, calibrate=True).segments
    assert tfrecompute.plan(model, budget=budget, sample=sample).segments
    assert headroom_of("plan", budget, None, calibrated) == pytest.approx(0.1)
    assert headroom_of("plan", budget, None, calibrated.calibration.traced) == pytest.approx(0.3)
