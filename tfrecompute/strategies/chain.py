"""`Chain`: the cost model of a sequential chain of links, all the planner sees."""

from __future__ import annotations

import itertools
import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from tfrecompute._messages import as_positive_int, fail
from tfrecompute.strategies._checks import as_byte_count, as_cost, as_sequence

__all__ = ["Chain"]

_API = "Chain"


@dataclass(frozen=True, init=False)
class Chain:
    """Memory and time costs of a chain of `n` links, link `i` mapping `x_i` to `x_{i+1}`.

    Bytes are ints, costs floats (seconds or FLOPs: only ratios matter). Sequences
    are stored as tuples. See `tfrecompute.strategies.simulate` for how these
    numbers turn into a memory peak.

    Attributes:
        input_bytes: bytes of `x_0`, the chain input.
        output_bytes: `output_bytes[i]` is the size of `x_{i+1}`, link `i`'s output.
        saved_bytes: bytes link `i` keeps alive for its backward pass when it is
            not recomputed, its output included (so `saved_bytes[i] >=
            output_bytes[i]`).
        forward_cost: cost of link `i`'s forward pass, paid again when recomputed.
        workspace_bytes: transient bytes while link `i` runs forward or backward.
        backward_cost: cost of link `i`'s backward pass (informational only).
        overhead_bytes: bytes live at every moment of the step (weights,
            optimizer slots...; parameter gradients go in `kept_grad_bytes`).
        names: link names, unique.
        carries: skip connections, sorted `(producer, last_consumer, bytes)`
            triples: a tensor of `bytes` made by link `producer` and used last
            by link `last_consumer` (`producer + 2 <= last_consumer <= n`;
            `n` means needed until the end of the forward pass, e.g. a model
            output). A recomputed segment must keep such a tensor alive when it
            is made inside the segment and used after it; a stored producer
            keeps it in its `saved_bytes` when a backward pass needs it.
        kept_grad_bytes: bytes of the parameter gradients link `i` produces in its
            backward pass that stay alive until the end of the step (default
            zeros): the optimizer needs all of them before it updates any
            (global norm clipping, loss scaling, gradient accumulation).
        applied_grad_bytes: bytes of the parameter gradients link `i` produces
            in its backward pass that its optimizer update consumes as soon as
            they exist (default zeros). They stay alive for the backward passes
            of the next `Chain.UPDATE_LAG` links (the update runs alongside them),
            and, when link `i` is recomputed, until its segment's backward
            pass ends (the segment releases its gradients together); see
            `tfrecompute.strategies.simulate`.
        carry_grads: gradients of skip connections, sorted `(producer,
            last_consumer, bytes)` triples like `carries`: the backward pass of
            `last_consumer` makes a gradient of `bytes` for a tensor that link
            `producer` output, and it stays alive until the backward pass of
            `producer` uses it (default none). Usually one per float carry. At
            the producer's own backward it is part of the gradient of
            `x_{producer+1}`, as the carry is part of that output.
        input_grad_bytes: bytes of the gradient link `i`'s backward pass
            makes for its input `x_i` (default `activation_bytes(i)`, all of
            it). Less when link `i` reads only part of `x_i` (a tensor of
            `x_i` that only a later link reads is a carry: its gradient is in
            `carry_grads`), or when `x_i` is not differentiable (integer token
            ids); at most `activation_bytes(i)`.
        input_copy_bytes: bytes of the copy of `x_i` that the recompute of a
            segment starting at link `i` reads (default zeros; at most
            `activation_bytes(i)`), live through the segment's recompute and
            backward. `RecomputeBlock` copies its floating inputs there (NOTE
            [ The recompute's input copy ] in tfrecompute/costs/profile.py).
        update_workspace_bytes: transient bytes of the optimizer step at the
            end of the backward pass, while the gradients of `kept_grad_bytes` are
            all alive (default 0): the copies an optimizer that needs all
            gradients makes of them (clipped or unscaled gradients). The step's
            end is folded into link 0's backward pass, so they count there.
        applied_workspace_bytes: transient bytes of one update of an
            optimizer that applies gradients as they come (default 0): the
            temporaries it makes for the largest variable (Adam's square of
            the gradient and root of its second moment, about twice the
            variable). Updates run alongside the backward pass, so they count
            at every backward and recompute moment.
        max_stop: `max_stop[s]` is the largest stop of a segment starting at
            link `s`: `[s, e)` may be recomputed as one block only if `e <=
            max_stop[s]`, and `max_stop[s] == s` means link `s` cannot be
            recomputed at all (default `n` everywhere: no constraint). A
            profiled model sets it where its structure limits the blocks:
            links inside a subclassed layer are checkpointed one call at a
            time, a block already in the model is not nested in another, and
            links no gradient reaches gain nothing from a recompute.
        policy_kept_bytes: the third state of a link (NOTE [ Recompute
            policies ] in tfrecompute/layers/policy.py): bytes link `i` keeps
            from its forward to its segment's backward when its segment is
            recomputed under a recompute policy (the outputs of the products
            the policy keeps, e.g. its weight matmuls under `"dots"`). None
            (the default): the chain has no third state and plans are
            two-state. Given together with `policy_forward_cost`.
        policy_forward_cost: the cost of link `i`'s recompute under the
            policy (its forward cost less the products it keeps); None with
            `policy_kept_bytes`.
        more_policies: further recompute states, one `(kept_bytes,
            forward_cost)` pair per policy, each per link as the two fields
            above (default none; needs `policy_kept_bytes`). The planner
            weighs every state per segment: with `policy_kept_bytes` under
            `"attention"` and one more pair under `"dots"`, a link is stored,
            recomputed whole, or recomputed under either (`policy_states`).
        policy_names: what each policy state is, for summaries (e.g.
            `("attention", "dots")`): one name per state, or () (the
            default: unnamed). Not part of equality or repr.
        source: what the chain was profiled from, opaque to the planner and
            not part of equality or repr: `tfrecompute.profile` sets it to the
            model's link map, so that `tfrecompute.recompute(model, plan)`
            rewrites a plan made on this chain without profiling the model
            again. None for a chain built by hand.
        calibration: how the chain's bytes were reconciled with a measured
            training step (`tfrecompute.check.calibrate.Calibration`, whose
            `summary()` a plan's summary prints), or None when they were not.
            Not part of equality or repr.

    Example:
        >>> chain = Chain(1024, [2048, 2048, 512], [4096, 2048, 512], [1.0, 2.0, 0.5])
        >>> chain.n, chain.names[0], chain.backward_cost[1]
        (3, 'link_0', 4.0)
        >>> Chain.homogeneous(4, activation_bytes=1024).saved_bytes
        (1024, 1024, 1024, 1024)
        >>> residual = Chain(8, [8] * 4, [8] * 4, [1.0] * 4, carries=[(0, 3, 8)])
        >>> residual.carries, residual.carried_bytes(0, 3), residual.carried_bytes(0, 4)
        (((0, 3, 8),), 8, 0)
    """

    UPDATE_LAG: ClassVar[int] = 2
    """Backward passes of later links an applied parameter gradient outlives."""

    input_bytes: int
    output_bytes: tuple[int, ...]
    saved_bytes: tuple[int, ...]
    forward_cost: tuple[float, ...]
    workspace_bytes: tuple[int, ...]
    backward_cost: tuple[float, ...]
    overhead_bytes: int
    names: tuple[str, ...]
    carries: tuple[tuple[int, int, int], ...]
    kept_grad_bytes: tuple[int, ...]
    carry_grads: tuple[tuple[int, int, int], ...]
    input_grad_bytes: tuple[int, ...]
    applied_grad_bytes: tuple[int, ...]
    input_copy_bytes: tuple[int, ...]
    update_workspace_bytes: int
    max_stop: tuple[int, ...]
    applied_workspace_bytes: int = 0
    policy_kept_bytes: tuple[int, ...] | None = None
    policy_forward_cost: tuple[float, ...] | None = None
    more_policies: tuple[tuple[tuple[int, ...], tuple[float, ...]], ...] = ()
    policy_names: tuple[str, ...] = field(default=(), compare=False, repr=False)
    source: object = field(default=None, compare=False, repr=False)
    calibration: object = field(default=None, compare=False, repr=False)

    def __init__(
        self,
        input_bytes: int,
        output_bytes: Iterable[int],
        saved_bytes: Iterable[int],
        forward_cost: Iterable[float],
        *,
        workspace_bytes: Iterable[int] | None = None,
        backward_cost: Iterable[float] | None = None,
        overhead_bytes: int = 0,
        names: Iterable[str] | None = None,
        carries: Iterable[Sequence[int]] = (),
        kept_grad_bytes: Iterable[int] | None = None,
        carry_grads: Iterable[Sequence[int]] = (),
        input_grad_bytes: Iterable[int] | None = None,
        applied_grad_bytes: Iterable[int] | None = None,
        input_copy_bytes: Iterable[int] | None = None,
        update_workspace_bytes: int = 0,
        max_stop: Iterable[int] | None = None,
        applied_workspace_bytes: int = 0,
        policy_kept_bytes: Iterable[int] | None = None,
        policy_forward_cost: Iterable[float] | None = None,
        more_policies: Iterable[tuple[Iterable[int], Iterable[float]]] = (),
        policy_names: Iterable[str] = (),
        source: object = None,
        calibration: object = None,
    ) -> None:
        """Validates and stores the costs; see the class docstring for the fields.

        Raises:
            TypeError: a value has the wrong type (bools are never numbers here).
            ValueError: lengths disagree, the chain is empty, a value is negative,
                NaN or infinite, a byte count is fractional, `saved_bytes[i] <
                output_bytes[i]`, names repeat, a carry's links are out of
                range or skip no link, or `input_grad_bytes[i]` or
                `input_copy_bytes[i]` exceeds the size of `x_i`, or
                `max_stop[s]` is outside `s..n`, or only one of
                `policy_kept_bytes` and `policy_forward_cost` is given, or
                `more_policies` without them, or `policy_names` not one
                name per policy state.
        """
        outputs = _byte_tuple("output_bytes", output_bytes)
        n = len(outputs)
        if n == 0:
            fail(
                _API,
                "a chain needs at least one link",
                "output_bytes",
                output_bytes,
                "Pass one entry per link",
            )
        forward = _cost_tuple("forward_cost", forward_cost, n=n)
        inputs = as_byte_count(_API, "input_bytes", input_bytes)
        sizes = (inputs, *outputs[:-1])
        fields = {
            "input_bytes": inputs,
            "output_bytes": outputs,
            "saved_bytes": _saved(saved_bytes, outputs),
            "forward_cost": forward,
            "workspace_bytes": _optional_bytes("workspace_bytes", workspace_bytes, n),
            "backward_cost": tuple(2.0 * cost for cost in forward)
            if backward_cost is None
            else _cost_tuple("backward_cost", backward_cost, n=n),
            "overhead_bytes": as_byte_count(_API, "overhead_bytes", overhead_bytes),
            "names": tuple(f"link_{i}" for i in range(n)) if names is None else _names(names, n=n),
            "carries": _carries(carries, n=n),
            "kept_grad_bytes": _optional_bytes("kept_grad_bytes", kept_grad_bytes, n),
            "carry_grads": _carries(carry_grads, n=n, name="carry_grads"),
            "input_grad_bytes": sizes
            if input_grad_bytes is None
            else _input_bounded(
                "input_grad_bytes", input_grad_bytes, sizes, "a link's input gradient"
            ),
            "applied_grad_bytes": _optional_bytes("applied_grad_bytes", applied_grad_bytes, n),
            "input_copy_bytes": (0,) * n
            if input_copy_bytes is None
            else _input_bounded(
                "input_copy_bytes", input_copy_bytes, sizes, "a copy of a link's input"
            ),
            "update_workspace_bytes": as_byte_count(
                _API, "update_workspace_bytes", update_workspace_bytes
            ),
            "max_stop": _max_stop(max_stop, n),
            "applied_workspace_bytes": as_byte_count(
                _API, "applied_workspace_bytes", applied_workspace_bytes
            ),
            **_policy_costs(policy_kept_bytes, policy_forward_cost, n),
            "source": source,
            "calibration": calibration,
        }
        more = _more_policies(more_policies, fields["policy_kept_bytes"], n)
        fields["more_policies"] = more
        states = 0 if fields["policy_kept_bytes"] is None else 1 + len(more)
        fields["policy_names"] = _policy_names(policy_names, states)
        for name, value in fields.items():
            object.__setattr__(self, name, value)

    @classmethod
    def homogeneous(cls, n: int, *, activation_bytes: int, cost: float = 1.0) -> Chain:
        """A chain of `n` identical links that each keep only their output.

        Args:
            n: number of links, at least 1.
            activation_bytes: size of every activation, the input included.
            cost: forward cost of every link.

        Returns:
            The chain.

        Example:
            >>> Chain.homogeneous(3, activation_bytes=100).output_bytes
            (100, 100, 100)
        """
        links = as_positive_int("Chain.homogeneous", "n", n)
        size = as_byte_count("Chain.homogeneous", "activation_bytes", activation_bytes)
        each = as_cost("Chain.homogeneous", "cost", cost)
        return cls(size, [size] * links, [size] * links, [each] * links)

    @property
    def has_policy(self) -> bool:
        """Whether links have a third state, recomputed under a policy (`policy_kept_bytes`)."""
        return self.policy_kept_bytes is not None

    @property
    def policy_states(self) -> tuple[tuple[tuple[int, ...], tuple[float, ...]], ...]:
        """Every policy state's `(kept_bytes, forward_cost)`: state `k` (1-based) is entry `k - 1`.

        Example:
            >>> chain = Chain(1, [1] * 2, [4] * 2, [2.0] * 2, policy_kept_bytes=[1, 1],
            ...               policy_forward_cost=[1.0, 1.0], more_policies=[([2, 2], [0.5, 0.5])])
            >>> [kept for kept, _ in chain.policy_states]
            [(1, 1), (2, 2)]
        """
        if self.policy_kept_bytes is None or self.policy_forward_cost is None:
            return ()
        return ((self.policy_kept_bytes, self.policy_forward_cost), *self.more_policies)

    @property
    def segment_states(self) -> tuple[tuple[tuple[int, ...], tuple[float, ...]], ...]:
        """A segment's `(kept_bytes, recompute cost)` per link in each state it may take:
        state 0 recomputed whole (nothing kept, `forward_cost`), state `k` policy state `k`.

        Example:
            >>> Chain(1, [1] * 2, [4] * 2, [2.0] * 2).segment_states
            (((0, 0), (2.0, 2.0)),)
        """
        return (((0,) * self.n, self.forward_cost), *self.policy_states)

    def policy_name(self, state: int) -> str:
        """How summaries name policy state `state` (1-based): its `policy_names` entry."""
        if self.policy_names:
            return self.policy_names[state - 1]
        return "policy" if len(self.policy_states) == 1 else f"policy {state}"

    @property
    def n(self) -> int:
        """Number of links."""
        return len(self.output_bytes)

    @property
    def total_forward_cost(self) -> float:
        """Cost of one forward pass over the whole chain (an exactly rounded sum)."""
        return math.fsum(self.forward_cost)

    def activation_bytes(self, i: int) -> int:
        """Size of `x_i` for `i` in `0..n`: the input for 0, else `output_bytes[i - 1]`."""
        return self.input_bytes if i == 0 else self.output_bytes[i - 1]

    def allowed(self, start: int, stop: int) -> bool:
        """Whether links `[start, stop)` may be recomputed as one segment (see `max_stop`)."""
        return stop <= self.max_stop[start]

    def carried_bytes(self, start: int, stop: int) -> int:
        """`C(start, stop)`: bytes of the carries a segment `[start, stop)` must output.

        These are the carries made inside the segment, before its last link
        (whose output is `x_stop` itself), and used at or after link `stop`. A
        recomputed segment holds `activation_bytes(stop) + carried_bytes(start,
        stop)` between its forward and its backward pass.

        Example:
            >>> chain = Chain(1, [1] * 5, [1] * 5, [1.0] * 5, carries=[(1, 4, 7), (2, 5, 3)])
            >>> chain.carried_bytes(0, 4), chain.carried_bytes(0, 2), chain.carried_bytes(2, 4)
            (10, 0, 3)
        """
        return sum(b for i, j, b in self.carries if start <= i < stop - 1 and j >= stop)

    def live_gradients(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Gradient bytes alive in the backward pass, whatever the plan.

        Returns `(backward, recompute)`: `backward[k]` (for `k` in `0..n-1`) is
        what is alive while link `k`'s backward pass runs besides the
        gradient of `x_{k+1}` and the one it makes for its input
        (`input_grad_bytes[k]`): `G_k`, plus the `carry_grads` `(i, j,
        b)` with `i < k <= j`, plus, for `k = 0`, `update_workspace_bytes`
        (the step's end, with the optimizer's copies, is folded into link
        0's backward pass). `recompute[e]` (for `e` in `0..n`) is what is
        alive while a segment ending at `e` runs forward again (after the
        backward pass of link `e`) besides the gradient of `x_e`: `G_e`, plus
        the `carry_grads` with `i + 1 < e <= j`. Both count
        `applied_workspace_bytes` at every moment (an update in flight). See
        `tfrecompute.strategies.simulate`.

        Example:
            >>> chain = Chain(1, [1] * 4, [1] * 4, [1.0] * 4, kept_grad_bytes=[1, 0, 0, 2],
            ...               carry_grads=[(0, 2, 10)])
            >>> chain.live_gradients()
            ((3, 12, 12, 2), (3, 2, 12, 2, 0))
        """
        n = self.n
        params = [0] * (n + 1)  # params[k] = G_k
        for k in range(n - 1, -1, -1):
            params[k] = params[k + 1] + self.kept_grad_bytes[k]
        at = [0] * (n + 1)  # differences: carry gradients at backward moments
        between = [0] * (n + 2)  # differences: carry gradients after backward of e
        for i, j, size in self.carry_grads:
            at[i + 1] += size
            at[min(j, n - 1) + 1] -= size
            between[i + 2] += size
            between[j + 1] -= size
        at[0] += self.update_workspace_bytes
        at[1] -= self.update_workspace_bytes
        update = self.applied_workspace_bytes
        backward = tuple(g + c + update for g, c in zip(params, itertools.accumulate(at[:n])))
        recompute = tuple(
            g + c + update for g, c in zip(params, itertools.accumulate(between[: n + 1]))
        )
        return backward, recompute


def _check_length(name: str, items: tuple[object, ...], n: int | None, values: object) -> None:
    if n is not None and len(items) != n:
        fail(
            _API,
            f"{name} has {len(items)} entries but the chain has {n} links (the length "
            "of output_bytes)",
            name,
            values,
            "Pass one entry per link in every per-link sequence",
        )


def _byte_tuple(name: str, values: object, *, n: int | None = None) -> tuple[int, ...]:
    items = as_sequence(_API, name, values)
    _check_length(name, items, n, values)
    return tuple(as_byte_count(_API, f"{name}[{i}]", item) for i, item in enumerate(items))


def _max_stop(values: object, n: int) -> tuple[int, ...]:
    """`max_stop`, each `s <= max_stop[s] <= n`; `n` everywhere by default."""
    if values is None:
        return (n,) * n
    items = as_sequence(_API, "max_stop", values)
    _check_length("max_stop", items, n, values)
    stops = []
    for s, item in enumerate(items):
        if isinstance(item, bool) or not isinstance(item, numbers.Integral):
            fail(
                _API,
                f"max_stop[{s}] is not an int",
                f"max_stop[{s}]",
                item,
                "Pass the largest stop of a segment starting at each link",
                error=TypeError,
            )
        if not s <= int(item) <= n:
            fail(
                _API,
                f"max_stop[{s}] is outside {s}..{n}",
                f"max_stop[{s}]",
                item,
                f"Keep s <= max_stop[s] <= n (s: the link cannot be recomputed; {n}: no limit)",
            )
        stops.append(int(item))
    return tuple(stops)


def _policy_costs(kept: object, cost: object, n: int) -> dict[str, object]:
    """`policy_kept_bytes` and `policy_forward_cost`: both None, or both per link."""
    if (kept is None) != (cost is None):
        given, missing = (
            ("policy_kept_bytes", "policy_forward_cost")
            if cost is None
            else ("policy_forward_cost", "policy_kept_bytes")
        )
        fail(
            _API,
            f"{given} is given without {missing}; a link's third state needs both",
            given,
            kept if cost is None else cost,
            f"Pass {missing} too (one entry per link), or neither",
        )
    if kept is None:
        return {"policy_kept_bytes": None, "policy_forward_cost": None}
    return {
        "policy_kept_bytes": _byte_tuple("policy_kept_bytes", kept, n=n),
        "policy_forward_cost": _cost_tuple("policy_forward_cost", cost, n=n),
    }


def _more_policies(
    values: object, first: object, n: int
) -> tuple[tuple[tuple[int, ...], tuple[float, ...]], ...]:
    """`more_policies`: `(kept_bytes, forward_cost)` pairs, each per link; only after a first."""
    pairs = as_sequence(_API, "more_policies", values)
    if pairs and first is None:
        fail(
            _API,
            "more_policies is given without policy_kept_bytes; further states follow a first",
            "more_policies",
            values,
            "Pass the first policy's policy_kept_bytes and policy_forward_cost too",
        )
    found = []
    for k, pair in enumerate(pairs):
        items = as_sequence(_API, f"more_policies[{k}]", pair)
        if len(items) != 2:
            fail(
                _API,
                f"more_policies[{k}] must be a (kept_bytes, forward_cost) pair",
                f"more_policies[{k}]",
                pair,
                "Pass one pair per further policy, each a per-link sequence",
            )
        found.append(
            (
                _byte_tuple(f"more_policies[{k}][0]", items[0], n=n),
                _cost_tuple(f"more_policies[{k}][1]", items[1], n=n),
            )
        )
    return tuple(found)


def _policy_names(values: object, states: int) -> tuple[str, ...]:
    """`policy_names`: () or one string per policy state."""
    names = as_sequence(_API, "policy_names", values)
    if names and (len(names) != states or not all(isinstance(name, str) for name in names)):
        fail(
            _API,
            f"policy_names must be one string per policy state ({states} here)",
            "policy_names",
            values,
            "Pass a name per state, e.g. ('attention', 'dots'), or ()",
        )
    return tuple(str(name) for name in names)


def _optional_bytes(name: str, values: object, n: int) -> tuple[int, ...]:
    """Per-link bytes, zeros when not given."""
    return (0,) * n if values is None else _byte_tuple(name, values, n=n)


def _saved(values: object, outputs: tuple[int, ...]) -> tuple[int, ...]:
    """`saved_bytes`, each at least the link's output, which it includes."""
    saved = _byte_tuple("saved_bytes", values, n=len(outputs))
    for i, (kept, output) in enumerate(zip(saved, outputs)):
        if kept < output:
            fail(
                _API,
                f"saved_bytes[{i}] is smaller than output_bytes[{i}]={output}; a link's "
                "saved bytes include its output",
                f"saved_bytes[{i}]",
                kept,
                "Set saved_bytes[i] >= output_bytes[i] for every link",
            )
    return saved


def _input_bounded(name: str, values: object, sizes: tuple[int, ...], what: str) -> tuple[int, ...]:
    """Per-link bytes, each at most the size of that link's input `x_i`."""
    items = _byte_tuple(name, values, n=len(sizes))
    for i, (value, size) in enumerate(zip(items, sizes)):
        if value > size:
            fail(
                _API,
                f"{name}[{i}] is larger than x_{i}, {size} bytes; {what} is at most its size",
                f"{name}[{i}]",
                value,
                f"Set {name}[i] <= activation_bytes(i) for every link",
            )
    return items


def _cost_tuple(name: str, values: object, *, n: int) -> tuple[float, ...]:
    items = as_sequence(_API, name, values)
    _check_length(name, items, n, values)
    return tuple(as_cost(_API, f"{name}[{i}]", item) for i, item in enumerate(items))


def _carries(values: object, *, n: int, name: str = "carries") -> tuple[tuple[int, int, int], ...]:
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Iterable):
        fail(
            _API,
            f"{name} must be a sequence of (producer, last_consumer, bytes) triples",
            name,
            values,
            "Pass e.g. [(2, 5, 4096)], or () for a plain chain",
            error=TypeError,
        )
    checked: list[tuple[int, int, int]] = []
    for k, item in enumerate(values):
        triple = tuple(item) if isinstance(item, (tuple, list)) else None
        if (
            triple is None
            or len(triple) != 3
            or not all(
                isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in triple[:2]
            )
        ):
            fail(
                _API,
                f"{name}[{k}] is not a (producer, last_consumer, bytes) triple of ints",
                f"{name}[{k}]",
                item,
                "Pass each carry as a triple of ints, e.g. (2, 5, 4096)",
                error=TypeError,
            )
        producer, consumer = int(triple[0]), int(triple[1])
        size = as_byte_count(_API, f"{name}[{k}][2]", triple[2])
        if not 0 <= producer < n:
            fail(
                _API,
                f"{name}[{k}] has producer {producer}, outside the chain's links 0..{n - 1}",
                f"{name}[{k}]",
                item,
                f"Keep 0 <= producer <= {n - 2}",
            )
        if not producer + 2 <= consumer <= n:
            fail(
                _API,
                f"{name}[{k}] has last_consumer {consumer}, outside {producer + 2}..{n}; a "
                "carry skips at least one link and last_consumer=n means needed until the end",
                f"{name}[{k}]",
                item,
                "Keep producer + 2 <= last_consumer <= n (a tensor used only by the next "
                "link is its output, not a carry)",
            )
        checked.append((producer, consumer, size))
    return tuple(sorted(checked))


def _names(values: object, *, n: int) -> tuple[str, ...]:
    items = as_sequence(_API, "names", values)
    _check_length("names", items, n, values)
    seen: dict[str, int] = {}
    for i, item in enumerate(items):
        if not isinstance(item, str):
            fail(
                _API,
                f"names[{i}] is not a string",
                f"names[{i}]",
                item,
                "Pass link names as strings",
                error=TypeError,
            )
        if not item:
            fail(
                _API,
                f"names[{i}] is empty",
                f"names[{i}]",
                item,
                "Give every link a non-empty name",
            )
        if item in seen:
            fail(
                _API,
                f"names[{i}] repeats names[{seen[item]}]",
                f"names[{i}]",
                item,
                "Give every link a unique name",
            )
        seen[item] = i
    return tuple(str(item) for item in items)
