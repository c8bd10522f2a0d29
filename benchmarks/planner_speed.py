"""Speed and quality of the planner on heterogeneous chains of 100, 200 and 1000 layers.

Usage:
    python benchmarks/planner_speed.py          # benchmarks/results/planner_speed.{json,md}
    python benchmarks/planner_speed.py --smoke  # tiny chains, to a temporary directory
    python benchmarks/planner_speed.py --out DIR

Two families of chains, both from a fixed seed:

* "random": every layer's output size log-uniform in [256 KiB, 16 MiB], saved
  bytes 1x to 3x the output, workspace half of the time, cost a float in
  seconds independent of the sizes. No two layers alike: the hard case (large
  Pareto sets, costs too fine for exact 64-bit sums).
* "blocks": repeated conv/batch-norm/relu blocks in stages that halve the
  activation size, costs proportional to the size. Many equal layers, as in
  real models.
* "residual": the "random" layers with residual shortcuts (every third
  layer's output is carried three layers, to the layer that adds it back) and
  random parameter-gradient sizes, so segments hold carries and backward
  moments hold gradients.

For each chain, `optimal` is timed at budgets spread between `min_peak` and the
peak of storing everything (share 0 is the least peak), next to `heuristic` (the
greedy baseline) and `frontier`. Times are the best of a few repeats in one
process; ratios to the heuristic say more than absolute times on a shared
machine. Where `optimal` stopped at its work limit before proving optimality,
the gap is measured against a search given 10x the work.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import _report  # noqa: E402
from tfrecompute.strategies import (  # noqa: E402
    DEFAULT_MAX_WORK,
    Chain,
    format_bytes,
    frontier,
    heuristic,
    min_peak,
    none,
    optimal,
)

SHARES = (0.0, 0.05, 0.2, 0.5, 0.9)
SEED = 20161001
T = TypeVar("T")


def random_chain(n: int, seed: int) -> Chain:
    """Independent random layers: the hard case."""
    rng = random.Random(seed)
    outputs = [int(2 ** rng.uniform(18, 24)) for _ in range(n)]
    return Chain(
        int(2 ** rng.uniform(18, 24)),
        outputs,
        [int(o * rng.uniform(1.0, 3.0)) for o in outputs],
        [rng.uniform(1e-4, 1e-2) for _ in range(n)],
        workspace_bytes=[int(o * rng.random()) if rng.random() < 0.5 else 0 for o in outputs],
        names=[f"layer_{i}" for i in range(n)],
    )


def block_chain(n: int, seed: int) -> Chain:
    """conv/bn/relu blocks in four stages whose activations halve: many equal layers."""
    rng = random.Random(seed)
    base = 1 << rng.randint(22, 24)
    outputs, saved, costs, names = [], [], [], []
    for i in range(n):
        stage = min(3, 4 * i // n)
        size = base >> stage
        kind = ("conv", "bn", "relu")[i % 3]
        outputs.append(size)
        saved.append({"conv": 2 * size, "bn": 2 * size, "relu": size}[kind])
        costs.append({"conv": 8.0, "bn": 1.0, "relu": 0.5}[kind] * (size / base))
        names.append(f"{kind}_{i}")
    return Chain(base, outputs, saved, costs, names=names)


def residual_chain(n: int, seed: int) -> Chain:
    """The random layers plus residual carries and parameter gradients."""
    base = random_chain(n, seed)
    rng = random.Random(seed + 1)
    carries = [(i, i + 3, base.output_bytes[i]) for i in range(0, n - 2, 3)]
    return Chain(
        base.input_bytes,
        base.output_bytes,
        base.saved_bytes,
        base.forward_cost,
        workspace_bytes=base.workspace_bytes,
        names=base.names,
        carries=carries,
        kept_grad_bytes=[int(2 ** rng.uniform(12, 22)) for _ in range(n)],
    )


FAMILIES: dict[str, Callable[[int, int], Chain]] = {
    "random": random_chain,
    "blocks": block_chain,
    "residual": residual_chain,
}


def best_of(repeats: int, fn: Callable[[], T]) -> tuple[float, T]:
    best = math.inf
    result: Any = None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def bench_chain(family: str, n: int, *, repeats: int, reference: bool) -> dict[str, Any]:
    chain = FAMILIES[family](n, SEED + n)
    low, high = min_peak(chain), none(chain).peak_bytes
    heuristic_s, heuristic_plan = best_of(repeats, lambda: heuristic(chain))
    frontier_s, points = best_of(repeats, lambda: frontier(chain))
    rows = []
    for share in SHARES:
        budget = int(low + share * (high - low))
        seconds, plan = best_of(repeats, lambda b=budget: optimal(chain, b))
        try:
            baseline: float | None = heuristic(chain, budget).recompute_cost
        except ValueError:  # InfeasibleBudgetError: the greedy cannot meet this budget
            baseline = None
        row: dict[str, Any] = {
            "share": share,
            "budget": budget,
            "seconds": seconds,
            "cost": plan.recompute_cost,
            "peak": plan.peak_bytes,
            "segments": len(plan.segments),
            "proven_optimal": plan.proven_optimal,
            "heuristic_cost": baseline,
            "reference_cost": None,
            "gap_pct": 0.0 if plan.proven_optimal else None,
        }
        if reference and not plan.proven_optimal:
            better = optimal(chain, budget, max_work=10 * DEFAULT_MAX_WORK)
            best_cost = min(better.recompute_cost, plan.recompute_cost)
            row["reference_cost"] = best_cost
            row["gap_pct"] = 100.0 * (plan.recompute_cost / best_cost - 1) if best_cost else 0.0
        rows.append(row)
    return {
        "family": family,
        "n": n,
        "min_peak": low,
        "none_peak": high,
        "total_forward_cost": chain.total_forward_cost,
        "heuristic_seconds": heuristic_s,
        "heuristic_peak": heuristic_plan.peak_bytes,
        "frontier_seconds": frontier_s,
        "frontier_points": len(points),
        "frontier_exact": all(p.proven_optimal for p in points),
        "optimal": rows,
    }


def markdown(report: dict[str, Any]) -> str:
    info = report["machine"]
    lines = [
        "# Planner speed",
        "",
        f"Machine: {info['platform']}, {info['processor']}, {info['cpu_count']} CPUs; "
        f"Python {info['python']}, numpy {info['numpy']}. Single core, best of "
        f"{report['repeats']}; `optimal` with `max_work={report['max_work']:,}`.",
        "",
        "Budget share s: budget = min_peak + s * (peak of storing everything - min_peak). "
        "Gap: extra cost over a search with 10x the work, when `optimal` stopped before "
        "proving optimality. Cost is in % of one forward pass.",
        "",
        "| chain | n | share | budget | optimal s | x heuristic time | cost % | proven | "
        "gap % | heuristic cost % |",
        "|---|---:|---:|---:|---:|---:|---:|:---:|---:|---:|",
    ]
    for result in report["results"]:
        forward = result["total_forward_cost"] or 1.0
        for row in result["optimal"]:
            gap = "-" if row["gap_pct"] is None else f"{row['gap_pct']:.2f}"
            greedy = (
                "infeasible"
                if row["heuristic_cost"] is None
                else f"{100 * row['heuristic_cost'] / forward:.1f}"
            )
            ratio = row["seconds"] / max(result["heuristic_seconds"], 1e-9)
            lines.append(
                f"| {result['family']} | {result['n']} | {row['share']:.2f} | "
                f"{format_bytes(row['budget'])} | {row['seconds']:.3f} | {ratio:.1f} | "
                f"{100 * row['cost'] / forward:.1f} | {'yes' if row['proven_optimal'] else 'no'} "
                f"| {gap} | {greedy} |"
            )
    lines += [
        "",
        "| chain | n | min peak | store-all peak | heuristic s | frontier s | frontier points "
        "| frontier exact |",
        "|---|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for result in report["results"]:
        lines.append(
            f"| {result['family']} | {result['n']} | {format_bytes(result['min_peak'])} | "
            f"{format_bytes(result['none_peak'])} | {result['heuristic_seconds']:.3f} | "
            f"{result['frontier_seconds']:.3f} | {result['frontier_points']} | "
            f"{'yes' if result['frontier_exact'] else 'no'} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs the benchmark; returns the report written to `<out>/planner_speed.json`."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny chains, one repeat")
    parser.add_argument("--out", type=Path, default=None, help="output directory")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)

    sizes = (12, 40) if args.smoke else (100, 200, 1000)
    repeats = 1 if args.smoke else args.repeats
    out = _report.output_dir(args.out, smoke=args.smoke, name="planner_speed")

    results = [
        bench_chain(family, n, repeats=repeats, reference=not args.smoke)
        for family in FAMILIES
        for n in sizes
    ]
    report = {
        "machine": {**_report.machine(), **_report.versions("numpy")},
        "repeats": repeats,
        "max_work": DEFAULT_MAX_WORK,
        "seed": SEED,
        "shares": list(SHARES),
        "results": results,
    }
    _report.write(out, "planner_speed", report, markdown(report))
    return report


if __name__ == "__main__":
    main()
