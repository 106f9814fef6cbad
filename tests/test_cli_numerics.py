"""`mixprec inspect` / `mixprec diagnose`: targets, example-input hooks, output,
exit statuses."""

import json
import textwrap

import pytest

from mixprec._src.cli import main as cli
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
    status, out, _ = run(capsys, ["inspect", f"{target}:f"])  # rich
    assert status == 0 and "┃" in out


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


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["inspect", "{t}:f", "--policy", "mixed_float61"], "mixed_float16"),
        (["diagnose", "{t}:f", "--mode", "fast"], "allow_mix_precision"),
        (["diagnose", "{t}:f", "--mixlist", "{{"], "mixlist"),
    ],
)
def test_values_mixprec_rejects_exit_1_with_its_message(capsys, target, argv, message):
    argv = [a.replace("{t}", target) for a in argv]
    status, out, err = run(capsys, argv)
    assert status == cli.EXIT_ERROR and out == ""
    assert err.startswith(f"mixprec {argv[0]}: error: ValueError: ")
    assert message in err


def test_load_target_errors_are_cli_errors():
    with pytest.raises(TargetError, match="module:function") as info:
        load_target("nocolon")
    assert isinstance(info.value, cli.CLIError)


def test_diagnose_without_fail_on_problems_exits_0(capsys, target):
    status = cli.main(["diagnose", f"{target}:f", "--json"])
    assert status == 0
    assert json.loads(capsys.readouterr().out)["to_black_list"] == ["mul"]
