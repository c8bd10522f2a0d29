"""The examples in the planner's docstrings run and print what they claim."""

from __future__ import annotations

import doctest
import importlib

import pytest

import tfrecompute.strategies as st

MODULES = ["budget", "chain", "memory", "plan", "optimize", "simple", "registry"]


@pytest.mark.parametrize("name", MODULES)
def test_module_examples(name: str) -> None:
    module = importlib.import_module(f"tfrecompute.strategies.{name}")
    names = {key: getattr(st, key) for key in st.__all__}
    result = doctest.testmod(module, extraglobs=names, verbose=False)
    assert result.attempted > 0 and result.failed == 0


def test_package_example() -> None:
    result = doctest.testmod(st, verbose=False)
    assert result.attempted > 0 and result.failed == 0
