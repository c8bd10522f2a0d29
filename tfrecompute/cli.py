"""The `tfrecompute` command line: plan, profile and plot recompute for a saved model.

Subcommands (each takes `--help`):

* `plan MODEL.keras --batch-size N [--strategy NAME] [--budget 2GiB [--headroom 0.3]]
  [--all-names]`: the plan table (`--all-names` names every layer of each
  row). A budget is planned less its headroom for the allocator
  (`tfrecompute.strategies.DEFAULT_HEADROOM` by default).
* `profile MODEL.keras --batch-size N`: the per-link costs the planner sees.
* `frontier MODEL.keras --batch-size N [--plot out.png] [--budget B [--headroom H]]`:
  the memory/recompute-cost Pareto curve.
* `timeline MODEL.keras --batch-size N [--plot out.png] [--strategy S] [--budget B [--headroom H]]`:
  predicted live memory over one training step, without and with the plan.

Exit codes: 0 on success, 2 for usage errors (bad arguments, a malformed
budget, an unknown strategy, a model file that does not exist), 1 for other
errors (an unreadable model, a model that cannot be planned, an infeasible
budget, plotting without matplotlib).

Example:

```bash
tfrecompute plan model.keras --batch-size 64 --strategy optimal --budget 2GiB
python -m tfrecompute frontier model.keras --batch-size 64 --plot frontier.png
```
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TextIO

from tfrecompute import strategies
from tfrecompute._messages import received
from tfrecompute.errors import InfeasibleBudgetError
from tfrecompute.strategies._table import table
from tfrecompute.strategies.headroom import check_headroom
from tfrecompute.strategies.units import budget_bytes

__all__ = ["main"]

_PLOT_EXTRA = 'pip install "tfrecompute[plot]"'
_MIB = float(2**20)


class CliError(Exception):
    """An error the command line reports as one message and an exit code.

    Attributes:
        code: the exit code, 2 for usage errors and 1 for the others.
    """

    def __init__(self, message: str, *, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


# ----------------------------------------------------------------- arguments


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tfrecompute",
        description="Plan gradient checkpointing (recompute) for a saved Keras model.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def model_command(name: str, help_text: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help_text, description=help_text)
        sub.add_argument("model", metavar="MODEL.keras", help="a model saved with model.save()")
        sub.add_argument(
            "--batch-size", type=_positive_int, required=True, help="the training batch size"
        )
        return sub

    def strategy_options(sub: argparse.ArgumentParser, default: str) -> None:
        names = ", ".join((*strategies.available(), "uniform:<k>"))
        sub.add_argument("--strategy", default=default, help=f"one of {names} (default: {default})")
        sub.add_argument("--budget", help='the most memory per step, e.g. "2GiB" or "512MB"')
        sub.add_argument(
            "--headroom",
            help="the share of the budget left for the allocator's rounding "
            f"(default {strategies.DEFAULT_HEADROOM:g}; 0 plans to the budget)",
        )

    plan = model_command("plan", "Print the recompute plan of a model.")
    strategy_options(plan, "sqrt")
    plan.add_argument(
        "--all-names",
        action="store_true",
        help="name every layer of each row (by default a row of three or more names two)",
    )

    model_command("profile", "Print the per-link memory and compute costs of a model.")

    frontier = model_command(
        "frontier", "Print (and plot) the memory / recompute-cost Pareto frontier."
    )
    strategy_options(frontier, "optimal")
    frontier.add_argument("--plot", metavar="OUT.png", help="write the curve to a PNG file")

    timeline = model_command(
        "timeline", "Print (and plot) predicted live memory over one training step."
    )
    strategy_options(timeline, "sqrt")
    timeline.add_argument("--plot", metavar="OUT.png", help="write the timeline to a PNG file")

    return parser


def _budget(command: str, text: str | None) -> int | None:
    if text is None:
        return None
    try:
        return budget_bytes(text, api=f"tfrecompute {command}", name="--budget")
    except (TypeError, ValueError) as error:
        raise CliError(str(error), code=2) from None


def _headroom(command: str, args: argparse.Namespace) -> float | None:
    """`--headroom` as a float (None when not given); usage errors exit with 2."""
    _budget(command, args.budget)
    if args.headroom is None:
        return None
    api = f"tfrecompute {command}"
    if args.budget is None:
        raise CliError(
            f"{api}: --headroom only applies to a --budget. Pass a --budget too.", code=2
        )
    fix = "Pass a share of the budget in [0, 1), e.g. --headroom 0.3 (0 plans to the budget)"
    try:
        value = float(args.headroom)
        check_headroom(api, value)
    except ValueError:
        raise CliError(
            f"{api}: --headroom must be a number in [0, 1). "
            f"{received('--headroom', args.headroom)}. {fix}.",
            code=2,
        ) from None
    return value


def _strategy(command: str, name: str) -> strategies.Strategy:
    try:
        return strategies.get(name)
    except (TypeError, ValueError):
        valid = ", ".join((*strategies.available(), "uniform:<k>"))
        raise CliError(
            f"tfrecompute {command}: unknown strategy. {received('--strategy', name)}. "
            f"Use one of {valid}.",
            code=2,
        ) from None


# -------------------------------------------------------------------- models


def _load_model(command: str, path: str) -> Any:
    """Loads a `.keras` model, compiled as saved: the profile reads its optimizer."""
    if not os.path.isfile(path):
        what = "is a directory" if os.path.isdir(path) else "does not exist"
        raise CliError(
            f"tfrecompute {command}: the model file {what}. {received('model', path)}. "
            "Pass the path of a model saved with model.save('model.keras').",
            code=2,
        )
    _quiet_tensorflow()
    import keras

    import tfrecompute  # noqa: F401  (registers RecomputeBlock for deserialization)

    try:
        return keras.models.load_model(path)
    except Exception as error:  # noqa: BLE001 - any failure means "cannot read it"
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise CliError(
            f"tfrecompute {command}: cannot load the model file ({type(error).__name__}: "
            f"{first}). {received('model', path)}. Pass a model saved with "
            "model.save('model.keras'), with its custom layers importable.",
        ) from None


def _quiet_tensorflow() -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


@contextlib.contextmanager
def _library_errors() -> Iterator[None]:
    """Turns the library's errors into `CliError`s (exit code 1)."""
    try:
        yield
    except InfeasibleBudgetError as error:
        raise CliError(
            f"{error}\nThe minimum feasible budget is {strategies.format_bytes(error.minimum)} "
            f"({error.minimum} bytes): pass --budget {error.minimum} or more."
        ) from None
    except (TypeError, ValueError) as error:
        raise CliError(str(error)) from None


def _progress_bar(done: int, total: int, *, width: int = 30) -> str:
    """One line of the profiling progress bar, e.g. `profiling [#####-----]  5/10 layer calls`."""
    filled = width * done // total if total > 0 else width
    digits = len(str(total))
    return (
        f"profiling [{'#' * filled}{'-' * (width - filled)}] {done:>{digits}}/{total} layer calls"
    )


def _profile(model: Any, batch_size: int, *, progress: TextIO | None = None) -> strategies.Chain:
    """`tfrecompute.profile`, with a progress bar of analysed layer calls on `progress`.

    The bar is redrawn in place on a terminal; elsewhere (a pipe, a log file)
    only the closing summary line is written.
    """
    import tfrecompute

    if progress is None:
        return tfrecompute.profile(model, batch_size)
    interactive = progress.isatty()
    start = time.perf_counter()
    counted = {"total": 0}

    def report(done: int, total: int) -> None:
        counted["total"] = total
        if interactive:
            progress.write(f"\r{_progress_bar(done, total)}")
            progress.flush()

    chain = tfrecompute.profile(model, batch_size, progress=report)
    summary = f"profiled {counted['total']} layer calls in {time.perf_counter() - start:.1f} s"
    if interactive:  # overwrite the whole bar
        summary = "\r" + summary.ljust(len(_progress_bar(counted["total"], counted["total"])))
    progress.write(summary + "\n")
    progress.flush()
    return chain


def _chain(command: str, args: argparse.Namespace, *, progress: bool = False) -> Any:
    model = _load_model(command, args.model)
    with _library_errors():
        return _profile(model, args.batch_size, progress=sys.stderr if progress else None)


# ------------------------------------------------------------------ commands


def _cmd_plan(args: argparse.Namespace) -> int:
    headroom = _headroom("plan", args)  # fail fast, before loading the model
    _strategy("plan", args.strategy)
    model = _load_model("plan", args.model)
    import tfrecompute

    with _library_errors():
        plan = tfrecompute.plan(
            model,
            args.strategy,
            budget=args.budget,
            batch_size=args.batch_size,
            headroom=headroom,
        )
    print(f"Model {model.name!r} at batch size {args.batch_size}")
    print(plan.summary(all_names=args.all_names))
    return 0


def _flops(value: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value:.0f}"


def _cmd_profile(args: argparse.Namespace) -> int:
    chain = _chain("profile", args, progress=True)
    fmt = strategies.format_bytes
    rows = [
        (
            str(i),
            chain.names[i],
            fmt(chain.output_bytes[i]),
            fmt(chain.saved_bytes[i]),
            fmt(chain.workspace_bytes[i]),
            fmt(chain.kept_grad_bytes[i] + chain.applied_grad_bytes[i]),
            fmt(chain.input_copy_bytes[i]),
            _flops(chain.forward_cost[i]),
        )
        for i in range(chain.n)
    ]
    header = ("#", "name", "output", "saved", "workspace", "grads", "input copy", "forward FLOPs")
    print(f"Chain of {chain.n} links at batch size {args.batch_size}")
    print(table(header, rows, right={0, 2, 3, 4, 5, 6, 7}))
    print(
        f"Input {fmt(chain.input_bytes)}; saved in total {fmt(sum(chain.saved_bytes))}; "
        f"forward cost {_flops(chain.total_forward_cost)}FLOPs"
    )
    if any(chain.kept_grad_bytes):
        print(
            "Weight gradients (grads): all kept until the step's end (the optimizer needs "
            f"them together), and {fmt(chain.update_workspace_bytes)} of copies as it updates"
        )
    elif any(chain.applied_grad_bytes):
        print(
            f"Weight gradients (grads): each updated during the backward of the next "
            f"{chain.UPDATE_LAG} links, or at the end of its segment's backward when recomputed"
        )
    none = strategies.none(chain)
    print(
        f"Predicted peak without recompute: {fmt(none.peak_bytes)}; least peak with "
        f"recompute: {fmt(strategies.min_peak(chain))}"
    )
    return 0


def _share(plan: strategies.Plan) -> float:
    total = plan.chain.total_forward_cost
    return 100.0 * plan.recompute_cost / total if total > 0 else 0.0


def _chosen(command: str, chain: Any, args: argparse.Namespace) -> strategies.Plan:
    strategy = _strategy(command, args.strategy)
    headroom = _headroom(command, args)
    with _library_errors():  # the user's budget text, so that errors quote it
        api = f"tfrecompute {command}"
        return strategies.plan_within(api, strategy, chain, args.budget, headroom)


def _cmd_frontier(args: argparse.Namespace) -> int:
    _headroom("frontier", args)
    _strategy("frontier", args.strategy)
    pyplot_figure = _figure_class() if args.plot else None
    chain = _chain("frontier", args)
    chosen = _chosen("frontier", chain, args)
    points = strategies.frontier(chain)
    marks = {
        "none": strategies.none(chain),
        "sqrt": strategies.sqrt(chain),
        "heuristic": strategies.heuristic(chain),
    }
    fmt = strategies.format_bytes
    shown = _spread(points, 12)
    rows = [(fmt(p.peak_bytes), f"{_share(p):.1f}%", str(len(p.segments))) for p in shown]
    print(
        f"Pareto frontier of {chain.n} links at batch size {args.batch_size}: "
        f"{len(points)} plans" + (f", {len(shown)} shown" if len(shown) < len(points) else "")
    )
    print(table(("peak", "recompute cost", "segments"), rows, right={0, 1, 2}))
    label = _chosen_label(args)
    width = max(len(name) for name in [*marks, label]) + 2
    for name, plan in [*marks.items(), (label, chosen)]:
        print(f"{name:<{width}}peak {fmt(plan.peak_bytes)}, cost {_share(plan):.1f}%")
    if pyplot_figure is not None:
        _plot_frontier(pyplot_figure, args.plot, points, marks, label, chosen, args)
        print(f"Wrote {args.plot}")
    return 0


def _chosen_label(args: argparse.Namespace) -> str:
    if not args.budget:
        return str(args.strategy)
    headroom = strategies.DEFAULT_HEADROOM if args.headroom is None else args.headroom
    return f"{args.strategy} @ {args.budget} (headroom {headroom})"


def _spread(points: list[strategies.Plan], most: int) -> list[strategies.Plan]:
    if len(points) <= most:
        return points
    picks = sorted({round(k * (len(points) - 1) / (most - 1)) for k in range(most)})
    return [points[k] for k in picks]


def _cmd_timeline(args: argparse.Namespace) -> int:
    _headroom("timeline", args)
    _strategy("timeline", args.strategy)
    figure = _figure_class() if args.plot else None
    chain = _chain("timeline", args)
    chosen = _chosen("timeline", chain, args)
    base = strategies.none(chain)
    label = _chosen_label(args)
    fmt = strategies.format_bytes
    for name, plan in (("none", base), (label, chosen)):
        events = plan.timeline()
        top = max(events, key=lambda e: e.live_bytes)
        print(
            f"{name}: peak {fmt(top.live_bytes)} during the {top.phase} of link {top.link} "
            f"({chain.names[top.link]}); {len(events)} moments, recompute cost "
            f"{_share(plan):.1f}%"
        )
    if base.peak_bytes:
        print(f"{label} uses {chosen.peak_bytes / base.peak_bytes:.0%} of the peak of none")
    if figure is not None:
        _plot_timeline(figure, args.plot, [("none", base), (label, chosen)], args)
        print(f"Wrote {args.plot}")
    return 0


# ------------------------------------------------------------------ plotting


def _figure_class() -> Any:
    """`matplotlib.figure.Figure` (Agg canvas, no pyplot state), or a CliError."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib.figure import Figure
    except ImportError:
        raise CliError(
            f"tfrecompute: plotting needs matplotlib, which is not installed. Install the "
            f"plot extra: {_PLOT_EXTRA}, or leave out --plot."
        ) from None
    return Figure


def _ticker() -> Any:
    import matplotlib.ticker

    return matplotlib.ticker


def _save(figure: Any, path: str) -> None:
    figure.tight_layout()
    try:
        figure.savefig(path, dpi=150)
    except (OSError, ValueError) as error:
        raise CliError(
            f"tfrecompute: cannot write the plot ({error}). {received('--plot', path)}. "
            "Pass a writable path ending in .png."
        ) from None


def _plot_frontier(
    figure_class: Callable[..., Any],
    path: str,
    points: list[strategies.Plan],
    marks: dict[str, strategies.Plan],
    label: str,
    chosen: strategies.Plan,
    args: argparse.Namespace,
) -> None:
    figure = figure_class(figsize=(7, 4.5))
    axes = figure.add_subplot()
    xs = [p.peak_bytes / _MIB for p in points]
    ys = [_share(p) for p in points]
    # Between two frontier points, the best plan under a budget is the left one:
    # a staircase, extended to the right edge.
    right = max(xs + [p.peak_bytes / _MIB for p in marks.values()]) * 1.04
    axes.step([*xs, right], [*ys, ys[-1]], where="post", color="0.55", lw=1.2, zorder=1)
    axes.scatter(xs, ys, s=14, color="0.35", zorder=2, label="Pareto-optimal plans")
    # sqrt and heuristic often coincide: the diamond is drawn inside the triangle.
    styles = {
        "none": ("s", "tab:gray", 70),
        "sqrt": ("^", "tab:blue", 160),
        "heuristic": ("D", "tab:orange", 45),
    }
    for name, plan in marks.items():
        marker, color, size = styles[name]
        axes.scatter(
            plan.peak_bytes / _MIB,
            _share(plan),
            marker=marker,
            s=size,
            color=color,
            edgecolor="black",
            zorder=3,
            label=f"{name} ({strategies.format_bytes(plan.peak_bytes)}, {_share(plan):.0f}%)",
        )
    axes.scatter(
        chosen.peak_bytes / _MIB,
        _share(chosen),
        marker="*",
        s=220,
        color="tab:red",
        edgecolor="black",
        zorder=4,
        label=f"{label} ({strategies.format_bytes(chosen.peak_bytes)}, {_share(chosen):.0f}%)",
    )
    if args.budget:
        budget = _budget("frontier", args.budget)
        assert budget is not None
        axes.axvline(budget / _MIB, color="tab:red", ls="--", lw=1, label=f"budget {args.budget}")
    axes.set_xlabel("predicted peak memory of a training step (MiB)")
    axes.set_ylabel("recompute cost (% of one forward pass)")
    axes.set_title(
        f"Memory / recompute trade-off: {os.path.basename(args.model)}, batch {args.batch_size}"
    )
    axes.set_ylim(bottom=-3)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8, loc="upper right")
    _save(figure, path)


def _plot_timeline(
    figure_class: Callable[..., Any],
    path: str,
    plans: list[tuple[str, strategies.Plan]],
    args: argparse.Namespace,
) -> None:
    figure = figure_class(figsize=(8, 4.5))
    axes = figure.add_subplot()
    colors = ["tab:gray", "tab:blue"]
    ends = []
    for (name, plan), color in zip(plans, colors):
        events = plan.timeline()
        xs = list(range(len(events) + 1))
        ys = [e.live_bytes / _MIB for e in events]
        axes.step(xs, [*ys, ys[-1]], where="post", color=color, lw=1.6, label=name)
        # Recomputed moments: the extra forward runs during the backward pass.
        shaded = [k for k, event in enumerate(events) if event.phase == "recompute"]
        for k in shaded:
            axes.axvspan(
                k, k + 1, color=color, alpha=0.15, lw=0,
                label=f"{name}: recompute" if k == shaded[0] else None,
            )  # fmt: skip
        top = max(range(len(events)), key=lambda k: events[k].live_bytes)
        axes.axhline(ys[top], color=color, ls=":", lw=1)
        axes.annotate(
            f"peak {strategies.format_bytes(events[top].live_bytes)}",
            (top + 0.5, ys[top]),
            xytext=(0, 6),
            textcoords="offset points",
            ha="center",
            fontsize=8,
            color=color,
        )
        ends.append(len(events))
    forward = plans[0][1].chain.n
    axes.axvline(forward, color="black", lw=0.8, ls="--")
    axes.text(forward / 2, 0.02, "forward", transform=axes.get_xaxis_transform(), ha="center")
    axes.text(
        forward + (max(ends) - forward) / 2,
        0.02,
        "backward",
        transform=axes.get_xaxis_transform(),
        ha="center",
    )
    axes.set_xlim(0, max(ends))
    axes.xaxis.set_major_locator(_ticker().MaxNLocator(integer=True))
    axes.set_ylim(bottom=0, top=max(p.peak_bytes for _, p in plans) / _MIB * 1.15)
    axes.set_xlabel("moment of the training step (one layer run each)")
    axes.set_ylabel("predicted live memory (MiB)")
    axes.set_title(
        f"Memory over one training step: {os.path.basename(args.model)}, batch {args.batch_size}"
    )
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8, loc="upper left")
    _save(figure, path)


# ---------------------------------------------------------------------- main

_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "plan": _cmd_plan,
    "profile": _cmd_profile,
    "frontier": _cmd_frontier,
    "timeline": _cmd_timeline,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the `tfrecompute` command line.

    Args:
        argv: the arguments without the program name; `sys.argv[1:]` when None.

    Returns:
        The exit code: 0 on success, 2 for usage errors, 1 for other errors.

    Example:
        >>> main(["plan", "model.keras", "--batch-size", "64"])  # doctest: +SKIP
        0
    """
    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help, or a usage error argparse already printed
        return exit_.code if isinstance(exit_.code, int) else 2
    try:
        return _COMMANDS[args.command](args)
    except CliError as error:
        print(f"error: {error}", file=sys.stderr)
        return error.code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
