"""Shared test set-up, run before any test imports TensorFlow.

The CPU is split into two logical devices so that tf.distribute tests can run
MirroredStrategy with two replicas on a machine without GPUs; this has to
happen before TensorFlow initialises its devices.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    _cpu, [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()]
)
