"""`benchmarks/depth_scaling.py`: its exponent fit, and its `--smoke` run end to end."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "depth_scaling.py"


def _script():  # noqa: ANN202 (a module loaded from a path)
    spec = importlib.util.spec_from_file_location("depth_scaling", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("exponent", [0.5, 1.0, 2.0, -0.25])
def test_fit_exponent_recovers_power_laws(exponent: float) -> None:
    fit_exponent = _script().fit_exponent
    depths = [8, 16, 32, 64, 128]
    values = [3.7 * d**exponent for d in depths]
    assert fit_exponent(depths, values) == pytest.approx(exponent, abs=1e-12)


def test_fit_exponent_is_the_least_squares_slope() -> None:
    fit_exponent = _script().fit_exponent
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
        _script().fit_exponent(depths, values)


def test_smoke_run_writes_results(tmp_path: Path) -> None:
    command = [sys.executable, str(SCRIPT), "--smoke", "--out", str(tmp_path)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]

    report = json.loads((tmp_path / "depth_scaling.json").read_text())
    table = (tmp_path / "depth_scaling.md").read_text()
    assert table.startswith("# Memory against depth")
    assert str(report["machine"]["cpu_count"]) in table

    depths = [r["depth"] for r in report["results"]]
    assert depths == [4, 8, 16]
    for result in report["results"]:
        assert [row["variant"] for row in result["rows"]] == ["none", "sqrt", "optimal"]
        for row in result["rows"]:
            assert row["measured_bytes"] > 0, (result["depth"], row)
            assert row["predicted_bytes"] > 0, (result["depth"], row)
            assert row["seconds"] > 0 and row["time_ratio"] > 0
            assert f"| {result['depth']} | {row['variant']} | {row['segments']} |" in table
        none, sqrt, optimal = result["rows"]
        assert none["segments"] == 0 and sqrt["segments"] >= 2
        assert optimal["predicted_bytes"] <= optimal["budget_bytes"]

    none, sqrt, _ = report["results"][-1]["rows"]
    assert sqrt["measured_bytes"] < none["measured_bytes"]
    fits = report["exponents"]
    assert fits["none"]["measured"] > fits["sqrt"]["measured"]
    assert fits["none"]["predicted"] > fits["sqrt"]["predicted"]
    assert "| none |" in table.split("Growth exponent")[1]
