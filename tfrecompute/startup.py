"""`quiet_tensorflow()`: import TensorFlow without its start-up logs.

On import TensorFlow's C++ runtime writes lines such as "oneDNN custom
operations are on", "Could not find cuda drivers" and, on a machine without a
GPU, an E-level "failed call to cuInit" straight to the process's standard
error (file descriptor 2), before its own log settings apply:
`TF_CPP_MIN_LOG_LEVEL` alone does not hide them in TensorFlow 2.21. The
command line and the examples call `quiet_tensorflow()` before anything
imports TensorFlow. Pure Python until called.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
from collections.abc import Iterator
from typing import BinaryIO

from tfrecompute._messages import as_bool

__all__ = ["quiet_tensorflow"]


def quiet_tensorflow(*, verbose: bool = False) -> None:
    """Imports TensorFlow with its start-up logs silenced, and its Python logs at ERROR.

    Sets `TF_CPP_MIN_LOG_LEVEL=2` (unless it is set already), imports
    TensorFlow and lists its devices (which writes the CUDA lines) with the
    process's standard error sent to a temporary file, and sets the
    `tensorflow` and `absl` Python loggers to ERROR. If the import fails, what
    it wrote is replayed before the error propagates. Once TensorFlow is
    imported, only the logger levels change.

    Args:
        verbose: when True, do nothing: every log is shown.

    Raises:
        TypeError: `verbose` is not a bool.

    Example:

    ```python
    import tfrecompute

    tfrecompute.quiet_tensorflow()  # before keras or tensorflow is imported
    import keras
    ```
    """
    if as_bool("quiet_tensorflow", "verbose", verbose):
        return
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if "tensorflow" not in sys.modules:
        with _standard_error_held() as held:
            try:
                import tensorflow as tf

                tf.config.list_physical_devices()
            except BaseException:
                held.replay = True
                raise
    logging.getLogger("tensorflow").setLevel(logging.ERROR)
    with contextlib.suppress(ImportError):
        from absl import logging as absl_logging

        absl_logging.set_verbosity(absl_logging.ERROR)


class _Held:
    """What was written to file descriptor 2 while it was held, and whether to show it."""

    def __init__(self, file: BinaryIO | None) -> None:
        self.file = file
        self.replay = False


@contextlib.contextmanager
def _standard_error_held() -> Iterator[_Held]:
    """Sends file descriptor 2 to a temporary file; writes it back if `replay` is set."""
    try:
        saved = os.dup(2)
    except OSError:  # no standard error to hold
        yield _Held(None)
        return
    with tempfile.TemporaryFile() as file:
        held = _Held(file)
        sys.stderr.flush()
        os.dup2(file.fileno(), 2)
        try:
            yield held
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            if held.replay:
                file.seek(0)
                sys.stderr.write(file.read().decode(errors="replace"))
                sys.stderr.flush()
