"""Every code example in README.md and docs/*.md runs as pasted, and the site builds strict.

The blocks of one Markdown file run in order in one fresh Python process, in
an empty working directory, sharing one namespace, so a later block may use
what an earlier one defined (as a reader pasting them in order would). What
runs: every ```python block, and every ```bash block whose commands all call
the command line (`tfrecompute ...`, through the `main` the script runs, in
the same process, after the Python blocks above it). Set-up commands (`pip
install`, examples and benchmark scripts) have tests of their own. A block
that cannot run here says so in an HTML comment on the line right above its
fence, with its reason:

    <!-- not run: needs two worker processes -->

Each such block is reported as a skipped test with its reason (`pytest -rs`
lists them), so what is excluded stays visible.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(`{3,})\s*([\w+-]*)")
NOT_RUN = re.compile(r"^<!-- not run: (?P<reason>.+?) -->$")
# Info strings that would hide Python from this test.
DISGUISED = {"py", "py3", "python3", "pycon", "ipython"}


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the first code line, 1-based
    language: str
    code: str
    not_run: str | None  # the reason, if marked

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def runs(self) -> bool:
        if self.not_run is not None:
            return False
        if self.language == "python":
            return True
        commands = [line for line in self.code.splitlines() if line.strip()]
        return self.language == "bash" and all(c.startswith("tfrecompute ") for c in commands)


def blocks_of(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        opened = FENCE.match(lines[i])
        if not opened:
            i += 1
            continue
        fence, language = opened.groups()
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith(fence))
        marker = NOT_RUN.match(lines[i - 1]) if i > 0 else None
        code = "\n".join(lines[i + 1 : end]) + "\n"
        reason = marker["reason"] if marker else None
        found.append(Block(path, i + 2, language, code, reason))
        i = end + 1
    return found


BLOCKS = [block for path in FILES for block in blocks_of(path)]
NOT_RUN_BLOCKS = [block for block in BLOCKS if block.not_run is not None]
RUN_FILES = [path for path in FILES if any(b.runs and b.path == path for b in BLOCKS)]

# This checkout's tfrecompute; plots to files; the command line's tracebacks shown.
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg", "TFRECOMPUTE_TRACEBACK": "1"}

# Runs the blocks given as JSON in order, in one namespace; tracebacks name
# the Markdown file and line.
DRIVER = """
import json, shlex, sys, time
namespace = {"__name__": "__main__"}
for block in json.load(open(sys.argv[1])):
    print(f"----- {block['where']} ({time.process_time():.1f} s CPU so far)", flush=True)
    if block["language"] == "python":
        exec(compile("\\n" * (block["line"] - 1) + block["code"], block["path"], "exec"), namespace)
        continue
    from tfrecompute.cli.command import main  # what the `tfrecompute` script runs

    for command in filter(str.strip, block["code"].splitlines()):
        print(f"$ {command}", flush=True)
        if main(shlex.split(command)[1:]) != 0:
            sys.exit(f"{block['where']}: {command!r} failed")
"""


def _run(path: Path, tmp_path: Path) -> str:
    blocks = [
        {"where": b.where, "path": str(b.path), "line": b.line, "language": b.language,
         "code": b.code}
        for b in blocks_of(path) if b.runs
    ]  # fmt: skip
    (tmp_path / "blocks.json").write_text(json.dumps(blocks))
    result = subprocess.run(
        [sys.executable, "-c", DRIVER, str(tmp_path / "blocks.json")],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # tracebacks in place among the blocks' output
        text=True,
        timeout=600,
        env=ENV,
    )
    assert result.returncode == 0, f"{path.name}: a block failed\n{result.stdout[-6000:]}"
    return result.stdout


# The README's blocks are the ones a newcomer pastes first: they stay in the quick subset.
@pytest.mark.parametrize(
    "path",
    [pytest.param(p, marks=[] if p.name == "README.md" else pytest.mark.slow) for p in RUN_FILES],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_blocks_run_as_pasted(path, tmp_path):
    _run(path, tmp_path)


@pytest.mark.parametrize("block", NOT_RUN_BLOCKS, ids=lambda b: b.where)
def test_block_not_run(block):
    """Each block marked not to run is a visible skip with its reason."""
    pytest.skip(f"{block.where}: {block.not_run}")


def test_every_python_block_says_python_and_every_marker_names_a_block():
    disguised = [b.where for b in BLOCKS if b.language in DISGUISED]
    assert not disguised, f"{disguised}: label Python blocks ```python so that they run"
    for path in FILES:
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            assert not re.match(r"\s+```", line), f"{path.name}:{i + 1}: start fences at column 0"
            if NOT_RUN.match(line):
                following = lines[i + 1] if i + 1 < len(lines) else ""
                assert FENCE.match(following), f"{path.name}:{i + 1}: a marker with no block"
    assert all(b.not_run.strip() for b in NOT_RUN_BLOCKS)


def test_the_readme_keeps_its_two_set_up_commands():
    commands = [b.code.strip() for b in blocks_of(ROOT / "README.md") if b.language == "bash"]
    assert commands == [
        "pip install . && python examples/quickstart.py",
        'pip install ".[test]" && python -m pytest -q -n 2 --dist loadfile',
    ]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python3 -m pytest -q -p no:cacheprovider -n 2 --dist loadfile" in ci


def test_docs_site_builds_strict(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, result.stderr[-6000:]
    assert (tmp_path / "api" / "index.html").exists()
