"""The planner imports and plans where TensorFlow and Keras cannot be imported."""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import sys
    sys.modules["tensorflow"] = None  # any import of tensorflow now fails
    sys.modules["keras"] = None
    import tfrecompute.strategies as st

    chain = st.Chain.homogeneous(32, activation_bytes=1024)
    plan = st.optimal(chain, "20KiB")
    assert plan.peak_bytes <= 20 * 1024
    for name in st.available():
        st.get(name)(chain)
    st.frontier(chain)
    loaded = [m for m, v in sys.modules.items()
              if v is not None and m.split(".")[0] in ("tensorflow", "keras", "tf_keras")]
    assert not loaded, loaded
    print("ok", len(st.__all__))
    """
)


def test_import_and_plan_without_tensorflow() -> None:
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ok")


def test_all_is_explicit_and_complete() -> None:
    import tfrecompute.strategies as st

    public = {
        name
        for name in dir(st)
        if not name.startswith("_") and not inspect.ismodule(getattr(st, name))
    }
    assert set(st.__all__) == public
