"""`benchmarks/keras_hub_suite.py`: keras-hub's model tests shipped and checkpointed."""

from __future__ import annotations

import pytest

from benchmarks import keras_hub_suite
from tests.helpers import run_benchmark_smoke


class _Model:
    def __init__(self, width: int, dtype: str | None = None) -> None:
        self.width, self.dtype = width, dtype

    @classmethod
    def from_config(cls, config: dict) -> _Model:
        return cls(**config)


def test_stand_in_checkpoints_what_it_builds_and_is_the_class_otherwise(monkeypatch):
    checkpointed = []
    monkeypatch.setattr(
        keras_hub_suite, "checkpoint", lambda *args: checkpointed.append(args), raising=True
    )
    stand_in = keras_hub_suite._Checkpointed(_Model, "run_backbone_test", lambda m: m.width)
    model = stand_in(3, dtype="mixed_float16")
    assert type(model) is _Model and isinstance(model, stand_in)
    assert checkpointed == [(model, "run_backbone_test", 3, "mixed_float16")]
    revived = stand_in.from_config({"width": 4})  # the class's own: not checkpointed
    assert isinstance(revived, _Model) and len(checkpointed) == 1
    assert stand_in.__name__ == "_Model" and issubclass(_Model, stand_in)


def test_a_model_left_as_it_was_is_never_a_pass():
    passed = {"outcome": "passed", "models": [{"checkpointed": True}, {"checkpointed": False}]}
    assert keras_hub_suite.classify(passed) == "passed, a model left as it was"
    assert keras_hub_suite.classify({"outcome": "passed", "models": []}) == (
        "no model built by a helper"
    )
    passed["models"].pop()
    assert keras_hub_suite.classify(passed) == "passed checkpointed"
    assert keras_hub_suite.classify({"outcome": "failed", "models": []}) == "failed"


@pytest.mark.slow
@pytest.mark.skipif(
    not keras_hub_suite.MIRROR.exists(), reason="no keras-hub source snapshot on this machine"
)
def test_smoke_run_checkpoints_every_model_of_the_bert_backbone_test(tmp_path):
    report, table = run_benchmark_smoke("keras_hub_suite", tmp_path, timeout=900)
    bert = report["families"]["bert"]
    test = "khtests/bert/bert_backbone_test.py::BertBackboneTest::test_backbone_basics"
    assert bert["shipped"][test]["outcome"] == "passed"
    record = bert["checkpointed"][test]
    # The backbone, its three mixed-precision builds and two quantized ones.
    assert [m["dtype"] for m in record["models"]] == [
        "float32", "mixed_float16", "mixed_bfloat16", "bfloat16", "int8", "float8"
    ]  # fmt: skip
    for model in record["models"]:
        assert model["wall_seconds"] > 0
        assert model["checkpointed"] == (model["blocks"] > 0)
        assert model["checkpointed"] or model["why"]
    assert "Families not run:" in table and "| bert |" in table


def _tiny_model():
    import keras

    inputs = keras.Input((4,))
    h = inputs
    for _ in range(6):
        h = keras.layers.Dense(4, activation="relu")(h)
    return keras.Model(inputs, h)


def test_a_strategy_checkpoints_models_the_default_leaves_as_they_were(monkeypatch, tmp_path):
    import numpy as np

    recorder = keras_hub_suite._Recorder(str(tmp_path / "events.jsonl"), "checkpointed")
    recorder.start("khtests/tiny/tiny_test.py::TinyTest::test_backbone_basics")
    monkeypatch.setattr(keras_hub_suite, "_RECORDER", [recorder])
    x = np.zeros((2, 4), "float32")
    keras_hub_suite.checkpoint(_tiny_model(), "run_backbone_test", x, None)
    monkeypatch.setenv(keras_hub_suite.ENV_STRATEGY, "sqrt")
    keras_hub_suite.checkpoint(_tiny_model(), "run_backbone_test", x, None)
    default, forced = recorder.test["models"]
    assert not default["checkpointed"] and "nothing is recomputed" in default["why"]
    assert forced["checkpointed"] and forced["blocks"] == forced["segments"] == 2
