"""`Chain`: normalisation, defaults and every validation error."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from tfrecompute.strategies import Chain, simulate


def test_stores_tuples_of_ints_and_floats() -> None:
    chain = Chain(np.int64(8), np.array([4, 2]), [4.0, 6], (1, np.float32(0.5)))
    assert chain.input_bytes == 8 and type(chain.input_bytes) is int
    assert chain.output_bytes == (4, 2) and all(type(x) is int for x in chain.output_bytes)
    assert chain.saved_bytes == (4, 6) and all(type(x) is int for x in chain.saved_bytes)
    assert chain.forward_cost == (1.0, 0.5) and all(type(x) is float for x in chain.forward_cost)


def test_defaults() -> None:
    chain = Chain(1, [2, 3], [2, 5], [1.0, 1.5])
    assert chain.n == 2
    assert chain.workspace_bytes == (0, 0)
    assert chain.backward_cost == (2.0, 3.0)
    assert chain.overhead_bytes == 0
    assert chain.names == ("link_0", "link_1")
    assert chain.total_forward_cost == 2.5
    assert [chain.activation_bytes(i) for i in range(3)] == [1, 2, 3]


def test_explicit_options() -> None:
    chain = Chain(
        1,
        [2],
        [2],
        [1.0],
        workspace_bytes=[7],
        backward_cost=[5.0],
        overhead_bytes=9,
        names=["dense"],
    )
    assert (chain.workspace_bytes, chain.backward_cost, chain.overhead_bytes, chain.names) == (
        (7,),
        (5.0,),
        9,
        ("dense",),
    )


def test_carries_and_grad_bytes() -> None:
    chain = Chain(
        1,
        [2, 3, 4, 5],
        [2, 3, 4, 5],
        [1.0] * 4,
        carries=[[1, 4, np.int64(7)], (0, 2, 3), (0, 2, 1.0)],
        kept_grad_bytes=np.array([1, 0, 2, 0]),
    )
    assert chain.carries == ((0, 2, 1), (0, 2, 3), (1, 4, 7))  # sorted tuples of ints
    assert all(type(x) is int for carry in chain.carries for x in carry)
    assert chain.kept_grad_bytes == (1, 0, 2, 0) and all(
        type(x) is int for x in chain.kept_grad_bytes
    )
    # C(s, e): carries made by layers s..e-2 and used at or after layer e.
    assert chain.carried_bytes(0, 2) == 4  # both (0, 2, .) carries, made by layer 0 < 1
    # (0, 2, .) are used last by layer 2 < 3; (1, 4, 7) is made by layer 1 < 2, used at 4.
    assert chain.carried_bytes(0, 3) == 7
    assert chain.carried_bytes(1, 4) == 7 and chain.carried_bytes(2, 4) == 0
    assert chain.carried_bytes(0, 1) == 0 and chain.carried_bytes(0, 4) == 7
    plain = Chain(1, [2], [2], [1.0])
    assert plain.carries == () and plain.kept_grad_bytes == (0,)
    assert plain != Chain(1, [2], [2], [1.0], kept_grad_bytes=[5])
    assert hash(chain) == hash(
        Chain(
            1,
            [2, 3, 4, 5],
            [2, 3, 4, 5],
            [1.0] * 4,
            carries=chain.carries,
            kept_grad_bytes=[1, 0, 2, 0],
        )
    )


def test_homogeneous() -> None:
    chain = Chain.homogeneous(3, activation_bytes=64, cost=2.0)
    assert chain == Chain(64, [64] * 3, [64] * 3, [2.0] * 3)


def test_frozen_and_hashable() -> None:
    chain = Chain.homogeneous(2, activation_bytes=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        chain.input_bytes = 3  # type: ignore[misc]
    assert hash(chain) == hash(Chain.homogeneous(2, activation_bytes=1))


def test_keyword_only_options() -> None:
    with pytest.raises(TypeError):
        Chain(1, [1], [1], [1.0], [0])  # type: ignore[misc]


GOOD = dict(input_bytes=1, output_bytes=[2, 3], saved_bytes=[2, 5], forward_cost=[1.0, 1.0])


@pytest.mark.parametrize(
    ("changes", "error", "match"),
    [
        (
            {"output_bytes": []},
            ValueError,
            r"Chain: a chain needs at least one link\. "
            r"Received: output_bytes=\[\] \(of type list\)\. Pass one entry per link\.",
        ),
        (
            {"saved_bytes": [2, 5, 1]},
            ValueError,
            r"Chain: saved_bytes has 3 entries but the chain has 2 links \(the length of "
            r"output_bytes\)\. Received: saved_bytes=\[2, 5, 1\] \(of type list\)\. Pass one "
            r"entry per link in every per-link sequence\.",
        ),
        ({"forward_cost": [1.0]}, ValueError, r"forward_cost has 1 entries but the chain has 2"),
        ({"workspace_bytes": [0]}, ValueError, r"workspace_bytes has 1 entries"),
        ({"backward_cost": [1.0, 2.0, 3.0]}, ValueError, r"backward_cost has 3 entries"),
        ({"names": ["a"]}, ValueError, r"names has 1 entries"),
        (
            {"saved_bytes": [2, 2]},
            ValueError,
            r"Chain: saved_bytes\[1\] is smaller than output_bytes\[1\]=3.*Received: "
            r"saved_bytes\[1\]=2 \(of type int\)\. Set saved_bytes\[i\] >= output_bytes\[i\]",
        ),
        (
            {"input_bytes": -1},
            ValueError,
            r"Chain: input_bytes must not be negative\. "
            r"Received: input_bytes=-1 \(of type int\)\. Pass an int >= 0\.",
        ),
        ({"output_bytes": [2, -3]}, ValueError, r"output_bytes\[1\] must not be negative"),
        (
            {"output_bytes": [2, 2.5]},
            ValueError,
            r"output_bytes\[1\] must be a finite whole number of bytes.*2\.5 \(of type float\)",
        ),
        ({"output_bytes": [2, float("nan")]}, ValueError, r"output_bytes\[1\] must be a finite"),
        (
            {"input_bytes": True},
            TypeError,
            r"Chain: input_bytes must be a whole number of "
            r"bytes\. Received: input_bytes=True \(of type bool\)\. Pass an int >= 0\.",
        ),
        ({"output_bytes": [2, "3"]}, TypeError, r"output_bytes\[1\] must be a whole number"),
        (
            {"output_bytes": "23"},
            TypeError,
            r"output_bytes must be a sequence with one entry per link.*of type str",
        ),
        ({"output_bytes": 3}, TypeError, r"output_bytes must be a sequence"),
        (
            {"forward_cost": [1.0, math.nan]},
            ValueError,
            r"Chain: forward_cost\[1\] must be finite\. Received: forward_cost\[1\]=nan "
            r"\(of type float\)\. Pass a finite float >= 0",
        ),
        ({"forward_cost": [1.0, math.inf]}, ValueError, r"forward_cost\[1\] must be finite"),
        ({"forward_cost": [1.0, -0.5]}, ValueError, r"forward_cost\[1\] must not be negative"),
        ({"forward_cost": [1.0, False]}, TypeError, r"forward_cost\[1\] must be a real number"),
        ({"backward_cost": [1.0, None]}, TypeError, r"backward_cost\[1\] must be a real number"),
        ({"workspace_bytes": [0, -1]}, ValueError, r"workspace_bytes\[1\] must not be negative"),
        ({"overhead_bytes": 1.5}, ValueError, r"overhead_bytes must be a finite whole number"),
        (
            {"names": ["a", "a"]},
            ValueError,
            r"Chain: names\[1\] repeats names\[0\]\. Received: "
            r"names\[1\]='a' \(of type str\)\. Give every link a unique name\.",
        ),
        ({"names": ["a", 3]}, TypeError, r"names\[1\] is not a string"),
        ({"names": ["a", ""]}, ValueError, r"names\[1\] is empty"),
        (
            {"kept_grad_bytes": [1]},
            ValueError,
            r"^Chain: kept_grad_bytes has 1 entries but the chain has 2",
        ),
        (
            {"kept_grad_bytes": [1, -2]},
            ValueError,
            r"^Chain: kept_grad_bytes\[1\] must not be negative\. "
            r"Received: kept_grad_bytes\[1\]=-2 \(of type int\)\. Pass an int >= 0\.$",
        ),
        (
            {"kept_grad_bytes": [1, 0.5]},
            ValueError,
            r"kept_grad_bytes\[1\] must be a finite whole number",
        ),
        ({"kept_grad_bytes": 3}, TypeError, r"^Chain: kept_grad_bytes must be a sequence"),
        (
            {"applied_grad_bytes": [1]},
            ValueError,
            r"^Chain: applied_grad_bytes has 1 entries but the chain has 2",
        ),
        (
            {"applied_grad_bytes": [-1, 0]},
            ValueError,
            r"^Chain: applied_grad_bytes\[0\] must not be negative",
        ),
        ({"applied_grad_bytes": 3}, TypeError, r"^Chain: applied_grad_bytes must be a sequence"),
    ],
)
def test_validation_errors(changes: dict[str, object], error: type[Exception], match: str) -> None:
    kwargs = {**GOOD, **changes}
    with pytest.raises(error, match=match):
        Chain(
            kwargs.pop("input_bytes"),  # type: ignore[arg-type]
            kwargs.pop("output_bytes"),  # type: ignore[arg-type]
            kwargs.pop("saved_bytes"),  # type: ignore[arg-type]
            kwargs.pop("forward_cost"),  # type: ignore[arg-type]
            **kwargs,  # type: ignore[arg-type]
        )


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"n": 0, "activation_bytes": 1},
            ValueError,
            r"Chain\.homogeneous: `n` must be at least 1\. Received: n=0 \(of type int\)",
        ),
        ({"n": 2.0, "activation_bytes": 1}, TypeError, r"Chain\.homogeneous: `n` must be an int"),
        ({"n": 2, "activation_bytes": -1}, ValueError, r"activation_bytes must not be negative"),
        ({"n": 2, "activation_bytes": 1, "cost": -1.0}, ValueError, r"cost must not be negative"),
    ],
)
def test_homogeneous_errors(kwargs: dict[str, object], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        Chain.homogeneous(**kwargs)  # type: ignore[arg-type]


FOUR = dict(input_bytes=1, output_bytes=[1] * 4, saved_bytes=[1] * 4, forward_cost=[1.0] * 4)


@pytest.mark.parametrize(
    ("carries", "error", "match"),
    [
        (
            [(0, 3, 8), (1, 2, 8)],
            ValueError,
            r"^Chain: carries\[1\] has last_consumer 2, outside 3\.\.4; a carry skips at least "
            r"one link and last_consumer=n means needed until the end\. Received: "
            r"carries\[1\]=\(1, 2, 8\) \(of type tuple\)\. Keep producer \+ 2 <= last_consumer "
            r"<= n \(a tensor used only by the next link is its output, not a carry\)\.$",
        ),
        ([(0, 5, 8)], ValueError, r"^Chain: carries\[0\] has last_consumer 5, outside 2\.\.4"),
        ([(3, 4, 8)], ValueError, r"^Chain: carries\[0\] has last_consumer 4, outside 5\.\.4"),
        (
            [(-1, 2, 8)],
            ValueError,
            r"^Chain: carries\[0\] has producer -1, outside the chain's links 0\.\.3\. "
            r"Received: carries\[0\]=\(-1, 2, 8\) \(of type tuple\)\. Keep 0 <= producer <= 2\.$",
        ),
        ([(4, 6, 8)], ValueError, r"^Chain: carries\[0\] has producer 4, outside"),
        (
            [(0, 2, -8)],
            ValueError,
            r"^Chain: carries\[0\]\[2\] must not be negative\. Received: carries\[0\]\[2\]=-8 "
            r"\(of type int\)\. Pass an int >= 0\.$",
        ),
        ([(0, 2, 1.5)], ValueError, r"^Chain: carries\[0\]\[2\] must be a finite whole number"),
        ([(0, 2, "8")], TypeError, r"^Chain: carries\[0\]\[2\] must be a whole number of bytes"),
        (
            [(0, 2)],
            TypeError,
            r"^Chain: carries\[0\] is not a \(producer, last_consumer, bytes\) triple of ints\. "
            r"Received: carries\[0\]=\(0, 2\) \(of type tuple\)\. Pass each carry as a triple "
            r"of ints, e\.g\. \(2, 5, 4096\)\.$",
        ),
        ([(0.0, 2, 8)], TypeError, r"carries\[0\] is not a \(producer, last_consumer, bytes\)"),
        ([(0, True, 8)], TypeError, r"carries\[0\] is not a \(producer, last_consumer, bytes\)"),
        ([3], TypeError, r"^Chain: carries\[0\] is not a"),
        (
            "02",
            TypeError,
            r"^Chain: carries must be a sequence of \(producer, last_consumer, bytes\) triples\. "
            r"Received: carries='02' \(of type str\)\. Pass e\.g\. \[\(2, 5, 4096\)\], or \(\) "
            r"for a plain chain\.$",
        ),
        (None, TypeError, r"^Chain: carries must be a sequence"),
        ({0: (0, 2, 1)}, TypeError, r"^Chain: carries must be a sequence"),
    ],
)
def test_carry_errors(carries: object, error: type[Exception], match: str) -> None:
    kwargs = dict(FOUR)
    with pytest.raises(error, match=match):
        Chain(
            kwargs.pop("input_bytes"),  # type: ignore[arg-type]
            kwargs.pop("output_bytes"),  # type: ignore[arg-type]
            kwargs.pop("saved_bytes"),  # type: ignore[arg-type]
            kwargs.pop("forward_cost"),  # type: ignore[arg-type]
            carries=carries,  # type: ignore[arg-type]
        )


@pytest.mark.parametrize(
    ("carry_grads", "error", "match"),
    [
        ([(0, 1, 8)], ValueError, r"^Chain: carry_grads\[0\] has last_consumer 1, outside 2\.\.4"),
        ([(0, 2, -1)], ValueError, r"^Chain: carry_grads\[0\]\[2\] must not be negative"),
        ("02", TypeError, r"^Chain: carry_grads must be a sequence of \(producer, last_consumer"),
    ],
)
def test_carry_grad_errors(carry_grads: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        Chain(1, [1] * 4, [1] * 4, [1.0] * 4, carry_grads=carry_grads)  # type: ignore[arg-type]


def test_carry_grads_are_sorted_and_compared() -> None:
    chain = Chain(1, [1] * 4, [1] * 4, [1.0] * 4, carry_grads=[(1, 4, 3), (0, 2, 5)])
    assert chain.carry_grads == ((0, 2, 5), (1, 4, 3))
    assert chain != Chain(1, [1] * 4, [1] * 4, [1.0] * 4)
    # Gradients of (0, 2) at backward moments 1..2, of (1, 4) (a model output) at 2..3;
    # while a segment ending at e recomputes, those with producer + 1 < e <= consumer.
    assert chain.live_gradients() == ((0, 5, 8, 3), (0, 0, 5, 3, 3))


def test_input_copy_bytes_default_to_zeros_and_are_compared() -> None:
    chain = Chain(3, [4, 5, 6], [4, 5, 6], [1.0] * 3)
    assert chain.input_copy_bytes == (0, 0, 0)
    copied = Chain(3, [4, 5, 6], [4, 5, 6], [1.0] * 3, input_copy_bytes=[3, 0, 5])
    assert copied.input_copy_bytes == (3, 0, 5) and copied != chain
    with pytest.raises(
        ValueError, match=r"^Chain: input_copy_bytes\[1\] is larger than x_1, 4 bytes"
    ):
        Chain(3, [4, 5, 6], [4, 5, 6], [1.0] * 3, input_copy_bytes=[3, 5, 0])
    with pytest.raises(ValueError, match=r"^Chain: input_copy_bytes has 2 entries"):
        Chain(3, [4, 5, 6], [4, 5, 6], [1.0] * 3, input_copy_bytes=[3, 4])


def test_update_workspace_counts_at_layer_0s_backward_only() -> None:
    """The optimizer's copies at the step's end, folded into layer 0's backward."""
    plain = Chain(3, [4, 5, 6], [4, 5, 6], [1.0] * 3, kept_grad_bytes=[2, 2, 2])
    assert plain.update_workspace_bytes == 0
    copying = dataclasses.replace(plain, update_workspace_bytes=9)
    assert copying != plain
    assert plain.live_gradients() == ((6, 4, 2), (6, 4, 2, 0))
    assert copying.live_gradients() == ((15, 4, 2), (6, 4, 2, 0))
    # Storing everything, the peak is layer 2's backward: 3 + 4 + 5 + 6 held, 6 + 5
    # (gradients of x_3 and x_2) and 2 (G_2) = 31; layer 0's backward is 3 + 4
    # held, 4 + 3 and 6 (G_0) = 20, and 40 with 20 bytes of copies.
    assert simulate(plain, []).peak_bytes == 31
    assert simulate(dataclasses.replace(plain, update_workspace_bytes=20), []).peak_bytes == 40
    for bad, error in ((-1, ValueError), (1.5, ValueError), (True, TypeError), ("9", TypeError)):
        with pytest.raises(error, match=r"^Chain: `?update_workspace_bytes"):
            Chain(3, [4], [4], [1.0], update_workspace_bytes=bad)


def test_applied_workspace_counts_at_every_backward_and_recompute_moment() -> None:
    """One update's temporaries, in flight beside whichever link's backward runs."""
    plain = Chain(3, [4, 5, 6], [4, 5, 6], [1.0] * 3, applied_grad_bytes=[2, 2, 2])
    assert plain.applied_workspace_bytes == 0
    updating = dataclasses.replace(plain, applied_workspace_bytes=7)
    assert updating != plain
    backward, recompute = plain.live_gradients()
    assert updating.live_gradients() == (
        tuple(b + 7 for b in backward),
        tuple(r + 7 for r in recompute),
    )
    # The forward never holds it; these plans all peak in the backward pass, so
    # each peak rises by the same 7 bytes.
    for segments in ([], [(0, 2)], [(1, 3)], [(0, 3)]):
        assert simulate(updating, segments).peak_bytes == simulate(plain, segments).peak_bytes + 7
    for bad, error in ((-1, ValueError), (2.5, ValueError), (False, TypeError)):
        with pytest.raises(error, match=r"^Chain: `?applied_workspace_bytes"):
            Chain(3, [4], [4], [1.0], applied_workspace_bytes=bad)


def test_update_grad_bytes_default_to_zeros_and_are_compared() -> None:
    chain = Chain(3, [4, 5, 6], [4, 5, 6], [1.0] * 3)
    assert chain.applied_grad_bytes == (0, 0, 0)
    applied = Chain(3, [4, 5, 6], [4, 5, 6], [1.0] * 3, applied_grad_bytes=[2, 0, 7])
    assert applied.applied_grad_bytes == (2, 0, 7) and applied != chain
    # Applied gradients are not kept until the step's end: live_gradients leaves them out.
    assert applied.live_gradients() == chain.live_gradients()


def test_input_grad_bytes_default_to_the_inputs_and_are_compared() -> None:
    chain = Chain(3, [4, 5, 6], [4, 5, 6], [1.0] * 3)
    assert chain.input_grad_bytes == (3, 4, 5)
    partial = Chain(3, [4, 5, 6], [4, 5, 6], [1.0] * 3, input_grad_bytes=[0, 4, 2])
    assert partial.input_grad_bytes == (0, 4, 2)
    assert partial != chain


@pytest.mark.parametrize(
    ("input_grad_bytes", "error", "match"),
    [
        ([3, 5, 5], ValueError, r"^Chain: input_grad_bytes\[1\] is larger than x_1, 4 bytes"),
        ([3, 4], ValueError, r"^Chain: input_grad_bytes has 2 entries but the chain has 3"),
        ([3, -1, 0], ValueError, r"^Chain: input_grad_bytes\[1\] must not be negative"),
    ],
)
def test_input_grad_bytes_errors(
    input_grad_bytes: object, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        Chain(3, [4, 5, 6], [4, 5, 6], [1.0] * 3, input_grad_bytes=input_grad_bytes)  # type: ignore[arg-type]


def test_max_stop_limits_the_segments() -> None:
    chain = Chain(1, [1] * 4, [1] * 4, [1.0] * 4, max_stop=[2, 2, 2, 4])
    assert chain.allowed(0, 2) and not chain.allowed(0, 3)
    assert not chain.allowed(2, 3)  # link 2 cannot be recomputed
    assert Chain(1, [1] * 3, [1] * 3, [1.0] * 3).max_stop == (3, 3, 3)
    with pytest.raises(ValueError, match=r"max_stop\[1\] is outside 1\.\.4"):
        Chain(1, [1] * 4, [1] * 4, [1.0] * 4, max_stop=[2, 0, 2, 4])
    with pytest.raises(TypeError, match=r"max_stop\[0\] is not an int"):
        Chain(1, [1] * 2, [1] * 2, [1.0] * 2, max_stop=[1.5, 2])


def test_every_strategy_keeps_within_max_stop() -> None:
    from tfrecompute import strategies as st

    chain = Chain(
        8, [8] * 8, [8] * 8, [1.0] * 8, max_stop=[3, 3, 3, 3, 5, 6, 8, 8], names=list("abcdefgh")
    )
    for name in st.available():
        plan = st.get(name)(chain)
        assert all(chain.allowed(s, e) for s, e in plan.segments), (name, plan.segments)
    for k in (1, 3, 8):
        assert all(chain.allowed(s, e) for s, e in st.uniform(k)(chain).segments)
    with pytest.raises(ValueError, match=r"segment \(0, 4\) is not allowed by the chain"):
        st.Plan.from_segments(chain, [(0, 4)])
