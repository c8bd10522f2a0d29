"""`benchmarks/backward_order.py --smoke`: both variants measured, the table written."""

from __future__ import annotations

import pytest

from tests.helpers import run_benchmark_smoke


@pytest.mark.slow
def test_smoke_run_measures_both_variants(tmp_path):
    report, table = run_benchmark_smoke("backward_order", tmp_path, timeout=300)
    assert [row["variant"] for row in report["memory"]] == ["wait", "early"]
    for row in report["memory"]:
        assert len(row["peaks"]) == report["config"]["measurements"]
        assert 0 < row["median_bytes"] <= row["max_bytes"] == max(row["peaks"])
        assert f"| {row['variant']} | {row['median_bytes'] / 2**20:.1f} |" in table
    assert report["time"]["cpu_ratio"] > 0 and report["time"]["wall_ratio"] > 0
    assert "x CPU /" in table
