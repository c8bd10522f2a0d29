"""`benchmarks/planning_time.py --smoke`: plan and recompute timed per model, the table written."""

from __future__ import annotations

import pytest

from tests.helpers import run_benchmark_smoke


@pytest.mark.slow
def test_smoke_run_times_plan_then_recompute(tmp_path):
    report, table = run_benchmark_smoke("planning_time", tmp_path, timeout=600)
    assert [row["model"] for row in report["rows"]] == ["mlp", "bert_tiny"]
    for row in report["rows"]:
        assert row["calls"] >= row["links"] >= 1 and row["parameters"] > 0
        assert row["plan_cpu_s"] > 0 and row["plan_wall_s"] > 0
        # The chain the plan holds is reused: no second profile.
        assert row["recompute_after_plan_cpu_s"] < row["plan_cpu_s"]
        assert f"| {row['model']} | {row['size']} |" in table
