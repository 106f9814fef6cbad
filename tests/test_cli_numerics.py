"""`mixprec inspect` / `mixprec diagnose`: targets, example-input hooks, output,
exit statuses."""

import json
import sys
import textwrap

import pytest

import mixprec
from mixprec._src.cli import main as cli, precisions
from mixprec._src.cli.numerics import TargetError, load_target


MODULE = textwrap.dedent(
    """
    import jax.numpy as jnp

    def f(w, x):
        h = x @ w
        return h * 300.0  # line 6: 256 * 300 overflows float16

    def f_example_args():
        return jnp.eye(8), jnp.full((8, 8), 256.0)

    def small_args():
        return [jnp.eye(8), jnp.full((8, 8), 2.0)]

    def g(x, *, scale):
        return x * scale

    def g_example_args():
        return {"x": jnp.ones(3), "scale": 2.0}

    def broken(w, x):
        h = x @ w
        raise RuntimeError("planted in the user's code")  # line 22

    def broken_example_args():
        return jnp.eye(8), jnp.ones((8, 8))

    def rejects(x):
        if x.shape[0] != 5:
            raise ValueError("x must have 5 rows")  # line 29
        return x

    def rejects_example_args():
        return (jnp.ones(3),)

    def scalars(w, n):
        return w * n

    def scalars_example_args():
        return 3, 4

    def identity(x):
        return x

    def identity_example_args():
        return (jnp.ones(3),)

    NOT_A_FUNCTION = 3

    def bad_hook(x):
        return x * 2.0

    def bad_hook_example_args():
        return jnp.ones(3) + jnp.ones(4)  # line 53
    """
)


@pytest.fixture
def target(tmp_path):
    path = tmp_path / "planted_mod.py"
    path.write_text(MODULE)
    return str(path)


def run(capsys, argv):
    status = cli.main(argv)
    out = capsys.readouterr()
    return status, out.out, out.err


def test_diagnose_json_from_a_file_target(capsys, target):
    status, out, _ = run(capsys, ["diagnose", f"{target}:f", "--json"])
    assert status == 0
    d = json.loads(out)
    first = d["ops"][d["first_nonfinite"]]
    assert first["primitive"] == "mul" and first["line"] == 6
    assert first["overflow"] == 64 and first["out_dtypes"] == ["float16"]
    assert d["policy"] == "p=f32,c=f16,o=f32"
    assert d["suggested_mixlist"] == {"black-list": {"to-add": ["mul"]}}


def test_diagnose_table_and_fail_on_problems(capsys, target):
    status, out, _ = run(
        capsys, ["diagnose", f"{target}:f", "--plain", "--fail-on-problems"]
    )
    assert status == cli.EXIT_PROBLEMS == 3
    assert "first NaN/inf: mul" in out and "planted_mod.py:6 (f)" in out
    assert '"to-add": ["mul"]' in out
    status, out, _ = run(
        capsys,
        ["diagnose", f"{target}:f", "--args", "small_args", "--fail-on-problems"],
    )
    assert status == 0 and "no op overflows" in out


def test_diagnose_with_a_mixlist_and_bf16(capsys, target):
    spec = json.dumps({"black-list": {"to-add": ["mul"]}})
    status, out, _ = run(
        capsys, ["diagnose", f"{target}:f", "--mixlist", spec, "--json"]
    )
    assert status == 0 and json.loads(out)["ops"][1]["decision"] == "float32"
    status, out, _ = run(
        capsys,
        ["diagnose", f"{target}:f", "--policy", "mixed_bfloat16", "--json"],
    )
    assert json.loads(out)["first_nonfinite"] is None


def test_inspect_table_and_json(capsys, target):
    status, out, _ = run(capsys, ["inspect", f"{target}:f", "--plain"])
    assert status == 0
    assert "dot_general" in out and "f16,f16" in out and "planted_mod.py:6" in out
    status, out, _ = run(capsys, ["inspect", f"{target}:f", "--json"])
    d = json.loads(out)
    assert [op["primitive"] for op in d["ops"]] == ["dot_general", "mul"]
    assert d["ops"][0]["decision"] == "low"
    status, out, _ = run(capsys, ["inspect", f"{target}:f", "--width", "160"])  # rich
    assert status == 0 and "┃" in out
    # Too narrow for a rich table with a readable reason column: plain text,
    # each reason under its row.
    status, out, _ = run(capsys, ["inspect", f"{target}:f", "--width", "80"])
    assert status == 0 and "┃" not in out and "    reason: allow list" in out


def test_module_target_and_keyword_example_args(capsys, target, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    fn, args = load_target("planted_mod:g")
    assert args == () and float(fn().sum()) == 6.0
    status, out, _ = run(capsys, ["inspect", "planted_mod:f", "--json"])
    assert status == 0 and json.loads(out)["ops"][0]["primitive"] == "dot_general"
    status, out, _ = run(
        capsys, ["inspect", "planted_mod:f", "--args", "planted_mod:small_args"]
    )
    assert status == 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["inspect", "no_such_module_xyz:f"], "cannot import module"),
        (["inspect", "nocolon"], "module:function"),
        (["diagnose", "{t}:h"], "function 'h' not found"),
        (["diagnose", "{t}:small_args"], "small_args_example_args"),
        (["inspect", "{t}:f", "--args", "nope"], "example-args callable 'nope'"),
        (["inspect", "/no/such/file.py:f"], "does not exist"),
    ],
)
def test_bad_targets_exit_1_with_a_message(capsys, target, argv, message):
    argv = [a.replace("{t}", target) for a in argv]
    status, out, err = run(capsys, argv)
    assert status == cli.EXIT_ERROR and out == ""
    assert err.startswith(f"mixprec {argv[0]}: error: ")
    assert message in err and err.count("\n") == 1
    assert "_mixprec_target" not in err  # no internal module names


# ----------------------------------------------------------------------------- targets


def test_a_file_target_imports_modules_beside_it(capsys, tmp_path, monkeypatch):
    # As `python project/model.py` would: the file's directory is on sys.path
    # while it is imported and run (a lazy import inside the function too).
    project = tmp_path / "project"
    project.mkdir()
    (project / "beside_helper.py").write_text("def double(x):\n    return x * 2.0\n")
    (project / "beside_lazy.py").write_text("def neg(x):\n    return -x\n")
    (project / "beside_model.py").write_text(
        textwrap.dedent(
            """
            import jax.numpy as jnp
            import beside_helper

            def f(w, x):
                import beside_lazy
                return beside_lazy.neg(beside_helper.double(x @ w))

            def f_example_args():
                return jnp.eye(4), jnp.ones((4, 4))
            """
        )
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    path_before = list(sys.path)
    status, out, err = run(
        capsys, ["inspect", "../project/beside_model.py:f", "--json"]
    )
    assert status == 0, err
    ops = json.loads(out)["ops"]
    assert [op["primitive"] for op in ops] == ["dot_general", "mul", "neg"]
    assert sys.path == path_before  # restored afterwards
    # `module:function` still imports from the current directory.
    monkeypatch.chdir(project)
    status, out, err = run(capsys, ["inspect", "beside_model:f", "--json"])
    assert status == 0, err
    assert len(json.loads(out)["ops"]) == 3


@pytest.mark.parametrize(
    ("name", "exception", "line", "code"),
    [
        (
            "broken",
            "RuntimeError: planted in the user's code",
            22,
            "raise RuntimeError",
        ),
        ("rejects", "ValueError: x must have 5 rows", 29, "raise ValueError"),
        ("bad_hook", "TypeError: add got incompatible shapes", 53, "jnp.ones(3) +"),
    ],
)
@pytest.mark.parametrize("command", ["inspect", "diagnose"])
def test_an_error_in_the_users_code_names_its_file_and_line(
    capsys, target, command, name, exception, line, code
):
    status, out, err = run(capsys, [command, f"{target}:{name}"])
    assert status == cli.EXIT_ERROR and out == ""
    assert err.startswith(f"mixprec {command}: error: ")
    assert exception in err
    assert f"planted_mod.py:{line} in {name}" in err and code in err
    assert "--verbose" in err and "Traceback" not in err
    assert "_mixprec_target" not in err
    # --verbose: the full traceback as well, then the same message.
    status, out, err = run(capsys, [command, f"{target}:{name}", "--verbose"])
    assert status == cli.EXIT_ERROR
    assert "Traceback (most recent call last)" in err
    assert f'planted_mod.py", line {line}, in {name}' in err
    assert err.rstrip().splitlines()[-1].strip().startswith("at ")


def test_an_error_while_importing_the_target_names_its_line(capsys, tmp_path):
    path = tmp_path / "import_fails.py"
    path.write_text("import jax\n\nVALUE = 1 / 0\n\ndef f(x):\n    return x\n")
    status, _, err = run(capsys, ["inspect", f"{path}:f"])
    assert status == cli.EXIT_ERROR
    assert "raised ZeroDivisionError: division by zero" in err
    assert "import_fails.py:3 in <module>: VALUE = 1 / 0" in err
    path.write_text("def f(x)\n    return x\n")
    status, _, err = run(capsys, ["inspect", f"{path}:f"])
    assert status == cli.EXIT_ERROR and "SyntaxError" in err
    assert "import_fails.py:1" in err


def test_an_internal_error_is_not_blamed_on_the_user(capsys, target, monkeypatch):
    # No frame of the user's code in the traceback: mixprec's own bug keeps its
    # traceback (see test_cli.py::test_an_internal_bug_is_not_hidden).
    def buggy(*args, **kwargs):
        raise ZeroDivisionError("mixprec bug")

    monkeypatch.setattr(mixprec, "explain", buggy)
    with pytest.raises(ZeroDivisionError):
        cli.main(["inspect", f"{target}:f"])


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("scalars", "hold no array (got int, int)"),
        ("identity", "ran no JAX operation on its array arguments"),
    ],
)
@pytest.mark.parametrize("command", ["inspect", "diagnose"])
def test_a_target_with_nothing_to_report_is_refused(
    capsys, target, command, name, message
):
    status, out, err = run(capsys, [command, f"{target}:{name}", "--json"])
    assert status == cli.EXIT_ERROR and out == ""
    assert message in err


def test_a_non_callable_target_says_what_was_expected(capsys, target):
    status, _, err = run(capsys, ["inspect", f"{target}:NOT_A_FUNCTION"])
    assert status == cli.EXIT_ERROR
    assert "names a `int` (3), not a function" in err
    assert "expected `module:function` naming a callable" in err
    assert "not callable" not in err


# ----------------------------------------------------------------------------- policies


@pytest.mark.parametrize("alias", sorted(precisions.PRECISION_ALIASES))
def test_a_precision_alias_means_what_it_means_in_the_demo(alias):
    policy, _ = precisions.resolve_policy(alias, command="inspect")
    assert policy == mixprec.get_policy(precisions.PRECISION_ALIASES[alias])


def test_bf16_is_mixed_on_the_command_line_and_the_note_says_so(capsys, target):
    status, out, err = run(
        capsys, ["inspect", f"{target}:f", "--policy", "bf16", "--json"]
    )
    assert status == 0
    assert json.loads(out)["policy"] == "p=f32,c=bf16,o=f32"
    assert "`--policy bf16` means mixed_bfloat16" in err
    assert "p=bf16,c=bf16,o=bf16" in err  # how to get JMP's pure bfloat16
    status, out, err = run(
        capsys, ["inspect", f"{target}:f", "--policy", "p=bf16,c=bf16,o=bf16", "--json"]
    )
    assert json.loads(out)["policy"] == "p=bf16,c=bf16,o=bf16" and err == ""
    # The library keeps JMP's meaning.
    assert str(mixprec.get_policy("bf16")) == "p=bf16,c=bf16,o=bf16"


@pytest.mark.parametrize(
    "spec", ["float8_e4m3fn", "float8_e5m2", "p=f32,c=float8_e4m3fn"]
)
def test_raw_float8_is_refused_with_a_pointer_to_mixed_float8(capsys, target, spec):
    status, out, err = run(capsys, ["inspect", f"{target}:f", "--policy", spec])
    assert status == cli.EXIT_USAGE and out == ""
    assert f"argument --policy: {spec!r} runs every op in float8" in err
    assert "`--policy mixed_float8`" in err
    status, out, _ = run(capsys, ["inspect", f"{target}:f", "--policy", "mixed_float8"])
    assert status == 0 and "float8" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["inspect", "{t}:f", "--policy", "mixed_float61"], "did you mean"),
        (["diagnose", "{t}:f", "--mode", "fast"], "allow_mix_precision"),
        (["diagnose", "{t}:f", "--mixlist", "{{"], "malformed JSON"),
    ],
)
def test_values_mixprec_rejects_are_usage_errors(capsys, target, argv, message):
    # Checked before the target runs, reported as argparse reports a bad flag:
    # the subcommand's usage, the flag, the reason, status 2.
    argv = [a.replace("{t}", target) for a in argv]
    status, out, err = run(capsys, argv)
    assert status == cli.EXIT_USAGE and out == ""
    assert err.startswith(f"usage: mixprec {argv[0]} ")
    assert f"mixprec {argv[0]}: error: argument {argv[2]}: " in err
    assert "ValueError" not in err and message in err


def test_load_target_errors_are_cli_errors():
    with pytest.raises(TargetError, match="module:function") as info:
        load_target("nocolon")
    assert isinstance(info.value, cli.CLIError)


def test_diagnose_without_fail_on_problems_exits_0(capsys, target):
    status = cli.main(["diagnose", f"{target}:f", "--json"])
    assert status == 0
    assert json.loads(capsys.readouterr().out)["to_black_list"] == ["mul"]
