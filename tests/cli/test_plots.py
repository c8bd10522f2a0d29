"""The figures of tfrecompute.cli.plots, rendered to PNG (matplotlib; no TensorFlow needed)."""

from __future__ import annotations

import pathlib

import pytest

from tfrecompute import strategies
from tfrecompute.cli import plots

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")
from matplotlib.figure import Figure  # noqa: E402

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
MIB = 2**20


def _chain() -> strategies.Chain:
    sizes = [MIB * (1 + k % 4) for k in range(16)]
    return strategies.Chain(MIB, sizes, sizes, [1.0 + k % 3 for k in range(16)])


def _save(figure, path: pathlib.Path) -> None:
    figure.savefig(path, dpi=80, bbox_inches="tight")
    assert path.read_bytes()[:8] == PNG_SIGNATURE and path.stat().st_size > 1000


def _legend_is_outside_the_axes(figure) -> bool:
    figure.canvas.draw()
    axes = figure.axes[0]
    legend = axes.get_legend().get_window_extent()
    return legend.x0 >= axes.get_window_extent().x1


def _labels(figure) -> list[str]:
    return [text.get_text() for text in figure.axes[0].get_legend().get_texts()]


def test_aligned_spans_put_each_links_backward_at_the_same_place():
    chain = _chain()
    n = chain.n
    for segments in ([], [(0, 4), (6, 9)], [(0, 16)]):
        events = strategies.timeline(chain, segments)
        spans = plots.aligned_spans(events, n)
        assert len(spans) == len(events)
        waiting = []  # recompute spans before the next backward one
        for event, (start, stop) in zip(events, spans):
            if event.phase == "recompute":
                waiting.append((start, stop))
                continue
            slot = event.link if event.phase == "forward" else 2 * n - 1 - event.link
            assert slot <= start < stop == slot + 1  # as without recompute
            # a segment's recompute shares the slot of the backward after it
            assert all(slot <= a < b <= start for a, b in waiting)
            waiting = []
        assert [s for s, _ in spans] == sorted(s for s, _ in spans)  # time order kept


def test_frontier_figure_draws_budget_planned_line_and_measured_peak(tmp_path):
    chain = _chain()
    budget = plots.Budget("30MiB", 30 * MIB, 21 * MIB)
    chosen = strategies.optimal(chain, budget.planned)
    marks = {"none": strategies.none(chain), "sqrt": strategies.sqrt(chain)}
    figure = plots.frontier_figure(
        Figure,
        strategies.frontier(chain),
        marks,
        ("optimal @ 30MiB", chosen),
        title="frontier",
        budget=budget,
        measured={"optimal @ 30MiB": chosen.peak_bytes + 3 * MIB},
    )
    _save(figure, tmp_path / "frontier.png")
    labels = _labels(figure)
    assert "budget 30MiB (30.00 MiB)" in labels and "planned within 21.00 MiB" in labels
    assert any(label.startswith("optimal @ 30MiB, measured: ") for label in labels)
    lines = {line.get_label(): line.get_xdata()[0] for line in figure.axes[0].get_lines()}
    assert lines["planned within 21.00 MiB"] == pytest.approx(21.0)  # in MiB
    assert _legend_is_outside_the_axes(figure)


def test_timeline_figure_aligns_both_plans_and_marks_measured_peaks(tmp_path):
    chain = _chain()
    plans = [("none", strategies.none(chain)), ("sqrt", strategies.sqrt(chain))]
    figure = plots.timeline_figure(
        Figure,
        plans,
        title="timeline",
        budget=plots.Budget("40MiB", 40 * MIB, 28 * MIB),
        measured={"sqrt": plans[1][1].peak_bytes + MIB},
    )
    _save(figure, tmp_path / "timeline.png")
    labels = _labels(figure)
    assert labels[0].startswith("none: predicted, peak") and "sqrt: recompute" in labels
    assert any(label.startswith("sqrt: measured peak") for label in labels)
    assert "planned within 28.00 MiB" in labels
    assert figure.axes[0].get_xlim() == (0, 2 * chain.n)  # one slot per link and pass
    assert _legend_is_outside_the_axes(figure)
