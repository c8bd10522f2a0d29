"""Every example runs (small settings) so that none of them rots."""

from __future__ import annotations

import importlib.util
import pathlib

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quickstart(capsys):
    _load("quickstart").main(["--depth", "4", "--width", "256", "--batch-size", "512"])
    out = capsys.readouterr().out
    assert "no recompute" in out and "RecomputeBlock x2" in out
    assert "of the memory" in out
