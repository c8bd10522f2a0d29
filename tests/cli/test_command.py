"""The `tfrecompute` command line, run in-process through `main(argv)`."""

from __future__ import annotations

import io
import os
import pathlib
import re
import subprocess
import sys

import keras
import pytest

import tfrecompute  # noqa: F401  (registers RecomputeBlock)
from tests import any_models
from tfrecompute.cli.command import main

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@keras.saving.register_keras_serializable(package="tfrecompute_tests")
class _Subclassed(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(4)

    def call(self, x):
        return self.dense(x)


def _convnext_like() -> keras.Model:
    """Two ConvNeXt blocks, small, with the long layer names of keras-hub's ConvNeXt."""
    inputs = keras.Input((16, 16, 3))
    x = keras.layers.Conv2D(16, 4, strides=4, name="convnext_tiny_stem_conv")(inputs)
    x = keras.layers.LayerNormalization(name="convnext_tiny_stem_layernorm")(x)
    for b in range(2):
        p = f"convnext_tiny_stage_0_block_{b}"
        h = keras.layers.DepthwiseConv2D(7, padding="same", name=f"{p}_depthwise_conv")(x)
        h = keras.layers.LayerNormalization(name=f"{p}_layernorm")(h)
        h = keras.layers.Dense(64, name=f"{p}_pointwise_conv_1")(h)
        h = keras.layers.Activation("gelu", name=f"{p}_gelu")(h)
        h = keras.layers.Dense(16, name=f"{p}_pointwise_conv_2")(h)
        x = keras.layers.Add(name=f"{p}_add")([x, h])
    x = keras.layers.GlobalAveragePooling2D(name="convnext_tiny_head_global_average_pooling")(x)
    outputs = keras.layers.Dense(10, name="convnext_tiny_head_dense")(x)
    return keras.Model(inputs, outputs, name="convnext_like")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("cli_models")
    keras.utils.set_random_seed(0)
    mlp = keras.Sequential(
        [keras.Input((32,))]
        + [keras.layers.Dense(32, activation="relu", name=f"hidden_{i}") for i in range(6)]
        + [keras.layers.Dense(4, name="head")]
    )
    inputs = x = keras.Input((16,))
    for i in range(3):
        h = keras.layers.Dense(16, activation="relu", name=f"block{i}_a")(x)
        h = keras.layers.Dense(16, name=f"block{i}_b")(h)
        x = keras.layers.Add(name=f"block{i}_add")([x, h])
    residual = keras.Model(inputs, keras.layers.Dense(2, name="out")(x))
    subclassed = _Subclassed()
    subclassed(keras.ops.zeros((1, 8)))
    compiled = keras.models.clone_model(mlp)
    compiled.compile(optimizer="adam", loss="mse")  # saved compiled, never trained
    paths = {}
    saved = [("mlp", mlp), ("residual", residual), ("subclassed", subclassed)]
    saved += [("compiled", compiled), ("convnext", _convnext_like())]
    saved += [("bert", any_models.bert(layers=1, hidden=16, sequence=8, batch=2)[0])]
    for name, model in saved:
        paths[name] = str(folder / f"{name}.keras")
        model.save(paths[name])
    paths["garbage"] = str(folder / "garbage.keras")
    pathlib.Path(paths["garbage"]).write_bytes(b"not a zip file")
    return paths


def test_dim_fixes_a_backbones_unknown_dimensions(models, capsys):
    assert main(["plan", models["bert"], "--batch-size", "2"]) == 1
    err = capsys.readouterr().err
    assert "has shape (None, None)" in err and "Pass --dim N" in err
    assert main(["plan", models["bert"], "--batch-size", "2", "--dim", "16"]) == 0
    assert "Plan 'optimal'" in capsys.readouterr().out


def _is_png(path: pathlib.Path) -> bool:
    return path.is_file() and path.stat().st_size > 1000 and path.read_bytes()[:8] == PNG_SIGNATURE


def test_plan_prints_segments_and_peak(models, capsys):
    code = main(["plan", models["mlp"], "--batch-size", "256", "--strategy", "uniform:3"])
    out = capsys.readouterr().out
    assert code == 0
    assert "Plan 'uniform:3' for a chain of 7 links" in out
    assert "hidden_0 … hidden_2 (3 links)  recomputed" in out
    assert "Predicted peak:" in out and "KiB" in out
    assert "Recompute cost:" in out and "% of one forward pass" in out
    assert main(["plan", models["mlp"], "--batch-size", "256", "--strategy", "uniform:3",
                 "--all-names"]) == 0  # fmt: skip
    assert "hidden_0, hidden_1, hidden_2  recomputed" in capsys.readouterr().out


def test_plan_with_budget_on_functional_model(models, capsys):
    argv = ["plan", models["residual"], "--batch-size", "1024", "--strategy", "optimal"]
    argv += ["--budget", "800KiB"]
    code = main(argv)
    out = capsys.readouterr().out
    assert code == 0
    assert "Plan 'optimal'" in out and "(proven optimal)" in out
    rows = [line for line in out.splitlines() if "recomputed" in line]
    # A row of more than two calls is named by its first and last and a count.
    assert rows and any(re.search(r"block\d_a … block\d_add \(2 links\)", row) for row in rows)
    peak = int(out.split("Predicted peak: ")[1].split("(")[1].split()[0])
    assert peak <= 560 * 1024  # 800 KiB less the default headroom of 30%
    assert main([*argv, "--all-names"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if "recomputed" in line]
    # a merged link (a Dense and the Add after it) is among the recomputed ones
    assert rows and any(re.search(r"block\d_a, block\d_b\+block\d_add", row) for row in rows)


def _predicted_peak(out: str) -> int:
    return int(out.split("Predicted peak: ")[1].split("(")[1].split()[0])


def test_headroom_sets_how_much_of_the_budget_is_planned(models, capsys):
    argv = ["plan", models["residual"], "--batch-size", "1024", "--strategy", "optimal"]
    peaks = {}
    for headroom in ("0", "0.3", "0.35"):
        assert main([*argv, "--budget", "800KiB", "--headroom", headroom]) == 0
        peaks[headroom] = _predicted_peak(capsys.readouterr().out)
        assert peaks[headroom] <= (1 - float(headroom)) * 800 * 1024
    assert peaks["0"] > 560 * 1024 >= peaks["0.3"] >= peaks["0.35"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--headroom", "0.3"], "tfrecompute plan: --headroom only applies to a --budget"),
        (
            ["--budget", "1MiB", "--headroom", "1"],
            "tfrecompute plan: --headroom must be a number in [0, 1). Received: --headroom='1'",
        ),
        (["--budget", "1MiB", "--headroom", "-0.1"], "Received: --headroom='-0.1'"),
        (["--budget", "1MiB", "--headroom", "a lot"], "--headroom must be a number in [0, 1)"),
    ],
)
def test_bad_headroom_is_a_usage_error(models, capsys, extra, message):
    assert main(["plan", models["mlp"], "--batch-size", "8", *extra]) == 2
    assert message in capsys.readouterr().err


def test_profile_table(models, capsys):
    code = main(["profile", models["residual"], "--batch-size", "512"])
    captured = capsys.readouterr()
    assert code == 0
    header = captured.out.splitlines()[1].split()
    # Short headers ("copy", "FLOPs", explained below the table) leave the names room.
    assert header == ["#", "name", "output", "saved", "workspace", "grads", "copy", "FLOPs"]
    rows = {line.split()[1]: line.split() for line in captured.out.splitlines()[2:9]}
    # output, saved, workspace, grads, input copy: (value, unit) pairs after "#" and the name.
    cells = [" ".join(rows["block0_a"][k : k + 2]) for k in range(2, 12, 2)]
    assert cells[0] == "32.00 KiB"  # 512 x 16 x float32
    assert cells[3] == "1.06 KiB"  # kernel 16 x 16 and bias 16, float32
    assert cells[4] == "32.00 KiB"  # the recompute's copy of the model input
    assert " ".join(rows["out"][8:10]) == "136 B"  # kernel 16 x 2 and bias 2
    assert "Weight gradients (grads): each updated during the backward of the next 2" in (
        captured.out
    )
    assert "Predicted peak without recompute:" in captured.out
    assert "profiled 10 layer calls" in captured.err


def test_profile_says_when_the_optimizer_keeps_every_gradient(models, capsys, tmp_path):
    model = keras.models.load_model(models["residual"])
    model.compile(optimizer=keras.optimizers.SGD(global_clipnorm=1.0), loss="mse")
    path = str(tmp_path / "clipped.keras")
    model.save(path)
    assert main(["profile", path, "--batch-size", "512"]) == 0
    out = capsys.readouterr().out
    assert "Weight gradients (grads): all kept until the step's end" in out
    # The two largest gradients: the kernels of the 16 x 16 Dense layers.
    assert "and 2.00 KiB of copies as it updates" in out
    assert "each updated" not in out


def test_frontier_plot(models, capsys, tmp_path):
    png = tmp_path / "frontier.png"
    code = main(
        [
            "frontier",
            models["residual"],
            "--batch-size",
            "1024",
            "--budget",
            "1MiB",
            "--plot",
            str(png),
        ]  # fmt: skip
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "peak" in out and "recompute cost" in out and "segments" in out
    for name in ("none ", "sqrt ", "heuristic ", "optimal @ 1MiB "):
        assert f"\n{name}" in out
    assert _is_png(png)


def test_timeline_plot(models, capsys, tmp_path):
    png = tmp_path / "timeline.png"
    code = main(["timeline", models["mlp"], "--batch-size", "2048", "--plot", str(png)])
    out = capsys.readouterr().out
    assert code == 0
    # A table of both plans' peaks (it was a sentence per plan, too wide for 100 columns).
    rows = {line.split()[0]: line for line in out.splitlines()[2:4]}
    assert set(rows) == {"none", "optimal"} and "of link" in rows["optimal"]
    assert "optimal uses" in out and "of the peak of none" in out
    assert _is_png(png)


def test_the_demo_is_the_quickstart_example(capsys):
    # One demo: examples/quickstart.py (the README's first command); the
    # command line has none of its own.
    assert main(["demo"]) == 2
    assert "invalid choice: 'demo'" in capsys.readouterr().err


def test_missing_model_file(tmp_path, capsys):
    code = main(["plan", str(tmp_path / "nope.keras"), "--batch-size", "8"])
    assert code == 2
    err = capsys.readouterr().err
    assert "tfrecompute plan: the model file does not exist. Received: model=" in err


def test_unreadable_model_file(models, capsys):
    assert main(["profile", models["garbage"], "--batch-size", "8"]) == 1
    assert "tfrecompute profile: cannot load the model file" in capsys.readouterr().err


def test_subclassed_model(models, capsys):
    assert main(["plan", models["subclassed"], "--batch-size", "8"]) == 1
    assert "a subclassed or unbuilt model has no declared inputs" in capsys.readouterr().err


def test_malformed_budget(models, capsys):
    code = main(["plan", models["mlp"], "--batch-size", "8", "--budget", "2 gigs"])
    assert code == 2
    err = capsys.readouterr().err
    assert "tfrecompute plan: unknown unit 'gigs'. Received: --budget='2 gigs'" in err


def test_infeasible_budget_reports_minimum(models, capsys):
    argv = ["plan", models["mlp"], "--batch-size", "256", "--strategy", "optimal"]
    assert main([*argv, "--budget", "1KiB"]) == 1
    err = capsys.readouterr().err
    # One line, sizes in binary units with the exact byte count in brackets.
    assert err.count("\n") == 1 and err.startswith("error: tfrecompute plan: the plan must fit in")
    assert "the budget 1.00 KiB (1024 bytes) less 30% headroom for the allocator" in err
    assert "the least predicted peak the strategy reaches is" in err
    assert "Received: budget='1KiB' (of type str)" in err
    found = re.search(r"Raise the budget to at least \d+\.\d\d KiB \((\d+) bytes\)", err)
    assert found, err
    minimum = found.group(1)
    assert main([*argv, "--budget", minimum]) == 0  # the minimum it names is feasible
    assert "Plan 'optimal'" in capsys.readouterr().out
    assert main([*argv, "--budget", str(int(minimum) - 1)]) == 1  # and the least one


def test_unknown_strategy(models, capsys):
    assert main(["plan", models["mlp"], "--batch-size", "8", "--strategy", "fast"]) == 2
    err = capsys.readouterr().err
    assert "unknown strategy. Received: --strategy='fast'" in err
    assert "heuristic, none, optimal, sqrt, uniform:<k>" in err


def test_usage_errors_exit_2(models, capsys):
    assert main(["plan", models["mlp"]]) == 2  # --batch-size is required
    assert main(["plan", models["mlp"], "--batch-size", "0"]) == 2
    assert main([]) == 2
    assert "usage: tfrecompute" in capsys.readouterr().err


def test_plot_without_matplotlib(models, capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    png = tmp_path / "out.png"
    code = main(["frontier", models["mlp"], "--batch-size", "8", "--plot", str(png)])
    assert code == 1
    assert 'pip install "tfrecompute[plot]"' in capsys.readouterr().err
    assert not png.exists()


def test_python_m_help():
    root = pathlib.Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "TF_CPP_MIN_LOG_LEVEL": "3"}
    result = subprocess.run(
        [sys.executable, "-m", "tfrecompute", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    for command in ("plan", "profile", "frontier", "timeline"):
        assert command in result.stdout


@pytest.mark.parametrize(
    ("done", "total", "bar"),
    [
        (0, 10, "[----------]  0/10"),
        (5, 10, "[#####-----]  5/10"),
        (7, 10, "[#######---]  7/10"),
        (10, 10, "[##########] 10/10"),
        (1, 3, "[###-------] 1/3"),
        (0, 0, "[##########] 0/0"),
    ],
)
def test_progress_bar(done, total, bar):
    from tfrecompute.cli.command import _progress_bar

    assert _progress_bar(done, total, width=10) == f"profiling {bar} layer calls"


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_profile_draws_a_progress_bar_on_a_terminal(models):
    from tfrecompute.cli.command import _profile

    terminal = _Terminal()
    chain = _profile(keras.models.load_model(models["residual"]), 64, progress=terminal)
    frames = terminal.getvalue().split("\r")[1:]
    assert chain.n > 0
    # One frame per analysed call, filling up, then the summary over the bar.
    counts = [f.split("] ")[1].split(" layer")[0] for f in frames[:-1]]
    assert counts == [f"{i:>2}/10" for i in range(1, 11)]
    assert frames[-2].startswith("profiling [" + "#" * 30 + "]")
    assert frames[-1].startswith("profiled 10 layer calls in ") and frames[-1].endswith("\n")
    assert len(frames[-1].rstrip("\n")) >= len(frames[-2])


# ------------------------------------------------------------- the first five minutes

_WRAPPER = """
import runpy, sys, time
start = time.perf_counter()
sys.argv = ["tfrecompute", *sys.argv[1:]]
try:
    runpy.run_module("tfrecompute", run_name="__main__")
except SystemExit as exit_:
    code = exit_.code
answered = time.perf_counter() - start
loaded = sorted({m.split(".")[0] for m in sys.modules} & {"tensorflow", "keras"})
start = time.perf_counter()
import tensorflow
print()
print("RESULT", code, ",".join(loaded) or "-", answered / (time.perf_counter() - start))
"""


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["plan", "--help"],
        ["plan", "model.keras", "--batch-size", "8", "--budget", "204M"],
        ["frontier", "model.keras", "--batch-size", "8", "--strategy", "fast"],
        ["timeline", "model.keras", "--batch-size", "8", "--budget", "1GiB", "--headroom", "2"],
        ["plan", "no_such_model.keras", "--batch-size", "8"],
    ],
)
def test_help_and_usage_errors_answer_before_tensorflow_is_imported(argv, tmp_path):
    root = pathlib.Path(__file__).resolve().parents[2]
    (tmp_path / "model.keras").write_bytes(b"never read: the options fail first")
    result = subprocess.run(
        [sys.executable, "-c", _WRAPPER, *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    _, code, loaded, ratio = result.stdout.splitlines()[-1].split()
    assert code == ("0" if "--help" in argv else "2"), result.stderr
    assert loaded == "-"  # neither tensorflow nor keras
    # Answering takes a small share of what importing TensorFlow alone takes (about 0.05).
    assert float(ratio) < 0.5


def test_a_command_prints_no_tensorflow_start_up_logs(models):
    root = pathlib.Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TF_CPP")}
    argv = ["plan", models["compiled"], "--batch-size", "8"]
    quiet = subprocess.run(
        [sys.executable, "-m", "tfrecompute", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        env={**env, "PYTHONPATH": str(root)},
    )
    assert quiet.returncode == 0, quiet.stderr[-2000:]
    assert "Plan 'optimal'" in quiet.stdout
    assert quiet.stderr == ""  # no absl, oneDNN, cuda or cuInit lines, no Keras warnings


def test_loading_a_compiled_untrained_model_does_not_warn(models, capsys, recwarn):
    assert main(["profile", models["compiled"], "--batch-size", "8"]) == 0
    assert "Weight gradients (grads): each updated" in capsys.readouterr().out
    assert not [w for w in recwarn if "Skipping variable loading" in str(w.message)]


@pytest.mark.parametrize("command", ["plan", "profile", "timeline"])
def test_tables_fit_100_columns_unless_all_names(models, capsys, command):
    argv = [command, models["convnext"], "--batch-size", "32"]
    if command != "profile":
        argv += ["--strategy", "uniform:2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 100, out
    assert "…" in out  # the long names were cut to fit
    assert main([*argv, "--all-names"]) == 0
    out = capsys.readouterr().out
    assert "convnext_tiny_stage_0_block_1_pointwise_conv_1+convnext_tiny_stage_0_block_1_gelu" in (
        out
    )


def test_an_unforeseen_failure_is_one_error_line(models, capsys, monkeypatch):
    """NOTE [ Unforeseen errors on the command line ]: no traceback unless asked for."""
    from tfrecompute.cli import command

    def broken(args):
        raise KeyError("a bug")

    monkeypatch.setitem(command._COMMANDS, "plan", broken)
    assert main(["plan", models["mlp"], "--batch-size", "8"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: tfrecompute plan: KeyError: 'a bug'.")
    assert "TFRECOMPUTE_TRACEBACK=1" in err
    monkeypatch.setenv("TFRECOMPUTE_TRACEBACK", "1")
    with pytest.raises(KeyError, match="a bug"):
        main(["plan", models["mlp"], "--batch-size", "8"])
