"""`max_batch_size` shows its progress by default and says when it stopped at its limit."""

from __future__ import annotations

import re
import warnings

import keras
import numpy as np
import pytest

import tfrecompute
from tfrecompute.check.max_batch import BatchProbe, MaxBatch

MiB = 2**20


def _model() -> keras.Model:
    keras.utils.set_random_seed(0)
    inputs = keras.Input((64,))
    h = inputs
    for _ in range(2):
        h = keras.layers.Dense(64, activation="tanh")(h)
    model = keras.Model(inputs, keras.layers.Dense(4)(h))
    model.compile(optimizer="sgd", loss="mse")
    return model


def _sample() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.random((8, 64), dtype="float32"), rng.random((8, 4), dtype="float32")


def test_a_search_that_reaches_its_limit_says_so_and_shows_each_probe(capsys):
    with pytest.warns(UserWarning) as record:
        found = tfrecompute.max_batch_size(
            _model(), _sample(), budget="1GiB", multiple=8, limit=16, isolate=False
        )
    out = capsys.readouterr().out
    assert found.at_limit and found.batch_size == 16 and found.limit == 16
    # Its probes' steps are small enough for oneDNN's allocator to count nothing, which
    # each probe's measured step warns of, naming max_batch_size too.
    said = [str(w.message) for w in record if "max_batch_size" in str(w.message)]
    said = [message for message in said if "recorded no memory" not in message]
    assert said == [
        "max_batch_size: every batch size tried fits, so the search stopped at its limit (16): "
        "16 is the largest tried, not the largest that fits. Received: limit=16 (of type int). "
        "Pass a larger limit to search further."
    ]
    lines = out.splitlines()
    assert lines[0].startswith("max_batch_size: trying batch sizes 8, 16, 32, ... up to limit=16")
    assert "in this process (progress=False: quiet)" in lines[0]
    probes = [line for line in lines if line.startswith("Probe ")]
    assert len(probes) == len(found.probes) == 2
    # (tiny steps measure 0 B: the CPU allocator leaves out allocations under 256 KiB)
    shown = r"Probe 1: batch size 8 fits: measured [0-9.]+ \w*B( \(\d+% of the budget\))? - \d+s$"
    assert re.match(shown, probes[0]), probes
    assert probes[1].startswith("Probe 2: batch size 16 fits")
    assert found.summary().startswith(
        "Every batch size tried fits: the search stopped at its limit, 16, so 16 is the largest "
        "tried, not the largest that fits"
    )


def test_progress_false_is_quiet_and_a_function_gets_each_probe(capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        tfrecompute.max_batch_size(
            _model(), _sample(), budget="1GiB", multiple=8, limit=8, isolate=False, progress=False
        )
        assert capsys.readouterr().out == ""
        seen = []
        tfrecompute.max_batch_size(
            _model(), _sample(), budget="1GiB", multiple=8, limit=8, isolate=False,
            progress=seen.append,
        )  # fmt: skip
    assert capsys.readouterr().out == "" and [p.batch_size for p in seen] == [8]


def test_a_search_that_finds_a_batch_that_does_not_fit_is_not_at_its_limit():
    probes = (BatchProbe(64, True, 10 * MiB, ((0, 2),)), BatchProbe(128, False, 30 * MiB))
    found = MaxBatch(64, None, None, 10 * MiB, 20 * MiB, probes, limit=65536)
    assert not found.at_limit
    assert found.summary() == (
        "Largest batch size that fits: 64 (measured 10.00 MiB, 50% of the budget 20.00 MiB; "
        "2 batch sizes measured)"
    )


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"budget": 0.5}, ValueError, r"max_batch_size: a budget as a share of storing "
         r"everything changes with the batch size, which this searches\. Received: budget=0\.5 "
         r"\(of type float\)\. Pass the budget in bytes"),
        ({"budget": "1GiB", "progress": "yes"}, TypeError, r"max_batch_size: `progress` must be a "
         r"bool or a function of a BatchProbe\. Received: progress='yes'"),
    ],
)  # fmt: skip
def test_options_are_refused_in_the_project_format(options, error, match):
    with pytest.raises(error, match=match):
        tfrecompute.max_batch_size(_model(), _sample(), isolate=False, **options)
