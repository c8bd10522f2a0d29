"""One path from a model to its checkpointed run, used by every entry point.

NOTE [ The pipeline ]
check the arguments (`check_options`, before anything runs) -> trace the
model at the sample's shapes (`tfrecompute.graph.trace.traced_graph`, which
builds an unbuilt model from the sample) -> price its calls
(`tfrecompute.costs.profile.profile_graph`) -> plan (`tfrecompute.strategies`)
-> apply (`apply_plan`, through `tfrecompute.rewrite.apply`) -> optionally
measure (`tfrecompute.check`). `plan`, `recompute` (every strategy, a
precomputed plan, `verify=True`), `verified_plan`, `max_batch_size` and the
command line all reach a chain through `chain_of` and a checkpointed model
through `apply_plan`, so a model that one entry point handles, all handle.

A chain is kept for as long as something else holds it (a `Plan` made on it,
a verified planner): `plan(model, ...)` then `recompute(model, ...)` with the
same sample profile the model once. The cache is keyed weakly by the model
and holds the chain weakly, so it keeps neither alive; its key is the input
signature and everything profiling reads of the model (its variables, their
`trainable` flags and dtypes, the optimizer it was compiled with).
"""

from __future__ import annotations

import json
import warnings
import weakref
from typing import Any

import keras
import numpy as np

from tfrecompute import strategies
from tfrecompute.costs.profile import COMPILED, ProfiledModel, profile_graph
from tfrecompute.graph.call_tree import sample_inputs
from tfrecompute.graph.expand import selection
from tfrecompute.graph.trace import batch_of, check_batch_size, check_model, traced_graph
from tfrecompute.layers.attention import attention_layers
from tfrecompute.layers.in_place import Checkpoints
from tfrecompute.layers.policy import planned_policies
from tfrecompute.rewrite.apply import apply, block_policies
from tfrecompute.strategies.headroom import check_headroom
from tfrecompute.strategies.units import check_budget

__all__ = [
    "BUDGET_POLICIES",
    "apply_plan",
    "budget_chain",
    "chain_of",
    "check_options",
    "left_as_it_was",
    "nothing_applied",
    "weighed_policy",
]

BUDGET_POLICIES = ("attention", "dots")
"""The policy states `optimal` weighs under a budget on a model with attention layers when
no `policy` is given (NOTE [ Policy states under a budget ])."""

_chains: weakref.WeakKeyDictionary[Any, dict[Any, weakref.ref[strategies.Chain]]] = (
    weakref.WeakKeyDictionary()
)
# Why an entry point left a model without checkpoints (NOTE [ Nothing applied, and why ]).
_notes: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def check_options(
    api: str,
    model: Any,
    *,
    budget: Any = None,
    headroom: Any = None,
    batch_size: Any = None,
    policy: Any = None,
    where: Any = None,
) -> None:
    """Refuses malformed arguments before any tracing: profiling a large model takes seconds."""
    check_model(api, model)
    if budget is not None:
        check_budget(budget, api=api, name="budget")
    if headroom is not None:
        check_headroom(api, headroom)
    check_batch_size(api, batch_size)
    planned_policies(api, policy)
    selection(api, where)


def weighed_policy(model: Any, policy: Any, strategy: Any, *, budgeted: bool) -> Any:
    """NOTE [ Policy states under a budget ]

    A keras-hub transformer layer is one call, so one link, and the plans of
    a stack of them step by a whole layer's activations: a budget between two
    steps goes unused (the held-out transformers' calibrated plans used 73%
    to 76% of their budget, the next plan up predicted at 101% to 105%).
    Under a budget, `optimal` (the default strategy) on a model holding
    attention layers therefore weighs `BUDGET_POLICIES` per segment when no
    `policy` is given: its attention cores recomputed, or all but its weight
    products, beside storing and recomputing whole. Those states fall
    between the whole-layer steps. They are priced by FLOPs, which
    under-price a `"dots"` recompute (NOTE [ Measured state times ] in
    `tfrecompute.costs.state_time`); on the functional encoder example the
    plan made with them measured 1.22x the CPU time of storing everything
    against 1.38x for whole segments at the same budget
    (docs/benchmarks.md, Examples). `policy="nothing"` plans whole
    segments only; a failure to price the states (not asked for) warns and
    plans whole segments (`budget_chain`). Without a budget, with another strategy, or on a model
    without attention layers, the given `policy` is used as it is. The
    plan's blocks get the states' policies when it is applied
    (`ProfiledModel.policies`).
    """
    if policy is not None or not budgeted:
        return policy
    if strategy is not strategies.optimal or not attention_layers([model]):
        return None
    return list(BUDGET_POLICIES)


def budget_chain(
    api: str,
    model: keras.Model,
    sample: Any,
    batch_size: Any,
    strategy: Any,
    *,
    depth: Any = None,
    where: Any = None,
    policy: Any = None,
    budgeted: bool,
) -> strategies.Chain:
    """`chain_of` with the policy states a budget weighs by default (`weighed_policy`).

    Those the user did not ask for are a refinement: if pricing them fails, one
    warning says why and the chain has whole segments only.
    """
    weighed = weighed_policy(model, policy, strategy, budgeted=budgeted)
    if weighed is policy:
        return chain_of(api, model, sample, batch_size, depth=depth, where=where, policy=policy)
    try:
        return chain_of(api, model, sample, batch_size, depth=depth, where=where, policy=weighed)
    except Exception as error:  # noqa: BLE001 (states not asked for: plan without them)
        warnings.warn(
            f"{api}: the attention and dots states a budget weighs on a model with attention "
            f"layers could not be priced ({type(error).__name__}: {error}); planning whole "
            "segments. Pass policy='nothing' to plan whole segments without trying them.",
            stacklevel=3,
        )
        return chain_of(api, model, sample, batch_size, depth=depth, where=where)


def chain_of(
    api: str,
    model: keras.Model,
    sample: Any,
    batch_size: Any,
    *,
    depth: Any = None,
    where: Any = None,
    policy: Any = None,
) -> strategies.Chain:
    """The model's cost chain at the sample's shapes (NOTE [ The pipeline ]): traced and
    priced once per model and input signature while the chain is in use. A policy that
    gives no state (None, "nothing") keys the same chain."""
    states = planned_policies(api, policy) or None
    key = _key(model, sample, batch_size, depth, where, states)
    known = _chains.get(model, {}).get(key) if key is not None else None
    chain = known() if known is not None else None
    if chain is not None:
        return chain
    graph = traced_graph(api, model, sample, batch_size, depth=depth, where=where)
    chain = profile_graph(graph, batch_of(graph), COMPILED, where=where, policy=policy, api=api)
    if key is not None:
        _chains.setdefault(model, {})[key] = weakref.ref(chain)
    return chain


def apply_plan(
    api: str,
    plan: strategies.Plan,
    policy: Any = None,
    *,
    to: ProfiledModel | None = None,
    note: str | None = None,
) -> Checkpoints | None:
    """Checkpoints the model `plan`'s chain was profiled from (or the model of `to`, whose
    chain has the same links), replacing what it had. A plan that stores everything
    leaves the model as it was, with `note` saying why (NOTE [ Nothing applied, and why ])."""
    source = plan.chain.source if to is None else to
    assert isinstance(source, ProfiledModel)  # plans of `chain_of` chains carry their calls
    segments = source.call_segments(plan.segments)
    applied = apply(source.graph, segments, plan=plan, policies=block_policies(api, plan, policy))
    left_as_it_was(source.graph.model, None if applied else (note or _stores_everything(api, plan)))
    return applied


def _stores_everything(api: str, plan: strategies.Plan) -> str:
    peak = strategies.format_size(plan.peak_bytes)
    return f"{api} applied plan {plan.strategy!r}, which stores everything (predicted {peak})"


def left_as_it_was(model: Any, note: str | None) -> None:
    """NOTE [ Nothing applied, and why ]

    An entry point that leaves a model without checkpoints (a plan that
    stores everything, `recompute(model, "none")`) records why, so that
    `tfrecompute.checkpoints(model)` says it instead of returning nothing;
    whatever applies checkpoints drops the note (`note=None`). Kept weakly by
    model: notes are text, they hold no model alive.
    """
    if note is None:
        _notes.pop(model, None)
    else:
        _notes[model] = note


def nothing_applied(model: Any) -> str:
    """Why `model` has no checkpoints (NOTE [ Nothing applied, and why ])."""
    try:
        note = _notes.get(model)
    except TypeError:  # not a model (no weak reference to it)
        note = None
    return note or (
        "no tfrecompute entry point checkpointed this model (one loaded from a file is the "
        "model without checkpointing): call tfrecompute.recompute(model, ...)"
    )


def _key(model: Any, sample: Any, batch_size: Any, *options: Any) -> Any:
    """What a chain depends on, as a hashable value; None when the model is not built
    (tracing builds it) or an option cannot be keyed."""
    if not getattr(model, "built", False):
        return None
    try:
        shapes = repr(
            keras.tree.map_structure(
                lambda a: (np.shape(a), str(getattr(a, "dtype", type(a).__name__))),
                sample_inputs(sample),
            )
        )
        weights = tuple(
            (v.path, bool(v.trainable), str(v.dtype), tuple(v.shape)) for v in model.weights
        )
        optimizer = getattr(model, "optimizer", None)
        compiled = None
        if optimizer is not None:
            config = json.dumps(optimizer.get_config(), sort_keys=True, default=str)
            compiled = (type(optimizer).__qualname__, config)
        keyed = tuple(_option_key(option) for option in options)
        key = (shapes, batch_size, weights, compiled, keyed)
        hash(key)
    except Exception:  # noqa: BLE001 - an unusual sample or option: profile without the cache
        return None
    return key


def _option_key(option: Any) -> Any:
    """An option as a value that names it for good: names, numbers and classes, or lists of
    them. A function or any other object raises (its id could name another one later)."""
    if option is None or isinstance(option, (str, int, float, type)):
        return option
    if isinstance(option, (list, tuple)):
        return tuple(_option_key(each) for each in option)
    raise TypeError(f"not keyed: {option!r}")
