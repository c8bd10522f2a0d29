"""keras-hub's own model tests, as shipped and with every model their helpers build checkpointed.

keras-hub's model tests (the files of `keras_hub/src/models/<family>/` that
call a model helper of `keras_hub.src.tests.test_case.TestCase`) are run from
a keras-hub source checkout against the installed keras-hub, twice, each pass
one pytest process:

* shipped: the tests as they are (tests marked `large`, `extra_large` or
  `kaggle_key_required` skipped by keras-hub's own conftest, as its CI does);
* checkpointed: the tests that passed as shipped, with this module loaded as a
  pytest plugin (`-p benchmarks.keras_hub_suite`) that hands each model helper
  (`run_backbone_test`, `run_vision_backbone_test`, `run_task_test`,
  `run_model_saving_test`, `run_precision_test`, `run_quantization_test`,
  `run_litert_export_test`) a stand-in for the `cls` it receives: calling it
  builds the model with the class itself, then
  `tfrecompute.recompute(model, sample=<the test's input>)` (a task's sample:
  its preprocessor's output for the test's training data). Everything else
  about `cls` is the class's own (`from_config`, `__name__`, `isinstance`), so
  revived copies are built without checkpointing, as a user's loaded model is.

Per test: passed as shipped, passed checkpointed; per model a helper built:
whether `tfrecompute.checkpoints(model)` holds blocks (a model left as it was
counts separately, never as a pass), why not (the warnings of `recompute`),
and the wall and CPU seconds `recompute` took. A checkpointed failure is
recorded with its error's first line and the innermost frames of tfrecompute,
of keras-hub and of `test_case.py` in its traceback; failures are grouped into
classes by them. Both passes load the plugin for `grain` (stubbed when absent:
the installed `test_case.py` imports it, the model tests never use it), the
test data of the checkout and the records.

Writes `keras_hub_suite.json` and `keras_hub_suite.md` to benchmarks/results/;
families run again replace their rows, the others are kept, and the file
names the families of the checkout not run yet.

    python benchmarks/keras_hub_suite.py --families bert gpt2  # snapshot of the mirror
    python benchmarks/keras_hub_suite.py --checkout ~/keras-hub --families all
    python benchmarks/keras_hub_suite.py --families gpt2 --run-large  # with test_saved_model
    python benchmarks/keras_hub_suite.py --families mobilenet --strategy sqrt  # every model
    python benchmarks/keras_hub_suite.py --smoke               # BertBackbone, a temporary folder
"""

from __future__ import annotations

import argparse
import collections
import datetime
import functools
import inspect
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import types
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # for `benchmarks._report`

from benchmarks import _report  # noqa: E402

NAME = "keras_hub_suite"
PLUGIN = "benchmarks.keras_hub_suite"
MIRROR = Path("/work/.mirror/keras-team+keras-hub/repo")
MODELS = Path("keras_hub/src/models")
TEST_DATA = Path("keras_hub/src/tests/test_data")
TESTS = "khtests"  # the folder of the copied test files, in the work folder
SMOKE = {"bert": ["bert_backbone_test.py"]}
# The model helpers of keras-hub's TestCase, each with the argument that holds its input.
HELPERS = {
    "run_backbone_test": "input_data",
    "run_vision_backbone_test": "input_data",
    "run_task_test": "train_data",
    "run_model_saving_test": "input_data",
    "run_precision_test": "input_data",
    "run_quantization_test": "input_data",
    "run_litert_export_test": "input_data",
}
MODEL_TEST = re.compile(r"self\.(" + "|".join(HELPERS) + r")\(")
# keras-hub's pytest options (pyproject.toml), when the checkout's cannot be read.
FILTERWARNINGS = [
    "error",
    "ignore::DeprecationWarning",
    "ignore::ImportWarning",
    "ignore::RuntimeWarning",
    "ignore::PendingDeprecationWarning",
    "ignore::FutureWarning",
    "ignore::UserWarning",
]
# What the driver tells the plugin in the pytest process.
ENV_PASS, ENV_EVENTS, ENV_TEST_DATA = "KH_SUITE_PASS", "KH_SUITE_EVENTS", "KH_SUITE_TEST_DATA"
ENV_STRATEGY = "KH_SUITE_STRATEGY"  # `--strategy`: the plan every model gets, e.g. "sqrt"
PASSES = ("shipped", "checkpointed")
TEST_TIMEOUT = 1200  # seconds one test may take before its process is killed


# ---------------------------------------------------------------- the checkout


def extract(mirror: Path, into: Path) -> Path:
    """The model tests, test data and pytest setup of the mirror's HEAD, extracted to `into`."""
    into.mkdir(parents=True, exist_ok=True)
    paths = ["keras_hub/src", "conftest.py", "pyproject.toml"]
    archive = subprocess.run(
        ["git", f"--git-dir={mirror}", "archive", "HEAD", *paths],
        check=True,
        capture_output=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def describe(checkout: Path, mirror: Path | None) -> dict[str, Any]:
    """Where the tests come from: the path, keras-hub's version there, the mirror's commit."""
    version = checkout / "keras_hub/src/version.py"
    found = (
        re.search(r"__version__ = \"([^\"]+)\"", version.read_text()) if version.exists() else None
    )
    commit = None
    if mirror is not None:
        commit = subprocess.run(
            ["git", f"--git-dir={mirror}", "log", "-1", "--format=%h %s"],
            capture_output=True,
            text=True,
        ).stdout.strip()
    return {"path": str(checkout), "version": found and found.group(1), "mirror_commit": commit}


def model_test_files(checkout: Path) -> dict[str, list[str]]:
    """Per family (a folder of `keras_hub/src/models`), its test files that call a model helper."""
    found: dict[str, list[str]] = {}
    for path in sorted((checkout / MODELS).glob("*/*_test.py")):
        if MODEL_TEST.search(path.read_text()):
            found.setdefault(path.parent.name, []).append(path.name)
    return found


def lay_out(checkout: Path, files: dict[str, list[str]], work: Path) -> list[str]:
    """Copies the test files to `work/khtests/<family>/` with keras-hub's conftest and warning
    filters; returns their paths relative to `work`.

    Only test files are copied, without `__init__.py`: imported with pytest's `importlib`
    mode, `keras_hub` stays the installed package.
    """
    targets = []
    for family, names in files.items():
        (work / TESTS / family).mkdir(parents=True, exist_ok=True)
        for name in names:
            shutil.copy(checkout / MODELS / family / name, work / TESTS / family / name)
            targets.append(f"{TESTS}/{family}/{name}")
    shutil.copy(checkout / "conftest.py", work / "conftest.py")
    filters = "\n".join(f"    {line}" for line in _filterwarnings(checkout))
    (work / "pytest.ini").write_text(f"[pytest]\nfilterwarnings =\n{filters}\n")
    return targets


def _filterwarnings(checkout: Path) -> list[str]:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        return FILTERWARNINGS
    options = tomllib.loads((checkout / "pyproject.toml").read_text())
    return (
        options.get("tool", {})
        .get("pytest", {})
        .get("ini_options", {})
        .get("filterwarnings", FILTERWARNINGS)
    )


# ------------------------------------------------------------------ the passes


def run_pass(
    kind: str,
    work: Path,
    targets: Sequence[str],
    test_data: Path,
    *,
    test_timeout: float,
    options: Sequence[str] = (),
) -> dict[str, Any]:
    """One pass over `targets` (files or test ids) in pytest processes, `kind` telling the plugin
    what to do, `options` added to pytest's; a process that crashes or hangs on a test is
    started again after that test.

    Returns:
        `tests`: per test id, its record; `collect_errors`: per file, the error importing it.
    """
    tests: dict[str, Any] = {}
    collect_errors: dict[str, str] = {}
    remaining, attempt = list(targets), 0
    while remaining:
        attempt += 1
        events_path = work / f"{kind}_{attempt}.jsonl"
        ended = _pytest(kind, work, [*options, *remaining], events_path, test_data, test_timeout)
        events = _read_events(events_path)
        collected = [t for e in events if e["event"] == "collected" for t in e["tests"]]
        for event in events:
            if event["event"] == "test":
                tests[event["test"]] = event
            elif event["event"] == "collect_error":
                collect_errors[event["file"]] = event["error"]
        started = [e["test"] for e in events if e["event"] == "start"]
        unfinished = [test for test in started if test not in tests]
        if not unfinished:
            if ended != "exited":
                print(f"{kind} pass {attempt} {ended} between tests", file=sys.stderr)
            break
        tests[unfinished[-1]] = {
            "event": "test",
            "test": unfinished[-1],
            "outcome": "crashed" if ended == "exited" else ended,
            "error": f"the pytest process {ended} during this test (see {kind}.log)",
            "models": [],
        }
        remaining = [test for test in collected if test not in tests]
    return {"tests": tests, "collect_errors": collect_errors}


def _pytest(
    kind: str, work: Path, targets: Sequence[str], events: Path, test_data: Path, timeout: float
) -> str:
    """Runs pytest on `targets` in `work`; "exited", or "timed out" if a test took longer than
    `timeout` seconds (the process is killed)."""
    command = [
        sys.executable, "-m", "pytest", "-p", PLUGIN, "-p", "no:cacheprovider", "-q",
        "--import-mode=importlib", "--continue-on-collection-errors", "-o", "addopts=",
        "-W", "ignore::pytest.PytestAssertRewriteWarning", *targets,
    ]  # fmt: skip
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "PYTHONDONTWRITEBYTECODE": "1",
        "KERAS_BACKEND": "tensorflow",
        "TF_CPP_MIN_LOG_LEVEL": "2",
        ENV_PASS: kind,
        ENV_EVENTS: str(events),
        ENV_TEST_DATA: str(test_data),
    }
    events.touch()
    with open(work / f"{kind}.log", "ab") as log:
        process = subprocess.Popen(command, cwd=work, env=env, stdout=log, stderr=log)
        while process.poll() is None:
            time.sleep(2)
            if time.time() - events.stat().st_mtime > timeout:
                process.kill()
                process.wait()
                return "timed out"
    return "exited"


def _read_events(path: Path) -> list[dict[str, Any]]:
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.strip()]


# ------------------------------------------------------------------ the plugin
# Loaded by `-p benchmarks.keras_hub_suite` in the pytest process of a pass; idle
# unless the driver set ENV_PASS.


class _Recorder:
    """The events of one pytest process, appended to a JSON-lines file as they happen."""

    def __init__(self, path: str, kind: str) -> None:
        self.path, self.kind = path, kind
        self.test: dict[str, Any] | None = None

    def write(self, event: dict[str, Any]) -> None:
        with open(self.path, "a") as file:
            file.write(json.dumps(event, default=str) + "\n")

    def start(self, test: str) -> None:
        self.test = {"event": "test", "test": test, "outcome": "passed", "models": []}
        self.test["seconds"] = 0.0
        self.write({"event": "start", "test": test})


_RECORDER: list[_Recorder] = []  # the one recorder of this process, once configured


def pytest_configure(config: Any) -> None:
    kind = os.environ.get(ENV_PASS)
    if kind is None:
        return
    _RECORDER.append(_Recorder(os.environ[ENV_EVENTS], kind))
    test_case = _import_test_case()

    test_data = os.environ[ENV_TEST_DATA]
    test_case.TestCase.get_test_data_dir = lambda self: test_data
    if kind == "checkpointed":
        for name, argument in HELPERS.items():
            if hasattr(test_case.TestCase, name):
                helper = getattr(test_case.TestCase, name)
                setattr(test_case.TestCase, name, _checkpointing(helper, name, argument))


def _import_test_case() -> Any:
    """keras-hub's installed `test_case` module, with a stand-in for `grain` if none is installed.

    `test_case.py` imports grain; only its preprocessing helpers use it. keras-hub's library
    runs without it (`try: import grain` / `grain = None`), so the stand-in is seen by
    `test_case` alone: the library modules imported meanwhile get `grain = None` back, and the
    stand-in leaves `sys.modules`.
    """
    import importlib.util

    if importlib.util.find_spec("grain") is not None:
        from keras_hub.src.tests import test_case

        return test_case

    def missing(name: str) -> Any:
        raise AttributeError(f"grain.{name}: grain is not installed (stubbed by {PLUGIN})")

    stub = types.ModuleType("grain")
    stub.__getattr__ = missing  # type: ignore[method-assign]
    sys.modules["grain"] = stub
    try:
        from keras_hub.src.tests import test_case
    finally:
        del sys.modules["grain"]
    for name, module in list(sys.modules.items()):
        if name.startswith("keras_hub") and module is not test_case:
            if getattr(module, "grain", None) is stub:
                module.grain = None
    return test_case


def pytest_collection_finish(session: Any) -> None:
    if _RECORDER:
        _RECORDER[0].write({"event": "collected", "tests": [i.nodeid for i in session.items]})


def pytest_collectreport(report: Any) -> None:
    if _RECORDER and report.failed:
        error = str(report.longrepr).strip().splitlines()
        _RECORDER[0].write(
            {"event": "collect_error", "file": report.nodeid, "error": error[-1] if error else ""}
        )


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    if _RECORDER:
        _RECORDER[0].start(nodeid)


def pytest_exception_interact(node: Any, call: Any, report: Any) -> None:
    test = _RECORDER[0].test if _RECORDER else None
    if test is not None and call.excinfo is not None and "where" not in test:
        test["where"] = diagnose(call.excinfo.value)


def pytest_runtest_logreport(report: Any) -> None:
    if not _RECORDER or _RECORDER[0].test is None:
        return
    recorder = _RECORDER[0]
    test = recorder.test
    test["seconds"] += report.duration
    if report.failed and test["outcome"] != "failed":
        test["outcome"] = "failed"
        where = test.get("where") or {}
        test["error"] = where.get("error") or _crash_line(report)
        test["phase"] = report.when
    elif report.skipped and test["outcome"] == "passed":
        test["outcome"] = "skipped"
        test["error"] = report.longrepr[2] if isinstance(report.longrepr, tuple) else ""
    if report.when == "teardown":
        recorder.write(test)
        recorder.test = None


def _crash_line(report: Any) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr)
    return (text.strip().splitlines() or [""])[0][:300]


def diagnose(error: BaseException) -> dict[str, Any]:
    """The error's first line and the innermost frames of tfrecompute, of keras-hub's library
    code and of its `test_case.py` in its traceback (its causes' tracebacks if its own has none).
    """
    chain, seen = [], set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        chain.append(traceback.extract_tb(current.__traceback__))
        current = current.__cause__ or current.__context__

    def innermost(matches: Callable[[str], bool]) -> str | None:
        for frames in chain:
            for frame in reversed(frames):
                if matches(frame.filename.replace(os.sep, "/")):
                    return f"{_short(frame.filename)}:{frame.lineno} {frame.name}"
        return None

    message = (str(error).strip().splitlines() or [""])[0][:300]
    return {
        "error": f"{type(error).__name__}: {message}",
        "tfrecompute": innermost(lambda path: "/tfrecompute/" in path),
        "keras_hub": innermost(lambda path: "/keras_hub/src/" in path and "/tests/" not in path),
        "test_case": innermost(lambda path: path.endswith("keras_hub/src/tests/test_case.py")),
        "raised_at": innermost(lambda path: True),
    }


def _short(filename: str) -> str:
    path = filename.replace(os.sep, "/")
    for anchor in ("/tfrecompute/", "/keras_hub/", "/site-packages/", f"/{TESTS}/"):
        if anchor in path:
            return path[path.rindex(anchor) + 1 :].removeprefix("site-packages/")
    return Path(path).name


class _Checkpointed:
    """A model class whose call builds the model, then checkpoints it with `recompute`.

    Everything else is the class's (`from_config`, `__name__`, `isinstance`): a copy
    revived from a config or a file is the model as defined, as for a user.
    """

    def __init__(self, cls: Any, helper: str, sample_of: Callable[[Any], Any]) -> None:
        self.wrapped, self.helper, self.sample_of = cls, helper, sample_of

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        model = self.wrapped(*args, **kwargs)
        checkpoint(model, self.helper, self.sample_of(model), kwargs.get("dtype"))
        return model

    def __getattr__(self, name: str) -> Any:
        return getattr(self.wrapped, name)

    def __instancecheck__(self, instance: Any) -> bool:
        return isinstance(instance, self.wrapped)

    def __subclasscheck__(self, subclass: Any) -> bool:
        return issubclass(subclass, self.wrapped)


def _checkpointing(helper: Callable[..., Any], name: str, argument: str) -> Callable[..., Any]:
    """`helper` handed a `_Checkpointed` in place of its `cls` (a nested helper's own)."""
    signature = inspect.signature(helper)

    @functools.wraps(helper)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(self, *args, **kwargs)
        cls = bound.arguments.get("cls")
        if cls is not None:
            cls = cls.wrapped if type(cls) is _Checkpointed else cls
            data = bound.arguments.get(argument)
            sample_of = _task_sample(data) if argument == "train_data" else (lambda _: data)
            bound.arguments["cls"] = _Checkpointed(cls, name, sample_of)
        return helper(*bound.args, **bound.kwargs)

    return run


def _task_sample(train_data: Any) -> Callable[[Any], Any]:
    """A task's sample: what its preprocessor makes of the training data (the test's own
    check does the same), or the data's inputs without a preprocessor."""

    def sample_of(task: Any) -> Any:
        import keras

        data = train_data if isinstance(train_data, tuple) else (train_data,)
        preprocessor = getattr(task, "preprocessor", None)
        if preprocessor is not None:
            data = preprocessor(*data)
        return keras.utils.unpack_x_y_sample_weight(data)[0]

    return sample_of


def checkpoint(model: Any, helper: str, sample: Any, dtype: Any) -> None:
    """`tfrecompute.recompute(model, sample=sample)`, recorded for the current test (with
    `--strategy`, `recompute(model, <strategy>, sample=sample)`)."""
    import keras

    import tfrecompute

    row: dict[str, Any] = {
        "helper": helper,
        "model": type(model).__name__,
        "dtype": _dtype_label(dtype),
    }
    recorder = _RECORDER[0]
    if recorder.test is not None:
        recorder.test["models"].append(row)
    if not isinstance(model, keras.Model):
        row.update(checkpointed=False, blocks=0, why="a layer, not a model: not checkpointed")
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            tfrecompute.recompute(model, os.environ.get(ENV_STRATEGY) or None, sample=sample)
        except Exception as error:
            row.update(checkpointed=False, blocks=0, error=diagnose(error)["error"])
            raise
        finally:
            row["wall_seconds"] = time.perf_counter() - wall
            row["cpu_seconds"] = time.process_time() - cpu
            row["warnings"] = [_first_sentence(str(w.message)) for w in caught]
    applied = tfrecompute.checkpoints(model)  # None or an object without blocks: nothing applied
    blocks = tuple(getattr(applied, "blocks", None) or ())
    plan = getattr(applied, "plan", None)
    row.update(checkpointed=bool(blocks) and bool(applied), blocks=len(blocks))
    row["segments"] = len(getattr(plan, "segments", None) or ())
    if not blocks:
        row["why"] = _why_left(applied, row["warnings"])


def _dtype_label(dtype: Any) -> str:
    """The policy a model was built with: float32 (the default), a policy's name, or the
    quantization modes of a policy map."""
    if dtype is None:
        return "float32"
    if hasattr(dtype, "values") and not isinstance(dtype, str):  # a DTypePolicyMap
        modes = {getattr(policy, "quantization_mode", None) for policy in dtype.values()}
        return "+".join(sorted(m for m in modes if m)) or "float32"
    return str(getattr(dtype, "name", dtype))


def _why_left(applied: Any, warned: Sequence[str]) -> str:
    """What the object `checkpoints` returned says, else `recompute`'s warnings."""
    for name in ("reason", "why", "message", "note"):
        said = getattr(applied, name, None)
        if isinstance(said, str) and said:
            return _first_sentence(said)
    if warned:
        return " / ".join(warned)
    return "recompute placed no block and warned of nothing"


def _first_sentence(text: str) -> str:
    text = " ".join(text.split())
    found = re.search(r"\.(\s|$)", text)
    return (text[: found.start() + 1] if found else text)[:240]


# ----------------------------------------------------------------- the report


def family_of(test: str) -> str:
    """The family of a test id (`khtests/<family>/<file>::...`)."""
    return test.split("/")[1]


def classify(checkpointed: dict[str, Any]) -> str:
    """The result of a test that passed as shipped, in the checkpointed pass."""
    outcome = checkpointed["outcome"]
    if outcome != "passed":
        return outcome  # failed, skipped, crashed, timed out
    models = checkpointed["models"]
    if not models:
        return "no model built by a helper"
    if any(not model["checkpointed"] for model in models):
        return "passed, a model left as it was"
    return "passed checkpointed"


def failure_class(record: dict[str, Any]) -> str:
    """Where a checkpointed failure comes from: in `recompute` or after it, the error's type and
    the innermost tfrecompute frame (else test_case.py's)."""
    where = record.get("where") or {}
    in_recompute = any("error" in model for model in record["models"])
    phase = "recompute raised" if in_recompute else "test failed after recompute"
    kind = (record.get("error") or where.get("error") or "?").split(":")[0]
    frame = where.get("tfrecompute") or where.get("test_case") or where.get("raised_at") or "?"
    return f"{phase}: {kind} at {re.sub(r':[0-9]+ ', ' ', frame)}"


def summarize(families: dict[str, Any]) -> dict[str, Any]:
    """Counts per family and in total, the failure classes, the models left, recompute times."""
    rows, totals = {}, collections.Counter()
    classes: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for family, result in sorted(families.items()):
        counts = collections.Counter({"files": len(result["files"])})
        counts["files not importable"] = len(result["collect_errors"])
        for test, shipped in result["shipped"].items():
            counts[f"shipped {shipped['outcome']}"] += 1
            if shipped["outcome"] != "passed":
                continue
            checkpointed = result["checkpointed"].get(test)
            state = classify(checkpointed) if checkpointed else "not run"
            counts[state] += 1
            if state not in ("passed checkpointed", "passed, a model left as it was",
                             "no model built by a helper", "skipped"):  # fmt: skip
                classes[failure_class(checkpointed or {"models": []})].append(
                    {"test": test, "error": (checkpointed or {}).get("error"),
                     "where": (checkpointed or {}).get("where")}
                )  # fmt: skip
        models = [m for r in result["checkpointed"].values() for m in r["models"]]
        counts["models built"] = len(models)
        counts["models checkpointed"] = sum(bool(m.get("checkpointed")) for m in models)
        rows[family] = dict(counts)
        totals.update(counts)
    return {"families": rows, "totals": dict(totals), "classes": dict(classes)}


def _count(*keys: str) -> Callable[[dict[str, int]], str]:
    return lambda counts: str(sum(counts.get(key, 0) for key in keys))


SHIPPED = ("shipped passed", "shipped failed", "shipped skipped", "shipped crashed",
           "shipped timed out")  # fmt: skip
# The columns of the tables: a title and the cell of a family's (or the totals') counts.
COLUMNS: list[tuple[str, Callable[[dict[str, int]], str]]] = [
    ("files", _count("files")),
    ("tests", _count(*SHIPPED)),
    ("skipped (large, ...)", _count("shipped skipped")),
    ("failed as shipped", _count("shipped failed", "shipped crashed", "shipped timed out")),
    ("passed as shipped", _count("shipped passed")),
    ("passed checkpointed", _count("passed checkpointed")),
    ("passed, a model left as it was", _count("passed, a model left as it was")),
    ("passed, no model built by a helper", _count("no model built by a helper")),
    ("failed checkpointed", _count("failed")),
    ("crashed, timed out, not run, files not importable",
     _count("crashed", "timed out", "not run", "files not importable")),
    ("models checkpointed / built",
     lambda counts: f"{counts.get('models checkpointed', 0)} / {counts.get('models built', 0)}"),
]  # fmt: skip


def _cells(counts: dict[str, int]) -> list[str]:
    return [cell(counts) for _, cell in COLUMNS]


def markdown(report: dict[str, Any]) -> str:
    summary = summarize(report["families"])
    run = report["families"]
    lines = [
        "# keras-hub's model tests, checkpointed",
        "",
        _header(report),
        "",
        "## Per family",
        "",
        "| family | " + " | ".join(title for title, _ in COLUMNS) + " |",
        "|---|" + "---:|" * len(COLUMNS),
    ]
    for family, counts in summary["families"].items():
        lines.append(f"| {family} | " + " | ".join(_cells(counts)) + " |")
    lines.append("| **total** | " + " | ".join(_cells(summary["totals"])) + " |")
    lines += _failure_lines(summary["classes"], run)
    lines += _left_lines(run)
    lines += _time_lines(run)
    lines += _shipped_failure_lines(run)
    return "\n".join(lines) + "\n"


def _header(report: dict[str, Any]) -> str:
    versions, checkout = report["versions"], report["checkout"]
    run = sorted(report["families"])
    not_run = sorted(set(report["all_families"]) - set(run))
    runs = "; ".join(
        f"{r['started']} ({r['minutes']:.0f} min, load average before: {r['load_before']}, "
        f"after: {r['load_after']}; tfrecompute {r['tfrecompute']}"
        f"{'; tests marked large run too, but *preset*' if r.get('large') else ''}): "
        f"{', '.join(r['families'])}"
        for r in report["runs"]
    )
    strategy = report.get("strategy")
    call = (
        f"recompute(model, {strategy!r}, sample=<the test's input>)"
        if strategy
        else "recompute(model, sample=<the test's input>)"
    )
    forced = (
        f" Every model gets the `{strategy}` plan, whether or not it beats storing "
        "everything at the tests' tiny sizes: this run tests checkpointed models, not the "
        "planner's choice."
        if strategy
        else ""
    )
    return "\n".join([
        f"The model tests of keras-hub {checkout['version']} (source snapshot "
        f"{checkout['mirror_commit'] or checkout['path']}) against the installed keras-hub "
        f"{versions['keras-hub']}, tensorflow {versions['tensorflow']}, keras "
        f"{versions['keras']}, on {report['machine']['cpu_count']} CPU cores shared with other "
        "work. Two pytest passes: as shipped (tests marked `large`, "
        "`extra_large` or needing a Kaggle key skipped by keras-hub's conftest), then the tests "
        "that passed, with every model built by a TestCase model helper checkpointed right "
        f"after construction: `tfrecompute.{call}`.{forced} "
        "A test passes checkpointed only if every such model got blocks "
        "(`tfrecompute.checkpoints(model)`); one with a model left as it was is counted apart, "
        "and so is one whose models are all built outside the helpers (nothing checkpointed).",
        "",
        f"Runs: {runs}.",
        "",
        f"Families run ({len(run)} of {len(report['all_families'])} with model tests): "
        f"{', '.join(run)}.",
        "",
        f"Families not run: {', '.join(not_run) or 'none'}.",
    ])  # fmt: skip


def _failure_lines(classes: dict[str, list[dict[str, Any]]], run: dict[str, Any]) -> list[str]:
    lines = ["", "## Checkpointed failures by class", ""]
    if not classes:
        return lines + ["None."]
    lines += ["| class | tests | families | first error line (an example) | example test |",
              "|---|---:|---|---|---|"]  # fmt: skip
    for name, tests in sorted(classes.items(), key=lambda item: -len(item[1])):
        families = sorted({family_of(t["test"]) for t in tests})
        example = tests[0]
        lines.append(
            f"| {name} | {len(tests)} | {', '.join(families)} | "
            f"{_cell(example['error'])} | `{example['test'].split('/', 2)[2]}` |"
        )
    lines += ["", "Every checkpointed failure:", "",
              "| test | error | tfrecompute frame | keras-hub frame | test_case.py frame |",
              "|---|---|---|---|---|"]  # fmt: skip
    for tests in classes.values():
        for t in tests:
            where = t["where"] or {}
            lines.append(
                f"| `{t['test'].split('/', 2)[2]}` | {_cell(t['error'])} | "
                f"{where.get('tfrecompute') or '-'} | {where.get('keras_hub') or '-'} | "
                f"{where.get('test_case') or '-'} |"
            )
    return lines


def _checkpointed_models(run: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(family, test, model record) for every model the checkpointed pass built."""
    for family, result in sorted(run.items()):
        for test, record in result["checkpointed"].items():
            for model in record["models"]:
                yield family, test, model


def _left_lines(run: dict[str, Any]) -> list[str]:
    left = collections.defaultdict(list)
    for family, test, model in _checkpointed_models(run):
        if not model.get("checkpointed") and "error" not in model:
            left[(family, model["model"], model["dtype"], model.get("why", "?"))].append(test)
    lines = ["", "## Models left as they were", ""]
    if not left:
        return lines + ["None."]
    lines += ["| family | model | dtype | why (recompute's warning) | models | tests |",
              "|---|---|---|---|---:|---|"]  # fmt: skip
    for (family, model, dtype, why), tests in left.items():
        names = sorted({t.split("::")[-1] for t in tests})
        lines.append(
            f"| {family} | {model} | {dtype} | {_cell(why)} | {len(tests)} | {', '.join(names)} |"
        )
    return lines


def _time_lines(run: dict[str, Any]) -> list[str]:
    groups = collections.defaultdict(list)
    for family, _, model in _checkpointed_models(run):
        if "wall_seconds" in model and "error" not in model:  # errors: see failures
            groups[(family, model["model"], model["dtype"])].append(model)
    lines = ["", "## recompute time per model", ""]
    if not groups:
        return lines + ["No model was checkpointed."]
    every = [m["wall_seconds"] for models in groups.values() for m in models]
    lines += [
        f"{len(every)} calls of `recompute` that returned: wall {min(every):.2f}-"
        f"{max(every):.2f} s, median {statistics.median(every):.2f} s (a shared machine: the "
        "CPU seconds are steadier).",
        "",
        "| family | model | dtype | calls | blocks | wall s (median, max) | CPU s (median) |",
        "|---|---|---|---:|---|---|---:|",
    ]
    for (family, model, dtype), models in groups.items():
        wall = [m["wall_seconds"] for m in models]
        cpu = [m["cpu_seconds"] for m in models]
        blocks = sorted({m.get("blocks", 0) for m in models})
        lines.append(
            f"| {family} | {model} | {dtype} | {len(models)} | "
            f"{', '.join(map(str, blocks))} | {statistics.median(wall):.2f}, {max(wall):.2f} | "
            f"{statistics.median(cpu):.2f} |"
        )
    return lines


def _shipped_failure_lines(run: dict[str, Any]) -> list[str]:
    lines = ["", "## Not counted: tests failing as shipped, files not importable", ""]
    found = False
    for family, result in sorted(run.items()):
        for file, error in result["collect_errors"].items():
            lines.append(f"- {family}: `{file}` not importable: {_cell(error)}")
            found = True
        for test, record in result["shipped"].items():
            if record["outcome"] in ("failed", "crashed", "timed out"):
                lines.append(f"- `{test.split('/', 2)[2]}`: {_cell(record.get('error'))}")
                found = True
    return lines + ([] if found else ["None."])


def _cell(text: Any) -> str:
    return str(text or "-").replace("|", "\\|").replace("\n", " ")[:200]


# ------------------------------------------------------------------- the run


def run_families(
    checkout: Path, files: dict[str, list[str]], *, test_timeout: float, large: bool = False
) -> dict[str, Any]:
    """Both passes over the model test files of `files`; per family its files and records.

    `tf.test.TestCase.test_session` (not a test) is left out. With `large`, the tests marked
    `large` run too (keras-hub's `--run_large`), but those named `*preset*`, which download.
    """
    options = ["-k", "not test_session and not preset", "--run_large"] if large else []
    run = functools.partial(
        run_pass, test_timeout=test_timeout, options=options or ["-k", "not test_session"]
    )
    work = Path(tempfile.mkdtemp(prefix=f"{NAME}_"))
    targets = lay_out(checkout, files, work)
    test_data = checkout / TEST_DATA
    print(f"{len(targets)} test files of {len(files)} families in {work}", file=sys.stderr)
    shipped = run("shipped", work, targets, test_data)
    passed = [t for t, r in shipped["tests"].items() if r["outcome"] == "passed"]
    print(f"shipped: {len(passed)} of {len(shipped['tests'])} passed", file=sys.stderr)
    checkpointed = run("checkpointed", work, passed, test_data)
    families = {}
    for family, names in files.items():
        mine = functools.partial(_of_family, family)
        families[family] = {
            "files": names,
            "collect_errors": mine(shipped["collect_errors"]),
            "shipped": mine(shipped["tests"]),
            "checkpointed": mine(checkpointed["tests"]),
        }
    return {"families": families, "work": str(work)}


def _of_family(family: str, records: dict[str, Any]) -> dict[str, Any]:
    return {test: record for test, record in records.items() if family_of(test) == family}


def _library_state() -> str:
    """The commit of this checkout and the library files changed since (others may be at work)."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout

    changed = [line[3:] for line in git("status", "--porcelain", "tfrecompute").splitlines()]
    head = git("log", "-1", "--format=%h").strip()
    return f"{head}" + (f" with {len(changed)} library files changed" if changed else "")


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "-"


def _chosen(found: dict[str, list[str]], families: Iterable[str] | None, smoke: bool) -> Any:
    if smoke:
        return SMOKE
    names = sorted(found) if not families or list(families) == ["all"] else list(families)
    unknown = [name for name in names if name not in found]
    if unknown:
        raise SystemExit(
            f"keras_hub_suite: no model tests for {unknown} in the checkout. Received: "
            f"families={names}. Choose among: {', '.join(sorted(found))}."
        )
    return {name: found[name] for name in names}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkout", type=Path, help="a keras-hub source checkout (default: "
                        "the mirror's snapshot, extracted to a temporary folder)")  # fmt: skip
    parser.add_argument("--mirror", type=Path, default=MIRROR, help="keras-hub's bare git dir")
    parser.add_argument("--families", nargs="+", help="families to run, or `all` (the default)")
    parser.add_argument("--smoke", action="store_true", help="one test file, a temporary folder")
    parser.add_argument("--out", type=Path, help="the folder to write to")
    parser.add_argument("--test-timeout", type=float, default=TEST_TIMEOUT,
                        help="seconds a test may run before its process is killed")  # fmt: skip
    parser.add_argument("--run-large", action="store_true", help="run the tests marked large "
                        "too (`test_saved_model` among them) but those named *preset*")  # fmt: skip
    parser.add_argument("--report-only", action="store_true",
                        help="write the Markdown from the JSON in --out again")  # fmt: skip
    parser.add_argument("--strategy", help="checkpoint every model with this plan "
                        "(e.g. sqrt), whether or not it beats storing everything; written to "
                        f"{NAME}_<strategy>.json and .md")  # fmt: skip
    args = parser.parse_args(argv)
    name = f"{NAME}_{args.strategy}" if args.strategy else NAME
    if args.report_only:
        out = _report.output_dir(args.out, smoke=False, name=name)
        report = json.loads((out / f"{name}.json").read_text())
        _report.write(out, name, report, markdown(report))
        return report
    if args.strategy:
        os.environ[ENV_STRATEGY] = args.strategy  # read by the plugin in each pytest process
    mirror = None if args.checkout else args.mirror
    checkout = args.checkout or extract(args.mirror, Path(tempfile.mkdtemp(prefix="keras_hub_")))
    found = model_test_files(checkout)
    files = _chosen(found, args.families, args.smoke)
    started, load_before, clock = datetime.datetime.now(), _uptime(), time.perf_counter()
    result = run_families(checkout, files, test_timeout=args.test_timeout, large=args.run_large)
    run = {
        "started": started.strftime("%Y-%m-%d %H:%M"),
        "minutes": (time.perf_counter() - clock) / 60,
        "load_before": load_before.split("load average:")[-1].strip(),
        "load_after": _uptime().split("load average:")[-1].strip(),
        "uptime": load_before,
        "families": sorted(files),
        "large": args.run_large,
        "tfrecompute": _library_state(),
        "work": result["work"],
    }
    report = {
        "machine": _report.machine(),
        "versions": _report.versions("tensorflow", "keras", "keras-hub"),
        "checkout": describe(checkout, mirror),
        "all_families": sorted(found),
        "strategy": args.strategy,
        "runs": [run],
        "families": result["families"],
    }
    out = _report.output_dir(args.out, smoke=args.smoke, name=name)
    report = _merged(out / f"{name}.json", report)
    _report.write(out, name, report, markdown(report))
    return report


def _merged(path: Path, report: dict[str, Any]) -> dict[str, Any]:
    """`report`'s families in place of theirs in the report at `path`, if any; runs added."""
    if not path.exists():
        return report
    old = json.loads(path.read_text())
    families = {**old["families"], **report["families"]}
    return {
        **report,
        "runs": old["runs"] + report["runs"],
        "families": {name: families[name] for name in sorted(families)},
    }


if __name__ == "__main__":
    main()
