"""Attention recognised by autocast and run as one fused kernel on a GPU.

On this CPU host: which attentions are recognised (and which near misses are
not), that the CPU formulation is the unfused one bit for bit, the numerics and
gradients of the fused formulation (run with JAX's XLA implementation here)
against float32, and the cuda export (cuDNN's custom calls, no dots).
"""

import contextlib
import functools as ft
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_trees_close

import mixprec
from mixprec._src import _compat
from mixprec._src.autocast.fusions.attention import (
    pattern as attention,
    rule as attention_rule,
)


B, T, N, H = 2, 16, 4, 64


def _pin_cuda_attention(monkeypatch):
    """The attention's cuda formulation, whatever the platform (dots keep
    theirs)."""
    monkeypatch.setattr(
        attention_rule,
        "per_platform",
        lambda args, *, platform, default, **overrides: overrides["cuda"](*args),
    )


def _qkv(t=T, s=None, h=H, seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    s = t if s is None else s
    return (
        jax.random.normal(ks[0], (B, t, N, h)),
        jax.random.normal(ks[1], (B, s, N, h)),
        jax.random.normal(ks[2], (B, s, N, h)),
    )


def _causal(t):
    return jnp.tril(jnp.ones((t, t), dtype=bool)).reshape(1, 1, t, t)


def gpt_causal(q, k, v):
    s = jnp.einsum("bthd,bshd->bhts", q, k) / math.sqrt(q.shape[-1])
    s = jnp.where(_causal(q.shape[1]), s, jnp.finfo(s.dtype).min)
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, axis=-1), v)


def sqrt_scale(q, k, v):
    # The scale as people write it: a function of the head dimension that
    # JAX stages as equations, not a literal.
    s = jnp.einsum("bthd,bshd->bhts", q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
    s = jnp.where(_causal(q.shape[1]), s, jnp.finfo(s.dtype).min)
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, axis=-1), v)


def plain(q, k, v):
    s = jnp.einsum("bthd,bshd->bhts", q, k) * 0.125
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, axis=-1), v)


def padding(q, k, v, keep):
    # keep: bool[B, S], a padding mask broadcast over heads and queries.
    s = jnp.einsum("bthd,bshd->bhts", q, k) / 8.0
    s = jnp.where(keep[:, None, None, :], s, -1e9)
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, axis=-1), v)


def additive(q, k, v, bias):
    s = jnp.einsum("bthd,bshd->bhts", q, k) / 8.0 + bias
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, axis=-1), v)


def dpa_causal(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)


def dpa_plain(q, k, v):
    return jax.nn.dot_product_attention(q, k, v)


# Near misses.
def dropout_on_weights(q, k, v):
    s = jnp.einsum("bthd,bshd->bhts", q, k) / 8.0
    w = jax.nn.softmax(s, axis=-1)
    keep = jax.random.bernoulli(jax.random.key(0), 0.9, w.shape)
    w = jnp.where(keep, w / 0.9, 0.0)
    return jnp.einsum("bhts,bshd->bthd", w, v)


def softmax_over_queries(q, k, v):
    s = jnp.einsum("bthd,bshd->bhts", q, k) / 8.0
    w = jax.nn.softmax(s, axis=-2)
    return jnp.einsum("bhts,bshd->bthd", w, v)


def per_head_scale(q, k, v):
    s = (
        jnp.einsum("bthd,bshd->bhts", q, k)
        * jnp.linspace(0.1, 0.2, N)[None, :, None, None]
    )
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, axis=-1), v)


def sigmoid_attention(q, k, v):
    s = jnp.einsum("bthd,bshd->bhts", q, k) / 8.0
    return jnp.einsum("bhts,bshd->bthd", jax.nn.sigmoid(s), v)


def weights_also_returned(q, k, v):
    s = jnp.einsum("bthd,bshd->bhts", q, k) / 8.0
    w = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bhts,bshd->bthd", w, v), w


def weak_mask_fill(q, k, v):
    # A fill of -10 does not make the masked weights zero: not a mask.
    s = jnp.einsum("bthd,bshd->bhts", q, k) / 8.0
    s = jnp.where(_causal(q.shape[1]), s, -10.0)
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, axis=-1), v)


def _fused(fn, *args, policy="mixed_bfloat16"):
    report = mixprec.explain(fn, *args, policy=policy)
    return [op for op in report.ops if op.primitive == "dot_product_attention"]


def _args(name):
    q, k, v = _qkv()
    if name == "padding":
        keep = jnp.arange(T)[None, :] < jnp.array([[T], [T - 5]])
        return q, k, v, keep
    if name == "additive":
        return q, k, v, 0.1 * jax.random.normal(jax.random.key(3), (1, N, T, T))
    return q, k, v


POSITIVE = {
    "gpt_causal": gpt_causal,
    "sqrt_scale": sqrt_scale,
    "plain": plain,
    "padding": padding,
    "additive": additive,
    "dpa_causal": dpa_causal,
    "dpa_plain": dpa_plain,
}
NEGATIVE = {
    "dropout_on_weights": dropout_on_weights,
    "softmax_over_queries": softmax_over_queries,
    "per_head_scale": per_head_scale,
    "sigmoid_attention": sigmoid_attention,
    "weights_also_returned": weights_also_returned,
    "weak_mask_fill": weak_mask_fill,
}


@pytest.mark.parametrize("name", sorted(POSITIVE))
def test_attention_is_one_entry_with_its_reason_and_line(name):
    ops = _fused(POSITIVE[name], *_args(name))
    assert len(ops) == 1, name
    op = ops[0]
    assert op.decision == "low" and op.dtype == "bfloat16"
    assert "attention" in op.reason and "softmax" in op.reason
    assert op.source and "test_autocast_attention.py" in op.source
    # Its FLOPs are those of the two matmuls it replaces.
    assert op.flops == 2 * (2 * B * N * T * T * H)
    if name in ("gpt_causal", "dpa_causal"):
        assert "causal mask" in op.reason


# How people write the scale: (divide or multiply, the constant as a function
# of the head dimension, which JAX stages as equations, not a literal).
_SCALES = {
    "sqrt": ("div", lambda d: jnp.sqrt(d)),
    "sqrt_cast": ("div", lambda d: jnp.sqrt(d).astype(jnp.float32)),
    "rsqrt": ("mul", lambda d: jax.lax.rsqrt(jnp.float32(d))),
    "pow": ("mul", lambda d: jnp.float32(d) ** -0.5),
    "sqrt_of_reciprocal": ("mul", lambda d: jnp.sqrt(1.0 / d)),
}


@pytest.mark.parametrize("form", sorted(_SCALES))
def test_scale_written_as_a_function_of_constants_is_the_same_attention(
    form, monkeypatch
):
    # Each form of sqrt(48) or its reciprocal (inexact in float32) is found
    # with the value the program computes: the fused formulation gives what
    # the same attention with that value as a literal gives, bit for bit.
    monkeypatch.setattr(attention_rule, "_IMPLEMENTATION", "xla")
    _pin_cuda_attention(monkeypatch)
    q, k, v = (x[..., :48] for x in _qkv())
    op, constant = _SCALES[form]

    def attend(c):
        def fn(q, k, v):
            s = jnp.einsum("bthd,bshd->bhts", q, k)
            s = s / c(q.shape[-1]) if op == "div" else s * c(q.shape[-1])
            return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, axis=-1), v)

        return fn

    written = attend(constant)
    value = float(np.asarray(constant(48)))
    literal = attend(lambda d: value)
    assert len(_fused(written, q, k, v)) == 1
    got = jax.jit(mixprec.autocast(written, "mixed_bfloat16"))(q, k, v)
    want = jax.jit(mixprec.autocast(literal, "mixed_bfloat16"))(q, k, v)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # A scale computed from the inputs is not a constant: not this attention.

    def data(q, k, v):
        s = jnp.einsum("bthd,bshd->bhts", q, k) / jnp.sqrt(jnp.sum(q * q))
        return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, axis=-1), v)

    assert _fused(data, q, k, v) == []


@pytest.mark.parametrize("name", sorted(NEGATIVE))
def test_near_misses_stay_unfused(name):
    assert _fused(NEGATIVE[name], *_qkv()) == []


def test_float32_policy_and_float32_scope_do_not_fuse():
    assert _fused(gpt_causal, *_qkv(), policy="float32") == []

    def scoped(q, k, v):
        with mixprec.float32_scope():
            return gpt_causal(q, k, v)

    assert _fused(scoped, *_qkv()) == []


@pytest.mark.parametrize("name", sorted(POSITIVE))
def test_cpu_formulation_is_the_unfused_one(name, monkeypatch):
    args = _args(name)
    fn = POSITIVE[name]
    # New functions: autocast caches what it built for one.
    got = jax.jit(mixprec.autocast(lambda *a: fn(*a), "mixed_bfloat16"))(*args)
    monkeypatch.setattr(attention, "find", lambda *a, **k: {})
    want = jax.jit(mixprec.autocast(lambda *a: fn(*a), "mixed_bfloat16"))(*args)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("low", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", sorted(POSITIVE))
def test_fused_formulation_matches_float32(name, low, monkeypatch):
    # The cuda formulation, pinned, with JAX's XLA implementation standing in
    # for cuDNN on this CPU: the layouts, scale, masks and biases are right.
    monkeypatch.setattr(attention_rule, "_IMPLEMENTATION", "xla")
    _pin_cuda_attention(monkeypatch)
    args = _args(name)
    fn = POSITIVE[name]
    calls = []
    real = attention_rule.fused
    monkeypatch.setattr(
        attention_rule, "fused", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    # A new function: autocast caches what it built for one.
    f = mixprec.autocast(lambda *a: fn(*a), f"mixed_{low}")
    got = jax.jit(f)(*args)
    assert calls, "the fused formulation did not run"
    assert got.dtype == jnp.float32  # the policy's output dtype
    if name == "additive" and low == "float16":
        # cuDNN takes the bias in float16 too: one more rounding than the
        # float16 tolerance (eps 1e-3) allows for.
        err = np.max(np.abs(got - fn(*args))) / np.max(np.abs(fn(*args)))
        assert err <= 2e-3
    else:
        assert_trees_close(got, fn(*args), dtype=low)

    def loss(f, q, k, v, *rest):
        return jnp.sum(f(q, k, v, *rest).astype(jnp.float32) * v)

    g = jax.grad(ft.partial(loss, f), argnums=(0, 1, 2))(*args)
    g32 = jax.grad(ft.partial(loss, fn), argnums=(0, 1, 2))(*args)
    assert [a.dtype for a in g] == [jnp.float32] * 3
    assert_trees_close(g, g32, dtype=low, grad=True)


def test_gradients_through_autocast_and_whole_step():
    q, k, v = _qkv()

    def loss(q, k, v):
        return jnp.mean(gpt_causal(q, k, v) ** 2)

    g32 = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    g = jax.grad(mixprec.autocast(loss, "mixed_bfloat16"), argnums=(0, 1, 2))(q, k, v)
    assert_trees_close(g, g32, dtype=jnp.bfloat16, grad=True)
    whole = mixprec.autocast(jax.grad(loss, argnums=(0, 1, 2)), "mixed_bfloat16")
    gw = jax.jit(whole)(q, k, v)
    assert [x.dtype for x in gw] == [jnp.float32] * 3
    assert_trees_close(gw, g32, dtype=jnp.bfloat16, grad=True)


# ------------------------------------------------- a whole step: forward and backward


def _sum_loss(fn):
    def loss(q, k, v, *rest):
        return jnp.sum(fn(q, k, v, *rest).astype(jnp.float32) * v)

    return loss


def _attention_entries(fn, *args, policy="mixed_bfloat16"):
    report = mixprec.explain(fn, *args, policy=policy)
    return [
        (op.backward, op.reason.split(" (")[0])
        for op in report.ops
        if op.primitive == "dot_product_attention"
    ]


@pytest.mark.parametrize("name", sorted(POSITIVE))
def test_whole_step_fuses_attention_and_its_gradient(name, monkeypatch):
    # autocast around `jax.grad`: the backward equations JAX emitted are
    # proven to be the derivative of the recognised forward and run as the
    # fused kernel's derivative (XLA's implementation standing in for cuDNN;
    # its float16 derivative has GEMMs XLA:CPU cannot run, so float16 is
    # checked by exporting for cuda: test_platforms.py).
    low = "bfloat16"
    monkeypatch.setattr(attention_rule, "_IMPLEMENTATION", "xla")
    _pin_cuda_attention(monkeypatch)
    args = _args(name)
    grad = jax.grad(_sum_loss(POSITIVE[name]), argnums=(0, 1, 2))
    g32 = grad(*args)
    assert _attention_entries(grad, *args, policy=f"mixed_{low}") == [
        (False, "attention"),
        (True, "attention's gradient"),
    ]
    # (JAX's XLA implementation of attention relies on implicit promotion in
    # its derivative, traced when the step is; cuDNN's does not.)
    with jax.numpy_dtype_promotion("standard"):
        got = jax.jit(mixprec.autocast(lambda *a: grad(*a), f"mixed_{low}"))(*args)
    assert [g.dtype for g in got] == [jnp.float32] * 3
    assert_trees_close(got, g32, dtype=low, grad=True)


@pytest.mark.parametrize("name", sorted(POSITIVE))
def test_whole_step_cpu_formulation_is_the_unfused_one(name, monkeypatch):
    args = _args(name)
    grad = jax.grad(_sum_loss(POSITIVE[name]), argnums=(0, 1, 2))
    assert _attention_entries(grad, *args)  # recognised
    got = jax.jit(mixprec.autocast(lambda *a: grad(*a), "mixed_bfloat16"))(*args)
    monkeypatch.setattr(attention, "find", lambda *a, **k: {})
    want = jax.jit(mixprec.autocast(lambda *a: grad(*a), "mixed_bfloat16"))(*args)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_whole_step_that_reads_the_weights_elsewhere_stays_unfused():
    # The attention weights are also returned: the fused kernel never
    # materialises them, so neither pass is fused.
    q, k, v = _qkv()

    def loss(q, k, v):
        s = jnp.einsum("bthd,bshd->bhts", q, k) / 8.0
        p = jax.nn.softmax(s, axis=-1)
        return jnp.sum(jnp.einsum("bhts,bshd->bthd", p, v) ** 2), p

    grad = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)
    assert _attention_entries(grad, q, k, v) == []
    # Without the weights it is recognised.
    plain = jax.grad(lambda *a: loss(*a)[0], argnums=(0, 1, 2))
    assert len(_attention_entries(plain, q, k, v)) == 2


def test_whole_step_with_one_array_as_queries_and_keys_is_right(monkeypatch):
    # The array's gradient is the sum of two of the kernel's: not fused, and
    # the gradients stay those of float32.
    monkeypatch.setattr(attention_rule, "_IMPLEMENTATION", "xla")
    _pin_cuda_attention(monkeypatch)
    q, _, v = _qkv()
    loss = _sum_loss(gpt_causal)
    grad = jax.grad(lambda x, v: loss(x, x, v), argnums=(0, 1))
    want = grad(q, v)
    # Either part of the sum alone (the queries' or the keys' gradient) is far
    # from it: a formulation that kept one part fails the value check below.
    parts = jax.grad(loss, argnums=(0, 1))(q, q, v)
    for part in parts:
        with pytest.raises(AssertionError, match="relative error"):
            assert_trees_close(part, want[0], dtype=jnp.bfloat16, grad=True)
    assert_trees_close(parts[0] + parts[1], want[0], dtype=jnp.float32, grad=True)
    # Not fused. (Were it fused, the array's gradient would be right only by
    # the order of two writes: the kernel's derivative for one slot is the
    # whole sum and for the other zero, and the later write wins.)
    assert _attention_entries(grad, q, v) == []
    got = jax.jit(mixprec.autocast(grad, "mixed_bfloat16"))(q, v)
    assert [g.dtype for g in got] == [jnp.float32] * 2
    assert_trees_close(got, want, dtype=jnp.bfloat16, grad=True)


def test_whole_step_under_remat_is_fused_and_correct():
    # `jax.checkpoint` puts the forward at top level and the recomputed
    # forward with the backward in the checkpoint's body: each is fused
    # (tests/test_autocast_attention_remat.py), the gradients those of float32.
    q, k, v = _qkv()
    loss = _sum_loss(jax.checkpoint(gpt_causal))
    grad = jax.grad(loss, argnums=(0, 1, 2))
    assert _attention_entries(grad, q, k, v) == [
        (False, "attention"),
        (True, "attention"),
        (True, "attention's gradient"),
    ]
    got = jax.jit(mixprec.autocast(grad, "mixed_bfloat16"))(q, k, v)
    assert_trees_close(got, grad(q, k, v), dtype=jnp.bfloat16, grad=True)


def test_head_dim_cudnn_refuses_keeps_the_unfused_formulation(monkeypatch):
    # Pretend cuDNN is present: a head dimension that is not a multiple of 8
    # is refused at trace time, and the cuda branch keeps the ops.
    monkeypatch.setattr(
        _compat.cudnn_attention_module(), "check_cudnn_version", lambda: 91000
    )
    _pin_cuda_attention(monkeypatch)
    q, k, v = _qkv(h=12)
    f = mixprec.autocast(lambda *a: gpt_causal(*a), "mixed_bfloat16")
    names = {e.primitive.name for e in jax.make_jaxpr(f)(q, k, v).eqns}
    assert "exp" in names and "custom_vjp_call" not in names


def _cuda_text(fn, *args):
    calls = ("__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward")
    calls += ("__cudnn$fmhaScaleBiasSoftmax", "__cudnn$fmhaScaleBiasSoftmaxBackward")
    checks = [jax.export.DisabledSafetyCheck.custom_call(c) for c in calls]
    exp = jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)
    return exp(*args).mlir_module()


@pytest.mark.parametrize("name", ["gpt_causal", "dpa_causal", "plain", "sqrt_scale"])
def test_cuda_export_runs_cudnn_attention_forward_and_backward(name, monkeypatch):
    monkeypatch.setattr(
        _compat.cudnn_attention_module(), "check_cudnn_version", lambda: 91000
    )
    q, k, v = _qkv()
    fn = POSITIVE[name]
    f = mixprec.autocast(lambda *a: fn(*a), "mixed_bfloat16")

    def loss(q, k, v):
        return jnp.sum(f(q, k, v).astype(jnp.float32))

    fwd = _cuda_text(f, q, k, v)
    calls = set(re.findall(r"custom_call @([\w$]+)", fwd))
    assert "__cudnn$fmhaSoftmax" in calls, calls
    assert "stablehlo.dot_general" not in fwd
    assert "stablehlo.exponential" not in fwd
    mask_type = re.search(r"mask_type\\22: \\22(\w+)", fwd)
    assert mask_type is not None
    causal = name in ("gpt_causal", "dpa_causal", "sqrt_scale")
    assert mask_type.group(1) == ("CAUSAL" if causal else "NO_MASK")
    # Every one of them scales by 1/sqrt(64), however it is written.
    scales = re.findall(r"fmha_scale\\22: ([0-9.e+-]+)", fwd)
    assert [float(x) for x in scales] == [1 / math.sqrt(H)], scales
    bwd = _cuda_text(jax.grad(loss, argnums=(0, 1, 2)), q, k, v)
    calls = set(re.findall(r"custom_call @([\w$]+)", bwd))
    assert "__cudnn$fmhaSoftmaxBackward" in calls, calls
    assert "stablehlo.dot_general" not in bwd
    # The attention takes 16-bit operands.
    sig = re.search(r"custom_call @__cudnn\$fmhaSoftmax\(.* : \(([^)]*)\) ->", fwd)
    assert sig is not None and "bf16" in sig.group(1) and "f32" not in sig.group(1)


def test_flax_equinox_haiku_attention_are_recognised():
    flax_nn = pytest.importorskip("flax.linen")
    eqx = pytest.importorskip("equinox")
    hk = pytest.importorskip("haiku")
    x = jax.random.normal(jax.random.key(0), (B, T, 64))
    m = flax_nn.MultiHeadDotProductAttention(num_heads=4, qkv_features=64)
    p = m.init(jax.random.key(1), x)

    def flax_f(p, x):
        mask = flax_nn.make_causal_mask(jnp.ones(x.shape[:2]))
        return m.apply(p, x, mask=mask, deterministic=True)

    (op,) = _fused(flax_f, p, x)
    assert "causal mask" in op.reason
    # A mask that is an argument is passed to the kernel as a mask.
    mask = flax_nn.make_causal_mask(jnp.ones((B, T)))
    flax_g = lambda p, x, mask: m.apply(p, x, mask=mask)  # noqa: E731
    (op,) = _fused(flax_g, p, x, mask)
    assert "mask" in op.reason and "causal" not in op.reason

    e = eqx.nn.MultiheadAttention(4, 64, key=jax.random.key(2))
    causal = jnp.tril(jnp.ones((T, T), bool))
    eqx_f = lambda e, x: e(x, x, x, mask=causal)  # noqa: E731
    assert len(_fused(eqx_f, e, x[0])) == 1

    def hk_fn(x):
        mha = hk.MultiHeadAttention(
            num_heads=4, key_size=16, w_init=hk.initializers.VarianceScaling()
        )
        return mha(x, x, x, mask=_causal(T))

    model = hk.without_apply_rng(hk.transform(hk_fn))
    hp = model.init(jax.random.key(3), x)
    assert len(_fused(model.apply, hp, x)) == 1


# ------------------------------------- a fusion decided from the ops it replaces


def highest_precision(q, k, v):
    hi = jax.lax.Precision.HIGHEST
    s = jnp.einsum("bthd,bshd->bhts", q, k, precision=hi) * 0.125
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, axis=-1), v, precision=hi)


@pytest.mark.parametrize("low", ["bfloat16", "float16"])
@pytest.mark.parametrize("case", ["precision_arg", "default_precision", "mixlist"])
def test_attention_whose_matmuls_stay_float32_is_not_fused(case, low, monkeypatch):
    # A fusion runs in 16 bits only where every product it replaces would:
    # here its matmuls run in float32, one by one, as explain says, on every
    # platform (the cuda export has no fused kernel either).
    monkeypatch.setattr(
        _compat.cudnn_attention_module(), "check_cudnn_version", lambda: 91000
    )
    q, k, v = _qkv()
    fn, mixlist = plain, None
    if case == "precision_arg":
        fn = highest_precision
    if case == "mixlist":
        mixlist = {"black-list": {"to-add": ["dot_general"]}}
    context = (
        jax.default_matmul_precision("highest")
        if case == "default_precision"
        else contextlib.nullcontext()
    )
    policy = f"mixed_{low}"
    with context:
        report = mixprec.explain(fn, q, k, v, policy=policy, mixlist=mixlist)
        dots = [op for op in report.ops if op.primitive == "dot_general"]
        f = mixprec.autocast(lambda *a: fn(*a), policy, mixlist=mixlist)
        got = jax.jit(f)(q, k, v)
        text = _cuda_text(f, q, k, v)
    assert not [op for op in report.ops if op.primitive == "dot_product_attention"]
    assert [op.dtype for op in dots] == ["float32", "float32"]
    assert "__cudnn$fmha" not in text
    assert got.dtype == jnp.float32
    assert_trees_close(got, fn(q, k, v), dtype=jnp.float32)
    # The same attention with its matmuls in the allow list is fused.
    assert len(_fused(plain, q, k, v, policy=policy)) == 1


def test_closed_over_causal_tril_becomes_is_causal(monkeypatch):
    # A causal mask closed over as an array (not written as `tril` in the
    # traced function) is a constant known before the walk: the fused kernel
    # gets `is_causal`, not a mask operand.
    monkeypatch.setattr(
        _compat.cudnn_attention_module(), "check_cudnn_version", lambda: 91000
    )
    q, k, v = _qkv()
    causal = np.tril(np.ones((T, T), bool)).reshape(1, 1, T, T)
    mask = jnp.asarray(causal)

    def closed(q, k, v):
        s = jnp.einsum("bthd,bshd->bhts", q, k) * 0.125
        s = jnp.where(mask, s, jnp.finfo(s.dtype).min)
        return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, axis=-1), v)

    (op,) = _fused(closed, q, k, v)
    assert "causal mask" in op.reason
    f = mixprec.autocast(lambda *a: closed(*a), "mixed_bfloat16")
    text = _cuda_text(f, q, k, v)
    mask_type = re.search(r"mask_type\\22: \\22(\w+)", text)
    assert mask_type is not None and mask_type.group(1) == "CAUSAL"
    assert_trees_close(jax.jit(f)(q, k, v), closed(q, k, v), dtype=jnp.bfloat16)


def _projected(x, w, keys=lambda k: k, stacked=False):
    d = N * H
    q, k, v = (
        (x @ w[n]).reshape(B, T, N, H) for n in ("q", "k", "v")
    )  # [b, t, heads, h]
    out = plain(q, keys(k), v)
    if stacked:  # the output of one attention is the queries of the next
        out = plain(out, keys(k), v)
    return out.reshape(B, T, d) @ w["o"]


@pytest.mark.parametrize("case", ["stop_gradient_keys", "values_only", "stacked"])
def test_whole_step_fuses_partial_and_stacked_gradients(case, monkeypatch):
    # Keys under stop_gradient, only the values' projection differentiated,
    # and two attentions in a row: each forward and each backward is fused,
    # with the gradients of float32 (XLA's implementation standing in for
    # cuDNN, the cuda formulation pinned).
    monkeypatch.setattr(attention_rule, "_IMPLEMENTATION", "xla")
    _pin_cuda_attention(monkeypatch)
    ks = jax.random.split(jax.random.key(4), 5)
    x = jax.random.normal(ks[0], (B, T, N * H))
    w = {
        n: 0.05 * jax.random.normal(k, (N * H, N * H))
        for n, k in zip("qkvo", ks[1:], strict=True)
    }
    keys = jax.lax.stop_gradient if case == "stop_gradient_keys" else (lambda k: k)
    stacked = case == "stacked"

    def loss(w, x):
        return jnp.mean(_projected(x, w, keys, stacked) ** 2)

    if case == "values_only":
        grad = jax.grad(lambda wv, w, x: loss({**w, "v": wv}, x))
        args = (w["v"], w, x)
    else:
        grad = jax.grad(loss)
        args = (w, x)
    n = 2 if stacked else 1
    assert _attention_entries(grad, *args) == (
        [(False, "attention")] * n + [(True, "attention's gradient")] * n
    )
    with jax.numpy_dtype_promotion("standard"):
        got = jax.jit(mixprec.autocast(lambda *a: grad(*a), "mixed_bfloat16"))(*args)
    want = grad(*args)
    assert jax.tree.map(lambda g: g.dtype, got) == jax.tree.map(lambda g: g.dtype, want)
    assert_trees_close(got, want, dtype=jnp.bfloat16, grad=True)


# ------------------------------- scopes inside an attention: one decision each


def _scoped(where, scope):
    """``plain`` with ``scope()`` around the scores matmul or the values one."""

    def fn(q, k, v):
        inner = scope() if where == "scores" else contextlib.nullcontext()
        with inner:
            s = jnp.einsum("bthd,bshd->bhts", q, k) * 0.125
        p = jax.nn.softmax(s, axis=-1)
        inner = scope() if where == "values" else contextlib.nullcontext()
        with inner:
            return jnp.einsum("bhts,bshd->bthd", p, v)

    return fn


def _unrecognised(monkeypatch, fn, policy, *args):
    with monkeypatch.context() as m:
        m.setattr(attention, "find", lambda *a, **k: {})
        return jax.jit(mixprec.autocast(lambda *a: fn(*a), policy))(*args)


_SCOPES = {
    "float32": mixprec.float32_scope,
    "other_policy": None,  # the other 16-bit policy, filled in per test
}


@pytest.mark.parametrize("low", ["bfloat16", "float16"])
@pytest.mark.parametrize("where", ["scores", "values"])
@pytest.mark.parametrize("kind", sorted(_SCOPES))
def test_a_scope_around_one_matmul_of_an_attention_is_kept(
    kind, where, low, monkeypatch
):
    # A fusion's decision is those of every equation it replaces, each in its
    # own region: one matmul under float32_scope, or under a policy of the
    # other 16-bit dtype, keeps the attention unfused, on every platform, and
    # the program gives what it gives with recognition off, bit for bit.
    monkeypatch.setattr(
        _compat.cudnn_attention_module(), "check_cudnn_version", lambda: 91000
    )
    policy = f"mixed_{low}"
    other = "mixed_float16" if low == "bfloat16" else "mixed_bfloat16"
    scope = _SCOPES[kind] or (lambda: mixprec.precision_scope(other))
    fn = _scoped(where, scope)
    q, k, v = _qkv()
    if kind == "float32" and where == "values":
        v = v * 5e4  # ·v beyond float16's range: only float32 holds it
    report = mixprec.explain(fn, q, k, v, policy=policy)
    assert not [op for op in report.ops if op.primitive == "dot_product_attention"]
    dots = [op.dtype for op in report.ops if op.primitive == "dot_general"]
    # (float32_scope: as written, no dtype of its own.)
    scoped = None if kind == "float32" else other.removeprefix("mixed_")
    assert dots == ([scoped, low] if where == "scores" else [low, scoped])
    got = jax.jit(mixprec.autocast(lambda *a: fn(*a), policy))(q, k, v)
    want = _unrecognised(monkeypatch, fn, policy, q, k, v)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert bool(jnp.all(jnp.isfinite(got)))
    ref = fn(q, k, v)
    assert_trees_close(
        got,
        ref,
        dtype=jnp.bfloat16 if "bfloat16" in (low, scoped) else jnp.float16,
    )
    # A whole step too: neither pass fused, the gradients those of recognition off.
    grad = jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v) * v), argnums=(0, 1, 2))
    assert not _attention_entries(grad, q, k, v, policy=policy)
    got_g = jax.jit(mixprec.autocast(lambda *a: grad(*a), policy))(q, k, v)
    want_g = _unrecognised(monkeypatch, grad, policy, q, k, v)
    for a, b in zip(got_g, want_g, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # The cuda export runs no fused kernel.
    f = mixprec.autocast(lambda *a: fn(*a), policy)
    assert "__cudnn$fmha" not in _cuda_text(f, q, k, v)


@pytest.mark.parametrize("low", ["bfloat16", "float16"])
def test_an_attention_inside_one_scope_is_fused_in_the_scope_dtype(low, monkeypatch):
    # Both matmuls under a policy of the other 16-bit dtype: fused, in it.
    monkeypatch.setattr(
        _compat.cudnn_attention_module(), "check_cudnn_version", lambda: 91000
    )
    other = "float16" if low == "bfloat16" else "bfloat16"

    def fn(q, k, v):
        with mixprec.precision_scope(f"mixed_{other}"):
            return plain(q, k, v)

    q, k, v = _qkv()
    (op,) = _fused(fn, q, k, v, policy=f"mixed_{low}")
    assert op.dtype == other
    text = _cuda_text(mixprec.autocast(fn, f"mixed_{low}"), q, k, v)
    sig = re.search(r"custom_call @__cudnn\$fmhaSoftmax\(.* : \(([^)]*)\) ->", text)
    assert sig is not None
    assert ("bf16" if other == "bfloat16" else "f16") in sig.group(1)


def test_diagnose_advice_around_the_values_matmul_is_what_runs(monkeypatch):
    # The advice `diagnose` verifies (float32_scope around ·v) applied as
    # written: autocast runs it, fused attention or not, with no inf.
    q, k, v = _qkv()
    v = v * 5e4
    fn = _scoped("values", mixprec.float32_scope)
    got = jax.jit(mixprec.autocast(fn, "mixed_float16"))(q, k, v)
    assert bool(jnp.all(jnp.isfinite(got)))
    assert_trees_close(got, fn(q, k, v), dtype=jnp.float16)
    unscoped = jax.jit(mixprec.autocast(plain, "mixed_float16"))(q, k, v)
    assert not bool(jnp.all(jnp.isfinite(unscoped)))  # what the scope fixes


# ------------------------------------ mask biases, whatever their origin


def _padded_bias(origin):
    """A padding mask bias for batch row 1 fully padded, built as people do:
    ``(1 - mask) * finfo(float32).min``; ``origin`` says where."""
    mask = np.ones((B, T), np.float32)
    mask[1] = 0.0
    if origin == "argument":
        bias = jnp.asarray((1 - mask) * np.finfo(np.float32).min)[:, None, None, :]
        return (lambda s, extra: s + extra), (bias,)
    if origin == "computed":  # from an argument inside the function
        return (
            lambda s, m: s + ((1.0 - m) * jnp.finfo(jnp.float32).min)[:, None, None, :],
            (jnp.asarray(mask),),
        )
    const = jnp.asarray((1 - mask) * np.finfo(np.float32).min)[:, None, None, :]
    return (lambda s, _: s + const), (jnp.zeros(()),)


@pytest.mark.parametrize("low", ["bfloat16", "float16"])
@pytest.mark.parametrize("origin", ["argument", "computed", "constant"])
@pytest.mark.parametrize("formulation", ["cpu", "cuda_pinned"])
def test_a_mask_bias_stays_finite_whatever_its_origin(
    origin, low, formulation, monkeypatch
):
    # A fully padded example (all keys masked): float32 gives finite, uniform
    # weights. Cast down, a bias beyond the low range saturates (constant,
    # argument or computed), in the ops one by one and in the fused bias.
    if formulation == "cuda_pinned":
        monkeypatch.setattr(attention_rule, "_IMPLEMENTATION", "xla")
        _pin_cuda_attention(monkeypatch)
    add_bias, extra = _padded_bias(origin)

    def attn(q, k, v, *extra):
        s = add_bias(jnp.einsum("bthd,bshd->bhts", q, k) / 8.0, *extra)
        return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, axis=-1), v)

    q, k, v = _qkv()
    policy = f"mixed_{low}"
    f = mixprec.autocast(lambda *a: attn(*a), policy)
    got = jax.jit(f)(q, k, v, *extra)
    ref = attn(q, k, v, *extra)
    assert bool(jnp.all(jnp.isfinite(ref)))
    assert bool(jnp.all(jnp.isfinite(got))), int(jnp.sum(~jnp.isfinite(got)))
    assert_trees_close(got, ref, dtype=low)

    if formulation == "cuda_pinned" and low == "float16":
        return  # (XLA's float16 attention derivative has GEMMs XLA:CPU refuses)

    # The gradient of a loss over the real tokens only (loss-only wrap and
    # whole step).
    def loss(attn, q, k, v, *extra):
        return jnp.sum(attn(q, k, v, *extra)[0].astype(jnp.float32) ** 2)

    g_ref = jax.grad(ft.partial(loss, attn), argnums=(0, 1, 2))(q, k, v, *extra)
    g = jax.grad(ft.partial(loss, f), argnums=(0, 1, 2))(q, k, v, *extra)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in g)
    assert_trees_close(g, g_ref, dtype=low, grad=True)
    whole = jax.grad(ft.partial(loss, attn), argnums=(0, 1, 2))
    with jax.numpy_dtype_promotion("standard"):
        g_whole = jax.jit(mixprec.autocast(whole, policy))(q, k, v, *extra)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in g_whole)
    assert_trees_close(g_whole, g_ref, dtype=low, grad=True)


@pytest.mark.parametrize("low", ["bfloat16", "float16"])
def test_a_bias_in_range_is_kept_bit_for_bit(low, monkeypatch):
    # The saturation changes values beyond the low range only: a bias
    # parameter (and its gradient) comes out as without it, bit for bit.
    from mixprec._src.autocast import operands

    x = jax.random.normal(jax.random.key(0), (8, 16))
    w = jax.random.normal(jax.random.key(1), (16, 16))
    b = jnp.linspace(-3.0, 3.0, 16)[None, :]

    def loss(w, b, x):
        return jnp.sum(jnp.tanh(jnp.tanh(x @ w) + b) ** 2)

    def run():
        grad = jax.value_and_grad(loss, argnums=(0, 1))
        return jax.jit(mixprec.autocast(lambda *a: grad(*a), f"mixed_{low}"))(w, b, x)

    report = mixprec.explain(loss, w, b, x, policy=f"mixed_{low}")
    assert any("mask bias" in op.reason for op in report.ops)  # it is there
    got = run()
    monkeypatch.setattr(operands, "_saturate_mask", lambda walk, eqn, v, x, d: x)
    want = run()
    for a, r in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.dtype == r.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(r))


@pytest.mark.parametrize("low", ["bfloat16", "float16"])
def test_saturate_mask_keeps_a_mask_finite_with_room_for_a_score(low):
    from mixprec._src.autocast.operands import saturate_mask

    big = float(jnp.finfo(low).max)
    x = jnp.array([np.finfo(np.float32).min, -1e9, -np.inf, np.inf, -3.0, np.nan])
    got = np.asarray(saturate_mask(x, low))
    assert saturate_mask(x, low).dtype == jnp.float32
    beyond = -big / 2 if low == "float16" else -1e9  # -1e9 fits bfloat16
    np.testing.assert_array_equal(got[:5], [-big / 2, beyond, -big / 2, big / 2, -3.0])
    assert np.isnan(got[5])
    # Cast down, a score within range added to it does not overflow.
    score = jnp.asarray(-big / 2, low)
    assert bool(jnp.all(jnp.isfinite(jnp.asarray(got[:4]).astype(low) + score)))


@pytest.mark.parametrize("low", ["bfloat16", "float16"])
def test_whole_step_under_remat_fuses_its_recomputed_backward(low, monkeypatch):
    # `jax.checkpoint` around the attention of a whole step: the forward is
    # fused at top level, the backward is recomputed in the checkpoint's body
    # (another jaxpr) and fused there with its recomputed forward; no note
    # says otherwise, and the cuda export has both kernels, as with autocast
    # around the loss.
    monkeypatch.setattr(
        _compat.cudnn_attention_module(), "check_cudnn_version", lambda: 91000
    )
    q, k, v = _qkv()
    policy = f"mixed_{low}"
    loss = _sum_loss(jax.checkpoint(gpt_causal))
    grad = jax.grad(loss, argnums=(0, 1, 2))
    report = mixprec.explain(grad, q, k, v, policy=policy)
    assert not any("backward not" in n for n in report.notes), report.notes
    diag = mixprec.diagnose(grad, q, k, v, policy=policy)
    assert not any("backward not" in n for n in diag.notes), diag.notes
    wrapped = mixprec.autocast(loss, policy)
    for step in (mixprec.autocast(grad, policy), jax.grad(wrapped, argnums=(0, 1, 2))):
        calls = re.findall(r"custom_call @([\w$]+)", _cuda_text(step, q, k, v))
        assert calls.count("__cudnn$fmhaSoftmax") == 2, calls  # one recomputed
        assert calls.count("__cudnn$fmhaSoftmaxBackward") == 1, calls
