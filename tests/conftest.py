"""Shared test set-up, run before any test imports TensorFlow.

The CPU is split into two logical devices so that tf.distribute tests can run
MirroredStrategy with two replicas on a machine without GPUs; this has to
happen before TensorFlow initialises its devices.
"""

import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


# Temporary files (saved models, checkpoints, weight files) go to memory where the
# machine has a tmpfs: on these VMs the disk at times stalls writes for minutes (I/O
# wait, no CPU), which held single persistence tests that long.
def _roomy_tmpfs(path: str = "/dev/shm", needed: int = 4 << 30) -> bool:
    if not (os.path.isdir(path) and os.access(path, os.W_OK)):
        return False
    stats = os.statvfs(path)
    return stats.f_bavail * stats.f_frsize >= needed


if "TMPDIR" not in os.environ and _roomy_tmpfs():
    os.environ["TMPDIR"] = "/dev/shm"
    tempfile.tempdir = None  # read TMPDIR again

import tensorflow as tf  # noqa: E402

_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    _cpu, [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()]
)


import gc  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture
def collect_garbage():
    """Collects garbage after the test (`pytestmark = pytest.mark.usefixtures(...)`).

    Tests that train many models under `MirroredStrategy` leave thousands of
    traced functions behind. Left to Python's own collections, they went in one
    late sweep, removing each function from TensorFlow's context, that held a single
    test of tests/rewrite/test_persistence.py for minutes; collected after each test, the
    sweeps stay small.
    """
    yield
    gc.collect()
