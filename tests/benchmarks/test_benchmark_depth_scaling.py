"""`benchmarks/depth_scaling.py`: its exponent fit, and its `--smoke` run end to end."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from benchmarks import depth_scaling
from tests.helpers import run_benchmark_smoke


@pytest.mark.parametrize("exponent", [0.5, 1.0, 2.0, -0.25])
def test_fit_exponent_recovers_power_laws(exponent: float) -> None:
    fit_exponent = depth_scaling.fit_exponent
    depths = [8, 16, 32, 64, 128]
    values = [3.7 * d**exponent for d in depths]
    assert fit_exponent(depths, values) == pytest.approx(exponent, abs=1e-12)


def test_fit_exponent_is_the_least_squares_slope() -> None:
    fit_exponent = depth_scaling.fit_exponent
    # log2 points (1, 0), (2, 1), (3, 3): least-squares slope 1.5 in any log base.
    assert fit_exponent([2, 4, 8], [1, 2, 8]) == pytest.approx(1.5, abs=1e-12)
    # An affine law a * L + b tends to exponent 1 from below as L grows.
    shallow = fit_exponent([1, 2, 4], [d + 10 for d in (1, 2, 4)])
    deep = fit_exponent([1000, 2000, 4000], [d + 10 for d in (1000, 2000, 4000)])
    assert shallow < deep < 1.0
    assert math.isclose(deep, 1.0, abs_tol=0.01)


@pytest.mark.parametrize(
    ("depths", "values", "match"),
    [
        ([8], [1.0], "at least two points"),
        ([8, 16], [1.0], "depths and values differ in length"),
        ([8, 16], [1.0, 0.0], "depths and values must be positive"),
        ([0, 16], [1.0, 2.0], "depths and values must be positive"),
        ([8, 8], [1.0, 2.0], "all depths are equal"),
    ],
)
def test_fit_exponent_rejects_bad_input(depths: list, values: list, match: str) -> None:
    with pytest.raises(ValueError, match=f"fit_exponent: {match}"):
        depth_scaling.fit_exponent(depths, values)


def test_smoke_run_writes_results(tmp_path: Path) -> None:
    report, table = run_benchmark_smoke("depth_scaling", tmp_path, timeout=300)
    assert table.startswith("# Memory against depth")
    assert str(report["machine"]["cpu_count"]) in table

    depths = [r["depth"] for r in report["results"]]
    assert depths == [4, 8]
    for result in report["results"]:
        assert [row["variant"] for row in result["rows"]] == ["none", "sqrt", "optimal"]
        for row in result["rows"]:
            assert row["measured_bytes"] > 0, (result["depth"], row)
            # Memory from a process of its own; the timing process's peaks kept beside it.
            assert len(row["measured_bytes_shared_rounds"]) == 2
            assert row["error"] == pytest.approx(row["predicted_bytes"] / row["measured_bytes"] - 1)
            assert row["predicted_bytes"] > 0, (result["depth"], row)
            assert row["seconds"] > 0 and row["time_ratio"] > 0
            assert row["cpu_seconds"] > 0 and row["cpu_time_ratio"] > 0
            assert len(row["cpu_seconds_rounds"]) == len(row["seconds_rounds"]) == 2
            ratios = f"{row['cpu_time_ratio']:.2f}x CPU / {row['time_ratio']:.2f}x wall"
            assert f"| {result['depth']} | {row['variant']} | {row['segments']} |" in table
            assert ratios in table
        none, sqrt, optimal = result["rows"]
        assert none["segments"] == 0 and sqrt["segments"] >= 2
        assert optimal["predicted_bytes"] <= optimal["budget_bytes"]

    none, sqrt, _ = report["results"][-1]["rows"]
    assert sqrt["measured_bytes"] < none["measured_bytes"]
    fits = report["exponents"]
    # Measured exponents over two small depths are not compared: the step's
    # fixed costs weigh on both (a loaded full run measured storing everything
    # at 0.51 and sqrt at 0.58); the full benchmark fits them over 4 to 128.
    assert all(fits[variant]["measured"] is not None for variant in ("none", "sqrt"))
    assert fits["none"]["predicted"] > fits["sqrt"]["predicted"]
    assert "| none |" in table.split("Growth exponent")[1]
