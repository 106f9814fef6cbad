"""Constants the low dtype cannot hold: mask biases made from them, and
closed-over constants inside call bodies.

* An additive mask bias (Hugging Face's ``select(mask > 0, 0, finfo.min)``,
  ``(1 - mask) * finfo.min``, ``(1 - mask) * -1e9``) is computed from the
  data's mask, yet its large values are a constant's: it must not become
  ``-inf`` in 16 bits, or a fully masked row (a padding query of a
  left-padded causal batch) becomes NaN and spreads. Checked op by op (the
  CPU formulation, recognised as an attention or not), through a whole train
  step, and in the fused attention's cuda formulation.
* A closed-over constant keeps its op in float32 inside every call body
  (``jit``, ``checkpoint``, ``custom_jvp``, ``custom_vjp``, ``shard_map``,
  ``closed_call``) as it does outside.
"""

import functools as ft
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_close
from jax import lax
from jax.extend.core import primitives as P
from jax.sharding import AxisType, PartitionSpec

import mixprec
from mixprec._src import _compat
from mixprec._src.autocast import interpreter
from mixprec._src.autocast.fusions.attention import (
    pattern as attention,
    rule as attention_rule,
)


POLICIES = {"mixed_bfloat16": jnp.bfloat16, "mixed_float16": jnp.float16}
B, T, D, HEADS, VOCAB = 2, 8, 16, 2, 11


# ------------------------------------------------------------ mask biases


def hf_bias(valid, form):
    """``[B, 1, T, T]`` additive bias from a ``[B, T]`` bool padding mask,
    causal, as Hugging Face models build it."""
    causal = jnp.tril(jnp.ones((T, T), bool))[None, None]
    mask = causal & valid[:, None, None, :]
    if form == "select_finfo_min":  # Flax GPT-2 / BART / OPT
        return lax.select(
            mask,
            jnp.full(mask.shape, 0.0, jnp.float32),
            jnp.full(mask.shape, jnp.finfo(jnp.float32).min, jnp.float32),
        )
    m = mask.astype(jnp.float32)
    if form == "mul_finfo_min":  # PyTorch ports
        return (1.0 - m) * jnp.finfo(jnp.float32).min
    assert form == "mul_1e9"  # older code
    return (1.0 - m) * -1e9


FORMS = ["select_finfo_min", "mul_finfo_min", "mul_1e9"]


def init_params(seed=0):
    ks = iter(jax.random.split(jax.random.key(seed), 16))
    layers = [
        {
            n: jax.random.normal(next(ks), (D, D)) / np.sqrt(D).astype(np.float32)
            for n in ("q", "k", "v", "o")
        }
        for _ in range(2)
    ]
    return {
        "embed": jax.random.normal(next(ks), (VOCAB, D)),
        "layers": layers,
        "head": jax.random.normal(next(ks), (D, VOCAB)) / np.float32(4.0),
    }


def batch():
    """One full sequence, one left-padded (its first 3 tokens are padding:
    their causal query rows see no key at all)."""
    tokens = jax.random.randint(jax.random.key(1), (B, T), 0, VOCAB)
    valid = jnp.arange(T)[None, :] >= jnp.array([[0], [3]])
    return tokens, jnp.roll(tokens, -1, axis=1), valid


def heads(x):
    return x.reshape(B, T, HEADS, D // HEADS).transpose(0, 2, 1, 3)


def model_loss(params, tokens, labels, valid, *, form):
    x = params["embed"][tokens]
    bias = hf_bias(valid, form)
    for p in params["layers"]:
        q, k, v = (heads(x @ p[n]) for n in "qkv")
        scores = q @ k.transpose(0, 1, 3, 2) / np.float32(np.sqrt(D // HEADS))
        w = jax.nn.softmax(scores + bias, axis=-1)
        y = (w @ v).transpose(0, 2, 1, 3).reshape(B, T, D)
        x = x + y @ p["o"]
    logits = x @ params["head"]
    xent = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    keep = valid.astype(jnp.float32)
    return jnp.sum(xent * keep) / jnp.sum(keep)


@pytest.fixture(params=["recognised", "unrecognised"])
def recognition(request, monkeypatch):
    """As autocast runs it (a recognised attention, its CPU formulation being
    its ops one by one), and with the recognition off (plain ops)."""
    if request.param == "unrecognised":
        monkeypatch.setattr(attention, "find", lambda *a, **k: {})
    return request.param


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("form", FORMS)
def test_mask_bias_loss_is_finite_and_matches_float32(form, policy, recognition):
    del recognition
    params = init_params()
    args = batch()
    loss = ft.partial(model_loss, form=form)
    want = loss(params, *args)
    # A new function per case: autocast caches what it built for one.
    got = jax.jit(mixprec.autocast(lambda *a: loss(*a), policy))(params, *args)
    assert got.dtype == jnp.float32
    assert np.isfinite(float(got)), got
    assert_trees_close(got, want, dtype=POLICIES[policy])


@pytest.mark.standard_promotion  # optax.adam's bias correction mixes int and float
@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("form", FORMS)
def test_mask_bias_whole_train_step(form, policy, recognition):
    del recognition
    params = init_params()
    args = batch()
    optimizer = optax.adam(1e-2)
    loss = ft.partial(model_loss, form=form)

    def step(params, opt_state, *batch):
        value, grads = jax.value_and_grad(loss)(params, *batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value, grads

    state = optimizer.init(params)
    want = step(params, state, *args)
    got = jax.jit(mixprec.autocast(lambda *a: step(*a), policy))(params, state, *args)
    low = POLICIES[policy]
    for leaf in jax.tree.leaves(got):
        assert bool(jnp.all(jnp.isfinite(leaf)))
    new_params, _, value, grads = got
    assert jax.tree.map(lambda a: a.dtype, new_params) == jax.tree.map(
        lambda a: a.dtype, params
    )
    assert_trees_close(value, want[2], dtype=low)
    assert_trees_close(grads, want[3], dtype=low, grad=True)
    assert_trees_close(new_params, want[0], dtype=low, grad=True)


def test_mask_bias_keeps_its_add_in_float32_and_saturates_in_a_fill(monkeypatch):
    # The decision, as explain reports it (the attention unrecognised, so the
    # report lists its ops): the add of a bias made from finfo.min runs in
    # float32; where the same bias is a fill's operand, the fill runs in the
    # low dtype with the bias saturated by autocast's own clamp.
    monkeypatch.setattr(attention, "find", lambda *a, **k: {})
    q, k = jax.random.normal(jax.random.key(2), (2, B, HEADS, T, D))
    valid = batch()[2]
    shape = (B, HEADS, T, T)

    def f(q, k, valid):
        scores = q @ k.transpose(0, 1, 3, 2)  # bfloat16 under autocast
        bias = hf_bias(valid, "select_finfo_min")
        added = scores + bias
        filled = jnp.where(valid[:, None, None, :], scores, bias)
        return added, filled

    report = mixprec.explain(f, q, k, valid, policy="mixed_bfloat16")
    (add,) = [op for op in report.find("add") if tuple(op.out_shapes[0]) == shape]
    assert add.decision == "float32" and tuple(add.out_dtypes) == ("float32",), (
        add.reason
    )
    assert "beyond bfloat16's range" in add.reason
    fill = [
        op
        for op in report.find("select_n")
        if tuple(op.out_shapes[0]) == shape and op.in_dtypes[1] == "bfloat16"
    ]
    assert len(fill) == 1 and tuple(fill[0].out_dtypes) == ("bfloat16",), fill
    added, filled = mixprec.autocast(f, "mixed_bfloat16")(q, k, valid)
    assert added.dtype == jnp.float32
    hidden = ~valid[1]  # the keys the bias masks for the padded example
    assert bool(jnp.all(jnp.isfinite(filled)))
    np.testing.assert_array_equal(
        np.asarray(filled[1, :, :, hidden], np.float32),
        np.float32(jnp.finfo(jnp.bfloat16).min),
    )


@pytest.mark.parametrize("recognised", [True, False])
def test_float16_fully_masked_rows_with_very_negative_scores(recognised, monkeypatch):
    # The rows that see no key have scores below -16: a bias saturated to
    # float16's -65504 and added in float16 would overflow to -inf again
    # (-65504 - 17 rounds to -inf) and give NaN. The add runs in float32.
    if not recognised:
        monkeypatch.setattr(attention, "find", lambda *a, **k: {})
    u = jax.random.normal(jax.random.key(3), (1, 1, 1, D))
    k = jnp.broadcast_to(u, (B, HEADS, T, D))
    q = -4.0 * k  # every score is -4|u|^2 / sqrt(D), about -16 or below
    v = jax.random.normal(jax.random.key(4), (B, HEADS, T, D))
    valid = batch()[2]

    def attend(q, k, v, valid):
        scores = q @ k.transpose(0, 1, 3, 2) / np.float32(np.sqrt(D))
        w = jax.nn.softmax(scores + hf_bias(valid, "mul_1e9"), axis=-1)
        return w @ v

    assert float(jnp.max(q[0, 0, 0] @ k[0, 0, 0]) / np.sqrt(D)) < -17.0
    want = attend(q, k, v, valid)
    got = jax.jit(mixprec.autocast(lambda *a: attend(*a), "mixed_float16"))(
        q, k, v, valid
    )
    assert bool(jnp.all(jnp.isfinite(got)))
    assert_trees_close(got, want, dtype=jnp.float16)


# The fused attention's cuda formulation.


def _pin_cuda_attention(monkeypatch):
    monkeypatch.setattr(
        attention_rule,
        "per_platform",
        lambda args, *, platform, default, **overrides: overrides["cuda"](*args),
    )


def _attend_bias(q, k, v, valid):
    # [B, T, N, H] operands, the layout jax.nn.dot_product_attention takes.
    s = jnp.einsum("bthd,bshd->bhts", q, k) / np.float32(np.sqrt(q.shape[-1]))
    w = jax.nn.softmax(s + hf_bias(valid, "select_finfo_min"), axis=-1)
    return jnp.einsum("bhts,bshd->bthd", w, v)


def _qkv(h=64):
    ks = jax.random.split(jax.random.key(5), 3)
    return tuple(jax.random.normal(kk, (B, T, HEADS, h)) for kk in ks)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_fused_cuda_formulation_saturates_the_bias(policy, monkeypatch):
    # The cuda formulation pinned, JAX's XLA implementation standing in for
    # cuDNN on this CPU: the float32 bias reaches the kernel in 16 bits.
    monkeypatch.setattr(attention_rule, "_IMPLEMENTATION", "xla")
    _pin_cuda_attention(monkeypatch)
    calls = []
    real = attention_rule.fused
    monkeypatch.setattr(
        attention_rule, "fused", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    q, k, v = _qkv()
    valid = batch()[2]
    got = jax.jit(mixprec.autocast(lambda *a: _attend_bias(*a), policy))(q, k, v, valid)
    assert calls, "the fused formulation did not run"
    assert bool(jnp.all(jnp.isfinite(got)))
    want = _attend_bias(q, k, v, valid)
    # The kernel takes the bias in 16 bits too: one rounding more than the
    # float16 tolerance allows for (as for any bias in the attention tests).
    err = np.max(np.abs(got - want)) / np.max(np.abs(want))
    assert err <= (1e-2 if policy == "mixed_bfloat16" else 2e-3), err

    # Its backward pass (the kernel's own), in a differentiated loss.
    def loss(fn, q, k, v, valid):
        return jnp.sum(fn(q, k, v, valid).astype(jnp.float32) * v)

    f = mixprec.autocast(lambda *a: _attend_bias(*a), policy)
    g = jax.jit(jax.grad(ft.partial(loss, f), argnums=(0, 1, 2)))(q, k, v, valid)
    g32 = jax.grad(ft.partial(loss, _attend_bias), argnums=(0, 1, 2))(q, k, v, valid)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in g)
    assert_trees_close(g, g32, dtype=POLICIES[policy], grad=True)


def _cuda_text(fn, *args):
    calls = ("__cudnn$fmhaScaleBiasSoftmax", "__cudnn$fmhaScaleBiasSoftmaxBackward")
    calls += ("__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward")
    checks = [jax.export.DisabledSafetyCheck.custom_call(c) for c in calls]
    exp = jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)
    return exp(*args).mlir_module()


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_cuda_export_saturates_the_bias_before_cudnn(policy, monkeypatch):
    monkeypatch.setattr(
        _compat.cudnn_attention_module(), "check_cudnn_version", lambda: 91000
    )
    q, k, v = _qkv()
    valid = batch()[2]
    f = mixprec.autocast(lambda *a: _attend_bias(*a), policy)
    text = _cuda_text(f, q, k, v, valid)
    calls = re.findall(r"custom_call @(__cudnn\$fmha\w+)", text)
    assert calls == ["__cudnn$fmhaScaleBiasSoftmax"], calls
    assert "stablehlo.dot_general" not in text
    # The bias is saturated for the low dtype before its cast:
    # finfo(float32).min would otherwise become -inf.
    assert _clips_to(text, POLICIES[policy]), "no saturation before the kernel"
    # The whole step: the kernel's backward takes the same saturated bias.
    loss = lambda *a: jnp.sum(f(*a).astype(jnp.float32))  # noqa: E731
    bwd = _cuda_text(jax.grad(loss, argnums=(0, 1, 2)), q, k, v, valid)
    calls = set(re.findall(r"custom_call @(__cudnn\$fmha\w+)", bwd))
    assert "__cudnn$fmhaScaleBiasSoftmaxBackward" in calls, calls
    assert _clips_to(bwd, POLICIES[policy])


def _clips_to(text, low):
    """The module saturates a float32 mask bias for ``low``
    (``operands.saturate_mask``): values beyond ``low``'s largest value (a
    float32 constant it is compared with) become half of it (another)."""
    big = float(jnp.finfo(low).max)
    consts = [
        float(c)
        for c in re.findall(
            r"dense<(-?[0-9.]+(?:E[+-]?[0-9]+)?)> : tensor<f32>", text, re.I
        )
    ]
    bound = any(np.isclose(abs(c), big, rtol=1e-6) for c in consts)
    half = any(np.isclose(abs(c), big / 2, rtol=1e-6) for c in consts)
    return bound and half and "stablehlo.select" in text and "stablehlo.compare" in text


# ------------------------------------------------- constants in call bodies


def _beyond(policy):
    """``(scale, constant)``: a constant the low dtype cannot hold (beyond its
    largest value), and a power of two that brings the product back."""
    if policy == "mixed_float16":
        return np.float32(2.0**-14), np.float32(2.0**20)  # 1048576 > 65504
    return np.float32(2.0**-120), np.finfo(np.float32).max  # > bfloat16's max


def _mesh():
    return jax.make_mesh((8,), ("d",), axis_types=(AxisType.Auto,))


def _body_kinds():
    """Each call body around ``core``."""

    def jit(core):
        return jax.jit(core)

    def checkpoint(core):
        return jax.checkpoint(core)

    def custom_jvp(core):
        f = jax.custom_jvp(core)
        f.defjvp(lambda p, t: (f(p[0]), t[0]))
        return f

    def custom_vjp(core):
        f = jax.custom_vjp(core)
        f.defvjp(lambda x: (f(x), None), lambda _, g: (g,))
        return f

    def shard_map(core):
        spec = PartitionSpec("d")
        return jax.shard_map(core, mesh=_mesh(), in_specs=spec, out_specs=spec)

    def closed_call(core):
        # The closed-over arrays become operands, as when JAX rewrites a
        # custom_vjp whose residuals are unused.
        def f(x):
            fn, consts = jax.closure_convert(core, x)
            closed = jax.make_jaxpr(fn)(x, *consts)
            params = P.closed_call_p.get_bind_params({"call_jaxpr": closed})
            return P.closed_call_p.bind(x, *consts, **params)[0]

        return f

    return {
        f.__name__: f
        for f in (jit, checkpoint, custom_jvp, custom_vjp, shard_map, closed_call)
    }


BODIES = _body_kinds()


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("kind", sorted(BODIES))
def test_closed_over_constant_keeps_its_op_float32_in_every_body(kind, policy):
    scale, big = _beyond(policy)
    # Closed over by the body: an array, so it is not a literal.
    c = jnp.full((1, 16), big, jnp.float32)
    w = jax.random.normal(jax.random.key(6), (16, 16))
    x = jax.random.normal(jax.random.key(7), (16, 16))

    def core(x):
        h = x @ w  # 16-bit under autocast; c is broadcast into its consumer
        # (also in a shard_map block: (2, 16) by (1, 16))
        return (h * scale) * c

    f = BODIES[kind](core)
    want = f(x)
    assert bool(jnp.all(jnp.isfinite(want)))
    got = jax.jit(mixprec.autocast(f, policy))(x)
    assert bool(jnp.all(jnp.isfinite(got))), got
    assert_trees_close(got.astype(jnp.float32), want, dtype=POLICIES[policy])


@pytest.mark.parametrize("kind", sorted(BODIES))
def test_closed_over_divisor_in_every_body_float16(kind):
    # `x / C * 1e5` with a closed-over 1e5 array: 0 when C became inf.
    c = jnp.full((1, 16), 1e5, jnp.float32)
    w = jax.random.normal(jax.random.key(8), (16, 16))
    x = jax.random.normal(jax.random.key(9), (16, 16))

    def core(x):
        return (x @ w) / c * np.float32(1e5)

    f = BODIES[kind](core)
    want = f(x)
    got = jax.jit(mixprec.autocast(f, "mixed_float16"))(x)
    assert_trees_close(got.astype(jnp.float32), want, dtype=jnp.float16)


@pytest.mark.parametrize("kind", ["checkpoint", "custom_jvp", "custom_vjp"])
def test_closed_over_constant_in_a_body_under_grad(kind):
    # The body's derivative rules see it too (a whole step differentiates them).
    scale, big = _beyond("mixed_float16")
    c = jnp.full((1, 16), big, jnp.float32)
    w = jax.random.normal(jax.random.key(10), (16, 16))
    x = jax.random.normal(jax.random.key(11), (8, 16))

    def core(x):
        return (x @ w * scale) * c

    f = BODIES[kind](core)

    def loss(x):
        return jnp.sum(f(x) * x)

    want = jax.value_and_grad(loss)(x)
    got = jax.jit(mixprec.autocast(jax.value_and_grad(loss), "mixed_float16"))(x)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(got))
    assert_trees_close(got[0], want[0], dtype=jnp.float16)
    assert_trees_close(got[1], want[1], dtype=jnp.float16, grad=True)


def test_a_large_closed_over_constant_is_known_by_its_range():
    # More elements than autocast folds (its value is not kept): the body
    # still knows its range.
    n = interpreter.FOLD_LIMIT + 16
    c = jnp.full((n,), 2.0**20, jnp.float32)
    w = jax.random.normal(jax.random.key(12), (4, 4))
    x = jax.random.normal(jax.random.key(13), (n, 4))

    @jax.checkpoint
    def f(x):
        return ((x @ w) * np.float32(2.0**-14)) * c[:, None]

    want = f(x)
    got = jax.jit(mixprec.autocast(f, "mixed_float16"))(x)
    assert bool(jnp.all(jnp.isfinite(got)))
    assert_trees_close(got.astype(jnp.float32), want, dtype=jnp.float16)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_sharded_constant_operand_of_shard_map_is_known_by_its_range(policy):
    # The body sees a block of the constant: what it knows is its range.
    scale, big = _beyond(policy)
    c = jnp.full((8, 1), big, jnp.float32)  # a (1, 1) block per device
    w = jax.random.normal(jax.random.key(14), (16, 16))
    x = jax.random.normal(jax.random.key(15), (16, 16))  # (2, 16) blocks
    spec = PartitionSpec("d")

    def f(x):
        def block(x, c):
            return ((x @ w) * scale) * c

        return jax.shard_map(
            block, mesh=_mesh(), in_specs=(spec, spec), out_specs=spec
        )(x, c)

    want = f(x)
    got = jax.jit(mixprec.autocast(f, policy))(x)
    assert bool(jnp.all(jnp.isfinite(got))), got
    assert_trees_close(got.astype(jnp.float32), want, dtype=POLICIES[policy])


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_mask_bias_stacked_per_layer_in_scan_xs(policy):
    # One bias per layer, stacked and scanned over (as scan-over-layers code
    # passes per-layer inputs): a slice of a mask bias is a mask bias, so the
    # add keeps float32 and a fully masked row stays finite.
    valid = batch()[2]
    ks = jax.random.split(jax.random.key(7), 3)
    q, k, v = (jax.random.normal(kk, (B, HEADS, T, D)) for kk in ks)

    def fn(q, k, v, valid):
        bias = hf_bias(valid, "select_finfo_min")  # [B, 1, T, T]
        stacked = jnp.stack([bias, bias])  # [layers, B, 1, T, T]

        def layer(h, b):
            s = jnp.einsum("bhtd,bhsd->bhts", h, k) / np.float32(np.sqrt(D))
            w = jax.nn.softmax(s + b, axis=-1)
            return jnp.einsum("bhts,bhsd->bhtd", w, v), None

        return lax.scan(layer, q, stacked)[0]

    want = fn(q, k, v, valid)
    assert bool(jnp.all(jnp.isfinite(want)))
    got = jax.jit(mixprec.autocast(fn, policy))(q, k, v, valid)
    assert got.dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(got)))
    assert_trees_close(got, want, dtype=POLICIES[policy])
