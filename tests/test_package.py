"""`import tfrecompute`: quick and pure Python; the TensorFlow parts load on first use."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent(
    """
    import sys
    import tfrecompute

    assert not {"tensorflow", "keras"} & {m.split(".")[0] for m in sys.modules}, "imported TF"
    assert "RecomputeBlock" in tfrecompute.__all__ and "quiet_tensorflow" in tfrecompute.__all__
    assert set(tfrecompute.__all__) <= set(dir(tfrecompute))
    tfrecompute.quiet_tensorflow()
    import keras
    from tfrecompute import RecomputeBlock  # registers it, as a saved model's loading needs

    assert keras.saving.get_registered_object("tfrecompute>RecomputeBlock") is RecomputeBlock
    assert tfrecompute.recompute is tfrecompute.whole_model.recompute  # all parts loaded at once
    try:
        tfrecompute.no_such_thing
    except AttributeError as error:
        assert "has no attribute 'no_such_thing'" in str(error)
    print("ok")
    """
)


def test_import_is_lazy_and_the_tensorflow_parts_load_on_first_use():
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "ok"
    assert result.stderr == ""  # quiet_tensorflow() hid TensorFlow's start-up logs


def test_quiet_tensorflow_checks_its_flag():
    import tfrecompute

    with pytest.raises(TypeError, match=r"quiet_tensorflow: `verbose` must be a bool"):
        tfrecompute.quiet_tensorflow(verbose=1)
