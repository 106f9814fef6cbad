"""Float8 under autocast: the arithmetic against NumPy/ml_dtypes, the dots and
their gradients, the jaxpr, the policy and recipe, explain and diagnose."""

import inspect

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import BF16, F32, assert_tree_dtypes, iter_eqns
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import mixprec
from mixprec._src import float8 as f8
from mixprec._src.autocast import float8_dots
from mixprec._src.workloads import models


E4M3, E5M2 = np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2)
FORMATS = [E4M3, E5M2]
DN = (((1,), (0,)), ((), ()))  # (M, K) x (K, N)
SMALL = "p=f32,c=bf16,o=f32,f8={}:min_dim=16"  # float8 for small test shapes
# The named recipes' data, written out here (not read from the code under test):
# which scale per row, and the gradients' format.
ROWWISE = {"rowwise", "rowwise_e4m3"}
GRAD_FORMAT = {"tensorwise": E5M2, "rowwise": E5M2, "rowwise_e4m3": E4M3}
# Gradients of a whole network against float32: norm of the error over the norm
# of the float32 gradient, all leaves together. bfloat16 reaches about 0.005
# on the models below; float8 (3 or 2 mantissa bits) about 0.04-0.06.
FLOAT8_GRAD_TOL = 0.1


def np_quantize(x, fmt, axes=None):
    """The reference: amax -> scale -> clip -> cast, in NumPy and ml_dtypes."""
    x = np.asarray(x, np.float32)
    big = np.float32(ml_dtypes.finfo(fmt).max)
    amax = np.max(np.abs(x), axis=axes, keepdims=True)
    inv = np.float32(1 / big)  # the scale is amax times the constant 1/max
    scale = np.where(
        amax == 0, np.float32(1), np.maximum(amax * inv, np.finfo(np.float32).tiny)
    ).astype(np.float32)
    return np.clip(x / scale, -big, big).astype(fmt), scale


def global_rel_error(actual, reference) -> float:
    a = np.concatenate([np.ravel(np.asarray(v, np.float64)) for v in actual])
    r = np.concatenate([np.ravel(np.asarray(v, np.float64)) for v in reference])
    return float(np.linalg.norm(a - r) / np.linalg.norm(r))


def _rng_values(seed, shape, spread=6.0):
    """Values over many binades, both signs, some zeros."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * np.exp2(rng.uniform(-spread, spread, shape))
    x[rng.random(shape) < 0.05] = 0.0
    return x.astype(np.float32)


# ------------------------------------------------------------------ arithmetic


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("axes", [None, (1,), (0,)])
def test_quantize_matches_numpy_reference_bit_for_bit(fmt, axes):
    x = _rng_values(0, (48, 40))
    x[3] = 0.0  # an all-zero row: scale 1
    q, s = f8.quantize(jnp.asarray(x), fmt, axes)
    q_ref, s_ref = np_quantize(x, fmt, axes)
    assert q.dtype == fmt and s.dtype == F32 and s.shape == s_ref.shape
    np.testing.assert_array_equal(np.asarray(s), s_ref)
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), q_ref.view(np.uint8))
    if axes == (1,):
        assert float(s[3, 0]) == 1.0


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_round_trip_within_half_an_ulp(fmt):
    x = _rng_values(1, (4096,), spread=3.0)
    q, s = jax.jit(lambda v: f8.quantize(v, fmt))(jnp.asarray(x))
    back = np.asarray(f8.dequantize(q, s, jnp.float32), np.float64)
    assert f8.dequantize(q, s, jnp.float32).dtype == F32
    info = ml_dtypes.finfo(fmt)
    scaled = np.abs(x.astype(np.float64)) / float(s.reshape(()))
    normal = scaled >= float(info.smallest_normal)
    rel = np.abs(back - x)[normal] / np.abs(x)[normal]
    assert rel.max() <= 2.0 ** -(int(info.nmant) + 1) + 1e-7
    # Below the normal range: the error is at most half the smallest subnormal.
    sub_err = np.abs(back - x)[~normal] / float(s.reshape(()))
    assert sub_err.max() <= float(info.smallest_subnormal) / 2 + 1e-12
    assert np.count_nonzero(normal) > 3000


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_saturation_not_inf_or_nan(fmt):
    big = f8.format_max(fmt)
    x = jnp.array([1e30, -1e30, 1.1 * big, 2.0, 0.0], jnp.float32)
    q, _ = f8.quantize(x, fmt, scale=1.0)
    got = np.asarray(q, np.float64)
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got, [big, -big, big, 2.0, 0.0])
    # A plain cast overflows (NaN for e4m3fn, inf for e5m2): what the clip avoids.
    assert not np.isfinite(np.asarray(x.astype(fmt), np.float64)[:2]).any()
    # Current scaling maps amax onto the max exactly: even huge values fit.
    q2, s2 = f8.quantize(x, fmt)
    assert np.isfinite(np.asarray(q2, np.float64)).all()
    assert float(np.asarray(q2, np.float64)[0]) == big
    assert float(s2.reshape(())) == pytest.approx(1e30 / big, rel=1e-6)


def test_scale_arithmetic_and_nonfinite_amax():
    amax = jnp.array([448.0, 0.0, 1.0, jnp.inf], jnp.float32)
    s = f8.scale_from_amax(amax, E4M3)
    assert s.dtype == F32
    inv = np.float32(1 / 448)
    np.testing.assert_array_equal(
        np.asarray(s)[:3], np.array([448 * inv, 1, inv], np.float32)
    )
    assert np.isinf(np.asarray(s)[3])
    assert f8.format_max(E4M3) == 448.0 and f8.format_max(E5M2) == 57344.0


def test_quantization_counts():
    x = np.array([448.0, 1.0, 1e-4, 0.0, -448.0], np.float32)
    assert f8.quantization_counts(x, E4M3) == (0, 1, 5)  # 1e-4 flushes
    # e5m2's range keeps 1e-4 (>= 448 * 2**-16 / 57344).
    assert f8.quantization_counts(x, E5M2) == (0, 0, 5)


# ------------------------------------------------------------------ the dots


def _dot(a, b, scaling, **kw):
    kw.setdefault("out_dtype", jnp.float32)
    return float8_dots.dot_general(
        a,
        b,
        dimension_numbers=DN,
        recipe=f8.Float8Recipe(scaling, min_dim=1),
        low_dtype=jnp.bfloat16,
        **kw,
    )


def _ref_dot(a, b, scaling, fa=E4M3, fb=E4M3):
    rowwise = scaling in ROWWISE
    return _ref_scaled_dot(a, b, rowwise, rowwise, fa, fb)


def _ref_scaled_dot(a, b, row_a, row_b, fa, fb):
    """``a @ b`` of float8-scaled operands; ``row_*``: one scale per row of
    ``a`` / column of ``b`` (over the contraction) instead of one per tensor."""
    qa, sa = np_quantize(a, fa, (1,) if row_a else None)
    qb, sb = np_quantize(b, fb, (0,) if row_b else None)
    prod = qa.astype(np.float64) @ qb.astype(np.float64)
    return prod * sa.astype(np.float64) * sb.astype(np.float64)


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise", "rowwise_e4m3"])
def test_dot_forward_and_backward_match_numpy(scaling):
    a, b = _rng_values(2, (32, 48), 2.0), _rng_values(3, (48, 16), 2.0)
    g = _rng_values(4, (32, 16), 2.0)
    out, vjp = jax.vjp(lambda x, y: _dot(x, y, scaling), jnp.asarray(a), jnp.asarray(b))
    assert out.dtype == F32
    ref = _ref_dot(a, b, scaling)
    np.testing.assert_allclose(
        np.asarray(out), ref, rtol=0, atol=2e-6 * np.abs(ref).max()
    )
    da, db = vjp(jnp.asarray(g))
    assert da.dtype == db.dtype == F32
    fg = GRAD_FORMAT[scaling]
    if scaling == "tensorwise":  # residuals: the forward's float8 operands
        ref_da = _ref_dot(g, b.T, scaling, fg, E4M3)
        ref_db = _ref_dot(a.T, g, scaling, E4M3, fg)
    else:  # re-quantized along the backward contraction, from bf16 residuals
        a16 = a.astype(ml_dtypes.bfloat16).astype(np.float32)
        b16 = b.astype(ml_dtypes.bfloat16).astype(np.float32)
        ref_da = _ref_dot(g, b16.T, scaling, fg, E4M3)
        ref_db = _ref_dot(a16.T, g, scaling, E4M3, fg)
    for got, want in ((da, ref_da), (db, ref_db)):
        np.testing.assert_allclose(
            np.asarray(got), want, rtol=0, atol=2e-6 * np.abs(want).max()
        )


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_gpu_formulation_hands_float8_operands_to_the_dot(scaling):
    # The GPU formulation (pinned here; exported for cuda in the export
    # tests): the dot takes the float8 arrays themselves, so that no compiler
    # pass can fold their rounding away, and XLA's GPU compiler can give it
    # to cuBLASLt's float8 GEMM. XLA:CPU runs such a dot too (widening the
    # operands), so its numbers are checked here against NumPy, forward and
    # backward (e5m2 cotangent).
    a, b = _rng_values(5, (32, 48), 2.0), _rng_values(6, (48, 16), 2.0)
    g = _rng_values(7, (32, 16), 2.0)

    def f(x, y):
        return _dot(x, y, scaling, platform="gpu")

    out, vjp = jax.vjp(jax.jit(f), jnp.asarray(a), jnp.asarray(b))
    ref = _ref_dot(a, b, scaling)
    np.testing.assert_allclose(
        np.asarray(out), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max()
    )
    jaxpr = jax.make_jaxpr(lambda x, y: jax.vjp(f, x, y)[1](g))(a, b)
    dots_ = [e for e in iter_eqns(jaxpr, None) if e.primitive.name == "dot_general"]
    assert len(dots_) == 3  # forward, d_lhs, d_rhs
    for e in dots_:
        kinds = {str(v.aval.dtype) for v in e.invars}
        assert kinds <= {"float8_e4m3fn", "float8_e5m2"}, kinds
        assert str(e.outvars[0].aval.dtype) == "float32"
    backward = [{str(v.aval.dtype) for v in e.invars} for e in dots_[1:]]
    assert all("float8_e5m2" in k for k in backward)
    d_lhs, d_rhs = vjp(jnp.asarray(g))
    qg, sg = np_quantize(g, f8.E5M2, (1,) if scaling == "rowwise" else None)
    if scaling == "tensorwise":
        qa, sa = np_quantize(a, E4M3)
        qb, sb = np_quantize(b, E4M3)
        g64 = qg.astype(np.float64) * sg.astype(np.float64)
        ref_lhs = g64 @ (qb.astype(np.float64) * sb.astype(np.float64)).T
        ref_rhs = (qa.astype(np.float64) * sa.astype(np.float64)).T @ g64
        for got, want in ((d_lhs, ref_lhs), (d_rhs, ref_rhs)):
            np.testing.assert_allclose(
                np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max()
            )


@pytest.mark.parametrize("platform", ["cpu", "gpu"])
@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_tiny_products_are_not_flushed(scaling, platform):
    # The rule: scales are applied so that a result float32 can represent is
    # never flushed. Each scale is amax/448 = 3.3e-23; their product, 1.1e-45,
    # is below float32's smallest subnormal, while the true result, 64 x
    # (1.5e-20)^2 = 1.4e-38, is a normal float32.
    a = np.full((16, 64), 1.5e-20, np.float32)
    b = np.full((64, 16), 1.5e-20, np.float32)
    want = a.astype(np.float64) @ b.astype(np.float64)
    assert want.min() > np.finfo(np.float32).tiny
    out = jax.jit(lambda x, y: _dot(x, y, scaling, platform=platform))(a, b)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-2)


def test_tiny_convolutions_are_not_flushed():
    x = np.full((1, 64, 4, 4), 1.5e-20, np.float32)
    k = np.full((16, 64, 1, 1), 1.5e-20, np.float32)
    conv_dn = lax.ConvDimensionNumbers((0, 1, 2, 3), (0, 1, 2, 3), (0, 1, 2, 3))
    y = float8_dots.conv_general_dilated(
        x, k, recipe=f8.Float8Recipe(min_dim=1), low_dtype=jnp.bfloat16,
        out_dtype=jnp.float32, platform="cpu", window_strides=(1, 1),
        padding=((0, 0), (0, 0)), lhs_dilation=(1, 1), rhs_dilation=(1, 1),
        dimension_numbers=conv_dn, feature_group_count=1, batch_group_count=1,
        precision=None, preferred_element_type=None,
    )  # fmt: skip
    np.testing.assert_allclose(
        np.asarray(y), np.full(y.shape, 64 * 1.5e-20**2), rtol=1e-2
    )


@pytest.mark.parametrize(
    ("scales", "formats"),
    [
        (("rowwise", "tensorwise"), ("e4m3", "e5m2")),
        (("tensorwise", "rowwise"), ("e4m3", "e4m3")),
        (("rowwise", "rowwise"), ("e5m2", "e4m3")),
    ],
)
def test_the_recipe_data_drives_the_formulation(scales, formats):
    # A recipe built here, with scales and formats no named recipe has: the
    # formulation reads them per role (an operand, a gradient), forward and
    # backward, so a new recipe needs no code.
    recipe = f8.Float8Recipe(min_dim=1, formats=formats, scales=scales)
    fmt = {"e4m3": E4M3, "e5m2": E5M2}
    f_op, f_grad = fmt[formats[0]], fmt[formats[1]]
    row_op, row_grad = (s == "rowwise" for s in scales)
    a, b = _rng_values(12, (32, 48), 2.0), _rng_values(13, (48, 16), 2.0)
    g = _rng_values(14, (32, 16), 2.0)

    def f(x, y):
        return float8_dots.dot_general(
            x, y, dimension_numbers=DN, recipe=recipe, low_dtype=jnp.bfloat16,
            out_dtype=jnp.float32,
        )  # fmt: skip

    out, vjp = jax.vjp(f, jnp.asarray(a), jnp.asarray(b))
    da, db = vjp(jnp.asarray(g))
    # Residuals scaled per row are kept in bfloat16 and quantized again along
    # the backward contraction; per tensor, the forward's float8 values.
    a_r, b_r = (
        x.astype(ml_dtypes.bfloat16).astype(np.float32) if row_op else x for x in (a, b)
    )
    want = {
        "out": (out, _ref_scaled_dot(a, b, row_op, row_op, f_op, f_op)),
        "d_lhs": (da, _ref_scaled_dot(g, b_r.T, row_grad, row_op, f_grad, f_op)),
        "d_rhs": (db, _ref_scaled_dot(a_r.T, g, row_op, row_grad, f_op, f_grad)),
    }
    tensorwise = {
        "out": _ref_scaled_dot(a, b, False, False, E4M3, E4M3),
        "d_lhs": _ref_scaled_dot(g, b.T, False, False, E5M2, E4M3),
        "d_rhs": _ref_scaled_dot(a.T, g, False, False, E4M3, E5M2),
    }
    differs = []
    for name, (got, ref) in want.items():
        atol = 2e-6 * np.abs(ref).max()
        np.testing.assert_allclose(
            np.asarray(got), ref, rtol=0, atol=atol, err_msg=name
        )
        differs.append(np.abs(tensorwise[name] - ref).max() > 100 * atol)
    # The comparison can tell the recipes apart: where a role's data differs
    # from the default recipe, the numbers do.
    assert sum(differs) >= 2, differs
    # The formats reach the products as written in the recipe.
    jaxpr = jax.make_jaxpr(lambda x, y: jax.vjp(f, x, y)[1](g))(a, b)
    converts = [
        str(e.params["new_dtype"])
        for e in iter_eqns(jaxpr, None)
        if e.primitive.name == "convert_element_type"
        and str(e.params["new_dtype"]).startswith("float8")
    ]
    # Forward: lhs and rhs; backward: the cotangent (once per contraction
    # where its scales differ) and re-quantized residuals.
    assert converts[:2] == [f_op.name] * 2
    assert converts[2:].count(f_grad.name) == (2 if row_grad else 1) + (
        2 * (f_grad == f_op) if row_op else 0
    )


def test_recipe_data_reaches_autocast_decisions():
    # Through a policy string: the decision names each operand's format and
    # scales from the recipe's data.
    policy = SMALL.format("tensorwise:scales=rowwise/tensorwise:formats=e4m3/e4m3")
    assert mixprec.get_policy(policy).float8 == f8.Float8Recipe(
        min_dim=16, scales=("rowwise", "tensorwise"), formats=(E4M3, E4M3)
    )
    p, x, t = _mlp_problem()
    report = mixprec.explain(jax.grad(mlp_loss), p, x, t, policy=policy)
    dots_ = report.find("dot_general")
    assert dots_ and all(op.decision == "float8" for op in dots_)
    for op in dots_:
        assert op.in_dtypes == ("float8_e4m3fn",) * 2
        if op.backward:  # a gradient (per tensor) times a residual (per row)
            assert "rowwise / tensorwise" in op.reason or (
                "tensorwise / rowwise" in op.reason
            ), op.reason
        else:
            assert "(rowwise current scaling)" in op.reason, op.reason


def _row_maxes(jaxpr):
    """Amax reductions with a non-scalar result: scales per row."""
    return [
        e
        for e in iter_eqns(jaxpr)
        if e.primitive.name == "reduce_max" and e.outvars[0].aval.shape
    ]


def test_a_recipe_is_one_entry_of_the_table(monkeypatch):
    # A recipe that differs only in data needs no code: registered here, it
    # runs through the policy string, autocast and explain. This one scales
    # operands per tensor and gradients per row, all in e4m3.
    monkeypatch.setitem(
        f8.RECIPES,
        "test_e4m3_rowwise_gradients",
        f8._Preset((E4M3, E4M3), ("tensorwise", "rowwise"), "a test recipe"),
    )
    policy = SMALL.format("test_e4m3_rowwise_gradients")
    recipe = mixprec.get_policy(policy).float8
    assert str(recipe) == "test_e4m3_rowwise_gradients:min_dim=16"
    assert recipe.scales == ("tensorwise", "rowwise")
    p, x, t = _mlp_problem()
    loss = mixprec.autocast(mlp_loss, policy)
    forward = jax.make_jaxpr(loss)(p, x, t)
    grad = jax.make_jaxpr(jax.grad(loss))(p, x, t)
    assert {d for d, _ in _float8_converts(grad)} == {"float8_e4m3fn"}
    # Per tensor forward, per row for the gradients only.
    assert not _row_maxes(forward) and _row_maxes(grad)
    ref = jax.jit(jax.grad(mlp_loss))(p, x, t)
    got = jax.jit(jax.grad(loss))(p, x, t)
    assert_tree_dtypes(got, ref)
    err = global_rel_error(jax.tree.leaves(got), jax.tree.leaves(ref))
    assert err < FLOAT8_GRAD_TOL
    report = mixprec.explain(jax.grad(mlp_loss), p, x, t, policy=policy)
    assert all(op.decision == "float8" for op in report.find("dot_general"))


def test_rowwise_e4m3_quantizes_gradients_to_e4m3():
    # DeepSeek-V3's choice: e4m3 for gradients too, rowwise scales.
    p, x, t = _mlp_problem()
    policy = SMALL.format("rowwise_e4m3")
    step = jax.make_jaxpr(mixprec.autocast(jax.grad(mlp_loss), policy))(p, x, t)
    grad = jax.make_jaxpr(jax.grad(mixprec.autocast(mlp_loss, policy)))(p, x, t)
    for jaxpr in (step, grad):
        converts = _float8_converts(jaxpr)
        assert converts and {d for d, _ in converts} == {"float8_e4m3fn"}
        assert any(bwd for _, bwd in converts) or jaxpr is grad
        # Rowwise: amax per row, a reduce_max with a non-scalar result.
        assert _row_maxes(jaxpr)
    report = mixprec.explain(jax.grad(mlp_loss), p, x, t, policy=policy)
    for op in report.find("dot_general"):
        assert op.decision == "float8" and op.float8 == "rowwise_e4m3:min_dim=16"
        assert op.in_dtypes == ("float8_e4m3fn",) * 2
        assert "rowwise current scaling" in op.reason
        assert ("(gradient)" in op.reason) == op.backward


# ------------------------------------------------------------------ autocast


def _mlp(p, x):
    h = jax.nn.relu(x @ p["w1"] + p["b1"][None])
    h = jax.nn.relu(h @ p["w2"] + p["b2"][None])
    return h @ p["w3"]


def _mlp_problem():
    k = jax.random.split(jax.random.key(0), 5)
    p = {
        "w1": jax.random.normal(k[0], (64, 128)) / 8,
        "b1": jnp.full(128, 0.1),
        "w2": jax.random.normal(k[1], (128, 128)) / 11,
        "b2": jnp.full(128, 0.1),
        "w3": jax.random.normal(k[2], (128, 16)) / 11,
    }
    x = jax.random.uniform(k[3], (128, 64))
    t = 2.0 + jax.random.normal(k[4], (128, 16))
    return p, x, t


def mlp_loss(p, x, t):
    return jnp.mean((_mlp(p, x) - t) ** 2)


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise", "rowwise_e4m3"])
def test_mlp_gradients_within_float8_tolerance(scaling):
    p, x, t = _mlp_problem()
    policy = SMALL.format(scaling)
    ref = jax.jit(jax.grad(mlp_loss))(p, x, t)
    through_vjp = jax.jit(jax.grad(mixprec.autocast(mlp_loss, policy)))(p, x, t)
    whole_step = jax.jit(mixprec.autocast(jax.grad(mlp_loss), policy))(p, x, t)
    bf16 = jax.jit(jax.grad(mixprec.autocast(mlp_loss, "mixed_bfloat16")))(p, x, t)
    for g in (through_vjp, whole_step):
        assert_tree_dtypes(g, ref)
        err = global_rel_error(jax.tree.leaves(g), jax.tree.leaves(ref))
        assert err < FLOAT8_GRAD_TOL
        # float8 really ran: it is coarser than bfloat16.
        assert err > 2 * global_rel_error(jax.tree.leaves(bf16), jax.tree.leaves(ref))


def test_transformer_block_gradients_within_float8_tolerance():
    cfg = models.LMConfig(
        vocab_size=32, seq_len=16, d_model=64, num_heads=4, num_layers=1
    )
    params = models.lm_init(jax.random.key(0), cfg)
    tokens = (jnp.arange(16)[None, :] * 3 + jnp.arange(4)[:, None] * 5) % 32

    def loss(p, tok):
        out = models.lm_apply(p, tok, num_heads=4)
        return models.cross_entropy(out[:, :-1], tok[:, 1:])

    # min_dim=64: the dense layers (d_model 64, 64 tokens) run in float8, the
    # per-head attention products (K = 16) stay bfloat16.
    policy = "p=f32,c=bf16,o=f32,f8=tensorwise:min_dim=64"
    ref = jax.jit(jax.grad(loss))(params, tokens)
    got = jax.jit(jax.grad(mixprec.autocast(loss, policy)))(params, tokens)
    assert_tree_dtypes(got, ref)
    assert (
        global_rel_error(jax.tree.leaves(got), jax.tree.leaves(ref)) < FLOAT8_GRAD_TOL
    )
    report = mixprec.explain(jax.grad(loss), params, tokens, policy=policy)
    assert report.float8_flop_fraction > 0.7
    kept = [op for op in report.ops if op.float8_skip is not None]
    assert kept and all(op.float8_skip in ("size", "alignment") for op in kept)
    assert all("below the recipe min_dim=64" in op.reason for op in kept)


def _float8_converts(jaxpr, stack=""):
    """``(float8 dtype, in a backward pass)`` of every cast to float8; the name
    stack of an equation inside a sub-jaxpr continues its parent's."""
    out = []
    for e in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        here = stack + "/" + str(e.source_info.name_stack)
        if e.primitive.name == "convert_element_type":
            dtype = str(e.params["new_dtype"])
            if dtype.startswith("float8"):
                out.append((dtype, "transpose(" in here))
        for v in e.params.values():
            for sub in v if isinstance(v, tuple | list) else [v]:
                if hasattr(sub, "eqns") or hasattr(sub, "jaxpr"):
                    out.extend(_float8_converts(sub, here))
    return out


def test_jaxpr_e4m3_forward_e5m2_backward():
    p, x, t = _mlp_problem()
    policy = SMALL.format("tensorwise")
    # A whole step under autocast: the backward dots are equations of their own,
    # their gradient operand goes to e5m2 and the residual to e4m3.
    step = jax.make_jaxpr(mixprec.autocast(jax.grad(mlp_loss), policy))(p, x, t)
    converts = _float8_converts(step)
    assert {d for d, bwd in converts if not bwd} == {"float8_e4m3fn"}
    backward = [d for d, bwd in converts if bwd]
    assert backward.count("float8_e5m2") == backward.count("float8_e4m3fn") == 5
    # Autocast's loss under jax.grad: the custom_vjp quantizes the cotangent.
    grad = jax.make_jaxpr(jax.grad(mixprec.autocast(mlp_loss, policy)))(p, x, t)
    dtypes = [d for d, _ in _float8_converts(grad)]
    assert dtypes.count("float8_e4m3fn") == 6 and dtypes.count("float8_e5m2") == 3
    # explain reports the same formats.
    report = mixprec.explain(jax.grad(mlp_loss), p, x, t, policy=policy)
    for op in report.find("dot_general"):
        assert op.decision == "float8" and op.float8 == "tensorwise:min_dim=16"
        want = (
            ("float8_e5m2", "float8_e4m3fn") if op.backward else ("float8_e4m3fn",) * 2
        )
        assert sorted(op.in_dtypes) == sorted(want)


def test_forward_mode_ad_is_straight_through():
    # Under jax.jvp the product is float8 and its derivative treats quantization
    # as the identity: t = t_a @ b + a @ t_b, computed in bfloat16.
    a, b = _rng_values(8, (32, 48), 1.0), _rng_values(9, (48, 16), 1.0)
    ta, tb = _rng_values(10, (32, 48), 1.0), _rng_values(11, (48, 16), 1.0)
    f = mixprec.autocast(
        lambda x, y: x @ y, "p=f32,c=bf16,o=f32,f8=tensorwise:min_dim=16"
    )
    y, t = jax.jvp(f, (a, b), (ta, tb))
    assert y.dtype == t.dtype == F32
    ref = _ref_dot(a, b, "tensorwise")
    np.testing.assert_allclose(y, ref, rtol=0, atol=1e-2 * np.abs(ref).max())
    t_ref = ta.astype(np.float64) @ b + a.astype(np.float64) @ tb
    assert np.abs(np.asarray(t) - t_ref).max() <= 1e-2 * np.abs(t_ref).max()


def test_convolution_in_float8():
    k = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(k[0], (16, 16, 8, 8))
    w = jax.random.normal(k[1], (32, 16, 3, 3)) / 12

    def loss(w, x):
        y = lax.conv_general_dilated(x, w, (1, 1), "SAME")
        return jnp.mean(jnp.tanh(y) ** 2)

    policy = SMALL.format("rowwise")  # convolutions scale tensorwise anyway
    report = mixprec.explain(jax.grad(loss), w, x, policy=policy)
    convs = report.find("conv_general_dilated")
    assert convs and all(op.decision == "float8" for op in convs)
    assert "tensorwise" in convs[0].reason
    ref = jax.jit(jax.grad(loss))(w, x)
    for g in (
        jax.jit(jax.grad(mixprec.autocast(loss, policy)))(w, x),
        jax.jit(mixprec.autocast(jax.grad(loss), policy))(w, x),
    ):
        assert g.dtype == F32
        assert global_rel_error([g], [ref]) < FLOAT8_GRAD_TOL
    # The forward against the reference of the same arithmetic.
    qa, sa = np_quantize(np.asarray(x), E4M3)
    qb, sb = np_quantize(np.asarray(w), E4M3)
    want = lax.conv_general_dilated(
        jnp.asarray(qa.astype(np.float32)),
        jnp.asarray(qb.astype(np.float32)),
        (1, 1),
        "SAME",
        precision=lax.Precision.HIGHEST,
    ) * (sa.reshape(()) * sb.reshape(()))
    got = mixprec.autocast(
        lambda w, x: lax.conv_general_dilated(x, w, (1, 1), "SAME"),
        "p=f32,c=f32,o=f32,f8=tensorwise:min_dim=16",
    )(w, x)
    assert got.dtype == F32
    np.testing.assert_allclose(
        got, want, rtol=0, atol=1e-5 * float(jnp.abs(want).max())
    )


def test_nonfinite_values_reach_the_output():
    p, x, t = _mlp_problem()
    loss = mixprec.autocast(mlp_loss, SMALL.format("tensorwise"))
    bad = x.at[0, 0].set(jnp.inf)
    assert not jnp.isfinite(jax.jit(loss)(p, bad, t))
    grads = jax.jit(jax.grad(loss))(p, x, t.at[0, 0].set(jnp.inf))
    assert not mixprec.all_finite(grads)


def test_eight_devices_agree_with_one():
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices")
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    p, x, t = _mlp_problem()
    step = jax.jit(mixprec.autocast(jax.grad(mlp_loss), SMALL.format("tensorwise")))
    one = step(p, x, t)
    rows = NamedSharding(mesh, P("data"))
    sharded = step(p, jax.device_put(x, rows), jax.device_put(t, rows))
    # The amax of a sharded operand is a global reduction: the same scales.
    for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(sharded), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------ policy


def test_policy_names_strings_and_round_trip():
    pol = mixprec.get_policy("mixed_float8")
    assert pol.float8 == mixprec.Float8Recipe()
    assert (pol.param_dtype, pol.compute_dtype, pol.output_dtype) == (F32, BF16, F32)
    assert str(pol) == "p=f32,c=bf16,o=f32,f8=tensorwise"
    for spec in (
        "mixed_float8",
        "p=f32,c=bf16,f8=rowwise",
        "p=f32,c=bf16,f8=rowwise_e4m3",
        "p=f32,f8=tensorwise:scales=rowwise/tensorwise:formats=e4m3/e4m3",
        "f32,f8=tensorwise:min_dim=32"[4:] and "p=f32,f8=tensorwise:min_dim=32",
    ):
        parsed = mixprec.get_policy(spec)
        assert mixprec.get_policy(str(parsed)) == parsed and hash(parsed) == hash(
            mixprec.get_policy(str(parsed))
        )
    assert pol.with_float8(None) == mixprec.get_policy("mixed_bfloat16")
    assert pol != mixprec.get_policy("mixed_bfloat16")
    # The casts ignore the recipe: float8 is autocast's business.
    assert pol.cast_to_compute(jnp.ones(2)).dtype == BF16


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (
            lambda: mixprec.Float8Recipe("delayed"),
            "must be one of 'rowwise', 'rowwise_e4m3', 'tensorwise'",
        ),
        (lambda: mixprec.Float8Recipe(min_dim=0), "positive int"),
        (
            lambda: mixprec.Float8Recipe(formats=("e4m3", "int8")),
            r"`Float8Recipe\(formats=...\)` must hold float8 formats",
        ),
        (lambda: mixprec.Float8Recipe(formats="e4m3"), "must be a pair"),
        (
            lambda: mixprec.Float8Recipe(scales=("rowwise", "blockwise")),
            r"`Float8Recipe\(scales=...\)` must hold 'rowwise', 'tensorwise'",
        ),
        (
            lambda: mixprec.get_policy("p=f32,f8=rowwise:formats=e4m3/e3m4"),
            "must hold float8 formats",
        ),
        (lambda: mixprec.get_policy("p=f32,f8=rowwise:history=4"), "unknown option"),
        (lambda: mixprec.get_policy("p=f32,f8=rowise"), "Did you mean 'rowwise'"),
        (lambda: mixprec.Policy("f32", "bf16", "f32", float8=3), "Float8Recipe"),
    ],
)
def test_bad_recipes_are_clear_errors(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()


def test_recipes_key_the_cache_and_regions_turn_float8_off():
    def f(w, x):
        a = x @ w
        with mixprec.precision_scope("mixed_bfloat16"):
            b = x @ w
        return a, b

    w, x = jnp.ones((64, 64)), jnp.ones((32, 64))
    tw = mixprec.explain(f, w, x, policy=SMALL.format("tensorwise"))
    rw = mixprec.explain(f, w, x, policy=SMALL.format("rowwise"))
    assert [op.decision for op in tw.find("dot_general")] == ["float8", "low"]
    assert tw.find("dot_general")[0].reason != rw.find("dot_general")[0].reason
    f_tw = mixprec.autocast(f, SMALL.format("tensorwise"))
    f_rw = mixprec.autocast(f, SMALL.format("rowwise"))
    j_tw, j_rw = jax.make_jaxpr(f_tw)(w, x), jax.make_jaxpr(f_rw)(w, x)

    # rowwise reduces amax per row: a reduce_max with a non-scalar result.
    def row_maxes(j):
        return [
            e
            for e in iter_eqns(j)
            if e.primitive.name == "reduce_max" and e.outvars[0].aval.shape
        ]

    assert row_maxes(j_rw) and not row_maxes(j_tw)


# ------------------------------------------------------------------ reports


def _lines(fn, marker):
    lines, start = inspect.getsourcelines(fn)
    return [start + i for i, text in enumerate(lines) if marker in text]


def _classifier(w1, w2, x):
    h = jax.nn.relu(x @ w1)  # <- big
    return h @ w2  # <- logits


def test_explain_names_float8_products_and_the_skip_reasons():
    w1, w2, x = jnp.ones((256, 512)), jnp.ones((512, 10)), jnp.ones((128, 256))
    report = mixprec.explain(_classifier, w1, w2, x, policy="mixed_float8")
    big, logits = report.find("dot_general")
    assert (big.decision, big.float8, big.float8_skip) == ("float8", "tensorwise", None)
    assert big.in_dtypes == ("float8_e4m3fn", "float8_e4m3fn")
    assert big.out_dtypes == ("bfloat16",)
    assert (logits.decision, logits.dtype, logits.float8_skip) == (
        "low",
        "bfloat16",
        "alignment",
    )
    assert logits.float8_skip_reason == "N=10 not a multiple of 16"
    assert report.float8 == "tensorwise"
    total = big.flops + logits.flops
    assert report.float8_flop_fraction == pytest.approx(big.flops / total, rel=1e-2)
    text = report.float8_summary()
    assert "float8 (tensorwise): 1 of 2" in text and "N=10 not a multiple of 16" in text
    [issue] = report.alignment
    assert issue.multiple == 16 and issue.misaligned == ("N",)
    assert issue.source.endswith(
        f":{_lines(_classifier, '# <- logits')[0]} (_classifier)"
    )
    d = report.to_dict()
    assert d["float8"] == "tensorwise" and d["float8_flops"] == big.flops
    # Too small for the default min_dim (128): stays bfloat16, with the reason.
    small = mixprec.explain(
        _classifier, w1[:64, :64], w2[:64], x[:, :64], policy="mixed_float8"
    )
    assert small.find("dot_general")[0].float8_skip == "size"
    assert "M=128" not in small.find("dot_general")[0].reason
    assert "below the recipe min_dim=128" in small.find("dot_general")[0].reason


def test_diagnose_counts_flushed_values_per_dot():
    k = jax.random.split(jax.random.key(7), 2)
    w = jax.random.normal(k[0], (128, 128)) / 11
    x = jax.random.normal(k[1], (128, 128)).at[0, 0].set(3e4)  # one outlier
    report = mixprec.diagnose(lambda w, x: x @ w, w, x, policy="mixed_float8")
    [dot] = report.find("dot_general")
    assert dot.decision == "float8" and dot.float8 == "tensorwise"
    want = [f8.quantization_counts(np.asarray(a), E4M3) for a in (x, w)]
    assert (dot.saturated, dot.flushed) == (0, sum(c[1] for c in want))
    assert dot.quantized == x.size + w.size
    # With the outlier setting the scale, most small values of x flush to zero;
    # rowwise confines the damage to the outlier's row.
    assert dot.flushed > 500
    rowwise = mixprec.diagnose(
        lambda w, x: x @ w, w, x, policy="p=f32,c=bf16,o=f32,f8=rowwise"
    ).find("dot_general")[0]
    assert rowwise.flushed < dot.flushed / 10
    assert "flushed to zero after scaling" in report.summary()
    assert report.ok  # flushing is float8's range, not a problem to advise on


def test_explain_says_where_float8_runs_and_what_runs_instead():
    # A float8 policy never changes an op's precision silently: a convolution
    # runs in float8 on CPU only, and the report says what runs elsewhere.
    def f(x, k, w):
        y = lax.conv_general_dilated(x, k, (1, 1), "SAME")
        return (y.reshape(-1, 128) @ w).sum()

    x = jnp.ones((8, 128, 16, 16))
    k, w = jnp.ones((128, 128, 3, 3)), jnp.ones((128, 128))
    report = mixprec.explain(f, x, k, w, policy="mixed_float8")
    products = ("conv_general_dilated", "dot_general")
    decided = {o.primitive: o.decision for o in report.ops if o.primitive in products}
    assert decided == {"conv_general_dilated": "float8", "dot_general": "float8"}
    conv = next(n for n in report.notes if n.startswith("Float8 convolutions"))
    assert "emulated on CPU" in conv and "run in bfloat16 instead" in conv
    dots = next(n for n in report.notes if n.startswith("Float8 dots"))
    assert "straight into the GEMM" in dots and "XLA:CPU has no float8 GEMM" in dots
    assert "Float8 convolutions" in str(report)
    # Where a platform is known, one sentence for it.
    note = float8_dots.conv_float8_note(jnp.bfloat16, platform="gpu")
    assert (
        note.startswith("Float8 convolutions: not on cuda") and "emulated" not in note
    )
    assert "widened" in float8_dots.dot_float8_note(jnp.bfloat16, platform="cpu")
    # No float8 decision, no float8 note.
    plain = mixprec.explain(f, x, k, w, policy="mixed_bfloat16")
    assert not any(n.startswith("Float8") for n in plain.notes)


def test_one_inf_makes_a_tensorwise_product_nan_and_diagnose_says_why():
    """Under tensorwise scaling one inf in an operand makes every output of the
    product NaN (its amax is inf); ``diagnose`` notes it. Rowwise scaling
    confines it to the inf's row."""
    x = jax.random.normal(jax.random.key(0), (128, 128)).at[3, 5].set(jnp.inf)
    w = jax.random.normal(jax.random.key(1), (128, 128)) / 8

    def f(x, w):
        return x @ w

    ref = f(x, w)
    assert int(jnp.isnan(ref).sum()) == 0  # float32: only row 3 is inf
    tensorwise = mixprec.autocast(f, "mixed_float8")(x, w)
    assert bool(jnp.isnan(tensorwise).all())
    rowwise = mixprec.autocast(f, "p=f32,c=bf16,o=f32,f8=rowwise")(x, w)
    assert not bool(jnp.isnan(jnp.delete(rowwise, 3, axis=0)).any())
    diag = mixprec.diagnose(f, x, w, policy="mixed_float8")
    [note] = [n for n in diag.notes if "amax is inf" in n]
    assert "every output is NaN" in note and "float8.md" in note
    assert "amax is inf" in str(diag)
    diag = mixprec.diagnose(f, x, w, policy="p=f32,c=bf16,o=f32,f8=rowwise")
    assert not any("amax is inf" in n for n in diag.notes)
