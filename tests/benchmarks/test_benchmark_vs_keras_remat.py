"""`benchmarks/vs_keras_remat.py --smoke` runs every variant and writes its JSON and Markdown."""

from __future__ import annotations

import pytest

from tests.helpers import run_benchmark_smoke

KERAS_MODES = ("full", "activations", "larger_than", "list_of_layers")
TFRECOMPUTE_ROWS = ("none", "tfrecompute sqrt", "tfrecompute optimal")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    return run_benchmark_smoke("vs_keras_remat", tmp_path_factory.mktemp("vs_keras_remat"))


def _rows(report: dict, model: str) -> dict[str, dict]:
    (result,) = [r for r in report["results"] if r["model"] == model]
    return {row["variant"]: row for row in result["rows"]}


@pytest.mark.slow
def test_smoke_writes_both_models_and_the_machine(smoke: tuple[dict, str]) -> None:
    report, table = smoke
    assert report["config"] == "smoke"
    assert [r["model"] for r in report["results"]] == ["dense_chain", "encoder"]
    assert report["versions"]["keras"] and report["versions"]["tensorflow"]
    assert table.startswith("# keras.RematScope against tfrecompute")
    assert f"{report['machine']['cpu_count']} CPUs" in table
    for variant in (*TFRECOMPUTE_ROWS, *(f"keras {mode}" for mode in KERAS_MODES)):
        assert f"| {variant} |" in table
    assert "| 1.00x CPU / 1.00x wall |" in table  # the no-recompute rows


@pytest.mark.slow
@pytest.mark.parametrize("model", ["dense_chain", "encoder"])
def test_every_remat_scope_mode_is_measured_or_a_reported_crash(
    smoke: tuple[dict, str], model: str
) -> None:
    rows = _rows(smoke[0], model)
    for mode in KERAS_MODES:
        row = rows[f"keras {mode}"]
        if row["error"] is None:
            assert row["peak_bytes"] > 0 and row["seconds"] > 0, row
            assert row["fit_graph"] is True, row
        else:
            assert isinstance(row["error"], str) and row["error"].strip(), row
            assert row["peak_bytes"] is None, row
        assert row["fit_graph"] is not None and row["fit_eager"] is not None, row
        if row["fit_graph"] is False:
            assert row["fit_graph_error"].strip(), row


@pytest.mark.slow
@pytest.mark.parametrize("model", ["dense_chain", "encoder"])
def test_tfrecompute_rows_run_with_exact_gradients(smoke: tuple[dict, str], model: str) -> None:
    rows = _rows(smoke[0], model)
    for variant in TFRECOMPUTE_ROWS:
        row = rows[variant]
        assert row["error"] is None and row["fit_graph"] is True, row
        assert row["peak_bytes"] > 0 and row["seconds"] > 0 and row["time_ratio"] > 0, row
        assert row["cpu_seconds"] > 0 and row["cpu_time_ratio"] > 0, row
        # Step MiB from a process that built only this variant; the shared one's kept.
        assert row["peak_bytes_shared_process"] > 0, row
        assert row["memory_ratio"] == row["peak_bytes"] / rows["none"]["peak_bytes"], row
        # graph mode, same weights and dropout seeds as the no-recompute model
        assert row["grad_mode"] == "graph" and row["grad_max_diff"] < 1e-5, row
    assert rows["none"]["memory_ratio"] == rows["none"]["time_ratio"] == 1.0
    assert rows["none"]["cpu_time_ratio"] == 1.0
    assert rows["tfrecompute sqrt"]["segments"] >= 2


@pytest.mark.slow
def test_sqrt_measures_less_than_none_on_the_dense_chain(smoke: tuple[dict, str]) -> None:
    rows = _rows(smoke[0], "dense_chain")
    assert rows["tfrecompute sqrt"]["peak_bytes"] < rows["none"]["peak_bytes"]
