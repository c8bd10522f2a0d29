"""Every example runs (small settings) so that none of them rots."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import keras

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


# NOTE [ Examples say what they do ]: a line before every step that takes long
# (`[   12 s] training ...`, or Keras's progress of fit), and a CPU-time ratio beside
# every wall-time ratio (the wall clock of a shared machine varies by 2x).
PROGRESS = re.compile(r"^\[ *\d+ s\] \w", re.MULTILINE)


def _load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quickstart(capsys):
    _load("quickstart").main(["--depth", "4", "--width", "256", "--batch-size", "512"])
    out = capsys.readouterr().out
    assert len(PROGRESS.findall(out)) >= 3, out
    assert "no recompute" in out and "RecomputeBlock x2" in out
    assert "of the memory" in out and "x the CPU time per step" in out and "x the wall time" in out
    # The two variants trained identically (the same weights after the same steps).
    assert "weight difference with and without recompute is 0.00e+00" in out


def test_mirrored_strategy_example():
    # A subprocess, so that the example splits the CPU before TensorFlow starts, as for a user.
    args = ["--depth", "2", "--width", "64", "--samples", "512", "--batch-size", "128"]
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "mirrored_strategy.py"), *args, "--epochs", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(EXAMPLES.parent)},  # this checkout's tfrecompute
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for noise in ("absl::InitializeLog", "oneDNN", "cuda", "cuInit"):  # quiet_tensorflow()
        assert noise not in result.stderr
    assert "replicas on" in result.stdout and "training 1 epochs: RecomputeBlock" in result.stdout
    assert "with and without recompute: 0.00e+00" in result.stdout


def test_mixed_precision_example(capsys):
    args = ["--depth", "2", "--width", "64", "--samples", "512", "--batch-size", "128"]
    _load("mixed_precision").main([*args, "--epochs", "1"])
    out = capsys.readouterr().out
    assert len(PROGRESS.findall(out)) >= 3 and "training the fixed model 1 epochs" in out
    assert keras.config.dtype_policy().name == "float32"  # the example restores the policy
    assert "check_precision(naive): 4 finding(s)" in out and "is not a LossScaleOptimizer" in out
    assert "check_precision(fixed): 0 finding(s)" in out and "loss scale now" in out


def test_functional_rewrite(capsys):
    args = ["--layers", "2", "--sequence", "32", "--hidden", "64", "--batch-size", "32"]
    _load("functional_rewrite").main(args)
    out = capsys.readouterr().out
    # Under a budget the attention layers give each segment the attention and dots states.
    assert "Plan 'optimal'" in out and re.search(r"selective \((attention|dots)\)", out)
    assert "checkpointed" in out and "of the memory" in out
    assert len(PROGRESS.findall(out)) >= 3
    assert re.search(r"at [0-9.]+x the CPU time per step \([0-9.]+x the wall time", out)
    taken = int(out.split("the checkpointed step took ")[1].split("%")[0])
    assert 0 < taken <= 100  # the headroom keeps the measured peak under the budget


def test_bert_finetune(capsys, recwarn):
    args = ["--layers", "4", "--hidden", "64", "--sequence", "64", "--batch-size", "8"]
    _load("bert_finetune").main([*args, "--budget", "12MiB", "--steps", "2"])
    out = capsys.readouterr().out
    # The weights file carries the optimizer's state: it loads into the same optimizer.
    assert not [w for w in recwarn if "Skipping variable loading" in str(w.message)]
    assert len(PROGRESS.findall(out)) >= 4
    assert re.search(r"[0-9.]+x the CPU time without recompute \([0-9.]+x the wall time", out)
    assert "Plan 'optimal'" in out and "recomputed" in out
    taken = int(out.split("MiB, ")[1].split("%")[0])
    assert 0 < taken <= 100  # the plan's measured step fits its budget
    difference = float(out.split("largest weight difference after 2 steps: ")[1].split()[0])
    assert difference < 1e-5  # the two models trained alike
    assert "BertTextClassifier saved with checkpointing, loaded into one built without: " in out
    loaded = float(out.split("largest weight difference ")[-1].split()[0])
    assert loaded == 0.0


def test_lora_finetune(capsys):
    args = ["--layers", "3", "--hidden", "32", "--sequence", "16", "--batch-size", "2"]
    _load("lora_finetune").main([*args, "--steps", "2"])
    out = capsys.readouterr().out
    assert "training the control model 2 steps" in out and "Checkpoints applied: " in out
    checkpointed = int(out.split(" of 3 frozen transformer layers checkpointed")[0].split()[-1])
    assert checkpointed >= 2
    assert "frozen weights moved 0.0\n" in out
    assert "with and without checkpointing: 0.00e+00" in out
