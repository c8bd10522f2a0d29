"""trace_step(): the allocator's events of one step, replayed up to its peak."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfrecompute
from tfrecompute.check.measure import _allocator_matches, _replay

WIDTH, BATCH = 1024, 512  # each activation is 2 MiB: above the CPU allocator's 256 KiB floor


def _mlp(depth=4):
    layers = [keras.layers.Dense(WIDTH, activation="tanh") for _ in range(depth)]
    model = keras.Sequential([keras.Input((256,)), *layers, keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    return model


def _batch():
    rng = np.random.default_rng(0)
    return rng.normal(size=(BATCH, 256)).astype("float32"), rng.normal(size=(BATCH, 1)).astype(
        "float32"
    )


def test_trace_finds_the_activations_live_at_the_peak():
    model = _mlp()
    trace = tfrecompute.trace_step(model, *_batch())
    assert trace.device == "CPU:0"
    # The requested peak can even exceed the allocator's when the step frees
    # buffers of an earlier step that held more than they asked for.
    assert trace.requested_peak_bytes > 0 and trace.peak_bytes > 0
    assert trace.allocator_overhead_bytes == trace.peak_bytes - trace.requested_peak_bytes
    for allocation in trace.live_at_peak:
        assert 0 < allocation.requested_bytes <= allocation.allocated_bytes
    sizes = [a.allocated_bytes for a in trace.live_at_peak]
    assert sizes == sorted(sizes, reverse=True)
    # The peak is in the backward pass: the tanh outputs its gradients read
    # are live, each exactly one activation's bytes.
    tanh = [a for a in trace.live_at_peak if a.op.endswith("/Tanh")]
    assert tanh, trace.summary(20)
    assert {a.shape for a in tanh} == {f"[{BATCH},{WIDTH}]"}
    assert {a.requested_bytes for a in tanh} == {BATCH * WIDTH * 4}
    # How many of the four are still live depends on when in the backward pass
    # the allocator's peak falls (2 to 4 seen: a weight copied by SGD's update
    # into a larger chunk can set it late).
    assert 1 <= len(tanh) <= 4, trace.summary(20)


def test_trace_sees_recompute_keep_fewer_activations():
    x, y = _batch()
    model = _mlp(depth=8)

    def activations(strategy):
        tfrecompute.recompute(model, strategy)
        trace = tfrecompute.trace_step(model, x, y)
        shape = f"[{BATCH},{WIDTH}]"
        return sum(a.requested_bytes for a in trace.live_at_peak if a.shape == shape), trace

    stored, plain_trace = activations("none")
    kept, blocked_trace = activations("sqrt")
    assert kept < stored, (plain_trace.summary(20), blocked_trace.summary(20))
    assert blocked_trace.requested_peak_bytes < plain_trace.requested_peak_bytes


def test_summary_names_the_peak_and_its_largest_buffers():
    trace = tfrecompute.trace_step(_mlp(), *_batch())
    text = trace.summary(top=3)
    lines = text.splitlines()
    assert lines[0].startswith(
        f"peak {tfrecompute.strategies.format_bytes(trace.peak_bytes)} on CPU:0"
    )
    assert len(lines) == 1 + min(3, len(trace.live_at_peak))
    assert trace.live_at_peak[0].op in lines[1]


MIB = 2**20


def _event(kind, address, requested, allocated, op="op"):
    name = "MemoryAllocation" if kind == "+" else "MemoryDeallocation"
    stats = {"addr": address, "requested_bytes": requested, "allocation_bytes": allocated}
    return (name, {**stats, "tf_op": op, "shape": "[1]"})


def test_replay_counts_buffers_freed_from_before_the_step():
    # A variable's previous buffer (6 MiB chunk for 4 MiB) is freed, a tight
    # 4 MiB buffer takes its place, then 2 MiB more: 2 MiB requested above
    # the start, and 0 MiB more allocated at the end than at the start.
    events = [
        _event("-", 1, 4 * MIB, 6 * MIB),
        _event("+", 2, 4 * MIB, 4 * MIB, op="copy"),
        _event("+", 3, 2 * MIB, 2 * MIB, op="activation"),
    ]
    replay = _replay(events)
    assert replay.requested_peak == 2 * MIB
    assert replay.peak == 0
    assert replay.live_at_peak == ()


def test_replay_finds_the_peak_and_what_is_live_then():
    events = [
        _event("+", 1, 3 * MIB, 4 * MIB, op="a"),
        _event("+", 2, 2 * MIB, 2 * MIB, op="b"),
        _event("-", 1, 3 * MIB, 4 * MIB),
        _event("+", 1, 5 * MIB, 5 * MIB, op="c"),  # the address is used again
        _event("-", 2, 2 * MIB, 2 * MIB),
    ]
    replay = _replay(events)
    assert replay.peak == 7 * MIB  # b and c
    assert replay.requested_peak == 7 * MIB
    assert [a.op for a in replay.live_at_peak] == ["c", "b"]
    assert [a.allocated_bytes for a in replay.live_at_peak] == [5 * MIB, 2 * MIB]


@pytest.mark.parametrize(
    ("allocator", "device", "expected"),
    [
        ("mklcpu", "CPU:0", True),
        ("cpu", "/device:CPU:0", True),
        ("GPU_0_bfc", "CPU:0", False),
        ("GPU_0_bfc", "GPU:0", True),
        ("GPU_1_bfc", "GPU:0", False),
        ("GPU_1_bfc", "/device:GPU:1", True),
    ],
)
def test_allocator_events_are_those_of_the_device(allocator, device, expected):
    assert _allocator_matches(allocator, tf.DeviceSpec.from_string(device)) is expected


def test_trace_refuses_while_another_profiler_runs(tmp_path):
    model = _mlp(depth=1)
    tf.profiler.experimental.start(str(tmp_path))
    try:
        with pytest.raises(RuntimeError, match=r"trace_step: another TensorFlow profiler"):
            tfrecompute.trace_step(model, *_batch())
    finally:
        tf.profiler.experimental.stop()


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (
            lambda: tfrecompute.trace_step(keras.layers.Dense(1), np.ones((1, 2))),
            TypeError,
            r"trace_step: `model` must be a Keras model\..*\(of type Dense\)",
        ),
        (
            lambda: tfrecompute.trace_step(
                keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]), np.ones((1, 2))
            ),
            ValueError,
            r"trace_step: the model is not compiled\..*model\.compile",
        ),
        (
            lambda: tfrecompute.trace_step(_mlp(depth=1), None),
            ValueError,
            r"trace_step: `x` is missing",
        ),
        (
            lambda: tfrecompute.trace_step(_mlp(depth=1), *_batch(), warmup=0),
            ValueError,
            r"trace_step: `warmup` must be at least 1\. Received: warmup=0",
        ),
        (
            lambda: tfrecompute.trace_step(_mlp(depth=1), *_batch(), device="TPU:0"),
            ValueError,
            r"trace_step: no TPU:0 device is available",
        ),
    ],
    ids=["not-a-model", "not-compiled", "no-x", "warmup", "device"],
)
def test_trace_step_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()


@pytest.mark.skipif(not tf.config.list_logical_devices("GPU"), reason="needs a GPU")
def test_trace_on_gpu():
    with tf.device("GPU:0"):
        model = _mlp()
    trace = tfrecompute.trace_step(model, *_batch(), device="GPU:0")
    assert trace.device == "GPU:0"
    assert trace.requested_peak_bytes > 0
    assert any(a.shape == f"[{BATCH},{WIDTH}]" for a in trace.live_at_peak)
