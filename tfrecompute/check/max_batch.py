"""`max_batch_size`: the largest batch whose measured train step fits a budget.

NOTE [ Probing batch sizes in fresh processes ]
Whether a batch fits is decided by measured steps (`tfrecompute.check.verified_plan`), and
the allocator's peak depends on what earlier steps left: after a large probe
failed, the chunks it split stay split, and the next probe's tensors land in
them with other rounding. So by default each probe runs in a fresh Python
process (`python -m tfrecompute.check._probe`): the model is saved once to a
temporary `.keras` file with its compile configuration, the sample pickled
beside it, and each child loads both, repeats the sample to the probed batch
size, makes a verified plan and reports it as one JSON line. The parent then
applies the found plan's segments to its own model. A model that cannot be
saved (a subclassed model without `get_config`) is searched in this process
with `isolate=False`, at the cost of that fragmentation.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import os
import pickle
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import keras
import numpy as np

from tfrecompute import strategies
from tfrecompute._messages import as_bool, as_positive_int, fail
from tfrecompute.check.twin import labelled
from tfrecompute.check.verified_plan import planner, verify
from tfrecompute.errors import InfeasibleBudgetError
from tfrecompute.strategies.units import budget_bytes, budget_share

__all__ = ["BatchProbe", "MaxBatch", "max_batch_size", "probe_batch", "repeated"]


@dataclasses.dataclass(frozen=True)
class BatchProbe:
    """One batch size tried: whether its verified plan's measured step fitted.

    Attributes:
        batch_size: the batch size.
        fits: whether a plan's measured step fitted the budget.
        peak_bytes: the measured peak of the plan kept (when it fits), else
            the least measured peak (0 when no plan was predicted to fit).
        segments: the plan's segments (links of the chain), when it fits.
        selective: each segment's state (`Plan.selective`), () when every one is
            recomputed whole.
        strategy: the name of the strategy that made the plan.
    """

    batch_size: int
    fits: bool
    peak_bytes: int
    segments: tuple[tuple[int, int], ...] = ()
    selective: tuple[int, ...] = ()
    strategy: str = "manual"


@dataclasses.dataclass(frozen=True)
class MaxBatch:
    """The largest batch that fits, with its plan and the model checkpointed by it.

    Attributes:
        batch_size: the largest batch size whose measured step fitted.
        plan: its plan (on the chain at that batch size).
        model: the model, checkpointed by the plan (the same object, as
            `tfrecompute.recompute` returns it).
        peak_bytes: its measured peak.
        budget_bytes: the budget.
        probes: every batch size tried, in order.
        limit: the largest batch size the search would try.
    """

    batch_size: int
    plan: strategies.Plan
    model: keras.Model
    peak_bytes: int
    budget_bytes: int
    probes: tuple[BatchProbe, ...]
    limit: int = 65536

    @property
    def at_limit(self) -> bool:
        """True when every batch size tried fitted: the search stopped at `limit`, not at a
        batch size that does not fit, and a larger batch may fit too."""
        return all(p.fits for p in self.probes)

    def summary(self) -> str:
        """One line: the batch size found, its measured peak, and whether the limit ended it."""
        fmt = strategies.format_bytes
        line = (
            f"Largest batch size that fits: {self.batch_size} (measured {fmt(self.peak_bytes)}, "
            f"{self.peak_bytes / max(self.budget_bytes, 1):.0%} of the budget "
            f"{fmt(self.budget_bytes)}; {len(self.probes)} batch sizes measured)"
        )
        if self.at_limit:
            line = (
                f"Every batch size tried fits: the search stopped at its limit, {self.limit}, "
                f"so {self.batch_size} is the largest tried, not the largest that fits "
                f"(measured {fmt(self.peak_bytes)}, "
                f"{self.peak_bytes / max(self.budget_bytes, 1):.0%} of the budget "
                f"{fmt(self.budget_bytes)}). Pass a larger limit to search further"
            )
        return line


def repeated(sample: Any, batch_size: int) -> Any:
    """The sample's rows repeated (or cut) to `batch_size` rows, every array alike."""

    def rows(array: Any) -> np.ndarray:
        array = np.asarray(array)
        return np.take(array, np.arange(batch_size) % len(array), axis=0)

    return keras.tree.map_structure(rows, sample)


def probe_batch(
    model: keras.Model, sample: Any, batch_size: int, options: dict[str, Any]
) -> BatchProbe:
    """Makes a verified plan at `batch_size` in this process; a `BatchProbe` of the result."""
    batch = repeated(sample, batch_size)
    made = planner(
        "max_batch_size",
        model,
        batch,
        options["strategy"],
        depth=options["depth"],
        where=options["where"],
        policy=options["policy"],
    )
    try:
        verified = verify(made, options["budget"])
    except InfeasibleBudgetError as error:
        measured = error.minimum if "no measured train step fits" in str(error) else 0
        return BatchProbe(batch_size, False, int(measured))
    finally:
        gc.collect()
    plan = verified.plan
    return BatchProbe(
        batch_size, True, verified.peak_bytes, plan.segments, plan.selective, plan.strategy
    )


class _Isolated:
    """Probes in fresh processes (NOTE [ Probing batch sizes in fresh processes ])."""

    def __init__(self, model: keras.Model, sample: Any, options: dict[str, Any], folder: str):
        self.folder = folder
        model.save(os.path.join(folder, "model.keras"))
        with open(os.path.join(folder, "sample.pkl"), "wb") as f:
            pickle.dump(keras.tree.map_structure(np.asarray, sample), f)
        with open(os.path.join(folder, "options.json"), "w") as f:
            json.dump(options, f)

    def __call__(self, batch_size: int) -> BatchProbe:
        command = [sys.executable, "-m", "tfrecompute.check._probe", self.folder, str(batch_size)]
        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2")}
        package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = os.pathsep.join([package, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        result = subprocess.run(command, capture_output=True, text=True, env=env)
        lines = result.stdout.strip().splitlines()
        try:
            found = json.loads(lines[-1]) if lines else {}
        except json.JSONDecodeError:
            found = {}
        if result.returncode != 0 or "error" in found:
            _probe_failed(batch_size, found, result.stderr)
        segments = tuple((int(s), int(e)) for s, e in found["segments"])
        selective = tuple(int(k) for k in found.get("selective", ()))
        fits, peak = bool(found["fits"]), int(found["peak_bytes"])
        strategy = str(found.get("strategy", "manual"))
        return BatchProbe(batch_size, fits, peak, segments, selective, strategy)


def _probe_failed(batch_size: int, found: dict[str, Any], stderr: str) -> None:
    """Raises what a probe's process reported: the library's own errors as they were
    raised there (a bad argument, a model it cannot plan), anything else as a
    `RuntimeError` with the process's last lines (its traceback is in them)."""
    kind, message = found.get("error"), found.get("message", "")
    if kind in ("ValueError", "TypeError") and str(message).startswith("max_batch_size:"):
        raise (ValueError if kind == "ValueError" else TypeError)(message)
    said = f"{kind}: {message}" if kind else "\n" + stderr[-4000:]
    raise RuntimeError(
        f"max_batch_size: the probe of batch size {batch_size} failed in its process. "
        f"Received: batch_size={batch_size} (of type int). Its error: {said}\n"
        "Pass isolate=False to search in this process (where the error shows its traceback)."
    )


def _options(
    strategy: Any, budget: int, depth: Any, where: Any, policy: Any, isolate: bool
) -> dict[str, Any]:
    """The options each probe plans with; in a fresh process they must travel as JSON."""
    names = [policy] if isinstance(policy, str) else policy
    if (
        isolate
        and policy is not None
        and not (isinstance(names, (list, tuple)) and all(isinstance(n, str) for n in names))
    ):
        fail(
            "max_batch_size",
            "a recompute policy for probes in fresh processes must be a name or a list of names",
            "policy",
            policy,
            'Pass policy="dots" or ["attention", "dots"], or isolate=False',
            error=TypeError,
        )
    if isolate and not isinstance(strategy, str):
        fail(
            "max_batch_size",
            "a strategy for probes in fresh processes must be a name",
            "strategy",
            strategy,
            'Pass a name such as "optimal", or isolate=False',
            error=TypeError,
        )
    if (
        isolate
        and where is not None
        and not (isinstance(where, list) and all(isinstance(n, str) for n in where))
    ):
        fail(
            "max_batch_size",
            "where= for probes in fresh processes must be a list of layer names",
            "where",
            where,
            "Pass layer names, or isolate=False",
            error=TypeError,
        )
    return {
        "strategy": strategy,
        "budget": budget,
        "depth": depth,
        "where": where,
        "policy": policy,
    }


def _search(probe: Callable[[int], BatchProbe], multiple: int, limit: int) -> list[BatchProbe]:
    """Exponential, then binary search over multiples of `multiple` up to `limit`."""
    probes = [probe(multiple)]
    if not probes[-1].fits:
        return probes
    low, high = multiple, None
    while high is None and low * 2 <= limit:
        probes.append(probe(low * 2))
        low, high = (low * 2, None) if probes[-1].fits else (low, low * 2)
    high = high if high is not None else min(low * 2, limit + multiple)
    while high - low > multiple:
        middle = (low + high) // 2 // multiple * multiple
        if middle in (low, high):
            break
        probes.append(probe(middle))
        low, high = (middle, high) if probes[-1].fits else (low, middle)
    return probes


_logger = logging.getLogger(__name__)


def _show(line: str) -> None:
    """A progress line, where Keras writes its own (`fit`'s progress bar): standard output,
    or the log when `keras.config.disable_interactive_logging()` was called."""
    if keras.config.is_interactive_logging_enabled():
        sys.stdout.write(line + "\n")
        sys.stdout.flush()
    else:
        _logger.info(line)


class _ProgressLines:
    """`max_batch_size`'s default progress: what it searches, then one line per probe."""

    def __init__(self, total: int, multiple: int, limit: int, isolate: bool) -> None:
        self.total, self.count, self.start = total, 0, time.perf_counter()
        where = "each in a fresh process" if isolate else "in this process"
        _show(
            f"max_batch_size: trying batch sizes {multiple}, {2 * multiple}, {4 * multiple}, "
            f"... up to limit={limit} until one does not fit, then bisecting; each probe "
            f"plans and measures train steps, {where} (progress=False: quiet)"
        )

    def __call__(self, probe: BatchProbe) -> None:
        self.count += 1
        fmt = strategies.format_bytes
        if probe.fits:
            verdict = f"fits: measured {fmt(probe.peak_bytes)}"
        elif probe.peak_bytes:
            verdict = f"does not fit: measured at least {fmt(probe.peak_bytes)}"
        else:
            verdict = "does not fit: no plan is predicted to fit"
        share = f" ({probe.peak_bytes / self.total:.0%} of the budget)" if probe.peak_bytes else ""
        elapsed = time.perf_counter() - self.start
        _show(
            f"Probe {self.count}: batch size {probe.batch_size} {verdict}{share} - {elapsed:.0f}s"
        )


def _progress(
    progress: Any, total: int, multiple: int, limit: int, isolate: bool
) -> Callable[[BatchProbe], None] | None:
    """The function each probe is reported to (None: quiet)."""
    if progress is None or progress is False:
        return None
    if progress is True:
        return _ProgressLines(total, multiple, limit, isolate)
    if not callable(progress):
        fail(
            "max_batch_size",
            "`progress` must be a bool or a function of a BatchProbe",
            "progress",
            progress,
            "Pass progress=True (a line per probe), False (quiet) or a function",
            error=TypeError,
        )
    return progress


def _bytes_budget(budget: Any) -> int:
    """The budget in bytes: a share of storing everything is refused, the batch size is
    what the search changes."""
    if budget_share(budget, api="max_batch_size", name="budget") is not None:
        fail(
            "max_batch_size",
            "a budget as a share of storing everything changes with the batch size, which "
            "this searches",
            "budget",
            budget,
            'Pass the budget in bytes, e.g. budget="8GiB"',
        )
    return budget_bytes(budget, api="max_batch_size", name="budget")


def max_batch_size(
    model: keras.Model,
    sample: Any,
    *,
    budget: int | str,
    strategy: Any = "optimal",
    multiple: int = 1,
    limit: int = 65536,
    depth: int | None = None,
    where: Any = None,
    policy: Any = None,
    isolate: bool = True,
    progress: bool | Callable[[BatchProbe], None] = True,
) -> MaxBatch:
    """The largest batch size whose measured train step fits `budget`, with its plan.

    Tries batch sizes `multiple`, `2 * multiple`, `4 * multiple`, ... until
    one does not fit (or `limit` is passed), then bisects between the last
    that fitted and the first that did not. Each batch size is a verified
    plan (`tfrecompute.verified_plan`) of the sample's rows repeated to that
    size: it fits when one of its measured steps fits the budget. By default
    every probe runs in a fresh process, so that the allocator's state after
    one probe does not shape the next (NOTE [ Probing batch sizes in fresh
    processes ] in `tfrecompute.check.max_batch`): the model is saved to a
    temporary `.keras` file, which needs it to be saveable and its custom
    layers registered (`keras.saving.register_keras_serializable`) and
    importable in a new process. `strategy="none"` gives the baseline of
    storing everything. When every batch size tried fits, the search
    stopped at `limit`: a warning says so, and `MaxBatch.at_limit` is True.

    Args:
        model: a built, compiled Keras model.
        sample: `(x, y)`: a few training rows with labels, repeated to each
            probed batch size.
        budget: the most memory the step may add, as `measure_step` counts
            it, in bytes or as a string like `"512MiB"` (a share of storing
            everything is refused: it changes with the batch size).
        strategy: a strategy name, `"optimal"` by default.
        multiple: batch sizes tried are multiples of it.
        limit: the largest batch size tried (every probe takes seconds to
            a minute: about `2 * log2(limit / multiple)` probes at most).
        depth, where, policy: as for `recompute` (`where` as layer names and
            `policy` as a name or a list of names when isolated).
        isolate: probe in fresh processes (True) or in this one (False).
        progress: True (the default): a line on standard output when the
            search starts and one per probe as it is measured; False: quiet;
            a function: called with each `BatchProbe` instead.

    Returns:
        A `MaxBatch`: the batch size, its plan, the model (checkpointed by
        that plan, as `recompute` leaves it), its peak. Under a
        `tf.distribute` strategy of `N` replicas each replica runs the whole
        probed batch (see `measure_step`): the batch size is per replica,
        `fit(batch_size=N * found)` the global one.

    Raises:
        ValueError: the sample has no labels, the model is not compiled, or
            an option is out of range.
        InfeasibleBudgetError: even batch size `multiple` does not fit.

    Example:

    ```python
    model.compile(optimizer="adam", loss="mse")
    found = tfrecompute.max_batch_size(model, (x[:8], y[:8]), budget="8GiB", multiple=8)
    print(found.batch_size, found.peak_bytes / 2**20)
    found.model.fit(x, y, batch_size=found.batch_size)
    ```
    """
    api = "max_batch_size"
    labelled(api, sample)
    multiple = as_positive_int(api, "multiple", multiple, example="multiple=8")
    limit = as_positive_int(api, "limit", limit, example="limit=4096")
    total = _bytes_budget(budget)
    options = _options(strategy, total, depth, where, policy, as_bool(api, "isolate", isolate))
    report = _progress(progress, total, multiple, limit, isolate)
    planner(
        api, model, repeated(sample, multiple), strategy, depth=depth, where=where, policy=policy
    )

    def probe(batch_size: int) -> BatchProbe:
        found = run(batch_size)
        if report is not None:
            report(found)
        return found

    with tempfile.TemporaryDirectory(prefix="tfrecompute-max-batch-") as folder:
        isolated = _Isolated(model, sample, options, folder) if isolate else None
        run = isolated or (lambda b: probe_batch(model, sample, b, options))
        probes = _search(probe, multiple, limit)
    found = _found(model, sample, probes, options, total, limit)
    if found.at_limit:
        warnings.warn(
            f"max_batch_size: every batch size tried fits, so the search stopped at its limit "
            f"({limit}): {found.batch_size} is the largest tried, not the largest that fits. "
            f"Received: limit={limit} (of type int). Pass a larger limit to search further.",
            stacklevel=2,
        )
    return found


def _found(
    model: keras.Model,
    sample: Any,
    probes: list[BatchProbe],
    options: dict[str, Any],
    total: int,
    limit: int,
) -> MaxBatch:
    """The largest fitting probe's plan applied to `model`; an error if none fitted."""
    fitting = [p for p in probes if p.fits]
    if not fitting:
        first = probes[0]
        fmt = strategies.format_size
        measured = (
            f"measured {fmt(first.peak_bytes)}"
            if first.peak_bytes
            else "no plan is predicted to fit"
        )
        raise InfeasibleBudgetError(
            f"max_batch_size: even batch size {first.batch_size} does not fit the budget "
            f"{fmt(total)} ({measured}). Received: budget={total!r} (of type int). Raise the "
            "budget, or train with a smaller model or shorter inputs.",
            budget=total,
            minimum=first.peak_bytes,
        )
    best = max(fitting, key=lambda p: p.batch_size)
    made = planner(
        "max_batch_size",
        model,
        repeated(sample, best.batch_size),
        options["strategy"],
        depth=options["depth"],
        where=options["where"],
        policy=options["policy"],
    )
    plan = (  # the plan measured: its segments and their states
        strategies.Plan.from_segments(
            made.chain, best.segments, strategy=best.strategy, selective=best.selective or None
        )
        if best.segments
        else strategies.none(made.chain)
    )
    made.apply(plan)
    return MaxBatch(best.batch_size, plan, model, best.peak_bytes, total, tuple(probes), limit)
