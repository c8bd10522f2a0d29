"""Every entry point on every kind of model a user brings (CI-sized, random init).

One tiny model per kind, built twice from one seed: the model every entry point
checkpoints in turn, and a control that is never checkpointed. Each cell is an
entry point (`recompute` with each kind of strategy, `verify=True`,
`verified_plan`, `max_batch_size`, `measure_step`, `trace_step`) applied to the
kind's model; it either checkpoints the model, with outputs and gradients equal
to the control's eagerly and under `tf.function` and the model still running
afterwards, or fails up front with the error the table below names. The command
line runs on every kind that saves to a `.keras` file (`tests/cli/` covers its
options): no traceback, `error:` lines only.
"""

from __future__ import annotations

import os
from typing import Any

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf

import tfrecompute
from tests import any_models
from tests.helpers import (
    MODES,
    forward_and_grads,
    load_state,
    model_runner,
    quantize,
    recomputed_blocks,
    save_state,
)
from tests.whole_model.test_any_model import assert_close_per_tensor
from tfrecompute.check.max_batch import repeated
from tfrecompute.cli.command import main

WIDTH, BATCH = 64, 64


def _dense_stack() -> list[keras.layers.Layer]:
    return [
        keras.layers.Dense(WIDTH, activation="relu"),
        keras.layers.Dropout(0.1),
        *[keras.layers.Dense(WIDTH, activation="tanh") for _ in range(5)],
        keras.layers.Dense(4),
    ]


def _xy(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(BATCH, 16)).astype("float32"), rng.normal(size=(BATCH, 4)).astype(
        "float32"
    )


def _sequential_input() -> tuple[keras.Model, Any, Any]:
    return keras.Sequential([keras.Input((16,)), *_dense_stack()]), *_xy()


def _sequential_called() -> tuple[keras.Model, Any, Any]:
    model = keras.Sequential(_dense_stack())
    x, y = _xy()
    model(x[:2])
    return model, x, y


def _sequential_unbuilt() -> tuple[keras.Model, Any, Any]:
    return keras.Sequential(_dense_stack()), *_xy()


def _functional(dropout: bool = True) -> tuple[keras.Model, Any, Any]:
    inputs = keras.Input((16,))
    h = keras.layers.Dense(WIDTH, activation="relu")(inputs)
    skip = h
    for _ in range(5):
        h = keras.layers.Dense(WIDTH, activation="tanh")(h)
    h = keras.layers.Add()([h, skip])
    if dropout:
        h = keras.layers.Dropout(0.1)(h)
    return keras.Model(inputs, keras.layers.Dense(4)(h)), *_xy()


def _loaded() -> tuple[keras.Model, Any, Any]:
    """Saved to `.keras` and loaded again by `_Case`; no Dropout, since a load gives an
    unseeded Dropout a new seed (the control's masks would differ)."""
    return _functional(dropout=False)


def _nested_functional() -> tuple[keras.Model, Any, Any]:
    inner, x, y = _functional()
    inputs = keras.Input((16,))
    h = keras.layers.Dense(16, activation="relu")(inputs)
    outputs = keras.layers.Dense(4)(inner(h))
    return keras.Model(inputs, outputs), x, y


class SubclassedStack(keras.Model):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.stack = _dense_stack()

    def call(self, x: Any, training: Any = None) -> Any:
        for layer in self.stack:
            x = layer(x, training=training)
        return x


def _subclassed() -> tuple[keras.Model, Any, Any]:
    model = SubclassedStack()
    x, y = _xy()
    model(x[:2])
    return model, x, y


def _subclassed_unbuilt() -> tuple[keras.Model, Any, Any]:
    return SubclassedStack(), *_xy()


def _keras_hub_backbone() -> tuple[keras.Model, Any, Any]:
    model, (x, y) = any_models.bert(layers=2, hidden=32, sequence=16, batch=8)
    return model, x, y


def _keras_hub_task() -> tuple[keras.Model, Any, Any]:
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=100, num_layers=2, num_heads=2, hidden_dim=32,
        intermediate_dim=64, max_sequence_length=32,
    )  # fmt: skip
    model = keras_hub.models.GPT2CausalLM(backbone, preprocessor=None)
    x = any_models._tokens(8, 16)
    y = np.random.default_rng(1).integers(1, 100, (8, 16))
    return model, x, y


def _list_called_with_dict() -> tuple[keras.Model, Any, Any]:
    """Inputs declared as a list and called with a dict keyed by their names (Gemma3n)."""
    ids = keras.Input((16,), dtype="int32", name="token_ids")
    mask = keras.Input((16,), dtype="bool", name="padding_mask")
    h = keras.layers.Embedding(100, WIDTH)(ids)
    keep = keras.ops.cast(mask, "float32")[..., None]
    for _ in range(4):
        h = keras.layers.Dense(WIDTH, activation="tanh")(h) * keep
    model = keras.Model([ids, mask], keras.layers.Dense(4)(h))
    rng = np.random.default_rng(0)
    x = {
        "padding_mask": np.ones((8, 16), bool),
        "token_ids": rng.integers(1, 100, (8, 16)).astype("int32"),
    }
    return model, x, rng.normal(size=(8, 16, 4)).astype("float32")


def _mixed_precision() -> tuple[keras.Model, Any, Any]:
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        return _functional()
    finally:
        keras.config.set_dtype_policy(previous)


def _int8_keras_hub() -> tuple[keras.Model, Any, Any]:
    model, x, y = _keras_hub_backbone()
    quantize(model, "int8")
    return model, x, y


KINDS = {
    "sequential_input": _sequential_input,
    "sequential_called": _sequential_called,
    "sequential_unbuilt": _sequential_unbuilt,
    "functional": _functional,
    "nested_functional": _nested_functional,
    "subclassed": _subclassed,
    "subclassed_unbuilt": _subclassed_unbuilt,
    "keras_hub_backbone": _keras_hub_backbone,
    "keras_hub_task": _keras_hub_task,
    "list_called_with_dict": _list_called_with_dict,
    "mixed_precision": _mixed_precision,
    "int8_keras_hub": _int8_keras_hub,
    "loaded": _loaded,
}
# keras-hub models take seconds per cell: the entry points that differ in how they
# reach a plan (a strategy, `where=`, a plan made beforehand, a measured plan).
HEAVY = {"keras_hub_backbone", "keras_hub_task", "int8_keras_hub"}
HEAVY_ENTRIES = ("default", "where", "plan", "verify")
# The kinds measured (`measure_step`, `trace_step`) and run on the command line: one of
# each way a model is built or called.
MEASURED = ("sequential_unbuilt", "subclassed", "keras_hub_backbone", "list_called_with_dict")
ON_THE_COMMAND_LINE = (
    "sequential_input",
    "sequential_called",
    "nested_functional",
    "keras_hub_task",
    "list_called_with_dict",
    "int8_keras_hub",
)


def _loss(model: keras.Model) -> Any:
    if isinstance(model, keras_hub.models.CausalLM):
        return keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if isinstance(model, keras_hub.models.Backbone):
        return {"pooled_output": "mse", "sequence_output": "mse"}
    return "mse"


class _Case:
    """A kind's model and its control, built from one seed, and their first state."""

    def __init__(self, kind: str, folder: str) -> None:
        keras.utils.set_random_seed(0)
        self.model, self.x, self.y = KINDS[kind]()
        keras.utils.set_random_seed(0)
        self.control, _, _ = KINDS[kind]()
        for model in (self.model, self.control):
            if not model.built:
                model(keras.tree.map_structure(lambda a: a[:1], self.x))
            model.compile(optimizer="sgd", loss=_loss(model))
        if kind == "loaded":
            path = os.path.join(folder, "model.keras")
            self.model.save(path)
            self.original = self.model
            self.model = keras.models.load_model(path)
        self.state = save_state(self.model.variables)
        self.control_state = save_state(self.control.variables)
        self.structure = self.x
        self.flat = [tf.convert_to_tensor(v) for v in keras.tree.flatten(self.x)]
        self._want: dict[str, list[np.ndarray]] = {}

    def want(self, mode: str) -> list[np.ndarray]:
        if mode not in self._want:
            load_state(self.control.variables, self.control_state)
            run = model_runner(self.control, self.structure)
            self._want[mode] = forward_and_grads(
                run, self.flat, self.control.trainable_variables, mode
            )
        return self._want[mode]

    def got(self, mode: str) -> list[np.ndarray]:
        load_state(self.model.variables, self.state)
        run = model_runner(self.model, self.structure)
        got = forward_and_grads(run, self.flat, self.model.trainable_variables, mode)
        load_state(self.model.variables, self.state)
        return got


_CASES: dict[str, _Case] = {}


@pytest.fixture(scope="module")
def cases(tmp_path_factory: Any) -> Any:
    folder = str(tmp_path_factory.mktemp("entry_points"))

    def case(kind: str) -> _Case:
        if kind not in _CASES:
            _CASES[kind] = _Case(kind, folder)
        return _CASES[kind]

    yield case
    _CASES.clear()


def _where(layer: keras.layers.Layer) -> bool:
    return isinstance(layer, keras.layers.Dense) or "transformer_layer" in layer.name


def _between(case: _Case) -> int:
    """A budget halfway between the least peak a plan reaches and storing everything."""
    chain = tfrecompute.plan(case.model, "none", sample=(case.x, case.y)).chain
    stored, least = (
        tfrecompute.strategies.none(chain).peak_bytes,
        tfrecompute.strategies.min_peak(chain),
    )
    return (stored + least) // 2


ENTRY_POINTS = {
    "default": lambda c: tfrecompute.recompute(c.model, sample=(c.x, c.y)),
    "sqrt": lambda c: tfrecompute.recompute(c.model, "sqrt", sample=c.x),
    "budget": lambda c: tfrecompute.recompute(
        c.model, budget=_between(c), sample=(c.x, c.y), headroom=0
    ),
    "where": lambda c: tfrecompute.recompute(c.model, where=_where, sample=c.x),
    "policy": lambda c: tfrecompute.recompute(c.model, policy="dots", sample=c.x),
    "plan": lambda c: tfrecompute.recompute(
        c.model, tfrecompute.plan(getattr(c, "original", c.model), "sqrt", sample=c.x)
    ),
    "verify": lambda c: tfrecompute.recompute(
        c.model, budget="256MiB", sample=(c.x, c.y), verify=True
    ),
    "verified_plan": lambda c: tfrecompute.verified_plan(
        c.model, (c.x, c.y), budget="256MiB", strategy="sqrt"
    ),
    "max_batch_size": lambda c: tfrecompute.max_batch_size(
        c.model, (c.x, c.y), budget="256MiB", multiple=BATCH, limit=BATCH, isolate=False
    ),
}
# Entry points that place blocks on every kind (the others may store everything).
PLACES_BLOCKS = {"sqrt", "where", "plan"}
# Where a cell cannot work, the error it must fail with up front.
EXPECTED_ERRORS: dict[tuple[str, str], tuple[type[Exception], str]] = {}
for _kind in ("subclassed", "subclassed_unbuilt"):
    for _entry in ("verify", "verified_plan", "max_batch_size"):
        # A measured step compiles a Functional model that runs as the checkpointed one.
        EXPECTED_ERRORS[(_kind, _entry)] = (ValueError, "subclassed model's call cannot")


# Where a cell places nothing, the warning that must say so (none today: the quantized
# transformer layers of a small BERT, whose outputs no backward reads, each end a link
# since NOTE [ Links of the chain ] prices a cut there, so `where=` gets its blocks).
LEFT_AS_IT_WAS: dict[tuple[str, str], str] = {}

CELLS = [
    (kind, entry)
    for kind in KINDS
    for entry in ENTRY_POINTS
    if kind not in HEAVY or entry in HEAVY_ENTRIES
]


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "entry"), CELLS, ids=[f"{k}-{e}" for k, e in CELLS])
def test_an_entry_point_checkpoints_the_model_or_refuses_it_up_front(cases, kind, entry):
    case = cases(kind)
    tfrecompute.recompute(case.model, "none")
    expected = EXPECTED_ERRORS.get((kind, entry))
    if (kind, entry) in LEFT_AS_IT_WAS:
        with pytest.warns(UserWarning, match=LEFT_AS_IT_WAS[(kind, entry)]):
            ENTRY_POINTS[entry](case)
        assert not tfrecompute.checkpoints(case.model)
    elif expected is not None:
        error, match = expected
        with pytest.raises(error, match=match):
            ENTRY_POINTS[entry](case)
        assert not tfrecompute.checkpoints(case.model)  # nothing left applied
    else:
        ENTRY_POINTS[entry](case)
        applied = tfrecompute.checkpoints(case.model)
        if entry in PLACES_BLOCKS:
            assert applied is not None and applied.blocks, "no block was placed"
        if applied is not None and applied.blocks:  # the comparison below compares something

            def train() -> None:
                with tf.GradientTape():
                    case.model(case.x, training=True)

            assert recomputed_blocks(case.model, train) >= 1
        for mode in MODES:
            assert_close_per_tensor(case.got(mode), case.want(mode), rtol=1e-5)
    outputs = case.model(case.x)  # the model runs afterwards, checkpointed or not
    assert all(np.all(np.isfinite(o)) for o in keras.tree.flatten(outputs))


@pytest.mark.slow
@pytest.mark.parametrize("kind", MEASURED)
def test_measure_and_trace_a_checkpointed_step(cases, kind):
    case = cases(kind)
    tfrecompute.recompute(case.model, "sqrt", sample=case.x)
    assert tfrecompute.checkpoints(case.model).blocks
    # 32 times the batch: the CPU allocator traces allocations of 256 KiB or more.
    x, y = repeated((case.x, case.y), 32 * len(keras.tree.flatten(case.x)[0]))
    step = tfrecompute.measure_step(case.model, x, y, steps=1)
    trace = tfrecompute.trace_step(case.model, x, y, warmup=1)
    assert step.peak_bytes > 0 and trace.requested_peak_bytes > 0
    load_state(case.model.variables, case.state)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ON_THE_COMMAND_LINE)
def test_the_command_line_answers_every_kind_without_a_traceback(cases, kind, tmp_path, capsys):
    """`tfrecompute plan --verify` (load, profile, plan, measure) on the kind's saved model:
    a plan, or one `error:` line; an exception escaping `main` fails the test."""
    case = cases(kind)
    tfrecompute.recompute(case.model, "none")
    path = str(tmp_path / "model.keras")
    case.model.save(path)
    dim = ["--dim", "16"] if kind in HEAVY else []
    code = main(["plan", path, "--batch-size", "8", "--budget", "256MiB", "--verify", *dim])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "Traceback" not in err and "Measured train step" in out, out + err


@pytest.mark.slow
def test_max_batch_on_the_command_line_probes_a_sequential_model_in_its_own_process(
    cases, tmp_path, capsys
):
    """`tfrecompute max-batch` runs each probe in a fresh process (the README's first model,
    which every measured path once failed on)."""
    case = cases("sequential_input")
    tfrecompute.recompute(case.model, "none")
    path = str(tmp_path / "model.keras")
    case.model.save(path)
    code = main(["max-batch", path, "--budget", "256MiB", "--multiple", "64", "--limit", "64"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "the search stopped at its --limit 64, so 64 is the largest tried" in out, out


def test_dir_of_a_model_is_the_same_after_recompute():
    """keras-hub's serialization tests compare `dir(model)` with a rebuilt copy."""
    for build in (_functional, _subclassed, _keras_hub_task):
        keras.utils.set_random_seed(0)
        model, x, _ = build()
        model(keras.tree.map_structure(lambda a: a[:1], x))
        before = dir(model)
        tfrecompute.recompute(model, "sqrt", sample=x)
        assert tfrecompute.checkpoints(model).blocks
        assert dir(model) == before
        # Nor do the layers show a record (Python itself may add `__annotations__` to a
        # layer class the first time its methods are wrapped: every instance shows it).
        for layer in model._flatten_layers():
            assert not [name for name in dir(layer) if "tfrecompute" in name], layer.name
        tfrecompute.recompute(model, "none")
        assert not tfrecompute.checkpoints(model)
        assert "call" not in vars(model)


@pytest.mark.slow
@pytest.mark.parametrize("order", ["checkpoint_then_compile", "compile_then_checkpoint"])
def test_checkpointed_in_a_mirrored_scope_before_or_after_compile(order):
    """Build, checkpoint and compile inside `MirroredStrategy.scope()`, in either order:
    `fit` ends on the control's weights (profiling's Adam, for a model not compiled yet,
    is made outside the strategy)."""
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    trained = []
    for checkpointed in (True, False):
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model, x, y = _functional()
            if order == "compile_then_checkpoint":
                model.compile(optimizer=keras.optimizers.AdamW(1e-2, weight_decay=0.1), loss="mse")
            if checkpointed:
                tfrecompute.recompute(model, "sqrt", sample=(x, y))
                assert tfrecompute.checkpoints(model).blocks
            if order == "checkpoint_then_compile":
                model.compile(optimizer=keras.optimizers.AdamW(1e-2, weight_decay=0.1), loss="mse")
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        trained.append(save_state(model.weights))
    for got, want in zip(*trained):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_plan_then_recompute_profiles_the_model_once(monkeypatch):
    from tfrecompute import pipeline

    profiled = []
    original = pipeline.profile_graph

    def counting(*args, **kwargs):
        profiled.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(pipeline, "profile_graph", counting)
    model, x, y = _sequential_input()
    made = tfrecompute.plan(model, "sqrt", sample=x)
    tfrecompute.recompute(model, "sqrt", sample=x)
    assert len(profiled) == 1 and made.segments
    assert tfrecompute.checkpoints(model).plan.segments == made.segments
    model.trainable = False  # what profiling reads changed: profiled again
    tfrecompute.recompute(model, "sqrt", sample=x)
    assert len(profiled) == 2


@pytest.mark.parametrize("api", ["plan", "recompute", "verified_plan"])
def test_a_malformed_budget_is_refused_before_any_profiling(api, monkeypatch):
    from tfrecompute import pipeline

    def fail(*args, **kwargs):
        raise AssertionError("profiled before the budget was checked")

    monkeypatch.setattr(pipeline, "traced_graph", fail)
    model, x, y = _sequential_input()
    model.compile(optimizer="sgd", loss="mse")
    call = getattr(tfrecompute, api)
    with pytest.raises(ValueError, match=f"{api}: .*budget"):
        if api == "verified_plan":
            call(model, (x, y), budget="lots")
        else:
            call(model, budget="lots", sample=(x, y))


@pytest.mark.parametrize("api", ["plan", "recompute"])
def test_an_unknown_strategy_is_named_as_the_user_passed_it(api):
    model, x, _ = _sequential_input()
    with pytest.raises(ValueError, match=rf"^{api}: unknown strategy name\. Received: strategy="):
        getattr(tfrecompute, api)(model, "fastest", sample=x)
