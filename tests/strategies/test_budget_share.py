"""A budget as a share of storing everything (`budget=0.5`), resolved on the chain."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tfrecompute.strategies import (
    Chain,
    InfeasibleBudgetError,
    heuristic,
    none,
    optimal,
    parse_budget,
    plan_within,
    sqrt,
)
from tfrecompute.strategies.units import budget_share, format_budget

CHAIN = Chain.homogeneous(64, activation_bytes=1024)
STORED = none(CHAIN).peak_bytes


@pytest.mark.parametrize(
    ("value", "share"),
    [(0.5, 0.5), (1.0, 1.0), (np.float32(0.25), 0.25), ("0.5", 0.5), ("50%", 0.5),
     ("100%", 1.0), (" 12.5 % ", 0.125), ("5e-1", 0.5), ("1.0", 1.0)],
)  # fmt: skip
def test_shares_are_taken_of_the_peak_given(value, share):
    assert budget_share(value, api="plan", name="budget") == share
    assert parse_budget(value, of=1000) == math.floor(share * 1000)


@pytest.mark.parametrize("value", [1e9, 2.0**30, 4096, "1", "1.5", "2GiB", "0.5KiB"])
def test_whole_floats_ints_and_strings_with_units_stay_bytes(value):
    assert budget_share(value, api="plan", name="budget") is None
    assert parse_budget(value) == parse_budget(value, of=10**12)


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (0.0, r"plan: a budget must be positive\. Received: budget=0\.0 \(of type float\)"),
        (-0.5, r"plan: a budget must be positive\. Received: budget=-0\.5"),
        (1.5, r"plan: a float budget is a share of storing everything in \(0, 1\] or a whole "
              r"number of bytes\. Received: budget=1\.5 \(of type float\)\. Pass a positive int"),
        (float("nan"), r"plan: a budget must be a finite number\. Received: budget=nan"),
        (float("inf"), r"plan: a budget must be a finite number\. Received: budget=inf"),
        ("150%", r"plan: a share of storing everything must be in \(0, 1\], 0% to 100%\. "
                 r"Received: budget='150%'"),
        ("0%", r"a share of storing everything must be in \(0, 1\]"),
        ("0.0", r"a share of storing everything must be in \(0, 1\]"),
    ],
)  # fmt: skip
def test_bad_shares_are_refused_in_the_project_format(value, match):
    with pytest.raises(ValueError, match=match):
        budget_share(value, api="plan", name="budget")


def test_a_share_without_the_peak_it_is_a_share_of_is_refused():
    with pytest.raises(ValueError, match=r"parse_budget: a share of storing everything needs the "
                       r"peak it is a share of\. Received: value=0\.5 \(of type float\)\. "
                       r"Pass of=<the predicted peak"):  # fmt: skip
        parse_budget(0.5)


def test_every_strategy_takes_a_share_of_the_chains_peak_of_storing_everything():
    half = STORED // 2
    assert optimal(CHAIN, 0.5) == optimal(CHAIN, half)
    assert optimal(CHAIN, 0.5).peak_bytes <= half < STORED
    assert heuristic(CHAIN, "50%") == heuristic(CHAIN, half)
    assert none(CHAIN, 1.0) == none(CHAIN)
    with pytest.raises(InfeasibleBudgetError, match=r"^none: .*Received: budget=0\.9 "):
        none(CHAIN, 0.9)
    assert sqrt(CHAIN, 1.0).peak_bytes <= STORED


def test_plan_within_takes_the_headroom_from_the_share_in_bytes():
    made = plan_within("plan", optimal, CHAIN, 0.5, 0.25)
    assert made == optimal(CHAIN, math.floor(STORED // 2 * 0.75))


def test_an_infeasible_share_names_the_share_and_the_bytes_it_became():
    with pytest.raises(InfeasibleBudgetError) as info:
        plan_within("recompute", optimal, CHAIN, 0.05, 0)
    text = str(info.value)
    assert f"the budget {format_budget(0.05, math.floor(0.05 * STORED))}" in text
    assert "bytes, 0.05 of the predicted peak of storing everything) less 0% headroom" in text
    assert "Received: budget=0.05 (of type float)" in text
    assert info.value.budget == math.floor(0.05 * STORED)
