"""benchmarks/encoder_table.py: its batch search against fake measurements, and a smoke run."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks import encoder_table
from tests.helpers import run_benchmark_smoke

ROW_NAMES = ["none", "uniform", "optimal", "optimal_bf16"]


def linear_measure(per_sample: int, *, infeasible_above: int | None = None):
    """A fake measure: the peak grows by `per_sample` bytes a sample; None above a batch."""
    calls: list[int] = []

    def measure(batch: int) -> dict[str, Any]:
        calls.append(batch)
        if infeasible_above is not None and batch > infeasible_above:
            return {"measured_bytes": None, "predicted_bytes": None, "infeasible": True}
        return {"measured_bytes": 1000 + per_sample * batch, "predicted_bytes": per_sample * batch}

    measure.calls = calls  # type: ignore[attr-defined]
    return measure


@pytest.mark.parametrize("granularity,max_batch", [(8, 512), (4, 64), (1, 37), (32, 96)])
def test_search_finds_the_largest_fitting_batch_for_every_cap(granularity, max_batch):
    for largest in range(0, max_batch + 3 * granularity):
        cap = 1000 + 10 * largest  # exactly `largest` samples of 10 bytes fit
        measure = linear_measure(10)
        result = encoder_table.search_max_batch(
            measure, cap, granularity=granularity, max_batch=max_batch
        )
        fitting = [b for b in range(granularity, max_batch + 1, granularity) if b <= largest]
        expected = max(fitting) if fitting else None
        assert result["max_batch"] == expected, (largest, result)
        assert result["capped"] == (expected == max_batch)
        assert not result["stopped"]
        batches = [p["batch"] for p in result["probes"]]
        assert batches == measure.calls
        assert len(set(batches)) == len(batches), batches
        assert all(b % granularity == 0 and granularity <= b <= max_batch for b in batches)
        for probe in result["probes"]:
            assert probe["fits"] == (probe["measured_bytes"] <= cap)
        if expected is not None:
            # The answer was measured to fit, and the next batch up was measured not to.
            assert _probe(result, expected)["fits"]
            if expected < max_batch:
                assert not _probe(result, expected + granularity)["fits"]
        # Exponential then binary: about two logarithms of probes, not a linear scan.
        steps = max_batch // granularity
        assert len(batches) <= 2 * steps.bit_length() + 1


def _probe(result: dict[str, Any], batch: int) -> dict[str, Any]:
    (probe,) = [p for p in result["probes"] if p["batch"] == batch]
    return probe


def test_search_when_even_the_smallest_batch_does_not_fit():
    measure = linear_measure(10)
    result = encoder_table.search_max_batch(measure, 1000 + 79, granularity=8, max_batch=256)
    assert result["max_batch"] is None
    assert measure.calls == [8]
    assert not result["probes"][0]["fits"]
    assert not result["capped"] and not result["stopped"]


def test_search_stops_at_max_batch_when_everything_fits():
    result = encoder_table.search_max_batch(linear_measure(1), 10**9, granularity=8, max_batch=96)
    assert result["max_batch"] == 96
    assert result["capped"]
    assert [p["batch"] for p in result["probes"]] == [8, 16, 32, 64, 96]


def test_search_counts_an_infeasible_plan_as_not_fitting():
    # Plenty of memory, but no plan above batch 40 (the planner said infeasible).
    measure = linear_measure(1, infeasible_above=40)
    result = encoder_table.search_max_batch(measure, 10**9, granularity=8, max_batch=256)
    assert result["max_batch"] == 40
    assert not _probe(result, 64)["fits"] and not _probe(result, 48)["fits"]


def test_search_respects_the_probe_limit():
    measure = linear_measure(10)
    result = encoder_table.search_max_batch(
        measure, 1000 + 10 * 100, granularity=8, max_batch=512, max_probes=3
    )
    assert measure.calls == [8, 16, 32]
    assert result["max_batch"] == 32
    assert result["stopped"]


def test_search_rejects_a_max_batch_off_the_granularity():
    with pytest.raises(ValueError, match="max_batch must be a positive multiple of granularity"):
        encoder_table.search_max_batch(linear_measure(1), 10, granularity=8, max_batch=20)


@pytest.mark.slow
def test_smoke_run_writes_a_consistent_table(tmp_path):
    report, table = run_benchmark_smoke("encoder_table", tmp_path)

    assert report["settings"]["smoke"] is True
    assert report["machine"]["cpu_count"] >= 1
    cap = report["settings"]["cap_bytes"]
    rows = {row["name"]: row for row in report["rows"]}
    assert list(rows) == ROW_NAMES
    for row in rows.values():
        assert row["label"] in table

        search = row["search"]
        assert search["probes"], row["name"]
        for probe in search["probes"]:
            if probe["infeasible"]:
                assert probe["measured_bytes"] is None and not probe["fits"]
                continue
            assert probe["measured_bytes"] > 0
            assert probe["predicted_bytes"] > 0
            assert probe["seconds"] > 0
            assert probe["fits"] == (probe["measured_bytes"] <= cap)
        best = search["max_batch"]
        assert best is not None, row["name"]
        assert _probe(search, best)["measured_bytes"] <= cap

        fixed = row["fixed"]
        assert fixed["batch"] == report["settings"]["fixed_batch"]
        for key in ("measured_bytes", "predicted_bytes", "seconds", "samples_per_second"):
            assert fixed[key] > 0, (row["name"], key)
        assert fixed["throughput_ratio"] > 0
        assert fixed["cpu_seconds"] > 0 and fixed["cpu_throughput_ratio"] > 0
        assert len(fixed["seconds_per_round"]) == report["settings"]["timing_rounds"]
        assert len(fixed["cpu_seconds_per_round"]) == report["settings"]["timing_rounds"]
        ratios = f"{fixed['cpu_throughput_ratio']:.2f}x CPU / {fixed['throughput_ratio']:.2f}x wall"
        assert ratios in table

    assert rows["none"]["fixed"]["throughput_ratio"] == 1.0
    assert rows["none"]["fixed"]["cpu_throughput_ratio"] == 1.0
    assert rows["none"]["fixed"]["segments"] == 0
    assert rows["uniform"]["fixed"]["segments"] > 0
    assert rows["uniform"]["fixed"]["strategy"].startswith("uniform:")
    for name in ("optimal", "optimal_bf16"):
        assert rows[name]["search"]["max_batch"] >= rows["none"]["search"]["max_batch"]
