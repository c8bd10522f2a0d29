"""recompute() on any Keras model: keras-hub backbones as built, layers that hold layers,
subclassed models, and a default plan that always helps.

Each model is compared with itself before it was checkpointed (an in-place
checkpoint changes the layers it shares with the original), in training mode,
eagerly and under `tf.function`, with the non-trainable state restored between
the two runs.
"""

from __future__ import annotations

import re
import warnings

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf

import tfrecompute
from tests import any_models
from tests.helpers import (
    MODES,
    applied_blocks,
    as_defined,
    assert_same_values,
    forward_and_grads,
    load_state,
    model_runner,
    recomputed_blocks,
    save_state,
)
from tfrecompute import RecomputeBlock, strategies
from tfrecompute.layers.in_place import checkpoint_in_place, checkpointed_in_place

NAMES = list(any_models.MODELS)


def _build(name: str, **sizes):
    keras.utils.set_random_seed(0)
    model, (x, y) = any_models.MODELS[name](**sizes)
    model(x)  # built, as a user's model is before training
    return model, x, y


def _per_tensor_errors(got, want):
    """Each tensor's largest error over max(its own scale, 1e-2 of the largest) (GUIDE.md)."""
    assert len(got) == len(want)
    largest = max((float(np.max(np.abs(w))) for w in want if w.size), default=1.0)
    errors = []
    for index, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape, index
        if w.size:
            scale = max(float(np.max(np.abs(w))), 1e-2 * largest, 1e-12)
            errors.append((float(np.max(np.abs(g - w))) / scale, index))
    return errors


def assert_close_per_tensor(got, want, *, rtol=1e-5, what=""):
    """Each tensor within `rtol` of max(its own scale, 1e-2 of the largest) (GUIDE.md)."""
    for error, index in _per_tensor_errors(got, want):
        assert error <= rtol, f"{what}tensor {index}: relative error {error:.3g}"


def _recomputing(model, x):
    """How many of the blocks applied to `model` recompute in one training call."""

    def run():
        with tf.GradientTape():
            model(x, training=True)

    return recomputed_blocks(model, run)


@pytest.mark.parametrize("name", NAMES)
def test_a_checkpointed_model_trains_like_the_original(name):
    model, x, _ = _build(name)
    _assert_sqrt_trains_like_the_original(model, x, MODES)


def assert_trains_like_before(model, x, modes, checkpoint, *, rtol=1e-5, blocks=1):
    """`checkpoint(model)` places blocks, at least `blocks` of which recompute in a training
    call; outputs, gradients and state of that call, and the inference outputs, equal the
    model's before it (measured before `checkpoint` runs: the control is the model as it was,
    not the same object with its checkpoints lifted). In each of `modes` ("eager",
    "function", or a list of them: one model built and checkpointed for all), from the
    same state."""
    modes = [modes] if isinstance(modes, str) else list(modes)
    flat = [tf.convert_to_tensor(v) for v in keras.tree.flatten(x)]
    trainable, state = model.trainable_variables, model.non_trainable_variables
    initial = save_state(state)
    want, want_state = {}, {}
    for mode in modes:
        load_state(state, initial)
        want[mode] = forward_and_grads(model_runner(model, x), flat, trainable, mode)
        want_state[mode] = save_state(state)
    load_state(state, initial)
    inference = keras.tree.flatten(model(x))
    assert checkpoint(model) is model
    assert _recomputing(model, x) >= blocks
    for got_output, want_output in zip(keras.tree.flatten(model(x)), inference):
        np.testing.assert_allclose(got_output, want_output, rtol=1e-5, atol=1e-6)
    for mode in modes:
        load_state(state, initial)
        got = forward_and_grads(model_runner(model, x), flat, trainable, mode)
        assert_close_per_tensor(got, want[mode], rtol=rtol, what=f"{mode}: ")
        assert_close_per_tensor(save_state(state), want_state[mode], what=f"{mode} state: ")


def _assert_sqrt_trains_like_the_original(model, x, modes, *, rtol=1e-5, blocks=1):
    """Gradients and state of `model` after a sqrt rewrite equal those before it."""

    def sqrt(m):
        plan = tfrecompute.plan(m, "sqrt", sample=x)
        assert plan.segments
        return tfrecompute.recompute(m, plan)

    assert_trains_like_before(model, x, modes, sqrt, rtol=rtol, blocks=blocks)


# keras.applications models at random init have gradients up to 1e8: the model
# itself, eagerly against under `tf.function`, differs by 1e-4 (DenseNet121) to
# 4e-3 (MobileNetV3Small) of the largest; recomputing reorders a few sums (2e-5).
MORE_RTOL = {"mobilenet_v3_small": 1e-4, "convnext_tiny": 1e-4}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(any_models.MORE_MODELS))
def test_more_models_train_like_the_original(name):
    keras.utils.set_random_seed(0)
    model, (x, _) = any_models.MORE_MODELS[name]()
    model(x)
    _assert_sqrt_trains_like_the_original(model, x, MODES, rtol=MORE_RTOL.get(name, 1e-5), blocks=2)


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_mixed_precision_keeps_each_decoder_layer_a_link(policy):
    """Each keras-hub decoder layer casts its half-precision input to float32 for its
    first norm; the stack must stay one link per layer, and train as without blocks."""
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(policy)
    try:
        keras.utils.set_random_seed(0)
        model, (x, _) = any_models.llama(layers=3)
        model(x)
        names = tfrecompute.profile(model, sample=x).names
        assert [n for n in names if n.startswith("transformer_layer")] == [
            f"transformer_layer_{i}" for i in range(3)
        ]
        _assert_sqrt_trains_like_the_original(model, x, "function", rtol=1e-3, blocks=2)
    finally:
        keras.config.set_dtype_policy(previous)


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_a_tied_embedding_trains_and_saves(policy, tmp_path):
    """Gemma's token embedding is called twice (embedding, and reversed for the
    logits, where under a mixed policy it computes in another dtype than recorded).

    bfloat16 keeps 8 bits, and TensorFlow fuses the model's ops differently eagerly
    and under `tf.function`: the model alone gives other gradients in the two, by
    percents. Recomputing may differ from the model by no more than 1.5 times that."""
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(policy)
    try:
        keras.utils.set_random_seed(0)
        backbone = keras_hub.models.GemmaBackbone(
            vocabulary_size=100, num_layers=3, num_query_heads=2, num_key_value_heads=1,
            hidden_dim=32, intermediate_dim=64, head_dim=16,
        )  # fmt: skip
        model = keras_hub.models.GemmaCausalLM(backbone, preprocessor=None)
        x = any_models._tokens(2, 8)
        model(x)
        rtol = 1e-5
        if policy != "float32":
            flat = [tf.convert_to_tensor(v) for v in keras.tree.flatten(x)]
            runs = [
                forward_and_grads(model_runner(model, x), flat, model.trainable_variables, mode)
                for mode in MODES
            ]
            spread = max(error for error, _ in _per_tensor_errors(*runs))
            assert spread < 0.1  # a comparison that can still fail
            rtol = 1.5 * spread
        _assert_sqrt_trains_like_the_original(model, x, "function", rtol=rtol, blocks=2)
        model.save(tmp_path / "gemma.keras")
        loaded = keras.models.load_model(tmp_path / "gemma.keras")
        np.testing.assert_allclose(loaded(x), model(x), atol=1e-6)
    finally:
        keras.config.set_dtype_policy(previous)


@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_a_backbone_keeps_its_unknown_dimensions(name):
    model, x, _ = _build(name)
    assert None in tuple(model.inputs[0].shape)[1:]  # (None, None) token ids, as built
    tfrecompute.recompute(model, sample=x)
    runtime = tfrecompute.checkpoints(model).runtime
    assert [tuple(t.shape) for t in runtime.inputs] == [tuple(t.shape) for t in model.inputs]
    longer = keras.tree.map_structure(lambda a: np.concatenate([a, a], axis=1), x)
    assert _recomputing(model, longer) >= 1
    initial = save_state(model.non_trainable_variables)  # dropout's seed states
    with tf.GradientTape():
        got = model(longer, training=True)
    load_state(model.non_trainable_variables, initial)
    want = as_defined(model)(longer, training=True)
    np.testing.assert_allclose(keras.tree.flatten(got)[0], keras.tree.flatten(want)[0], atol=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_fit_runs_and_the_model_round_trips(name, tmp_path):
    model, x, y = _build(name)
    tfrecompute.recompute(model, sample=x)
    model.compile(optimizer=keras.optimizers.AdamW(1e-3), loss="mse")
    before = save_state(model.trainable_variables)
    model.fit(x, y, epochs=2, verbose=0)
    assert any(not np.allclose(a, b) for a, b in zip(before, save_state(model.trainable_variables)))
    path = tmp_path / f"{name}.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    assert type(loaded) is type(model) and not tfrecompute.checkpoints(loaded)
    np.testing.assert_allclose(
        keras.tree.flatten(loaded(x))[0], keras.tree.flatten(model(x))[0], atol=1e-5
    )


def test_vit_round_trips_although_its_embedding_config_cannot(tmp_path):
    """keras-hub 0.32's ViTPatchingAndEmbedding returns `num_patches` and
    `num_positions` from get_config, which its __init__ refuses: a plain
    Functional model around ViT's layers cannot be loaded. A checkpointed
    ViTBackbone is the backbone, which saves its constructor arguments."""
    model, x, y = _build("vit")
    embedding = model.get_layer("vit_patching_and_embedding")
    with pytest.raises(TypeError, match="Unrecognized keyword arguments.*num_patches"):
        type(embedding).from_config(embedding.get_config())  # the upstream bug
    tfrecompute.recompute(model, sample=x)
    model.compile(optimizer="adam", loss="mse")
    model.fit(x, y, epochs=1, verbose=0)
    model.save(tmp_path / "vit.keras")
    loaded = keras.models.load_model(tmp_path / "vit.keras")
    np.testing.assert_allclose(loaded(x), model(x), atol=1e-5)


def _more(name, seed=0):
    keras.utils.set_random_seed(seed)
    model, (x, _) = any_models.MORE_MODELS[name]()
    outputs = model(x)
    y = keras.tree.map_structure(lambda t: np.ones(t.shape, "float32"), outputs)
    return model, x, y


def test_a_layer_in_two_blocks_saves_and_loads(tmp_path):
    """ALBERT's one transformer layer is called at every depth: with `sqrt` its
    calls sit in two blocks, which no saved file sees."""
    model, x, y = _more("albert")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        tfrecompute.recompute(model, "sqrt", sample=x)
    shared = model.get_layer("group_0_inner_layer_0")
    assert sum(shared in block._flatten_layers() for block in applied_blocks(model)) >= 2
    model.compile(optimizer="adam", loss="mse")
    model.fit(x, y, epochs=1, verbose=0)
    model.save(tmp_path / "albert.keras")
    loaded = keras.models.load_model(tmp_path / "albert.keras")
    for a, b in zip(keras.tree.flatten(loaded(x)), keras.tree.flatten(model(x))):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_llama_round_trips_although_its_layer_config_cannot(tmp_path):
    """keras-hub 0.32's Llama decoder layers cannot give their config; the
    checkpointed backbone saves its constructor arguments, as without checkpointing."""
    model, x, y = _more("llama")
    decoder = model.get_layer("transformer_layer_0")
    with pytest.raises(AttributeError, match="rope_scaling_factor"):
        decoder.get_config()  # keras-hub 0.32: the upstream bug
    tfrecompute.recompute(model, sample=x)
    model.compile(optimizer="adam", loss="mse")
    model.fit(x, y, epochs=1, verbose=0)
    model.save(tmp_path / "llama.keras")
    loaded = keras.models.load_model(tmp_path / "llama.keras")
    np.testing.assert_allclose(loaded(x), model(x), atol=1e-6)


def test_vit_plans_over_its_encoder_blocks():
    model, x, _ = _build("vit")
    chain = tfrecompute.profile(model, sample=x)
    blocks = [name for name in chain.names if "transformer_block" in name]
    assert len(blocks) == 4 and all(chain.allowed(i, i + 1) for i in range(chain.n))
    shallow = tfrecompute.profile(model, sample=x, depth=0)
    assert shallow.n == 2  # the embedding and the whole encoder: nothing to plan


def test_a_layer_of_single_calls_in_code_stays_one_call():
    """HGNetV2's stages hold blocks holding conv, norm and activation layers, called in
    code: each conv layer and stem is one link (checkpointed in place whole), not three
    links of which a plan could only recompute one at a time."""
    keras.utils.set_random_seed(0)
    model, (x, _) = any_models.hgnetv2()
    chain = tfrecompute.profile(model, sample=x)
    assert "embedder/embedder_stem1" in chain.names
    assert not any(name.endswith(("_conv", "_bn", "_relu")) for name in chain.names)
    tfrecompute.recompute(model, sample=x)
    blocks = tfrecompute.checkpoints(model).blocks
    assert blocks and all(checkpointed_in_place(b.inner[0]) for b in blocks)
    assert _recomputing(model, x) == len(blocks)


class _Fuse(keras.layers.Layer):
    """Called with the stage's residual beside its input, as DepthAnything's fusion
    stages are (by keyword, with a Python number)."""

    def __init__(self, width, **kwargs):
        super().__init__(**kwargs)
        self.inner = keras.layers.Dense(width, activation="tanh")
        self.outer = keras.layers.Dense(width, activation="tanh")

    def call(self, x, residual, scale=1.0):
        return self.outer(self.inner(x) + scale * residual)


class _Fusions(keras.layers.Layer):
    def __init__(self, width, **kwargs):
        super().__init__(**kwargs)
        self.stem = keras.layers.Dense(width)
        self.stages = [_Fuse(width, name=f"fuse_{i}") for i in range(3)]

    def call(self, x):
        residual = self.stem(x)
        for stage in self.stages:
            x = stage(x, residual=residual, scale=0.5)
        return x


def _fusion_task(width=64):
    inputs = keras.Input((width,))
    backbone = keras.Model(inputs, _Fusions(width, name="fusions")(inputs), name="backbone")
    task_inputs = keras.Input((width,))
    return backbone, keras.Model(task_inputs, keras.layers.Dense(4)(backbone(task_inputs)))


@pytest.mark.parametrize("mode", MODES)
def test_a_task_around_a_backbone_checkpointed_in_place_with_extra_arguments(mode):
    """keras-hub's task tests checkpoint the backbone, then the task built on it: the
    task's profile meets in-place blocks called with more than their input (it raised
    "takes extra arguments" on DepthAnything's depth estimator), and prices each from
    its layer's own call. The control is a twin never checkpointed, with the same
    weights."""
    keras.utils.set_random_seed(0)
    _, control = _fusion_task()
    backbone, task = _fusion_task()
    task.set_weights(control.get_weights())
    x = np.random.default_rng(0).normal(size=(256, 64)).astype("float32")
    flat = [tf.convert_to_tensor(x)]
    want = forward_and_grads(model_runner(control, x), flat, control.trainable_variables, mode)
    tfrecompute.recompute(backbone, where=_Fuse, sample=x)
    blocks = tfrecompute.checkpoints(backbone).blocks
    assert len(blocks) >= 2
    chain = tfrecompute.profile(task, sample=x)
    fused = [i for i, name in enumerate(chain.names) if any(b.name in name for b in blocks)]
    assert len(fused) == len(blocks) and all(chain.workspace_bytes[i] > 0 for i in fused)
    tfrecompute.recompute(task, sample=x)
    assert _recomputing(task, x) >= 1
    got = forward_and_grads(model_runner(task, x), flat, task.trainable_variables, mode)
    assert_close_per_tensor(got, want)


def test_a_subclassed_model_is_checkpointed_in_place():
    model, x, _ = _build("loop_transformer")
    chain = tfrecompute.profile(model, sample=x)
    assert [name for name in chain.names if name.startswith("block_")] == [
        f"block_{i}" for i in range(4)
    ]
    glue = [i for i, name in enumerate(chain.names) if "_ops" in name]
    assert glue and all(chain.max_stop[i] == i for i in glue)  # its own ops stay stored
    assert tfrecompute.recompute(model, sample=x) is model
    assert tfrecompute.checkpoints(model).runtime is None  # nothing to rebuild: in place
    assert any(checkpointed_in_place(block) for block in model.blocks)
    assert _recomputing(model, x) >= 1


@pytest.mark.parametrize("mode", MODES)
def test_a_layer_called_with_its_input_by_keyword_is_checkpointed_in_place(mode):
    """Bloom's decoder layer calls its attention as `self._self_attention_layer(
    hidden_states=..., attention_mask=...)`: an in-place block around it takes the
    keyword input as the block's input. Gradients equal the model's before the blocks."""
    keras.utils.set_random_seed(0)
    model = keras_hub.models.BloomBackbone(
        vocabulary_size=100, num_layers=2, num_heads=2, hidden_dim=16, intermediate_dim=32,
        dropout=0.1,
    )  # fmt: skip
    x = any_models._tokens(2, 8)
    model(x)
    flat = [tf.convert_to_tensor(v) for v in keras.tree.flatten(x)]
    state = save_state(model.non_trainable_variables)
    variables = model.trainable_variables
    want = forward_and_grads(model_runner(model, x), flat, variables, mode)  # no blocks yet
    attention = [layer._self_attention_layer for layer in model.transformer_layers]
    blocks = [checkpoint_in_place(layer) for layer in attention]
    seen = []
    original = RecomputeBlock._recomputed_call

    def counting(self, frame):
        seen.append(self)
        return original(self, frame)

    load_state(model.non_trainable_variables, state)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(RecomputeBlock, "_recomputed_call", counting)
        got = forward_and_grads(model_runner(model, x), flat, variables, mode)
    assert set(map(id, seen)) == set(map(id, blocks))  # traced once per block, or run once
    assert_same_values(got, want, rtol=1e-5)


def test_a_subclassed_layer_holding_a_sequential_gets_blocks_of_its_layers():
    model, x, _ = _build("towers")
    chain = tfrecompute.profile(model, sample=x)
    prefix = f"tower_1/{model.get_layer('tower_1').body.name}/"
    body = [i for i, name in enumerate(chain.names) if name.startswith(prefix)]
    assert len(body) == 8 and chain.max_stop[body[0]] == body[-1] + 1  # one region
    plan = strategies.Plan.from_segments(chain, [(body[0], body[-1] + 1)])
    tfrecompute.recompute(model, plan)
    assert "call" in vars(model.get_layer("tower_1").body)  # routed to a rebuilt Sequential


@pytest.mark.parametrize("where", ["class", "names", "predicate"])
def test_where_makes_each_selected_call_a_block(where):
    model, x, _ = _build("bert", layers=3)
    encoder = keras_hub.layers.TransformerEncoder
    selection = {
        "class": encoder,
        "names": [f"transformer_layer_{i}" for i in range(3)],
        "predicate": lambda layer: isinstance(layer, encoder),
    }[where]
    plan = tfrecompute.plan(model, sample=x, where=selection)
    names = [plan.chain.names[s] for s, e in plan.segments]
    assert names == [f"transformer_layer_{i}" for i in range(3)]
    assert all(e == s + 1 for s, e in plan.segments)
    tfrecompute.recompute(model, plan)
    assert len(applied_blocks(model)) == 3 and _recomputing(model, x) == 3


def test_where_with_a_budget_chooses_among_the_selected_calls():
    model, x, _ = _build("bert", layers=3)
    everything = tfrecompute.plan(model, sample=x, where=keras_hub.layers.TransformerEncoder)
    stored = strategies.none(everything.chain).peak_bytes
    budget = (stored + everything.peak_bytes) // 2
    chosen = tfrecompute.plan(
        model, sample=x, where=keras_hub.layers.TransformerEncoder, budget=budget, headroom=0
    )
    assert 0 < len(chosen.segments) <= 3 and chosen.peak_bytes <= budget
    # The default strategy with where= weighs a budget's policy states as optimal does.
    assert chosen.chain.policy_names == ("attention", "dots")


def test_a_model_that_holds_blocks_is_planned_with_their_recompute():
    model, x, y = _build("bert", layers=4, hidden=128, sequence=64, batch=8)
    original = tfrecompute.plan(model, "uniform:1", sample=x)
    tfrecompute.recompute(model, original)
    # The rebuilt model the checkpointed model runs holds the blocks as its layers.
    runtime = tfrecompute.checkpoints(model).runtime
    assert any(isinstance(layer, RecomputeBlock) for layer in runtime.layers)
    again = tfrecompute.profile(runtime, sample=x)
    blocks = [i for i, name in enumerate(again.names) if name.startswith("recompute_")]
    assert blocks and all(again.max_stop[i] == i for i in blocks)  # never nested in another
    predicted = strategies.none(again).peak_bytes
    # Profiled as plain layers, the blocks hid their recompute (17.4 against 164.5 MiB
    # on a BERT): now the stored rewritten model predicts what its plan predicted.
    assert abs(predicted / original.peak_bytes - 1) < 0.25, (predicted, original.peak_bytes)


def test_the_default_plan_is_on_the_frontier():
    model, x, _ = _build("bert", layers=3)
    chosen = tfrecompute.plan(model, sample=x)
    frontier = strategies.frontier(chosen.chain)
    assert not any(
        p.peak_bytes <= chosen.peak_bytes
        and p.recompute_cost < chosen.recompute_cost
        or p.peak_bytes < chosen.peak_bytes
        and p.recompute_cost <= chosen.recompute_cost
        for p in frontier
    )
    assert chosen.peak_bytes < strategies.none(chosen.chain).peak_bytes


def test_a_default_plan_that_saves_nothing_warns_and_names_the_link():
    inputs = keras.Input((64,))
    model = keras.Model(inputs, keras.layers.Dense(4096, activation="tanh")(inputs))
    with pytest.warns(UserWarning, match=r"no plan lowers this model's predicted peak.*'dense"):
        tfrecompute.plan(model, batch_size=8)


def test_a_plan_under_where_that_saves_nothing_points_at_where():
    """The link keeping the most is outside the selection: the warning says to add it
    to where=, not to reach for depth= (where= replaces depth's expansion)."""
    inputs = keras.Input((64,))
    h = keras.layers.Dense(4096, activation="tanh", name="wide")(inputs)
    h = keras.layers.Dense(4096, activation="tanh", name="wide_too")(h)
    for index in range(3):
        h = keras.layers.Dense(256, activation="tanh", name=f"narrow_{index}")(h)
    model = keras.Model(inputs, keras.layers.Dense(4)(h))
    with pytest.warns(UserWarning, match="no plan lowers") as caught:
        tfrecompute.plan(model, batch_size=64, where=["wide_too", "narrow_0"])
    said = str(caught[0].message)
    assert "Link 'wide'" in said and "add it, or its sub-layers, to where=" in said
    assert "depth=" not in said


@pytest.mark.parametrize("strategy", ["sqrt", "uniform:1"])
def test_a_named_strategy_that_saves_nothing_warns(strategy):
    """Cut by link count, these plans recompute the two wide layers of a short chain
    and predict a higher peak than storing everything."""
    model = keras.Sequential(
        [keras.Input((32,)), keras.layers.Dense(256, activation="relu"),
         keras.layers.Dense(256, activation="relu"), keras.layers.Dense(4)]
    )  # fmt: skip
    with pytest.warns(UserWarning, match=rf"plan '{strategy}' predicts a peak of .* not below "
                      r"storing everything .* No plan predicts less"):  # fmt: skip
        made = tfrecompute.plan(model, strategy, batch_size=64)
    assert made.peak_bytes >= strategies.none(made.chain).peak_bytes
    model, x, _ = _build("bert")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # a plan that lowers the peak: silent
        tfrecompute.plan(model, "sqrt", sample=x)


def test_weightless_preprocessing_is_never_put_in_a_block():
    model = keras.applications.EfficientNetB0(weights=None, input_shape=(32, 32, 3), classes=3)
    plan = tfrecompute.plan(model, "sqrt", batch_size=2)  # one profile: the slow part
    chain = plan.chain
    # Rescaling, normalization and padding (merged: no backward reads between them).
    assert re.match(r"rescaling(_\d+)?\+normalization", chain.names[0])  # _2: a model before
    assert chain.max_stop[0] == 0 and chain.max_stop[1] > 1
    assert all(s > 0 for s, _ in plan.segments)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "recompute is pointless" block
        tfrecompute.recompute(model, plan)
    assert tfrecompute.checkpoints(model).plan == plan


# --------------------------------------------------------------- bad input


def test_where_matching_nothing_is_an_error():
    model, x, _ = _build("bert")
    with pytest.raises(ValueError, match=r"recompute: `where` selects no layer call.*Received"):
        tfrecompute.recompute(model, sample=x, where=keras.layers.Conv2D)
    with pytest.raises(TypeError, match=r"`where` must be a layer class"):
        tfrecompute.recompute(model, sample=x, where=3)


def test_a_sample_that_does_not_fit_the_inputs_is_an_error():
    model, x, _ = _build("bert")
    # What the user passed comes first, then what the model takes; inputs by their names.
    mismatch = r"plan: the sample's inputs \(a dict with keys \['token_ids'\]\) do not match "
    with pytest.raises(ValueError, match=mismatch + r"the model's inputs \(a dict with keys"):
        tfrecompute.plan(model, sample={"token_ids": x["token_ids"]})
    wrong = {**x, "token_ids": x["token_ids"][:, :, None]}
    shape = r"plan: a sample input of shape \(4, 32, 1\) does not fit the model input 'token_ids'"
    with pytest.raises(ValueError, match=shape):
        tfrecompute.plan(model, sample=wrong)
    sequential = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    with pytest.raises(ValueError, match=r"does not fit the model's input of shape \(None, 8\)"):
        tfrecompute.plan(sequential, sample=np.ones((2, 9), "float32"))
    with pytest.raises(TypeError, match=r"plan: the sample is not a batch of arrays"):
        tfrecompute.plan(model, sample={"token_ids": "abc", "padding_mask": 1, "segment_ids": 2})


def test_a_negative_depth_is_an_error():
    model, x, _ = _build("vit")
    with pytest.raises(ValueError, match=r"profile: `depth` must not be negative"):
        tfrecompute.profile(model, sample=x, depth=-1)


def test_an_untraceable_subclassed_model_names_the_layer():
    class Branchy(keras.layers.Layer):
        def call(self, x):
            if float(keras.ops.sum(x)) > 0:  # a Python branch on a tensor value
                return x
            return -x

    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(4)
            self.branchy = Branchy(name="branchy")

        def call(self, x):
            return self.branchy(self.dense(x))

    net = Net()
    net(np.ones((1, 4), "float32"))
    sample = np.ones((2, 4), "float32")
    untraceable = r"cannot be traced symbolically.*layer 'branchy'"
    with pytest.raises(tfrecompute.UntraceableModelError, match=untraceable):
        tfrecompute.plan(net, sample=sample)
    with pytest.raises(ValueError, match=untraceable):  # a budget it would not be held to
        tfrecompute.recompute(net, budget="1GiB", sample=sample)
    # Without a budget it is left as it was, and says so once (NOTE [ A model whose
    # call cannot be traced ]).
    with pytest.warns(UserWarning, match=r"recompute: nothing is recomputed, so the model") as w:
        assert tfrecompute.recompute(net, sample=sample) is net
    assert len([x for x in w if issubclass(x.category, UserWarning)]) == 1
    record = tfrecompute.checkpoints(net)
    assert not record and re.search(untraceable, record.note)
    # Nor does `fit`'s compiled step trace it, with no tfrecompute in the way.
    net.compile(optimizer="sgd", loss="mse")
    with pytest.raises(TypeError, match="SymbolicTensor"):
        net.fit(sample, np.ones((2, 4), "float32"), epochs=1, verbose=0)
