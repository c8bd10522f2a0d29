"""The command line's measured commands: `--verify` and `max-batch`, through `main(argv)`."""

from __future__ import annotations

import re

import keras
import pytest

import tfrecompute  # noqa: F401  (registers RecomputeBlock)
from tfrecompute.cli.command import main

MiB = 2**20


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("cli_measured")
    keras.utils.set_random_seed(0)
    inputs = keras.Input((256,))
    h = inputs
    for _ in range(8):
        h = keras.layers.Dense(512, activation="tanh")(h)
    model = keras.Model(inputs, keras.layers.Dense(8)(h), name="chain")
    paths = {"uncompiled": str(folder / "uncompiled.keras")}
    model.save(paths["uncompiled"])
    model.compile(optimizer="sgd", loss="mse")
    paths["compiled"] = str(folder / "compiled.keras")
    model.save(paths["compiled"])
    return paths


def test_plan_verify_prints_the_measured_step_within_the_budget(saved, capsys):
    args = ["plan", saved["compiled"], "--batch-size", "512", "--budget", "12MiB", "--verify"]
    assert main(args) == 0
    captured = capsys.readouterr()
    assert "measured a plan predicted at" in captured.err
    found = re.search(
        r"Measured train step: ([0-9.]+) MiB, (\d+)% of the budget 12\.00 MiB", captured.out
    )
    assert found, captured.out
    assert float(found.group(1)) <= 0.9 * 12 and int(found.group(2)) <= 90


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ([], r"--verify measures a plan made for a budget"),
        (["--budget", "8MiB", "--headroom", "0.1"], r"--verify takes its headroom from"),
    ],
)
def test_verify_usage_errors_exit_with_2(saved, capsys, extra, match):
    assert main(["plan", saved["compiled"], "--batch-size", "8", "--verify", *extra]) == 2
    assert re.search(match, capsys.readouterr().err)


def test_verify_needs_a_model_saved_compiled(saved, capsys):
    args = ["plan", saved["uncompiled"], "--batch-size", "8", "--budget", "8MiB", "--verify"]
    assert main(args) == 1
    assert "the model was saved uncompiled" in capsys.readouterr().err


def test_plan_calibrate_prints_what_the_measured_step_changed(saved, capsys):
    assert main(["plan", saved["compiled"], "--batch-size", "512", "--calibrate"]) == 0
    out = capsys.readouterr().out
    found = re.search(
        r"Memory calibrated by a measured step storing everything: ([0-9.]+) MiB "
        r"\(traced calls: ([0-9.]+) MiB",
        out,
    )
    assert found, out
    assert float(found.group(1)) > 8  # eight 1 MiB activations and their gradients
    assert main(["plan", saved["compiled"], "--batch-size", "512"]) == 0
    assert "not measured (calibrate=True)" in capsys.readouterr().out


def test_calibrate_errors_exit_as_verify_does(saved, capsys):
    args = ["plan", saved["compiled"], "--batch-size", "8", "--budget", "8MiB"]
    assert main([*args, "--verify", "--calibrate"]) == 2
    assert "Pass --verify or --calibrate, not both" in capsys.readouterr().err
    assert main(["plan", saved["uncompiled"], "--batch-size", "8", "--calibrate"]) == 1
    assert "the model was saved uncompiled" in capsys.readouterr().err


def test_max_batch_draws_a_bar_per_batch_size_and_fails_when_none_fits(saved, capsys):
    args = ["max-batch", saved["compiled"], "--budget", "1MiB", "--multiple", "64"]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert re.search(r"batch +64 \[-{30}\] +no plan is predicted to fit", err), err
    assert "max_batch_size: even batch size 64 does not fit the budget 1.00 MiB" in err


def test_profile_measure_time_shows_measured_forward_milliseconds(saved, capsys):
    args = ["profile", saved["uncompiled"], "--batch-size", "64", "--measure", "--measure-time"]
    assert main(args) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("#"))
    assert header.split()[-1] == "forward"
    assert re.search(r"forward cost [0-9.]+ ms", out), out
    assert "each link's forward (measured time)" in out
