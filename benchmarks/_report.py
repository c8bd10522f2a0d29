"""What every benchmark script shares: the machine it ran on, where and how it writes, how it
runs itself in fresh processes, and how it times training steps.

A script imports it as `from benchmarks import _report` after putting the
repository root on `sys.path` (each script does, so that it runs alone).
Nothing here imports TensorFlow at import time; `measure_steps` imports it
when called, in a worker.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path
from typing import IO, Any, TypeVar

# Every benchmark measures TensorFlow's CPU allocator with oneDNN on, as TensorFlow runs by
# itself on CPUs with AVX-512 VNNI or BF16, AVX-VNNI or AMX, where the allocator keeps
# statistics (NOTE [ Counting CPU memory ] in tfrecompute/startup.py); set before any script
# or worker imports TensorFlow.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
STDERR_TAIL = 3000  # characters of a failed worker's stderr quoted in the error

T = TypeVar("T")


def machine() -> dict[str, Any]:
    """The platform, processor, Python version and CPU count of this machine."""
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": sys.version.split()[0],
        "cpu_count": os.cpu_count(),
    }


def versions(*packages: str) -> dict[str, str | None]:
    """The installed version of each distribution (None when it is not installed).

    Read from the package metadata, so nothing (TensorFlow) is imported.
    """
    found: dict[str, str | None] = {}
    for package in packages:
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = None
    return found


def output_dir(out: Path | None, *, smoke: bool, name: str) -> Path:
    """`out` if given, else a new temporary directory for a smoke run, else `results/`.

    The directory is created if needed.
    """
    if out is None:
        out = Path(tempfile.mkdtemp(prefix=f"{name}_")) if smoke else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    return out


def write(out: Path, name: str, report: Any, table: str) -> list[Path]:
    """Writes `<name>.json` (the report) and `<name>.md` (the table) to `out`.

    Prints the table and the paths written; returns the paths.
    """
    paths = [out / f"{name}.json", out / f"{name}.md"]
    paths[0].write_text(json.dumps(report, indent=2) + "\n")
    paths[1].write_text(table)
    print(table)
    print(f"wrote {' and '.join(str(path) for path in paths)}")
    return paths


# ------------------------------------------------------------- worker processes


class Worker:
    """A benchmark script running in a fresh Python process, started when created.

    The script runs as `python <script> <args...>` in the repository root and
    must print its result as JSON on the last line of its stdout. Its stdout
    and stderr go to temporary files, not pipes: a worker blocked on a full
    pipe would never finish.

    Args:
        script: the script to run.
        args: its command-line arguments.
        echo_stderr: let the worker write to this process's stderr as it
            runs (for progress messages) instead of keeping it for the error.
    """

    def __init__(self, script: Path, args: Sequence[str], *, echo_stderr: bool = False) -> None:
        self.command = [sys.executable, str(script), *args]
        self._stdout: IO[bytes] = tempfile.TemporaryFile()
        self._stderr: IO[bytes] | None = None if echo_stderr else tempfile.TemporaryFile()
        self._process = subprocess.Popen(
            self.command, stdout=self._stdout, stderr=self._stderr, cwd=ROOT
        )

    def result(self, *, timeout: float) -> Any:
        """Waits for the worker and returns the JSON value its last stdout line holds.

        Raises:
            RuntimeError: the worker did not finish within `timeout` seconds
                (it is killed), exited with a non-zero code or printed
                nothing; the message ends with the tail of its stderr.
        """
        try:
            self._process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise RuntimeError(
                f"{self._name()} did not finish within {timeout:.0f} s and was killed."
            ) from None
        except BaseException:
            self.kill()
            raise
        output, errors = self._read(self._stdout), self._read(self._stderr)
        self._close()
        lines = output.strip().splitlines()
        if self._process.returncode == 0 and lines:
            return json.loads(lines[-1])
        code = self._process.returncode
        what = f"exit code {code}" if code else "exit code 0 but no output"
        if self._stderr is None:
            raise RuntimeError(f"{self._name()} failed ({what}); its stderr is above.")
        raise RuntimeError(f"{self._name()} failed ({what}); stderr:\n{errors[-STDERR_TAIL:]}")

    def kill(self) -> None:
        """Kills the worker if it still runs, and drops its output."""
        if self._process.poll() is None:
            self._process.kill()
            self._process.wait()
        self._close()

    def _name(self) -> str:
        return f"benchmark worker `{' '.join(self.command[1:])}`"

    @staticmethod
    def _read(file: IO[bytes] | None) -> str:
        if file is None or file.closed:
            return ""
        file.seek(0)
        return file.read().decode(errors="replace")

    def _close(self) -> None:
        for file in (self._stdout, self._stderr):
            if file is not None:
                file.close()


def run_worker(
    script: Path, args: Sequence[str], *, timeout: float, echo_stderr: bool = False
) -> Any:
    """Runs `python <script> <args...>` in a fresh process; returns its last stdout line as JSON.

    See `Worker` for how it runs and `Worker.result` for what it raises.

    Example:
        >>> run_worker(Path(__file__), ["--worker", "4"], timeout=900)  # doctest: +SKIP
    """
    return Worker(script, args, echo_stderr=echo_stderr).result(timeout=timeout)


def run_workers(
    script: Path, tasks: Sequence[Sequence[str]], *, jobs: int, timeout: float
) -> list[Any]:
    """Runs `script` once per task (its arguments), each in a fresh process, `jobs` at a time.

    Workers start in task order and are waited for in that order, each for at
    most `timeout` seconds. A failure kills the workers still running and
    raises (see `Worker.result`).

    Returns:
        Each worker's result, in task order.
    """
    if jobs < 1:
        raise ValueError(f"run_workers: jobs must be at least 1. Received: jobs={jobs!r}.")
    pending = collections.deque(tasks)
    running: collections.deque[Worker] = collections.deque()
    results = []
    try:
        while pending or running:
            while pending and len(running) < jobs:
                running.append(Worker(script, pending.popleft()))
            results.append(running[0].result(timeout=timeout))
            running.popleft()
    finally:
        for worker in running:
            worker.kill()
    return results


# ----------------------------------------------------------------------- timing


@dataclasses.dataclass
class StepTimes:
    """The wall and CPU seconds of one variant's timed steps, a list per round.

    The wall clock is `time.perf_counter()`; the CPU clock is
    `time.process_time()`, the CPU time of every thread of this process
    (TensorFlow runs ops on its inter-op threads): the work a step did,
    steadier than the wall clock on a shared machine.

    Attributes:
        wall: per round, each step's wall seconds.
        cpu: per round, each step's CPU seconds.
    """

    wall: list[list[float]] = dataclasses.field(default_factory=list)
    cpu: list[list[float]] = dataclasses.field(default_factory=list)

    def new_round(self) -> None:
        """Starts a round: the steps timed from now on belong to it."""
        self.wall.append([])
        self.cpu.append([])

    def time(self, step: Callable[[], T]) -> T:
        """Runs `step()` once, adds its wall and CPU seconds to the round; returns its result."""
        if not self.wall:
            raise ValueError("StepTimes.time: no round started. Call new_round() first.")
        wall, cpu = time.perf_counter(), time.process_time()
        result = step()
        cpu = time.process_time() - cpu
        wall = time.perf_counter() - wall
        self.wall[-1].append(wall)
        self.cpu[-1].append(cpu)
        return result

    def wall_per_round(self) -> list[float]:
        """The median wall seconds of each round's steps."""
        return [statistics.median(steps) for steps in self.wall]

    def cpu_per_round(self) -> list[float]:
        """The median CPU seconds of each round's steps."""
        return [statistics.median(steps) for steps in self.cpu]


def interleaved_rounds(
    turns: Sequence[Callable[[StepTimes], T]],
    times: Sequence[StepTimes],
    *,
    rounds: int,
    alternate: bool = False,
    untimed: int = 0,
) -> list[list[T]]:
    """Times variants side by side: in each round, every variant takes its turn.

    On a shared machine the load drifts; taking the variants in turn exposes
    them all to the same drift, so their ratios hold better than those of
    timings taken one variant after the other.

    Args:
        turns: per variant, a function that runs its steps of one round,
            timing them with the `StepTimes` it is given (`StepTimes.time`).
        times: per variant, where its timed rounds are added (a new round each).
        rounds: how many timed rounds.
        alternate: take the variants in reverse order in every other round, so
            that none always runs right after the same one.
        untimed: rounds to run first whose times and results are dropped (to
            trace the train functions again, say).

    Returns:
        Per variant, what its turn returned in each timed round.

    Example:
        >>> times = [StepTimes(), StepTimes()]
        >>> turns = [lambda t: t.time(lambda: sum(range(1000))), lambda t: t.time(list)]
        >>> interleaved_rounds(turns, times, rounds=3, alternate=True)[0]
        [499500, 499500, 499500]
        >>> len(times[1].cpu_per_round())
        3
    """
    if len(turns) != len(times):
        raise ValueError(
            f"interleaved_rounds: one StepTimes per turn is needed. Received: "
            f"{len(turns)} turns and {len(times)} StepTimes."
        )
    results: list[list[T]] = [[] for _ in turns]
    order = list(range(len(turns)))
    for round_ in range(untimed + rounds):
        timed = round_ >= untimed
        for i in order[::-1] if alternate and round_ % 2 else order:
            clock = times[i] if timed else StepTimes()
            clock.new_round()
            result = turns[i](clock)
            if timed:
                results[i].append(result)
    return results


def default_device() -> str:
    """`"GPU:0"` when TensorFlow sees a GPU, else `"CPU:0"` (imports TensorFlow)."""
    import tensorflow as tf

    return "GPU:0" if tf.config.list_logical_devices("GPU") else "CPU:0"


def measure_steps(
    model: Any, x: Any, y: Any, times: StepTimes, *, steps: int, warmup: int = 1
) -> int:
    """Training steps measured as `tfrecompute.measure_step` does, each timed on both clocks.

    Converts the batch to tensors on the device (`default_device()`), runs
    `warmup` untimed steps of the model's compiled train function
    (`train_on_batch`, as `model.fit` runs it), then `steps` steps: for each,
    the allocator's peak is reset, the step is timed into the latest round of
    `times`, and the peak above the bytes in use before it is read.
    (`measure_step` keeps only the median wall time; the benchmarks need
    every step on both clocks.)

    Returns:
        The largest peak a step added to the allocator, in bytes.
    """
    import keras
    import tensorflow as tf

    from tfrecompute.costs.measured import memory_info

    device = default_device()
    with tf.device(device):
        x = keras.tree.map_structure(tf.convert_to_tensor, x)
        if y is not None:
            y = keras.tree.map_structure(tf.convert_to_tensor, y)
    for _ in range(warmup):
        model.train_on_batch(x, y)
    peaks = []
    for _ in range(steps):
        before = memory_info("measure_steps", device)["current"]
        tf.config.experimental.reset_memory_stats(device)
        times.time(lambda: model.train_on_batch(x, y))
        peaks.append(memory_info("measure_steps", device)["peak"] - before)
    return int(max(peaks))


def ratios(cpu: float | None, wall: float | None) -> str:
    """A CPU-time and a wall-time ratio for a table, `"1.31x CPU / 1.29x wall"`; "-" if missing.

    Example:
        >>> ratios(1.3125, 1.29)
        '1.31x CPU / 1.29x wall'
    """
    if cpu is None or wall is None:
        return "-"
    return f"{cpu:.2f}x CPU / {wall:.2f}x wall"
