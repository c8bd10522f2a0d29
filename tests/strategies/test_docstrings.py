"""The examples in the planner's docstrings run and print what they claim."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import tfrecompute.strategies as st

# Every module of the planner, found rather than listed, and the pure-Python
# messages it uses; a module without examples is fine.
MODULES = [
    *(f"tfrecompute.strategies.{m.name}" for m in pkgutil.iter_modules(st.__path__)),
    "tfrecompute._messages",
]


def test_the_planner_has_modules():
    assert {"tfrecompute.strategies.chain", "tfrecompute.strategies.plan"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_module_examples(name: str) -> None:
    module = importlib.import_module(name)
    names = {key: getattr(st, key) for key in st.__all__}
    result = doctest.testmod(module, extraglobs=names, verbose=False)
    assert result.failed == 0


def test_package_example() -> None:
    result = doctest.testmod(st, verbose=False)
    assert result.attempted > 0 and result.failed == 0


def test_most_modules_have_examples() -> None:
    attempted = {
        name: doctest.testmod(importlib.import_module(name), verbose=False).attempted
        for name in MODULES
    }
    without = sorted(name for name, count in attempted.items() if count == 0)
    # The private search and checks have none; every public module shows its use.
    assert set(without) <= {"tfrecompute.strategies._checks", "tfrecompute.strategies._solver"}
