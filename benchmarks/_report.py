"""What every benchmark script shares: the machine it ran on, and where and how it writes.

A script imports it as `from benchmarks import _report` after putting the
repository root on `sys.path` (each script does, so that it runs alone).
"""

from __future__ import annotations

import json
import os
import platform
import sys
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


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
