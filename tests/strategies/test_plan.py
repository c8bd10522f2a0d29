"""`Plan`: construction, validation, equality and `summary()`."""

from __future__ import annotations

import dataclasses

import pytest

from tfrecompute.strategies import Chain, Plan, simulate


def _chain(n: int = 10) -> Chain:
    return Chain(
        1024,
        [1024 * (i + 1) for i in range(n)],
        [2048 * (i + 1) for i in range(n)],
        [float(i + 1) for i in range(n)],
        names=[f"dense_{i}" for i in range(n)],
    )


def test_from_segments_uses_simulate() -> None:
    chain = _chain()
    plan = Plan.from_segments(chain, [[0, 3], (5, 6)])
    assert plan.segments == ((0, 3), (5, 6))
    assert (plan.peak_bytes, plan.recompute_cost) == simulate(chain, plan.segments)
    assert plan.strategy == "manual" and not plan.proven_optimal
    assert plan.recomputed_links == (0, 1, 2, 5)
    assert plan.recomputed_layers == plan.recomputed_links  # the older name
    assert plan.timeline()[-1].link == 0
    assert Plan.from_segments(chain, [], strategy="mine").strategy == "mine"


def test_equality_ignores_the_chain_and_repr_omits_it() -> None:
    a = Plan.from_segments(_chain(), [(0, 2)])
    b = Plan(
        ((0, 2),),
        peak_bytes=a.peak_bytes,
        recompute_cost=a.recompute_cost,
        strategy="manual",
        chain=Chain.homogeneous(10, activation_bytes=1),
    )
    assert a == b
    assert "chain" not in repr(a) and "Chain" not in repr(a)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.peak_bytes = 0  # type: ignore[misc]


def test_summary_can_name_every_layer() -> None:
    chain = _chain()
    plan = Plan.from_segments(chain, [(0, 3), (6, 10)])
    rows = plan.summary(all_names=True).splitlines()[2:5]
    assert rows[0].split()[:4] == ["0-2", "dense_0,", "dense_1,", "dense_2"]
    assert rows[1].split()[:4] == ["3-5", "dense_3,", "dense_4,", "dense_5"]
    assert rows[2].split()[:5] == ["6-9", "dense_6,", "dense_7,", "dense_8,", "dense_9"]
    # The rest of the table is the same.
    assert plan.summary(all_names=True).splitlines()[5:] == plan.summary().splitlines()[5:]
    with pytest.raises(TypeError, match=r"^Plan.summary: `all_names` must be True or False"):
        plan.summary(all_names="yes")  # type: ignore[arg-type]


def test_summary_rows_and_totals() -> None:
    chain = _chain()
    plan = Plan.from_segments(chain, [(0, 3), (3, 4), (6, 10)], strategy="optimal")
    text = plan.summary()
    lines = text.splitlines()
    assert lines[0] == "Plan 'optimal' for a chain of 10 links"
    assert lines[1].split() == ["links", "names", "mode", "held", "recompute", "cost"]
    # One row per segment and per run of stored layers.
    assert lines[2].split() == [
        "0-2",
        "dense_0",
        "…",
        "dense_2",
        "(3",
        "links)",
        "recomputed",
        "3.00",
        "KiB",
        "6",
    ]
    assert lines[3].split() == ["3", "dense_3", "recomputed", "4.00", "KiB", "4"]
    # Stored run 4-5 holds saved bytes 10 KiB + 12 KiB.
    assert lines[4].split() == ["4-5", "dense_4,", "dense_5", "stored", "22.00", "KiB", "-"]
    assert lines[5].split()[:2] == ["6-9", "dense_6"]
    assert lines[6] == (
        f"Predicted peak: {plan.peak_bytes / 1024:.2f} KiB ({plan.peak_bytes} bytes)"
    )
    # Recomputed layers 0-3 and 6-9 cost 1+2+3+4 + 7+8+9+10 = 44 of 55.
    assert lines[7] == "Recompute cost: 44 = 80.0% of one forward pass (total forward cost 55)"


def test_summary_held_column_counts_the_carries_of_segments() -> None:
    # Layer 1's output (2 KiB) is used last by layer 5; layer 3's (4 KiB) by layer 6.
    chain = Chain(
        1024,
        [1024 * (i + 1) for i in range(6)],
        [1024 * (i + 1) for i in range(6)],
        [1.0] * 6,
        carries=[(1, 5, 2048), (3, 6, 4096)],
    )
    plan = Plan.from_segments(chain, [(0, 3), (3, 5)])
    lines = plan.summary().splitlines()
    # [0, 3): output 3 KiB + carry of layer 1 (1 < 2, used at 5 >= 3): 5 KiB.
    assert lines[2].split()[-4:] == ["recomputed", "5.00", "KiB", "3"]
    # [3, 5): output 5 KiB + carry of layer 3 (3 < 4, used at 6 >= 5); the carry of
    # layer 1 is held by [0, 3), not again here: 9 KiB.
    assert lines[3].split()[-4:] == ["recomputed", "9.00", "KiB", "2"]
    assert lines[4].split()[-4:] == ["stored", "6.00", "KiB", "-"]


def test_summary_marks_proven_plans_and_zero_cost_chains() -> None:
    chain = Chain(1, [1], [1], [0.0])
    plan = Plan(
        [], peak_bytes=3, recompute_cost=0.0, strategy="x", chain=chain, proven_optimal=True
    )
    assert plan.summary().splitlines()[0].endswith("(proven optimal)")
    assert "0.0% of one forward pass" in plan.summary()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"segments": [(0, 11)]},
            ValueError,
            r"^Plan: segment \(0, 11\) is outside the chain's "
            r"links 0\.\.9\. Received: segments=\[\(0, 11\)\] \(of type list\)",
        ),
        ({"segments": [(3, 1)]}, ValueError, r"^Plan: segment \(3, 1\) is empty"),
        (
            {"segments": [(0, 3), (2, 4)]},
            ValueError,
            r"^Plan: segments \(0, 3\) and \(2, 4\) "
            r"overlap",
        ),
        (
            {"peak_bytes": 1.0},
            TypeError,
            r"^Plan: peak_bytes must be an int\. Received: "
            r"peak_bytes=1\.0 \(of type float\)\. Pass the peak in bytes",
        ),
        ({"peak_bytes": -1}, ValueError, r"^Plan: peak_bytes must not be negative"),
        ({"recompute_cost": "1"}, TypeError, r"^Plan: recompute_cost must be a real number"),
        (
            {"recompute_cost": float("nan")},
            ValueError,
            r"recompute_cost must be finite and not "
            r"negative\. Received: recompute_cost=nan",
        ),
        ({"strategy": 3}, TypeError, r"^Plan: strategy must be a string"),
        ({"chain": None}, TypeError, r"^Plan: chain must be a Chain\. Received: chain=None"),
    ],
)
def test_validation_errors(kwargs: dict[str, object], error: type[Exception], match: str) -> None:
    fields: dict[str, object] = {
        "segments": [],
        "peak_bytes": 1,
        "recompute_cost": 0.0,
        "strategy": "s",
        "chain": _chain(),
    }
    fields.update(kwargs)
    segments = fields.pop("segments")
    with pytest.raises(error, match=match):
        Plan(segments, **fields)  # type: ignore[arg-type]


def test_from_segments_errors_name_their_api() -> None:
    with pytest.raises(ValueError, match=r"^Plan\.from_segments: segment \(0, 0\) is empty"):
        Plan.from_segments(_chain(), [(0, 0)])


def _convnext_names(blocks: int) -> list[str]:
    """Link names as profile() makes them for a ConvNeXt: long, and merged calls joined by "+"."""
    names = ["convnext_tiny_stem_conv+convnext_tiny_stem_layernorm"]
    for b in range(blocks):
        p = f"convnext_tiny_stage_{b // 3}_block_{b % 3}"
        names += [
            f"{p}_depthwise_conv",
            f"{p}_layernorm+{p}_pointwise_conv_1",
            f"{p}_gelu+{p}_pointwise_conv_2+{p}_layer_scale+{p}_add",
        ]
    return names


def test_summary_fits_100_columns_with_long_names() -> None:
    names = _convnext_names(9)
    n = len(names)
    chain = Chain(
        1 << 20, [1 << 24] * n, [3 << 24] * n, [1e9] * n, names=names
    )  # 16 MiB activations
    plan = Plan.from_segments(chain, [(1, 3), (3, 4), (9, 20)])
    summary = plan.summary()
    assert max(len(line) for line in summary.splitlines()) <= 100, summary
    rows = summary.splitlines()[2:-2]
    # A run is named by its first and last call and a count; a merged link by its calls.
    assert rows[1].startswith("1-2    convne") and "… convne" in rows[1], summary
    assert "wise_conv_1 (2 links)" in rows[1]
    assert rows[2].startswith("3      convne") and "… add (4 calls)" in rows[2]
    everything = plan.summary(all_names=True)
    assert names[-1] in everything and max(len(line) for line in everything.splitlines()) > 100
