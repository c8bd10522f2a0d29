"""`quiet_tensorflow()`: import TensorFlow without its start-up logs; `count_cpu_memory()`:
let TensorFlow count the bytes its CPU allocator holds.

On import TensorFlow's C++ runtime writes lines such as "oneDNN custom
operations are on", "Could not find cuda drivers" and, on a machine without a
GPU, an E-level "failed call to cuInit" straight to the process's standard
error (file descriptor 2), before its own log settings apply:
`TF_CPP_MIN_LOG_LEVEL` alone does not hide them in TensorFlow 2.21. The
command line and the examples call `quiet_tensorflow()` before anything
imports TensorFlow. Pure Python until called.

NOTE [ Counting CPU memory ]
Every measurement here (`measure_step`, `trace_step`, `calibrate=True`,
`verify=True`, `max_batch_size`, a call's measured workspace, an
optimizer's measured update) reads TensorFlow's allocator: its current and
peak bytes, and the profiler's allocation events. On a CPU, TensorFlow
keeps them only when its CPU allocator counts: where oneDNN is on (by
TensorFlow's own policy, `tensorflow/core/util/port.cc`, on CPUs with
AVX-512 VNNI or BF16, AVX-VNNI or AMX; without it
`tf.config.experimental.get_memory_info("CPU:0")` raises "Allocator stats
not available"), or when `TF_CPU_ALLOCATOR_USE_BFC=true`. TensorFlow reads that variable when its
runtime starts (its first operation or device placement, not its import),
so `count_cpu_memory()` sets it while it still can, and only where oneDNN is
off: the two allocators count differently (oneDNN's serves requests under
256 KiB from a pool outside its statistics, the BFC allocator counts them;
tests/check/test_cpu_allocator.py), and where oneDNN is on the measurements
stay those of TensorFlow's default. TensorFlow caps that
BFC allocator at `TF_CPU_BFC_MEM_LIMIT_IN_MB`, 64 GiB unless set; on a
machine with more memory `count_cpu_memory()` raises the cap to it, so that
counting never limits a process the default allocator would let run. The
command line, the examples and `max_batch_size`'s probe processes call it.
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

__all__ = [
    "COUNTING_FIX",
    "CPU_ALLOCATOR_VARIABLE",
    "bfc_cpu_allocator_asked",
    "count_cpu_memory",
    "quiet_tensorflow",
]

CPU_ALLOCATOR_VARIABLE = "TF_CPU_ALLOCATOR_USE_BFC"  # TensorFlow's switch to its BFC CPU allocator
_BFC_LIMIT_VARIABLE = "TF_CPU_BFC_MEM_LIMIT_IN_MB"  # the BFC CPU allocator's cap
_BFC_DEFAULT_LIMIT_MIB = 1 << 16  # TensorFlow's default cap: 64 GiB
COUNTING_FIX = (  # how to have a counting CPU allocator, as every error about it says
    "call tfrecompute.count_cpu_memory() before building a model, or start Python with "
    f"{CPU_ALLOCATOR_VARIABLE}=true in the environment"
)


def count_cpu_memory() -> None:
    """Makes TensorFlow's CPU allocator count the bytes it holds, for measuring on a CPU.

    Where TensorFlow runs with oneDNN, its CPU allocator counts already and
    nothing changes. Elsewhere it sets `TF_CPU_ALLOCATOR_USE_BFC=true` unless
    the variable is set, and raises that allocator's 64 GiB cap to the
    machine's memory where it has more (NOTE [ Counting CPU memory ]).
    Imports TensorFlow.
    Call it before TensorFlow runs its first operation (importing TensorFlow
    or Keras first is fine; building a model is too late).

    Raises:
        RuntimeError: TensorFlow's runtime has started without a counting allocator.

    Example:

    ```python
    import tfrecompute

    tfrecompute.count_cpu_memory()  # before the first model is built
    import keras
    ```
    """
    from tfrecompute._keras_internals import onednn_enabled, runtime_started

    if onednn_enabled() or os.environ.get(CPU_ALLOCATOR_VARIABLE) is not None:
        return
    if runtime_started():
        raise RuntimeError(
            "count_cpu_memory: TensorFlow's runtime has started (a model was built or an "
            "operation ran) without oneDNN, and its CPU allocator, which keeps no statistics, "
            f"is fixed for this process. {COUNTING_FIX[0].upper()}{COUNTING_FIX[1:]}."
        )
    os.environ[CPU_ALLOCATOR_VARIABLE] = "true"
    machine = _physical_mib()
    if machine is not None and machine > _BFC_DEFAULT_LIMIT_MIB:
        os.environ.setdefault(_BFC_LIMIT_VARIABLE, str(machine))


def bfc_cpu_allocator_asked() -> bool:
    """Whether the environment asks TensorFlow for its BFC CPU allocator (which it obeys
    when its runtime starts, oneDNN or not)."""
    return os.environ.get(CPU_ALLOCATOR_VARIABLE, "").strip().lower() in ("1", "true")


def _physical_mib() -> int | None:
    """The machine's memory in MiB, or None where the platform does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") >> 20
    except (AttributeError, OSError, ValueError):
        return None


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
