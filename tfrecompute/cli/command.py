"""The `tfrecompute` command line: plan, profile and plot recompute for a saved model.

Subcommands (each takes `--help`):

* `plan MODEL.keras --batch-size N [--strategy NAME] [--budget 2GiB [--headroom 0.3]]
  [--all-names]`: the plan table (`--all-names` names every layer of each
  row). A budget is planned less its headroom for the allocator
  (`tfrecompute.strategies.DEFAULT_HEADROOM` by default); `--budget 0.5` (or
  `50%`) plans to half the predicted peak of storing everything (without
  headroom unless `--headroom` is given).
* `profile MODEL.keras --batch-size N [--all-names] [--measure] [--measure-time]`: the
  per-link costs the planner sees (every call measured; forward times measured).
* `frontier MODEL.keras --batch-size N [--plot out.png] [--budget B [--headroom H]]`:
  the memory/recompute-cost Pareto curve; under an infeasible budget it is
  still printed and drawn, the budget marked, before the error.
* `timeline MODEL.keras --batch-size N [--plot out.png] [--strategy S] [--budget B [--headroom H]]`:
  predicted live memory over one training step, without and with the plan.
* `plan`, `frontier` and `timeline` take `--verify` with a `--budget`: the
  plan's compiled train step is measured and re-planned until it fits
  (`tfrecompute.verified_plan`; the model must be saved compiled), and
  the measured peak is printed and plotted.
* `max-batch MODEL.keras --budget B [--strategy S] [--multiple N] [--limit L]`: the
  largest batch size whose measured step fits (`tfrecompute.max_batch_size`),
  a bar per measured batch size; it says so when every size tried fitted up
  to `--limit`.

Measured commands run the model on random inputs labelled with its own
outputs (NOTE [ The command line's sample batch ]).

Arguments, budgets, headrooms and strategy names are checked before
TensorFlow is imported, so `--help` and usage errors answer at once.
TensorFlow's start-up logs are hidden unless `--verbose` is given; models
load uncompiled with the optimizer of their saved compile config, so Keras
has no optimizer state to restore and warn about. Tables fit 100 columns
(`--all-names` prints every name in full).

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
import json
import math
import os
import re
import sys
import time
import warnings
import zipfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from tfrecompute import strategies
from tfrecompute._messages import cause, received
from tfrecompute.cli import plots
from tfrecompute.errors import InfeasibleBudgetError
from tfrecompute.startup import count_cpu_memory, quiet_tensorflow
from tfrecompute.strategies._table import WIDTH, free_width, span_name, table
from tfrecompute.strategies.headroom import check_headroom, headroom_of
from tfrecompute.strategies.plan import chain_budget
from tfrecompute.strategies.units import budget_share, check_budget, format_budget

__all__ = ["main"]

_PLOT_EXTRA = 'pip install "tfrecompute[plot]"'


class CliError(Exception):
    """An error the command line reports as one message and an exit code.

    Attributes:
        code: the exit code, 2 for usage errors and 1 for the others.
        infeasible: the library found the budget infeasible.
    """

    def __init__(self, message: str, *, code: int = 1, infeasible: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.infeasible = infeasible


# ----------------------------------------------------------------- arguments


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


_POLICIES = ("nothing", "dots", "attention")


def _policies(text: str) -> str | list[str]:
    """`--policy`: one name, or several joined by commas (a state each)."""
    names = [name.strip() for name in text.split(",")]
    for name in names:
        if name not in _POLICIES:
            raise argparse.ArgumentTypeError(
                f"unknown policy {name!r}: choose from {', '.join(_POLICIES)}, or several "
                "joined by commas (attention,dots)"
            )
    return names[0] if len(names) == 1 else names


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tfrecompute",
        description="Plan gradient checkpointing (recompute) for a saved Keras model.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def model_command(name: str, help_text: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help_text, description=help_text)
        _model_options(sub)
        return sub

    def all_names(sub: argparse.ArgumentParser) -> None:
        sub.add_argument(
            "--all-names",
            action="store_true",
            help=f"print every layer name in full (by default tables fit {WIDTH} columns: "
            "a row of more than two layer calls is named by its first and last and a count)",
        )

    plan = model_command("plan", "Print the recompute plan of a model.")
    _strategy_options(plan, "optimal")
    all_names(plan)

    profile = model_command("profile", "Print the per-link memory and compute costs of a model.")
    all_names(profile)
    _measure_flags(profile)

    frontier = model_command(
        "frontier", "Print (and plot) the memory / recompute-cost Pareto frontier."
    )
    _strategy_options(frontier, "optimal")
    frontier.add_argument("--plot", metavar="OUT.png", help="write the curve to a PNG file")

    timeline = model_command(
        "timeline", "Print (and plot) predicted live memory over one training step."
    )
    _strategy_options(timeline, "optimal")
    all_names(timeline)
    timeline.add_argument("--plot", metavar="OUT.png", help="write the timeline to a PNG file")

    _max_batch_options(commands)
    return parser


def _strategy_options(sub: argparse.ArgumentParser, default: str) -> None:
    """`--strategy`, `--budget`, `--headroom` and `--verify`."""
    names = ", ".join((*strategies.available(), "uniform:<k>"))
    sub.add_argument("--strategy", default=default, help=f"one of {names} (default: {default})")
    sub.add_argument(
        "--budget",
        help='the most memory per step, e.g. "2GiB" or "512MB", or a share of the '
        "predicted peak of storing everything, e.g. 0.5 (or 50%%) for half of it",
    )
    sub.add_argument(
        "--headroom",
        help="the share of the budget left for the allocator's rounding "
        f"(default {strategies.DEFAULT_HEADROOM:g}; 0 plans to the budget)",
    )
    sub.add_argument(
        "--verify",
        action="store_true",
        help="run the plan's compiled train step (the model saved compiled) and re-plan "
        "until the measured step fits the --budget; headroom then comes from the measurement",
    )
    sub.add_argument(
        "--calibrate",
        action="store_true",
        help="reconcile the predicted memory with one measured train step storing everything "
        "(the model saved compiled) before planning",
    )


def _measure_flags(profile: argparse.ArgumentParser) -> None:
    profile.add_argument(
        "--measure",
        action="store_true",
        help="run every layer call and read the allocator (by default only the calls whose "
        "gradient graph does not show what they allocate, such as XLA functions)",
    )
    profile.add_argument(
        "--measure-time",
        action="store_true",
        help="replace the estimated FLOPs of each link by its measured forward time",
    )


def _max_batch_options(commands: Any) -> None:
    text = "Find the largest batch size whose measured train step fits a budget."
    sub = commands.add_parser("max-batch", help=text, description=text)
    sub.add_argument(
        "model", metavar="MODEL.keras", help="a model saved compiled with model.save()"
    )
    sub.add_argument("--budget", required=True, help='the most memory per step, e.g. "2GiB"')
    names = ", ".join((*strategies.available(), "uniform:<k>"))
    sub.add_argument("--strategy", default="optimal", help=f"one of {names} (default: optimal)")
    sub.add_argument("--multiple", type=_positive_int, default=1, help="try multiples of N")
    sub.add_argument("--limit", type=_positive_int, default=65536, help="the largest batch tried")
    sub.add_argument("--dim", type=_positive_int, help="the size of unknown input dimensions")
    sub.add_argument("--all-names", action="store_true", help="print every layer name in full")
    sub.add_argument("-v", "--verbose", action="store_true", help="show TensorFlow's logs")


def _model_options(sub: argparse.ArgumentParser) -> None:
    """The options of every command that reads a saved model."""
    sub.add_argument("model", metavar="MODEL.keras", help="a model saved with model.save()")
    sub.add_argument(
        "--batch-size", type=_positive_int, required=True, help="the training batch size"
    )
    sub.add_argument(
        "--dim",
        type=_positive_int,
        help="the size of every input dimension the model leaves unknown, e.g. the "
        "sequence length of a keras-hub backbone's (None, None) token ids",
    )
    sub.add_argument(
        "--policy",
        type=_policies,
        help='plan with a recompute policy: "dots" lets a segment keep its weight products '
        'and recompute the rest, "attention" keep all but its attention cores (a third '
        "state per segment, shown as 'selective'); several joined by commas "
        "(attention,dots) give the planner a state each",
    )
    sub.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="show TensorFlow's start-up logs (hidden by default)",
    )


def _budget(command: str, text: str | None, chain: Any = None) -> int | None:
    """`--budget` in bytes (None when not given): a share is taken of `chain`'s predicted
    peak of storing everything; without a chain the budget is only checked (and None
    returned for a share). Usage errors exit with 2."""
    if text is None:
        return None
    api = f"tfrecompute {command}"
    try:
        check_budget(text, api=api, name="--budget")
        if chain is None and budget_share(text, api=api, name="--budget") is not None:
            return None
        return chain_budget(api, chain, text)
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


_NUMBER = re.compile(r"(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def _budget_number(text: Any) -> Any:
    """A `--budget` without a unit as the number it is, so that it means what it means in
    Python: digits an int of bytes, a decimal a float (a share of storing everything in
    (0, 1], a whole number of bytes above 1, anything else refused). Other text as given."""
    if not isinstance(text, str) or not _NUMBER.fullmatch(text.strip()):
        return text
    return int(text) if text.strip().isdigit() else float(text)


def _check_options(command: str, args: argparse.Namespace) -> None:
    """Every option a command has, checked before TensorFlow is imported."""
    if hasattr(args, "budget"):
        args.budget = _budget_number(args.budget)
    if hasattr(args, "strategy"):
        if hasattr(args, "headroom"):
            _headroom(command, args)
        else:
            _budget(command, args.budget)
        _strategy(command, args.strategy)
    if getattr(args, "verify", False):
        if args.calibrate:
            raise CliError(
                f"tfrecompute {command}: --verify measures the checkpointed model's own step, "
                "so there is nothing to calibrate. Pass --verify or --calibrate, not both.",
                code=2,
            )
        if args.budget is None:
            raise CliError(
                f"tfrecompute {command}: --verify measures a plan made for a budget. "
                "Pass a --budget too.",
                code=2,
            )
        if args.headroom is not None:
            raise CliError(
                f"tfrecompute {command}: --verify takes its headroom from the measured step. "
                f"{received('--headroom', args.headroom)}. Leave out --headroom.",
                code=2,
            )


def _planned_budget(command: str, args: argparse.Namespace, chain: Any) -> plots.Budget | None:
    """The budget as the plots mark it: the total and what the plan had to fit."""
    total = _budget(command, args.budget, chain)
    if total is None:
        return None
    given = None if args.headroom is None else float(args.headroom)
    share = headroom_of(f"tfrecompute {command}", args.budget, given, chain)
    planned = max(math.floor(total * (1 - share)), 1)
    return plots.Budget(_budget_text(args.budget), total, planned)


def _budget_text(value: Any) -> str:
    """The budget as written; a share says what it is a share of (`0.5 of storing everything`)."""
    if budget_share(value, api="tfrecompute", name="--budget") is None:
        return str(value)
    return f"{value} of storing everything"


# -------------------------------------------------------------------- models


@dataclass(frozen=True)
class _Loaded:
    """A model loaded for planning, and the optimizer it was saved compiled with."""

    model: Any
    optimizer: Any


def _load_model(command: str, args: argparse.Namespace) -> _Loaded:
    """Loads a `.keras` model uncompiled, with the optimizer of its saved compile config.

    Profiling reads only the optimizer's handling of gradients, so the model is
    not compiled: Keras would otherwise restore the optimizer's variables and
    warn when a model saved untrained has none.
    """
    path = args.model
    if not os.path.isfile(path):
        what = "is a directory" if os.path.isdir(path) else "does not exist"
        raise CliError(
            f"tfrecompute {command}: the model file {what}. {received('model', path)}. "
            "Pass the path of a model saved with model.save('model.keras').",
            code=2,
        )
    quiet_tensorflow(verbose=args.verbose)
    count_cpu_memory()  # the command measures: TensorFlow's allocator must count bytes
    import keras

    from tfrecompute import RecomputeBlock  # noqa: F401  (registers it for deserialization)

    try:
        return _Loaded(keras.models.load_model(path, compile=False), _saved_optimizer(path))
    except Exception as error:  # noqa: BLE001 - any failure means "cannot read it"
        raise CliError(
            f"tfrecompute {command}: cannot load the model file ({cause(error)}). "
            f"{received('model', path)}. Pass a model saved with "
            "model.save('model.keras'), with its custom layers importable.",
        ) from None


def _saved_optimizer(path: str) -> Any:
    """The optimizer of a `.keras` file's compile config; None if it was saved uncompiled."""
    import keras

    with zipfile.ZipFile(path) as archive:
        config = json.loads(archive.read("config.json"))
    optimizer = (config.get("compile_config") or {}).get("optimizer")
    return None if optimizer is None else keras.optimizers.get(optimizer)


@contextlib.contextmanager
def _library_errors() -> Iterator[None]:
    """Turns the library's errors into `CliError`s (exit code 1)."""
    try:
        yield
    except (InfeasibleBudgetError, TypeError, ValueError) as error:
        text = str(error).replace("Pass sample=<", "Pass --dim N (or, in Python, sample=<")
        raise CliError(text, infeasible=isinstance(error, InfeasibleBudgetError)) from None


def _progress_bar(done: int, total: int, *, width: int = 30) -> str:
    """One line of the profiling progress bar, e.g. `profiling [#####-----]  5/10 layer calls`."""
    filled = width * done // total if total > 0 else width
    digits = len(str(total))
    return (
        f"profiling [{'#' * filled}{'-' * (width - filled)}] {done:>{digits}}/{total} layer calls"
    )


def _sample(model: Any, batch_size: int, dim: int | None) -> Any:
    """Zeros in the shapes of the model's inputs, unknown dimensions `dim` (None: no sample)."""
    if dim is None or not getattr(model, "inputs", None):
        return None
    import keras
    import numpy as np

    from tfrecompute.graph.layer_graph import declared_input

    def zeros(tensor: Any) -> Any:
        shape = [batch_size, *(dim if d is None else d for d in tuple(tensor.shape)[1:])]
        return np.zeros(shape, keras.backend.standardize_dtype(tensor.dtype))

    declared = declared_input(model)
    return keras.tree.map_structure(zeros, declared)


def _profile(
    model: Any,
    batch_size: int,
    *,
    optimizer: Any = None,
    dim: int | None = None,
    progress: TextIO | None = None,
    policy: str | None = None,
    measure: dict[str, Any] | None = None,
) -> strategies.Chain:
    """`tfrecompute.profile`, with a progress bar of analysed layer calls on `progress`.

    The bar is redrawn in place on a terminal; elsewhere (a pipe, a log file)
    only the closing summary line is written.
    """
    import tfrecompute

    sample = _sample(model, batch_size, dim)
    measure = measure or {}
    if progress is None:
        return tfrecompute.profile(
            model, batch_size, sample=sample, optimizer=optimizer, policy=policy, **measure
        )
    interactive = progress.isatty()
    start = time.perf_counter()
    counted = {"total": 0}

    def report(done: int, total: int) -> None:
        counted["total"] = total
        if interactive:
            progress.write(f"\r{_progress_bar(done, total)}")
            progress.flush()

    chain = tfrecompute.profile(
        model,
        batch_size,
        sample=sample,
        optimizer=optimizer,
        progress=report,
        policy=policy,
        **measure,
    )
    summary = f"profiled {counted['total']} layer calls in {time.perf_counter() - start:.1f} s"
    if interactive:  # overwrite the whole bar
        summary = "\r" + summary.ljust(len(_progress_bar(counted["total"], counted["total"])))
    progress.write(summary + "\n")
    progress.flush()
    return chain


def _chain(
    command: str, args: argparse.Namespace, *, progress: bool = False
) -> tuple[Any, strategies.Chain]:
    """The model of `args` and its chain; every option checked first."""
    _check_options(command, args)
    loaded = _load_model(command, args)
    given = getattr(args, "policy", None)
    policy = given
    if getattr(args, "budget", None) is not None and hasattr(args, "strategy"):
        from tfrecompute.pipeline import weighed_policy

        strategy = _strategy(command, args.strategy)  # NOTE [ Policy states under a budget ]
        policy = weighed_policy(loaded.model, given, strategy, budgeted=True)

    def profiled(policy: Any) -> strategies.Chain:
        return _profile(
            loaded.model,
            args.batch_size,
            optimizer=loaded.optimizer,
            dim=args.dim,
            progress=sys.stderr if progress else None,
            policy=policy,
            measure=_measure_options(args),
        )

    with _library_errors():
        try:
            chain = profiled(policy)
        except Exception as error:  # noqa: BLE001 (states not asked for: plan without them)
            if policy is given:
                raise
            sys.stderr.write(
                f"tfrecompute {command}: the attention and dots states could not be priced "
                f"({type(error).__name__}: {error}); planning whole segments "
                "(--policy nothing skips them).\n"
            )
            chain = profiled(None)
    if getattr(args, "calibrate", False):
        chain = _calibrated(command, args, loaded.model, chain)
    return loaded.model, chain


def _calibrated(command: str, args: argparse.Namespace, model: Any, chain: Any) -> Any:
    """`--calibrate`: the chain reconciled with one measured train step storing everything."""
    from tfrecompute.check.calibrate import calibrated

    _compile_saved(command, args, model)
    with _library_errors():
        sample = _labelled_batch(model, args.batch_size, args.dim)
        return calibrated(f"tfrecompute {command}", chain, sample)


def _measure_options(args: argparse.Namespace) -> dict[str, Any]:
    """`profile`'s `measure` and `measure_time` from `--measure` and `--measure-time`."""
    options: dict[str, Any] = {}
    if getattr(args, "measure", False):
        options["measure"] = True
    if getattr(args, "measure_time", False):
        options["measure_time"] = True
    return options


# ------------------------------------------------------------------ measured


def _compile_saved(command: str, args: argparse.Namespace, model: Any) -> None:
    """Compiles a loaded model from its saved compile config: a measured step needs it."""
    with zipfile.ZipFile(args.model) as archive:
        config = (json.loads(archive.read("config.json")).get("compile_config")) or None
    if config is None:
        raise CliError(
            f"tfrecompute {command}: measuring runs the model's train step, but the model was "
            f"saved uncompiled. {received('model', args.model)}. Save it after "
            "model.compile(optimizer=..., loss=...)."
        )
    with _library_errors():
        model.compile_from_config(config)


def _labelled_batch(model: Any, batch_size: int, dim: int | None) -> tuple[Any, Any]:
    """NOTE [ The command line's sample batch ]

    Random normal floats (zeros for integer inputs, valid token ids) in the
    shapes of the model's inputs, unknown dimensions `--dim` (1 without),
    and as labels the model's own outputs on them: the arg-max over the last
    axis for a sparse loss. Only their shapes and dtypes matter to memory.
    """
    import keras
    import numpy as np

    from tfrecompute.graph.layer_graph import declared_input

    rng = np.random.default_rng(0)

    def sample(tensor: Any) -> Any:
        shape = [batch_size, *((dim or 1) if d is None else d for d in tuple(tensor.shape)[1:])]
        dtype = keras.backend.standardize_dtype(tensor.dtype)
        if "int" in dtype or dtype == "bool":
            return np.zeros(shape, dtype)
        return rng.standard_normal(shape).astype(dtype)

    declared = declared_input(model)
    x = keras.tree.map_structure(sample, declared)
    y = keras.tree.map_structure(np.asarray, model(x, training=False))
    if "sparse" in str(getattr(model.loss, "name", model.loss)):
        y = keras.tree.map_structure(lambda t: np.argmax(t, axis=-1), y)
    return x, y


def _verified(command: str, model: Any, args: argparse.Namespace, chain: Any) -> Any:
    """`tfrecompute.verified_plan` of the loaded model, each measured plan reported on stderr."""
    import tfrecompute

    _compile_saved(command, args, model)
    total = _budget(command, args.budget, chain) or 1
    fmt = strategies.format_bytes

    def report(probe: Any) -> None:
        sys.stderr.write(
            f"measured a plan predicted at {fmt(probe.predicted_bytes)}: "
            f"{fmt(probe.measured_bytes)}, {probe.measured_bytes / total:.0%} of the budget\n"
        )

    with _library_errors():
        sample = _labelled_batch(model, args.batch_size, args.dim)
        return tfrecompute.verified_plan(
            model,
            sample,
            budget=args.budget,
            strategy=args.strategy,
            policy=getattr(args, "policy", None),
            progress=report,
        )


def _verified_choice(
    command: str, model: Any, args: argparse.Namespace, label: str, chain: Any
) -> tuple[strategies.Plan, dict[str, int], plots.Budget]:
    """With --verify: the verified plan, its measured peak by label, and the budget it marks."""
    verified = _verified(command, model, args, chain)
    planned = next(
        p.planned_bytes for p in verified.probes if p.measured_bytes == verified.peak_bytes
    )
    budget = plots.Budget(_budget_text(args.budget), verified.budget_bytes, planned)
    return verified.plan, {label: verified.peak_bytes}, budget


# ------------------------------------------------------------------ commands


def _cmd_plan(args: argparse.Namespace) -> int:
    model, chain = _chain("plan", args)
    if args.verify:
        plan, measured, budget = _verified_choice("plan", model, args, "plan", chain)
    else:
        plan, measured, budget = _chosen("plan", chain, args), {}, None
    print(f"Model {model.name!r} at batch size {args.batch_size}")
    print(plan.summary(all_names=args.all_names))
    fmt = strategies.format_bytes
    if budget is not None:
        print(
            f"Measured train step: {fmt(measured['plan'])}, {measured['plan'] / budget.total:.0%} "
            f"of the budget {format_budget(args.budget, budget.total)} (planned within "
            f"{fmt(budget.planned)})"
        )
    elif args.budget is not None:
        planned = _planned_budget("plan", args, chain)
        assert planned is not None
        print(
            f"Budget: {format_budget(args.budget, planned.total)}, planned within "
            f"{fmt(planned.planned)} ({1 - planned.planned / planned.total:.0%} headroom for "
            "the allocator)"
        )
    _say_stored(plan, args)
    return 0


def _say_stored(plan: strategies.Plan, args: argparse.Namespace) -> None:
    """A line when the plan recomputes nothing though recompute was asked for."""
    if plan.segments or plan.strategy == "none":
        return
    if args.budget is not None:
        why = (
            "storing everything is predicted to fit the budget: pass a lower --budget "
            "(e.g. --budget 0.5 for half of storing everything) to save memory"
        )
    else:
        why = "no plan predicts a lower peak than storing everything for this model"
    print(f"Nothing is recomputed: {why}.")


def _flops(value: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value:.0f}"


def _cost(value: float, seconds: bool) -> str:
    """A forward cost: measured seconds as milliseconds, else FLOPs."""
    return f"{value * 1e3:.2f} ms" if seconds else _flops(value)


def _cmd_profile(args: argparse.Namespace) -> int:
    _, chain = _chain("profile", args, progress=True)
    fmt = strategies.format_bytes
    rows = [
        [
            str(i),
            "",
            fmt(chain.output_bytes[i]),
            fmt(chain.saved_bytes[i]),
            fmt(chain.workspace_bytes[i]),
            fmt(chain.kept_grad_bytes[i] + chain.applied_grad_bytes[i]),
            fmt(chain.input_copy_bytes[i]),
            _cost(chain.forward_cost[i], args.measure_time),
        ]
        for i in range(chain.n)
    ]
    cost = "forward" if args.measure_time else "FLOPs"
    header = ("#", "name", "output", "saved", "workspace", "grads", "copy", cost)
    width = None if args.all_names else free_width(header, rows, 1)
    for row, name in zip(rows, chain.names):
        row[1] = span_name([name], width)
    print(f"Chain of {chain.n} links at batch size {args.batch_size}")
    print(table(header, rows, right={0, 2, 3, 4, 5, 6, 7}))
    total = _cost(chain.total_forward_cost, args.measure_time)
    print(
        f"Input {fmt(chain.input_bytes)}; saved in total {fmt(sum(chain.saved_bytes))}; "
        f"forward cost {total}{'' if args.measure_time else 'FLOPs'}"
    )
    what = "measured time" if args.measure_time else "estimated FLOPs"
    print(f"{cost}: each link's forward ({what}); copy: the copy of its input a recompute reads")
    for state, (kept, cheaper) in enumerate(chain.policy_states, start=1):
        again = _cost(math.fsum(cheaper), args.measure_time)
        under = "the policy" if len(chain.policy_states) == 1 else repr(chain.policy_name(state))
        print(
            f"Under {under} the links keep {fmt(sum(kept))} in total and "
            f"recompute for {again}{'' if args.measure_time else 'FLOPs'}"
        )
    if any(chain.kept_grad_bytes):
        print(
            "Weight gradients (grads): all kept until the step's end (the optimizer needs "
            f"them together), and {fmt(chain.update_workspace_bytes)} of copies as it updates"
        )
    elif any(chain.applied_grad_bytes):
        print(
            f"Weight gradients (grads): each updated during the backward of the next "
            f"{chain.UPDATE_LAG} links,\nor at the end of its segment's backward when "
            f"recomputed; {fmt(chain.applied_workspace_bytes)} of temporaries per update"
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
    _check_options("frontier", args)
    figure_class = _figure_class() if args.plot else None  # before the model loads
    model, chain = _chain("frontier", args)
    label = _chosen_label(args, chain)
    infeasible = None
    try:
        chosen, measured, budget = _choice("frontier", model, chain, args, label)
    except CliError as error:
        if not error.infeasible:
            raise
        # NOTE [ The frontier of an infeasible budget ]: the moment the curve is most
        # wanted; it is printed and drawn with the budget marked, then the error exits 1.
        infeasible, chosen, measured = error, None, {}
        budget = _planned_budget("frontier", args, chain)
    points = strategies.frontier(chain)
    marks = {
        "none": strategies.none(chain),
        "sqrt": strategies.sqrt(chain),
        "heuristic": strategies.heuristic(chain),
    }
    fmt = strategies.format_bytes
    shown = _spread(points, 12)
    header: tuple[str, ...] = ("peak", "recompute cost", "segments")
    rows = [[fmt(p.peak_bytes), f"{_share(p):.1f}%", str(len(p.segments))] for p in shown]
    if chain.has_policy:  # how many segments each plan recomputes under the policy
        header += ("selective",)
        rows = [[*row, str(sum(map(bool, p.selective)))] for row, p in zip(rows, shown)]
    print(
        f"Pareto frontier of {chain.n} links at batch size {args.batch_size}: "
        f"{len(points)} plans" + (f", {len(shown)} shown" if len(shown) < len(points) else "")
    )
    print(table(header, rows, right=set(range(len(header)))))
    width = max(len(name) for name in [*marks, label]) + 2
    for name, plan in [*marks.items(), (label, chosen)]:
        if plan is None:
            print(f"{name:<{width}}no plan fits the budget")
            continue
        print(f"{name:<{width}}peak {fmt(plan.peak_bytes)}, cost {_share(plan):.1f}%")
    _print_measured(measured, budget)
    if figure_class is not None:
        figure = plots.frontier_figure(
            figure_class,
            points,
            marks,
            None if chosen is None else (label, chosen),
            title=_title("Memory / recompute trade-off", args),
            budget=budget,
            measured=measured,
        )
        _save(figure, args.plot)
        print(f"Wrote {args.plot}")
    if infeasible is not None:
        raise infeasible
    return 0


def _choice(
    command: str, model: Any, chain: Any, args: argparse.Namespace, label: str
) -> tuple[strategies.Plan, dict[str, int], plots.Budget | None]:
    """The chosen plan, measured peaks by label (with --verify), and the budget to mark."""
    if args.verify:
        return _verified_choice(command, model, args, label, chain)
    return _chosen(command, chain, args), {}, _planned_budget(command, args, chain)


def _print_measured(measured: dict[str, int], budget: plots.Budget | None) -> None:
    for name, peak in measured.items():
        total = budget.total if budget else 0
        share = f", {peak / total:.0%} of the budget" if total else ""
        print(f"{name}: measured train step {strategies.format_bytes(peak)}{share}")


def _chosen_label(args: argparse.Namespace, chain: Any = None) -> str:
    if not args.budget:
        return str(args.strategy)
    if args.verify:
        return f"{args.strategy} @ {args.budget} (verified)"
    headroom = None if args.headroom is None else float(args.headroom)
    share = float(headroom_of("tfrecompute", args.budget, headroom, chain))
    return f"{args.strategy} @ {_budget_text(args.budget)} (headroom {share:g})"


def _title(what: str, args: argparse.Namespace) -> str:
    return f"{what}: {os.path.basename(args.model)}, batch {args.batch_size}"


def _spread(points: list[strategies.Plan], most: int) -> list[strategies.Plan]:
    if len(points) <= most:
        return points
    picks = sorted({round(k * (len(points) - 1) / (most - 1)) for k in range(most)})
    return [points[k] for k in picks]


def _cmd_timeline(args: argparse.Namespace) -> int:
    _check_options("timeline", args)
    figure_class = _figure_class() if args.plot else None  # before the model loads
    model, chain = _chain("timeline", args)
    label = _chosen_label(args, chain)
    chosen, measured, budget = _choice("timeline", model, chain, args, label)
    base = strategies.none(chain)
    rows = []
    for name, plan in (("none", base), (label, chosen)):
        events = plan.timeline()
        top = max(events, key=lambda e: e.live_bytes)
        rows.append(
            [name, strategies.format_bytes(top.live_bytes), f"{_share(plan):.1f}%"]
            + [f"{top.phase} of link {top.link}", chain.names[top.link]]
        )
    header = ("plan", "peak", "recompute cost", "the peak is during", "link name")
    width = None if args.all_names else free_width(header, rows, 4)
    for row in rows:
        row[4] = span_name([row[4]], width)
    print(f"Predicted live memory of one training step at batch size {args.batch_size}")
    print(table(header, rows, right={1, 2}))
    if base.peak_bytes:
        print(f"{label} uses {chosen.peak_bytes / base.peak_bytes:.0%} of the peak of none")
    _print_measured(measured, budget)
    if figure_class is not None:
        figure = plots.timeline_figure(
            figure_class,
            [("none", base), (label, chosen)],
            title=_title("Memory over one training step", args),
            budget=budget,
            measured=measured,
        )
        _save(figure, args.plot)
        print(f"Wrote {args.plot}")
    return 0


def _budget_bar(probe: Any, total: int, *, width: int = 30) -> str:
    """One line of the max-batch search, e.g. `batch 64 [######----] 52% of the budget, fits`."""
    share = probe.peak_bytes / total if total else 0.0
    filled = min(width, round(width * share))
    bar = f"[{'#' * filled}{'-' * (width - filled)}]"
    if not probe.fits and not probe.peak_bytes:
        return f"batch {probe.batch_size:>6} {bar}  no plan is predicted to fit"
    verdict = "fits" if probe.fits else "does not fit"
    return f"batch {probe.batch_size:>6} {bar} {share:5.0%} of the budget, {verdict}"


def _cmd_max_batch(args: argparse.Namespace) -> int:
    _check_options("max-batch", args)
    if budget_share(args.budget, api="tfrecompute max-batch", name="--budget") is not None:
        raise CliError(
            "tfrecompute max-batch: a budget as a share of storing everything changes with the "
            f"batch size, which this searches. {received('--budget', args.budget)}. Pass the "
            "budget in bytes, e.g. --budget 8GiB.",
            code=2,
        )
    loaded = _load_model("max-batch", args)
    model = loaded.model
    _compile_saved("max-batch", args, model)
    total = _budget("max-batch", args.budget) or 1
    sys.stderr.write(
        f"Trying batch sizes {args.multiple}, {2 * args.multiple}, ... up to --limit "
        f"{args.limit}, each measured in a fresh process\n"
    )
    found = _search_batch(model, args, total)
    fmt = strategies.format_bytes
    where = "each in a fresh process"
    if found.at_limit:
        print(
            f"Every batch size tried fits {model.name!r} under {args.budget}: the search "
            f"stopped at its --limit {args.limit}, so {found.batch_size} is the largest "
            f"tried, not the largest that fits (measured {fmt(found.peak_bytes)}, "
            f"{found.peak_bytes / total:.0%} of the budget; {len(found.probes)} batch sizes "
            f"measured, {where}). Pass a larger --limit to search further."
        )
    else:
        print(
            f"Largest batch size of {model.name!r} under {args.budget}: {found.batch_size} "
            f"(measured {fmt(found.peak_bytes)}, {found.peak_bytes / total:.0%} of the budget; "
            f"{len(found.probes)} batch sizes measured, {where})"
        )
    print(found.plan.summary(all_names=args.all_names))
    return 0


def _search_batch(model: Any, args: argparse.Namespace, total: int) -> Any:
    """`tfrecompute.max_batch_size`, a bar per probe on stderr; the limit is said by the
    command itself, not by the library's warning."""
    import tfrecompute

    def report(probe: Any) -> None:
        sys.stderr.write(_budget_bar(probe, total) + "\n")
        sys.stderr.flush()

    with _library_errors(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"max_batch_size: every batch size tried fits")
        sample = _labelled_batch(model, args.multiple, args.dim)
        try:
            return tfrecompute.max_batch_size(
                model,
                sample,
                budget=args.budget,
                strategy=args.strategy,
                multiple=args.multiple,
                limit=args.limit,
                policy=getattr(args, "policy", None),
                progress=report,
            )
        except RuntimeError as error:
            raise CliError(str(error)) from None


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


def _save(figure: Any, path: str) -> None:
    try:
        figure.savefig(path, dpi=150, bbox_inches="tight")
    except (OSError, ValueError) as error:
        raise CliError(
            f"tfrecompute: cannot write the plot ({error}). {received('--plot', path)}. "
            "Pass a writable path ending in .png."
        ) from None


# ---------------------------------------------------------------------- main

_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "plan": _cmd_plan,
    "profile": _cmd_profile,
    "frontier": _cmd_frontier,
    "timeline": _cmd_timeline,
    "max-batch": _cmd_max_batch,
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
    except Exception as error:  # noqa: BLE001 - one line, not a traceback (NOTE below)
        # NOTE [ Unforeseen errors on the command line ]
        # The library's own errors arrive as `CliError`s; anything else is a failure it
        # did not foresee (a bug here, or in the model's code): one `error:` line that
        # says so, with the way to see the traceback, instead of the traceback itself.
        if os.environ.get("TFRECOMPUTE_TRACEBACK"):
            raise
        text = str(error).strip().splitlines()
        print(
            f"error: tfrecompute {args.command}: {type(error).__name__}: "
            f"{text[0] if text else 'no message'}. This failure was not foreseen: run "
            "again with TFRECOMPUTE_TRACEBACK=1 to see where it happened, and report it.",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
