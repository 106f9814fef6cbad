"""A written-out RMSNorm with its scale recognised by autocast and run as one
op: float32 statistics, its result in the compute dtype, one decision and one
row in ``explain``.

Which written-out forms are recognised and which near misses are not, values
and gradients against float32 (bfloat16 and float16), the result's dtype, the
scopes that keep it unfused, composition with ``jit``, ``vmap`` and
``lax.scan``, and programs without a norm left as they are.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import BF16, F16, F32, assert_trees_close, tol

import mixprec
from mixprec._src.autocast import fusions
from mixprec._src.autocast.fusions.norm import pattern as norm


D = 64
POLICIES = {BF16: "mixed_bfloat16", F16: "mixed_float16"}


def _row(scale, x):  # (the suite raises on implicit rank promotion)
    return scale.reshape((1,) * (x.ndim - 1) + scale.shape)


def rms_square(x, scale):
    ms = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(ms + 1e-6) * _row(scale, x)


def rms_mul_expand(x, scale):  # x·x, no keepdims, broadcast after the rsqrt
    ms = jnp.mean(x * x, axis=-1)
    return _row(scale, x) * (jax.lax.rsqrt(ms + 1e-5)[..., None] * x)


def rms_pow(x, scale):
    ms = jnp.mean(x**2, axis=-1, keepdims=True)
    return _row(scale, x) * (x * jax.lax.rsqrt(1e-6 + ms))


FORMS = {"square": rms_square, "mul_expand": rms_mul_expand, "pow": rms_pow}


def _args(seed=0, rows=(4, 8)):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    w = jax.random.normal(k1, (D, D), jnp.float32) / np.sqrt(D)
    scale = 1.0 + 0.1 * jax.random.normal(k2, (D,), jnp.float32)
    x = jax.random.normal(k3, (*rows, D), jnp.float32)
    return w, scale, x


def _net(norm_fn):
    def net(w, scale, x):
        return jnp.tanh(norm_fn(x @ w, scale))

    return net


def _names(jaxpr):
    return [e.primitive.name for e in jaxpr.eqns]


def _rewritten(fn, *args):
    closed = jax.make_jaxpr(fn)(*args)
    return norm.rewrite(closed.jaxpr, closed.consts)


@pytest.mark.parametrize("form", FORMS)
def test_written_out_forms_become_one_op(form):
    w, scale, x = _args()
    out = _rewritten(FORMS[form], x, scale)
    names = _names(out)
    assert names.count("rms_norm") == 1
    assert not {"rsqrt", "reduce_sum", "square", "integer_pow", "mul"} & set(names)
    (eqn,) = [e for e in out.eqns if e.primitive is norm.RMS_NORM_P]
    assert eqn.params["fusion"].axes == (2,)
    assert eqn.params["flops"] == 4 * x.size


def _other_array(x, scale):
    y = x + 1.0
    ms = jnp.mean(jnp.square(y), axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(ms + 1e-6) * _row(scale, x)


def _wrong_divisor(x, scale):
    ms = jnp.sum(jnp.square(x), axis=-1, keepdims=True) / (D - 1)
    return x * jax.lax.rsqrt(ms + 1e-6) * _row(scale, x)


def _statistic_read_elsewhere(x, scale):
    ms = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(ms + 1e-6) * _row(scale, x), ms


def _constant_factor(x, scale):
    del scale
    ms = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(ms + 1e-6) * 2.0


def _no_scale(x, scale):
    del scale
    ms = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(ms + 1e-6)


def _cube(x, scale):
    ms = jnp.mean(x**3, axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(ms + 1e-6) * _row(scale, x)


def _sqrt_divide(x, scale):  # another spelling: not recognised (documented)
    ms = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    return x / jnp.sqrt(ms + 1e-6) * _row(scale, x)


NEAR_MISSES = {
    "other_array": _other_array,
    "wrong_divisor": _wrong_divisor,
    "statistic_read_elsewhere": _statistic_read_elsewhere,
    "constant_factor": _constant_factor,
    "no_scale": _no_scale,
    "cube": _cube,
    "sqrt_divide": _sqrt_divide,
}


@pytest.mark.parametrize("name", NEAR_MISSES)
def test_near_misses_stay_unfused(name):
    _, scale, x = _args()
    closed = jax.make_jaxpr(NEAR_MISSES[name])(x, scale)
    assert norm.rewrite(closed.jaxpr, closed.consts) is closed.jaxpr
    report = mixprec.explain(NEAR_MISSES[name], x, scale, policy="mixed_bfloat16")
    assert not report.find("rms_norm")


@pytest.mark.parametrize("low", [BF16, F16], ids=str)
@pytest.mark.parametrize("form", FORMS)
def test_values_and_dtype_against_float32(form, low):
    args = _args()
    net = _net(FORMS[form])
    report = mixprec.explain(net, *args, policy=POLICIES[low])
    [row] = report.find("rms_norm")
    assert row.decision == "low"
    assert row.out_dtypes == (str(low),)
    assert "float32" in row.reason and "RMSNorm" in row.reason
    assert row.flops == 4 * args[2].size
    # One row in place of the norm's ops.
    assert not report.find("rsqrt") and not report.find("reduce_sum")
    out = jax.jit(mixprec.autocast(net, POLICIES[low]))(*args)
    assert out.dtype == F32  # the policy's output dtype
    # Two roundings to the low dtype (the matmul's result, the norm's).
    ref = net(*args)
    assert np.max(np.abs(out - ref)) <= 2 * tol(low) * np.max(np.abs(ref))
    # The norm alone: its operands rounded to the compute dtype, statistics
    # in float32, the result rounded once.
    _, scale, x = args
    y = jax.jit(mixprec.autocast(FORMS[form], POLICIES[low]))(x, scale)
    assert y.dtype == F32
    ref = FORMS[form](x.astype(low).astype(F32), scale.astype(low).astype(F32))
    assert_trees_close(y, ref, dtype=low)


@pytest.mark.parametrize("low", [BF16, F16], ids=str)
def test_gradients_against_float32(low):
    args = _args()
    net = _net(rms_square)

    def loss(w, scale, x):
        return jnp.mean(net(w, scale, x) ** 2)

    grads = jax.jit(jax.grad(mixprec.autocast(loss, POLICIES[low]), argnums=(0, 1, 2)))(
        *args
    )
    ref = jax.grad(loss, argnums=(0, 1, 2))(*args)
    for g in grads:
        assert g.dtype == F32
    assert_trees_close(grads, ref, dtype=low, grad=True)


@pytest.mark.parametrize("low", [BF16, F16], ids=str)
def test_whole_step_against_float32(low):
    args = _args()
    net = _net(rms_square)

    def step(w, scale, x):
        def loss(w, scale):
            return jnp.mean(net(w, scale, x) ** 2)

        value, (gw, gs) = jax.value_and_grad(loss, argnums=(0, 1))(w, scale)
        return value, w - 0.1 * gw, scale - 0.1 * gs

    # Its backward pass reads the statistic: left as written, op by op.
    report = mixprec.explain(step, *args, policy=POLICIES[low])
    assert not report.find("rms_norm") and report.find("rsqrt")
    out = jax.jit(mixprec.autocast(step, POLICIES[low]))(*args)
    ref = step(*args)
    for a in out:
        assert a.dtype == F32
    assert_trees_close(out[0], ref[0], dtype=low)
    assert_trees_close(out[1:], ref[1:], dtype=low, grad=True)


def test_float32_scope_and_float32_policy_do_not_fuse():
    args = _args()

    def scoped(w, scale, x):
        h = x @ w
        with mixprec.float32_scope():
            ms = jnp.mean(jnp.square(h), axis=-1, keepdims=True)
        return h * jax.lax.rsqrt(ms + 1e-6) * _row(scale, x)

    report = mixprec.explain(scoped, *args, policy="mixed_bfloat16")
    assert not report.find("rms_norm")
    assert report.find("rsqrt")
    report = mixprec.explain(_net(rms_square), *args, policy="float32")
    assert not report.find("rms_norm")

    # And the whole norm in the scope.
    def in_scope(x, s):
        with mixprec.float32_scope():
            return rms_square(x, s)

    report = mixprec.explain(_net(in_scope), *args, policy="mixed_bfloat16")
    assert not report.find("rms_norm")
    assert [op.out_dtypes for op in report.find("rsqrt")] == [("float32",)]


@pytest.mark.parametrize("low", [BF16, F16], ids=str)
def test_composes_with_jit_vmap_and_scan(low):
    w, scale, x = _args(rows=(8,))
    inner = jax.jit(rms_square)

    def layer(h, ws):
        return jnp.tanh(inner(h @ ws, scale)), None

    def net(ws, x):
        return jax.lax.scan(layer, x, ws)[0]

    ws = jnp.stack([w, w * 0.5, w * 2.0])
    batched = jax.vmap(net, in_axes=(None, 0))
    xs = jnp.stack([x, -x])
    report = mixprec.explain(batched, ws, xs, policy=POLICIES[low])
    [row] = report.find("rms_norm")
    assert "scan" in row.path and row.out_dtypes == (str(low),)
    out = jax.jit(mixprec.autocast(batched, POLICIES[low]))(ws, xs)
    assert out.dtype == F32

    def unrolled(ws, x):  # no jit, vmap or scan
        for ws_i in ws:
            x = jnp.tanh(rms_square(x @ ws_i, scale))
        return x

    plain = mixprec.autocast(unrolled, POLICIES[low])
    expected = jnp.stack([plain(ws, x_i) for x_i in xs])
    assert mixprec.explain(unrolled, ws, x, policy=POLICIES[low]).find("rms_norm")
    assert_trees_close(out, expected, dtype=low)
    # Against float32: three layers, two roundings each.
    ref = batched(ws, xs)
    assert np.max(np.abs(out - ref)) <= 6 * tol(low) * np.max(np.abs(ref))


def test_programs_without_a_norm_are_unchanged():
    def fn(x, scale):  # an rsqrt, a mean, no norm
        return jax.lax.rsqrt(jnp.mean(x * x) + 1.0) + jnp.sum(x * _row(scale, x))

    def of_a_literal(x):  # an rsqrt of a constant (a scale written so)
        return x * jax.lax.rsqrt(48.0)

    def statistic_times_a_literal(x):
        ms = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
        return jax.lax.rsqrt(ms + 1e-6) * 2.0

    _, scale, x = _args()
    closed = jax.make_jaxpr(fn)(x, scale)
    assert norm.rewrite(closed.jaxpr, closed.consts) is closed.jaxpr
    for other in (of_a_literal, statistic_times_a_literal):
        closed = jax.make_jaxpr(other)(x)
        assert norm.rewrite(closed.jaxpr, closed.consts) is closed.jaxpr
    net = _net(lambda h, s: h * _row(s, h))
    args = _args()
    a = jax.jit(mixprec.autocast(net, "mixed_bfloat16"))(*args)
    closed = jax.make_jaxpr(net)(*args)
    assert fusions.passes()  # the registry is loaded
    assert [n for n in _names(closed.jaxpr)] == _names(
        norm.rewrite(closed.jaxpr, closed.consts)
    )
    assert a.dtype == F32
