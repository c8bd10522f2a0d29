"""benchmarks/prediction_accuracy.py: merging runs, and the table of errors over the runs."""

from __future__ import annotations

import pytest

from benchmarks import prediction_accuracy


def _run(model: str, measured: list[int], plans=("none", "sqrt"), requested=None) -> dict:
    requested = requested or measured
    rows = [
        {
            "strategy": plan,
            "segments": i,
            "predicted_bytes": 100 << 20,
            "measured_bytes": m,
            "error": (100 << 20) / m - 1,
            "requested_bytes": r,
            "requested_error": (100 << 20) / r - 1,
            "allocator_overhead": [m / r - 1, 0.0],
            "trace_summary": f"peak of {model} {plan}",
            "budget_bytes": (160 << 20) if plan == "optimal" else None,
            "headroom": 0.25 if plan == "optimal" else None,
        }
        for i, (plan, m, r) in enumerate(zip(plans, measured, requested))
    ]
    return {"model": model, "batch_size": 32, "links": 7, "rows": rows}


def test_merge_runs_keeps_every_run_and_the_range():
    runs = [
        _run("unet", [100 << 20, 125 << 20], requested=[80 << 20, 100 << 20]),
        _run("unet", [80 << 20, 100 << 20]),
    ]
    merged = prediction_accuracy.merge_runs(runs)
    assert merged["runs"] == 2 and merged["model"] == "unet"
    none, sqrt = merged["rows"]
    assert none["measured_bytes_runs"] == [100 << 20, 80 << 20]
    assert none["errors"] == pytest.approx([0.0, 0.25])
    assert (none["error_min"], none["error_max"]) == pytest.approx((0.0, 0.25))
    assert (sqrt["error_min"], sqrt["error_max"]) == pytest.approx((-0.2, 0.0))
    assert none["requested_bytes_runs"] == [80 << 20, 80 << 20]
    assert none["requested_errors"] == pytest.approx([0.25, 0.25])
    assert (sqrt["requested_error_min"], sqrt["requested_error_max"]) == pytest.approx((0.0, 0.0))
    # The rounding is over every traced step of every run: 25%, 0%, 0%, 0%.
    assert (sqrt["overhead_min"], sqrt["overhead_max"]) == pytest.approx((0.0, 0.25))
    # The first run's fields are kept, for callers that read one run.
    assert none["error"] == runs[0]["rows"][0]["error"]

    table = prediction_accuracy._markdown([merged])
    assert "measured 2 times" in table
    assert (
        "| unet | 7 | none | 0 | 100.0 | 100.0, 80.0 | +0.0%, +25.0% | +0% .. +25% "
        "| 80.0, 80.0 | +25% .. +25% | +0% .. +25% |"
    ) in table
    assert (
        "| unet | 7 | sqrt | 1 | 100.0 | 125.0, 100.0 | -20.0%, +0.0% | -20% .. +0% "
        "| 100.0, 100.0 | +0% .. +0% | +0% .. +25% |"
    ) in table
    # The first run's trace of each sqrt plan, and no other.
    assert "unet:\n\n```\npeak of unet sqrt\n```" in table
    assert "peak of unet none" not in table


def test_table_shows_optimal_plans_against_their_budget():
    plans = ("none", "optimal")
    runs = [
        _run("resnet50", [200 << 20, 120 << 20], plans),
        _run("resnet50", [200 << 20, 168 << 20], plans),
    ]
    table = prediction_accuracy._markdown([prediction_accuracy.merge_runs(runs)])
    assert "| resnet50 | 160.0 | 25% | 62% | 75%, 105% |" in table


@pytest.mark.parametrize(
    ("runs", "match"),
    [
        ([], "merge_runs: no runs"),
        ([_run("unet", [1, 2]), _run("encoder", [1, 2])], "the runs differ in model or plans"),
        (
            [_run("unet", [1, 2]), _run("unet", [1, 2], plans=("none", "optimal"))],
            "the runs differ in model or plans",
        ),
    ],
)
def test_merge_runs_rejects_mismatched_runs(runs, match):
    with pytest.raises(ValueError, match=match):
        prediction_accuracy.merge_runs(runs)


def test_table_shows_errors_before_and_after_measured_costs_and_verified_plans():
    runs = [_run("convnext_tiny", [500 << 20, 400 << 20], ("none", "verified"))]
    for row, static in zip(runs[0]["rows"], (250 << 20, 50 << 20)):
        row["static_predicted_bytes"] = static
    verified = runs[0]["rows"][1]
    verified.update(
        budget_bytes=500 << 20,
        verified_bytes=450 << 20,
        probes=[
            {"predicted_bytes": 300 << 20, "measured_bytes": 600 << 20},
            {"predicted_bytes": 100 << 20, "measured_bytes": 450 << 20},
        ],
    )
    table = prediction_accuracy._markdown([prediction_accuracy.merge_runs(runs)])
    assert "| convnext_tiny | none | 250.0 | -50% | 100.0 | -80% |" in table
    assert "| convnext_tiny | verified | 50.0 | -88% | 100.0 | -75% |" in table
    assert "| convnext_tiny | 500.0 | 90% | 80% | 300 -> 600; 100 -> 450 |" in table
