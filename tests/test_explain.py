"""mixprec.explain: decisions, reasons, source lines, paths, FLOPs and the lint."""

import inspect
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mixprec
from mixprec._src.numerics.record import (
    eqn_flops,
    lint_eqn,
    parse_source,
    short_source,
)
from mixprec._src.numerics.render import render_table


def line_of(fn, marker: str) -> int:
    lines, start = inspect.getsourcelines(fn)
    hits = [start + i for i, text in enumerate(lines) if marker in text]
    assert len(hits) == 1, (marker, hits)
    return hits[0]


def mlp(w1, w2, x):
    h = jnp.tanh(x @ w1)  # <- dot1
    return jax.nn.log_softmax(h @ w2)  # <- dot2


def _mlp_args():
    return jnp.ones((64, 32)), jnp.ones((32, 16)), jnp.ones((8, 64))


@pytest.mark.parametrize(
    ("policy", "low"), [("mixed_bfloat16", "bfloat16"), ("mixed_float16", "float16")]
)
def test_decisions_dtypes_and_lines(policy, low):
    report = mixprec.explain(mlp, *_mlp_args(), policy=policy)
    assert report.low_dtype == low and report.mode == "allow_mix_precision"
    dots = report.find("dot_general")
    assert [d.line for d in dots] == [
        line_of(mlp, "# <- dot1"),
        line_of(mlp, "# <- dot2"),
    ]
    for d in dots:
        assert d.decision == "low" and d.dtype == low and d.op_class == "allow"
        assert d.in_dtypes == (low, low) and d.out_dtypes == (low,)
        assert "allow" in d.reason
        assert d.source.endswith("(mlp)")
    [tanh] = report.find("tanh")
    assert (tanh.decision, tanh.op_class, tanh.out_dtypes) == ("low", "infer", (low,))
    for op in report.find("exp"):  # inside log_softmax
        assert op.decision == "float32" and op.out_dtypes == ("float32",)
        assert "deny" in op.reason
    assert dots[0].flops == 2 * 8 * 64 * 32 and dots[1].flops == 2 * 8 * 32 * 16


def test_low_precision_flop_fraction():
    report = mixprec.explain(mlp, *_mlp_args(), policy="mixed_bfloat16")
    low = sum(op.flops for op in report.ops if op.decision == "low")
    assert report.low_precision_flops == low
    assert report.total_flops == sum(op.flops for op in report.ops)
    assert report.low_precision_flop_fraction == pytest.approx(low / report.total_flops)
    assert 0.9 < report.low_precision_flop_fraction < 1.0
    f32 = mixprec.explain(mlp, *_mlp_args(), policy="mixed_bfloat16", mode="force_fp32")
    assert f32.low_precision_flop_fraction == 0.0
    assert all(op.decision != "low" for op in f32.ops)


def test_mixlist_changes_the_decision_and_the_reason():
    spec = {"black-list": {"to-add": ["tanh"]}}
    report = mixprec.explain(mlp, *_mlp_args(), policy="mixed_bfloat16", mixlist=spec)
    [tanh] = report.find("tanh")
    assert tanh.decision == "float32" and tanh.op_class == "deny"
    assert tanh.out_dtypes == ("float32",)


def test_float32_scope_is_reported_as_a_region():
    def f(w, x):
        h = x @ w
        with mixprec.float32_scope():
            return jnp.tanh(h @ w)  # <- region

    report = mixprec.explain(
        f, jnp.ones((16, 16)), jnp.ones((8, 16)), policy="mixed_bfloat16"
    )
    inner = [op for op in report.ops if op.line == line_of(f, "# <- region")]
    assert inner and all(op.decision != "low" for op in inner)
    assert any("float32_scope" in op.reason for op in inner)
    assert report.find("dot_general")[0].decision == "low"


def test_paths_through_higher_order_primitives():
    @jax.custom_jvp
    def safe(x):
        return jnp.sin(x)

    safe.defjvp(lambda p, t: (safe(p[0]), jnp.cos(p[0]) * t[0]))

    def f(w, xs):
        def body(c, x):
            return jnp.tanh(c @ w + x), None  # <- body

        c, _ = jax.lax.scan(body, xs[0], xs)
        c = jax.lax.cond(c.sum() > 0, jnp.cos, jnp.sin, c)
        c = jax.checkpoint(jnp.exp)(c)
        return jax.jit(safe)(c)

    report = mixprec.explain(
        f, jnp.ones((8, 8)), jnp.ones((5, 4, 8)), policy="mixed_bfloat16"
    )
    [dot] = report.find("dot_general")
    assert dot.path == "scan/body" and dot.line == line_of(f, "# <- body")
    assert dot.flops == 5 * 2 * 4 * 8 * 8  # times the trip count
    paths = {op.path for op in report.ops}
    assert {"cond/branch0", "cond/branch1", "checkpoint"} <= paths
    assert any(p.startswith("jit(safe)/custom_jvp(safe)") for p in paths)


def test_table_dict_json_and_str():
    report = mixprec.explain(mlp, *_mlp_args(), policy="mixed_bfloat16")
    d = json.loads(report.to_json())
    assert d["policy"] == "p=f32,c=bf16,o=f32"
    assert d["low_precision_flop_fraction"] == pytest.approx(
        report.low_precision_flop_fraction
    )
    assert len(d["ops"]) == len(report.ops)
    first = d["ops"][0]
    assert first["primitive"] == "dot_general" and first["decision"] == "low"
    assert first["line"] == line_of(mlp, "# <- dot1")
    assert first["in_shapes"] == [[8, 64], [64, 32]]
    text = str(report)
    assert "dot_general" in text and "bf16,bf16" in text
    assert "in bfloat16" in report.summary() and report.summary() in text
    # The notes come last: here, how this backend runs the bfloat16 dots.
    assert text.splitlines()[-1] == f"Note: {report.notes[-1]}"
    assert report.notes[-1].startswith("Dots: ")
    assert f"test_explain.py:{line_of(mlp, '# <- dot1')} (mlp)" in text
    rich = report.table(use_rich=True, width=160)
    assert "┃" in rich and "dot_general" in rich
    short = report.table(use_rich=False, max_rows=2)
    assert "more ops not shown" in short


def test_alignment_lint_for_dots():
    def f(w, x):
        return x @ w  # <- dot

    report = mixprec.explain(
        f, jnp.ones((20, 12)), jnp.ones((6, 20)), policy="mixed_float16"
    )
    [issue] = report.alignment
    assert issue.misaligned == ("M", "N", "K")
    assert dict(issue.dims) == {"M": 6, "N": 12, "K": 20, "batch": 1}
    assert f"test_explain.py:{line_of(f, '# <- dot')}" in issue.message()
    assert "pad M to 8, N to 16, K to 24" in issue.message()
    ok = mixprec.explain(
        f, jnp.ones((16, 8)), jnp.ones((8, 16)), policy="mixed_float16"
    )
    assert ok.alignment == ()
    # float32 dots are not linted.
    f32 = mixprec.explain(f, jnp.ones((20, 12)), jnp.ones((6, 20)), policy="float32")
    assert f32.alignment == ()


def _conv(x, k):
    return jax.lax.conv_general_dilated(
        x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )


def test_alignment_lint_and_flops_for_convolutions_and_8bit():
    x, k = jnp.ones((2, 8, 8, 3)), jnp.ones((3, 3, 3, 16))
    [eqn] = jax.make_jaxpr(_conv)(x, k).jaxpr.eqns
    assert eqn_flops(eqn) == 2 * (2 * 8 * 8 * 16) * 3 * 9
    issue = lint_eqn(eqn, jnp.float16)
    assert issue is not None and issue.misaligned == ("C_in",)
    assert lint_eqn(eqn, jnp.float32) is None
    [dot] = jax.make_jaxpr(jnp.matmul)(jnp.ones((8, 8)), jnp.ones((8, 24))).jaxpr.eqns
    assert lint_eqn(dot, jnp.bfloat16) is None  # multiples of 8 suit 16-bit
    issue8 = lint_eqn(dot, jnp.float8_e4m3fn)  # 8-bit needs multiples of 16
    assert issue8 is not None and issue8.multiple == 16
    assert issue8.misaligned == ("M", "N", "K")


def test_explain_under_jit_and_with_shape_dtype_structs():
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in _mlp_args()]
    report = mixprec.explain(jax.jit(mlp), *args, policy="mixed_bfloat16")
    dots = report.find("dot_general")
    assert [d.decision for d in dots] == ["low", "low"]
    assert all(d.path.startswith("jit(mlp)") for d in dots)
    assert dots[0].line == line_of(mlp, "# <- dot1")


@pytest.mark.parametrize(
    ("source", "parsed", "short"),
    [
        ("/a/b/m.py:12 (f)", ("/a/b/m.py", 12, "f"), "m.py:12 (f)"),
        ("m.py:3", ("m.py", 3, ""), "m.py:3"),
        ("", ("", None, ""), ""),
    ],
)
def test_source_helpers(source, parsed, short):
    assert parse_source(source) == parsed
    assert short_source(source) == short


def test_plain_table_renderer_without_rich():
    text = render_table("t", ["a", "bb"], [["1", "x"], ["22", "yyy"]], use_rich=False)
    assert text.splitlines() == ["t", "a   bb", "--  ---", "1   x", "22  yyy"]


def biased(w, b, x):
    return jax.nn.relu(x @ w + b[None, :])  # a long reason: the epilogue of the dot


def _biased_report():
    return mixprec.explain(
        biased,
        jnp.ones((16, 8)),
        jnp.ones(8),
        jnp.ones((4, 16)),
        policy="mixed_float16",
    )


def _table_lines(text: str) -> list[str]:
    """The header, rule and rows of a plain table (after its title)."""
    lines = text.splitlines()[1:]
    end = next(i for i, line in enumerate(lines) if line.startswith("policy "))
    return lines[:end]


def _column(lines: list[str], name: str, after: str) -> str:
    """The text of column ``name`` (followed by column ``after``), its wrapped
    lines joined."""
    start, stop = lines[0].index(name), lines[0].index(after)
    return " ".join(
        " ".join(line[start:stop].split())
        for line in lines[2:]
        if line[start:stop].strip()
    )


@pytest.mark.parametrize("width", [100, 140, 220])
def test_plain_table_fits_the_width_and_wraps_the_reason(width):
    report = _biased_report()
    [add] = report.find("add")
    assert len(add.reason) > 64 and "the epilogue of the dot" in add.reason
    text = report.table(use_rich=False, width=width)
    lines = _table_lines(text)
    assert max(map(len, lines)) <= width
    if width >= 140:  # the reason is a column: every reason in it, whole
        assert _column(lines, "reason", "flops") == " ".join(
            " ".join(op.reason.split()) for op in report.ops
        )
    else:  # too narrow for the column: each reason under its row, whole
        flat = " ".join(text.split())
        assert "reason" not in lines[0]
        for op in report.ops:
            assert f"reason: {' '.join(op.reason.split())}" in flat
    assert "…" not in " ".join(op.reason for op in report.ops)
    # A column empty in every row (no layer here; relu has a path) is left out.
    assert "layer" not in lines[0] and "path" in "\n".join(lines)
    assert all(not op.layer for op in report.ops)


def test_table_width_defaults_to_the_terminal(monkeypatch):
    report = _biased_report()
    monkeypatch.setenv("COLUMNS", "90")
    lines = _table_lines(str(report))
    assert max(map(len, lines)) <= 90
    assert "source: test_explain.py:" in "\n".join(lines)  # the source went below
    monkeypatch.setenv("COLUMNS", "200")
    assert max(map(len, _table_lines(str(report)))) > 90
    rich = report.table(use_rich=True)  # rich's console width: COLUMNS too
    assert "┃" in rich and max(map(len, rich.splitlines()[:-4])) <= 200
    monkeypatch.setenv("COLUMNS", "60")  # a rich table that narrow: plain text
    narrow = report.table(use_rich=True)
    assert "┃" not in narrow and "reason: " in narrow


def test_dtype_columns_say_what_they_show():
    report = _biased_report()
    [add] = report.find("add")
    # The add is the float16 dot's epilogue: its operands arrive in float16,
    # it runs in float32 on the dot's float32 product and gives float16.
    assert add.in_dtypes == ("float32", "float32") and add.out_dtypes == ("float16",)
    text = report.table(use_rich=False, width=220)
    header = _table_lines(text)[0].split("  ")
    assert "ran with" in header and "result" in header
    assert "in" not in [h.strip() for h in header]
    assert "ran with: the dtypes of the operands the op computed with, after" in text
    row = next(line for line in _table_lines(text) if re.match(r"\d+\s+add\s", line))
    assert "f32,f32" in row and "f16" in row and "its operands are float16" in row


def test_plain_renderer_puts_long_columns_below_a_narrow_row():
    rows = [["0", "abcdef", "src.py:1 (f)", "a long reason " * 6]]
    cols = ["#", "op", "source", "reason"]
    wide = render_table("t", cols, rows, use_rich=False, width=200, wrap=["reason"])
    assert len(wide.splitlines()) == 4 and wide.splitlines()[1].endswith("reason")
    mid = render_table(
        "t", cols, rows, use_rich=False, width=40, wrap=["reason"], shrink=["source"]
    )
    assert mid.splitlines()[1:] == [
        "#  op      source",
        "-  ------  ------------",
        "0  abcdef  src.py:1 (f)",
        "    reason: a long reason a long reason",
        "            a long reason a long reason",
        "            a long reason a long reason",
    ]
    narrow = render_table(
        "t", cols, rows, use_rich=False, width=20, wrap=["reason"], shrink=["source"]
    )
    assert narrow.splitlines()[1:4] == ["#  op", "-  ------", "0  abcdef"]
    assert "    source: src.py:1 (f)" in narrow.splitlines()


def test_report_is_read_only_and_deterministic():
    a = mixprec.explain(mlp, *_mlp_args(), policy="mixed_bfloat16")
    b = mixprec.explain(mlp, *_mlp_args(), policy="mixed_bfloat16")
    assert a == b
    with pytest.raises(AttributeError):
        a.policy = "x"  # type: ignore[misc]
    assert np.isclose(a.low_precision_flop_fraction, b.low_precision_flop_fraction)
