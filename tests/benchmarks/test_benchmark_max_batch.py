"""benchmarks/max_batch.py: the table of the largest batches found."""

from __future__ import annotations

from benchmarks import max_batch

MiB = 2**20


def test_table_has_the_batch_its_share_of_the_cap_and_the_probes():
    report = {
        "machine": "test machine",
        "config": {"model": {"layers": 2}, "cap_bytes": 512 * MiB, "multiple": 4},
        "rows": [
            {
                "strategy": "optimal",
                "batch_size": 76,
                "peak_bytes": 500 * MiB,
                "predicted_bytes": 480 * MiB,
                "segments": 12,
                "recompute_share": 0.56,
                "probes": [
                    {"batch_size": 4, "fits": True, "peak_bytes": 1},
                    {"batch_size": 128, "fits": False, "peak_bytes": 0},
                ],
                "wall_seconds": 100.4,
                "cpu_seconds": 180.6,
            }
        ],
    }
    table = max_batch.markdown(report)
    assert "| optimal | 76 | 500.0 (98%) | 480.0 | 12 | 56% | 4, 128 x | 100 | 181 |" in table
    assert "cap 512 MiB" in table
