"""recompute(model, ..., policy=...): the blocks it builds keep what the policy says."""

from __future__ import annotations

import dataclasses

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfrecompute
from tests import any_models, models_zoo
from tests.helpers import MODES, applied_blocks, as_defined, assert_same_training
from tests.test_errors import CONVENTION, _own_message
from tests.whole_model.test_recompute import _same_training
from tfrecompute import strategies
from tfrecompute.layers.in_place import checkpointed_in_place
from tfrecompute.pipeline import weighed_policy
from tfrecompute.rewrite.apply import block_policies

_blocks = applied_blocks


@pytest.mark.parametrize("mode", MODES)
def test_a_sequential_rewrite_gives_every_block_the_policy(mode):
    model = models_zoo.tanh_mlp(depth=6, width=16)
    tfrecompute.recompute(model, "sqrt", policy="dots")
    blocks = _blocks(model)
    assert len(blocks) >= 2 and all(b.policy == "dots" for b in blocks)
    x = tf.constant(np.random.default_rng(0).normal(size=(4, 16)).astype("float32"))
    _same_training(model, [x], mode)


@pytest.mark.parametrize("mode", MODES)
def test_a_functional_encoder_rewrite_under_dots_trains_as_the_original(mode):
    keras.utils.set_random_seed(0)
    model = models_zoo.transformer_encoder(layers=2, sequence=8, hidden=16, heads=2)
    tfrecompute.recompute(model, "uniform:4", policy="dots")
    blocks = _blocks(model)
    assert blocks and all(b.policy == "dots" for b in blocks)
    ids = tf.constant(np.random.default_rng(0).integers(0, 100, (2, 8)).astype("int32"))
    _same_training(model, [ids], mode)


def test_in_place_checkpoints_get_the_policy():
    model, (ids, _) = any_models.loop_transformer(layers=2, hidden=16, sequence=8, batch=2)
    tfrecompute.recompute(model, "uniform:1", sample=ids, policy="dots")
    placed = _blocks(model)
    assert placed and all(b.policy == "dots" for b in placed)
    assert all(checkpointed_in_place(b.inner[0]) for b in placed)


def test_a_malformed_policy_is_rejected_before_planning():
    model = models_zoo.tanh_mlp(depth=2, width=8)
    with pytest.raises(ValueError, match=r"^recompute: unknown recompute policy") as info:
        tfrecompute.recompute(model, "sqrt", policy="everything")
    assert CONVENTION.match(_own_message(info.value))


def test_profile_with_a_policy_measures_the_kept_products():
    keras.utils.set_random_seed(0)
    model = models_zoo.transformer_encoder(layers=1, sequence=8, hidden=16, heads=2)
    chain = tfrecompute.profile(model, batch_size=4, policy="dots")
    plain = tfrecompute.profile(model, batch_size=4)
    assert plain.policy_kept_bytes is None and chain.has_policy
    kept = dict(zip(chain.names, chain.policy_kept_bytes))
    cost = dict(zip(chain.names, chain.policy_forward_cost))
    attention = next(name for name in chain.names if "multi_head_attention" in name)
    dense = next(name for name in chain.names if name.startswith("dense") and "+" not in name)
    # q, k, v and the output projection: four (4, 8, 16) float32 products.
    assert kept[attention] == 4 * 4 * 8 * 16 * 4
    assert kept[dense] in (4 * 8 * 64 * 4, 4 * 8 * 16 * 4)
    # Links without a weight product keep nothing and cost their whole forward. The
    # Dropouts are merged into links with a product (e.g. "dense_1+dropout_2+add_1"),
    # so the links checked are the others: the embedding (a gather), the normalizations
    # and the pooling.
    products = ("dense", "multi_head_attention")
    weightless = [
        name
        for name in chain.names
        if not any(part.startswith(products) for part in name.split("+"))
    ]
    assert len(weightless) >= 3, chain.names
    for name, forward in zip(chain.names, chain.forward_cost):
        if name in weightless:
            assert kept[name] == 0 and cost[name] == forward, name
    assert cost[attention] < dict(zip(chain.names, chain.forward_cost))[attention]


def test_recompute_applies_the_plans_selective_segments():
    keras.utils.set_random_seed(0)
    model = models_zoo.transformer_encoder(layers=2, sequence=32, hidden=16, heads=2)
    chain = tfrecompute.profile(model, batch_size=8, policy="dots")
    chosen = next(p for p in tfrecompute.strategies.frontier(chain) if any(p.selective))
    tfrecompute.recompute(model, chosen, policy="dots")
    policies = [b.policy for b in _blocks(model)]
    assert policies == ["dots" if s else None for s in chosen.selective]
    assert "selective" in chosen.summary()
    ids = tf.constant(np.random.default_rng(0).integers(0, 100, (2, 32)).astype("int32"))
    _same_training(model, [ids], "function")


def test_a_plan_weighing_policies_is_applied_with_the_policies_it_was_made_with():
    keras.utils.set_random_seed(0)
    model = models_zoo.transformer_encoder(layers=2, sequence=32, hidden=16, heads=2)
    chain = tfrecompute.profile(model, batch_size=8, policy=["attention", "dots"])
    chosen = next(p for p in tfrecompute.strategies.frontier(chain) if 2 in p.selective)
    tfrecompute.recompute(model, chosen)  # no policy: the chain's own, by state
    names = {0: None, 1: "attention", 2: "dots"}
    assert [b.policy for b in _blocks(model)] == [names[s] for s in chosen.selective]
    # A chain built by hand records no policy: the plan cannot say which to run.
    bare = strategies.Chain(
        1, [1] * 2, [4] * 2, [2.0] * 2, policy_kept_bytes=[1, 1], policy_forward_cost=[1.0] * 2
    )
    plan = strategies.Plan.from_segments(bare, [(0, 2)], selective=[1])
    with pytest.raises(ValueError, match="no policy is given") as info:
        block_policies("recompute", plan, None)
    assert CONVENTION.match(_own_message(info.value))


@pytest.mark.parametrize("policy", ["dots", "attention"])
def test_the_command_line_plans_with_a_policy(policy, tmp_path, capsys):
    from tfrecompute.cli.command import main

    keras.utils.set_random_seed(0)
    model = models_zoo.transformer_encoder(layers=2, sequence=32, hidden=16, heads=2)
    # SGD updates in place: what the plans trade is activations, not the 2x
    # weights an uncompiled model's modelled Adam update adds to every moment.
    model.compile(optimizer="sgd", loss="mse")
    path = str(tmp_path / "encoder.keras")
    model.save(path)
    assert main(["frontier", path, "--batch-size", "8", "--policy", policy]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.split()[:1] == ["peak"])
    assert header.split()[-1] == "selective"
    rows = out.split(header)[1].strip().splitlines()
    assert any(row.split()[-1] != "0" for row in rows if row.strip()[:1].isdigit())
    assert main(["profile", path, "--batch-size", "8", "--policy", policy]) == 0
    assert "Under the policy the links keep" in capsys.readouterr().out
    chain = tfrecompute.profile(model, batch_size=8, policy=policy)
    selective = next(p for p in tfrecompute.strategies.frontier(chain) if any(p.selective))
    budget = str(int(selective.peak_bytes / 0.7) + 1)
    assert main(["plan", path, "--batch-size", "8", "--policy", policy, "--budget", budget]) == 0
    assert "selective" in capsys.readouterr().out


def test_a_keras_hub_bert_under_dots_trains_as_the_original():
    keras.utils.set_random_seed(0)
    model, (x, _) = any_models.bert(layers=2, hidden=32, sequence=16, batch=2)
    tfrecompute.recompute(model, "uniform:3", sample=x, policy="dots")
    assert {b.policy for b in _blocks(model)} == {"dots"}
    names = sorted(x)
    inputs = [tf.constant(x[k]) for k in names]

    def run(m):
        return lambda *xs, training=None: m(dict(zip(names, xs)), training=training)

    for mode in MODES:
        assert_same_training(
            run(model),
            run(as_defined(model)),
            inputs,
            model.trainable_variables,
            model.non_trainable_variables,
            mode,
            atol=1e-5,
        )


BOTH = ["attention", "dots"]


def test_profile_with_two_policies_gives_each_its_state():
    keras.utils.set_random_seed(0)
    model = models_zoo.transformer_encoder(layers=1, sequence=8, hidden=16, heads=2)
    both = tfrecompute.profile(model, batch_size=4, policy=BOTH)
    attention = tfrecompute.profile(model, batch_size=4, policy="attention")
    dots = tfrecompute.profile(model, batch_size=4, policy="dots")
    plain = tfrecompute.profile(model, batch_size=4)
    assert both.policy_names == ("attention", "dots") and len(both.policy_states) == 2
    assert both.policy_states[0] == attention.policy_states[0]
    (kept, cost), (alone_kept, alone_cost) = both.policy_states[1], dots.policy_states[0]
    assert kept == alone_kept
    # By FLOPs the attention state adds the cores to each link's forward, which a "dots"
    # recompute runs again too: the same amount more than "dots" priced alone.
    assert both.forward_cost == attention.forward_cost
    added = [a - p for a, p in zip(attention.forward_cost, plain.forward_cost)]
    assert any(added)
    assert cost == pytest.approx([c + a for c, a in zip(alone_cost, added)])


@pytest.mark.parametrize("mode", MODES)
def test_a_plan_over_four_states_gives_each_block_its_policy(mode):
    keras.utils.set_random_seed(0)
    model = models_zoo.transformer_encoder(layers=2, sequence=32, hidden=16, heads=2)
    chain = tfrecompute.profile(model, batch_size=8, policy=BOTH)
    segments = tfrecompute.strategies.uniform(1)(chain).segments
    attention = [i for i, (s, e) in enumerate(segments) if "attention" in chain.names[s]]
    # The attention links under "attention", the others in turn whole and under "dots".
    states = [1 if i in attention else i % 2 * 2 for i in range(len(segments))]
    assert attention and 0 in states and 2 in states
    chosen = tfrecompute.strategies.Plan.from_segments(chain, segments, selective=states)
    assert "selective (attention)" in chosen.summary() and "selective (dots)" in chosen.summary()
    tfrecompute.recompute(model, chosen, policy=BOTH)
    assert [b.policy for b in _blocks(model)] == [[None, "attention", "dots"][s] for s in states]
    ids = tf.constant(np.random.default_rng(0).integers(0, 100, (2, 32)).astype("int32"))
    _same_training(model, [ids], mode)


def test_the_default_plan_weighs_both_policies_under_a_budget():
    keras.utils.set_random_seed(0)
    model = models_zoo.transformer_encoder(layers=2, sequence=64, hidden=16, heads=2)
    chain = tfrecompute.profile(model, batch_size=8, policy=BOTH)
    stored = tfrecompute.strategies.none(chain).peak_bytes
    budget = (stored + tfrecompute.strategies.min_peak(chain)) // 2
    made = tfrecompute.plan(model, budget=budget, batch_size=8, headroom=0, policy=BOTH)
    assert made.peak_bytes <= budget
    for one in ([chain.policy_states[0]], [chain.policy_states[1]]):
        (kept, cost), *_ = one
        three = dataclasses.replace(
            chain,
            policy_kept_bytes=kept,
            policy_forward_cost=cost,
            more_policies=(),
            policy_names=(),
        )
        assert made.recompute_cost <= tfrecompute.strategies.optimal(three, budget).recompute_cost
    tfrecompute.recompute(model, made, policy=BOTH)
    want = [[None, "attention", "dots"][made.state(i)] for i in range(len(made.segments))]
    assert [b.policy for b in _blocks(model)] == want


@pytest.mark.parametrize(
    ("strategy", "policy", "match"),
    [
        (None, [], "the list of policies is empty"),
        (None, ["dots", "dots"], "a policy appears twice"),
        (None, ["nothing", "dots"], r"policy\[0\] \('nothing'\) recomputes everything"),
        (None, [["dots"]], "policies do not nest"),
        (None, ["dots", "everything"], "unknown recompute policy"),
        ("sqrt", BOTH, "without weighing policies, so each block can get one policy"),
    ],
)
def test_malformed_policy_lists_are_refused(strategy, policy, match):
    model = models_zoo.transformer_encoder(layers=1, sequence=8, hidden=16, heads=2)
    with pytest.raises((ValueError, TypeError), match=match) as info:
        tfrecompute.recompute(model, strategy, policy=policy)
    assert CONVENTION.match(_own_message(info.value))


def test_a_plan_over_two_policies_needs_both_to_apply():
    keras.utils.set_random_seed(0)
    model = models_zoo.transformer_encoder(layers=1, sequence=8, hidden=16, heads=2)
    chain = tfrecompute.profile(model, batch_size=4, policy=BOTH)
    chosen = tfrecompute.strategies.Plan.from_segments(chain, [(0, 1)], selective=[2])
    for wrong in ("dots", ["dots", "attention"]):
        with pytest.raises(ValueError, match="does not match") as info:
            tfrecompute.recompute(model, chosen, policy=wrong)
        assert CONVENTION.match(_own_message(info.value))


def test_the_command_line_plans_with_two_policies(tmp_path, capsys):
    from tfrecompute.cli.command import main

    keras.utils.set_random_seed(0)
    model = models_zoo.transformer_encoder(layers=2, sequence=32, hidden=16, heads=2)
    model.compile(optimizer="sgd", loss="mse")
    path = str(tmp_path / "encoder.keras")
    model.save(path)
    assert main(["profile", path, "--batch-size", "8", "--policy", "attention,dots"]) == 0
    out = capsys.readouterr().out
    assert "Under 'attention' the links keep" in out and "Under 'dots' the links keep" in out
    assert main(["frontier", path, "--batch-size", "8", "--policy", "attention,dots"]) == 0
    assert "selective" in capsys.readouterr().out
    assert main(["profile", path, "--batch-size", "8", "--policy", "attention,everything"]) == 2
    assert "unknown policy 'everything'" in capsys.readouterr().err


def _between_whole_steps(model, batch_size):
    """A budget no plan of whole segments fills: a plan with policy states predicted strictly
    between two plans of whole segments; the budget and those two peaks."""
    whole = sorted({p.peak_bytes for p in tfrecompute.strategies.frontier(
        tfrecompute.profile(model, batch_size=batch_size))})  # fmt: skip
    mixed = tfrecompute.profile(model, batch_size=batch_size, policy=["attention", "dots"])
    for point in tfrecompute.strategies.frontier(mixed):
        below = [peak for peak in whole if peak < point.peak_bytes]
        if below and point.peak_bytes not in whole and point.peak_bytes < whole[-1]:
            return point.peak_bytes, below[-1]
    raise AssertionError("no policy plan between two whole-segment plans")


def test_a_budget_on_a_model_with_attention_weighs_the_attention_and_dots_states():
    keras.utils.set_random_seed(0)
    model = models_zoo.transformer_encoder(layers=2, sequence=32, hidden=16, heads=2)
    model.compile(optimizer="sgd", loss="mse")
    budget, whole_below = _between_whole_steps(model, 8)
    options = {"budget": budget, "batch_size": 8, "headroom": 0}
    made = tfrecompute.plan(model, **options)
    assert made.chain.policy_names == ("attention", "dots") and any(made.selective)
    assert whole_below < made.peak_bytes <= budget  # more of the budget used
    off = tfrecompute.plan(model, **options, policy="nothing")
    assert not off.chain.has_policy and off.peak_bytes == whole_below
    # Without a budget, or with a strategy that does not weigh states: none offered.
    assert not tfrecompute.plan(model, batch_size=8).chain.has_policy
    assert weighed_policy(model, None, strategies.sqrt, budgeted=True) is None
    tfrecompute.recompute(model, **options)
    names = {0: None, 1: "attention", 2: "dots"}
    assert [b.policy for b in _blocks(model)] == [names[s] for s in made.selective]
    ids = tf.constant(np.random.default_rng(0).integers(0, 100, (2, 32)).astype("int32"))
    _same_training(model, [ids], "function")


def test_a_budget_on_a_model_without_attention_plans_whole_segments():
    model = models_zoo.tanh_mlp(depth=6, width=16)
    assert not tfrecompute.plan(model, budget=0.9, batch_size=8).chain.has_policy


def test_the_command_line_weighs_the_same_states_under_a_budget(tmp_path, capsys):
    from tfrecompute.cli.command import main

    keras.utils.set_random_seed(0)
    model = models_zoo.transformer_encoder(layers=2, sequence=32, hidden=16, heads=2)
    model.compile(optimizer="sgd", loss="mse")
    budget, _ = _between_whole_steps(model, 8)
    path = str(tmp_path / "encoder.keras")
    model.save(path)
    common = ["plan", path, "--batch-size", "8", "--budget", str(budget), "--headroom", "0"]
    assert main(common) == 0
    assert "selective" in capsys.readouterr().out
    assert main([*common, "--policy", "nothing"]) == 0
    assert "selective" not in capsys.readouterr().out


def test_a_plan_using_policy_states_refuses_a_policy_that_turns_them_off():
    keras.utils.set_random_seed(0)
    model = models_zoo.transformer_encoder(layers=2, sequence=32, hidden=16, heads=2)
    budget, _ = _between_whole_steps(model, 8)
    made = tfrecompute.plan(model, budget=budget, batch_size=8, headroom=0)
    assert any(made.selective)
    with pytest.raises(ValueError, match="which the policy given turns off") as info:
        tfrecompute.recompute(model, made, policy="nothing")
    assert CONVENTION.match(_own_message(info.value))


def test_a_budget_plans_whole_segments_when_its_policy_states_cannot_be_priced(monkeypatch):
    from tfrecompute.costs import profile

    original = profile._policy_states

    def broken(graph, links, batch_size, forward, policies, traced):
        if policies:
            raise RuntimeError("no attention core found")
        return original(graph, links, batch_size, forward, policies, traced)

    monkeypatch.setattr(profile, "_policy_states", broken)
    keras.utils.set_random_seed(0)
    model = models_zoo.transformer_encoder(layers=2, sequence=32, hidden=16, heads=2)
    with pytest.warns(UserWarning, match=r"plan: the attention and dots states .* no attention"):
        made = tfrecompute.plan(model, budget=0.8, batch_size=8)
    assert not made.chain.has_policy and made.segments
    with pytest.raises(RuntimeError, match="no attention core"):  # asked for: the error
        tfrecompute.plan(model, budget=0.8, batch_size=8, policy="dots")
