"""Figures of plans: the memory / recompute-cost frontier and the memory timeline.

Drawn on a `matplotlib.figure.Figure` class the caller passes (so that no
pyplot state is touched, and a missing matplotlib is reported where the
caller chooses); the figure is returned unsaved. Pure Python apart from
matplotlib; the command line's `--plot` draws these.

Both take the budget and the planned budget (the budget less its headroom,
what the planner had to fit), and optionally measured peaks, keyed by the
name of the plan they belong to.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tfrecompute import strategies
from tfrecompute.strategies import MemoryEvent, Plan

__all__ = ["Budget", "aligned_spans", "frontier_figure", "timeline_figure"]

_UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))
_LEGEND = {"loc": "upper left", "bbox_to_anchor": (1.02, 1.0), "borderaxespad": 0.0, "fontsize": 8}
_MARKS = {  # sqrt and heuristic often coincide: the diamond is drawn inside the triangle
    "none": ("s", "tab:gray", 70),
    "sqrt": ("^", "tab:blue", 160),
    "heuristic": ("D", "tab:orange", 45),
}


@dataclass(frozen=True)
class Budget:
    """A budget as a figure marks it.

    Attributes:
        text: the budget as the user wrote it, e.g. `"2GiB"`.
        total: the budget in bytes.
        planned: the bytes the plan had to fit (the budget less its headroom).
    """

    text: str
    total: int
    planned: int


def _unit(largest: float) -> tuple[str, float]:
    for name, scale in _UNITS:
        if largest >= scale:
            return name, float(scale)
    return "KiB", 1024.0


def _share(plan: Plan) -> float:
    total = plan.chain.total_forward_cost
    return 100.0 * plan.recompute_cost / total if total > 0 else 0.0


def _budget_lines(axes: Any, budget: Budget, scale: float, *, vertical: bool) -> None:
    """The budget, the planned budget left of (below) it, and the headroom between."""
    line = axes.axvline if vertical else axes.axhline
    span = axes.axvspan if vertical else axes.axhspan
    headroom = 1 - budget.planned / budget.total
    bytes_ = strategies.format_bytes
    line(
        budget.total / scale,
        color="tab:red",
        ls="--",
        lw=1.2,
        label=f"budget {budget.text} ({bytes_(budget.total)})",
    )
    span(
        budget.planned / scale,
        budget.total / scale,
        color="tab:red",
        alpha=0.08,
        lw=0,
        label=f"headroom for the allocator ({headroom:.0%})",
    )
    line(
        budget.planned / scale,
        color="darkred",
        ls=":",
        lw=1.6,
        label=f"planned within {bytes_(budget.planned)}",
    )


def frontier_figure(
    figure_class: Callable[..., Any],
    points: Sequence[Plan],
    marks: Mapping[str, Plan],
    chosen: tuple[str, Plan] | None,
    *,
    title: str,
    budget: Budget | None = None,
    measured: Mapping[str, int] | None = None,
) -> Any:
    """The Pareto frontier of (predicted peak, recompute cost), with marked plans.

    Args:
        figure_class: `matplotlib.figure.Figure`.
        points: the frontier, by increasing peak (`strategies.frontier`).
        marks: plans of the strategies `none`, `sqrt`, `heuristic` to mark.
        chosen: the label and plan of the chosen strategy; None when no plan fits
            the budget (which is then marked, with the least peak it would need).
        title: the figure's title.
        budget: the budget the chosen plan was made under, if any.
        measured: measured peak bytes by plan label (keys of `marks` or the
            chosen label), drawn as hollow markers beside the predictions.

    Returns:
        The figure.
    """
    plans = {**marks, **dict([chosen] if chosen else [])}
    largest = max(
        [p.peak_bytes for p in [*points, *plans.values()]] + list((measured or {}).values())
    )
    unit, scale = _unit(largest)
    figure = figure_class(figsize=(10, 4.8))
    axes = figure.add_subplot()
    xs = [p.peak_bytes / scale for p in points]
    ys = [_share(p) for p in points]
    # Between two frontier points the best plan under a budget is the left one:
    # a staircase, extended to the right edge.
    right = max(largest, budget.total if budget else 0) / scale * 1.05
    axes.step([*xs, right], [*ys, ys[-1]], where="post", color="0.6", lw=1.2, zorder=1)
    axes.scatter(xs, ys, s=14, color="0.35", zorder=2, label="Pareto-optimal plans")
    for name, mark in marks.items():
        marker, color, size = _MARKS.get(name, ("o", "tab:green", 60))
        axes.scatter(
            mark.peak_bytes / scale,
            _share(mark),
            marker=marker,
            s=size,
            color=color,
            edgecolor="black",
            zorder=3,
            label=f"{name}: {strategies.format_bytes(mark.peak_bytes)}, {_share(mark):.0f}%",
        )
    if chosen is not None:
        label, plan = chosen
        axes.scatter(
            plan.peak_bytes / scale,
            _share(plan),
            marker="*",
            s=240,
            color="tab:red",
            edgecolor="black",
            zorder=4,
            label=f"{label}: {strategies.format_bytes(plan.peak_bytes)}, {_share(plan):.0f}%",
        )
        _draw_measured(axes, plans, measured or {}, scale, chosen=label)
    if budget is not None:
        _budget_lines(axes, budget, scale, vertical=True)
        if chosen is None:
            _mark_infeasible(axes, budget, points[0], scale)
    axes.set_xlim(left=0, right=right)
    axes.set_ylim(bottom=-4, top=max(ys + [_share(p) for p in plans.values()]) * 1.08 + 1)
    axes.set_xlabel(f"predicted peak memory of a training step ({unit})")
    axes.set_ylabel("recompute cost (% of one forward pass)")
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend(**_LEGEND)
    return figure


def _mark_infeasible(axes: Any, budget: Budget, least: Plan, scale: float) -> None:
    """Where no plan fits: the gap from the planned budget to the least peak, labelled."""
    axes.axvspan(
        budget.planned / scale,
        least.peak_bytes / scale,
        color="tab:red",
        alpha=0.15,
        hatch="//",
        lw=0,
        label=f"no plan fits: the least peak is {strategies.format_bytes(least.peak_bytes)}",
    )


def _draw_measured(
    axes: Any, plans: Mapping[str, Plan], measured: Mapping[str, int], scale: float, *, chosen: str
) -> None:
    """Hollow markers at measured peaks, joined to their plan's predicted one."""
    for name, peak in measured.items():
        predicted = plans[name]
        x, y = predicted.peak_bytes / scale, _share(predicted)
        axes.plot([x, peak / scale], [y, y], color="black", ls=":", lw=1, zorder=2)
        axes.scatter(
            peak / scale,
            y,
            marker="*" if name == chosen else "o",
            s=200,
            facecolor="none",
            edgecolor="black",
            lw=1.2,
            zorder=4,
            label=f"{name}, measured: {strategies.format_bytes(peak)}",
        )


def aligned_spans(events: Sequence[MemoryEvent], n: int) -> list[tuple[float, float]]:
    """Where each moment of a timeline is drawn, so that timelines of one chain align.

    Link `j`'s forward takes `[j, j + 1)` and its backward `[2n - 1 - j, 2n - j)`,
    with or without recompute. A segment's recompute moments share the span
    of the backward moment they precede, which they split evenly with it.

    Example:
        >>> from tfrecompute.strategies import Chain, timeline
        >>> aligned_spans(timeline(Chain.homogeneous(2, activation_bytes=1), [(0, 2)]), 2)
        [(0, 1), (1, 2), (2.0, 2.3333333333333335), (2.3333333333333335, 2.666666666666667), \
(2.666666666666667, 3.0), (3, 4)]
    """
    spans: list[tuple[float, float]] = []
    waiting = 0  # recompute moments before the next backward one
    for event in events:
        if event.phase == "forward":
            spans.append((event.link, event.link + 1))
        elif event.phase == "recompute":
            waiting += 1
        else:
            start = 2 * n - 1 - event.link
            if waiting:
                step = 1 / (waiting + 1)
                spans += [(start + k * step, start + (k + 1) * step) for k in range(waiting + 1)]
                waiting = 0
            else:
                spans.append((start, start + 1))
    return spans


def timeline_figure(
    figure_class: Callable[..., Any],
    plans: Sequence[tuple[str, Plan]],
    *,
    title: str,
    budget: Budget | None = None,
    measured: Mapping[str, int] | None = None,
) -> Any:
    """Predicted live memory over one training step, one curve per plan, moments aligned.

    Args:
        figure_class: `matplotlib.figure.Figure`.
        plans: labels and plans of one chain (e.g. `none` and the chosen plan).
        title: the figure's title.
        budget: the budget the last plan was made under, if any.
        measured: measured peak bytes by plan label, drawn as dash-dot lines.

    Returns:
        The figure.
    """
    chain = plans[0][1].chain
    n = chain.n
    peaks = [p.peak_bytes for _, p in plans] + list((measured or {}).values())
    if budget is not None:
        peaks.append(budget.total)
    unit, scale = _unit(max(peaks))
    figure = figure_class(figsize=(10, 4.8))
    axes = figure.add_subplot()
    for (name, plan), color in zip(plans, ["tab:gray", "tab:blue", "tab:green"]):
        _draw_timeline(axes, name, plan, color, scale, (measured or {}).get(name))
    if budget is not None:
        _budget_lines(axes, budget, scale, vertical=False)
    axes.axvline(n, color="black", lw=0.8, ls="--")
    for x, text in (
        (n / 2, "forward"),
        (1.5 * n, "backward (a recompute shares the slot of the backward after it)"),
    ):
        axes.text(x, 1.01, text, transform=axes.get_xaxis_transform(), ha="center", fontsize=8)
    axes.set_xlim(0, 2 * n)
    axes.set_ylim(bottom=0, top=max(peaks) / scale * 1.15)
    _link_ticks(axes, n)
    axes.set_xlabel("layer call (link index): forward 0 to n-1, then backward n-1 to 0")
    axes.set_ylabel(f"predicted live memory ({unit})")
    axes.set_title(title, pad=16)
    axes.grid(alpha=0.3)
    axes.legend(**_LEGEND)
    return figure


def _draw_timeline(
    axes: Any, name: str, plan: Plan, color: str, scale: float, measured: int | None
) -> None:
    events = plan.timeline()
    spans = aligned_spans(events, plan.chain.n)
    xs = [start for start, _ in spans] + [spans[-1][1]]
    ys = [e.live_bytes / scale for e in events]
    axes.step(
        xs,
        [*ys, ys[-1]],
        where="post",
        color=color,
        lw=1.6,
        label=f"{name}: predicted, peak {strategies.format_bytes(plan.peak_bytes)}",
    )
    shaded = [k for k, event in enumerate(events) if event.phase == "recompute"]
    for k in shaded:
        axes.axvspan(
            *spans[k],
            color=color,
            alpha=0.2,
            lw=0,
            label=f"{name}: recompute" if k == shaded[0] else None,
        )
    axes.axhline(plan.peak_bytes / scale, color=color, ls=":", lw=1)
    if measured is not None:
        axes.axhline(
            measured / scale,
            color=color,
            ls="-.",
            lw=1.2,
            label=f"{name}: measured peak {strategies.format_bytes(measured)}",
        )


def _link_ticks(axes: Any, n: int) -> None:
    import matplotlib.ticker

    def link(x: float, _: object) -> str:  # a tick at a moment's start names its link
        k = int(round(x))
        return str(k) if k < n else str(2 * n - 1 - k) if k < 2 * n else ""

    axes.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    axes.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(link))
