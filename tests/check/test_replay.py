"""A plan's step replayed from a measured step through a simulation of TensorFlow's allocator."""

from __future__ import annotations

import keras
import numpy as np

import tfrecompute
from tests.check.test_calibrate import _cnn
from tfrecompute import strategies
from tfrecompute.check import replay
from tfrecompute.check.measure import traced_events

MiB = 2**20


def test_a_request_takes_the_smallest_free_chunk_split_only_at_twice_its_size():
    bfc = replay._BFC()
    bfc.allocate("first", 3 * MiB)  # a new region of 4 MiB: less than twice, held whole
    assert bfc.in_use == 4 * MiB
    bfc.allocate("a", 5 * MiB)  # a new region, doubled to 8 MiB: held whole
    assert bfc.in_use == 12 * MiB
    region = bfc.at["a"]
    bfc.release("a")
    bfc.allocate("b", 3 * MiB)  # the free 8 MiB chunk is at least twice 3: split
    assert bfc.in_use == 7 * MiB
    bfc.allocate("c", 3 * MiB)  # the 5 MiB left is less than twice 3: held whole
    assert bfc.in_use == 12 * MiB
    bfc.release("b")
    bfc.release("c")  # its neighbour below is free: the two merge back into 8 MiB
    assert bfc.free == [(8 * MiB, region)]
    bfc.allocate("d", 100)  # rounded up to 256 bytes, from the smallest free chunk
    assert bfc.in_use == 4 * MiB + 256
    assert bfc.peak == 12 * MiB


def _record() -> list[replay.Buffer]:
    """Three links, each a forward intermediate and an output (link 2's output is the
    loss's input), then their gradients in reverse, each freeing what its link kept."""
    B = replay.Buffer
    return [
        B(True, 1, 1 * MiB, link=0),  # link 0's intermediate
        B(True, 2, 2 * MiB, link=0),  # link 0's output
        B(True, 3, 4 * MiB, link=1),  # link 1's intermediate
        B(True, 4, 2 * MiB, link=1),  # link 1's output
        B(True, 5, 1 * MiB, link=2),
        B(True, 6, 2 * MiB, link=2),
        B(True, 7, 2 * MiB, link=2, forward=False),  # link 2's input gradient
        B(False, 5, 1 * MiB),
        B(False, 6, 2 * MiB),
        B(True, 8, 2 * MiB, link=1, forward=False),
        B(False, 3, 4 * MiB),
        B(False, 4, 2 * MiB),
        B(False, 7, 2 * MiB),
        B(True, 9, 2 * MiB, link=0, forward=False),
        B(False, 1, 1 * MiB),
        B(False, 2, 2 * MiB),
        B(False, 8, 2 * MiB),
        B(False, 9, 2 * MiB),
    ]


def _requested_peak(events: list) -> int:
    live, peak = {}, 0
    for allocates, key, requested in events:
        if allocates:
            live[key] = requested
        else:
            live.pop(key, None)
        peak = max(peak, sum(live.values()))
    return peak


def test_a_recomputed_segment_frees_its_forward_and_allocates_it_again_for_its_backward():
    record = _record()
    outputs = [2 * MiB] * 3
    stored = replay._plan_events(record, (), outputs)
    assert [key for _, key, _ in stored] == [("step", i) for i in range(6)] + [
        ("step", i) for i in (6, 4, 5, 9, 2, 3, 6, 13, 0, 1, 9, 13)
    ]
    assert _requested_peak(stored) == 14 * MiB  # the forward's 12 and link 2's gradient
    planned = replay._plan_events(record, ((1, 2),), outputs)
    keys = [(allocates, key) for allocates, key, _ in planned]
    # Link 1's intermediate is freed at its forward's end, its output kept; both are
    # allocated again before link 1's first gradient buffer, the output freed at once.
    assert keys.index((False, ("step", 2))) == keys.index((True, ("step", 3))) + 1
    again = keys.index((True, ("again", 2)))
    assert keys[again : again + 4] == [
        (True, ("again", 2)),
        (True, ("again", 3)),
        (False, ("again", 3)),
        (True, ("step", 9)),
    ]
    assert (False, ("again", 2)) in keys  # freed where the measured step freed it
    # 1 MiB less than storing everything: link 1's intermediate is not held through link
    # 2's backward, and its recomputed output is held beside the stored one a moment.
    assert _requested_peak(planned) == 13 * MiB
    assert replay.replayed_peak(record, ((1, 2),), outputs) < replay.replayed_peak(
        record, (), outputs
    )


def test_a_plan_replayed_from_a_calibration_follows_its_traced_step():
    # Against the bytes a traced step requests, which do not depend on where the
    # process's allocator left free space (its peak does: NOTE [ Replaying a plan
    # through the allocator ]): the replay only adds the allocator's rounding.
    model, sample = _cnn(blocks=6)
    stored = tfrecompute.plan(model, "none", sample=sample, calibrate=True)
    # The requested peak moves by a buffer or so with the order ops run in (112 or 120 MiB).
    requested = max(tfrecompute.trace_step(model, *sample).requested_peak_bytes for _ in range(2))
    assert requested * 0.8 <= stored.replayed_peak_bytes <= requested * 1.5
    plan = tfrecompute.plan(model, "sqrt", sample=sample, calibrate=True)
    replayed = plan.replayed_peak_bytes
    traced = tfrecompute.plan(model, "sqrt", sample=sample)
    assert traced.replayed_peak_bytes is None
    assert traced.reconciled_peak_bytes == traced.peak_bytes
    assert "this plan's step replayed through the allocator: " in plan.summary()
    # The chain's prediction, kept between the replay and 10% above it (NOTE [ Reconciling
    # a prediction with its replay ]).
    reconciled = plan.reconciled_peak_bytes
    assert reconciled == min(max(plan.peak_bytes, replayed), int(1.1 * replayed))
    printed = strategies.format_bytes(reconciled)
    assert f"reconciled with the replay (reconciled_peak_bytes): {printed}" in plan.summary()
    assert replayed < 0.75 * stored.replayed_peak_bytes
    # The default plan is the one of the least replayed peak, at most the chain's least
    # peak's and sqrt's (NOTE [ The least peak of a calibrated chain ]).
    default = tfrecompute.plan(model, sample=sample, calibrate=True)
    least = strategies.optimal(default.chain)
    assert default.replayed_peak_bytes <= min(least.replayed_peak_bytes, replayed)
    tfrecompute.recompute(model, plan)
    requested = max(tfrecompute.trace_step(model, *sample).requested_peak_bytes for _ in range(2))
    assert requested * 0.8 <= replayed <= requested * 1.5  # 64 or 72 MiB requested


def test_variables_held_between_steps_fill_the_first_regions_before_a_replayed_step():
    variables = [
        keras.Variable(np.zeros((512, 512), "float32")),  # 1 MiB
        keras.Variable(np.zeros((512, 256), "float32"), dtype="bfloat16"),  # 256 KiB
        keras.Variable(np.zeros((10,), "float32")),  # 40 bytes
    ]
    # oneDNN's CPU allocator serves the small one outside what is replayed; the BFC
    # allocator counts it (costs.measured.counted_from).
    assert replay.resident_bytes(variables, 256 << 10) == (MiB, MiB // 4)
    assert replay.resident_bytes(variables, 0) == (MiB, MiB // 4, 40)
    # A step of one 1 MiB buffer: alone, the first 2 MiB region is split for it. After a
    # 768 KiB variable took the start of that region, the 1.25 MiB left is less than
    # twice the request and is held whole.
    step = [replay.Buffer(True, 1, MiB, link=0), replay.Buffer(False, 1, MiB)]
    assert replay.replayed_peak(step, (), [MiB]) == MiB
    assert replay.replayed_peak(step, (), [MiB], resident=(3 * MiB // 4,)) == 5 * MiB // 4


def test_a_gradient_op_run_from_the_steps_start_runs_in_a_recomputed_segments_backward():
    # A recurrent layer's gradient accumulators are allocated before the forward runs;
    # inside a block they are made in its backward, with its recomputation.
    record = [replay.Buffer(True, 99, MiB, link=1, forward=False), *_record()]
    planned = replay._plan_events(record, ((1, 2),), [2 * MiB] * 3)
    keys = [(allocates, key) for allocates, key, _ in planned]
    recomputed = keys.index((True, ("again", 3)))
    assert recomputed > keys.index((True, ("step", 7)))  # after link 2's gradient
    assert keys[recomputed + 3 : recomputed + 5] == [(True, ("step", 0)), (True, ("step", 10))]
    assert keys.count((True, ("step", 0))) == 1  # not at the step's start any more


def _live_at_the_end(events: list) -> set:
    live = set()
    for allocates, key, _ in events:
        if allocates:
            live.add(key)
        else:
            live.discard(key)
    return live


def test_a_buffer_freed_between_a_segments_forward_and_its_backward_is_freed_when_recomputed():
    # Link 1's intermediate is freed right after link 1's output is made (a ReLU's
    # input its backward does not read): recomputed, it is freed at once, not left live.
    record = _record()
    record.insert(4, record.pop(10))  # the free of address 3 right after link 1's output
    outputs = [2 * MiB] * 3
    planned = replay._plan_events(record, ((1, 2),), outputs)
    assert _live_at_the_end(planned) == _live_at_the_end(replay._plan_events(record, (), outputs))
    again = [(a, k) for a, k, _ in planned].index((True, ("again", 2)))
    assert planned[again + 1][:2] == (False, ("again", 2))


def test_a_segment_with_no_gradient_buffer_after_the_forward_is_replayed_as_stored():
    record = [b for b in _record() if b.address != 8]  # link 1 makes no gradient buffer
    outputs = [2 * MiB] * 3
    assert replay._plan_events(record, ((1, 2),), outputs) == replay._plan_events(
        record, (), outputs
    )


def test_an_optimizers_copy_of_a_recomputed_links_variable_is_made_in_place():
    # An update copies a variable while a forward op still reads it (storing
    # everything, the backward holds the read); a recomputed link reads it again in
    # its backward, before the update, and the update runs in place: no copy, and the
    # variable's buffer from before the step is not freed.
    B = replay.Buffer
    record = _record()
    record[10:10] = [  # after link 1's input gradient: its weight gradient and update
        B(True, 20, 3 * MiB, link=1, forward=False),
        B(True, 21, 3 * MiB, update=True),
        B(False, 20, 3 * MiB),
        B(False, 50, 3 * MiB),  # the variable's buffer from before the step
    ]
    record += [  # link 0's, the same way
        B(True, 30, 5 * MiB, link=0, forward=False),
        B(True, 31, 5 * MiB, update=True),
        B(False, 30, 5 * MiB),
        B(False, 51, 5 * MiB),
    ]
    outputs = [2 * MiB] * 3
    copies = {(True, ("step", 11)), (False, ("before", 50))}
    stored = {(a, k) for a, k, _ in replay._plan_events(record, (), outputs)}
    assert copies <= stored
    planned = {(a, k) for a, k, _ in replay._plan_events(record, ((1, 2),), outputs)}
    assert not copies & planned
    assert {(True, ("step", 23)), (False, ("before", 51))} <= planned  # link 0 is stored


def test_a_variable_update_is_told_by_its_op():
    def allocation(address: int, op: str) -> tuple:
        return "MemoryAllocation", {"addr": address, "requested_bytes": 8, "tf_op": op}

    events = [
        allocation(1, "adam/AssignSubVariableOp_3"),
        allocation(2, "sgd/AssignVariableOp"),
        allocation(3, "gradient_tape/dense/MatMul"),
        allocation(4, "dense/AssignSubVariableOp_grad/x"),
        ("MemoryDeallocation", {"addr": 1, "requested_bytes": 8}),
    ]
    updates = [b.update for b in replay.recorded(events, lambda op: None)]
    assert updates == [True, True, False, False, False]


def test_a_recomputed_layers_variables_are_updated_in_place():
    # What the replay's in-place rule rests on: storing everything, SGD copies a kernel
    # the backward still reads (an update allocation); recomputed, no update allocates.
    def updates(strategy: str) -> int:
        keras.utils.set_random_seed(0)
        inputs = keras.Input((512,))
        h = inputs
        for _ in range(12):
            h = keras.layers.Dense(512, activation="relu")(h)  # 1 MiB kernels
        model = keras.Model(inputs, keras.layers.Dense(10)(h))
        model.compile(optimizer="sgd", loss="mse")
        if strategy != "none":
            tfrecompute.recompute(model, strategy, sample=sample)
        found = 0
        for _ in range(2):  # how many copies a step makes depends on its op order
            _, events, _ = traced_events("test", model, *sample, warmup=1)
            found += sum(b.update for b in replay.recorded(events, lambda op: None))
        return found

    rng = np.random.default_rng(0)
    sample = rng.random((2048, 512), dtype="float32"), rng.random((2048, 10), dtype="float32")
    assert updates("none") >= 1
    assert updates("sqrt") == 0
