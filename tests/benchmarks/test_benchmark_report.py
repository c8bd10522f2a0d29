"""benchmarks/_report.py: running workers in fresh processes, and timing steps on both clocks."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
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


def test_interleaved_rounds_takes_turns_and_times_every_step() -> None:
    calls: list[str] = []

    def turn(name: str, steps: int) -> Callable[[_report.StepTimes], str]:
        def run(times: _report.StepTimes) -> str:
            for _ in range(steps):
                times.time(lambda: calls.append(name) or sum(range(20_000)))
            return f"{name}{len(times.wall)}"

        return run

    times = [_report.StepTimes(), _report.StepTimes()]
    results = _report.interleaved_rounds(
        [turn("a", 2), turn("b", 1)], times, rounds=3, alternate=True, untimed=1
    )
    # The untimed round first (forward), then reversed, forward, reversed.
    assert calls == ["a", "a", "b", "b", "a", "a", "a", "a", "b", "b", "a", "a"]
    assert results == [["a1", "a2", "a3"], ["b1", "b2", "b3"]]
    assert [len(r) for r in times[0].wall] == [len(r) for r in times[0].cpu] == [2, 2, 2]
    assert [len(r) for r in times[1].cpu] == [1, 1, 1]
    for clock in times:
        assert all(s > 0 for s in clock.wall_per_round() + clock.cpu_per_round())


def test_interleaved_rounds_same_order_without_alternate() -> None:
    calls: list[int] = []
    turns = [lambda t, i=i: t.time(lambda: calls.append(i)) for i in range(3)]
    times = [_report.StepTimes() for _ in turns]
    _report.interleaved_rounds(turns, times, rounds=2)
    assert calls == [0, 1, 2, 0, 1, 2]
    with pytest.raises(ValueError, match="one StepTimes per turn"):
        _report.interleaved_rounds(turns, times[:2], rounds=1)


def test_step_times_needs_a_round() -> None:
    with pytest.raises(ValueError, match="no round started"):
        _report.StepTimes().time(list)


def test_ratios_text() -> None:
    assert _report.ratios(1.3125, 1.29) == "1.31x CPU / 1.29x wall"
    assert _report.ratios(None, 1.0) == "-"
