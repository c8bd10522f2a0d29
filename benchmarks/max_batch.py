"""The largest batch under a memory cap, found by `tfrecompute.max_batch_size`.

The model is the encoder of `encoder_table.py` (`tests/models_zoo.transformer_encoder`:
12 post-norm layers, hidden 256, sequence 128, 4 heads, dropout 0.1), trained
with SGD on a mean squared error loss. For each strategy (`none`: storing
everything; `optimal`), `max_batch_size` searches batch sizes in multiples
of 4 under a 512 MiB cap: exponential, then binary, each probe a verified
plan (measured compiled train steps, re-planned with the measured
correction) in a fresh process. Reported: the batch found, its measured
peak as a share of the cap, its plan's recompute cost (share of one
forward), every probe, and the search's wall and CPU time (CPU time of
this process and its finished children).

    python benchmarks/max_batch.py            # benchmarks/results/max_batch.{json,md}
    python benchmarks/max_batch.py --smoke    # a tiny encoder, to a temporary directory
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # for `benchmarks._report` (and this checkout's tfrecompute)

from benchmarks import _report, encoder_table  # noqa: E402

MIB = 1 << 20
STRATEGIES = ("none", "optimal")

FULL: dict[str, Any] = {  # the encoder and cap of encoder_table.py
    "model": encoder_table.FULL["model"],
    "cap_bytes": encoder_table.FULL["cap_bytes"],
    "multiple": 4,
}
SMOKE: dict[str, Any] = {
    "model": {"layers": 2, "hidden": 64, "sequence": 32, "heads": 4, "vocab": 100, "dropout": 0.1},
    "cap_bytes": 32 * MIB,
    "multiple": 16,
}


def _children_cpu() -> float:
    usage = os.times()
    return usage.user + usage.system + usage.children_user + usage.children_system


def search(config: dict[str, Any]) -> list[dict[str, Any]]:
    """Runs `max_batch_size` for each strategy; one row each."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras

    import tfrecompute
    from tests import models_zoo

    keras.utils.set_random_seed(0)
    model = models_zoo.transformer_encoder(**config["model"])
    model.compile(optimizer="sgd", loss="mse")
    sample = models_zoo.synthetic_batch(model, config["multiple"])
    rows = []
    for strategy in STRATEGIES:
        wall, cpu = time.perf_counter(), _children_cpu()
        found = tfrecompute.max_batch_size(
            model,
            sample,
            budget=config["cap_bytes"],
            strategy=strategy,
            multiple=config["multiple"],
            progress=lambda p, s=strategy: print(f"[max_batch] {s} {p}", file=sys.stderr),
        )
        plan = found.plan
        total = plan.chain.total_forward_cost
        rows.append(
            {
                "strategy": strategy,
                "batch_size": found.batch_size,
                "peak_bytes": found.peak_bytes,
                "predicted_bytes": plan.peak_bytes,
                "segments": len(plan.segments),
                "recompute_share": plan.recompute_cost / total if total else 0.0,
                "probes": [
                    {"batch_size": p.batch_size, "fits": p.fits, "peak_bytes": p.peak_bytes}
                    for p in found.probes
                ],
                "wall_seconds": time.perf_counter() - wall,
                "cpu_seconds": _children_cpu() - cpu,
            }
        )
    return rows


def markdown(report: dict[str, Any]) -> str:
    cap = report["config"]["cap_bytes"]
    lines = [
        "# The largest batch under a memory cap (`max_batch_size`)",
        "",
        f"Machine: {report['machine']}. Encoder {report['config']['model']}, SGD, cap "
        f"{cap / MIB:.0f} MiB, batch sizes in multiples of {report['config']['multiple']}; "
        "every probe a verified plan measured in a fresh process.",
        "",
        "| strategy | max batch | measured MiB (share of the cap) | predicted MiB | segments "
        "| recompute | probes | search wall s | search CPU s |",
        "|---|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for row in report["rows"]:
        probes = ", ".join(f"{p['batch_size']}{'' if p['fits'] else ' x'}" for p in row["probes"])
        lines.append(
            f"| {row['strategy']} | {row['batch_size']} | {row['peak_bytes'] / MIB:.1f} "
            f"({row['peak_bytes'] / cap:.0%}) | {row['predicted_bytes'] / MIB:.1f} | "
            f"{row['segments']} | {row['recompute_share']:.0%} | {probes} | "
            f"{row['wall_seconds']:.0f} | {row['cpu_seconds']:.0f} |"
        )
    lines += ["", "Probes: batch sizes in the order tried; x marks one that did not fit."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny encoder, a small cap")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    config = SMOKE if args.smoke else FULL
    report = {
        "machine": f"{platform.platform()}, {os.cpu_count()} CPUs",
        "config": config,
        "rows": search(config),
    }
    out = _report.output_dir(args.out, smoke=args.smoke, name="max_batch")
    _report.write(out, "max_batch", report, markdown(report))
    return report


if __name__ == "__main__":
    main()
