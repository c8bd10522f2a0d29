"""`benchmarks/selective.py --smoke`: none, full, dots, attention and a planned variant."""

from __future__ import annotations

from tests.helpers import run_benchmark_smoke


def test_smoke_run_measures_every_variant_of_every_model(tmp_path):
    report, table = run_benchmark_smoke("selective", tmp_path)
    variants = {
        "encoder": ["none", "full", "dots", "attention", "mix@0.45"],
        "bert": ["none", "full", "dots", "attention", "mix@0.45"],
        "cnn": ["none", "full", "dots", "plan@0.45"],  # no attention to recompute
    }
    assert set(report["sizes"]) == set(variants)
    assert {(r["model"], r["variant"]) for r in report["memory"]} == {
        (m, v) for m, names in variants.items() for v in names
    }
    planned = [r for r in report["memory"] if "@" in r["variant"]]
    assert all(r["segments"] > 0 and r["predicted_bytes"] > 0 for r in planned)
    # Each planned variant counts its segments per policy state it planned with.
    for row in planned:
        kind = row["variant"].split("@")[0]
        want = {"plan": ["dots"], "attn": ["attention"], "mix": ["attention", "dots"]}[kind]
        assert list(row["states"]) == want and sum(row["states"].values()) <= row["segments"]
    for timing in report["time"]:
        assert timing["variants"] == variants[timing["model"]]
        assert all(t > 0 for t in timing["cpu_seconds"] + timing["wall_seconds"])
        ops = timing["ops"]
        # "dots" keeps part of what the forward keeps and recomputes less.
        assert 0 < ops["dots_kept_bytes"] < ops["saved_bytes"]
        assert ops["dots_recompute_flops"] < ops["forward_flops"]
        times = timing["op_times"]
        if timing["model"] == "cnn":
            assert times is None
        else:  # a core is part of the forward, the forward part of the step
            assert times["attention_layers"] == 2
            # One core, not both: timed alone, the smoke encoder's two can exceed its forward
            # on some CPUs (a core's share of a forward is the benchmark's to report).
            assert 0 < times["core_ms"] < times["forward_ms"] < times["step_ms"]
    assert "| dots |" in table and "| attention |" in table and "x CPU" in table
