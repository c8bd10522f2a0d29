"""Measuring on a CPU where TensorFlow's allocator keeps no statistics by default.

TensorFlow counts CPU memory only where oneDNN is on (it turns it on by itself
on CPUs with AVX-512 VNNI or BF16, AVX-VNNI or AMX) or with
`TF_CPU_ALLOCATOR_USE_BFC=true` (NOTE [ Counting CPU memory ] in
tfrecompute/startup.py). The suite runs with oneDNN on (tests/conftest.py);
each test here runs Python in a process with it off and the variable unset,
as TensorFlow starts on other CPUs, whatever this machine's CPU.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from tfrecompute.startup import CPU_ALLOCATOR_VARIABLE

ROOT = pathlib.Path(__file__).resolve().parents[2]

MODEL = """
import json
import keras
import numpy as np
import tfrecompute

def model():
    keras.utils.set_random_seed(0)
    layers = [keras.layers.Dense(512, activation="tanh") for _ in range(8)]
    built = keras.Sequential([keras.Input((512,)), *layers, keras.layers.Dense(1)])
    built.compile(optimizer="sgd", loss="mse")
    return built

x = np.random.default_rng(0).normal(size=(1024, 512)).astype("float32")
y = np.zeros((1024, 1), "float32")
"""


def _run(script: str, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if key != CPU_ALLOCATOR_VARIABLE}
    env.update(TF_ENABLE_ONEDNN_OPTS="0", TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=str(ROOT))
    env.update(CUDA_VISIBLE_DEVICES="", **extra)
    return subprocess.run(
        [sys.executable, *(["-c", script] if script else []), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )


def _with_onednn(script: str) -> dict:
    """`script`'s last JSON line, run with oneDNN on; the test skips on builds without it
    (the script's JSON says so under "onednn")."""
    found = _last_json(_run(script, TF_ENABLE_ONEDNN_OPTS="1"))
    if not found["onednn"]:
        pytest.skip("this TensorFlow build has no oneDNN")
    return found


def _last_json(result: subprocess.CompletedProcess[str]) -> dict:
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_measuring_without_statistics_says_how_to_have_them():
    script = MODEL + (
        "said = {}\n"
        "runs = [('measure_step', lambda: tfrecompute.measure_step(model(), x, y)),\n"
        "        ('profile', lambda: tfrecompute.profile(model(), sample=x, measure=True)),\n"
        "        ('recompute', lambda: tfrecompute.recompute(\n"
        "            model(), 'optimal', budget='16MiB', sample=(x, y), verify=True))]\n"
        "for api, run in runs:\n"
        "    try:\n"
        "        run()\n"
        "    except RuntimeError as error:\n"
        "        said[api] = str(error)\n"
        "print(json.dumps(said))\n"
    )
    said = _last_json(_run(script))
    assert set(said) == {"measure_step", "profile", "recompute"}, said
    for api, message in said.items():
        assert message.startswith(
            f"{api}: TensorFlow keeps no allocator statistics for this device"
        ), message
        assert "Received: device='CPU:0'" in message
        assert "tfrecompute.count_cpu_memory()" in message and "=true" in message


def test_a_variable_set_to_false_is_named_in_the_error():
    script = MODEL + (
        "try:\n"
        "    tfrecompute.measure_step(model(), x, y)\n"
        "except RuntimeError as error:\n"
        "    print(json.dumps({'error': str(error)}))\n"
    )
    message = _last_json(_run(script, TF_CPU_ALLOCATOR_USE_BFC="false"))["error"]
    assert "TF_CPU_ALLOCATOR_USE_BFC='false' in the environment keeps" in message, message


def test_count_cpu_memory_after_importing_keras_lets_every_measurement_run():
    script = MODEL.replace(
        "import tfrecompute\n", "import tfrecompute\ntfrecompute.count_cpu_memory()\n"
    ) + (
        "m = model()\n"
        "stored = tfrecompute.measure_step(m, x, y).peak_bytes\n"
        "trace = tfrecompute.trace_step(m, x, y)\n"
        "plan = tfrecompute.plan(m, 'sqrt', sample=(x, y), calibrate=True)\n"
        "tfrecompute.recompute(m, plan)\n"
        "sqrt = tfrecompute.measure_step(m, x, y).peak_bytes\n"
        "print(json.dumps({'stored': stored, 'requested': trace.requested_peak_bytes,\n"
        "                  'sqrt': sqrt, 'replayed': plan.replayed_peak_bytes}))\n"
    )
    found = _last_json(_run(script))
    activations = 8 * 1024 * 512 * 4  # eight 2 MiB outputs a stored step keeps
    assert found["stored"] >= activations and found["requested"] >= activations, found
    assert found["sqrt"] < found["stored"], found
    assert found["replayed"] is not None and found["replayed"] > 0, found


def test_count_cpu_memory_after_tensorflow_started_raises_at_once():
    script = MODEL + (
        "m = model()\n"  # building the model starts TensorFlow's runtime
        "try:\n"
        "    tfrecompute.count_cpu_memory()\n"
        "except RuntimeError as error:\n"
        "    print(json.dumps({'error': str(error)}))\n"
    )
    message = _last_json(_run(script))["error"]
    assert message.startswith("count_cpu_memory: TensorFlow's runtime has started"), message


def test_a_variable_set_after_tensorflow_started_is_named_in_the_error():
    script = MODEL + (
        "import os\n"
        "m = model()\n"
        "os.environ['TF_CPU_ALLOCATOR_USE_BFC'] = 'true'\n"
        "try:\n"
        "    tfrecompute.measure_step(m, x, y)\n"
        "except RuntimeError as error:\n"
        "    print(json.dumps({'error': str(error)}))\n"
    )
    message = _last_json(_run(script))["error"]
    assert "TF_CPU_ALLOCATOR_USE_BFC=true was set after TensorFlow's runtime started" in message


def test_count_cpu_memory_leaves_a_process_with_onednn_as_it_is():
    script = (
        "import json, os\n"
        "import tfrecompute\n"
        "tfrecompute.count_cpu_memory()\n"
        "from tfrecompute._keras_internals import onednn_enabled\n"
        "print(json.dumps({'set': os.environ.get('TF_CPU_ALLOCATOR_USE_BFC'),\n"
        "                  'onednn': onednn_enabled()}))\n"
    )
    assert _with_onednn(script) == {"set": None, "onednn": True}
    assert _last_json(_run(script)) == {"set": "true", "onednn": False}


@pytest.mark.slow
def test_max_batch_size_probes_count_cpu_memory_themselves():
    script = MODEL.replace("np.random.default_rng(0).normal(size=(1024, 512))", "np.ones((8, 512))")
    script = script.replace("np.zeros((1024, 1)", "np.zeros((8, 1)") + (
        "found = tfrecompute.max_batch_size(model(), (x, y), budget='1GiB', multiple=8,\n"
        "                                   limit=16, progress=False)\n"
        "print(json.dumps({'batch_size': found.batch_size}))\n"
    )
    assert _last_json(_run(script)) == {"batch_size": 16}


@pytest.mark.slow
def test_the_main_demo_runs_as_pasted():
    result = _run("", "examples/quickstart.py", "--depth", "4", "--width", "256")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "of the memory" in result.stdout and "weight difference" in result.stdout


def test_the_command_line_counts_cpu_memory_itself(tmp_path):
    saved = tmp_path / "chain.keras"
    script = MODEL.replace(
        "import tfrecompute\n", "import tfrecompute\ntfrecompute.count_cpu_memory()\n"
    )
    _last_json(_run(script + f"model().save({str(saved)!r})\nprint(json.dumps({{}}))\n"))
    result = _run("", "-m", "tfrecompute", "plan", str(saved), "--batch-size", "512", "--calibrate")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Memory calibrated by a measured step storing everything" in result.stdout


@pytest.mark.parametrize(("machine_mib", "cap"), [(1 << 17, str(1 << 17)), (24 << 10, None)])
def test_count_cpu_memory_raises_the_bfc_cap_to_a_larger_machines_memory(
    monkeypatch, machine_mib, cap
):
    from tfrecompute import _keras_internals, startup

    environment = {k: v for k, v in os.environ.items() if not k.startswith("TF_CPU_")}
    monkeypatch.setattr(os, "environ", environment)  # this process's own is left as it was
    monkeypatch.setattr(_keras_internals, "onednn_enabled", lambda: False)
    monkeypatch.setattr(_keras_internals, "runtime_started", lambda: False)
    monkeypatch.setattr(startup, "_physical_mib", lambda: machine_mib)
    startup.count_cpu_memory()
    assert environment[CPU_ALLOCATOR_VARIABLE] == "true"
    assert environment.get("TF_CPU_BFC_MEM_LIMIT_IN_MB") == cap


def test_the_two_counting_allocators_differ_on_buffers_under_256_kib():
    # Why count_cpu_memory leaves a process with oneDNN as it is: oneDNN's allocator serves
    # small buffers outside its statistics, TensorFlow's BFC allocator counts them.
    script = (
        "import json\n"
        "import tensorflow as tf\n"
        "from tfrecompute._keras_internals import onednn_enabled\n"
        "from tfrecompute.costs.measured import counted_from\n"
        "large = tf.ones([1024, 1024])\n"
        "before = tf.config.experimental.get_memory_info('CPU:0')['current']\n"
        "small = [tf.ones([100, 100]) + i for i in range(20)]\n"  # 40 KB each
        "added = tf.config.experimental.get_memory_info('CPU:0')['current'] - before\n"
        "print(json.dumps({'added': added, 'onednn': onednn_enabled(), "
        "'counted_from': counted_from('test', 'CPU:0')}))\n"
    )
    onednn = _with_onednn(script)
    bfc = _last_json(_run(script, TF_CPU_ALLOCATOR_USE_BFC="true"))
    assert bfc["added"] >= 20 * 100 * 100 * 4, bfc
    assert onednn["added"] < 0.1 * bfc["added"], (onednn, bfc)
    # What the replay of a calibrated plan takes the allocator to count, asked of it.
    assert (onednn["counted_from"], bfc["counted_from"]) == (256 << 10, 0)
    both = _last_json(_run(script, TF_ENABLE_ONEDNN_OPTS="1", TF_CPU_ALLOCATOR_USE_BFC="true"))
    assert both["added"] >= 20 * 100 * 100 * 4 and both["counted_from"] == 0, both
