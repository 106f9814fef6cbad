"""mixprec.diagnose: planted float16 problems, found and attributed to op and line.

Each planted problem is checked three ways: the report names the right primitive
and the user source line (found through a ``# <-`` marker comment), the suggested
mixlist makes the problem go away when fed back to ``mixprec.autocast``, and
without it autocast really does produce the inf/zero (so the test can fail).
"""

import collections
import dataclasses
import inspect
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import FORMULATION_PRIMITIVES, iter_eqns, tol
from jax.extend.core import Literal

import mixprec
from mixprec._src._compat import is_tracer
from mixprec._src.autocast import api, interpreter as itp
from mixprec._src.autocast.config import make_config
from mixprec._src.numerics.advice import merge_black_list
from mixprec._src.numerics.record import OpRecord


F16 = "mixed_float16"


def line_of(fn, marker: str) -> int:
    """The line number of the line in ``fn``'s source that contains ``marker``."""
    lines, start = inspect.getsourcelines(fn)
    hits = [start + i for i, text in enumerate(lines) if marker in text]
    assert len(hits) == 1, (marker, hits)
    return hits[0]


def rel_err(a, b) -> float:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# ------------------------------------------ float16's range (65504 and 6e-8)


def seed_overflow(w, x):
    h = x @ w
    g = x @ w.T
    return h * g  # <- overflow


def seed_underflow(w, x):
    h = x @ w
    g = x @ w.T
    return h * g  # <- underflow


def test_product_of_two_activations_overflows_and_is_fixed():
    w, x = jnp.eye(8), jnp.full((8, 8), 256.0)
    report = mixprec.diagnose(seed_overflow, w, x, policy=F16)
    op = report.first_nonfinite_op
    assert op is not None
    assert op.primitive == "mul"
    assert op.line == line_of(seed_overflow, "# <- overflow")
    assert op.source.endswith("(seed_overflow)")
    assert (op.in_dtypes, op.out_dtypes, op.decision) == (
        ("float16", "float16"),
        ("float16",),
        "low",
    )
    assert op.overflow == 64 and op.underflow == 0 and op.nonfinite == 64
    assert [p.primitive for p in report.problems] == ["mul"]
    assert report.find("dot_general")[0].overflow == 0  # 256 itself is fine
    assert report.suggested_mixlist == {"black-list": {"to-add": ["mul"]}}
    assert report.advice_verified is True
    # Without the advice autocast overflows; with it, it matches float32.
    broken = mixprec.autocast(seed_overflow, F16)(w, x)
    assert np.isinf(np.asarray(broken)).all()
    fixed = mixprec.autocast(seed_overflow, F16, mixlist=report.suggested_mixlist)(w, x)
    assert fixed.dtype == jnp.float32
    np.testing.assert_array_equal(fixed, np.full((8, 8), 65536.0, np.float32))


@pytest.mark.parametrize(
    "square, name",
    [
        (lambda h: h**2, "integer_pow"),
        (jnp.square, "square"),
        (lambda h: h * h, "mul"),
    ],
)
def test_squares_are_safe_under_float16_with_the_default_lists(square, name):
    # Squares of 256 overflow float16, so under float16 every way of writing
    # one runs in float32 (a value multiplied by itself is a square).
    def f(w, x):
        return square(x @ w)

    report = mixprec.diagnose(f, jnp.eye(8), jnp.full((8, 8), 256.0), policy=F16)
    assert report.ok and report.first_nonfinite is None
    [op] = report.find(name)
    assert op.decision == "float32" and op.out_dtypes == ("float32",)
    assert report.suggested_mixlist == {} and report.advice_verified is None
    y = mixprec.autocast(f, F16)(jnp.eye(8), jnp.full((8, 8), 256.0))
    np.testing.assert_array_equal(y, np.full((8, 8), 65536.0, np.float32))


def test_product_of_two_activations_underflows_and_is_fixed():
    w, x = jnp.eye(8), jnp.full((8, 8), 1e-5)
    report = mixprec.diagnose(seed_underflow, w, x, policy=F16)
    [op] = report.problems
    assert op.primitive == "mul" and op.line == line_of(seed_underflow, "# <- under")
    assert op.underflow == 64 and op.overflow == 0 and op.nonfinite == 0
    assert op.local_rel_error == pytest.approx(1.0)
    assert report.output_rel_error == (pytest.approx(1.0),)
    assert report.first_nonfinite is None  # zeros are finite
    assert report.suggested_mixlist == {"black-list": {"to-add": ["mul"]}}
    assert report.advice_verified is True
    broken = mixprec.autocast(seed_underflow, F16)(w, x)
    assert (np.asarray(broken) == 0).all()
    fixed = mixprec.autocast(seed_underflow, F16, mixlist=report.suggested_mixlist)(
        w, x
    )
    assert fixed.dtype == jnp.float32
    # 1e-5 is a float16 subnormal at the dot's input: a few 1e-3 of rounding.
    assert rel_err(fixed, seed_underflow(w, x)) < tol(jnp.float16, grad=True)


def test_bfloat16_has_the_range_float16_lacks():
    report = mixprec.diagnose(
        seed_overflow, jnp.eye(8), jnp.full((8, 8), 256.0), policy="mixed_bfloat16"
    )
    assert report.ok and report.low_dtype == "bfloat16"
    assert report.find("mul")[0].out_dtypes == ("bfloat16",)


# ---------------------------------------------------------------- softmax


def naive_softmax(q, k):
    s = q @ k.T
    e = jnp.exp(s)  # <- exp
    return e / jnp.sum(e, axis=-1, keepdims=True)


def test_softmax_without_max_subtraction_overflows_when_exp_runs_low():
    # exp is on the default black list; a user moved it off "for speed".
    q, k = jnp.full((8, 8), 1.5), jnp.ones((8, 8))  # scores 12: e**12 > 65504
    user = {"black-list": {"to-remove": ["exp"]}}
    report = mixprec.diagnose(naive_softmax, q, k, policy=F16, mixlist=user)
    op = report.first_nonfinite_op
    assert op is not None and op.primitive == "exp"
    assert op.line == line_of(naive_softmax, "# <- exp")
    assert op.overflow == 64 and op.out_dtypes == ("float16",)
    # Black-listing exp also fixes the division downstream of it.
    assert report.to_black_list == ("exp",)
    assert report.suggested_mixlist == {"black-list": {"to-add": ["exp"]}}
    assert report.advice_verified is True
    ref = naive_softmax(q, k)
    assert np.isnan(
        np.asarray(mixprec.autocast(naive_softmax, F16, mixlist=user)(q, k))
    ).all()
    fixed = mixprec.autocast(naive_softmax, F16, mixlist=report.suggested_mixlist)(q, k)
    assert fixed.dtype == jnp.float32
    assert rel_err(fixed, ref) < tol(jnp.float16)
    # With the default lists the same softmax is already safe.
    assert mixprec.diagnose(naive_softmax, q, k, policy=F16).ok


# ---------------------------------------------------------------- layer norm


def layer_norm(w, mu, x):
    h = x @ w
    # Centred with a stored mean (a parameter, so it follows the float16
    # operand). With `jnp.mean(h)` autocast keeps `h - mu` in float32 (the mean
    # is a float32 reduction and the widest input wins).
    d = h - mu
    var = jnp.mean(d * d, axis=-1, keepdims=True)  # <- square
    return d * jax.lax.rsqrt(var + 1e-12)


def weighted_layer_norm(w, mu, x):
    h = x @ w
    d = h - mu
    # A product of two different float16 values: gray, so it runs in float16.
    var = jnp.mean(d * (d * 0.5), axis=-1, keepdims=True)  # <- variance
    return d * jax.lax.rsqrt(var + 1e-12)


def test_layer_norm_variance_is_a_square_and_does_not_underflow():
    w = jnp.eye(16)
    x = jax.random.normal(jax.random.key(0), (8, 16)) * 1e-4  # d*d ~ 1e-8
    mu = jnp.zeros((1, 16))
    report = mixprec.diagnose(layer_norm, w, mu, x, policy=F16)
    assert report.ok, report.problems
    [sq] = [
        op for op in report.find("mul") if op.line == line_of(layer_norm, "# <- sq")
    ]
    assert sq.decision == "float32" and "by itself" in sq.reason
    ref = layer_norm(w, mu, x)
    assert rel_err(mixprec.autocast(layer_norm, F16)(w, mu, x), ref) < 1e-2


def test_layer_norm_variance_underflow_found_and_fixed():
    w = jnp.eye(16)
    x = jax.random.normal(jax.random.key(0), (8, 16)) * 1e-4  # d*d ~ 1e-8
    mu = jnp.zeros((1, 16))
    layer_norm = weighted_layer_norm
    report = mixprec.diagnose(layer_norm, w, mu, x, policy=F16)
    root = report.problems[0]
    assert root.primitive == "mul"
    assert root.line == line_of(layer_norm, "# <- variance")
    assert root.underflow > 0 and root.in_dtypes == ("float16", "float16")
    assert report.to_black_list == ("mul",)
    assert report.advice_verified is True
    ref = layer_norm(w, mu, x)
    # The flushed variance makes the normalised output wrong by orders of magnitude.
    assert rel_err(mixprec.autocast(layer_norm, F16)(w, mu, x), ref) > 1.0
    fixed = mixprec.autocast(layer_norm, F16, mixlist=report.suggested_mixlist)(
        w, mu, x
    )
    assert fixed.dtype == jnp.float32
    assert np.isfinite(np.asarray(fixed)).all()
    assert rel_err(fixed, ref) < tol(jnp.float16, grad=True)


# ---------------------------------------------------------------- gradients


def mlp_loss(params, x):
    h = x
    for w in params:
        h = jnp.tanh(h @ w)  # <- layer
    return jnp.mean(h * h) * 1e-3  # <- loss


def _mlp():
    keys = jax.random.split(jax.random.key(0), 6)
    params = [jax.random.normal(k, (32, 32)) * (0.5 / math.sqrt(32)) for k in keys]
    x = jax.random.normal(jax.random.key(1), (32, 32))
    return params, x


def test_gradient_underflow_in_a_deep_mlp_and_the_loss_scale_that_fixes_it():
    params, x = _mlp()
    report = mixprec.diagnose(jax.grad(mlp_loss), params, x, policy=F16)
    grad_problems = [op for op in report.problems if op.backward]
    assert grad_problems and all(op.underflow > 0 for op in grad_problems)
    worst = max(grad_problems, key=lambda op: op.underflow)
    # The tiny cotangent flushes where it meets the float16 activations: most
    # of all in the layers' backward dots.
    assert worst.line == line_of(mlp_loss, "# <- layer")
    assert worst.primitive in ("mul", "dot_general")
    assert worst.in_dtypes == ("float16", "float16")
    # Gradients are not fixed by the black list: the advice is a loss scale.
    assert report.to_black_list == ()
    assert max(report.output_rel_error) > 0.5
    scale = report.suggested_loss_scale
    assert scale is not None and scale > 1 and math.log2(scale).is_integer()
    assert report.gradient_range is not None
    assert report.gradient_range[1] * scale < 65504

    scaled = mixprec.diagnose(mlp_loss, params, x, policy=F16, loss_scale=scale)
    assert scaled.loss_scale == scale
    before = sum(op.underflow for op in report.ops if op.backward)
    after = sum(op.underflow for op in scaled.ops if op.backward)
    assert after < before / 100
    assert max(scaled.output_rel_error) < tol(jnp.float16, grad=True)

    # End to end through autocast: the same scale rescues the real gradients.
    g32 = jax.grad(mlp_loss)(params, x)

    def mixed_grads(s):
        g = jax.grad(lambda p: mixprec.autocast(mlp_loss, F16)(p, x) * s)(params)
        return [gi / s for gi in g]

    unscaled = mixed_grads(1.0)
    assert np.mean([float(jnp.mean(g == 0)) for g in unscaled]) > 0.5
    for g, r in zip(mixed_grads(scale), g32, strict=True):
        assert g.dtype == jnp.float32
        assert rel_err(g, r) < tol(jnp.float16, grad=True)


def test_bfloat16_needs_no_loss_scale():
    params, x = _mlp()
    report = mixprec.diagnose(jax.grad(mlp_loss), params, x, policy="mixed_bfloat16")
    assert report.suggested_loss_scale is None
    assert report.gradient_range is not None


@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan])
def test_loss_scale_must_be_positive_and_finite(bad):
    with pytest.raises(ValueError, match=r"`diagnose\(\.\.\., loss_scale=\.\.\.\)`"):
        mixprec.diagnose(mlp_loss, *_mlp(), policy=F16, loss_scale=bad)


# ---------------------------------------------------------------- higher-order ops


def _sq(h):
    return h * (h + 1.0)  # <- hop


@jax.custom_jvp
def _sq_jvp(h):
    return _sq(h)


_sq_jvp.defjvp(lambda p, t: (_sq_jvp(p[0]), 2 * p[0] * t[0]))


@jax.custom_vjp
def _sq_vjp(h):
    return _sq(h)


_sq_vjp.defvjp(lambda h: (_sq_vjp(h), h), lambda h, g: (2 * h * g,))


def _via_scan(w, x):
    def body(c, xi):
        return c, _sq(xi @ w)

    return jax.lax.scan(body, 0.0, x)[1]


def _via_while(w, x):
    def body(carry):
        i, acc = carry
        return i + 1, acc + _sq(x[i] @ w)

    return jax.lax.while_loop(lambda c: c[0] < 3, body, (0, jnp.zeros((4, 8))))[1]


def _via_cond(w, x):
    return jax.lax.cond(x.sum() > 0, lambda v: _sq(v @ w), lambda v: v @ w, x[0])


HOPS = {
    "jit": (lambda w, x: jax.jit(_sq)(x[0] @ w), "jit(_sq)", 1),
    "checkpoint": (lambda w, x: jax.checkpoint(_sq)(x[0] @ w), "checkpoint", 1),
    "custom_jvp": (lambda w, x: _sq_jvp(x[0] @ w), "custom_jvp(_sq_jvp)", 1),
    "custom_vjp": (lambda w, x: _sq_vjp(x[0] @ w), "custom_vjp(_sq_vjp)", 1),
    "scan": (_via_scan, "scan/body", 3),
    "while": (_via_while, "while/body", 3),
    "cond": (_via_cond, "cond/branch1", 1),
}


@pytest.mark.parametrize("hop", sorted(HOPS))
def test_problems_inside_higher_order_primitives(hop):
    fn, path, calls = HOPS[hop]
    w, x = jnp.eye(8), jnp.full((3, 4, 8), 300.0)
    report = mixprec.diagnose(fn, w, x, policy=F16)
    op = report.first_nonfinite_op
    assert op is not None and op.primitive == "mul"
    assert op.line == line_of(_sq, "# <- hop")
    assert path in op.path
    assert op.calls == calls and op.overflow == 32 * calls
    assert report.to_black_list == ("mul",) and report.advice_verified


def test_grad_through_custom_vjp_and_scan_is_diagnosed():
    def loss(w, x):
        return jnp.sum(_via_scan(w, x)) * 1e-9

    w, x = jnp.eye(8), jnp.full((3, 4, 8), 1e-3)
    report = mixprec.diagnose(jax.grad(loss), w, x, policy=F16)
    backward = [op for op in report.ops if op.backward]
    assert backward and any("scan" in op.path for op in backward)
    assert report.suggested_loss_scale is not None


# ---------------------------------------------------------------- report details


def test_float32_itself_nonfinite_is_reported_separately():
    def f(x):
        return jnp.log(x) * 2.0

    report = mixprec.diagnose(f, jnp.zeros((4,)), policy=F16)
    assert report.first_f32_nonfinite is not None
    assert report.ops[report.first_f32_nonfinite].primitive == "log"
    assert report.first_nonfinite is None  # float16 is no worse than float32


def test_report_table_json_and_str():
    report = mixprec.diagnose(
        seed_overflow, jnp.eye(8), jnp.full((8, 8), 256.0), policy=F16
    )
    d = json.loads(report.to_json())
    assert d["policy"] == "p=f32,c=f16,o=f32" and d["low_dtype"] == "float16"
    assert d["first_nonfinite"] == report.first_nonfinite
    assert d["ops"][report.first_nonfinite]["problems"] == ["overflow"]
    assert d["ops"][report.first_nonfinite]["line"] == line_of(
        seed_overflow, "# <- overflow"
    )
    assert d["suggested_mixlist"] == {"black-list": {"to-add": ["mul"]}}
    plain = report.table(use_rich=False, only_problems=False)
    assert "mul" in plain and "dot_general" in plain
    assert "first NaN/inf" in plain
    rich = report.table(use_rich=True, width=160)
    assert "mul" in rich and "┃" in rich
    text = str(report)
    assert "first NaN/inf: mul" in text and '"to-add": ["mul"]' in text


def test_alignment_lint_in_diagnosis():
    def f(w, x):
        return x @ w  # <- dot

    report = mixprec.diagnose(f, jnp.ones((16, 10)), jnp.ones((8, 16)), policy=F16)
    [issue] = report.alignment
    assert issue.misaligned == ("N",) and issue.multiple == 8
    assert issue.dtype == "float16"
    assert f"test_diagnose.py:{line_of(f, '# <- dot')}" in issue.message()
    aligned = mixprec.diagnose(f, jnp.ones((16, 16)), jnp.ones((8, 16)), policy=F16)
    assert aligned.alignment == ()


def test_cond_branch_divergence_is_noted():
    def f(x):
        h = x @ jnp.eye(4)
        # float32 sees 1 + 1e-4 > 1; float16 rounds it to 1.
        return jax.lax.cond(h[0, 0] > 1.0, jnp.sin, jnp.cos, h)

    report = mixprec.diagnose(f, jnp.full((4, 4), 1.0001), policy=F16)
    assert any("cond" in n and "branch" in n for n in report.notes)


@pytest.mark.parametrize(
    ("spec", "ops", "expected"),
    [
        (None, ["exp"], {"black-list": {"to-add": ["exp"]}}),
        (None, [], {}),
        (
            {"black-list": {"to-remove": ["exp", "log"]}},
            ["exp"],
            {"black-list": {"to-remove": ["log"], "to-add": ["exp"]}},
        ),
        (
            {"white-list": {"to-add": ["mul"]}, "black-list": {"to-add": ["tanh"]}},
            ["mul", "mul"],
            {"black-list": {"to-add": ["tanh", "mul"]}},
        ),
    ],
)
def test_merge_black_list(spec, ops, expected):
    assert merge_black_list(spec, ops) == expected
    if spec is not None:
        assert spec != expected or not ops  # the input is not modified


def test_merged_mixlist_is_accepted_by_autocast():
    spec = merge_black_list({"black-list": {"to-remove": ["exp"]}}, ["exp", "square"])
    y = mixprec.autocast(jnp.exp, F16, mixlist=spec)(jnp.ones(3))
    assert y.dtype == jnp.float32


def test_mixlist_as_json_text():
    user = json.dumps({"black-list": {"to-remove": ["exp"]}})
    q, k = jnp.full((8, 8), 1.5), jnp.ones((8, 8))
    report = mixprec.diagnose(naive_softmax, q, k, policy=F16, mixlist=user)
    assert report.mixlist == {"black-list": {"to-remove": ["exp"]}}
    assert report.suggested_mixlist == {"black-list": {"to-add": ["exp"]}}


def test_float32_scope_region_is_respected_inside_loops():
    def f(w, x):
        def body(c, xi):
            h = xi @ w
            with mixprec.float32_scope():
                return c, jnp.square(h)  # <- scoped

        return jax.lax.scan(body, 0.0, x)[1]

    w, x = jnp.eye(8), jnp.full((3, 4, 8), 300.0)
    report = mixprec.diagnose(f, w, x, policy=F16)
    assert report.ok
    [op] = report.find("square")
    assert op.line == line_of(f, "# <- scoped") and op.path == "scan/body"
    assert op.decision == "original" and op.out_dtypes == ("float32",)
    assert "float32_scope" in op.reason and op.calls == 3


def test_recognised_composite_runs_in_float32():
    def f(w, x):
        return jnp.var(x @ w, axis=-1)  # <- var

    report = mixprec.diagnose(f, jnp.eye(8), jnp.full((4, 8), 3.0), policy=F16)
    inside = [op for op in report.ops if op.path == "jit(_var)" and op.dtype]
    assert inside and all(op.line == line_of(f, "# <- var") for op in inside)
    assert all(op.decision == "float32" for op in inside), inside
    assert all("inside var (a JAX composite)" in op.reason for op in inside)


def test_while_loop_comparison_is_capped_and_noted():
    def f(x):
        def body(c):
            return c[0] + 1, c[1] @ jnp.eye(8)

        return jax.lax.while_loop(lambda c: c[0] < 5, body, (0, x))[1]

    report = mixprec.diagnose(f, jnp.ones((4, 8)), policy=F16, max_loop_steps=2)
    [dot] = report.find("dot_general")
    assert dot.calls == 2 and dot.path == "while/body"
    assert any("first 2 iterations" in n for n in report.notes)
    assert report.output_rel_error == (0.0,)  # both streams still finish


def test_float32_policy_is_noted():
    report = mixprec.diagnose(seed_overflow, jnp.eye(8), jnp.ones((8, 8)))
    assert report.ok and report.low_dtype == "float32"
    assert any("computes in float32" in n for n in report.notes)


def test_prng_keys_and_integers_pass_through():
    def f(w, x, key, n):
        h = x @ w
        keep = jax.random.bernoulli(key, 0.5, h.shape)
        return jnp.where(keep, h / 0.5, 0.0), n + 1

    args = (jnp.eye(8), jnp.ones((4, 8)), jax.random.key(0), jnp.int32(3))
    report = mixprec.diagnose(f, *args, policy="mixed_bfloat16")
    assert report.ok and report.output_rel_error == (0.0,)  # floating outputs
    assert report.find("dot_general")[0].out_dtypes == ("bfloat16",)


def test_abstract_arguments_are_rejected():
    spec = jax.ShapeDtypeStruct((8, 8), jnp.float32)
    with pytest.raises(TypeError, match="concrete values"):
        mixprec.diagnose(seed_overflow, spec, spec, policy=F16)


def several_muls(w, x):
    h = x @ w
    g = x @ w.T
    small = (h * 1e-2) @ w  # a mul that runs in float16 and is fine
    return small + h * g  # <- overflow


def several_muls_scoped(w, x):
    h = x @ w
    g = x @ w.T
    small = (h * 1e-2) @ w
    with mixprec.float32_scope():
        hg = h * g
    return small + hg


def test_advice_names_the_offending_line_and_spares_the_other_ops():
    w, x = jnp.eye(8), jnp.full((8, 8), 256.0)
    report = mixprec.diagnose(several_muls, w, x, policy=F16)
    low_muls = [op for op in report.find("mul") if op.decision == "low"]
    assert len(low_muls) == 2
    (fix,) = report.scope_fixes
    assert fix.primitive == "mul" and fix.problem == "overflow"
    line = line_of(several_muls, "# <- overflow")
    assert fix.line.endswith(f":{line} (several_muls)")
    assert report.scope_verified is True
    text = report.advice()
    assert f"wrap line {line} of test_diagnose.py in" in text
    assert "float32_scope" in text
    # The black list is offered only as the last resort, saying what else it hits.
    assert report.black_list_reach == {"mul": 1}
    assert "Last resort" in text and "also moves 1 other mul op" in text
    # The check is honest: the same line really wrapped is clean, and the other
    # mul still runs in float16.
    scoped = mixprec.diagnose(several_muls_scoped, w, x, policy=F16)
    assert scoped.ok
    assert [op.decision for op in scoped.find("mul")] == ["low", "original"]


def test_advice_names_the_flax_layer_and_the_line_that_calls_it():
    nn = pytest.importorskip("flax.linen")

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Dense(8)(x)
            g = nn.Dense(8, name="gate")(x)
            return nn.Dense(8)(h * g)  # <- product

    x = jnp.full((4, 8), 16.0)
    params = Net().init(jax.random.key(0), x)
    params = jax.tree.map(lambda p: jnp.full_like(p, 2.0), params)
    report = mixprec.diagnose(lambda p, x: Net().apply(p, x), params, x, policy=F16)
    assert [op.layer for op in report.find("dot_general")] == [
        "Net/Dense_0",
        "Net/gate",
        "Net/Dense_1",
    ]
    (fix,) = report.scope_fixes
    line = line_of(Net.__call__, "# <- product")
    assert (fix.primitive, fix.layer) == ("mul", "Net")
    assert fix.line.split(" ")[0].endswith(f"test_diagnose.py:{line}")
    assert report.scope_verified is True
    # The primitive-wide black list would move the three healthy dots too.
    assert report.black_list_reach["dot_general"] == 3


# ------------------------------------- one walk: records and stepped control flow


def _loops(w, x):
    # Both loops carry a float32 state their bodies compute in the low dtype:
    # each iteration's result is cast back to the carry's dtype.
    def cell(h, xi):
        h = jnp.tanh(h @ w)
        return h, jnp.exp(h + xi).sum()

    h, ys = jax.lax.scan(cell, jnp.zeros(8), x)

    def body(c):
        i, acc = c
        return i + 1, jnp.sin(acc @ w) * x[i]

    _, acc = jax.lax.while_loop(lambda c: c[0] < 3, body, (0, h))
    out = jax.lax.cond(
        acc.sum() > -1e9,
        lambda v: jnp.log1p(jnp.abs(v @ w)),
        lambda v: v * 2.0,
        acc,
    )
    return out, ys


def _loops_args():
    k1, k2 = jax.random.split(jax.random.key(7))
    return jax.random.normal(k1, (8, 8)) / 4, jax.random.normal(k2, (5, 8))


# Primitives a dot formulation or a cast adds to the staged body by itself;
# dots are checked on their own.
_ADDED = FORMULATION_PRIMITIVES


def _bodies(staged):
    """The bodies of the staged scan, while and cond, by the path diagnose
    reports their ops at (``lax.cond``'s true branch is branch 1)."""
    found = {}
    for e in staged.jaxpr.eqns:
        name = e.primitive.name
        if name == "scan":
            found["scan/body"] = e.params["jaxpr"]
        elif name == "while":
            found["while/body"] = e.params["body_jaxpr"]
            found["while/cond"] = e.params["cond_jaxpr"]
        elif name == "cond":
            found["cond/branch1"] = e.params["branches"][1]
    return found


@pytest.mark.parametrize("policy", [F16, "mixed_bfloat16"])
def test_diagnose_steps_loops_with_the_decisions_autocast_makes(policy):
    w, x = _loops_args()
    diag = mixprec.diagnose(_loops, w, x, policy=policy, refine=False)
    report = mixprec.explain(_loops, w, x, policy=policy)
    bodies = _bodies(jax.make_jaxpr(mixprec.autocast(_loops, policy))(w, x))
    trips = {"scan/body": 5, "while/body": 3, "while/cond": 4, "cond/branch1": 1}
    assert set(bodies) == set(trips)

    def decided(op):
        return (op.primitive, op.in_dtypes, op.out_dtypes, op.decision, op.reason)

    # Everywhere (the taken branch only), the decisions and dtypes are those of
    # autocast's own walk: explain records them. Outside the loops, this says
    # the carries left each loop in the dtype autocast gives them.
    paths = {op.path for op in report.ops} - {"cond/branch0"}
    assert paths == set(trips) | {""}
    for path in paths:
        ops = [op for op in diag.ops if op.path == path]
        explained = [op for op in report.ops if op.path == path]
        assert sorted(map(decided, ops)) == sorted(map(decided, explained)), path
    for path, n in trips.items():
        ops = [op for op in diag.ops if op.path == path]
        assert ops, path
        # Each iteration was walked and compared: one site, n calls.
        assert all(op.calls == n for op in ops), [
            (op.primitive, op.calls) for op in ops
        ]
        # The dtypes are those of the body autocast stages out.
        staged = list(iter_eqns(bodies[path]))
        want = collections.Counter(
            (e.primitive.name, tuple(str(v.aval.dtype) for v in e.invars))
            for e in staged
            if e.primitive.name not in _ADDED
        )
        got = collections.Counter(
            (op.primitive, op.in_dtypes) for op in ops if op.primitive not in _ADDED
        )
        assert got == want, path
        # (A dot's formulation is per platform: its record says the dtype it
        # was decided in, the explain records above the decision.)
        dots = {op.decision for op in ops if op.primitive == "dot_general"}
        assert dots <= {"low"}, path
    # The stepped values are autocast's: the outputs agree with float32 to the
    # low dtype's tolerance, and diagnose found no problem.
    low = jnp.dtype(diag.low_dtype)
    assert diag.ok and all(e < 10 * tol(low) for e in diag.output_rel_error)


def test_diagnose_reports_the_records_explain_reports_with_measurements_added():
    def f(w, x):
        h = jnp.tanh(x @ w) * 3.0
        return jnp.exp(h) + h.sum()

    w, x = _loops_args()
    report = mixprec.explain(f, w, x[:4], policy=F16)
    diag = mixprec.diagnose(f, w, x[:4], policy=F16, refine=False)
    shared = [f.name for f in dataclasses.fields(OpRecord) if f.name != "eqn"]
    assert len(diag.ops) == len(report.ops) > 4
    for a, b in zip(report.ops, diag.ops, strict=True):
        assert isinstance(b, OpRecord)
        assert str(b.eqn) == str(a.eqn)  # the same equation (each traced its own)
        assert {k: getattr(b, k) for k in shared} == {k: getattr(a, k) for k in shared}
        explained, diagnosed = a.to_dict(), b.to_dict()
        assert {k: diagnosed[k] for k in explained} == explained
        assert diagnosed["calls"] == 1 and "problems" in diagnosed


class _Stepper:
    """The smallest observer that has the walk step: it keeps each variable's
    value as written beside the walk's (as diagnose does) and records what the
    walk shows it."""

    fuses = False

    def __init__(self, *, steps, max_loop_steps=100):
        self.steps = steps
        self.max_loop_steps = max_loop_steps
        self.ref = {}
        self.seen = []
        self.notes = []

    def seed(self, variables, values):
        for v, x in zip(variables, values, strict=True):
            if type(v) is not Literal:
                self.ref[v] = x

    def read(self, variables):
        return [v.val if type(v) is Literal else self.ref[v] for v in variables]

    def on_eqn(self, walk, eqn, decision, ran_with, invals, outs, rerun):
        del decision, ran_with, invals, rerun
        if self.steps:
            self.seed(eqn.outvars, itp.bind_as_written(eqn, self.read(eqn.invars)))
        self.seen.append((eqn.primitive.name, walk.path, outs[0]))

    def on_own(self, walk, eqn, decision, ran_with, invals, outs):
        del walk, eqn, decision, ran_with, invals, outs

    def on_note(self, walk, eqn, text):
        del walk, eqn
        self.notes.append(text)


def _walk_concretely(fn, args, config, observer):
    call = api.split_call(fn, args, {})
    source = call.source(config)
    values = [*source.consts, *(call.leaves[i] for i in call.dyn_idx)]
    observer.seed(source.jaxpr.invars, values)
    walk = api.region_walk(config, observer)
    outs, _ = itp.eval_jaxpr(
        walk, source.jaxpr, (), values, source.in_marks(), source.consts
    )
    return outs, observer.read(source.jaxpr.outvars)


def test_the_walk_steps_loops_only_for_an_observer_that_asks():
    # Both loops compute a float32 carry in bfloat16: each iteration's result
    # is cast back to float32, as autocast's loops do.
    def f(w, x):
        def body(c):
            i, h = c
            return i + 1, jnp.tanh(h @ w)

        h = jax.lax.while_loop(lambda c: c[0] < 4, body, (0, x))[1]
        c, ys = jax.lax.scan(lambda c, r: (jnp.tanh(c @ w), r @ w), h[0], x)
        return h, c, ys

    w, x = _loops_args()
    config = make_config("mixed_bfloat16").resolved()
    want = mixprec.autocast(f, "mixed_bfloat16")(w, x)

    def check(got, ref=None):
        # The carries leave their loops in float32 (the ys as computed: the
        # policy's output cast comes after the walk).
        assert [o.dtype for o in got] == [jnp.float32, jnp.float32, jnp.bfloat16]
        for a, b in zip(got, want, strict=True):
            assert rel_err(a, b) < tol(jnp.bfloat16)
        if ref is not None:  # float32's values, carried beside
            for a, b in zip(ref, f(w, x), strict=True):
                assert a.dtype == jnp.float32 and rel_err(a, b) < tol(jnp.float32)

    stepper = _Stepper(steps=True)
    got, ref = _walk_concretely(f, (w, x), config, stepper)
    seen = collections.Counter((p, path) for p, path, _ in stepper.seen)
    assert seen[("dot_general", "while/body")] == 4
    assert seen[("dot_general", "scan/body")] == 10
    assert seen[("lt", "while/cond")] == 5
    # Concrete values, every iteration; the same numbers autocast computes,
    # and float32's beside them.
    assert all(isinstance(o, jax.Array) and not is_tracer(o) for *_, o in stepper.seen)
    check(got, ref)

    # At most max_loop_steps iterations are stepped; the rest runs as a whole.
    capped = _Stepper(steps=True, max_loop_steps=2)
    got, _ = _walk_concretely(f, (w, x), config, capped)
    seen = collections.Counter((p, path) for p, path, _ in capped.seen)
    assert seen[("dot_general", "while/body")] == 2
    assert any("first 2 iterations" in n for n in capped.notes)
    check(got)

    # An observer that does not ask sees each body once, traced (explain).
    tracer = _Stepper(steps=False)
    api.trace_transformed(f, config, (w, x), {}, observer=tracer)
    seen = collections.Counter((p, path) for p, path, _ in tracer.seen)
    assert seen[("dot_general", "while/body")] == 1
    assert seen[("dot_general", "scan/body")] == 2
    assert all(is_tracer(o) for *_, o in tracer.seen)


def test_a_higher_order_op_without_a_stepping_path_is_compared_as_one_op():
    def f(w, x):
        a = x @ w
        # custom_linear_solve has no stepping path: its rule runs unobserved.
        sol = jax.lax.custom_linear_solve(
            lambda v: 2.0 * v, a, solve=lambda mv, b: b / 2.0, symmetric=True
        )
        return sol * 3.0

    w, x = _loops_args()
    report = mixprec.diagnose(f, w, x, policy="mixed_bfloat16", refine=False)
    [solve] = report.find("custom_linear_solve")
    assert solve.path == "" and solve.calls == 1 and solve.elements == x.size
    assert solve.in_dtypes == ("bfloat16",) and solve.f32_dtypes == ("float32",)
    assert solve.rel_error < 10 * tol(jnp.bfloat16)
    assert "custom_linear_solve: compared as a whole, not op by op" in report.notes
    # Nothing inside it was observed: the walk inside was a traced one.
    assert [op.primitive for op in report.ops] == [
        "dot_general",
        "custom_linear_solve",
        "mul",
    ]
    assert report.output_rel_error[0] < 10 * tol(jnp.bfloat16)


# ------------------------------------------- attention a whole step cannot fuse


def _attention_notes(report):
    return [n for n in report.notes if n.startswith("dot_product_attention")]


def _scan_program(name):
    from corpus import PROGRAMS

    return PROGRAMS[name].build()


@pytest.fixture
def user_rank_promotion():
    # The corpus programs broadcast biases by rank promotion, as users do.
    with jax.numpy_rank_promotion("allow"):
        yield


@pytest.mark.standard_promotion  # optax.adamw mixes int and float
@pytest.mark.usefixtures("user_rank_promotion")
@pytest.mark.parametrize(
    "name,policy",
    [
        ("gpt_scan_over_layers", "mixed_bfloat16"),
        ("gpt_scan_over_layers", F16),
        ("flax_nn_scan_gpt", "mixed_bfloat16"),
    ],
)
def test_scan_over_layers_whole_step_fuses_its_attention(name, policy):
    # A whole step over lax.scan-stacked layers: JAX puts the attention's
    # forward in one scan body and its backward in another; autocast proves
    # the backward across the two bodies and fuses both, so there is nothing
    # to say. (Where it cannot, the note names it: the tests of
    # test_autocast_attention_scan.py.)
    inst = _scan_program(name)
    args = (inst.train_state, *inst.args)
    report = mixprec.diagnose(inst.step, *args, policy=policy, refine=False)
    assert _attention_notes(report) == []
    explained = mixprec.explain(inst.step, *args, policy=policy)
    assert _attention_notes(explained) == []
    assert [
        (op.path, op.backward) for op in explained.find("dot_product_attention")
    ] == [("scan/body", False), ("scan/body", True)]


@pytest.mark.standard_promotion  # optax's cross-entropy mixes int and float
@pytest.mark.usefixtures("user_rank_promotion")
def test_no_unfused_attention_note_where_attention_fuses_or_is_absent():
    from corpus import scan_layers

    inst = _scan_program("gpt_scan_over_layers")
    params, (tokens, labels) = inst.params, inst.args
    # The loss alone (what the note advises): its attention is fused in the
    # scan body, and JAX differentiates the fused kernel.
    loss_only = mixprec.diagnose(inst.loss, params, tokens, labels, policy=F16)
    assert _attention_notes(loss_only) == []
    scaled = mixprec.diagnose(
        inst.loss, params, tokens, labels, policy=F16, loss_scale=1024.0, refine=False
    )
    assert _attention_notes(scaled) == []
    explained = mixprec.explain(inst.loss, params, tokens, labels, policy=F16)
    assert [op.path for op in explained.find("dot_product_attention")] == ["scan/body"]

    # The same layers unrolled: both passes fused in one jaxpr, nothing to say.
    def unrolled(params, tokens, labels):
        x = params["embed"][tokens]
        for i in range(scan_layers.LAYERS):
            layer = jax.tree.map(lambda a, i=i: a[i], params["layers"])
            x, _ = scan_layers.block(x, layer)
        logits = x @ params["head"]
        return jnp.mean(
            jax.nn.logsumexp(logits, axis=-1)
            - jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
        )

    step = jax.grad(unrolled)
    report = mixprec.diagnose(step, params, tokens, labels, policy=F16, refine=False)
    assert _attention_notes(report) == []
    fused = mixprec.explain(step, params, tokens, labels, policy=F16)
    assert [op.backward for op in fused.find("dot_product_attention")] == [
        False,
        False,
        True,
        True,
    ]

    # A scanned whole step without attention.
    def mlp(ws, x):
        y, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)
        return jnp.mean(y**2)

    ws = 0.3 * jax.random.normal(jax.random.key(0), (2, 16, 16))
    x = jax.random.normal(jax.random.key(1), (4, 16))
    report = mixprec.diagnose(jax.grad(mlp), ws, x, policy=F16, refine=False)
    assert _attention_notes(report) == []
