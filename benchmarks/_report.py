"""What every benchmark script shares: the machine it ran on, where and how it writes, and how
it runs itself in fresh processes.

A script imports it as `from benchmarks import _report` after putting the
repository root on `sys.path` (each script does, so that it runs alone).
"""

from __future__ import annotations

import collections
import json
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
STDERR_TAIL = 3000  # characters of a failed worker's stderr quoted in the error


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
