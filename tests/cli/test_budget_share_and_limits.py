"""The command line: `--budget 0.5`, a plan that recomputes nothing says so, `frontier`
under an infeasible budget still draws, `max-batch` says when it stopped at `--limit`."""

from __future__ import annotations

import re

import keras
import pytest

import tfrecompute  # noqa: F401  (registers RecomputeBlock)
from tfrecompute import strategies
from tfrecompute.cli import plots
from tfrecompute.cli.command import main

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("cli_shares")
    keras.utils.set_random_seed(0)
    inputs = x = keras.Input((64,))
    for i in range(6):
        h = keras.layers.Dense(64, activation="relu", name=f"block{i}_a")(x)
        x = keras.layers.Add(name=f"block{i}_add")([x, keras.layers.Dense(64)(h)])
    model = keras.Model(inputs, keras.layers.Dense(2, name="out")(x), name="residual")
    paths = {"residual": str(folder / "residual.keras")}
    model.save(paths["residual"])
    model.compile(optimizer="sgd", loss="mse")
    paths["compiled"] = str(folder / "compiled.keras")
    model.save(paths["compiled"])
    return paths


def _predicted_peak(out: str) -> int:
    return int(out.split("Predicted peak: ")[1].split("(")[1].split()[0])


@pytest.mark.parametrize("budget", ["0.8", "80%"])
def test_plan_takes_a_share_of_storing_everything_and_shows_its_bytes(saved, capsys, budget):
    argv = ["plan", saved["residual"], "--batch-size", "2048"]
    assert main([*argv, "--strategy", "none"]) == 0
    stored = _predicted_peak(capsys.readouterr().out)
    assert main([*argv, "--budget", budget]) == 0
    out = capsys.readouterr().out
    total = stored * 8 // 10
    share = f"{budget} of the predicted peak of storing everything"
    shown = f"{strategies.format_bytes(total)} ({total} bytes, {share})"
    planned = strategies.format_bytes(total)
    assert f"Budget: {shown}, planned within {planned} (0% headroom for the allocator)" in out
    assert "recomputed" in out and _predicted_peak(out) <= total


def test_plan_says_when_it_recomputes_nothing(saved, capsys):
    argv = ["plan", saved["residual"], "--batch-size", "64", "--budget", "1GiB"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "Nothing is recomputed: storing everything is predicted to fit the budget: pass a " \
        "lower --budget (e.g. --budget 0.5 for half of storing everything)" in out  # fmt: skip


@pytest.mark.parametrize(
    ("budget", "match"),
    [
        ("1.5", r"tfrecompute plan: a float budget is a share of storing everything in \(0, 1\] "
                r"or a whole number of bytes\. Received: --budget=1\.5 \(of type float\)"),
        ("0", r"tfrecompute plan: a budget must be positive\. Received: --budget=0"),
        ("0.0", r"tfrecompute plan: a budget must be positive\. Received: --budget=0\.0"),
        ("150%", r"tfrecompute plan: a share of storing everything must be in \(0, 1\]"),
    ],
)  # fmt: skip
def test_a_bad_share_is_a_usage_error(saved, capsys, budget, match):
    assert main(["plan", saved["residual"], "--batch-size", "8", "--budget", budget]) == 2
    assert re.search(match, capsys.readouterr().err)


def test_frontier_under_an_infeasible_budget_still_prints_and_draws_it(saved, capsys, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "frontier.png"
    argv = ["frontier", saved["residual"], "--batch-size", "1024", "--budget", "1KiB"]
    assert main([*argv, "--plot", str(png)]) == 1
    captured = capsys.readouterr()
    assert "Pareto frontier of" in captured.out and f"Wrote {png}" in captured.out
    assert re.search(r"\noptimal @ 1KiB \(headroom 0\.3\) +no plan fits the budget\n", captured.out)
    assert captured.err.startswith("error: tfrecompute frontier: the plan must fit in ")
    assert png.read_bytes()[:8] == PNG_SIGNATURE


def test_the_frontier_figure_marks_where_no_plan_fits():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    sizes = [2**20 * (1 + k % 4) for k in range(16)]
    chain = strategies.Chain(2**20, sizes, sizes, [1.0 + k % 3 for k in range(16)])
    points = strategies.frontier(chain)
    budget = plots.Budget("1MiB", 2**20, 2**19)
    marks = {"none": strategies.none(chain)}
    figure = plots.frontier_figure(Figure, points, marks, None, title="t", budget=budget)
    labels = [t.get_text() for t in figure.axes[0].get_legend().get_texts()]
    least = strategies.format_bytes(points[0].peak_bytes)
    assert f"no plan fits: the least peak is {least}" in labels
    assert "budget 1MiB (1.00 MiB)" in labels and not any("@" in label for label in labels)


def test_max_batch_refuses_a_share(saved, capsys):
    assert main(["max-batch", saved["compiled"], "--budget", "0.5"]) == 2
    err = capsys.readouterr().err
    assert (
        "tfrecompute max-batch: a budget as a share of storing everything changes with "
        "the batch size, which this searches. Received: --budget=0.5 (of type float)" in err
    )


def test_max_batch_says_when_it_stopped_at_its_limit(saved, capsys):
    argv = ["max-batch", saved["compiled"], "--budget", "1GiB", "--multiple", "8"]
    assert main([*argv, "--limit", "8"]) == 0
    captured = capsys.readouterr()
    assert captured.err.startswith("Trying batch sizes 8, 16, ... up to --limit 8")
    assert re.search(r"batch +8 \[[#-]{30}\] +\d+% of the budget, fits", captured.err)
    assert "UserWarning" not in captured.err  # the command says it itself
    assert (
        "Every batch size tried fits 'residual' under 1GiB: the search stopped at its "
        "--limit 8, so 8 is the largest tried, not the largest that fits"
    ) in captured.out
    assert "Pass a larger --limit to search further." in captured.out  # fmt: skip
