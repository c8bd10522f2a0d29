"""The package's layout: imports flow one way, private symbols in one module, short functions.

Read from the source with `ast`, nothing is imported. The folders follow the
data path (model -> `graph/` -> `costs/` -> Chain -> `strategies/` -> plan ->
`rewrite/` -> blocks of `layers/` -> `check/` by measurement), and imports
go down it between folders (`PLACES`); `ORDER` lists every module bottom-up,
and a module may import only modules before it, at module level or inside a
function alike (a lazy import must not hide a cycle). A new module has to be
placed in `ORDER`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "tfrecompute"

ORDER = [
    "tfrecompute.errors",
    "tfrecompute._messages",
    "tfrecompute.strategies._table",
    "tfrecompute.strategies._checks",
    "tfrecompute.strategies.units",
    "tfrecompute.strategies.chain",
    "tfrecompute.strategies.simulate",
    "tfrecompute.strategies.plan",
    "tfrecompute.strategies._solver",
    "tfrecompute.strategies._selective",
    "tfrecompute.strategies.basic",
    "tfrecompute.strategies.optimize",
    "tfrecompute.strategies.headroom",
    "tfrecompute.strategies.registry",
    "tfrecompute.strategies",
    "tfrecompute._keras_internals",
    "tfrecompute.startup",
    "tfrecompute.distribute",
    "tfrecompute.layers.custom_gradient",
    "tfrecompute.layers.state",
    "tfrecompute.layers.randomness",
    "tfrecompute.layers.debug",
    "tfrecompute.layers.watch",
    "tfrecompute.layers.backward",
    "tfrecompute.layers.policy",
    "tfrecompute.layers.tree",
    "tfrecompute.layers.dtypes",
    "tfrecompute.layers.frame",
    "tfrecompute.layers.block",
    "tfrecompute.layers.in_place",
    "tfrecompute.layers.function",
    "tfrecompute.layers.attention",
    "tfrecompute.layers",
    "tfrecompute.graph",
    "tfrecompute.graph.layer_graph",
    "tfrecompute.graph.call_tree",
    "tfrecompute.graph.expand",
    "tfrecompute.graph.trace",
    "tfrecompute.costs",
    "tfrecompute.costs.loop_memory",
    "tfrecompute.costs.call_memory",
    "tfrecompute.costs.policy_state",
    "tfrecompute.costs.measured",
    "tfrecompute.costs.state_time",
    "tfrecompute.costs.optimizer",
    "tfrecompute.costs.profile",
    "tfrecompute.rewrite",
    "tfrecompute.rewrite.apply",
    "tfrecompute.rewrite.unwrap",
    "tfrecompute.pipeline",
    "tfrecompute.check",
    "tfrecompute.check.measure",
    "tfrecompute.check.replay",
    "tfrecompute.check.twin",
    "tfrecompute.check.calibrate",
    "tfrecompute.check.verified_plan",
    "tfrecompute.check.max_batch",
    "tfrecompute.check._probe",
    "tfrecompute.check.precision",
    "tfrecompute.whole_model",
    "tfrecompute",
    "tfrecompute.cli",
    "tfrecompute.cli.plots",
    "tfrecompute.cli.command",
    "tfrecompute.__main__",
]

# The folders are the steps of the path: the planner, the blocks, then a
# model's call graph, its costs, a plan applied, a plan checked by
# measurement, and the command line. The top-level modules are the shared
# base below every folder and the public surface above all but the command
# line. `tfrecompute.pipeline`, the one path from a model to its checkpointed run
# (NOTE [ The pipeline ]), sits between applying a plan and measuring one. A module
# may import from its own place and the places before it only.
BASE = {
    "tfrecompute.errors",
    "tfrecompute._messages",
    "tfrecompute.startup",
    "tfrecompute._keras_internals",
    "tfrecompute.distribute",
}
SURFACE = {"tfrecompute", "tfrecompute.whole_model"}
FOLDERS = ["strategies", "layers", "graph", "costs", "rewrite", "check"]
PLACES = ["base", *FOLDERS[:-1], "pipeline", FOLDERS[-1], "surface", "cli", "__main__"]

# Only this module may import Keras's and TensorFlow's private modules.
INTERNALS = "tfrecompute._keras_internals"
PRIVATE_MODULES = ("keras.src", "tensorflow.python", "tensorflow.tsl")

# The exact solver's inner loop is one vectorized pass, kept whole on purpose.
LONG_FUNCTIONS = {("tfrecompute.strategies._solver", "label_pass")}
MAX_FUNCTION_LINES = 60


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _modules()


def _imports(path: Path) -> set[str]:
    """The modules a file imports, every `from x import y` resolved to x.y if that is a module."""
    imported = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                child = f"{node.module}.{alias.name}"
                imported.add(child if child in MODULES else node.module)
    return imported


def test_every_module_has_a_place_in_the_order():
    assert set(MODULES) == set(ORDER), "place new modules in ORDER, remove gone ones"


@pytest.mark.parametrize("module", ORDER)
def test_imports_point_down_the_data_path(module):
    rank = ORDER.index(module)
    upward = [
        name
        for name in _imports(MODULES[module])
        if name.split(".")[0] == "tfrecompute" and ORDER.index(name) >= rank
    ]
    assert not upward, f"{module} imports {upward}, which come after it in ORDER"


def _place(module: str) -> str:
    if module in BASE:
        return "base"
    if module in SURFACE:
        return "surface"
    return module.split(".")[1]


def test_every_module_sits_in_a_folder_of_the_path_or_at_the_top():
    stray = [module for module in MODULES if _place(module) not in PLACES]
    assert not stray, f"{stray}: put them in a folder of PLACES, or name them in BASE or SURFACE"


@pytest.mark.parametrize("module", ORDER)
def test_folders_import_only_their_own_place_and_those_before(module):
    rank = PLACES.index(_place(module))
    later = [
        name
        for name in _imports(MODULES[module])
        if name.split(".")[0] == "tfrecompute" and PLACES.index(_place(name)) > rank
    ]
    assert not later, f"{module} ({_place(module)}) imports {later}, from places after it"


def test_the_planner_never_imports_tensorflow_or_keras():
    for module, path in MODULES.items():
        if module.startswith("tfrecompute.strategies") or module in ORDER[:2]:
            roots = {name.split(".")[0] for name in _imports(path)}
            assert not roots & {"tensorflow", "keras"}, module


def test_private_keras_and_tensorflow_symbols_stay_in_one_module():
    for module, path in MODULES.items():
        if module == INTERNALS:
            continue
        source = path.read_text()
        private = [name for name in _imports(path) if name.startswith(PRIVATE_MODULES)]
        private += [name for name in PRIVATE_MODULES if f"{name}." in source]
        assert not private, f"{module} uses {private}: add what it needs to {INTERNALS}"


def _body_lines(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines of the function's body after its docstring."""
    body = function.body
    has_docstring = isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
    first = body[1] if has_docstring and len(body) > 1 else body[0]
    return function.end_lineno - first.lineno + 1


def test_functions_stay_short():
    long = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = _body_lines(node)
                if lines > MAX_FUNCTION_LINES and (module, node.name) not in LONG_FUNCTIONS:
                    long.append(f"{module}.{node.name}: {lines} lines")
    assert not long, long
