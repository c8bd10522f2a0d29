"""`simulate` and `timeline`: hand-computed steps, invariants, segment validation."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs
from planner_cases import allowed_segment_sets, chains

from tfrecompute.strategies import Chain, Estimate, MemoryEvent, _solver, simulate, timeline

# Chain B: x0 = 4 bytes; three layers with outputs of 4 bytes; layers 0 and 1
# keep 12 bytes for their backward, layer 2 only its output.
CHAIN_B = Chain(4, [4, 4, 4], [12, 12, 4], [1.0, 2.0, 3.0])


def test_store_everything_by_hand() -> None:
    # forward:  H=4;  L0: 4+12=16, H=16;  L1: 16+12=28, H=28;  L2: 28+4=32, H=32
    # backward: L2: 32 + grad out 4 + grad in 4 = 40, H=28;  L1: 28+4+4=36, H=16;
    #           L0: 16+4+4=24
    assert [e.live_bytes for e in timeline(CHAIN_B, [])] == [16, 28, 32, 40, 36, 24]
    assert simulate(CHAIN_B, []) == Estimate(40, 0.0)


def test_one_segment_by_hand() -> None:
    # forward:  H=4;  segment [0,2): j=0: 4 + 4 = 8;  j=1: 4 + (4 + 4) = 12;  H = 4 + 4 = 8
    #           L2 stored: 8 + 4 = 12, H = 12
    # backward: L2: 12 + 4 + 4 = 20, H = 8;  segment: H -= 4 -> 4
    #           recompute j=0: 4 + grad 4 + 12 = 20;  j=1: 4 + 4 + (12 + 12) = 32
    #           backward j=1: 4 + 24 + 4 + 4 = 36;  j=0: 4 + 12 + 4 + 4 = 24
    assert timeline(CHAIN_B, [(0, 2)]) == [
        MemoryEvent("forward", 0, 8),
        MemoryEvent("forward", 1, 12),
        MemoryEvent("forward", 2, 12),
        MemoryEvent("backward", 2, 20),
        MemoryEvent("recompute", 0, 20),
        MemoryEvent("recompute", 1, 32),
        MemoryEvent("backward", 1, 36),
        MemoryEvent("backward", 0, 24),
    ]
    assert simulate(CHAIN_B, [(0, 2)]) == Estimate(36, 3.0)


def test_adjacent_one_layer_segments_by_hand() -> None:
    # forward:  H=4;  [0,1): 4+4=8, H=8;  [1,2): 8+4=12, H=12;  L2: 12+4=16, H=16
    # backward: L2: 16+4+4=24, H=12;  [1,2): H=8, recompute 8+4+12=24, backward 8+12+4+4=28
    #           [0,1): H=4, recompute 4+4+12=20, backward 4+12+4+4=24
    assert [e.live_bytes for e in timeline(CHAIN_B, [(0, 1), (1, 2)])] == [
        8,
        12,
        16,
        24,
        24,
        28,
        20,
        24,
    ]
    assert simulate(CHAIN_B, [(0, 1), (1, 2)]) == Estimate(28, 3.0)


# Chain A: workspace and a constant overhead of 100 bytes.
CHAIN_A = Chain(10, [20, 5], [30, 5], [1.0, 2.0], workspace_bytes=[4, 0], overhead_bytes=100)


def test_workspace_and_overhead_by_hand() -> None:
    # forward:  H=10;  L0: 100 + 10 + 30 + ws 4 = 144, H=40;  L1: 100 + 40 + 5 = 145, H=45
    # backward: L1: 100 + 45 + 5 + 20 = 170, H=40;  L0: 100 + 40 + 20 + 10 + 4 = 174
    assert [e.live_bytes for e in timeline(CHAIN_A, [])] == [144, 145, 170, 174]
    # segment [0,2): forward j=0: 100 + 10 + 20 + 4 = 134;  j=1: 100 + 10 + (20 + 5) = 135
    # H = 15;  backward: H -= 5 -> 10;  recompute j=0: 100 + 10 + 5 + 30 + 4 = 149;
    # j=1: 100 + 10 + 5 + 35 = 150;  backward j=1: 100 + 10 + 35 + 5 + 20 = 170;
    # j=0: 100 + 10 + 30 + 20 + 10 + 4 = 174
    assert [e.live_bytes for e in timeline(CHAIN_A, [(0, 2)])] == [134, 135, 149, 150, 170, 174]
    assert simulate(CHAIN_A, [(0, 2)]) == Estimate(174, 3.0)


# Chain D: chain B's shape with x0 = 2 bytes, saved bytes 8, 8, 4, a residual
# carry (layer 0's output, 4 bytes, used last by layer 2) and parameter
# gradients of 1, 2, 3 bytes: G_0 = 6, G_1 = 5, G_2 = 3, G_3 = 0.
CHAIN_D = Chain(
    2, [4, 4, 4], [8, 8, 4], [1.0, 1.0, 1.0], carries=[(0, 2, 4)], kept_grad_bytes=[1, 2, 3]
)


def test_carry_and_gradients_when_storing_everything_by_hand() -> None:
    # The carry is in saved_0: nothing changes for it; gradients add to backward moments.
    # forward:  H=2;  L0: 2+8=10, H=10;  L1: 10+8=18, H=18;  L2: 18+4=22, H=22
    # backward: L2: 22 + 4 + 4 + G_2 3 = 33, H=18;  L1: 18 + 4 + 4 + G_1 5 = 31, H=10;
    #           L0: 10 + 4 + 2 + G_0 6 = 22.  Step end: 2 + G_0 6 = 8 < 22, folded.
    assert [e.live_bytes for e in timeline(CHAIN_D, [])] == [10, 18, 22, 33, 31, 22]


def test_segment_holding_a_carry_by_hand() -> None:
    # [0, 2): C(0, 2) = 4 (made by layer 0 < 2 - 1, used last by layer 2 >= 2).
    # forward:  j=0: 2 + C(0,0) 0 + a_1 4 = 6;  j=1: 2 + C(0,1) 0 + a_1 4 + a_2 4 = 10;
    #           H = 2 + a_2 4 + C(0,2) 4 = 10;  L2 stored: 10 + 4 = 14, H = 14
    # backward: L2: 14 + 4 + 4 + G_2 3 = 25, H = 10;  segment: H -= 4 + 4 -> 2
    #           recompute (G_2 = 3 live, no gradient of the segment yet):
    #           j=0: 2 + a_2 4 + 8 + 3 = 17;  j=1: 2 + 4 + (8 + 8) + 3 = 25
    #           backward j=1: 2 + 16 + 4 + 4 + G_1 5 = 31;  j=0: 2 + 8 + 4 + 2 + G_0 6 = 22
    assert timeline(CHAIN_D, [(0, 2)]) == [
        MemoryEvent("forward", 0, 6),
        MemoryEvent("forward", 1, 10),
        MemoryEvent("forward", 2, 14),
        MemoryEvent("backward", 2, 25),
        MemoryEvent("recompute", 0, 17),
        MemoryEvent("recompute", 1, 25),
        MemoryEvent("backward", 1, 31),
        MemoryEvent("backward", 0, 22),
    ]
    assert simulate(CHAIN_D, [(0, 2)]) == Estimate(31, 2.0)
    # [0, 3): the carry is used inside the segment, C(0, 3) = 0, but it is live while
    # layer 2 runs forward: j=2: 2 + C(0,2) 4 + a_2 4 + a_3 4 = 14.  H = 2 + 4 = 6.
    # backward: H -= 4 -> 2;  recompute (G_3 = 0): 2 + 4 + 8 = 14, 2 + 4 + 16 = 22,
    # 2 + 4 + 20 = 26;  backward j=2: 2 + 20 + 4 + 4 + 3 = 33;  then 31 and 22 as above.
    assert [e.live_bytes for e in timeline(CHAIN_D, [(0, 3)])] == [
        *(6, 10, 14),
        *(14, 22, 26),
        *(33, 31, 22),
    ]


def test_carry_gradient_lives_from_consumer_to_producer_by_hand() -> None:
    # Chain D, plus a 5-byte gradient for the carry: made by layer 2's backward,
    # used by layer 0's (where it is part of the gradient of x_1, already counted).
    # live_gradients: G = (6, 5+5, 3+5), R = (6, 5, 3+5, 0).
    chain = Chain(
        2,
        [4, 4, 4],
        [8, 8, 4],
        [1.0] * 3,
        carries=[(0, 2, 4)],
        kept_grad_bytes=[1, 2, 3],
        carry_grads=[(0, 2, 5)],
    )
    assert chain.live_gradients() == ((6, 10, 8), (6, 5, 8, 0))
    # The backward moments of layers 2 and 1 gain 5 bytes; forward moments do not change.
    assert [e.live_bytes for e in timeline(chain, [])] == [10, 18, 22, 38, 36, 22]
    # [0, 2): recompute moments see R_2 = 3 + 5: 17 + 5 and 25 + 5.
    assert [e.live_bytes for e in timeline(chain, [(0, 2)])] == [6, 10, 14, 30, 22, 30, 36, 22]
    assert simulate(chain, [(0, 2)]) == Estimate(36, 2.0)


def test_input_gradient_counts_only_what_the_layer_reads() -> None:
    # Chain D where layer 1 reads none of x_1 (it reads a carry instead, whose
    # gradient the carry gradients count): its backward moments lose a_1 = 4.
    full = Chain(2, [4, 4, 4], [8, 8, 4], [1.0] * 3, kept_grad_bytes=[1, 2, 3])
    skip = Chain(
        2, [4, 4, 4], [8, 8, 4], [1.0] * 3, kept_grad_bytes=[1, 2, 3], input_grad_bytes=[2, 0, 4]
    )
    moments = [e.live_bytes for e in timeline(full, [])]
    assert [e.live_bytes for e in timeline(skip, [])] == [*moments[:4], moments[4] - 4, moments[5]]
    # In a segment, the backward moment of layer 1 loses it too; recompute moments do not.
    recomputed = [e.live_bytes for e in timeline(full, [(0, 2)])]
    changed = [e.live_bytes for e in timeline(skip, [(0, 2)])]
    assert [b - a for a, b in zip(recomputed, changed)] == [0, 0, 0, 0, 0, 0, -4, 0]


def test_applied_gradients_live_for_the_lag_or_until_their_segment_ends_by_hand() -> None:
    # Five 10-byte layers; layer i makes u_i applied gradient bytes, alive through
    # the backward passes of the next UPDATE_LAG = 2 layers.
    plain = Chain.homogeneous(5, activation_bytes=10)
    chain = Chain(10, [10] * 5, [10] * 5, [1.0] * 5, applied_grad_bytes=[1, 2, 4, 8, 16])
    assert Chain.UPDATE_LAG == 2

    def extra(segments: list[tuple[int, int]]) -> list[int]:
        moments = zip(timeline(plain, segments), timeline(chain, segments))
        return [b.live_bytes - a.live_bytes for a, b in moments]

    # Stored: backward of layer j sees u_j + u_{j+1} + u_{j+2}; forward sees none.
    assert extra([]) == [0] * 5 + [16, 8 + 16, 4 + 8 + 16, 2 + 4 + 8, 1 + 2 + 4]
    # [0, 5): the segment holds its gradients until its backward ends, so layers
    # 1 and 0 also see those of layers 4 and 3-4.
    assert extra([(0, 5)]) == [0] * 10 + [16, 24, 28, 2 + 4 + 8 + 16, 1 + 2 + 4 + 8 + 16]
    # [0, 2): as short as the lag, its backward is unchanged; its recompute runs
    # while the gradients of layers 2 and 3 are alive.
    assert extra([(0, 2)]) == [0] * 5 + [16, 24, 28] + [4 + 8] * 2 + [14, 7]
    assert simulate(chain, [(0, 5)]) == Estimate(96, 5.0)


def test_the_input_copy_lives_through_a_segments_recompute_and_backward_by_hand() -> None:
    # Five 10-byte layers; a segment starting at layer 1 recomputes from a
    # 7-byte copy of x_1, one starting at 2 from a 3-byte copy (at 0: none).
    plain = Chain.homogeneous(5, activation_bytes=10)
    chain = Chain(10, [10] * 5, [10] * 5, [1.0] * 5, input_copy_bytes=[0, 7, 3, 0, 0])

    def extra(segments: list[tuple[int, int]]) -> list[int]:
        moments = zip(timeline(plain, segments), timeline(chain, segments))
        return [b.live_bytes - a.live_bytes for a, b in moments]

    assert extra([]) == [0] * 10  # only a recompute copies
    # [1, 4): forward 5, stored 4, then recompute 1..3 and backward 3..1, stored 0.
    assert extra([(1, 4)]) == [0] * 6 + [7] * 6 + [0]
    # [0, 2), [2, 5): only the segment starting at 2 copies (3 bytes of x_2):
    # forward 5, then [2, 5)'s recompute and backward, then [0, 2)'s.
    assert extra([(0, 2), (2, 5)]) == [0] * 5 + [3] * 6 + [0] * 4
    assert simulate(chain, [(1, 4)]).peak_bytes == simulate(plain, [(1, 4)]).peak_bytes + 7


def test_a_large_carry_sets_the_peak_in_a_forward_moment() -> None:
    # Chain D with a 40-byte carry (larger than anything its producer saves).
    chain = Chain(
        2, [4, 4, 4], [8, 8, 4], [1.0] * 3, carries=[(0, 2, 40)], kept_grad_bytes=[1, 2, 3]
    )
    assert simulate(chain, []).peak_bytes == 33  # stored: part of saved_0, as in chain D
    # [0, 3): forward j=2: 2 + C(0,2) 40 + a_2 4 + a_3 4 = 50, above every backward moment.
    events = timeline(chain, [(0, 3)])
    assert [e.live_bytes for e in events] == [6, 10, 50, 14, 22, 26, 33, 31, 22]
    assert max(events, key=lambda e: e.live_bytes) == MemoryEvent("forward", 2, 50)
    # [0, 2): H = 2 + a_2 4 + C(0,2) 40 = 46;  L2: 46 + 4 = 50;  backward L2:
    # 50 + 4 + 4 + 3 = 61;  then H = 46 - 44 = 2 and the segment as in chain D.
    assert [e.live_bytes for e in timeline(chain, [(0, 2)])] == [6, 10, 50, 61, 17, 25, 31, 22]


def test_a_carry_needed_until_the_end_is_held_past_later_layers_by_hand() -> None:
    # Layer 0's output (5 bytes as a carry) is used until the end (last_consumer = n = 4).
    chain = Chain(2, [4, 4, 4, 4], [8, 8, 4, 4], [1.0] * 4, carries=[(0, 4, 5)])
    assert chain.carried_bytes(0, 2) == 5
    # forward:  j=0: 2 + 4 = 6;  j=1: 2 + 4 + 4 = 10;  H = 2 + 4 + 5 = 11;
    #           L2: 11 + 4 = 15, H = 15;  L3: 15 + 4 = 19, H = 19
    # backward: L3: 19 + 4 + 4 = 27, H = 15;  L2: 15 + 4 + 4 = 23, H = 11;  H -= 9 -> 2
    #           recompute: 2 + 4 + 8 = 14, 2 + 4 + 16 = 22;  backward: 2 + 16 + 4 + 4 = 26,
    #           2 + 8 + 4 + 2 = 16
    assert [e.live_bytes for e in timeline(chain, [(0, 2)])] == [
        *(6, 10, 15, 19),
        *(27, 23, 14, 22, 26, 16),
    ]


def test_homogeneous_docstring_values() -> None:
    chain = Chain.homogeneous(4, activation_bytes=100)
    assert simulate(chain, []) == (700, 0.0)
    assert simulate(chain, [(0, 2), (2, 4)]) == (600, 4.0)


@settings(deadline=None, max_examples=60)
@given(chains(max_layers=7), hs.data())
def test_simulate_is_the_max_of_timeline(chain: Chain, data: hs.DataObject) -> None:
    plans = allowed_segment_sets(chain)
    segments = plans[data.draw(hs.integers(0, len(plans) - 1))]
    events = timeline(chain, segments)
    estimate = simulate(chain, segments)
    assert estimate.peak_bytes == max(e.live_bytes for e in events)
    recomputed = [j for s, e in segments for j in range(s, e)]
    assert estimate.recompute_cost == math.fsum(chain.forward_cost[j] for j in recomputed)
    assert len(events) == 2 * chain.n + len(recomputed)
    assert [e.link for e in events if e.phase == "forward"] == list(range(chain.n))
    assert sorted(e.link for e in events if e.phase == "recompute") == recomputed
    assert sorted(e.link for e in events if e.phase == "backward") == list(range(chain.n))
    # The step-end moment (input held, every parameter gradient live) is folded into
    # the backward of layer 0, which is never below it.
    assert events[-1][:2] == ("backward", 0)
    lag = min(chain.n, Chain.UPDATE_LAG)
    end = chain.overhead_bytes + chain.input_bytes + sum(chain.kept_grad_bytes)
    end += sum(chain.applied_grad_bytes[:lag])  # V_0: the applied gradients still alive
    assert events[-1].live_bytes >= end


@settings(deadline=None, max_examples=60)
@given(chains(max_layers=7), hs.data())
def test_element_formula_matches_simulate(chain: Chain, data: hs.DataObject) -> None:
    """The closed form the solver relies on (NOTE [ The element formula ])."""
    plans = allowed_segment_sets(chain)
    segments = plans[data.draw(hs.integers(0, len(plans) - 1))]
    pb = _solver.Problem.from_chain(chain)
    held, peak = chain.input_bytes, 0
    position = 0
    elements = []
    for s, e in segments:
        elements += [(i, i + 1, False) for i in range(position, s)] + [(s, e, True)]
        position = e
    elements += [(i, i + 1, False) for i in range(position, chain.n)]
    moments = timeline(chain, segments)
    for s, e, recomputed in elements:
        if recomputed:
            width, row, holds = pb.row(s, pb.inf)
            local, kept = int(row[e - s - 1]), int(holds[e - s - 1])
            assert kept == chain.activation_bytes(e) + chain.carried_bytes(s, e)
        else:
            local, kept = int(pb.Lst[s]), chain.saved_bytes[s]
        # Each element's own moments, forward and backward, peak at `held + local`.
        own = max(m.live_bytes for m in moments if s <= m.link < e)
        assert own - chain.overhead_bytes == held + local, (s, e, recomputed)
        peak = max(peak, held + local)
        held += kept
    assert chain.overhead_bytes + peak == simulate(chain, segments).peak_bytes


@pytest.mark.parametrize(
    ("segments", "error", "match"),
    [
        (
            [(2, 2)],
            ValueError,
            r"simulate: segment \(2, 2\) is empty\. Received: "
            r"segments=\[\(2, 2\)\] \(of type list\)\. Use half-open ranges",
        ),
        ([(0, 2), (1, 3)], ValueError, r"simulate: segments \(0, 2\) and \(1, 3\) overlap"),
        ([(2, 3), (0, 1)], ValueError, r"segments \(2, 3\) and \(0, 1\) are not sorted"),
        (
            [(0, 4)],
            ValueError,
            r"simulate: segment \(0, 4\) is outside the chain's links "
            r"0\.\.2\. Received: segments=\[\(0, 4\)\] \(of type list\)\. Keep 0 <= start < stop "
            r"<= 3\.",
        ),
        ([(-1, 1)], ValueError, r"segment \(-1, 1\) is outside"),
        ([(0, 1, 2)], TypeError, r"simulate: segment \(0, 1, 2\) is not a pair of ints"),
        ([(0, True)], TypeError, r"is not a pair of ints"),
        ([(0.0, 1)], TypeError, r"is not a pair of ints"),
        ([3], TypeError, r"segment 3 is not a pair of ints"),
        ("01", TypeError, r"segments must be a sequence of \(start, stop\) pairs"),
        (None, TypeError, r"segments must be a sequence"),
    ],
)
def test_segment_errors(segments: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        simulate(CHAIN_B, segments)  # type: ignore[arg-type]


def test_timeline_errors_name_their_api() -> None:
    with pytest.raises(ValueError, match=r"^timeline: segment \(1, 1\) is empty"):
        timeline(CHAIN_B, [(1, 1)])
    with pytest.raises(
        TypeError,
        match=r"^simulate: chain must be a Chain\. Received: "
        r"chain=\[1, 2\] \(of type list\)",
    ):
        simulate([1, 2], [])  # type: ignore[arg-type]


def test_adjacent_and_single_layer_segments_are_valid() -> None:
    assert simulate(CHAIN_B, [(0, 1), (1, 2), (2, 3)]).recompute_cost == 6.0
