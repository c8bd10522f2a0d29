"""Checkpoint whole models: `plan` and `recompute` (orchestration only).

`plan` profiles the model (`tfrecompute.costs.profile`) and runs a strategy on its
chain; `recompute` applies a plan (`tfrecompute.rewrite.apply`). A plan made by
`plan` or on a chain from `profile` knows the model's calls through its
chain's `source`, so `recompute(model, plan)` does not profile again.
"""

from __future__ import annotations

import math
import warnings
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import keras

from tfrecompute import strategies
from tfrecompute._messages import as_bool, fail
from tfrecompute.check.calibrate import calibrated
from tfrecompute.check.twin import check_compiled, labelled
from tfrecompute.check.verified_plan import VerifiedPlan, planner
from tfrecompute.check.verified_plan import verify as verify_plan
from tfrecompute.costs.profile import ProfiledModel, profiled_model
from tfrecompute.errors import UntraceableModelError
from tfrecompute.graph.trace import check_batch_size, check_model
from tfrecompute.layers.attention import attention_layers, checkpoint_attention
from tfrecompute.layers.in_place import Checkpoints, record, remove
from tfrecompute.layers.in_place import checkpoints as applied_checkpoints
from tfrecompute.pipeline import (
    apply_plan,
    budget_chain,
    chain_of,
    check_options,
    left_as_it_was,
    nothing_applied,
)
from tfrecompute.strategies.headroom import headroom_of
from tfrecompute.strategies.plan import chain_budget
from tfrecompute.strategies.units import format_budget

__all__ = ["checkpoints", "plan", "recompute"]

StrategyLike = str | Callable[..., strategies.Plan] | strategies.Plan


class _Resolved(NamedTuple):
    """A plan to apply, the profile of the model's calls it refers to, and the warning
    already given about it storing everything (None if none was)."""

    plan: strategies.Plan
    profiled: ProfiledModel
    said: str | None = None


def _resolve_plan(
    api: str, model: keras.Model, strategy: Any, options: dict[str, Any]
) -> _Resolved:
    """The plan to apply, and the profile of the model's calls it refers to."""
    budget, batch_size, sample = options["budget"], options["batch_size"], options["sample"]
    if budget is not None and batch_size is None and sample is None:
        check_batch_size(api, None, required_for="a memory budget")
    if isinstance(strategy, strategies.Plan):
        for name in ("budget", "headroom", "where", "depth", "calibrate"):
            if options[name] is not None:
                fail(
                    api,
                    f"a Plan already fixes the segments, so a {name} has no effect",
                    name,
                    options[name],
                    "Pass either a Plan or a strategy name with a budget",
                )
        return _Resolved(strategy, _profile_of_plan(api, model, strategy, sample, batch_size))
    chosen = (
        _default_strategy(options["where"])
        if strategy is None
        else strategies.get(strategy, api=api, argument="strategy")
    )
    if options["calibrate"]:  # a measured step needs labels and the model's train step
        labelled(api, sample)
        check_compiled(api, model)
    # Without a batch size or a sample the bytes are those of one sample: the
    # proportions, which is all a budget-free strategy needs.
    chain = budget_chain(
        api,
        model,
        sample,
        batch_size,
        strategies.optimal if strategy is None else chosen,  # where= wraps the default
        depth=options["depth"],
        where=options["where"],
        policy=options["policy"],
        budgeted=budget is not None,
    )
    if options["calibrate"]:
        chain = calibrated(api, chain, sample)
    _warn_of_xla(api, model)
    made = strategies.plan_within(api, chosen, chain, budget, options["headroom"])
    alone = strategy is None and budget is None and options["where"] is None
    made, said = _worth_its_recompute(
        api,
        made,
        named=strategy is not None,
        budgeted=budget is not None,
        fall_back=alone,
        selected=options["where"] is not None,
    )
    profiled = profiled_model(made.chain, model)
    assert profiled is not None  # strategies plan the chain they are given
    return _Resolved(made, profiled, said)


_warned_of_xla: weakref.WeakSet[Any] = weakref.WeakSet()


def _warn_of_xla(api: str, model: Any) -> None:
    """NOTE [ Plans for a step XLA compiles ]

    Compiled with `jit_compile=True`, a model's training step is one XLA
    computation, whose buffers XLA assigns itself: the predicted peaks,
    read from TensorFlow's ops, do not see them. The held-out benchmark's
    CNN compiled so measured 3.6x its predicted peak
    (`benchmarks/results/held_out.md`: 256.0 against 72.1 MiB). A plan is
    still made (XLA keeps the recompute, and blocks still save memory
    there), with a warning once per model; `verify=True` measures the
    compiled step instead. Keras's default `jit_compile="auto"` resolves to
    True on a machine with a GPU and no distribution strategy, for models
    XLA supports (`Trainer._resolve_auto_jit_compile`); on CPU to False.
    """
    if getattr(model, "jit_compile", False) is not True or model in _warned_of_xla:
        return
    _warned_of_xla.add(model)
    warnings.warn(
        f"{api}: model {model.name!r} is compiled with jit_compile=True: XLA places the "
        "buffers of its training step itself, and the predicted peaks do not see them (a CNN "
        "compiled so measured 3.6x its predicted peak). Received: model.jit_compile=True (of "
        "type bool; Keras's default jit_compile='auto' is True on a single GPU). Measure the "
        "plan with verify=True and a budget, or compile with jit_compile=False to plan from "
        "predictions.",
        stacklevel=4,
    )


def _check_before_profiling(api: str, model: Any, options: dict[str, Any]) -> None:
    """Refuses malformed options before any tracing (NOTE [ The pipeline ])."""
    names = ("budget", "headroom", "batch_size", "policy", "where")
    check_options(api, model, **{name: options[name] for name in names})


def _verified(api: str, model: keras.Model, strategy: Any, options: dict[str, Any]) -> VerifiedPlan:
    """`recompute(..., verify=True)`: a plan measured to fit the budget."""
    if options["budget"] is None or isinstance(strategy, strategies.Plan):
        fail(
            api,
            "verify=True measures a plan made for a budget, so it needs a budget and a "
            "strategy, not a Plan",
            "budget",
            options["budget"],
            'Pass budget= (e.g. budget="1GiB") and a strategy name, or verify=False',
        )
    if options["calibrate"]:
        fail(
            api,
            "verify=True measures the checkpointed model's own step, so there is nothing to "
            "calibrate",
            "calibrate",
            True,
            "Pass verify=True or calibrate=True, not both",
        )
    if options["headroom"] is not None:
        fail(
            api,
            "verify=True takes its headroom from the measured step",
            "headroom",
            options["headroom"],
            "Leave headroom=None, or pass verify=False",
        )
    made = planner(
        api,
        model,
        options["sample"],
        strategy or _default_strategy(options["where"]),
        depth=options["depth"],
        where=options["where"],
        policy=options["policy"],
    )
    return verify_plan(made, options["budget"])


def _default_strategy(where: Any) -> strategies.Strategy:
    """NOTE [ The default strategy ]

    `optimal`: under a budget the least recompute that fits it, without one
    the least peak any plan reaches, at the least recompute for that peak:
    never a plan that another beats on both. With `where` and no budget,
    every selected call recomputed, one block each (`uniform(1)` within
    `Chain.max_stop`), as `apply_activation_checkpointing` does; with a
    budget, `optimal` chooses among the selected calls.
    """
    optimal = strategies.optimal
    if where is None:
        return optimal

    def selected(chain: strategies.Chain, budget: Any = None) -> strategies.Plan:
        if budget is not None:
            return optimal(chain, budget)
        return strategies.uniform(1)(chain)

    return selected


MIN_SAVING = 0.1
"""The least predicted saving the default strategy recomputes for (NOTE [ A plan worth its
recompute ])."""


def _worth_its_recompute(
    api: str,
    plan: strategies.Plan,
    *,
    named: bool,
    budgeted: bool,
    fall_back: bool,
    selected: bool = False,
) -> tuple[strategies.Plan, str | None]:
    """NOTE [ A plan worth its recompute ]

    A plan is returned with a warning when its predicted peak is not below
    storing everything, or below it by less than `MIN_SAVING`: measured
    peaks of one step vary by about that much from run to run and with the
    order updates run in (the same ResNet50 plan measured 10% apart in one
    process, benchmarks/results/prediction_accuracy.md; the same
    storing-everything step of ResNet50V2 on 32x32 images at batch 2 under
    Adam 4% apart in two fresh processes, and its `sqrt` plan at 1.67x,
    benchmarks/results/any_model.md). The
    default strategy without a budget or `where=` (`fall_back`) then stores
    everything instead: no recompute for a saving the measurement may not
    show. Under a budget the plan is what fits it, and is kept silently
    when it saves something (`verify=True` measures it). A named strategy
    (`sqrt`, `uniform`) cuts by link count, not by bytes, so on a short
    chain of wide layers its segments can hold the largest activations
    anyway; its plan is kept, with the warning. Returned with the plan: the
    warning given when the plan stores everything (`recompute` then says
    nothing more), else None.
    """
    chain = plan.chain
    stored = strategies.none(chain).peak_bytes
    thin = stored - plan.peak_bytes < MIN_SAVING * stored
    if not thin or (named and not plan.segments):
        return plan, None
    least = strategies.min_peak(chain)
    said = None
    if named:
        _warn_named(api, plan, stored, least)
    elif least >= stored:
        said = (
            f"{api}: no plan lowers this model's predicted peak below storing everything "
            f"({strategies.format_size(stored)}), so nothing is recomputed. "
            f"{_largest_link(chain, selected, alone=True)}, or leave the model as it is."
        )
    elif plan.segments and not budgeted:
        saving = 1 - plan.peak_bytes / stored
        kept = "nothing is recomputed" if fall_back else "its plan recomputes anyway"
        if sum(chain.saved_bytes) < stored / 2:
            why = (
                "Most of this step is weights, their gradients and the optimizer's updates, "
                "not activations: a larger batch leaves more to save"
            )
        else:
            why = _largest_link(chain, selected)
        said = (
            f"{api}: the least peak a plan reaches, {strategies.format_size(plan.peak_bytes)}, "
            f"is only {saving:.0%} below storing everything "
            f"({strategies.format_size(stored)}), less than measured peaks vary "
            f"({MIN_SAVING:.0%}), so {kept}. {why}. Pass budget= to plan to a budget anyway, "
            f"e.g. {_share_hint(chain, stored)}."
        )
        if fall_back:
            plan = strategies.none(chain)
    if said is not None:
        warnings.warn(said, stacklevel=4)
    return plan, (said if not plan.segments else None)


def _largest_link(chain: strategies.Chain, selected: bool, *, alone: bool = False) -> str:
    """Which link keeps the most activations, and how to look into it (`alone`: no plan
    recomputes it with a lower peak)."""
    largest = max(range(chain.n), key=lambda i: chain.saved_bytes[i])
    share = chain.saved_bytes[largest] / max(sum(chain.saved_bytes), 1)
    look = (
        "add it, or its sub-layers, to where=" if selected
        else "look into it with depth= (or where= to pick its sub-layers)"
    )  # fmt: skip
    cannot = " and cannot be split or recomputed here" if alone else ""
    return (
        f"Link {chain.names[largest]!r} keeps {share:.0%} of the saved activations{cannot}: {look}"
    )


def _warn_named(api: str, plan: strategies.Plan, stored: int, least: int) -> None:
    """The warning of a named strategy's plan that saves nothing, or too little."""
    chain = plan.chain
    if least < (1 - MIN_SAVING) * stored:
        fix = (
            f"Drop the strategy name: the default strategy predicts {strategies.format_size(least)}"
        )
    else:
        fix = (
            f"No plan predicts {MIN_SAVING:.0%} less" if least < stored else "No plan predicts less"
        ) + " for this model: leave it as it is (strategy='none')"
    if plan.peak_bytes >= stored:
        where, saves = "not below", "and saves no memory"
    else:
        where = f"only {1 - plan.peak_bytes / stored:.0%} below"
        saves = f"for less than measured peaks vary ({MIN_SAVING:.0%})"
    warnings.warn(
        f"{api}: plan {plan.strategy!r} predicts a peak of "
        f"{strategies.format_size(plan.peak_bytes)}, {where} storing everything "
        f"({strategies.format_size(stored)}): it recomputes "
        f"{plan.recompute_cost / max(chain.total_forward_cost, 1e-30):.0%} of a forward "
        f"pass {saves}. {fix}.",
        stacklevel=5,
    )


def _attention_only(api: str, model: keras.Model) -> keras.Model:
    """`recompute(model, policy="attention")`: the attention cores, nothing else."""
    check_model(api, model)
    found = attention_layers([model])
    if not found:
        fail(
            api,
            "policy='attention' found no attention layer in the model (a layer with a "
            "`_compute_attention` method, or with projection layers and a class name saying "
            "attention), so it would checkpoint nothing",
            "model",
            model,
            "Use it on models with keras.layers.MultiHeadAttention or keras-hub attention "
            "layers, checkpoint a custom core with tfrecompute.checkpoint, or use another policy",
        )
    remove(model)
    blocks = tuple(checkpoint_attention(layer) for layer in found)
    record(model, Checkpoints(None, None, blocks, tuple(found)))
    left_as_it_was(model, None)
    return model


def _profile_of_plan(
    api: str, model: keras.Model, plan: strategies.Plan, sample: Any, batch_size: Any
) -> ProfiledModel:
    """Which calls of `model` the links of `plan` are; profiles only a plan made elsewhere.

    A plan on a chain `profile` made for this model carries the map. A plan on
    any other chain (built by hand, or profiled from another model object)
    applies if this model's chain has the same link names.
    """
    known = profiled_model(plan.chain, model)
    if known is not None:
        return known
    source = plan.chain.source
    if (
        sample is None
        and batch_size is None
        and isinstance(source, ProfiledModel)
        and source.graph.specs is not None
    ):
        sample = (source.graph.specs, None)  # the shapes the plan was made at
    chain = chain_of(api, model, sample, batch_size)
    if plan.chain.names != chain.names:
        ours, theirs = plan.chain.names, chain.names
        first = next(
            (i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs))
        )
        differs = (
            f"link {first} is {ours[first]!r} in the plan and "
            f"{theirs[first] if first < len(theirs) else 'missing'!r} in this model"
            if first < len(ours)
            else f"this model has {len(theirs) - first} more links ({theirs[first]!r} ...)"
        )
        fail(
            api,
            f"the plan was made for another model: its chain has {plan.chain.n} links, "
            f"this model's {chain.n}, and {differs}",
            "strategy",
            plan,
            "Make the plan with tfrecompute.plan(model, ...) for this model",
        )
    profiled = profiled_model(chain, model)
    assert profiled is not None
    return profiled


_SHARED_ARGS = """
        strategy: a strategy name (see `tfrecompute.strategies.available()`), a
            strategy callable `(chain, budget=None) -> Plan`, or a `Plan` made
            by `tfrecompute.plan` for this model. By default (None) `optimal`
            (NOTE [ The default strategy ]): the least recompute under a
            budget, else the least peak at the least recompute; with `where`
            and no budget, every selected call its own block.
        budget: the most memory the step may use, as the allocator counts it
            (`measure_step`), in bytes or as a string like `"2GiB"`, or as a
            share of the predicted peak of storing everything: `0.5` (or
            `"50%"`) plans to half of it, in bytes once the model is profiled
            (NOTE [ A budget as a share of storing everything ] in
            `tfrecompute.strategies.units`); needs `batch_size` or `sample`.
        batch_size: the training batch size; by default the sample's.
        sample: one batch as the model is called with (an array, a list or
            dict of arrays, or `(x, y)` as passed to `fit`): fixes unknown
            input dimensions (keras-hub backbones take `(None, None)` token
            ids) and is needed for a subclassed model. Only shapes and
            dtypes are read.
        headroom: the share of `budget` left for the allocator's rounding of
            chunks: the predicted peak stays under `budget * (1 - headroom)`
            (default `strategies.DEFAULT_HEADROOM`, 0.3; 0.1 calibrated,
            `strategies.CALIBRATED_HEADROOM`; and 0 for a share
            of storing everything; 0 plans to the budget itself). Only with
            a budget.
        depth: how many levels of nested calls to look into below the
            model's own (None: as deep as they can be checkpointed; 0: the
            model's own calls only).
        where: make only the calls of these layers blocks, one block each: a
            layer class, a tuple of classes, a list of layer names, or a
            predicate `(layer) -> bool` (layers holding them are looked into).
        calibrate: reconcile the predicted memory with one measured training
            step storing everything before planning (NOTE [ Calibrating
            against a measured step ] in `tfrecompute.check.calibrate`):
            links keeping more than their traced calls show get the measured
            bytes, and what the step holds beyond the links is added to every
            moment. Needs a compiled Functional or Sequential model and
            `sample=(x, y)`; the step runs on a twin with a fresh optimizer,
            and the weights are restored. The plan's summary says whether its
            memory was calibrated. Default False: predicted from the traced
            calls only (quicker).
"""


def plan(
    model: keras.Model,
    strategy: StrategyLike | None = None,
    *,
    budget: int | float | str | None = None,
    batch_size: int | None = None,
    sample: Any = None,
    headroom: float | None = None,
    depth: int | None = None,
    where: Any = None,
    policy: Any = None,
    calibrate: bool = False,
) -> strategies.Plan:
    """Plans which calls of a model to recompute, without changing the model.

    Args:
        model: a built Keras model: Sequential, Functional or subclassed.{shared}
        policy: a recompute policy to plan with (see `RecomputeBlock`): links
            get a third state, recomputed under it, which `optimal` weighs
            against storing and recomputing whole (`Plan.selective`; other
            strategies plan two states). A list (e.g. `["attention",
            "dots"]`) gives `optimal` one state per policy to choose from
            per segment. None: with a budget, `optimal` on a model holding
            attention layers weighs `["attention", "dots"]` (NOTE [ Policy
            states under a budget ] in `tfrecompute.pipeline`), else
            segments are recomputed whole; "nothing": whole segments only.
            `recompute(model, plan)` applies the plan with its policies.
    Returns:
        The `Plan`; `plan.summary()` names the calls of each segment and gives
        the predicted peak and recompute cost. `recompute(model, plan)`
        applies it without profiling the model again.

    Example:

    ```python
    p = tfrecompute.plan(model, budget="1GiB", batch_size=64)
    print(p.summary())
    ```
    """
    options = {
        "budget": budget,
        "batch_size": batch_size,
        "sample": sample,
        "headroom": headroom,
        "depth": depth,
        "where": where,
        "policy": policy,
        "calibrate": as_bool("plan", "calibrate", calibrate) or None,
    }
    _check_before_profiling("plan", model, options)
    return _resolve_plan("plan", model, strategy, options).plan


def recompute(
    model: keras.Model,
    strategy: StrategyLike | None = None,
    *,
    budget: int | float | str | None = None,
    batch_size: int | None = None,
    sample: Any = None,
    headroom: float | None = None,
    depth: int | None = None,
    where: Any = None,
    policy: Any = None,
    verify: bool = False,
    calibrate: bool = False,
) -> keras.Model:
    """Checkpoints `model` itself: the plan's calls are recomputed in backprop.

    Checkpointing changes how the model runs, never what it is (NOTE [ A
    checkpointed model is the model ] in `tfrecompute/layers/in_place.py`):
    the same model object comes back, with its layers, variables, weight
    paths and config; `model.save`, `save_weights`, `tf.train.Checkpoint`,
    `model.export` and every callback see the model as it was, and weights
    move between it and the same model without checkpointing. How it runs:

    * calls of a Sequential or Functional graph (nested Functional models
      included, inlined; a keras-hub task's backbone): the model's call runs
      a rebuilt model that shares its layers, each segment a
      `RecomputeBlock` around a Functional sub-model of its calls (a list of
      layers in a Sequential); tensors that only pass by a segment (long
      skip connections) go around its block. A keras-hub task stays the
      task (`generate`, `score`, `backbone`, `enable_lora`).
    * calls made by a subclassed layer's or model's code (the blocks of
      keras-hub's `ViTEncoder`, a subclassed model's layers): checkpointed
      where they are made, one call at a time. This changes those layer
      objects wherever else they are used.

    Calling `recompute` again replaces what the previous call applied;
    `recompute(model, "none")` turns checkpointing off, and
    `tfrecompute.checkpoints(model)` tells what is applied (the plan and
    its blocks), or why nothing is. When the plan stores everything (the
    budget holds the predicted peak of storing everything, or no plan
    saves enough), the model is left without checkpoints and a warning
    line says why and what would change it (NOTE [ A model left storing
    everything says so ]). A model loaded from a file is the model without
    checkpointing: call `recompute` on it again (with the same plan, or the
    same arguments). `fit`, `evaluate` and `predict` trace the model's call
    again after each change.

    Args:
        model: a built Keras model: Sequential, Functional or subclassed.{shared}
        policy: the recompute policy of the blocks (see `RecomputeBlock`):
            "nothing" (recompute all), "dots" (keep the products with a
            weight), or a function of a `tfrecompute.layers.OpInfo`; None
            recomputes all, except that with a budget `optimal` on a model
            holding attention layers weighs `["attention", "dots"]` (NOTE
            [ Policy states under a budget ] in `tfrecompute.pipeline`). With
            `optimal` (the default) the planner weighs it per segment against
            recomputing whole (`Plan.selective`); with any other strategy
            every block gets it. "attention" alone (no strategy, budget,
            sample or plan): checkpoint exactly the attention core (scores,
            mask, softmax, dropout, weighted sum) of every attention layer
            and nothing else (Megatron-LM's selective recompute; NOTE
            [ Attention core recompute ]), `checkpoints(model).plan` is None;
            with a strategy or budget, "attention" is the third state: a
            selective segment keeps everything but its attention cores. A
            list of policies (e.g. `["attention", "dots"]`): `optimal`
            chooses per segment among all of them, storing and recomputing
            whole.
        verify: measure the plan instead of trusting a fixed headroom: with a
            `budget` and a labelled `sample=(x, y)`, run the compiled train
            step of the checkpointed model (`model` must be compiled), read
            the allocator's peak and re-plan until the measured step fits
            the budget and uses most of it (`tfrecompute.verified_plan`),
            with the policy if one is given.
    Returns:
        `model` itself, checkpointed.

    Example:

    ```python
    tfrecompute.recompute(model, budget="1GiB", batch_size=64)
    model.compile(optimizer="adam", loss="mse")
    model.fit(x, y, batch_size=64)
    model.save("model.keras")  # the model as defined: no blocks in the file
    backbone = tfrecompute.recompute(keras_hub.models.BertBackbone(...), sample=batch)
    ```
    """
    options = {
        "budget": budget,
        "batch_size": batch_size,
        "sample": sample,
        "headroom": headroom,
        "depth": depth,
        "where": where,
        "policy": policy,
        "calibrate": as_bool("recompute", "calibrate", calibrate) or None,
    }
    _check_before_profiling("recompute", model, options)
    alone = [value for name, value in options.items() if name != "policy" and value is not None]
    if policy == "attention" and strategy is None and not alone and not verify:
        return _attention_only("recompute", model)
    if strategy == "none" and all(value is None for value in options.values()) and not verify:
        check_model("recompute", model)
        remove(model)  # storing everything: nothing to plan
        left_as_it_was(model, "recompute(model, 'none') turned checkpointing off")
        return model
    if as_bool("recompute", "verify", verify):
        verified = _verified("recompute", model, strategy, options)
        if not verified.plan.segments:
            note = _say_stored("recompute", verified.plan, strategy, options, measured=verified)
            left_as_it_was(model, note)
        return model
    try:
        resolved = _resolve_plan("recompute", model, strategy, options)
    except UntraceableModelError as error:
        if budget is not None:  # a budget the model would not be held to
            raise
        _say_untraceable(model, error)
        return model
    note = resolved.said
    if note is None and not resolved.plan.segments:
        note = _say_stored("recompute", resolved.plan, strategy, options)
    apply_plan("recompute", resolved.plan, policy, to=resolved.profiled, note=note)
    return model


def _say_untraceable(model: keras.Model, error: UntraceableModelError) -> None:
    """NOTE [ A model whose call cannot be traced ]

    tfrecompute finds a model's calls by tracing its call in training mode in
    a `tf.function`, as `model.fit` compiles it. Some models cannot be (keras-hub's
    MoE routers' auxiliary loss and D-FINE's position embeddings under
    `mixed_float16`, a scheduler that branches in Python on a tensor). A call
    that stops this trace stops `fit`'s compiled step as well (the test of a
    Python branch on a tensor's value checks `fit` fails on it).
    `recompute` without a budget leaves such a model as it was, with one
    warning that says why, and `checkpoints(model)` tells the same; with a
    budget (which the model would not be held to), `plan` or
    `verify=True`, the `UntraceableModelError` is raised.
    """
    reason = str(error).split(": ", 1)[-1]
    note = f"nothing is recomputed, so the model stores everything as it was: {reason}"
    left_as_it_was(model, note)
    warnings.warn(f"recompute: {note}", stacklevel=3)


def _say_stored(
    api: str,
    plan: strategies.Plan,
    strategy: Any,
    options: dict[str, Any],
    *,
    measured: VerifiedPlan | None = None,
) -> str:
    """NOTE [ A model left storing everything says so ]

    When `recompute` leaves a model storing every activation, one warning
    line says so, why, and what would change it, unless the user asked for
    it (`strategy="none"`, or a Plan of it) or a warning of the plan already
    said so; `checkpoints(model)` then tells the same. Returns the line.
    """
    if plan.strategy == "none":  # asked for: the user knows
        return "strategy 'none' stores everything, as asked"
    stored = strategies.none(plan.chain).peak_bytes
    fmt = strategies.format_size
    budget, headroom = options["budget"], options["headroom"]
    if measured is not None:
        why = (
            f"the measured step of plan {plan.strategy!r}, {fmt(measured.peak_bytes)}, fits the "
            f"budget {format_budget(budget, measured.budget_bytes)}"
        )
        fix = f"Pass a lower budget to save memory, e.g. {_share_hint(plan.chain, stored)}"
    elif budget is not None:
        total = chain_budget(api, plan.chain, budget)
        share = headroom_of(api, budget, headroom, plan.chain)
        why = (
            f"the budget {format_budget(budget, total)}, less {float(share):.0%} headroom, holds "
            f"the predicted peak of storing everything, {fmt(stored)}"
        )
        below = fmt(math.ceil(stored / (1 - share)))  # the least that stores everything
        fix = (
            f"To save memory pass a budget below {below}, e.g. "
            f"{_share_hint(plan.chain, stored)}, or strategy='sqrt' to recompute without a budget"
        )
    else:
        given = "the plan passed" if isinstance(strategy, strategies.Plan) else "strategy"
        why = (
            f"{given} {plan.strategy!r} recomputes no segment of this model's {plan.chain.n} links"
        )
        fix = (
            f"Pass a budget below the predicted peak of storing everything, {fmt(stored)}, e.g. "
            f"{_share_hint(plan.chain, stored)}, or depth= to look into nested layers"
        )
    note = f"nothing is recomputed, so the model stores everything: {why}. {fix}."
    warnings.warn(f"{api}: {note}", stacklevel=3)
    return note


def _share_hint(chain: strategies.Chain, stored: int) -> str:
    """A share of storing everything a plan can meet: halfway from the least peak any plan
    reaches to storing everything, e.g. `budget=0.87 (the least peak is 73% of it)`."""
    least = strategies.min_peak(chain) / max(stored, 1)
    share = min(math.ceil((least + 1) / 2 * 100) / 100, 1.0)
    return f"budget={share:g} (the least peak a plan reaches is {least:.0%} of storing everything)"


def checkpoints(model: Any) -> Checkpoints:
    """What tfrecompute applied to `model` and is in force, or why nothing is.

    `recompute`, `verified_plan` and `max_batch_size` checkpoint a model in
    place; this tells what they applied: the plan, its blocks, the layers
    whose call changed. A model they left storing everything, one never
    checkpointed, and one loaded from a file get a record of nothing applied
    (`applied` False, `bool(record)` False, `plan` None) whose `note` and
    `summary()` say why.

    Args:
        model: a Keras model.

    Returns:
        A `Checkpoints`.

    Example:

    ```python
    tfrecompute.recompute(model, budget=0.5, batch_size=64)
    print(tfrecompute.checkpoints(model).summary())
    ```
    """
    applied = applied_checkpoints(model)
    if applied is not None:
        return applied
    return Checkpoints(None, None, (), (), note=nothing_applied(model))


plan.__doc__ = (plan.__doc__ or "").replace("{shared}", _SHARED_ARGS.rstrip() + "\n")
recompute.__doc__ = (recompute.__doc__ or "").replace("{shared}", _SHARED_ARGS.rstrip() + "\n")
