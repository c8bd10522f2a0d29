"""benchmarks/_report.py: running workers in fresh processes, and timing steps on both clocks."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from benchmarks import _report

WORKER = """
import json, sys, time
mode, value = sys.argv[1], sys.argv[2]
print("progress", file=sys.stderr)
if mode == "fail":
    print("boom " + value, file=sys.stderr)
    sys.exit(3)
if mode == "sleep":
    time.sleep(float(value))
if mode != "silent":
    print("not the result")
    print(json.dumps({"value": value, "argv": sys.argv[1:]}))
"""


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "worker.py"
    path.write_text(WORKER)
    return path


def test_run_worker_returns_the_last_stdout_line_as_json(script: Path) -> None:
    result = _report.run_worker(script, ["ok", "7"], timeout=60)
    assert result == {"value": "7", "argv": ["ok", "7"]}


def test_run_worker_raises_with_the_exit_code_and_the_stderr_tail(script: Path) -> None:
    with pytest.raises(RuntimeError, match=r"worker\.py fail 1` failed \(exit code 3\)") as info:
        _report.run_worker(script, ["fail", "1"], timeout=60)
    assert "boom 1" in str(info.value)


def test_run_worker_raises_when_the_worker_prints_nothing(script: Path) -> None:
    with pytest.raises(RuntimeError, match="exit code 0 but no output"):
        _report.run_worker(script, ["silent", "-"], timeout=60)


def test_run_worker_kills_a_worker_past_its_timeout(script: Path) -> None:
    started = time.perf_counter()
    with pytest.raises(RuntimeError, match="did not finish within 1 s and was killed"):
        _report.run_worker(script, ["sleep", "30"], timeout=1)
    assert time.perf_counter() - started < 20


def test_run_workers_returns_results_in_task_order(script: Path) -> None:
    tasks = [["sleep", "0.5"], ["ok", "b"], ["ok", "c"]]
    results = _report.run_workers(script, tasks, jobs=2, timeout=60)
    assert [r["value"] for r in results] == ["0.5", "b", "c"]
    json.dumps(results)  # plain JSON values


def test_run_workers_raises_on_the_first_failure(script: Path) -> None:
    with pytest.raises(RuntimeError, match="boom x"):
        _report.run_workers(script, [["fail", "x"], ["sleep", "30"]], jobs=2, timeout=60)
    with pytest.raises(ValueError, match="jobs must be at least 1"):
        _report.run_workers(script, [["ok", "1"]], jobs=0, timeout=60)
