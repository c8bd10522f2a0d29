"""`benchmarks/any_model.py --smoke`: keras-hub and subclassed models, memory and time."""

from __future__ import annotations

from tests.helpers import run_benchmark_smoke


def test_smoke_run_writes_every_variant_of_every_model(tmp_path):
    report, table = run_benchmark_smoke("any_model", tmp_path)
    models = set(report["sizes"])
    assert models == {"bert_mirrored"}
    assert {(r["model"], r["variant"]) for r in report["memory"]} == {
        (m, v) for m in models for v in ("none", "default", "sqrt")
    }
    for row in report["memory"]:
        assert row["peak_bytes"] > 0 and row["predicted_bytes"] > 0
        if row["variant"] != "none":
            assert row["segments"] > 0
    same = {r["model"]: r["same_object"] for r in report["memory"] if r["variant"] == "sqrt"}
    assert same == {"bert_mirrored": True}  # a checkpointed model is the model
    # Under the strategy the default plan recomputes and the step takes less memory.
    rows = {(r["model"], r["variant"]): r for r in report["memory"]}
    mirrored = rows[("bert_mirrored", "default")]
    assert mirrored["segments"] > 0
    assert mirrored["peak_bytes"] < rows[("bert_mirrored", "none")]["peak_bytes"]
    for row in report["time"]:
        assert row["cpu_time_ratio"] > 0 and row["wall_time_ratio"] > 0
    assert "| bert_mirrored |" in table and "x CPU" in table
