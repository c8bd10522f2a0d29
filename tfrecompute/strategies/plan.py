"""`Plan`: which links to recompute, with its predicted peak and cost."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from tfrecompute._messages import fail, received
from tfrecompute.errors import InfeasibleBudgetError
from tfrecompute.strategies._table import free_width, span_name, table
from tfrecompute.strategies.chain import Chain
from tfrecompute.strategies.simulate import (
    MemoryEvent,
    check_segments,
    check_selective,
    estimate,
    recompute_cost,
    timeline,
)
from tfrecompute.strategies.units import budget_bytes, format_bytes, format_size

__all__ = [
    "REPLAY_MARGIN",
    "Budget",
    "Plan",
    "Strategy",
    "chain_budget",
    "infeasible",
    "reconciled_peak",
]

# NOTE [ Reconciling a prediction with its replay ]
# A calibrated plan has two estimates of the allocator's peak: the chain's (`peak_bytes`,
# simulated from what each link keeps and holds) and its replay (`replayed_peak_bytes`, the
# measured step's own buffers through a simulation of the allocator). On the held-out
# models (benchmarks/results/held_out.md) the replay mostly falls below the measured peak
# and below the chain's estimate (it starts from an allocator without the process's
# earlier free space), and the chain's largest errors are above it (a coarse link, a
# recurrent layer's buffers freed early). `reconciled_peak_bytes` is the chain's estimate
# kept between the replay and `REPLAY_MARGIN` above it; the margin was chosen on those runs.
REPLAY_MARGIN = 0.10
"""`Plan.reconciled_peak_bytes` keeps a calibrated plan's prediction at most this share
above its replayed peak (and never below it)."""


def reconciled_peak(predicted: int, replayed: int | None) -> int:
    """`predicted` kept between `replayed` and `REPLAY_MARGIN` above it; `predicted` when
    there is no replay.

    Example:
        >>> reconciled_peak(150, 100), reconciled_peak(80, 100), reconciled_peak(105, 100)
        (110, 100, 105)
        >>> reconciled_peak(150, None)
        150
    """
    if replayed is None:
        return predicted
    return min(max(predicted, replayed), int(replayed * (1 + REPLAY_MARGIN)))


Budget = int | float | str
"""A memory budget: bytes, a string like `"512MiB"`, or a share of storing everything such as
`0.5` (see `parse_budget`)."""


@dataclass(frozen=True, init=False)
class Plan:
    """A single-level recompute plan for a `Chain`.

    Attributes:
        segments: sorted, disjoint half-open ranges `(start, stop)` of recomputed
            links; every other link is stored as usual. Adjacent segments are
            distinct blocks; a one-link segment recomputes that link alone.
        peak_bytes: the predicted peak memory of one training step.
        recompute_cost: summed `forward_cost` of the recomputed links.
        strategy: the name of the strategy that made the plan (`"manual"` for
            `Plan.from_segments`).
        chain: the chain planned for (not part of equality or repr).
        proven_optimal: True when the planner proved that no plan within the same
            peak costs less (the `optimal` strategy when its search was exact,
            and the points of `frontier`); False otherwise.
        selective: per segment, its state: 0 recomputed whole, 1 under the
            recompute policy the chain was profiled with (its third state,
            `Chain.policy_kept_bytes`), `k` under the `k`-th of several
            (`Chain.policy_states`); () when none is (not part of repr).
            `True`/`False` are accepted for 1/0; stored as ints.

    Example:
        >>> chain = Chain.homogeneous(4, activation_bytes=100)
        >>> plan = Plan.from_segments(chain, [(0, 2), (2, 4)])
        >>> plan.peak_bytes, plan.recompute_cost, plan.recomputed_links
        (600, 4.0, (0, 1, 2, 3))
    """

    segments: tuple[tuple[int, int], ...]
    peak_bytes: int
    recompute_cost: float
    strategy: str
    chain: Chain = field(compare=False, repr=False)
    proven_optimal: bool = False
    selective: tuple[int, ...] = field(default=(), repr=False)

    def __init__(
        self,
        segments: Iterable[Sequence[int]],
        *,
        peak_bytes: int,
        recompute_cost: float,
        strategy: str,
        chain: Chain,
        proven_optimal: bool = False,
        selective: Iterable[int] | None = None,
    ) -> None:
        """Validates the fields; use `Plan.from_segments` to compute peak and cost.

        Raises:
            TypeError: a field has the wrong type.
            ValueError: segments are empty, overlapping, unsorted or outside
                `0..chain.n`, or peak or cost is negative or not finite.
        """
        checked = check_segments("Plan", chain, segments)
        modes = check_selective("Plan", chain, checked, selective)
        if isinstance(peak_bytes, bool) or not isinstance(peak_bytes, numbers.Integral):
            fail(
                "Plan",
                "peak_bytes must be an int",
                "peak_bytes",
                peak_bytes,
                "Pass the peak in bytes, e.g. from simulate()",
                error=TypeError,
            )
        if peak_bytes < 0:
            fail(
                "Plan",
                "peak_bytes must not be negative",
                "peak_bytes",
                peak_bytes,
                "Pass the peak in bytes, e.g. from simulate()",
            )
        if isinstance(recompute_cost, bool) or not isinstance(recompute_cost, numbers.Real):
            fail(
                "Plan",
                "recompute_cost must be a real number",
                "recompute_cost",
                recompute_cost,
                "Pass a finite float >= 0",
                error=TypeError,
            )
        if not math.isfinite(recompute_cost) or recompute_cost < 0:
            fail(
                "Plan",
                "recompute_cost must be finite and not negative",
                "recompute_cost",
                recompute_cost,
                "Pass a finite float >= 0",
            )
        if not isinstance(strategy, str):
            fail(
                "Plan",
                "strategy must be a string",
                "strategy",
                strategy,
                "Pass the strategy's name",
                error=TypeError,
            )
        object.__setattr__(self, "segments", checked)
        object.__setattr__(self, "peak_bytes", int(peak_bytes))
        object.__setattr__(self, "recompute_cost", float(recompute_cost))
        object.__setattr__(self, "strategy", strategy)
        object.__setattr__(self, "chain", chain)
        object.__setattr__(self, "proven_optimal", bool(proven_optimal))
        object.__setattr__(self, "selective", modes)

    @classmethod
    def from_segments(
        cls,
        chain: Chain,
        segments: Iterable[Sequence[int]],
        *,
        strategy: str = "manual",
        selective: Iterable[int] | None = None,
    ) -> Plan:
        """Builds a plan from segments, its peak and cost predicted by `simulate`.

        Args:
            chain: the cost model.
            segments: sorted, disjoint half-open ranges `(start, stop)` of
                recomputed links.
            strategy: the name recorded in the plan.
            selective: per segment, whether it is recomputed under the policy
                (see `Chain.policy_kept_bytes`), or its policy state (0 whole,
                `k` the `k`-th of `Chain.policy_states`); None: none is.

        Returns:
            The plan.

        Example:
            >>> Plan.from_segments(Chain.homogeneous(3, activation_bytes=10), [(1, 3)])
            Plan(segments=((1, 3),), peak_bytes=60, recompute_cost=2.0, strategy='manual', \
proven_optimal=False)
        """
        checked = check_segments("Plan.from_segments", chain, segments)
        modes = check_selective("Plan.from_segments", chain, checked, selective)
        peak, cost = estimate(chain, checked, modes)
        return cls(
            checked,
            peak_bytes=peak,
            recompute_cost=cost,
            strategy=strategy,
            chain=chain,
            selective=modes,
        )

    @property
    def recomputed_links(self) -> tuple[int, ...]:
        """Indices of the recomputed links, ascending."""
        return tuple(j for s, e in self.segments for j in range(s, e))

    @property
    def recomputed_layers(self) -> tuple[int, ...]:
        """The older name of `recomputed_links`."""
        return self.recomputed_links

    def timeline(self) -> list[MemoryEvent]:
        """The memory over one training step; see `tfrecompute.strategies.timeline`."""
        return timeline(self.chain, self.segments, selective=self.selective or None)

    def is_selective(self, index: int) -> bool:
        """Whether segment `index` is recomputed under a policy."""
        return self.state(index) > 0

    @property
    def replayed_peak_bytes(self) -> int | None:
        """The allocator's peak of this plan's step, replayed from the measured step of a
        calibrated chain (`calibrate=True`) through a simulation of TensorFlow's allocator
        (NOTE [ Replaying a plan through the allocator ] in
        `tfrecompute/check/replay.py`); None when the chain is not calibrated or a segment
        recomputes in part."""
        calibration = self.chain.calibration
        if calibration is None:
            return None
        return calibration.replayed_peak_bytes(self)  # type: ignore[attr-defined]

    @property
    def reconciled_peak_bytes(self) -> int:
        """The prediction of the allocator's peak closest on the held-out runs: for a
        calibrated plan that can be replayed, `peak_bytes` kept between
        `replayed_peak_bytes` and 10% above it (`REPLAY_MARGIN`, NOTE [ Reconciling a
        prediction with its replay ]); otherwise `peak_bytes`. Replays the plan's step
        each time it is read."""
        return reconciled_peak(self.peak_bytes, self.replayed_peak_bytes)

    def state(self, index: int) -> int:
        """Segment `index`'s state: 0 recomputed whole, `k` under policy state `k`."""
        return self.selective[index] if self.selective else 0

    def summary(self, *, all_names: bool = False) -> str:
        """A readable table of the plan: one row per run of stored links or segment.

        The "held" column is what a row keeps between its forward and its
        backward pass: the saved bytes of stored links; a segment's output plus
        the carries it hands on (`Chain.carried_bytes`), plus, for a segment
        recomputed under the policy (mode "selective"), the products it keeps.

        Args:
            all_names: list the name of every link of a row. By default the
                table fits 100 columns: a row of more than two layer calls
                (a link merged from calls joins their names with "+") is
                named by its first and last call and a count, and long names
                are cut in the middle.

        Returns:
            The table, then the predicted peak and the recompute overhead.

        Example:
            >>> chain = Chain.homogeneous(6, activation_bytes=1024)
            >>> plan = Plan.from_segments(chain, [(0, 3)])
            >>> print(plan.summary())  # doctest: +NORMALIZE_WHITESPACE
            Plan 'manual' for a chain of 6 links
            links  names                      mode        held      recompute cost
            0-2    link_0 … link_2 (3 links)  recomputed  1.00 KiB  3
            3-5    link_3 … link_5 (3 links)  stored      3.00 KiB  -
            Predicted peak: 7.00 KiB (7168 bytes)
            Recompute cost: 3 = 50.0% of one forward pass (total forward cost 6)
            >>> print(plan.summary(all_names=True).splitlines()[2])
            0-2    link_0, link_1, link_2  recomputed  1.00 KiB  3
        """
        if not isinstance(all_names, bool):
            fail(
                "Plan.summary",
                "`all_names` must be True or False",
                "all_names",
                all_names,
                "Pass all_names=True to name every link",
                error=TypeError,
            )
        chain = self.chain
        runs = _runs(chain.n, self.segments)
        header = ("links", "names", "mode", "held", "recompute cost")
        states = {segment: self.state(i) for i, segment in enumerate(self.segments)}
        rows = [self._row(s, e, recomputed, states.get((s, e), 0)) for s, e, recomputed in runs]
        width = None if all_names else free_width(header, rows, 1)
        for row, (s, e, _) in zip(rows, runs):
            names = chain.names[s:e]
            row[1] = ", ".join(names) if width is None else span_name(names, width)
        total = chain.total_forward_cost
        share = 100.0 * self.recompute_cost / total if total > 0 else 0.0
        proof = " (proven optimal)" if self.proven_optimal else ""
        lines = [
            f"Plan {self.strategy!r} for a chain of {chain.n} links{proof}",
            table(header, rows),
            f"Predicted peak: {format_size(self.peak_bytes)}",
            f"Recompute cost: {_number(self.recompute_cost)} = {share:.1f}% of one forward "
            f"pass (total forward cost {_number(total)})",
        ]
        if chain.calibration is not None:
            lines.append(chain.calibration.summary(self))  # type: ignore[attr-defined]
        elif chain.source is not None:
            lines.append("Memory predicted from the traced calls, not measured (calibrate=True)")
        return "\n".join(lines)

    def _row(self, s: int, e: int, recomputed: bool, state: int = 0) -> list[str]:
        """A row of `summary` for links `s..e-1`, its names left empty."""
        chain = self.chain
        span = str(s) if e - s == 1 else f"{s}-{e - 1}"
        if recomputed:  # its output and the carries it hands on
            held = chain.output_bytes[e - 1] + chain.carried_bytes(s, e)
            mode = "recomputed"
            if state:
                held += sum(chain.segment_states[state][0][s:e])
                one = len(chain.policy_states) == 1 and not chain.policy_names
                mode = "selective" if one else f"selective ({chain.policy_name(state)})"
            cost = _number(recompute_cost(chain, ((s, e),), (state,)))
            return [span, "", mode, format_bytes(held), cost]
        return [span, "", "stored", format_bytes(sum(chain.saved_bytes[s:e])), "-"]


def _runs(n: int, segments: tuple[tuple[int, int], ...]) -> list[tuple[int, int, bool]]:
    """Maximal runs of stored links and the segments, in order."""
    runs: list[tuple[int, int, bool]] = []
    position = 0
    for s, e in segments:
        if position < s:
            runs.append((position, s, False))
        runs.append((s, e, True))
        position = e
    if position < n:
        runs.append((position, n, False))
    return runs


def _number(value: float) -> str:
    return format(value, ".4g")


def chain_budget(api: str, chain: Chain, budget: object) -> int:
    """`budget` for `chain` in bytes; a share (NOTE [ A budget as a share of storing
    everything ] in `units`) is taken of the chain's predicted peak of storing everything.

    Example:
        >>> chain_budget("plan", Chain.homogeneous(4, activation_bytes=100), 0.5)
        350
    """
    return budget_bytes(budget, api=api, name="budget", whole=lambda: estimate(chain, ())[0])


def infeasible(
    api: str, value: object, budget: int, *, own: int, least: int
) -> InfeasibleBudgetError:
    """The error for a budget a strategy cannot meet.

    `own` is the least budget the strategy meets, `least` that of any plan.
    """
    if budget < least:
        what = (
            f"budget {format_size(budget)} is below the least peak any plan reaches, "
            f"{format_size(least)}"
        )
    else:
        what = (
            f"the plan's predicted peak {format_size(own)} exceeds the budget {format_size(budget)}"
        )
    if own == least:
        fix = f"Raise the budget to at least {format_size(least)}, or reduce the batch size"
    else:
        fix = (
            f"Raise the budget to at least {format_size(own)} for this strategy, or use the "
            f'"optimal" strategy, which needs {format_size(least)}'
        )
        if budget < least:
            fix += ", or reduce the batch size"
    message = f"{api}: {what}. {received('budget', value)}. {fix}."
    return InfeasibleBudgetError(message, budget=budget, minimum=own)


class Strategy(Protocol):
    """A planning strategy: `(chain, budget=None) -> Plan`.

    Strategies are plain functions (or factories of functions, like `uniform(k)`);
    `tfrecompute.strategies.get` looks them up by name.
    """

    def __call__(self, chain: Chain, budget: Budget | None = None) -> Plan:
        """Plans `chain`; raises `InfeasibleBudgetError` when the budget cannot be met."""
        ...
