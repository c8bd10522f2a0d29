"""Training state that survives: checkpointed models save, restore, export and exchange
weights exactly like the same models without checkpointing.

Kinds (each `Case` holds the checkpointed model and its control, the same model built
without checkpointing, with equal variables): hand-written blocks in a Sequential and a
Functional model (BatchNormalization and Dropout inside, one block around a Functional
sub-model), a block with `policy="dots"`, and `tfrecompute.recompute()` of a
Functional, a Sequential and a subclassed model. Every kind is built plainly and under
`MirroredStrategy` over the two logical CPUs of conftest.py (there `recompute` runs
outside the scope, as a user may call it).

Paths: `.keras` files then training resumed, `.weights.h5` files, weights moving
between the checkpointed model and its control both ways, `get_weights`/`set_weights`,
`tf.train.Checkpoint` and `CheckpointManager` (model alone, model and optimizer),
`model.export` and `tf.saved_model.save`, `BackupAndRestore` (per epoch and every 2
batches) and `ModelCheckpoint`. keras-hub models: tests/rewrite/test_persistence_keras_hub.py.

Keras 3.15 saves a `SeedGenerator`'s state neither in a `.keras` file (a loaded
Dropout draws its masks from its seed again) nor in TensorFlow's object graph, with or
without checkpointing (`test_upstream_seed_states_are_not_saved`): a resumed run is
compared with its control resumed the same way, and checkpoint restores leave seed
states out.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfrecompute
from tests import multiworker_worker as worker
from tests.helpers import applied_blocks, assert_same_weights, recomputed_blocks
from tfrecompute import RecomputeBlock

WIDTH = 8
RNG = np.random.default_rng(0)
X = RNG.normal(size=(32, WIDTH)).astype("float32")
Y = RNG.normal(size=(32, 2)).astype("float32")


def _body(seed: int) -> list[keras.layers.Layer]:
    return [
        keras.layers.Dense(16, activation="tanh"),
        keras.layers.BatchNormalization(momentum=0.5),
        keras.layers.Dropout(0.3, seed=seed),
    ]


def _sequential(blocks: bool) -> keras.Model:
    first, body_1, body_2, last = keras.layers.Dense(16), _body(1), _body(2), keras.layers.Dense(2)
    middle = [RecomputeBlock(body_1), RecomputeBlock(body_2)] if blocks else [*body_1, *body_2]
    return keras.Sequential([keras.Input((WIDTH,)), first, *middle, last])


def _functional(blocks: bool) -> keras.Model:
    inputs = keras.Input((WIDTH,))
    h = keras.layers.Dense(16)(inputs)
    sub_in = keras.Input((16,))
    sub_out = sub_in
    for layer in _body(1):
        sub_out = layer(sub_out)
    sub = keras.Model(sub_in, sub_out, name="sub")
    g = RecomputeBlock(sub)(h) if blocks else sub(h)
    body = _body(2)
    if blocks:
        g = RecomputeBlock(body)(g)
    else:
        for layer in body:
            g = layer(g)
    outputs = keras.layers.Dense(2)(keras.layers.Add()([g, h]))
    return keras.Model(inputs, outputs)


def _dots(blocks: bool) -> keras.Model:
    inputs = keras.Input((WIDTH,))
    h = keras.layers.Dense(16)(inputs)
    body = [
        keras.layers.Dense(32, activation="gelu"),
        keras.layers.Dropout(0.2, seed=3),
        keras.layers.Dense(16),
    ]
    if blocks:
        h = RecomputeBlock(body, policy="dots")(h)
    else:
        for layer in body:
            h = layer(h)
    return keras.Model(inputs, keras.layers.Dense(2)(h))


def _plain_functional(blocks: bool) -> keras.Model:
    inputs = keras.Input((WIDTH,))
    h = keras.layers.Dense(16)(inputs)
    for seed in range(3):
        for layer in _body(seed):
            h = layer(h)
    return keras.Model(inputs, keras.layers.Dense(2)(h))


def _plain_sequential(blocks: bool) -> keras.Model:
    layers = [layer for seed in range(3) for layer in _body(seed)]
    return keras.Sequential([keras.Input((WIDTH,)), keras.layers.Dense(16), *layers,
                             keras.layers.Dense(2)])  # fmt: skip


@keras.saving.register_keras_serializable(package="tfrecompute_tests")
class Towers(keras.Model):
    """A subclassed model: its calls are checkpointed where its code makes them."""

    def __init__(self, width: int = 16, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.width = width
        self.stem = keras.layers.Dense(width)
        # Attributes, not a list: TensorFlow's object graph does not follow a Keras
        # list of layers (test_upstream_a_list_of_layers_is_not_in_a_tf_checkpoint).
        self.depth = 0
        for seed in range(2):
            for layer in _body(seed):
                setattr(self, f"body_{self.depth}", layer)
                self.depth += 1
        self.head = keras.layers.Dense(2)

    def call(self, x: Any, training: Any = None) -> Any:
        h = self.stem(x)
        for index in range(self.depth):
            h = getattr(self, f"body_{index}")(h, training=training)
        return self.head(h)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "width": self.width}


def _subclassed(blocks: bool) -> keras.Model:
    model = Towers()
    model(X[:1])
    return model


# kind: (builder, how `recompute` checkpoints it; None: hand-written blocks)
KINDS: dict[str, tuple[Callable[[bool], keras.Model], dict[str, Any] | None]] = {
    "sequential_blocks": (_sequential, None),
    "functional_blocks": (_functional, None),
    "dots_block": (_dots, None),
    "functional_recompute": (_plain_functional, {"strategy": "uniform:2", "batch_size": 8}),
    "sequential_recompute": (_plain_sequential, {"strategy": "sqrt", "batch_size": 8}),
    "subclassed_recompute": (_subclassed, {"strategy": "uniform:1", "sample": X[:8]}),
}
DISTRIBUTIONS = ["plain", "mirrored"]


@dataclasses.dataclass
class Case:
    """A checkpointed model, its control, and how to make them again."""

    kind: str
    distribution: str
    model: keras.Model
    control: keras.Model

    @property
    def recomputed(self) -> bool:
        return KINDS[self.kind][1] is not None

    def scope(self) -> Any:
        if self.distribution == "mirrored":
            return _mirrored().scope()
        return contextlib.nullcontext()

    def build(self, *, checkpointed: bool, compiled: bool = True) -> keras.Model:
        """A model of this kind, as a new process would build it."""
        builder, options = KINDS[self.kind]
        with self.scope():
            keras.utils.set_random_seed(0)
            model = builder(checkpointed and options is None)
            if compiled:
                _compile(model)
        if checkpointed:
            self.again(model)
        return model

    def again(self, model: keras.Model) -> keras.Model:
        """Checkpoints a model loaded from a file as the case's model is (outside the scope)."""
        options = KINDS[self.kind][1]
        if options is not None:
            options = dict(options)
            assert tfrecompute.recompute(model, options.pop("strategy"), **options) is model
        return model

    def plain(self, model: keras.Model) -> keras.Model:
        """The view of `model` whose weights the control's files hold."""
        return tfrecompute.unwrap(model)


_STRATEGY: list[Any] = []


def _mirrored() -> Any:
    if not _STRATEGY:
        _STRATEGY.append(worker.mirrored_strategy(["CPU:0", "CPU:1"]))
    return _STRATEGY[0]


def _compile(model: keras.Model) -> None:
    model.compile(optimizer=keras.optimizers.AdamW(1e-2, weight_decay=0.1), loss="mse")


def _case(kind: str, distribution: str) -> Case:
    empty = Case(kind, distribution, None, None)  # type: ignore[arg-type]
    model = empty.build(checkpointed=True)
    control = empty.build(checkpointed=False)
    control.set_weights(model.get_weights())
    made = Case(kind, distribution, model, control)
    _assert_checkpointed(made, model)
    return made


@pytest.fixture(
    params=[(k, d) for d in DISTRIBUTIONS for k in KINDS], ids=lambda p: f"{p[0]}-{p[1]}"
)
def case(request) -> Case:
    """Every kind, built plainly and under MirroredStrategy: for the paths that train
    or restore under the strategy."""
    return _case(*request.param)


@pytest.fixture(params=list(KINDS))
def plain_case(request) -> Case:
    """Every kind, built plainly: for the paths a strategy does not change."""
    return _case(request.param, "plain")


def _assert_checkpointed(case: Case, model: keras.Model) -> None:
    """`model` checkpoints: it holds blocks, or recompute applied some that recompute."""
    if not case.recomputed:  # hand-written blocks, as the user placed them
        assert any(isinstance(layer, RecomputeBlock) for layer in model._flatten_layers())
        return
    assert not any(isinstance(layer, RecomputeBlock) for layer in model._flatten_layers())
    assert applied_blocks(model)

    def run() -> None:
        with tf.GradientTape():
            model(X[:8], training=True)

    assert recomputed_blocks(model, run) > 0


def _fit(model: keras.Model, epochs: int = 1, **kwargs: Any) -> Any:
    return model.fit(X, Y, batch_size=8, epochs=epochs, shuffle=False, verbose=0, **kwargs)


def _values(variables: list[Any]) -> list[np.ndarray]:
    return [np.array(v.numpy()) for v in variables]


def _assert_same_optimizer(got: keras.Model, want: keras.Model, atol: float = 1e-6) -> None:
    got_values, want_values = _values(got.optimizer.variables), _values(want.optimizer.variables)
    assert len(got_values) == len(want_values)
    for a, b in zip(got_values, want_values):
        np.testing.assert_allclose(a, b, atol=atol, rtol=0)


def _seed_state(variable: Any) -> bool:
    return "seed_generator_state" in variable.path


# ------------------------------------------------------------------ .keras


def test_the_keras_file_loads_and_training_resumes_as_without_checkpointing(case, tmp_path):
    for model in (case.model, case.control):
        _fit(model, 2)
    assert_same_weights(case.model, case.control)
    case.model.save(tmp_path / "model.keras")
    case.control.save(tmp_path / "control.keras")
    with case.scope():
        loaded = keras.models.load_model(tmp_path / "model.keras")
        loaded_control = keras.models.load_model(tmp_path / "control.keras")
    assert type(loaded) is type(case.model)
    if case.recomputed:  # the file is the model as defined: checkpoint it again
        assert not tfrecompute.checkpoints(loaded)
        assert not any(isinstance(layer, RecomputeBlock) for layer in loaded._flatten_layers())
        case.again(loaded)
    _assert_checkpointed(case, loaded)
    assert_same_weights(loaded, case.model)
    _assert_same_optimizer(loaded, case.model)
    for model in (loaded, loaded_control):
        _fit(model, 1)
    assert_same_weights(loaded, loaded_control)
    _assert_same_optimizer(loaded, loaded_control)


# ---------------------------------------------------------------- weights


def test_weights_files_round_trip(plain_case, tmp_path):
    case = plain_case
    _fit(case.model, 1)
    case.model.save_weights(tmp_path / "model.weights.h5")
    fresh = case.build(checkpointed=True)
    fresh.load_weights(tmp_path / "model.weights.h5")
    assert_same_weights(fresh, case.model)


def test_weights_move_between_the_model_and_its_control_both_ways(plain_case, tmp_path):
    case = plain_case
    _fit(case.model, 1)
    case.plain(case.model).save_weights(tmp_path / "model.weights.h5")
    case.control.load_weights(tmp_path / "model.weights.h5")
    assert_same_weights(case.control, case.model)
    _fit(case.control, 1)  # now the control moves, and its file loads into the model
    case.control.save_weights(tmp_path / "control.weights.h5")
    case.plain(case.model).load_weights(tmp_path / "control.weights.h5")
    assert_same_weights(case.model, case.control)
    if case.recomputed:
        assert case.plain(case.model) is case.model  # the model's own file already is it
    else:  # hand-written blocks nest their layers' paths: a direct load fails loudly
        with pytest.raises(ValueError, match="could not be loaded"):
            case.model.load_weights(tmp_path / "control.weights.h5")


def test_get_and_set_weights_keep_the_order_both_ways(plain_case):
    case = plain_case
    _fit(case.model, 1)
    case.control.set_weights(case.model.get_weights())
    np.testing.assert_allclose(case.control(X), case.model(X), atol=1e-6)
    _fit(case.control, 1)
    case.model.set_weights(case.control.get_weights())
    np.testing.assert_allclose(case.model(X), case.control(X), atol=1e-6)


# ------------------------------------------------------- tf.train.Checkpoint


def _scrambled(variables: list[Any]) -> None:
    for variable in variables:
        if not _seed_state(variable):
            variable.assign(tf.cast(tf.fill(variable.shape, 3), variable.dtype))


def test_tf_train_checkpoint_restores_every_variable_of_the_model(plain_case, tmp_path):
    _assert_restores(plain_case, tmp_path, with_optimizer=False)


def test_tf_train_checkpoint_restores_the_model_and_its_optimizer(case, tmp_path):
    _assert_restores(case, tmp_path, with_optimizer=True)


def _assert_restores(case: Case, tmp_path: Any, *, with_optimizer: bool) -> None:
    _fit(case.model, 1)
    objects = {"model": case.model}
    variables = list(case.model.variables)
    if with_optimizer:
        objects["optimizer"] = case.model.optimizer
        variables += list(case.model.optimizer.variables)
    checkpoint = tf.train.Checkpoint(**objects)
    manager = tf.train.CheckpointManager(checkpoint, tmp_path, max_to_keep=2)
    manager.save()
    saved = _values(variables)
    _scrambled(variables)
    checkpoint.restore(manager.latest_checkpoint).assert_existing_objects_matched()
    for variable, value in zip(variables, saved):
        if not _seed_state(variable):
            np.testing.assert_array_equal(variable.numpy(), value, err_msg=variable.path)


def test_a_checkpoint_of_the_control_restores_into_the_model(plain_case, tmp_path):
    case = plain_case
    _fit(case.control, 1)
    path = tf.train.Checkpoint(model=case.control).save(tmp_path / "control")
    status = tf.train.Checkpoint(model=case.plain(case.model)).restore(path)
    status.assert_existing_objects_matched()
    for variable, want in zip(case.model.weights, case.control.weights):
        if not _seed_state(variable):
            np.testing.assert_array_equal(variable.numpy(), want.numpy(), err_msg=variable.path)


# ----------------------------------------------------------------- export


def test_an_export_serves_what_the_control_serves(plain_case, tmp_path):
    case = plain_case
    _fit(case.model, 1)
    case.control.set_weights(case.model.get_weights())
    want = case.control(X)
    case.model.export(tmp_path / "export", verbose=False)
    served = tf.saved_model.load(str(tmp_path / "export"))
    np.testing.assert_allclose(served.serve(X), want, atol=1e-6)
    tf.saved_model.save(case.model, str(tmp_path / "saved_model"))
    restored = tf.saved_model.load(str(tmp_path / "saved_model"))
    (got,) = restored.signatures["serving_default"](tf.constant(X)).values()
    np.testing.assert_allclose(got, want, atol=1e-6)


# -------------------------------------------------------------- callbacks


class _Interrupt(keras.callbacks.Callback):
    """Stops training with an error at a given (epoch, batch), as a lost machine would."""

    def __init__(self, epoch: int, batch: int) -> None:
        super().__init__()
        self.at, self.epoch = (epoch, batch), 0

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self.epoch = epoch

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        if (self.epoch, batch) == self.at:
            raise RuntimeError("interrupted")


# NOTE [ An interrupted fit's input pipeline ]
# A `fit` stopped by an exception leaves its tf.data iterators alive as long as the
# model (no other fit here leaves any: counted after each). Freeing one waits for a
# tf.data thread to wake (the autotuner's, in a stack taken during a wait), which
# sleeps twice as long at each wake, up to a minute: collected at the end of each test,
# as this file used to, they held single teardowns for tens of seconds. They are freed
# right away, while young, here; nothing else in this file needs a collection of its
# own.


def _resumed(case: Case, *, checkpointed: bool, folder: Any, save_freq: Any) -> keras.Model:
    """Trains 3 epochs, interrupted in the second, then resumed in a new model object."""
    first = case.build(checkpointed=checkpointed)
    backup = keras.callbacks.BackupAndRestore(str(folder), save_freq=save_freq)
    with pytest.raises(RuntimeError, match="interrupted"):
        _fit(first, 3, callbacks=[backup, _Interrupt(1, 3)])
    del first, backup
    gc.collect()  # NOTE [ An interrupted fit's input pipeline ]
    again = case.build(checkpointed=checkpointed)
    _fit(again, 3, callbacks=[keras.callbacks.BackupAndRestore(str(folder), save_freq=save_freq)])
    return again


def test_backup_and_restore_per_epoch_resumes_as_without_checkpointing(case, tmp_path):
    _assert_resumes(case, tmp_path, "epoch")


def test_backup_and_restore_every_2_batches_resumes_as_without_checkpointing(plain_case, tmp_path):
    _assert_resumes(plain_case, tmp_path, 2)


def _assert_resumes(case: Case, tmp_path: Any, save_freq: Any) -> None:
    got = _resumed(case, checkpointed=True, folder=tmp_path / "model", save_freq=save_freq)
    want = _resumed(case, checkpointed=False, folder=tmp_path / "control", save_freq=save_freq)
    _assert_checkpointed(case, got)
    assert_same_weights(got, want)
    assert any(
        not np.allclose(a, b) for a, b in zip(got.get_weights(), case.model.get_weights())
    )  # it trained


def test_model_checkpoint_writes_files_that_load(plain_case, tmp_path):
    case = plain_case
    for name, model in (("model", case.model), ("control", case.control)):
        path = str(tmp_path / f"{name}_{{epoch}}.keras")
        _fit(model, 2, callbacks=[keras.callbacks.ModelCheckpoint(path)])
    with case.scope():
        loaded = keras.models.load_model(tmp_path / "model_2.keras")
        loaded_control = keras.models.load_model(tmp_path / "control_2.keras")
    assert_same_weights(loaded, case.model)
    assert_same_weights(loaded, loaded_control)
    np.testing.assert_allclose(loaded(X), loaded_control(X), atol=1e-6)


# ---------------------------------------------------------------- upstream


def test_upstream_seed_states_are_not_saved(tmp_path):
    """Keras 3.15, no blocks: a `.keras` load resets a Dropout's seed state to its seed,
    and TensorFlow's object graph does not hold it. If this fails, Keras saves them now:
    compare resumed runs with uninterrupted ones and drop the seed-state exceptions."""
    keras.utils.set_random_seed(0)
    model = _plain_functional(False)
    _compile(model)
    _fit(model, 1)
    states = [v for v in model.variables if _seed_state(v)]
    assert states and all(int(v.numpy()[1]) > 0 for v in states)  # advanced by training
    model.save(tmp_path / "plain.keras")
    loaded = keras.models.load_model(tmp_path / "plain.keras")
    assert all(int(v.numpy()[1]) == 0 for v in loaded.variables if _seed_state(v))
    names = [n for n, _ in tf.train.list_variables(tf.train.Checkpoint(model=model).save(
        tmp_path / "plain"))]  # fmt: skip
    assert not any("seed_generator" in name for name in names)


def test_upstream_a_list_of_layers_is_not_in_a_tf_checkpoint(tmp_path):
    """keras-team/keras#19425, no blocks: a subclassed model holding its layers in a
    list attribute has no TensorFlow checkpoint children for them, and a restore leaves
    their BatchNormalization statistics as they were while the status check passes.
    (`RecomputeBlock` tracks its own layers for TensorFlow; see NOTE [ A block in
    TensorFlow's object graph ].) If this fails, Keras tracks such lists now."""

    class Listed(keras.Model):
        def __init__(self) -> None:
            super().__init__()
            self.body = [keras.layers.Dense(4), keras.layers.BatchNormalization()]

        def call(self, x: Any, training: Any = None) -> Any:
            for layer in self.body:
                x = layer(x, training=training)
            return x

    model = Listed()
    model(X, training=True)
    moving = [v for v in model.variables if "moving_mean" in v.path]
    path = tf.train.Checkpoint(model=model).save(tmp_path / "listed")
    saved = _values(moving)
    _scrambled(moving)
    tf.train.Checkpoint(model=model).restore(path).assert_existing_objects_matched()
    assert not np.allclose(moving[0].numpy(), saved[0])  # not restored
