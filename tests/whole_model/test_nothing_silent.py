"""Nothing happens silently: a model left storing everything says so, `checkpoints` never
returns None, and a budget can be a share of storing everything (`budget=0.5`)."""

from __future__ import annotations

import math
import re
import warnings

import keras
import numpy as np
import pytest

import tfrecompute
from tfrecompute import strategies

STORED_ALL = r"recompute: nothing is recomputed, so the model stores everything: "


def _mlp(depth: int = 8, width: int = 256) -> keras.Model:
    keras.utils.set_random_seed(0)
    inputs = keras.Input((width,), name="features")
    h = inputs
    for _ in range(depth):
        h = keras.layers.Dense(width, activation="tanh")(h)
    return keras.Model(inputs, keras.layers.Dense(4)(h), name="mlp")


def _one_warning(record) -> str:
    said = [str(w.message) for w in record if issubclass(w.category, UserWarning)]
    assert len(said) == 1, said
    assert "\n" not in said[0]  # one line
    return said[0]


def test_a_budget_above_storing_everything_says_so_in_one_line():
    model = _mlp()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert tfrecompute.recompute(model, budget="1GiB", batch_size=64) is model
    said = _one_warning(record)
    budget = "the budget 1.00 GiB (1073741824 bytes), less 30% headroom, holds the predicted "
    assert said.startswith(STORED_ALL + budget + "peak of storing everything, ")
    assert "To save memory pass a budget below " in said
    hint = r"e\.g\. budget=0\.\d+ \(the least peak a plan reaches is \d+% of storing everything\)"
    assert re.search(hint + ", or strategy='sqrt' to recompute without a budget", said)
    applied = tfrecompute.checkpoints(model)
    assert isinstance(applied, tfrecompute.Checkpoints)
    assert not applied and not applied.applied and applied.plan is None and applied.blocks == ()
    assert applied.summary() == "No checkpoints applied: " + said.removeprefix("recompute: ")
    assert "call" not in vars(model)  # left as it was


def test_the_fix_it_names_checkpoints_the_model():
    model = _mlp()
    with pytest.warns(UserWarning) as record:
        tfrecompute.recompute(model, budget="1GiB", batch_size=4096)
    below = re.search(r"pass a budget below \d+\.\d\d [KM]iB \((\d+) bytes\)", _one_warning(record))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        tfrecompute.recompute(model, budget=int(below.group(1)) - 1, batch_size=4096)
    applied = tfrecompute.checkpoints(model)
    assert applied and applied.applied and applied.plan.segments and applied.blocks
    assert applied.note == ""
    share = float(re.search(r"e\.g\. budget=(0\.\d+) ", _one_warning(record)).group(1))
    tfrecompute.recompute(model, "none")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        tfrecompute.recompute(model, budget=share, batch_size=4096)  # the share it suggests
    assert tfrecompute.checkpoints(model).plan.segments
    assert applied.summary().startswith(
        f"Checkpoints applied: {len(applied.blocks)} recompute block"
    )
    assert "of plan 'optimal'\nPlan 'optimal' for a chain of" in applied.summary()


def test_a_model_never_checkpointed_says_so():
    applied = tfrecompute.checkpoints(_mlp(depth=1))
    assert not applied and applied.plan is None and applied.runtime is None
    assert applied.summary().startswith(
        "No checkpoints applied: no tfrecompute entry point checkpointed this model"
    )
    assert "call tfrecompute.recompute(model, ...)" in applied.note


def test_turning_checkpointing_off_is_recorded_and_silent():
    model = _mlp()
    tfrecompute.recompute(model, "sqrt", batch_size=4096)
    assert tfrecompute.checkpoints(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        tfrecompute.recompute(model, "none")  # asked for: no warning
        assert "turned checkpointing off" in tfrecompute.checkpoints(model).note
        tfrecompute.recompute(model, "none", batch_size=4096)
    applied = tfrecompute.checkpoints(model)
    assert not applied and "strategy 'none' stores everything" in applied.note


def test_a_share_of_one_stores_everything_and_says_it_in_bytes_too():
    model = _mlp()
    stored = strategies.none(tfrecompute.profile(model, batch_size=4096)).peak_bytes
    with pytest.warns(UserWarning) as record:
        tfrecompute.recompute(model, budget=1.0, batch_size=4096)
    said = _one_warning(record)
    budget = f"{strategies.format_bytes(stored)} ({stored} bytes, 1.0 of the predicted peak"
    assert f"the budget {budget} of storing everything), less 0% headroom, holds " in said
    assert not tfrecompute.checkpoints(model)


@pytest.mark.parametrize("share", [0.8, "80%", "0.8"])
def test_a_share_plans_to_that_share_of_storing_everything(share):
    model = _mlp()
    made = tfrecompute.plan(model, budget=share, batch_size=4096)
    stored = strategies.none(made.chain).peak_bytes
    assert made.segments and made.peak_bytes <= 0.8 * stored
    # The share in bytes, without headroom unless one is given.
    assert made == tfrecompute.plan(model, budget=math.floor(0.8 * stored), headroom=0,
                                    batch_size=4096)  # fmt: skip
    tight = tfrecompute.plan(model, budget=share, headroom=0.05, batch_size=4096)
    assert tight.peak_bytes <= 0.95 * 0.8 * stored


def test_recompute_takes_a_share_and_checkpoints_the_model():
    model = _mlp()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        tfrecompute.recompute(model, budget=0.8, batch_size=4096)
    applied = tfrecompute.checkpoints(model)
    assert applied.plan.peak_bytes <= 0.8 * strategies.none(applied.plan.chain).peak_bytes


@pytest.mark.parametrize(
    ("budget", "match"),
    [
        (1.5, r"recompute: a float budget is a share of storing everything in \(0, 1\] or a "
              r"whole number of bytes\. Received: budget=1\.5 \(of type float\)\. Pass a "),
        (0.0, r"recompute: a budget must be positive\. Received: budget=0\.0 \(of type float\)"),
        (-0.5, r"recompute: a budget must be positive\. Received: budget=-0\.5"),
        (float("nan"), r"recompute: a budget must be a finite number\. Received: budget=nan"),
        ("150%", r"recompute: a share of storing everything must be in \(0, 1\]"),
    ],
)  # fmt: skip
def test_a_bad_share_is_refused_before_profiling(budget, match, monkeypatch):
    from tfrecompute import pipeline

    monkeypatch.setattr(pipeline, "traced_graph", None)  # profiling would fail otherwise
    with pytest.raises(ValueError, match=match):
        tfrecompute.recompute(_mlp(depth=1), budget=budget, batch_size=8)


def test_an_infeasible_share_names_the_share_and_its_bytes():
    model = _mlp()
    with pytest.raises(tfrecompute.InfeasibleBudgetError) as info:
        tfrecompute.plan(model, budget=0.01, batch_size=64)
    text = str(info.value)
    assert text.startswith("plan: the plan must fit in ")
    assert "bytes, 0.01 of the predicted peak of storing everything) less 0% headroom" in text
    assert "Received: budget=0.01 (of type float)" in text


def _compiled(depth: int = 4) -> tuple[keras.Model, tuple[np.ndarray, np.ndarray]]:
    model = _mlp(depth=depth, width=128)
    model.compile(optimizer="sgd", loss="mse")
    rng = np.random.default_rng(0)
    return model, (rng.random((2048, 128), "float32"), rng.random((2048, 4), "float32"))


def test_a_verified_plan_takes_a_share_of_the_predicted_peak():
    model, sample = _compiled()
    stored = strategies.none(tfrecompute.plan(model, "none", sample=sample).chain).peak_bytes
    # A share of one is storing everything's predicted peak, in bytes. Its measured step
    # fits in the 90% a verified plan keeps when the allocator rounds little, and not
    # when it rounds more.
    try:
        verified = tfrecompute.verified_plan(model, sample, budget=1.0)
    except tfrecompute.InfeasibleBudgetError as error:
        assert error.budget == stored
    else:
        assert verified.budget_bytes == stored
    shared = r"verified_plan: .*0\.01 of the predicted peak of storing everything.*budget=0\.01"
    with pytest.raises(tfrecompute.InfeasibleBudgetError, match=shared):
        tfrecompute.verified_plan(model, sample, budget=0.01)


def test_a_verified_recompute_that_stores_everything_says_so():
    model, sample = _compiled()
    said = r"the measured step of plan '\w+', .* fits the budget 1\.00 GiB \(1073741824 bytes\)\. "
    with pytest.warns(UserWarning, match=STORED_ALL + said + "Pass a lower budget"):
        tfrecompute.recompute(model, budget="1GiB", sample=sample, verify=True)
    assert not tfrecompute.checkpoints(model)
    assert "fits the budget 1.00 GiB" in tfrecompute.checkpoints(model).note


def test_a_plan_for_an_xla_compiled_step_says_its_peaks_are_not_seen():
    """Under jit_compile=True the prediction does not see XLA's buffers: planning warns
    once per model, and a model compiled without XLA plans silently."""
    layers = [keras.layers.Dense(256, activation="tanh") for _ in range(8)]
    model = keras.Sequential([keras.Input((256,)), *layers])
    model.compile(optimizer="sgd", loss="mse", jit_compile=True)
    with pytest.warns(UserWarning, match=r"jit_compile=True: XLA places .* verify=True"):
        tfrecompute.plan(model, batch_size=256)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tfrecompute.plan(model, batch_size=256)  # said once
        model.compile(optimizer="sgd", loss="mse", jit_compile=False)
        other = keras.models.clone_model(model)
        other.compile(optimizer="sgd", loss="mse")
        tfrecompute.plan(other, batch_size=256)
