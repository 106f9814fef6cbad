"""Autocast through higher-order primitives: jit, scan, while, cond, remat,
custom_jvp, custom_vjp, shard_map."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import BF16, F32, assert_tree_dtypes, assert_trees_close, iter_eqns
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import mixprec
from mixprec._src import _compat


_K = jax.random.split(jax.random.key(7), 4)
W = jax.random.normal(_K[0], (8, 8)) / np.sqrt(8)
U = jax.random.normal(_K[1], (8, 8)) / np.sqrt(8)
X = jax.random.normal(_K[2], (4, 8))
XS = jax.random.normal(_K[3], (6, 4, 8))


def _prims(fn, *args):
    return [
        (
            e.primitive.name,
            tuple(str(v.aval.dtype) for v in e.invars),
            tuple(str(v.aval.dtype) for v in e.outvars),
        )
        for e in iter_eqns(jax.make_jaxpr(fn)(*args))
    ]


def _low_dots(fn, *args):
    return [
        p for p in _prims(fn, *args) if p[0] == "dot_general" and p[1][0] == "bfloat16"
    ]


# ------------------------------------------------------------------ scan (RNN)


def _rnn(params, xs, h0):
    w, u = params

    def cell(h, x):
        h = jnp.tanh(h @ w + x @ u)
        return h, h.sum(axis=-1)

    h, ys = lax.scan(cell, h0, xs)
    return h, ys


def test_rnn_under_scan():
    f = mixprec.autocast(_rnn, "mixed_bfloat16")
    h0 = jnp.zeros((4, 8))
    h, ys = f((W, U), XS, h0)
    h_ref, ys_ref = _rnn((W, U), XS, h0)
    assert_tree_dtypes((h, ys), F32)
    assert_trees_close((h, ys), (h_ref, ys_ref), dtype=BF16)
    # dots inside the body are low precision
    assert len(_low_dots(f, (W, U), XS, h0)) >= 2
    # the carry keeps one dtype (float32, as written) across iterations
    scans = [
        e
        for e in iter_eqns(jax.make_jaxpr(f)((W, U), XS, h0))
        if e.primitive.name == "scan"
    ]
    body = scans[0].params["jaxpr"]
    n_c, _ = _compat.scan_layout(scans[0].params)
    carry_in = body.in_avals[n_c : n_c + 1]
    carry_out = body.out_avals[:1]
    assert [a.dtype for a in carry_in] == [a.dtype for a in carry_out] == [F32]

    def loss(params):
        h, ys = _rnn(params, XS, h0)
        return jnp.sum(h**2) + jnp.sum(ys)

    g = jax.jit(jax.grad(mixprec.autocast(loss, "mixed_bfloat16")))((W, U))
    assert_tree_dtypes(g, (W, U))
    assert_trees_close(g, jax.grad(loss)((W, U)), dtype=BF16, grad=True)


def test_scan_with_low_precision_carry_stays_low():
    def f(h0, xs):
        return lax.scan(lambda h, x: (h * 0.5 + x, None), h0, xs)[0]

    g = mixprec.autocast(f, "p=bf16,c=bf16,o=bf16")
    y = g(jnp.zeros((4, 8), BF16), XS.astype(BF16))
    assert y.dtype == BF16
    assert_trees_close(y, f(jnp.zeros((4, 8)), XS), dtype=BF16)


# ------------------------------------------------------------------ while


def _newton_sqrt(a):
    """Newton's method for sqrt(a) with a tolerance-based while_loop."""

    def cond(state):
        x, i = state
        return (jnp.max(jnp.abs(x * x - a)) > 1e-3) & (i < 50)

    def body(state):
        x, i = state
        return 0.5 * (x + a / x), i + 1

    x, n = lax.while_loop(cond, body, (jnp.ones_like(a), 0))
    return x, n


def test_while_loop_solver():
    a = jnp.linspace(1.0, 9.0, 8)
    x, n = mixprec.autocast(_newton_sqrt, "mixed_bfloat16")(a)
    assert x.dtype == F32 and jnp.result_type(n) == jnp.int32
    assert_trees_close(x, jnp.sqrt(a), dtype=BF16)
    assert 0 < int(n) < 50


def test_while_loop_matmul_body_carry_dtype():
    def f(x):
        def body(s):
            i, h = s
            return i + 1, jnp.tanh(h @ W)

        return lax.while_loop(lambda s: s[0] < 3, body, (0, x))[1]

    g = mixprec.autocast(f, "mixed_bfloat16")
    assert_trees_close(g(X), f(X), dtype=BF16)
    assert _low_dots(g, X)
    whiles = [e for e in iter_eqns(jax.make_jaxpr(g)(X)) if e.primitive.name == "while"]
    body = whiles[0].params["body_jaxpr"]
    nb = whiles[0].params["body_nconsts"]
    assert [a.dtype for a in body.in_avals[nb:]] == [a.dtype for a in body.out_avals]


# ------------------------------------------------------------------ cond / switch


def test_cond_branches_agree():
    def f(x, p):
        # one branch is low precision (a dot), the other float32 (exp)
        return lax.cond(p, lambda a: a @ W, lambda a: jnp.exp(a), x)

    g = mixprec.autocast(f, "p=f32,c=bf16,o=f32")
    for p in (True, False):
        y = g(X, jnp.asarray(p))
        assert y.dtype == F32
        assert_trees_close(y, f(X, p), dtype=BF16)
    conds = [
        e for e in iter_eqns(jax.make_jaxpr(g)(X, True)) if e.primitive.name == "cond"
    ]
    outs = {tuple(a.dtype for a in br.out_avals) for br in conds[0].params["branches"]}
    assert len(outs) == 1


def test_switch_and_grad():
    def f(x, i):
        return lax.switch(
            i, [lambda a: jnp.sin(a @ W), lambda a: a @ U, lambda a: jnp.log1p(a**2)], x
        ).sum()

    g = mixprec.autocast(f, "mixed_bfloat16")
    for i in range(3):
        assert_trees_close(g(X, i), f(X, i), dtype=BF16)
        assert_trees_close(jax.grad(g)(X, i), jax.grad(f)(X, i), dtype=BF16, grad=True)


# ------------------------------------------------------------------ remat


def test_checkpoint_inside():
    def f(x):
        block = jax.checkpoint(lambda h: jnp.tanh(h @ W) @ U)
        return jnp.sum(block(block(x)) ** 2)

    g = mixprec.autocast(f, "mixed_bfloat16")
    assert_trees_close(g(X), f(X), dtype=BF16)
    assert_trees_close(jax.grad(g)(X), jax.grad(f)(X), dtype=BF16, grad=True)
    prims = _prims(jax.grad(g), X)
    assert any(p[0] in ("remat2", "checkpoint") for p in prims)
    assert _low_dots(jax.grad(g), X)


@pytest.mark.parametrize(
    "policy", [None, jax.checkpoint_policies.dots_with_no_batch_dims_saveable]
)
def test_checkpoint_policy_is_kept(policy):
    def f(x):
        return jnp.sum(jax.checkpoint(lambda h: jnp.sin(h @ W), policy=policy)(x))

    prims = [
        e
        for e in iter_eqns(jax.make_jaxpr(mixprec.autocast(f, "mixed_bfloat16"))(X))
        if e.primitive.name == "remat2"
    ]
    assert prims and prims[0].params["policy"] is policy


# ------------------------------------------------------------------ custom_jvp


@jax.custom_jvp
def safe_norm(x):
    return jnp.sqrt(jnp.sum(x * x))


@safe_norm.defjvp
def _safe_norm_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    n = safe_norm(x)
    nz = n > 0
    safe_n = jnp.where(nz, n, jnp.ones_like(n))
    return n, jnp.where(nz, jnp.sum(x * t) / safe_n, jnp.zeros_like(n))


def test_custom_jvp_safe_norm_gradient_finite_at_zero():
    def f(x):
        return safe_norm(x @ W)

    g = mixprec.autocast(f, "mixed_bfloat16")
    zero = jnp.zeros((2, 8))
    grad0 = jax.grad(g)(zero)
    assert grad0.dtype == F32
    assert bool(jnp.all(jnp.isfinite(grad0)))
    np.testing.assert_array_equal(grad0, 0.0)
    # inlining the primal would give NaN here: d/dx sqrt(sum(x^2)) at 0
    assert bool(jnp.any(jnp.isnan(jax.grad(lambda x: jnp.sqrt(jnp.sum(x * x)))(zero))))
    assert_trees_close(jax.grad(g)(X[:2]), jax.grad(f)(X[:2]), dtype=BF16, grad=True)
    # the custom_jvp is rebuilt, not inlined
    assert any(p[0] == "custom_jvp_call" for p in _prims(g, X[:2]))


def test_custom_jvp_tangent_dtype_follows_primal():
    def f(x):
        return jax.nn.relu(x @ W)  # relu is a custom_jvp

    g = mixprec.autocast(f, "p=f32,c=bf16,o=bf16")
    y, t = jax.jvp(
        mixprec.autocast(f, "p=f32,c=bf16,o=bf16", forward_mode_ad=True),
        (X,),
        (jnp.ones_like(X),),
    )
    assert y.dtype == t.dtype == BF16
    assert_trees_close(
        jax.grad(lambda x: g(x).astype(F32).sum())(X),
        jax.grad(lambda x: f(x).sum())(X),
        dtype=BF16,
        grad=True,
    )


# ------------------------------------------------------------------ custom_vjp


@jax.custom_vjp
def clip_gradient(x):
    return x


def _clip_fwd(x):
    return x, None


def _clip_bwd(_, g):
    return (jnp.clip(g, -0.1, 0.1),)


clip_gradient.defvjp(_clip_fwd, _clip_bwd)


def test_custom_vjp_gradient_clip_rule_applies():
    def f(x):
        return jnp.sum(clip_gradient(x @ W) * 10.0)

    g = mixprec.autocast(f, "mixed_bfloat16")
    grad = jax.grad(g)(X)
    ref = jax.grad(f)(X)
    assert grad.dtype == F32
    assert_trees_close(grad, ref, dtype=BF16, grad=True)
    # without the rule, the gradient would be 10 * W.sum(1), far larger
    unclipped = jax.grad(lambda x: jnp.sum((x @ W) * 10.0))(X)
    assert float(jnp.max(jnp.abs(grad))) < 0.5 * float(jnp.max(jnp.abs(unclipped)))
    assert any(p[0] == "custom_vjp_call" for p in _prims(g, X))


@jax.custom_vjp
def _scaled_matmul(x, w):
    return x @ w


def _sm_fwd(x, w):
    return x @ w, (x, w)


def _sm_bwd(res, g):
    x, w = res
    return g @ w.T * 2.0, x.T @ g * 2.0  # a deliberately non-standard rule


_scaled_matmul.defvjp(_sm_fwd, _sm_bwd)


def test_custom_vjp_with_residuals_and_two_inputs():
    def f(x, w):
        return jnp.sum(jnp.tanh(_scaled_matmul(x, w)))

    g = mixprec.autocast(f, "mixed_bfloat16")
    gx, gw = jax.jit(jax.grad(g, argnums=(0, 1)))(X, W)
    rx, rw = jax.grad(f, argnums=(0, 1))(X, W)
    assert_tree_dtypes((gx, gw), (X, W))
    assert_trees_close((gx, gw), (rx, rw), dtype=BF16, grad=True)
    # the user's backward dots run in bf16 too
    assert len(_low_dots(jax.grad(g, argnums=(0, 1)), X, W)) >= 3


# ------------------------------------------------------------------ nested jit


def test_nested_jit_and_composites():
    @jax.jit
    def block(x):
        return jnp.tanh(x @ W)

    def f(x):
        h = block(x)
        return jax.nn.log_softmax(h), jnp.var(h, axis=-1)

    g = mixprec.autocast(f, "mixed_bfloat16")
    prims = _prims(g, X)
    assert _low_dots(g, X)  # the dot inside the named jit is lowered
    # log_softmax / _var are composites: every float op inside runs in float32
    jx = jax.make_jaxpr(g)(X)
    for e in iter_eqns(jx):
        if e.primitive.name == "jit" and e.params["name"] in ("log_softmax", "_var"):
            inner = [
                str(v.aval.dtype)
                for ee in iter_eqns(e.params["jaxpr"])
                for v in ee.outvars
                if jnp.issubdtype(v.aval.dtype, jnp.floating)
            ]
            assert inner and set(inner) == {"float32"}
    assert ("jit", ("float32",), ("bfloat16",)) in prims
    assert_trees_close(g(X), f(X), dtype=BF16)


def test_jit_around_and_inside_autocast_compose():
    f = lambda x: jnp.sum(jax.jit(lambda a: jnp.tanh(a @ W))(x))  # noqa: E731
    g = jax.jit(mixprec.autocast(jax.jit(f), "mixed_bfloat16"))
    assert_trees_close(g(X), f(X), dtype=BF16)
    assert_trees_close(jax.grad(g)(X), jax.grad(f)(X), dtype=BF16, grad=True)


# ------------------------------------------------------------------ shard_map


def test_sharded_over_8_devices():
    assert jax.device_count() >= 8
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    x = jax.random.normal(jax.random.key(1), (16, 8))

    def loss(w, x):
        def local(w, x):
            h = jnp.tanh(x @ w)
            return lax.pmean(jnp.mean(h**2), "data")

        return jax.shard_map(
            local, mesh=mesh, in_specs=(P(), P("data")), out_specs=P()
        )(w, x)

    g = mixprec.autocast(loss, "mixed_bfloat16")
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    v, gw = jax.jit(jax.value_and_grad(g))(W, xs)
    rv, rg = jax.value_and_grad(loss)(W, x)
    assert v.dtype == F32 and gw.dtype == F32
    assert_trees_close(v, rv, dtype=BF16)
    assert_trees_close(gw, rg, dtype=BF16, grad=True)
    assert _low_dots(g, W, xs)


def test_jit_sharded_inputs_keep_sharding():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    sharding = NamedSharding(mesh, P("data"))
    x = jax.device_put(jax.random.normal(jax.random.key(2), (16, 8)), sharding)
    f = jax.jit(mixprec.autocast(lambda x: jnp.tanh(x @ W), "mixed_bfloat16"))
    y = f(x)
    assert y.sharding.is_equivalent_to(sharding, 2)
    assert_trees_close(y, jnp.tanh(x @ W), dtype=BF16)
