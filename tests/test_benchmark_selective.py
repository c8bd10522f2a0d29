"""`benchmarks/selective.py --smoke`: none, full, dots and a planned variant of two models."""

from __future__ import annotations

from tests.helpers import run_benchmark_smoke


def test_smoke_run_measures_every_variant_of_both_models(tmp_path):
    report, table = run_benchmark_smoke("selective", tmp_path)
    variants = ["none", "full", "dots", "plan@0.45"]
    assert set(report["sizes"]) == {"encoder", "cnn"}
    assert {(r["model"], r["variant"]) for r in report["memory"]} == {
        (m, v) for m in ("encoder", "cnn") for v in variants
    }
    planned = [r for r in report["memory"] if r["variant"].startswith("plan@")]
    assert all(r["segments"] > 0 and r["predicted_bytes"] > 0 for r in planned)
    for timing in report["time"]:
        assert timing["variants"] == variants
        assert all(t > 0 for t in timing["cpu_seconds"] + timing["wall_seconds"])
        ops = timing["ops"]
        # "dots" keeps part of what the forward keeps and recomputes less.
        assert 0 < ops["dots_kept_bytes"] < ops["saved_bytes"]
        assert ops["dots_recompute_flops"] < ops["forward_flops"]
    assert "| dots |" in table and "x CPU" in table
