"""Bad calls of every public entry point, and the errors they raise.

Each case is `(entry point, exception type, pattern)`: the call must raise that
type with a message matching the pattern, and the message must follow the
project's convention (see GUIDE.md):

    "<api>: <what was wrong>. Received: <name>=<value> (of type <T>). <how to fix>."

To add an entry point, append its cases to `CASES` (one list per module).
"""

from __future__ import annotations

import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfrecompute
from tests.models_zoo import Untraceable
from tfrecompute import RecomputeBlock, measure_step, strategies
from tfrecompute.layers import set_debug

CONVENTION = re.compile(
    r"^(?P<api>[\w.]+(?: '[^']*')?): (?P<what>.+?)\. "
    r"Received: (?P<received>\w[\w\[\]]*=.+? \(of type [\w.]+\))"
    r"(?:, \w+=.+? \(of type [\w.]+\))*\. (?P<fix>\S.*)$",
    re.DOTALL,
)


def _compiled_model():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    return model


def _call_block_with_list_and_extra_args():
    block = RecomputeBlock([keras.layers.Dense(2), keras.layers.Dense(2)])
    x = tf.ones((1, 2))
    block(x, x)


def _call_block_with_training(training):
    block = RecomputeBlock(keras.layers.Dense(2))
    with tf.GradientTape():
        block(tf.ones((1, 2)), training=training)


def _train_unbuilt_untraceable():
    block = RecomputeBlock(Untraceable())
    with tf.GradientTape():
        block(tf.ones((2, 3)), training=True)


def _measure(model=None, x=None, y=None, **kwargs):
    model = _compiled_model() if model is None else model
    x = np.ones((2, 2), "float32") if x is None else x
    y = np.ones((2, 1), "float32") if y is None else y
    return measure_step(model, x, y, **kwargs)


RECOMPUTE_BLOCK_CASES = {
    "layers_empty_list": (
        lambda: RecomputeBlock([]),
        ValueError,
        r"RecomputeBlock: `layers` is empty\. Received: layers=\[\] \(of type list\)",
    ),
    "layers_empty_tuple": (
        lambda: RecomputeBlock(()),
        ValueError,
        r"`layers` is empty\. Received: layers=\(\) \(of type tuple\)",
    ),
    "layers_function": (
        lambda: RecomputeBlock(lambda x: x),
        TypeError,
        r"must be a Keras layer.*Received: layers=.*\(of type function\)",
    ),
    "layers_none": (
        lambda: RecomputeBlock(None),
        TypeError,
        r"Received: layers=None \(of type NoneType\)",
    ),
    "layers_class_not_instance": (
        lambda: RecomputeBlock(keras.layers.Dense),
        TypeError,
        r"\(of type type\)\. Pass an instance, e.g\. Dense\(\.\.\.\), not the class",
    ),
    "layers_item_string": (
        lambda: RecomputeBlock([keras.layers.Dense(2), "dense"]),
        TypeError,
        r"item 1 of `layers` is not a Keras layer\. Received: layers\[1\]='dense' "
        r"\(of type str\)",
    ),
    "layers_item_class": (
        lambda: RecomputeBlock([keras.layers.Dropout]),
        TypeError,
        r"Received: layers\[0\]=.*Pass an instance, e.g\. Dropout\(\.\.\.\)",
    ),
    "layers_item_input_layer": (
        lambda: RecomputeBlock([keras.layers.InputLayer(shape=(3,)), keras.layers.Dense(2)]),
        ValueError,
        r"item 0 of `layers` is an InputLayer.*Received: layers\[0\]=.*\(of type InputLayer\)"
        r".*Leave keras\.Input/InputLayer out of the block",
    ),
    "debug_not_bool": (
        lambda: RecomputeBlock(keras.layers.Dense(2), debug="yes"),
        TypeError,
        r"`debug` must be a bool\. Received: debug='yes' \(of type str\)",
    ),
    "call_extra_args_with_a_list": (
        _call_block_with_list_and_extra_args,
        TypeError,
        r"extra call arguments go to a single wrapped layer.*Received: args=",
    ),
    "call_training_string": (
        lambda: _call_block_with_training("yes"),
        TypeError,
        r"`training` must be None, a bool or a boolean tensor\. Received: training='yes' "
        r"\(of type str\)",
    ),
    "call_untraceable_unbuilt_model": (
        _train_unbuilt_untraceable,
        ValueError,
        r"could not build the wrapped layers by tracing them.*Received: layers=.*Cause: TypeError",
    ),
    "from_config_without_layers": (
        lambda: RecomputeBlock.from_config({"name": "b"}),
        ValueError,
        r"RecomputeBlock\.from_config: `config` must be a dict with a 'layers' entry.*"
        r"Received: config=\{'name': 'b'\} \(of type dict\)",
    ),
    "from_config_not_a_dict": (
        lambda: RecomputeBlock.from_config(["layers"]),
        ValueError,
        r"Received: config=\['layers'\] \(of type list\)",
    ),
    "set_debug_not_bool": (
        lambda: set_debug(1),
        TypeError,
        r"set_debug: `enabled` must be a bool\. Received: enabled=1 \(of type int\)",
    ),
}

MEASURE_STEP_CASES = {
    "model_not_a_model": (
        lambda: measure_step(keras.layers.Dense(1), np.ones((1, 2))),
        TypeError,
        r"measure_step: `model` must be a Keras model\..*\(of type Dense\)",
    ),
    "model_not_compiled": (
        lambda: _measure(keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])),
        ValueError,
        r"measure_step: the model is not compiled\..*model\.compile",
    ),
    "steps_zero": (
        lambda: _measure(steps=0),
        ValueError,
        r"`steps` must be at least 1\. Received: steps=0 \(of type int\)",
    ),
    "steps_float": (
        lambda: _measure(steps=1.5),
        TypeError,
        r"Received: steps=1\.5 \(of type float\)",
    ),
    "steps_bool": (
        lambda: _measure(steps=True),
        TypeError,
        r"Received: steps=True \(of type bool\)",
    ),
    "warmup_negative": (
        lambda: _measure(warmup=-1),
        ValueError,
        r"`warmup` must be at least 1\. Received: warmup=-1",
    ),
    "device_missing": (
        lambda: _measure(device="TPU:0"),
        ValueError,
        r"measure_step: no TPU:0 device is available\. Received: device='TPU:0'",
    ),
}


def _mlp(depth=2):
    return keras.Sequential([keras.Input((4,)), *[keras.layers.Dense(4) for _ in range(depth)]])


class _Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(2)

    def call(self, x):
        return self.dense(x)


def _variable_length():
    inputs = keras.Input((None, 8))  # an unknown sequence length
    h = keras.layers.Dense(8)(inputs)
    return keras.Model(inputs, keras.layers.Dense(2)(h), name="variable_length")


def _built_subclassed():
    model = _Subclassed()
    model(tf.ones((1, 2)))
    return model


MODEL_CASES = {
    "recompute_not_a_model": (
        lambda: tfrecompute.recompute(keras.layers.Dense(2)),
        TypeError,
        r"recompute: `model` must be a Keras model",
    ),
    "recompute_subclassed": (
        lambda: tfrecompute.recompute(_built_subclassed()),
        ValueError,
        r"recompute: a subclassed or unbuilt model has no declared inputs.*Pass sample=",
    ),
    "recompute_variable_length": (
        lambda: tfrecompute.recompute(_variable_length(), "sqrt"),
        ValueError,
        r"recompute: the model input '\w+' has shape \(None, None, 8\), and every dimension "
        r"but the batch must be known.*Received: model='variable_length'.*Pass sample=",
    ),
    "plan_unbuilt": (
        lambda: tfrecompute.plan(keras.Sequential([keras.layers.Dense(2)])),
        ValueError,
        r"plan: the model is not built",
    ),
    "recompute_budget_without_batch_size": (
        lambda: tfrecompute.recompute(_mlp(), "optimal", budget="1MiB"),
        ValueError,
        r"recompute: a memory budget needs the batch size.*Received: batch_size=None",
    ),
    "profile_batch_size_zero": (
        lambda: tfrecompute.profile(_mlp(), batch_size=0),
        ValueError,
        r"profile: `batch_size` must be at least 1\. Received: batch_size=0",
    ),
    "profile_batch_size_float": (
        lambda: tfrecompute.profile(_mlp(), batch_size=2.5),
        TypeError,
        r"Received: batch_size=2\.5 \(of type float\)",
    ),
    "recompute_plan_of_another_model": (
        lambda: tfrecompute.recompute(_mlp(5), tfrecompute.plan(_mlp(2))),
        ValueError,
        r"recompute: the plan was made for another model",
    ),
    "recompute_plan_with_budget": (
        lambda: tfrecompute.recompute(
            _mlp(), tfrecompute.plan(_mlp()), budget="1MiB", batch_size=2
        ),
        ValueError,
        r"recompute: a Plan already fixes the segments",
    ),
    "recompute_unknown_strategy": (
        lambda: tfrecompute.recompute(_mlp(), "fastest"),
        ValueError,
        r"fastest.*optimal",
    ),
}

_CHAIN = strategies.Chain.homogeneous(4, activation_bytes=1 << 20)

STRATEGY_CASES = {
    "chain_lengths_disagree": (
        lambda: strategies.Chain(1, [1, 2], [1], [1.0, 1.0]),
        ValueError,
        r"Chain: ",
    ),
    "chain_negative_bytes": (
        lambda: strategies.Chain(-1, [1], [1], [1.0]),
        ValueError,
        r"Chain: ",
    ),
    "budget_malformed": (
        lambda: strategies.parse_budget("lots"),
        ValueError,
        r"parse_budget: .*Received: value='lots'",
    ),
    "budget_not_positive": (
        lambda: strategies.parse_budget(0),
        ValueError,
        r"parse_budget: .*Received: value=0",
    ),
    "strategy_unknown": (lambda: strategies.get("fastest"), ValueError, r"get: .*optimal"),
    "strategy_not_callable": (lambda: strategies.get(3), TypeError, r"get: "),
    "uniform_k_zero": (lambda: strategies.uniform(0), ValueError, r"uniform: "),
    "segments_overlap": (
        lambda: strategies.Plan.from_segments(_CHAIN, [(0, 2), (1, 3)]),
        ValueError,
        r"Plan\.from_segments: ",
    ),
    "segments_out_of_range": (
        lambda: strategies.Plan.from_segments(_CHAIN, [(2, 9)]),
        ValueError,
        r"Plan\.from_segments: ",
    ),
    "budget_infeasible": (
        lambda: strategies.optimal(_CHAIN, budget=1024),
        strategies.InfeasibleBudgetError,
        r"optimal: .*least peak",
    ),
}

CASES = {
    **{f"RecomputeBlock.{k}": v for k, v in RECOMPUTE_BLOCK_CASES.items()},
    **{f"measure_step.{k}": v for k, v in MEASURE_STEP_CASES.items()},
    **{f"models.{k}": v for k, v in MODEL_CASES.items()},
    **{f"strategies.{k}": v for k, v in STRATEGY_CASES.items()},
}


def _own_message(error: BaseException) -> str:
    """The library's message, without Keras's wrapping of errors raised in `call()`."""
    lines = [re.sub(r"\x1b\[\d+m", "", line).strip() for line in str(error).splitlines()]
    apis = ("RecomputeBlock", "measure_step", "set_debug", "recompute", "plan", "profile")
    apis += ("Chain", "parse_budget", "get", "uniform", "Plan.from_segments", "optimal")
    return next((line for line in lines if line.startswith(apis)), str(error))


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_call_raises_a_clear_error(case):
    call, error_type, pattern = CASES[case]
    with pytest.raises(error_type, match=pattern) as raised:
        call()
    message = _own_message(raised.value)
    assert CONVENTION.match(message), f"does not follow the error convention: {message!r}"


# Inputs measure_step must name in its errors rather than fail inside TensorFlow.
MEASURE_STEP_INPUT_CASES = {
    "x_none": (
        lambda: measure_step(_compiled_model(), None, np.ones((2, 1), "float32")),
        ValueError,
        r"Received: x=None",
    ),
    "device_not_a_string": (lambda: _measure(device=5), TypeError, r"Received: device=5"),
    "device_index_out_of_range": (
        lambda: _measure(device="CPU:7"),
        ValueError,
        r"measure_step: no CPU:7 device",
    ),
}


@pytest.mark.parametrize("case", sorted(MEASURE_STEP_INPUT_CASES))
def test_measure_step_checks_x_and_device(case):
    call, error_type, pattern = MEASURE_STEP_INPUT_CASES[case]
    with pytest.raises(error_type, match=pattern):
        call()
