"""A chain reconciled with the model's own measured training step.

NOTE [ Calibrating against a measured step ]
A chain's bytes are read from the model's traced calls; some of what a
training step holds is not in them (a loop's per-step tensors, casts and
copies TensorFlow adds, the optimizer's temporaries, the allocator's
rounding). `calibrated` runs one compiled training step storing
everything on a twin of the model (a Functional model over its graph, or a
model calling a subclassed one, compiled with a fresh copy of its
optimizer; the weights are restored afterwards) under TensorFlow's
profiler. Each layer is named by its index while the step is traced, so an
op's name scopes say which layers it ran in, and each buffer is placed on
the link of the innermost layer call of the chain (`_Scopes`: a layer
called in a loop has a scope per call). Then:

1. What each link keeps for its backward: its forward buffers at the
   moment the forward's buffers are largest (the end of the forward). A
   link measured keeping more than its `saved_bytes` gets the measured
   bytes; never less (oneDNN's CPU allocator's events leave out allocations
   under 256 KiB, so a link measured keeping less may hold buffers the
   trace does not show).
2. What each link holds at once: the most its forward and gradient buffers
   held together. Above what the chain has it hold at its backward (kept,
   input and weight gradients, workspace), the difference is added to its
   workspace (BatchNormalization's backward holds one more buffer the size
   of its input than its gradient graph shows).
3. What the step holds beyond the links, in two parts. The bytes its
   buffers requested at its peak above the reconciled chain's prediction
   of storing everything: memory no link can be said to hold (the
   optimizer's temporaries, buffers of ops outside every layer), added to
   every moment (`Chain.overhead_bytes`), so plans are predicted
   conservatively. And the allocator's peak over that prediction (its
   rounding; XLA's buffers under
   `jit_compile=True`), by which every byte count of the chain is
   multiplied, rounded up: the rounding grows with what is live. Storing
   everything is then predicted at its measured peak. When the chain
   predicts more than the allocator's peak, it is left predicting more:
   the excess is reported, not placed.

`Calibration.summary()` says which of these happened, with their sizes; a
plan's summary prints it. The step's events are kept (`Calibration.record`):
a plan's step is replayed from them (`Plan.replayed_peak_bytes`, NOTE [
Replaying a plan through the allocator ] in `tfrecompute/check/replay.py`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import keras
import numpy as np

from tfrecompute import strategies
from tfrecompute._messages import fail
from tfrecompute.check import replay
from tfrecompute.check.measure import requested_peak, traced_events
from tfrecompute.check.twin import compiled_like, functional_twin, labelled, weights_restored
from tfrecompute.costs.measured import counted_from
from tfrecompute.costs.profile import ProfiledModel
from tfrecompute.graph.trace import as_defined

__all__ = ["Calibration", "calibrated"]

_TOKEN = "tfrecompute_layer_"  # a layer's name while its step is traced: _TOKEN + index
_SCOPE = re.compile(rf"^{_TOKEN}(\d+)(?:_(\d+))?(?:_\d+)*$")  # unique scopes: "_1", "_2"


@dataclasses.dataclass(frozen=True)
class Calibration:
    """How a chain was reconciled with a measured training step storing everything.

    Attributes:
        measured_bytes: the allocator's peak of the step.
        predicted_bytes: the chain's predicted peak of storing everything before.
        kept_bytes: per link, the bytes its layers' forward ops held at the
            moment the forward's buffers were largest (what it keeps for its
            backward, as measured).
        held_bytes: per link, the most bytes its layers' ops (forward and
            gradient) held at once over the step.
        raised_bytes: per link, the bytes its measured kept buffers added to
            its `saved_bytes` (0 for most links).
        workspace_bytes: per link, the bytes added to its `workspace_bytes`:
            the most its ops held at once, less what the chain has it hold
            at its backward (its kept bytes, input and weight gradients and
            workspace).
        unplaced_bytes: the bytes the step's buffers requested at its peak
            above the reconciled prediction, added to every moment of the
            chain (0 when the prediction was above).
        rounding: the allocator's peak over the reconciled prediction with
            the unplaced bytes (at least 1): every byte count of the
            calibrated chain is multiplied by it.
        excess_bytes: how far the reconciled prediction of storing
            everything is above the measured peak (0 when it is not).
        seconds: the wall time the calibration took.
        traced: the chain before calibration (predicted from the traced
            calls only). Not part of equality or repr.
        record: the measured step's allocator events, each allocation placed
            on its link (`replay.Buffer`), from which a plan's step is
            replayed (`replayed_peak_bytes`). Not part of equality or repr.
        resident: the bytes of the model's and its optimizer's variables the
            allocator holds between steps, in creation order, allocated
            before a replayed step. Not part of equality or repr.
    """

    measured_bytes: int
    predicted_bytes: int
    kept_bytes: tuple[int, ...]
    held_bytes: tuple[int, ...]
    raised_bytes: tuple[int, ...]
    workspace_bytes: tuple[int, ...]
    unplaced_bytes: int
    rounding: float
    excess_bytes: int
    seconds: float
    traced: strategies.Chain | None = dataclasses.field(default=None, compare=False, repr=False)
    record: tuple[replay.Buffer, ...] = dataclasses.field(default=(), compare=False, repr=False)
    resident: tuple[int, ...] = dataclasses.field(default=(), compare=False, repr=False)

    def replayed_peak_bytes(self, plan: strategies.Plan) -> int | None:
        """The allocator's peak of `plan`'s step, replayed from the measured step through a
        simulation of TensorFlow's allocator (NOTE [ Replaying a plan through the
        allocator ] in `tfrecompute/check/replay.py`), or None where the plan cannot be
        replayed: a segment recomputes in part (a policy state) or nothing was recorded."""
        if not self.record or self.traced is None:
            return None
        if any(plan.state(i) for i in range(len(plan.segments))):
            return None
        return replay.replayed_peak(
            self.record, plan.segments, self.traced.output_bytes, resident=self.resident
        )

    def summary(self, plan: strategies.Plan | None = None) -> str:
        """A plan summary's lines: what was measured, then what it changed, one per line;
        with `plan`, also its step replayed through the allocator."""
        fmt = strategies.format_bytes
        lines = [
            f"Memory calibrated by a measured step storing everything: {fmt(self.measured_bytes)}"
            f" (traced calls: {fmt(self.predicted_bytes)}; {self.seconds:.1f} s)"
        ]
        raised = [b for b in self.raised_bytes if b > 0]
        if raised:
            lines.append(f"  {len(raised)} links keep {fmt(sum(raised))} more than traced")
        wider = [b for b in self.workspace_bytes if b > 0]
        if wider:
            most = fmt(max(wider))
            lines.append(f"  {len(wider)} links hold up to {most} more at their backward")
        if self.rounding > 1:
            share = f"{self.rounding - 1:.1%}"
            lines.append(f"  every byte {share} more: the allocator's rounding, buffers unseen")
        if self.unplaced_bytes:
            lines.append(
                f"  {fmt(self.unplaced_bytes)} no link holds, added to every moment (conservative)"
            )
        if self.excess_bytes:
            lines.append(f"  still predicted {fmt(self.excess_bytes)} above the measured step")
        replayed = None if plan is None else plan.replayed_peak_bytes
        if replayed is not None:
            lines.append(
                f"  this plan's step replayed through the allocator: {fmt(replayed)} "
                "(its buffers as the allocator rounds them)"
            )
            lines.append(
                "  the prediction reconciled with the replay (reconciled_peak_bytes): "
                f"{fmt(strategies.reconciled_peak(plan.peak_bytes, replayed))}"
            )
        return "\n".join(lines)


def calibrated(api: str, chain: strategies.Chain, sample: Any) -> strategies.Chain:
    """`chain` reconciled with one measured training step storing everything of the model
    it was profiled from (NOTE [ Calibrating against a measured step ]), on `sample`; the
    model's weights and optimizer are left as they were. A chain is calibrated once
    while its calibrated chain is in use (`plan(..., calibrate=True)` then
    `recompute(...)` with the same sample measure once; the pipeline keeps one chain per
    model and input signature)."""
    known = _calibrations.get(id(chain))
    done = known() if known is not None else None
    if done is not None and done.calibration.traced is chain:  # type: ignore[attr-defined]
        return done
    made = _calibrated(api, chain, sample)
    key = id(chain)
    _calibrations[key] = weakref.ref(made, lambda _, key=key: _calibrations.pop(key, None))
    return made


# id of a traced chain -> its calibrated chain, which holds the traced chain (so the id
# is not reused while the entry lives) and is held weakly.
_calibrations: dict[int, weakref.ref[strategies.Chain]] = {}


def _calibrated(api: str, chain: strategies.Chain, sample: Any) -> strategies.Chain:
    """`calibrated` without the cache: measures and reconciles."""
    start = time.perf_counter()
    source = chain.source
    assert isinstance(source, ProfiledModel)  # the pipeline's chains carry their calls
    x, y = labelled(api, sample)
    rows = {int(np.shape(t)[0]) for t in keras.tree.flatten(x) if np.ndim(t)}
    if rows != {source.batch_size}:
        fail(
            api,
            f"calibrating measures a step on the sample's {', '.join(map(str, sorted(rows)))} "
            f"rows, and the plan is for batch size {source.batch_size}",
            "batch_size",
            source.batch_size,
            "Pass a sample of that many rows, or leave batch_size out to plan at the sample's",
        )
    measured = _measured_step(api, source, (x, y), chain.n)
    raised = tuple(max(0, kept - saved) for kept, saved in zip(measured.kept, chain.saved_bytes))
    kept = dataclasses.replace(
        chain, saved_bytes=tuple(s + r for s, r in zip(chain.saved_bytes, raised))
    )
    workspace = tuple(
        max(0, held - _traced_backward(kept, i)) for i, held in enumerate(measured.held)
    )
    reconciled = dataclasses.replace(
        kept, workspace_bytes=tuple(w + r for w, r in zip(chain.workspace_bytes, workspace))
    )
    predicted = strategies.none(reconciled).peak_bytes
    unplaced = max(0, measured.requested - predicted)
    rounding = max(1.0, measured.peak / max(predicted + unplaced, 1))
    calibration = Calibration(
        measured_bytes=measured.peak,
        predicted_bytes=strategies.none(chain).peak_bytes,
        kept_bytes=tuple(measured.kept),
        held_bytes=tuple(measured.held),
        raised_bytes=raised,
        workspace_bytes=workspace,
        unplaced_bytes=unplaced,
        rounding=rounding,
        excess_bytes=max(0, predicted - measured.peak),
        seconds=time.perf_counter() - start,
        traced=chain,
        record=measured.record,
        resident=measured.resident,
    )
    placed = dataclasses.replace(reconciled, overhead_bytes=chain.overhead_bytes + unplaced)
    return dataclasses.replace(_scaled(placed, rounding), calibration=calibration)


def _scaled(chain: strategies.Chain, factor: float) -> strategies.Chain:
    """`chain` with every byte count times `factor` (rounded up): each buffer as the
    allocator holds it, rounded up as it rounded the measured step's buffers."""

    def times(values: Any) -> Any:
        return tuple(math.ceil(v * factor) for v in values)

    def carried(items: Any) -> Any:
        return tuple((i, j, math.ceil(b * factor)) for i, j, b in items)

    policy = chain.policy_kept_bytes
    return dataclasses.replace(
        chain,
        input_bytes=math.ceil(chain.input_bytes * factor),
        output_bytes=times(chain.output_bytes),
        saved_bytes=times(chain.saved_bytes),
        workspace_bytes=times(chain.workspace_bytes),
        overhead_bytes=math.ceil(chain.overhead_bytes * factor),
        carries=carried(chain.carries),
        kept_grad_bytes=times(chain.kept_grad_bytes),
        carry_grads=carried(chain.carry_grads),
        input_grad_bytes=times(chain.input_grad_bytes),
        applied_grad_bytes=times(chain.applied_grad_bytes),
        input_copy_bytes=times(chain.input_copy_bytes),
        update_workspace_bytes=math.ceil(chain.update_workspace_bytes * factor),
        applied_workspace_bytes=math.ceil(chain.applied_workspace_bytes * factor),
        policy_kept_bytes=None if policy is None else times(policy),
        more_policies=tuple((times(kept), cost) for kept, cost in chain.more_policies),
    )


def _traced_backward(chain: strategies.Chain, link: int) -> int:
    """What the chain has a link hold while its backward runs: what it keeps, its input
    and weight gradients and its workspace."""
    grads = chain.kept_grad_bytes[link] + chain.applied_grad_bytes[link]
    held = chain.saved_bytes[link] + chain.input_grad_bytes[link]
    return held + grads + chain.workspace_bytes[link]


def _link_of_layer(source: ProfiledModel) -> dict[int, tuple[int, ...]]:
    """The links of each layer's calls in the chain, in call order, by the layer's `id`
    (a layer called in a loop, or shared, has several)."""
    link_of: dict[int, tuple[int, ...]] = {}
    for link, (first, stop) in enumerate(source.links):
        for call in source.graph.calls[first:stop]:
            if isinstance(call.layer, keras.layers.Layer):
                link_of[id(call.layer)] = (*link_of.get(id(call.layer), ()), link)
    return link_of


@dataclasses.dataclass(frozen=True)
class _Measured:
    kept: list[int]  # per link, what its forward ops hold at the forward's largest moment
    held: list[int]  # per link, the most its ops (forward and gradient) hold at once
    peak: int  # the allocator's peak of the step
    requested: int  # the most bytes its buffers requested at once
    record: tuple[replay.Buffer, ...]  # its allocator events, placed on links
    resident: tuple[int, ...]  # the bytes of each variable the allocator holds between steps


def _measured_step(api: str, source: ProfiledModel, batch: tuple[Any, Any], n: int) -> _Measured:
    """One training step of `model` storing everything, measured per link (NOTE [
    Calibrating against a measured step ])."""
    model, functional, link_of = (
        source.graph.model,
        source.graph.root is not None,
        _link_of_layer(source),
    )
    with weights_restored(model), as_defined(model):
        twin = compiled_like(api, model, _twin(model, functional))
        layers = list(model._flatten_layers(include_self=False, recursive=True))
        with _named_by_index(layers):
            step, events, spec = traced_events(api, twin, *batch, warmup=1)
    link_of_op = _Scopes([link_of.get(id(layer), ()) for layer in layers], events).link
    kept = [0] * n
    for op, size in _forward_at_its_largest(events):
        link = link_of_op(op)
        if link is not None:
            kept[link] += size
    most = _most_held(events, link_of_op, n)
    record = replay.recorded(events, link_of_op)
    variables = [*twin.weights, *twin.optimizer.variables]
    smallest = counted_from(api, f"{spec.device_type}:{spec.device_index}")
    resident = replay.resident_bytes(variables, smallest)
    return _Measured(kept, most, step.peak_bytes, requested_peak(events), record, resident)


class _Calling(keras.Model):
    """A model that calls another: its train step runs the other's call, with an optimizer
    of its own."""

    def __init__(self, model: keras.Model) -> None:
        super().__init__(name=f"{model.name}_calibrating")
        self.called = model

    def call(self, inputs: Any, training: Any = None) -> Any:
        return self.called(inputs, training=training)


def _twin(model: keras.Model, functional: bool) -> keras.Model:
    """A model to compile and train as `model` trains, without touching its optimizer: a
    Functional model over its graph (the same output names for the loss), else one that
    calls it (a subclassed model, whose call cannot be rebuilt)."""
    return functional_twin(model) if functional else _Calling(model)


def _most_held(
    events: list[tuple[str, dict[str, Any]]], link_of_op: Callable[[str], int | None], n: int
) -> list[int]:
    """Per link, the most bytes its layers' ops (forward and gradient) held at once: what
    it keeps, less what its backward has released, plus its gradients and temporaries.
    A coarse link (a whole transformer layer) releases what it keeps as its backward
    runs, so its gradient ops' buffers alone would count its workspace twice."""
    live: dict[int, tuple[int, int]] = {}  # address -> (link, bytes)
    held, most = [0] * n, [0] * n
    for name, stats in events:
        address = int(stats.get("addr", 0))
        if name != "MemoryAllocation":
            if address in live:
                link, size = live.pop(address)
                held[link] -= size
            continue
        link = link_of_op(str(stats.get("tf_op", "")))
        if link is not None:
            size = int(stats.get("requested_bytes", 0))
            live[address] = (link, size)
            held[link] += size
            most[link] = max(most[link], held[link])
    return most


@contextlib.contextmanager
def _named_by_index(layers: list[Any]) -> Iterator[None]:
    """Names each layer `_TOKEN + index` while the step is traced, so that an op's name
    scopes say which layers made it."""
    names = [layer.name for layer in layers]
    try:
        for index, layer in enumerate(layers):
            layer.name = f"{_TOKEN}{index}"
        yield
    finally:
        for layer, name in zip(layers, names):
            layer.name = name


def _forward_at_its_largest(events: list[tuple[str, dict[str, Any]]]) -> list[tuple[str, int]]:
    """`(op, requested bytes)` of the buffers forward ops (all but `gradient_tape/` ones)
    allocated and still held at the moment those buffers were largest in total."""
    best, best_at = 0, 0
    for index, (_, total) in enumerate(_forward_live(events)):
        if total > best:
            best, best_at = total, index
    for index, (live, _) in enumerate(_forward_live(events)):
        if index == best_at:
            return list(live.values())
    return []


def _forward_live(
    events: list[tuple[str, dict[str, Any]]],
) -> Iterator[tuple[dict[int, tuple[str, int]], int]]:
    """After each event: the forward ops' live buffers by address, and their total."""
    live: dict[int, tuple[str, int]] = {}
    total = 0
    for name, stats in events:
        op, size = str(stats.get("tf_op", "")), int(stats.get("requested_bytes", 0))
        address = int(stats.get("addr", 0))
        if name == "MemoryAllocation":
            if "gradient_tape" not in op:
                live[address] = (op, size)
                total += size
        elif address in live:
            total -= live.pop(address)[1]
        yield live, total


class _Scopes:
    """Which link an op of the traced step belongs to, by its name scopes.

    Every layer is named `_TOKEN + index` while the step traces; an op
    belongs to the innermost such layer among its scopes. A layer called
    several times in one graph (in a loop, or shared) gets one scope per
    call, `<name>`, `<name>_1`, `<name>_3`, ..., numbered in call order but
    not by call (other scopes of the name take numbers in between): when the
    step shows as many distinct scopes of a layer as the chain has calls of
    it, the k-th lowest number is its k-th call; otherwise every scope of the
    layer counts as its first call.
    """

    def __init__(self, links: list[tuple[int, ...]], events: list[tuple[str, Any]]) -> None:
        self.links = links
        numbers: dict[int, set[int]] = {}
        for _, stats in events:
            for index, number in self._scopes(str(stats.get("tf_op", ""))):
                numbers.setdefault(index, set()).add(number)
        self.call_of = {
            (index, number): rank
            for index, seen in numbers.items()
            if len(seen) == len(links[index]) > 1
            for rank, number in enumerate(sorted(seen))
        }

    def _scopes(self, op: str) -> Iterator[tuple[int, int]]:
        """`(layer index, scope number)` of each chain layer's scope in `op`, outermost first."""
        for match in filter(None, map(_SCOPE.match, op.split("/"))):
            index = int(match.group(1))
            if index < len(self.links) and self.links[index]:
                yield index, int(match.group(2) or 0)

    def link(self, op: str) -> int | None:
        """The link of the innermost chain layer's call among `op`'s scopes, if any."""
        found = None
        for index, number in self._scopes(op):
            found = self.links[index][self.call_of.get((index, number), 0)]
        return found
