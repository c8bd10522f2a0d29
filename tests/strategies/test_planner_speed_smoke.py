"""`benchmarks/planner_speed.py --smoke` runs and writes its JSON and Markdown."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "planner_speed.py"


def test_smoke(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("planner_speed", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    report = module.main(["--smoke", "--out", str(tmp_path)])
    written = json.loads((tmp_path / "planner_speed.json").read_text())
    assert written == json.loads(json.dumps(report))
    assert {r["n"] for r in written["results"]} == {12, 40}
    for result in written["results"]:
        for row in result["optimal"]:
            assert row["peak"] <= row["budget"]
    table = (tmp_path / "planner_speed.md").read_text()
    assert table.startswith("# Planner speed") and "| random | 12 |" in table
    assert str(written["machine"]["cpu_count"]) in table
