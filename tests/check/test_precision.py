"""Mixed precision: check_precision findings, and training blocks in 16-bit."""

from __future__ import annotations

import dataclasses
import math
import re
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import (
    MODES,
    assert_same_values,
    forward_and_grads,
    highest_requested_trace,
    load_state,
    save_state,
)
from tfrecompute import RecomputeBlock
from tfrecompute.check.precision import PrecisionFinding, block_precision_findings, check_precision

POLICIES = ["mixed_float16", "mixed_bfloat16"]


@pytest.fixture(autouse=True)
def restore_dtype_policy():
    previous = keras.config.dtype_policy()
    yield
    keras.config.set_dtype_policy(previous)


def _x(shape=(8, 8), seed=0):
    return np.random.default_rng(seed).normal(size=shape).astype("float32")


def _summary(findings):
    return [(f.severity, f.path) for f in findings]


def _one(findings, severity, path, match):
    """Asserts exactly one finding, of that severity and path, whose message matches."""
    assert _summary(findings) == [(severity, path)], findings
    assert _matches(findings[0].message, match), findings[0].message
    assert findings[0].fix
    return findings[0]


def _matches(text, pattern):
    return re.search(pattern, text) is not None


# ------------------------------------------------------------ clean models


def test_clean_float32_model_has_no_findings():
    model = keras.Sequential(
        [keras.Input((8,)), RecomputeBlock([keras.layers.Dense(8), keras.layers.Dense(8)])],
        name="m",
    )
    model(_x())
    model.compile(optimizer="sgd", loss="mse")
    assert check_precision(model) == []


@pytest.mark.parametrize("policy", POLICIES)
def test_clean_mixed_model_has_no_findings(policy):
    keras.config.set_dtype_policy(policy)
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16),
            RecomputeBlock([keras.layers.Dense(16, activation="relu"), keras.layers.Dropout(0.1)]),
            RecomputeBlock([keras.layers.Dense(16), keras.layers.BatchNormalization()]),
            keras.layers.Dense(2, dtype="float32"),  # float32 outputs, outside any block
        ],
        name="m",
    )
    model(_x())
    model.compile(optimizer="adam", loss="mse")
    assert check_precision(model) == []


def test_compile_wraps_the_optimizer_only_under_a_mixed_float16_model_policy():
    """What Keras 3 does, which the loss-scale check relies on."""
    keras.config.set_dtype_policy("mixed_float16")
    wrapped = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    wrapped.compile(optimizer="sgd", loss="mse")
    assert isinstance(wrapped.optimizer, keras.optimizers.LossScaleOptimizer)
    not_auto = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    not_auto.compile(optimizer="sgd", loss="mse", auto_scale_loss=False)
    assert not isinstance(not_auto.optimizer, keras.optimizers.LossScaleOptimizer)
    keras.config.set_dtype_policy("float32")
    per_layer = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, dtype="mixed_float16")])
    per_layer.compile(optimizer="sgd", loss="mse")
    assert not isinstance(per_layer.optimizer, keras.optimizers.LossScaleOptimizer)


# --------------------------------------------------------------- loss scale


def _float16_model(name="m"):
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(8), RecomputeBlock([keras.layers.Dense(8)])],
        name=name,
    )
    model(_x())
    return model


def test_mixed_float16_without_loss_scaling_is_an_error():
    keras.config.set_dtype_policy("mixed_float16")
    model = _float16_model()
    model.compile(optimizer="sgd", loss="mse", auto_scale_loss=False)
    finding = _one(
        check_precision(model),
        "error",
        "m",
        r"2 layer\(s\) compute in float16 .*model's optimizer \(SGD\) is not a LossScaleOptimizer",
    )
    assert "LossScaleOptimizer(optimizer)" in finding.fix


def test_an_explicit_optimizer_overrides_the_compiled_one():
    keras.config.set_dtype_policy("mixed_float16")
    model = _float16_model()
    model.compile(optimizer="sgd", loss="mse")  # auto-wrapped: fine
    assert check_precision(model) == []
    _one(
        check_precision(model, optimizer=keras.optimizers.Adam()),
        "error",
        "m",
        r"the optimizer \(Adam\) is not a LossScaleOptimizer",
    )
    scaled = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam())
    assert check_precision(model, optimizer=scaled) == []


def test_layer_policies_of_mixed_float16_are_not_auto_wrapped():
    """Global float32, layers mixed_float16: compile keeps a plain optimizer."""
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(8, dtype="mixed_float16"),
            RecomputeBlock([keras.layers.Dense(8, dtype="mixed_float16")], dtype="mixed_float16"),
        ],
        name="m",
    )
    model(_x())
    _one(
        check_precision(model),
        "warning",
        "m",
        r"model's own policy is 'float32', so model.compile will not wrap",
    )
    model.compile(optimizer="sgd", loss="mse")
    _one(check_precision(model), "error", "m", r"is not a LossScaleOptimizer")


def test_uncompiled_mixed_float16_model_will_be_wrapped():
    keras.config.set_dtype_policy("mixed_float16")
    _one(check_precision(_float16_model()), "info", "m", r"model.compile will wrap")


def test_loss_scaling_under_bfloat16_is_info():
    keras.config.set_dtype_policy("mixed_bfloat16")
    model = _float16_model()
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD())
    _one(check_precision(model, optimizer=optimizer), "info", "m", r"do not need loss scaling")


def test_global_mixed_policy_that_the_layers_ignore_is_a_warning():
    model = _float16_model()  # created under float32
    keras.config.set_dtype_policy("mixed_bfloat16")
    _one(
        check_precision(model),
        "warning",
        "m",
        r"global dtype policy is 'mixed_bfloat16' but every layer of 'm' computes in 32-bit",
    )


# ------------------------------------------------------------------ blocks


def test_layers_of_one_block_in_different_dtypes():
    keras.config.set_dtype_policy("mixed_bfloat16")
    block = RecomputeBlock(
        [keras.layers.Dense(8, name="a"), keras.layers.Dense(8, dtype="float32", name="b")],
        name="blk",
    )
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8), block], name="m")
    model(_x())
    _one(
        check_precision(model),
        "warning",
        "m/blk",
        r"layers inside block 'blk' compute in different dtypes \(bfloat16: 'a'; float32: 'b'\)",
    )
    _one(block_precision_findings(block), "warning", "blk", r"different dtypes")


def test_block_policy_differs_from_its_layers():
    block = RecomputeBlock([keras.layers.Dense(8, dtype="mixed_bfloat16")], name="blk")
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(8, dtype="mixed_bfloat16"), block], name="m"
    )
    model(_x())
    finding = _one(
        check_precision(model),
        "warning",
        "m/blk",
        r"block 'blk' has the dtype policy 'float32' .* its layers compute in bfloat16",
    )
    assert "dtype='mixed_bfloat16'" in finding.fix


def test_block_findings_work_before_build_and_on_consistent_blocks():
    keras.config.set_dtype_policy("mixed_bfloat16")
    block = RecomputeBlock([keras.layers.Dense(8), keras.layers.Dense(8)])
    assert not block.built
    assert block_precision_findings(block) == []
    assert block_precision_findings(RecomputeBlock([keras.layers.Dropout(0.1)])) == []


def test_nested_blocks_and_models_are_walked():
    keras.config.set_dtype_policy("mixed_bfloat16")
    inner_model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(8, name="x16"),
            keras.layers.Dense(8, dtype="float32"),
        ],
        name="sub",
    )
    inner_block = RecomputeBlock([inner_model], name="inner")
    outer = RecomputeBlock([keras.layers.Dense(8), inner_block], name="outer")
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8), outer], name="m")
    model(_x())
    findings = check_precision(model)
    assert _summary(findings) == [("warning", "m/outer"), ("warning", "m/outer/inner")]
    assert all("different dtypes" in f.message for f in findings)


def test_subclassed_models_are_walked_without_a_graph():
    keras.config.set_dtype_policy("mixed_bfloat16")

    class Net(keras.Model):
        def __init__(self):
            super().__init__(name="net")
            self.stem = keras.layers.Dense(8, dtype="float32")
            self.block = RecomputeBlock(
                [keras.layers.Dense(8), keras.layers.Dense(8, dtype="float32")], name="blk"
            )

        def call(self, x):
            return self.block(self.stem(x))

    model = Net()
    model(_x())
    # The layer order is known, the data flow is not: no checkpoint finding.
    _one(check_precision(model), "warning", "net/blk", r"compute in different dtypes")


# ------------------------------------------------------------- checkpoints


def test_float32_layer_feeding_a_block_doubles_its_checkpoint():
    keras.config.set_dtype_policy("mixed_bfloat16")
    inputs = keras.Input((8,), name="x")
    hidden = keras.layers.Dense(8, dtype="float32", name="wide")(inputs)
    outputs = RecomputeBlock([keras.layers.Dense(8)], name="blk")(hidden)
    model = keras.Model(inputs, outputs, name="m")
    model(_x())
    finding = _one(
        check_precision(model),
        "warning",
        "m/blk",
        r"block 'blk' keeps its input in float32, produced by 'm/wide' \(policy 'float32'\)"
        r".*twice the memory of a bfloat16 one",
    )
    assert "'wide'" in finding.fix


def test_float32_layer_before_a_block_in_a_sequential_model():
    keras.config.set_dtype_policy("mixed_float16")
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(8),
            keras.layers.LayerNormalization(dtype="float32", name="norm"),
            RecomputeBlock([keras.layers.Dense(8)], name="blk"),
        ],
        name="m",
    )
    model(_x())
    model.compile(optimizer="sgd", loss="mse")
    _one(check_precision(model), "warning", "m/blk", r"produced by 'm/norm'")


def test_block_after_a_block_ending_in_float32_names_the_inner_layer():
    """Keras reports a block's output in the block's dtype; the real producer is inside."""
    keras.config.set_dtype_policy("mixed_bfloat16")
    first = RecomputeBlock(
        [keras.layers.Dense(8), keras.layers.Activation("linear", dtype="float32", name="out32")],
        name="first",
    )
    second = RecomputeBlock([keras.layers.Dense(8)], name="second")
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8), first, second], name="m")
    model(_x())
    findings = check_precision(model)
    assert _summary(findings) == [("warning", "m/first"), ("warning", "m/second")]
    assert "different dtypes" in findings[0].message
    assert "produced by 'm/first/out32'" in findings[1].message


def test_nested_model_input_is_followed_to_the_outer_producer():
    keras.config.set_dtype_policy("mixed_bfloat16")
    sub_in = keras.Input((8,))
    sub = keras.Model(
        sub_in, RecomputeBlock([keras.layers.Dense(8)], name="blk")(sub_in), name="sub"
    )
    inputs = keras.Input((8,))
    outputs = sub(keras.layers.Dense(8, dtype="float32", name="wide")(inputs))
    model = keras.Model(inputs, outputs, name="m")
    model(_x())
    _one(check_precision(model), "warning", "m/sub/blk", r"produced by 'm/wide'")


def test_float32_op_feeding_a_block_is_named():
    keras.config.set_dtype_policy("mixed_bfloat16")
    inputs = keras.Input((8,))
    hidden = keras.ops.cast(keras.layers.Dense(8)(inputs), "float32")
    model = keras.Model(
        inputs, RecomputeBlock([keras.layers.Dense(8)], name="blk")(hidden), name="m"
    )
    model(_x())
    _one(
        check_precision(model), "warning", "m/blk", r"produced by '.*cast.*' \(an op, not a layer\)"
    )


def test_float32_model_input_feeding_a_block_is_info():
    """Measured: no extra step memory (see test_bfloat16_checkpoints_halve_block_memory)."""
    keras.config.set_dtype_policy("mixed_bfloat16")
    model = keras.Sequential(
        [keras.Input((8,), name="x"), RecomputeBlock([keras.layers.Dense(8)], name="blk")],
        name="m",
    )
    model(_x())
    _one(
        check_precision(model),
        "info",
        "m/blk",
        r"keeps the model input 'x' \(float32\) .* costs no extra memory",
    )


def test_16_bit_layer_feeding_a_float32_block_is_fine():
    keras.config.set_dtype_policy("mixed_bfloat16")
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(8),
            RecomputeBlock([keras.layers.Dense(8, dtype="float32")], dtype="float32"),
        ],
        name="m",
    )
    model(_x())
    assert check_precision(model) == []


# --------------------------------------------------------------- variables


def test_16_bit_variables_under_a_mixed_policy():
    keras.config.set_dtype_policy("mixed_bfloat16")
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(8),
            RecomputeBlock(
                [keras.layers.Dense(8, dtype="bfloat16", name="pure")], dtype="bfloat16", name="blk"
            ),
        ],
        name="m",
    )
    model(_x())
    finding = _one(
        check_precision(model),
        "warning",
        "m/blk/pure",
        r"layer 'pure' \(policy 'bfloat16'\) has variables that are not float32 under a mixed "
        r"policy: kernel \(bfloat16\), bias \(bfloat16\)",
    )
    assert "mixed_bfloat16" in finding.fix


def test_unbuilt_layers_are_reported_as_info():
    keras.config.set_dtype_policy("mixed_bfloat16")
    model = keras.Sequential([RecomputeBlock([keras.layers.Dense(8, name="d")])], name="m")
    _one(check_precision(model), "info", "m", r"1 layer\(s\) are not built yet \(e.g. 'd'\)")


# -------------------------------------------------------------- the API


def test_findings_are_frozen_and_print_path_message_and_fix():
    finding = PrecisionFinding(severity="warning", path="m/b", message="bad.", fix="do x.")
    with pytest.raises(dataclasses.FrozenInstanceError):
        finding.path = "other"
    assert str(finding) == "m/b: bad. Fix: do x."


def test_findings_are_sorted_by_severity():
    keras.config.set_dtype_policy("mixed_float16")
    model = keras.Sequential(
        [
            keras.Input((8,)),
            RecomputeBlock([keras.layers.Dense(8), keras.layers.Dense(8, dtype="float32")]),
        ],
        name="m",
    )
    model(_x())
    severities = [f.severity for f in check_precision(model, optimizer=keras.optimizers.SGD())]
    assert severities == ["error", "warning", "info"]


def test_check_precision_accepts_a_single_layer():
    keras.config.set_dtype_policy("mixed_bfloat16")
    block = RecomputeBlock(
        [keras.layers.Dense(8), keras.layers.Dense(8, dtype="float32")], name="b"
    )
    block(_x())
    assert _summary(check_precision(block)) == [("warning", "b")]


def test_check_precision_rejects_a_non_layer():
    with pytest.raises(
        TypeError,
        match=r"check_precision: `model` must be a Keras model or layer. Received: "
        r"model='m' \(of type str\). Pass a keras.Model",
    ):
        check_precision("m")


def test_check_precision_rejects_a_non_optimizer():
    with pytest.raises(
        TypeError,
        match=r"check_precision: `optimizer` must be a Keras optimizer or None. Received: "
        r"optimizer='adam' \(of type str\)\. Pass an instance",
    ):
        check_precision(keras.layers.Dense(1), optimizer="adam")


def test_block_precision_findings_rejects_a_non_block():
    with pytest.raises(
        TypeError,
        match=r"block_precision_findings: `block` must be a RecomputeBlock. Received: "
        r"block=<Dense .*\(of type Dense\)\. Pass a tfrecompute.RecomputeBlock",
    ):
        block_precision_findings(keras.layers.Dense(1))


def test_block_warns_once_when_built_with_mixed_layers():
    block = RecomputeBlock([keras.layers.Dense(8, dtype="mixed_bfloat16"), keras.layers.Dense(8)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        block(_x())
        block(_x())
    messages = [str(w.message) for w in caught if "compute in different dtypes" in str(w.message)]
    assert len(messages) == 1


def test_symbolic_block_output_dtype_is_the_real_one():
    keras.config.set_dtype_policy("mixed_bfloat16")
    block = RecomputeBlock([keras.layers.Dense(8), keras.layers.Dense(8, dtype="float32")])
    symbolic = block(keras.Input((8,)))
    real = block(_x())
    assert symbolic.dtype == keras.backend.standardize_dtype(real.dtype) == "float32"


# ------------------------------------------------- training in mixed precision


def _mixed_layers():
    return [
        keras.layers.Dense(32, activation="relu"),
        keras.layers.Dropout(0.3, seed=1),
        keras.layers.BatchNormalization(momentum=0.5),
        keras.layers.Dense(16, activation="tanh"),
    ]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("policy", POLICIES)
def test_mixed_precision_gradients_match_unwrapped(policy, mode):
    keras.config.set_dtype_policy(policy)
    keras.utils.set_random_seed(0)
    layers = _mixed_layers()
    block = RecomputeBlock(layers)
    x = tf.constant(_x())
    block(x)

    def unwrapped(x, training=None):
        for layer in layers:
            x = layer(x, training=training)
        return x

    state = block.non_trainable_variables
    initial = save_state(state)
    got = forward_and_grads(block, [x], block.trainable_variables, mode)
    got_state = save_state(state)
    load_state(state, initial)
    want = forward_and_grads(unwrapped, [x], block.trainable_variables, mode)
    compute = keras.config.dtype_policy().compute_dtype
    assert got[0].dtype == want[0].dtype == np.dtype(compute)  # the output stays 16-bit
    # The recompute runs the same 16-bit ops on the same values: measured, the outputs,
    # gradients and statistics equal the unwrapped ones exactly (both policies, both
    # modes). 1e-6 of each tensor's scale is below one 16-bit rounding step, so an
    # error of 0.1% fails.
    assert_same_values(got, want, rtol=1e-6)
    assert_same_values(got_state, save_state(state), rtol=1e-6, what="state")


def _mlp(blocked, *, first_in_block=True):
    keras.utils.set_random_seed(0)
    layers = _mixed_layers()
    body = [RecomputeBlock(layers[:2]), RecomputeBlock(layers[2:])] if blocked else layers
    head = [] if first_in_block else [keras.layers.Dense(8)]
    model = keras.Sequential(
        [keras.Input((8,)), *head, *body, keras.layers.Dense(1, dtype="float32")]
    )
    model(_x()[:1])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    return model


@pytest.mark.parametrize("policy", POLICIES)
def test_fit_in_mixed_precision_matches_unwrapped(policy):
    keras.config.set_dtype_policy(policy)
    plain, blocked = _mlp(False), _mlp(True)
    for a, b in zip(blocked.variables, plain.variables):
        a.assign(b)
    assert isinstance(plain.optimizer, keras.optimizers.LossScaleOptimizer) == (
        policy == "mixed_float16"
    )
    x, y = _x((64, 8)), _x((64, 1), seed=1)
    losses = [
        m.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history["loss"]
        for m in (plain, blocked)
    ]
    assert all(math.isfinite(v) for v in losses[1])
    # Measured: equal losses, and equal variables but for a BatchNormalization gamma
    # under mixed_bfloat16, off by 6e-8 (one float32 rounding step at its 1.02).
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-6)
    for a, b in zip(blocked.variables, plain.variables):
        np.testing.assert_allclose(
            a.numpy().astype("float32"),
            b.numpy().astype("float32"),
            rtol=1e-6,
            atol=1e-6,
            err_msg=a.path,
        )


@pytest.mark.parametrize("blocked", [False, True], ids=["unwrapped", "blocked"])
def test_overflowing_step_is_skipped_by_the_loss_scale_optimizer(blocked):
    keras.config.set_dtype_policy("mixed_float16")
    model = _mlp(blocked)  # a block is the first layer: the overflow happens inside it
    optimizer = model.optimizer
    x, y = _x((16, 8)), _x((16, 1), seed=1)
    model.train_on_batch(x, y)
    scale = float(optimizer.dynamic_scale.numpy())
    before = save_state(model.trainable_variables)
    model.train_on_batch(x * 1e6, y)  # float16 overflows to inf inside the block
    assert float(optimizer.dynamic_scale.numpy()) == scale / 2
    for value, variable in zip(before, model.trainable_variables):
        np.testing.assert_array_equal(variable.numpy(), value, err_msg=variable.path)
    model.train_on_batch(x, y)  # the next finite step applies again
    assert float(optimizer.dynamic_scale.numpy()) == scale / 2
    assert any(not np.array_equal(v.numpy(), b) for v, b in zip(model.trainable_variables, before))


def _deep_mlp(policy, *, depth, width, block_size, float32_boundaries=False):
    keras.config.set_dtype_policy(policy)
    keras.utils.set_random_seed(0)
    dense = [keras.layers.Dense(width, activation="tanh") for _ in range(depth)]
    body = []
    for start in range(0, depth, block_size):
        if float32_boundaries:
            body.append(keras.layers.Activation("linear", dtype="float32"))
        body.append(RecomputeBlock(dense[start : start + block_size]))
    model = keras.Sequential(
        [keras.Input((width,)), *body, keras.layers.Dense(width, dtype="float32")]
    )
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    return model


def _checkpoints(trace):
    """The bytes of the blocks' outputs a step holds at its peak (kept for the backward)."""
    return [
        a.requested_bytes
        for a in trace.live_at_peak
        if "recompute_block" in a.op and not a.op.startswith("gradient_tape")
    ]


def test_bfloat16_checkpoints_halve_block_memory():
    """24 Dense(128, tanh) at batch 16384 in 6 blocks: the checkpoints are bf16, measured.

    Compared by requested peaks (`trace_step`): the allocator's rounding once
    made a bf16 step's allocator peak 69 MiB in CI. The float32 output layer,
    loss and weight gradients do not shrink, so bf16 is not a full half of the
    peak, and less than that on a CPU whose bf16 matmul gradients allocate
    float32 buffers (AVX2), by an amount that moves with the order ops run in.
    The checkpoints held at the peak are a half; the peak is below float32's.
    """
    depth, width, batch, block_size = 24, 128, 16384, 4
    x, y = _x((batch, width)), _x((batch, width), seed=1)
    sizes = dict(depth=depth, width=width, block_size=block_size)
    f32 = highest_requested_trace(_deep_mlp("float32", **sizes), x, y)
    bf16 = highest_requested_trace(_deep_mlp("mixed_bfloat16", **sizes), x, y)
    wide = highest_requested_trace(
        _deep_mlp("mixed_bfloat16", float32_boundaries=True, **sizes), x, y
    )
    checkpoint = batch * width * 2  # one block's output in bf16
    assert max(_checkpoints(bf16), default=0) == checkpoint, bf16.summary()
    assert max(_checkpoints(f32), default=0) == 2 * checkpoint, f32.summary()
    assert _checkpoints(bf16).count(checkpoint) >= depth // block_size - 2, bf16.summary()
    assert bf16.requested_peak_bytes < f32.requested_peak_bytes, (
        bf16.summary(),
        f32.summary(),
    )
    # A float32 layer in front of each block (what check_precision warns
    # about): each of the 6 checkpoints grows from 2 to 4 bytes per value.
    grown = wide.requested_peak_bytes - bf16.requested_peak_bytes
    assert grown >= 0.5 * (depth // block_size) * checkpoint, (wide.summary(), bf16.summary())
