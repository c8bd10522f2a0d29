"""Verified plans and the largest batch: budgets checked by measured train steps."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import tfrecompute
from tests.helpers import applied_blocks
from tfrecompute import strategies

MiB = 2**20


def _chain_model(depth: int = 16) -> keras.Model:
    keras.utils.set_random_seed(0)
    inputs = keras.Input((256,))
    h = inputs
    for _ in range(depth):
        h = keras.layers.Dense(512, activation="tanh")(h)
    model = keras.Model(inputs, keras.layers.Dense(8)(h))
    model.compile(optimizer="sgd", loss="mse")
    return model


def _batch(rows: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.random((rows, 256), dtype="float32"), rng.random((rows, 8), dtype="float32")


def test_a_verified_plan_measures_within_its_budget_and_uses_most_of_it():
    model = _chain_model()
    x, y = _batch(512)
    stored = tfrecompute.measure_step(model, x, y).peak_bytes
    budget = int(0.75 * stored)
    weights = [v.numpy().copy() for v in model.weights]
    verified = tfrecompute.verified_plan(model, (x, y), budget=budget)
    assert verified.plan.segments  # storing everything does not fit
    assert verified.peak_bytes <= budget
    assert verified.share >= 0.6, verified.probes
    assert all(p.measured_bytes > 0 for p in verified.probes)
    weight_bytes = sum(w.nbytes for w in weights)
    assert weight_bytes <= verified.state_bytes < 1.01 * weight_bytes  # SGD keeps no slots
    for variable, value in zip(model.weights, weights):  # measuring trained nothing
        np.testing.assert_array_equal(variable.numpy(), value)
    assert verified.model is model and tfrecompute.checkpoints(model).plan == verified.plan
    history = verified.model.fit(x, y, batch_size=512, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])


def test_recompute_verify_returns_the_verified_model():
    model = _chain_model()
    x, y = _batch(512)
    optimizer = model.optimizer
    # A budget that binds: storing everything (19 to 20.5 MiB here) measures over it,
    # so the verified plan has blocks. The first plan measured 10 MiB, well within the
    # budget less its 10% (12.8 MiB); at batch 256 plans measured too close to it.
    stored = tfrecompute.measure_step(model, x, y).peak_bytes
    budget = int(0.75 * stored)
    assert tfrecompute.recompute(model, budget=budget, sample=(x, y), verify=True) is model
    applied = tfrecompute.checkpoints(model)
    assert applied is not None and applied.plan.segments
    assert len(applied.blocks) == len(applied.plan.segments)
    assert model.optimizer is optimizer  # measured with a copy: the model's own is untouched
    assert model.predict(x, verbose=0).shape == (512, 8)


def test_a_verified_plan_with_a_policy_measures_its_selective_blocks():
    model = _chain_model()
    x, y = _batch(512)
    stored = tfrecompute.measure_step(model, x, y).peak_bytes
    budget = int(0.75 * stored)
    verified = tfrecompute.verified_plan(model, (x, y), budget=budget, policy="dots")
    assert verified.plan.chain.has_policy
    assert verified.peak_bytes <= budget
    blocks = applied_blocks(model)
    assert len(blocks) == len(verified.plan.segments) > 0
    want = ["dots" if verified.plan.is_selective(i) else None for i in range(len(blocks))]
    assert [b.get_config().get("policy") for b in blocks] == want
    # A strategy that does not weigh the third state gives every block the policy.
    fixed = tfrecompute.verified_plan(
        model, (x, y), budget=2 * stored, strategy="sqrt", policy="dots"
    )
    blocks = applied_blocks(model)
    assert fixed.peak_bytes <= 2 * stored and len(blocks) >= 2
    assert {b.get_config().get("policy") for b in blocks} == {"dots"}


def test_max_batch_size_in_fresh_processes_takes_a_policy_by_name():
    with pytest.raises(TypeError, match=r"max_batch_size: a recompute policy for probes in"):
        tfrecompute.max_batch_size(
            _chain_model(2), _batch(8), budget="1GiB", policy=lambda op: op.weight
        )


def test_a_verified_plan_needs_labels():
    with pytest.raises(ValueError, match=r"verified_plan: measuring a train step needs a sample"):
        tfrecompute.verified_plan(_chain_model(2), _batch(8)[0], budget="1GiB")


def test_a_verified_plan_needs_a_compiled_model():
    model = _chain_model(2)
    uncompiled = keras.Model(model.inputs, model.outputs)
    with pytest.raises(ValueError, match=r"verified_plan: the model is not compiled"):
        tfrecompute.verified_plan(uncompiled, _batch(8), budget="1GiB")


def test_a_verified_plan_under_an_infeasible_budget_names_the_least_one():
    with pytest.raises(tfrecompute.InfeasibleBudgetError, match=r"at least [0-9.]+ MiB"):
        tfrecompute.verified_plan(_chain_model(4), _batch(512), budget="1MiB")


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({}, r"recompute: verify=True measures a plan made for a budget"),
        ({"budget": "1GiB", "headroom": 0.1}, r"takes its headroom from the measured step"),
    ],
)
def test_recompute_verify_checks_its_options(options, match):
    with pytest.raises(ValueError, match=match):
        tfrecompute.recompute(_chain_model(2), sample=_batch(8), verify=True, **options)


def _assert_largest(found, multiple: int, budget: int) -> None:
    assert found.peak_bytes <= budget
    tried = {p.batch_size: p for p in found.probes}
    assert tried[found.batch_size].fits
    assert not tried[found.batch_size + multiple].fits  # the next search step did not fit
    assert all(p.fits for p in found.probes if p.batch_size < found.batch_size)


def test_max_batch_size_finds_the_largest_measured_fit_in_fresh_processes():
    model = _chain_model()
    seen = []
    # Storing everything measures about 11.3 MiB at batch 256; 512 is predicted at 22 MiB.
    found = tfrecompute.max_batch_size(
        model, _batch(8), budget=14 * MiB, strategy="none", multiple=256, progress=seen.append
    )
    assert found.batch_size == 256, found.probes
    assert [p.batch_size for p in seen] == [256, 512]
    _assert_largest(found, 256, 14 * MiB)
    assert found.plan.segments == ()


def test_max_batch_size_with_optimal_beats_storing_everything():
    model = _chain_model()
    # Storing everything measures about 16 MiB at batch 384 and 21 at 512; the plan at
    # 512 measures 10.5 to 12.5 MiB by the allocator's state, well inside the budget.
    found = tfrecompute.max_batch_size(
        model, _batch(8), budget=16 * MiB, multiple=128, isolate=False
    )
    _assert_largest(found, 128, 16 * MiB)
    assert found.batch_size >= 512 and found.plan.segments
    assert found.plan.chain.source.batch_size == found.batch_size


def test_max_batch_size_fails_when_not_even_the_first_batch_fits():
    with pytest.raises(tfrecompute.InfeasibleBudgetError, match=r"even batch size 64 does not"):
        tfrecompute.max_batch_size(
            _chain_model(4), _batch(8), budget="1MiB", multiple=64, isolate=False
        )


def test_max_batch_size_probes_in_fresh_processes_by_strategy_name():
    with pytest.raises(TypeError, match=r"max_batch_size: a strategy for probes in fresh"):
        tfrecompute.max_batch_size(
            _chain_model(2), _batch(8), budget="1GiB", strategy=strategies.sqrt
        )


def test_a_verified_plan_refuses_a_subclassed_model():
    from tests.any_models import loop_transformer

    keras.utils.set_random_seed(0)
    model, sample = loop_transformer(layers=2, hidden=32, sequence=8)
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match=r"verified_plan: a verified plan measures the compiled"):
        tfrecompute.verified_plan(model, sample, budget="1GiB")
    assert not tfrecompute.checkpoints(model)


def test_a_verified_plan_replaces_calls_checkpointed_in_place_as_it_re_plans():
    """Subclassed layers holding Sequential models: their calls are routed in place,
    and each measured plan replaces the previous one."""
    from tests.any_models import tower_model

    keras.utils.set_random_seed(0)
    # Activations, not weight gradients, dominate the step, so its first plan
    # measures well inside the budget less its 10% margin (at width 1024,
    # batch 256, weight gradients dominated and the only plan fell in or out
    # of it by the allocator's state).
    model, (x, y) = tower_model(width=256, batch=2048)
    model.compile(optimizer="sgd", loss="mse")
    stored = tfrecompute.measure_step(model, x, y).peak_bytes
    seen = []
    verified = tfrecompute.verified_plan(
        model, (x, y), budget=int(0.9 * stored), progress=lambda probe: seen.append(probe)
    )
    assert seen and verified.plan.segments and verified.peak_bytes <= 0.9 * stored
    applied = tfrecompute.checkpoints(model)
    assert applied.plan == verified.plan and applied.changed
    routed = [m for m in applied.changed if m is not model]
    assert routed and all("call" in vars(m) for m in routed)
    assert tfrecompute.measure_step(model, x, y).peak_bytes < stored


def test_a_failed_verified_plan_leaves_the_model_as_it_was():
    model = _chain_model(depth=4)
    x, y = _batch(256)
    tfrecompute.recompute(model, "uniform:2")
    before = tfrecompute.checkpoints(model)
    # Predicted a little over the budget, the least plan is still measured (and applied).
    least = strategies.min_peak(tfrecompute.profile(model, batch_size=256))
    with pytest.raises(strategies.InfeasibleBudgetError, match="no measured train step fits"):
        tfrecompute.verified_plan(model, (x, y), budget=int(least / 1.2))
    assert tfrecompute.checkpoints(model) is before
    assert all(vars(t).get("call") is not None for t in before.changed)


@pytest.mark.parametrize(
    ("found", "raised", "match"),
    [
        (
            {"error": "ValueError", "message": "max_batch_size: the sample is wrong."},
            ValueError,
            "^max_batch_size: the sample is wrong.$",
        ),
        ({"error": "KeyError", "message": "'x'"}, RuntimeError, "Its error: KeyError: 'x'"),
        ({}, RuntimeError, "Its error: \nTraceback: boom"),
    ],
)
def test_a_probe_process_error_is_raised_as_the_library_raised_it(found, raised, match):
    """The library's own errors come back as they were raised in the probe's process;
    anything else as a RuntimeError with what the process said."""
    from tfrecompute.check.max_batch import _probe_failed

    with pytest.raises(raised, match=match):
        _probe_failed(8, found, "Traceback: boom")


@pytest.mark.parametrize("isolate", [False, True])
def test_max_batch_size_applies_the_policy_states_its_probe_measured(isolate):
    from tests import models_zoo

    keras.utils.set_random_seed(0)
    model = models_zoo.transformer_encoder(layers=2, sequence=128, hidden=64, heads=2)
    model.compile(optimizer="sgd", loss="mse")
    rng = np.random.default_rng(0)
    sample = (rng.integers(0, 100, (8, 128)).astype("int32"), np.zeros((8, 2), "float32"))
    stored = tfrecompute.measure_step(model, *repeat(sample, 32)).peak_bytes
    # Under the budget's default policy states (the encoder holds attention layers).
    found = tfrecompute.max_batch_size(
        model, sample, budget=int(0.8 * stored), multiple=32, limit=32, isolate=isolate
    )
    probe = found.probes[-1]
    assert found.batch_size == 32 and probe.fits and found.plan.segments == probe.segments
    assert found.plan.chain.policy_names == ("attention", "dots")
    assert found.plan.selective == probe.selective and any(probe.selective)
    names = {0: None, 1: "attention", 2: "dots"}
    assert [b.policy for b in applied_blocks(model)] == [names[s] for s in probe.selective]


def repeat(sample, rows):
    return tuple(np.concatenate([part] * (rows // len(part))) for part in sample)
