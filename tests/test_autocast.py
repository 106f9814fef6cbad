"""Core tests of the autocast transform: dtypes, composition, caching, regions."""

import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import BF16, F16, F32, assert_tree_dtypes, assert_trees_close, iter_eqns
from jax import lax
from jax.extend.core import Primitive

import mixprec
from mixprec._src.autocast import api, interpreter, ops
from mixprec._src.autocast.config import make_config
from mixprec._src.autocast.decide import Decision, Precision, decide_eqn
from mixprec._src.autocast.interpreter import CastContext, Walk, eval_jaxpr
from mixprec._src.numerics.record import OpRecord


def trace_records(fn, *args, policy, mode="allow_mix_precision"):
    return mixprec.explain(fn, *args, policy=policy, mode=mode).ops


def _dots(fn, *args):
    return [
        (tuple(str(v.aval.dtype) for v in e.invars), str(e.outvars[0].aval.dtype))
        for e in iter_eqns(jax.make_jaxpr(fn)(*args))
        if e.primitive.name == "dot_general"
    ]


def _signature(jaxpr):
    """The primitive names and dtypes of every equation, recursively."""
    return [
        (
            e.primitive.name,
            tuple(str(v.aval.dtype) for v in e.invars),
            tuple(str(v.aval.dtype) for v in e.outvars),
        )
        for e in iter_eqns(jaxpr)
    ]


def _mlp(params, x):
    h = jax.nn.relu(x @ params["w1"] + params["b1"][None, :])
    return h @ params["w2"] + params["b2"][None, :]


def _params(key=0, d_in=8, d_h=16, d_out=4):
    k1, k2 = jax.random.split(jax.random.key(key))
    return {
        "w1": jax.random.normal(k1, (d_in, d_h)) / np.sqrt(d_in),
        "b1": jnp.full((d_h,), 0.1),
        "w2": jax.random.normal(k2, (d_h, d_out)) / np.sqrt(d_h),
        "b2": jnp.zeros((d_out,)),
    }


X = jax.random.normal(jax.random.key(42), (5, 8))


# ------------------------------------------------------------------ dtypes


@pytest.mark.parametrize(
    "policy, low, out",
    [
        ("mixed_bfloat16", BF16, F32),
        ("p=f32,c=bf16,o=bf16", BF16, BF16),
        ("mixed_float16", F16, F32),
    ],
)
def test_mlp_matches_float32_and_dtypes(policy, low, out):
    params = _params()
    f = mixprec.autocast(_mlp, policy)
    y = f(params, X)
    assert y.dtype == out
    assert_trees_close(y, _mlp(params, X), dtype=low)
    # every dot runs with low-precision operands
    dots = _dots(f, params, X)
    assert len(dots) == 2
    assert all(ins == (str(low), str(low)) for ins, _ in dots)


def test_oracle_against_precast_inputs():
    params = _params()
    f = mixprec.autocast(lambda w, x: x @ w, "p=f32,c=bf16,o=bf16")
    want = lax.dot(
        X.astype(BF16), params["w1"].astype(BF16), preferred_element_type=F32
    ).astype(BF16)
    np.testing.assert_array_equal(np.asarray(f(params["w1"], X)), np.asarray(want))


def test_bias_add_follows_the_half_operand():
    # An add whose bf16 input is not a dot's product: the f32 bias follows it.
    def f(params, x):
        h = x.astype(BF16) * 2
        return jax.nn.relu(h + params["b1"][None, :8])

    params = _params()
    sig = _signature(jax.make_jaxpr(mixprec.autocast(f, "mixed_bfloat16"))(params, X))
    adds = [s for s in sig if s[0] == "add"]
    assert adds == [("add", ("bfloat16", "bfloat16"), ("bfloat16",))], adds
    # and relu's max runs in bf16 too (its 0.0 literal follows)
    assert any(s[0] == "max" and s[2] == ("bfloat16",) for s in sig)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="CPU dot formulation")
def test_bias_add_after_a_dot_is_its_float32_epilogue():
    # On CPU the dot's product is float32 before rounding: the bias is added to
    # it in float32 and the sum rounded once, like a GEMM epilogue.
    params = _params()
    f = mixprec.autocast(_mlp, "p=f32,c=bf16,o=bf16")
    sig = _signature(jax.make_jaxpr(f)(params, X))
    adds = [s for s in sig if s[0] == "add"]
    assert adds and all(s[1] == ("float32", "float32") for s in adds), adds
    assert any(s[0] == "max" and s[2] == ("bfloat16",) for s in sig)
    y = f(params, X)
    assert y.dtype == BF16
    # Bit-exact against the same formulation written by hand.
    xb, w1, w2 = (a.astype(BF16) for a in (X, params["w1"], params["w2"]))
    h = lax.dot(xb, w1, preferred_element_type=F32) + params["b1"][None, :]
    h = jax.nn.relu(h.astype(BF16))
    want = lax.dot(h, w2, preferred_element_type=F32) + params["b2"][None, :]
    np.testing.assert_array_equal(
        np.asarray(y, np.float32), np.asarray(want.astype(BF16), np.float32)
    )
    # The rounding happens once: closer to float32 than rounding the product
    # and the bias first (summed over a batch where the two differ).
    b = params["b1"][None, :] * 300

    g = mixprec.autocast(lambda p, x: x @ p["w1"] + b, "p=f32,c=bf16,o=f32")
    ref = X @ params["w1"] + b
    twice = (
        lax.dot(xb, w1, preferred_element_type=F32).astype(BF16) + b.astype(BF16)
    ).astype(F32)
    assert float(jnp.abs(g(params, X) - ref).sum()) < float(jnp.abs(twice - ref).sum())
    recs = trace_records(_mlp, params, X, policy="p=f32,c=bf16,o=bf16")
    fused = [r for r in recs if r.primitive == "add"]
    assert len(fused) == 2
    assert all("the epilogue of the dot" in r.reason for r in fused), fused
    assert all(r.in_dtypes == ("float32", "float32") for r in fused)
    assert all(r.out_dtypes == ("bfloat16",) for r in fused)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="CPU dot formulation")
def test_dot_product_used_twice_is_rounded_for_other_uses():
    # Only the add is fused; another use of the product sees the rounded value.
    def f(w, x):
        y = x @ w
        return y + jnp.ones((1, w.shape[1])), y * 2

    w = _params()["w1"]
    a, b = mixprec.autocast(f, "p=f32,c=bf16,o=bf16")(w, X)
    assert a.dtype == b.dtype == BF16
    prod = lax.dot(X.astype(BF16), w.astype(BF16), preferred_element_type=F32)
    np.testing.assert_array_equal(
        np.asarray(a, np.float32), np.asarray((prod + 1).astype(BF16), np.float32)
    )
    np.testing.assert_array_equal(
        np.asarray(b, np.float32), np.asarray(prod.astype(BF16) * 2, np.float32)
    )


def test_deny_ops_run_in_float32():
    def f(x):
        return jnp.exp(x @ x.T).sum()

    sig = _signature(jax.make_jaxpr(mixprec.autocast(f, "mixed_bfloat16"))(X))
    exp = [s for s in sig if s[0] == "exp"]
    assert exp == [("exp", ("float32",), ("float32",))]


def test_non_float_outputs_untouched():
    def f(x, n, key):
        return x.sum(), n + 1, x > 0, jax.random.split(key)

    key = jax.random.key(0)
    s, n, b, keys = mixprec.autocast(f, "p=f32,c=bf16,o=bf16")(X, jnp.int32(3), key)
    assert s.dtype == BF16
    assert n.dtype == jnp.int32 and int(n) == 4
    assert b.dtype == jnp.bool_
    assert jnp.issubdtype(keys.dtype, jax.dtypes.prng_key)


def test_pytree_static_and_keyword_arguments():
    def f(params, x, *, scale, activation="relu", skip=None):
        assert skip is None
        h = _mlp(params, x) * scale
        return {"y": jax.nn.relu(h) if activation == "relu" else h, "name": activation}

    g = mixprec.autocast(f, "mixed_bfloat16")
    out = g(_params(), X, scale=2.0, activation="none")
    assert out["name"] == "none"
    assert out["y"].dtype == F32
    assert_trees_close(out["y"], _mlp(_params(), X) * 2.0, dtype=BF16)
    assert (g(_params(), X, scale=2.0)["y"] >= 0).all()


def test_global_policy_is_read_at_call_time():
    # (under jax.jit it is read when the outer function is traced)
    f = mixprec.autocast(lambda x: x @ x.T)
    assert f(X).dtype == F32
    with mixprec.policy_scope("p=f32,c=bf16,o=bf16"):
        assert f(X).dtype == BF16
        assert _dots(mixprec.autocast(lambda x: x @ x.T), X)[0][0] == (
            "bfloat16",
            "bfloat16",
        )
    assert f(X).dtype == F32


# ------------------------------------------------------------------ composition


def test_grad_value_and_grad_jit_vmap():
    params = _params()

    def loss(p, x):
        return jnp.mean(_mlp(p, x) ** 2)

    f = mixprec.autocast(loss, "mixed_bfloat16")
    v, g = jax.jit(jax.value_and_grad(f))(params, X)
    v_ref, g_ref = jax.value_and_grad(loss)(params, X)
    assert v.dtype == F32
    assert_trees_close(v, v_ref, dtype=BF16)
    assert_tree_dtypes(g, params)
    assert_trees_close(g, g_ref, dtype=BF16, grad=True)
    # vmap outside and inside
    per_ex = jax.vmap(f, in_axes=(None, 0))(params, X[:, None])
    ref = jax.vmap(loss, in_axes=(None, 0))(params, X[:, None])
    assert_trees_close(per_ex, ref, dtype=BF16)
    inner = mixprec.autocast(jax.vmap(loss, in_axes=(None, 0)), "mixed_bfloat16")
    assert_trees_close(inner(params, X[:, None]), ref, dtype=BF16)


def test_checkpoint_around_autocast():
    params = _params()

    def loss(p, x):
        return jnp.sum(jnp.tanh(_mlp(p, x)))

    f = jax.checkpoint(mixprec.autocast(loss, "mixed_bfloat16"))
    g = jax.grad(f)(params, X)
    assert_trees_close(g, jax.grad(loss)(params, X), dtype=BF16, grad=True)
    assert_tree_dtypes(g, params)


def test_forward_mode_ad_option():
    w = _params()["w1"]

    def f(x):
        return jnp.tanh(x @ w)

    t = jnp.ones_like(X)
    forced = mixprec.autocast(f, "mixed_bfloat16", forward_mode_ad=False)
    with pytest.raises(TypeError, match="forward_mode_ad=False"):
        jax.jvp(forced, (X,), (t,))
    y_ref, ty_ref = jax.jvp(f, (X,), (t,))
    for g in (
        mixprec.autocast(f, "mixed_bfloat16"),  # decided per call
        mixprec.autocast(f, "mixed_bfloat16", forward_mode_ad=True),
    ):
        y, ty = jax.jvp(g, (X,), (t,))
        assert ty.dtype == F32
        assert_trees_close((y, ty), (y_ref, ty_ref), dtype=BF16)
        assert_trees_close(jax.jacfwd(g)(X[:1]), jax.jacfwd(f)(X[:1]), dtype=BF16)
    g = mixprec.autocast(f, "mixed_bfloat16", forward_mode_ad=True)
    # reverse mode still works, with low-precision dots
    assert_trees_close(
        jax.grad(lambda x: g(x).sum())(X),
        jax.grad(lambda x: f(x).sum())(X),
        dtype=BF16,
        grad=True,
    )


def test_nested_autocast_is_idempotent():
    params = _params()
    once = mixprec.autocast(_mlp, "mixed_bfloat16")
    twice = mixprec.autocast(once, "mixed_bfloat16")
    j1 = jax.make_jaxpr(once)(params, X)
    j2 = jax.make_jaxpr(twice)(params, X)
    assert _signature(j1) == _signature(j2)
    np.testing.assert_array_equal(twice(params, X), once(params, X))


def test_nested_autocast_with_other_policy_wins_inside():
    w = _params()["w1"]
    inner = mixprec.autocast(lambda x: x @ w, "float32")
    outer = mixprec.autocast(lambda x: inner(x) @ w.T, "mixed_bfloat16")
    dots = _dots(outer, X)
    assert dots[0][0] == ("float32", "float32")
    assert dots[1][0] == ("bfloat16", "bfloat16")


def test_identity_policy_leaves_jaxpr_unchanged():
    params = _params()

    def f(p, x):
        y = _mlp(p, x)
        y = jax.nn.softmax(y) + jnp.var(y)
        return lax.scan(lambda c, a: (c * a, c.sum()), y[0], y)

    ref = jax.make_jaxpr(f)(params, X)
    got = jax.make_jaxpr(mixprec.autocast(f, "float32"))(params, X)
    assert _signature(got) == _signature(ref)
    assert str(got).count("convert_element_type") == str(ref).count(
        "convert_element_type"
    )


def test_must_keep_origin_dtype_is_identity():
    params = _params()
    got = jax.make_jaxpr(
        mixprec.autocast(_mlp, "mixed_bfloat16", mode="must_keep_origin_dtype")
    )(params, X)
    assert _signature(got) == _signature(jax.make_jaxpr(_mlp)(params, X))


# ------------------------------------------------------------------ caching


def test_second_call_does_not_retrace_and_jit_compiles_once():
    traces = []

    def f(x, w):
        traces.append(1)
        return jnp.tanh(x @ w)

    g = mixprec.autocast(f, "mixed_bfloat16")
    w = _params()["w1"]
    g(X, w)
    g(X + 1, w)
    assert len(traces) == 1
    g(X[:2], w)  # new shape: one more trace
    assert len(traces) == 2
    jitted = jax.jit(g)
    jitted(X, w)
    jitted(X * 2, w)
    assert jitted._cache_size() == 1  # type: ignore[attr-defined]
    # the function is traced once more under jit (tracer avals are the same,
    # so the transformed jaxpr is reused)
    assert len(traces) == 2


def test_eager_and_traced_calls_agree():
    # Eagerly (also under an eager grad) autocast runs its jitted transformed
    # jaxpr; inside jit it evaluates the same jaxpr inline.
    params = _params()

    def loss(p, x):
        return jnp.mean(_mlp(p, x) ** 2)

    g = mixprec.autocast(loss, "mixed_bfloat16")
    eager = g(params, X)
    np.testing.assert_array_equal(np.asarray(jax.jit(g)(params, X)), np.asarray(eager))
    grads = jax.grad(g)(params, X)
    assert_tree_dtypes(grads, jax.tree.map(lambda a: a.dtype, params))
    # Eager grad compiles the forward and backward passes as two XLA programs,
    # jit(grad) as one. XLA's default `xla_allow_excess_precision` may drop a
    # bf16 -> f32 round trip in one and not the other, so the two agree to
    # bfloat16's precision (bit for bit with that flag off).
    assert_trees_close(jax.jit(jax.grad(g))(params, X), grads, dtype=BF16)
    assert_trees_close(grads, jax.grad(loss)(params, X), dtype=BF16)


def test_first_staged_call_walks_in_place_and_later_ones_reuse_one_build():
    # Inside jit the first call at given types is walked into the caller's
    # trace (nothing cached); the second builds and caches the transformed
    # jaxpr, the third copies it. All three stage the same program, with and
    # without grad, a closed-over constant and a loop included.
    traces = []
    bias = np.linspace(-1.0, 1.0, 16, dtype=np.float32)[None]

    def loss(w, x):
        traces.append(1)
        h = jnp.tanh(x @ w + bias)
        h = lax.fori_loop(0, 2, lambda i, h: jnp.tanh(h @ w), h)
        return jnp.mean(h**2)

    g = mixprec.autocast(loss, "mixed_bfloat16")
    w = jnp.eye(16) * 0.5
    x = jnp.ones((4, 16))
    # (a fresh caller each time: JAX caches the trace of a function it saw)
    staged = [str(jax.make_jaxpr(lambda w, x: g(w, x))(w, x)) for _ in range(3)]
    assert staged[0] == staged[1] == staged[2]
    assert len(traces) == 2  # walked in place, then built once
    assert "bf16" in staged[0]
    h = mixprec.autocast(loss, "mixed_bfloat16")
    grads = [
        str(jax.make_jaxpr(jax.grad(lambda w, x: h(w, x)))(w, x)) for _ in range(3)
    ]
    assert grads[0] == grads[1] == grads[2]
    np.testing.assert_array_equal(
        np.asarray(jax.jit(jax.grad(h))(w, x)), np.asarray(jax.grad(h)(w, x))
    )


def test_equations_left_as_written_are_recorded_as_traced(monkeypatch):
    # An equation whose operands autocast leaves as traced is copied into the
    # new jaxpr with the results' types it records, not bound again: the
    # program staged is the one binding every equation stages.
    from mixprec._src import _compat
    from mixprec._src.workloads import gpt2

    cfg = gpt2.GPT2Config(
        vocab_size=32, seq_len=8, d_model=16, num_heads=2, num_layers=1
    )
    params = jax.tree.map(jnp.asarray, gpt2.init(cfg))
    tokens = jnp.zeros((2, cfg.seq_len), jnp.int32)

    def step(params, tokens):
        loss, grads = jax.value_and_grad(gpt2.loss)(params, tokens, tokens, config=cfg)
        return loss, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    emit = _compat.emit_as_written
    copied = []

    def counting(eqn, invals, **kwargs):
        out = emit(eqn, invals, **kwargs)
        copied.append(out is not None)
        return out

    def staged():
        cast_step = mixprec.autocast(step, "mixed_bfloat16")
        return str(jax.make_jaxpr(cast_step)(params, tokens))

    monkeypatch.setattr(_compat, "emit_as_written", counting)
    fast = staged()
    assert sum(copied) > 100
    monkeypatch.setattr(_compat, "emit_as_written", lambda eqn, invals, **kw: None)
    assert staged() == fast


def test_is_staging_tells_jit_from_eager_transforms():
    from mixprec._src import _compat

    seen = []

    def probe(x):
        seen.append(_compat.is_staging())
        return x * 2.0

    x = jnp.ones(3)
    probe(x)
    jax.grad(lambda x: probe(x).sum())(x)
    jax.vmap(probe)(x)
    jax.jit(probe)(x)
    jax.jit(jax.grad(lambda x: probe(x).sum()))(x)
    jax.grad(jax.jit(lambda x: probe(x).sum()))(x)
    assert seen == [False, False, False, True, True, True]


def test_cache_is_keyed_on_policy_and_static_args():
    traces = []

    def f(x, k):
        traces.append(k)
        return x * k

    g = mixprec.autocast(f, "mixed_bfloat16")
    g(X, 2.0)
    g(X, 2.0)
    g(X, 3.0)
    assert traces == [2.0, 3.0]
    mixprec.autocast(f, "mixed_float16")(X, 2.0)
    assert traces == [2.0, 3.0, 2.0]


# ------------------------------------------------------------------ HLO


def test_compiled_step_has_bf16_dots():
    params = _params()

    def loss(p, x):
        return jnp.mean(_mlp(p, x) ** 2)

    step = jax.jit(jax.value_and_grad(mixprec.autocast(loss, "mixed_bfloat16")))
    lowered = step.lower(params, X)
    dots = [ln for ln in lowered.as_text().splitlines() if "dot_general" in ln]
    # 2 forward dots + 3 backward dots (the first layer's input gets no gradient)
    assert len(dots) == 5
    assert all(
        re.search(r"\(tensor<[\dx]+xbf16>, tensor<[\dx]+xbf16>\)", d) for d in dots
    )
    compiled = lowered.compile().as_text() or ""
    assert " dot(" in compiled and "bf16[" in compiled
    # the float32 step has no bf16 at all
    plain = jax.jit(jax.value_and_grad(loss)).lower(params, X).compile().as_text()
    assert plain is not None
    assert "bf16[" not in plain


# ------------------------------------------------------------------ regions


def test_float32_scope_keeps_original_precision():
    w = _params()["w1"]

    def f(x):
        h = x @ w
        with mixprec.float32_scope():
            y = jax.nn.softmax(h @ w.T)
        return h @ w.T, y

    g = mixprec.autocast(f, "mixed_bfloat16")
    dots = _dots(g, X)
    assert [d[0] for d in dots] == [
        ("bfloat16", "bfloat16"),
        ("float32", "float32"),
        ("bfloat16", "bfloat16"),
    ]
    sig = _signature(jax.make_jaxpr(g)(X))
    assert ("sub", ("float32", "float32"), ("float32",)) in sig
    # the backward pass of the region is in the region too
    grad_dots = _dots(jax.grad(lambda x: g(x)[1].sum()), X)
    assert ("float32", "float32") in [d[0] for d in grad_dots]


def test_float32_scope_around_the_call():
    w = _params()["w1"]
    g = mixprec.autocast(lambda x: x @ w, "mixed_bfloat16")

    def f(x):
        with mixprec.float32_scope():
            a = g(x)
        return a, g(x)

    dots = _dots(f, X)
    assert [d[0] for d in dots] == [("float32", "float32"), ("bfloat16", "bfloat16")]


def test_precision_scope():
    w = _params()["w1"]

    def f(x):
        with mixprec.precision_scope("float32") as p:
            assert p == mixprec.get_policy("float32")
            a = x @ w
        with mixprec.precision_scope("mixed_float16"):
            b = x @ w
        return a, b, x @ w

    dots = _dots(mixprec.autocast(f, "mixed_bfloat16"), X)
    assert [d[0] for d in dots] == [
        ("float32", "float32"),
        ("float16", "float16"),
        ("bfloat16", "bfloat16"),
    ]


@pytest.mark.parametrize("scope", ["layer_norm", "norm", "mean", "softmax", "var"])
def test_user_scope_names_are_not_composites(scope):
    # A scope named like a JAX composite is the user's name, not jnp.mean:
    # its matmul stays low precision and its gray ops follow their operands.
    w = _params()["w1"]

    def f(x):
        with jax.named_scope(scope):
            h = x @ w
            y = h * 2.0
        return y

    sig = _signature(jax.make_jaxpr(mixprec.autocast(f, "mixed_bfloat16"))(X))
    assert [s for s in sig if s[0] in ("dot_general", "mul")] == [
        ("dot_general", ("bfloat16", "bfloat16"), ("float32",)),
        ("mul", ("bfloat16", "bfloat16"), ("bfloat16",)),
    ]


def test_jax_composites_run_in_float32():
    # jnp.var is a nested jit that JAX itself emits: every op inside is float32.
    w = _params()["w1"]
    report = mixprec.explain(lambda x: jnp.var(x @ w), X, policy="mixed_bfloat16")
    inside = [
        op
        for op in report.ops
        if op.path.startswith("jit(_var)") and "float" in op.out_dtypes[0]
    ]
    assert inside and all(op.out_dtypes == ("float32",) for op in inside), inside
    assert all("inside var (a JAX composite)" in op.reason for op in inside)


# ------------------------------------------------------------------ modes


@pytest.mark.parametrize(
    "mode, dot_dtype, exp_dtype, add_dtype",
    [
        ("allow_mix_precision", "bfloat16", "float32", "bfloat16"),
        ("allow_mix_precision_bf16", "bfloat16", "float32", "bfloat16"),
        ("allow_fp32_to_bf16", "bfloat16", "float32", "float32"),
        ("allow_fp32_to_fp16", "float16", "float32", "float32"),
        ("force_fp16", "float16", "float16", "float16"),
        ("force_fp32", "float32", "float32", "float32"),
        ("must_keep_origin_dtype", "float32", "float32", "float32"),
    ],
)
def test_modes_end_to_end(mode, dot_dtype, exp_dtype, add_dtype):
    w = _params()["w1"]

    def f(x):
        h = x @ w
        return jnp.exp(h + 1.0)

    g = mixprec.autocast(f, "mixed_bfloat16", mode=mode)
    sig = _signature(jax.make_jaxpr(g)(X))
    assert [s[1] for s in sig if s[0] == "dot_general"][0] == (dot_dtype,) * 2
    assert [s[1] for s in sig if s[0] == "exp"] == [(exp_dtype,)]
    # The add's result dtype (on CPU a bias add after a dot runs in float32 on
    # the dot's product and is rounded to this dtype: see the epilogue tests).
    recs = trace_records(f, X, policy="mixed_bfloat16", mode=mode)
    assert [r.out_dtypes for r in recs if r.primitive == "add"] == [(add_dtype,)]
    y = g(X)
    assert y.dtype == F32
    # exp of a float16 argument (force_fp16) is as accurate as bfloat16
    assert_trees_close(y, f(X), dtype=BF16 if dot_dtype != "float32" else F32)


def test_mixlist_moves_ops_between_lists():
    w = _params()["w1"]

    def f(x):
        return jnp.exp(x @ w)

    g = mixprec.autocast(
        f,
        "mixed_bfloat16",
        mixlist={
            "black-list": {"to-add": ["dot_general"], "to-remove": ["exp"]},
        },
    )
    sig = _signature(jax.make_jaxpr(g)(X))
    assert [s[1] for s in sig if s[0] == "dot_general"] == [("float32", "float32")]
    # exp removed from black and added nowhere: gray, follows its f32 input
    assert [s[1] for s in sig if s[0] == "exp"] == [("float32",)]


def test_bad_mode_and_mixlist():
    with pytest.raises(ValueError, match="allow_mix_precision"):
        mixprec.autocast(jnp.sin, mode="allow_mixed_precision")
    with pytest.raises(ValueError):
        mixprec.autocast(jnp.sin, mixlist={"black-list": {"to-add": ["expp"]}})
    with pytest.raises(TypeError, match="callable"):
        mixprec.autocast(3)  # type: ignore[arg-type]


# ------------------------------------------------------------------ strict / rules


_mystery_p = Primitive("mixprec_test_mystery")
_mystery_p.def_impl(lambda x: x * 2)
_mystery_p.def_abstract_eval(lambda x: x)


def test_strict_names_primitive_and_source_line():
    def f(x):
        return _mystery_p.bind(x @ x.T)

    # not strict: runs at its original dtypes (correct, never silently wrong)
    sig = _signature(jax.make_jaxpr(mixprec.autocast(f, "mixed_bfloat16"))(X))
    assert ("mixprec_test_mystery", ("float32",), ("float32",)) in sig
    assert ("dot_general", ("bfloat16", "bfloat16"), ("float32",)) in sig
    with pytest.raises(NotImplementedError) as e:
        jax.make_jaxpr(mixprec.autocast(f, "mixed_bfloat16", strict=True))(X)
    msg = str(e.value)
    assert "mixprec_test_mystery" in msg
    assert re.search(r"test_autocast\.py:\d+ \(\S*\bf\)", msg)
    # a known primitive is fine in strict mode
    mixprec.autocast(_mlp, "mixed_bfloat16", strict=True)(_params(), X)


def test_register_rule_and_duplicates():
    prim = Primitive("mixprec_test_double")
    prim.def_impl(lambda x: x * 2)
    prim.def_abstract_eval(lambda x: x)
    seen = []

    @mixprec.register_rule(prim)
    def rule(ctx, x):
        seen.append(ctx.decision)
        return prim.bind(x.astype(ctx.low_dtype))

    try:
        g = mixprec.autocast(lambda x: prim.bind(x), "p=f32,c=f16,o=f32")
        sig = _signature(jax.make_jaxpr(g)(X))
        assert ("mixprec_test_double", ("float16",), ("float16",)) in sig
        assert seen and seen[0].op_class == "infer"
        with pytest.raises(ValueError, match="already has a cast rule"):
            mixprec.register_rule(prim, rule)
        mixprec.register_rule(prim, rule, override=True)
        with pytest.raises(TypeError, match="Primitive"):
            mixprec.register_rule("add", rule)  # type: ignore[arg-type]
    finally:
        ops._ops.pop(prim.name, None)


def test_every_rule_accepts_the_context_protocol():
    # conformance: every rule in the table is callable as rule(ctx, *invals, **params)
    import inspect

    for spec in ops.all_specs():
        if spec.rule is not None:
            params = list(inspect.signature(spec.rule).parameters.values())
            assert params[0].name == "ctx", spec.name
            assert any(p.kind is p.VAR_KEYWORD for p in params), spec.name


# ------------------------------------------------------------------ numerics API


def test_explain_records_and_the_interpreter_api():
    params = _params()
    recs = trace_records(
        lambda p, x: jnp.var(_mlp(p, x)), params, X, policy="mixed_bfloat16"
    )
    assert all(isinstance(r, OpRecord) for r in recs)
    dots = [r for r in recs if r.primitive == "dot_general"]
    assert len(dots) == 2
    assert dots[0].decision == "low" and dots[0].dtype == "bfloat16"
    assert dots[0].flops == 2 * 5 * 8 * 16
    assert re.search(r"test_autocast\.py:\d+ \(_mlp\)", dots[0].source)
    var = [r for r in recs if r.path == "jit(_var)" and r.op_class != "clear"]
    assert var and all(r.decision == "float32" for r in var if r.dtype), var

    # The interpreter on its own: one equation decided and run.
    jaxpr = jax.make_jaxpr(lambda x, y: jnp.exp(x @ y))(X, X.T)
    walk = Walk(make_config("mixed_bfloat16"))
    d = decide_eqn(walk, jaxpr.eqns[0], ops.spec_for("dot_general"), [X, X.T], [0, 0])
    assert (d.precision, d.dtype, d.op_class) == (Precision.LOW, BF16, "allow")
    d = decide_eqn(walk, jaxpr.eqns[1], ops.spec_for("exp"), [X], [0])
    assert (d.precision, d.dtype, d.op_class) == (Precision.FLOAT32, F32, "deny")
    (z,), _ = eval_jaxpr(walk, jaxpr, (), [X, X.T])
    assert z.dtype == F32
    assert_trees_close(z, jnp.exp(X @ X.T), dtype=BF16)


def test_explain_accepts_shape_dtype_structs():
    s = jax.ShapeDtypeStruct((3, 8), jnp.float32)
    recs = trace_records(
        lambda x, y: x @ y, s, s.update(shape=(8, 3)), policy="mixed_float16"
    )
    assert [r.in_dtypes for r in recs] == [("float16", "float16")]


def test_interpreter_module_exports():
    assert CastContext is interpreter.CastContext
    assert isinstance(Decision(Precision.LOW, BF16, "allow", "why").label, str)
    assert api.autocast is mixprec.autocast


# ------------------------------------------------------------------ robustness


def test_debug_print_and_callbacks_run_at_original_dtype(capsys):
    def f(x):
        h = x @ x.T
        jax.debug.print("h00={h}", h=h[0, 0])
        y = jax.pure_callback(
            lambda a: np.asarray(a) * 2, jax.ShapeDtypeStruct(h.shape, h.dtype), h
        )
        return y

    y = jax.jit(mixprec.autocast(f, "mixed_bfloat16"))(X)
    jax.effects_barrier()
    assert y.dtype == F32
    assert "h00=" in capsys.readouterr().out
    assert_trees_close(y, 2 * (X @ X.T), dtype=BF16)


def test_functions_without_floats_and_empty_outputs():
    assert mixprec.autocast(lambda n: n * 2, "mixed_bfloat16")(jnp.int32(4)) == 8
    assert mixprec.autocast(lambda x: None, "mixed_bfloat16")(X) is None
    out = mixprec.autocast(lambda x: (), "mixed_bfloat16")(X)
    assert out == ()


def test_unhashable_static_argument_still_works():
    class Config:  # unhashable
        __hash__ = None  # type: ignore[assignment]
        scale = 3.0

    def f(x, cfg):
        return x * cfg.scale

    y = mixprec.autocast(f, "mixed_bfloat16")(X, Config())
    assert_trees_close(y, X * 3.0, dtype=F32)


def test_nested_jit_body_is_interpreted_once_per_type():
    from mixprec._src.autocast.rules import calls

    @jax.jit
    def block(x, w):
        return jnp.tanh(x @ w)

    def f(x, w):
        for _ in range(4):
            x = block(x, w)
        return x

    w = jnp.eye(8)
    jax.make_jaxpr(mixprec.autocast(f, "mixed_bfloat16"))(X, w)
    body = jax.make_jaxpr(block)(X, w).eqns[0].params["jaxpr"]
    # first call with a float32 x, then three with a bfloat16 x: two entries
    assert len(calls._jit_cache[body]) == 2


def test_a_walk_pauses_the_garbage_collector_and_restores_it(monkeypatch):
    import gc

    seen = []
    walk = interpreter.eval_jaxpr

    def recording(*args, **kwargs):
        seen.append(gc.isenabled())
        return walk(*args, **kwargs)

    monkeypatch.setattr(interpreter, "eval_jaxpr", recording)
    f = mixprec.autocast(lambda x: jnp.tanh(x @ x), "mixed_bfloat16")
    assert gc.isenabled()
    out = jax.jit(f)(jnp.ones((4, 4)))
    assert seen == [False] and gc.isenabled()
    assert out.dtype == F32  # (the policy's output dtype)

    def failing(*args, **kwargs):
        raise RuntimeError("walk failed")

    monkeypatch.setattr(interpreter, "eval_jaxpr", failing)
    with pytest.raises(RuntimeError, match="walk failed"):
        jax.jit(mixprec.autocast(lambda x: x @ x, "mixed_bfloat16"))(jnp.ones((4, 4)))
    assert gc.isenabled()
    # Paused by the caller: left paused.
    monkeypatch.setattr(interpreter, "eval_jaxpr", recording)
    gc.disable()
    try:
        jax.jit(mixprec.autocast(lambda x: x @ x.T, "mixed_bfloat16"))(jnp.ones((4, 4)))
        assert not gc.isenabled()
    finally:
        gc.enable()
    assert seen == [False, False]


def test_tracing_the_function_pauses_the_garbage_collector_and_restores_it():
    import gc

    seen = []

    def f(x):
        seen.append(gc.isenabled())
        return jnp.tanh(x @ x)

    out = jax.jit(mixprec.autocast(f, "mixed_bfloat16"))(jnp.ones((4, 4)))
    assert seen == [False] and gc.isenabled()
    assert out.dtype == F32

    def failing(x):
        raise ValueError("user code failed")

    with pytest.raises(ValueError, match="user code failed"):
        jax.jit(mixprec.autocast(failing, "mixed_bfloat16"))(jnp.ones((4, 4)))
    assert gc.isenabled()


def test_primitives_under_grad_go_through_cached_jits_and_stage_the_same_program(
    monkeypatch,
):
    # A walk under `grad` binds each primitive through an inline `jit` cached
    # per primitive and parameters (JAX linearizes it from a cached jaxpr):
    # staged, the program holds the same primitives, and computes the same
    # bits, as binding each one on its own.
    from mixprec._src import _compat

    def loss(w, x):
        h = jnp.tanh(x @ w) * 0.5 + 1.0
        return jnp.sum(jnp.exp(-h) / (1.0 + h**2))

    w = jax.random.normal(jax.random.key(0), (32, 32)) / 6
    x = jax.random.normal(jax.random.key(1), (8, 32))

    def staged():
        f = jax.jit(jax.value_and_grad(mixprec.autocast(loss, "mixed_bfloat16")))
        eqns = [e.primitive.name for e in iter_eqns(jax.make_jaxpr(f)(w, x))]
        return collections.Counter(eqns), f(w, x)

    calls = []
    call = _compat.call_transformed

    def counting(key, fn, operands):
        if _compat._transforming(operands):
            calls.append(key)
        return call(key, fn, operands)

    monkeypatch.setattr(_compat, "call_transformed", counting)
    cached, got = staged()
    if not _compat._inline_calls_vanish():  # JAX 0.11: bound directly
        assert not calls
        return
    assert calls, "no primitive went through a cached jit"
    # Inlined when staged: the only nested jit is `f`'s own.
    assert cached["jit"] + cached["pjit"] == 1, cached
    monkeypatch.setattr(_compat, "_transforming", lambda operands: False)
    direct, want = staged()
    assert cached == direct
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16", "mixed_float8"])
def test_float32_ops_taken_as_traced_stage_what_deciding_them_stages(
    policy, monkeypatch
):
    # The walk takes an op of the default rule, outside the allow list, whose
    # floating operands are all float32 as traced, as it was traced, without
    # deciding it: a whole GPT train step (float32 AdamW update, backward pass)
    # stages the same program as when every op is decided.
    import optax

    from mixprec._src._compat import eqn_frame_lines
    from mixprec._src.workloads import gpt2

    cfg = gpt2.GPT2Config(
        vocab_size=64, seq_len=16, d_model=32, num_heads=2, num_layers=2
    )
    params = jax.tree.map(jnp.asarray, gpt2.init(cfg))
    opt = optax.adamw(1e-3)
    state = opt.init(params)
    x, y = gpt2.batch(cfg, 2)

    def staged():
        # The program, and where each equation says it comes from (a fresh
        # function: its first call is walked into the caller's trace).
        def step(params, state, x, y):
            loss = lambda p: gpt2.loss(p, x, y, config=cfg, attention="einsum")  # noqa: E731
            value, grads = jax.value_and_grad(loss)(params)
            updates, state = opt.update(grads, state, params)
            return optax.apply_updates(params, updates), state, value

        f = jax.jit(mixprec.autocast(step, policy))
        with jax.numpy_dtype_promotion("standard"):  # optax's bias correction
            closed = jax.make_jaxpr(f)(params, state, x, y)
        sources = [
            (str(e.source_info.name_stack), eqn_frame_lines(e.source_info), e.ctx)
            for e in iter_eqns(closed)
        ]
        return str(closed), sources

    taken = []
    as_traced = interpreter.runs_as_traced

    def counting(*args):
        found = as_traced(*args)
        taken.append(found)
        return found

    monkeypatch.setattr(interpreter, "runs_as_traced", counting)
    fast, fast_sources = staged()
    assert sum(taken) > len(taken) // 4, (sum(taken), len(taken))
    monkeypatch.setattr(interpreter, "runs_as_traced", lambda *args: False)
    slow, slow_sources = staged()
    assert fast == slow
    assert fast_sources == slow_sources


def test_a_scope_spelled_like_a_transform_is_no_backward_pass():
    # The backward pass is what JAX's transposition emitted (its `Transform`
    # records in the name stack), not any scope whose text reads "transpose(":
    # a forward product there is rounded like any other, and the real backward
    # pass still keeps a float32 weight's gradient in float32.
    def loss(w, x, scope):
        with jax.named_scope(scope):
            h = x @ w
        return jnp.sum(jnp.tanh(h))

    w = jnp.ones((4, 4), F32) * 0.1
    x = jnp.ones((2, 4), F32)
    for scope in ("plain", "transpose(mine)"):
        f = mixprec.autocast(
            lambda w, x, s=scope: loss(w, x, s), policy="mixed_bfloat16"
        )
        # The product's result is bfloat16 (its CPU formulation multiplies
        # rounded operands in float32), so the tanh after it runs in bfloat16.
        tanhs = [
            e for e in iter_eqns(jax.make_jaxpr(f)(w, x)) if e.primitive.name == "tanh"
        ]
        assert [e.outvars[0].aval.dtype for e in tanhs] == [BF16], scope
        grad = jax.grad(f)(w, x)
        assert grad.dtype == F32
        np.testing.assert_allclose(grad, jax.grad(loss)(w, x, scope), rtol=1e-2)
