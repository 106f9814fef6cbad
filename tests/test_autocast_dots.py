"""Tests for the low-precision dot and convolution formulations (autocast/dots.py)."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from mixprec._src.autocast import dots
from mixprec._src.workloads import timing
from tests.helpers import assert_tree_dtypes, assert_trees_close, iter_eqns


BF16 = jnp.dtype(jnp.bfloat16)
F16 = jnp.dtype(jnp.float16)
F32 = jnp.dtype(jnp.float32)
ON_CPU = jax.default_backend() == "cpu"

# name: (lhs shape, rhs shape, dimension_numbers)
DOT_CASES = {
    "matmul": ((16, 24), (24, 32), (((1,), (0,)), ((), ()))),
    "xT_g": ((24, 16), (24, 32), (((0,), (0,)), ((), ()))),
    "g_wT": ((16, 24), (32, 24), (((1,), (1,)), ((), ()))),
    "bmm": ((4, 16, 24), (4, 24, 32), (((2,), (1,)), ((0,), (0,)))),
    "q_kT": ((4, 16, 24), (4, 32, 24), (((2,), (2,)), ((0,), (0,)))),
    "lhs_contract_mid": ((4, 24, 16), (4, 24, 32), (((1,), (1,)), ((0,), (0,)))),
    "lhs_contract_lead": ((24, 4, 16), (4, 24, 32), (((0,), (1,)), ((1,), (0,)))),
    "rhs_batch_mid": ((4, 16, 24), (24, 4, 32), (((2,), (0,)), ((0,), (1,)))),
    "two_contract": ((16, 4, 6), (6, 4, 32), (((1, 2), (1, 0)), ((), ()))),
    "attn_bhtd": ((2, 3, 16, 8), (2, 3, 24, 8), (((3,), (3,)), ((0, 1), (0, 1)))),
    "attn_bthd": ((2, 16, 3, 8), (2, 24, 3, 8), (((3,), (3,)), ((0, 2), (0, 2)))),
    "attn_pv_bthd": ((2, 3, 16, 24), (2, 24, 3, 8), (((3,), (1,)), ((0, 1), (0, 2)))),
    "batch_only": ((8, 16), (8, 16), (((), ()), ((0,), (0,)))),
    "outer": ((16,), (12,), (((), ()), ((), ()))),
    "matvec": ((16, 24), (24,), (((1,), (0,)), ((), ()))),
    "primes": ((13, 17), (13, 11), (((0,), (0,)), ((), ()))),
}


def _inputs(lhs_shape, rhs_shape, dtype=F32, seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    lhs = jax.random.normal(k1, lhs_shape, jnp.float32).astype(dtype)
    rhs = jax.random.normal(k2, rhs_shape, jnp.float32).astype(dtype)
    return lhs, rhs


def _rounded(x, dtype):
    return x.astype(dtype).astype(jnp.float32)


def _dot(lhs, rhs, dn, *, low=BF16, out=F32, **kw):
    return dots.dot_general(
        lhs, rhs, dimension_numbers=dn, low_dtype=low, out_dtype=out, **kw
    )


dot_dtypes = timing.hlo_dot_types  # (lhs, rhs, out) of every dot XLA runs


# --- forward values and dtypes ------------------------------------------------


@pytest.mark.parametrize(
    ("case", "low"),
    [(c, BF16) for c in sorted(DOT_CASES)]
    + [(c, F16) for c in ("matmul", "xT_g", "attn_bthd", "two_contract")],
)
def test_dot_rounds_inputs_and_accumulates_in_float32(case, low):
    lhs_shape, rhs_shape, dn = DOT_CASES[case]
    lhs, rhs = _inputs(lhs_shape, rhs_shape)
    out = jax.jit(lambda a, b: _dot(a, b, dn, low=low))(lhs, rhs)
    assert out.dtype == F32
    # Oracle: a float32 dot of the rounded inputs (float32 accumulation).
    oracle = lax.dot_general(
        _rounded(lhs, low), _rounded(rhs, low), dn, precision=lax.Precision.HIGHEST
    )
    np.testing.assert_allclose(out, oracle, rtol=2e-5, atol=2e-5)
    # And close to the float32 reference within the low dtype's tolerance.
    ref = lax.dot_general(lhs, rhs, dn, precision=lax.Precision.HIGHEST)
    assert_trees_close(out, ref, dtype=low)


@pytest.mark.parametrize("out_dtype", [F32, BF16, F16])
def test_dot_output_dtype(out_dtype):
    lhs, rhs = _inputs((8, 16), (16, 8))
    out = _dot(lhs, rhs, (((1,), (0,)), ((), ())), out=out_dtype)
    assert out.dtype == out_dtype
    assert out.shape == (8, 8)


@pytest.mark.parametrize("in_dtype", [BF16, F16, F32])
def test_dot_accepts_any_floating_input_dtype(in_dtype):
    lhs, rhs = _inputs((8, 16), (16, 8), dtype=in_dtype)
    out = _dot(lhs, rhs, (((1,), (0,)), ((), ())))
    ref = lax.dot_general(
        _rounded(lhs, BF16), _rounded(rhs, BF16), (((1,), (0,)), ((), ()))
    )
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arg", ["low_dtype", "out_dtype"])
def test_dot_rejects_non_floating_dtypes(arg):
    x = jnp.ones((4, 4))
    kw = {"low_dtype": BF16, "out_dtype": F32, arg: jnp.int32}
    with pytest.raises(ValueError, match=rf"`dot_general\(\.\.\., {arg}=\.\.\.\)`"):
        dots.dot_general(
            x,
            x,
            dimension_numbers=(((1,), (0,)), ((), ())),
            low_dtype=kw["low_dtype"],
            out_dtype=kw["out_dtype"],
        )


def test_dot_rejects_integer_operands():
    x = jnp.ones((4, 4), jnp.int32)
    with pytest.raises(TypeError, match=r"`dot_general\(lhs, rhs, \.\.\.\)`"):
        _dot(x, x, (((1,), (0,)), ((), ())))


# --- gradients -----------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(DOT_CASES))
def test_dot_gradients_values_and_dtypes(case):
    lhs_shape, rhs_shape, dn = DOT_CASES[case]
    lhs, rhs = _inputs(lhs_shape, rhs_shape, seed=1)
    w = jax.random.normal(
        jax.random.key(2),
        jax.eval_shape(lambda a, b: lax.dot_general(a, b, dn), lhs, rhs).shape,
    )

    def loss(a, b):
        return jnp.sum(_dot(a, b, dn) * w)

    def ref_loss(a, b):
        return jnp.sum(lax.dot_general(a, b, dn, precision=lax.Precision.HIGHEST) * w)

    grads = jax.jit(jax.grad(loss, (0, 1)))(lhs, rhs)
    ref = jax.grad(ref_loss, (0, 1))(lhs, rhs)
    assert_tree_dtypes(grads, (F32, F32))
    assert_trees_close(grads, ref, dtype=BF16, grad=True)
    # The backward dots take bf16 operands too: the cotangent is rounded to
    # bf16 and multiplied by the bf16 residuals, accumulating in float32.
    g = _rounded(w, BF16)
    oracle = jax.vjp(
        lambda a, b: lax.dot_general(a, b, dn, precision=lax.Precision.HIGHEST),
        _rounded(lhs, BF16),
        _rounded(rhs, BF16),
    )[1](g)
    for got, want in zip(grads, oracle, strict=True):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("in_dtype", [BF16, F16])
def test_dot_gradients_come_back_in_input_dtype(in_dtype):
    lhs, rhs = _inputs((8, 16), (16, 12), dtype=in_dtype)
    dn = (((1,), (0,)), ((), ()))
    grads = jax.grad(lambda a, b: _dot(a, b, dn).sum(), (0, 1))(lhs, rhs)
    assert_tree_dtypes(grads, (in_dtype, in_dtype))


def test_dot_mixed_input_dtypes_gradients():
    lhs, _ = _inputs((8, 16), (16, 12))
    _, rhs = _inputs((8, 16), (16, 12), dtype=BF16)
    dn = (((1,), (0,)), ((), ()))
    grads = jax.grad(lambda a, b: _dot(a, b, dn).sum(), (0, 1))(lhs, rhs)
    assert_tree_dtypes(grads, (F32, BF16))


def test_dot_second_order_gradients():
    lhs, rhs = _inputs((8, 16), (16, 12))
    dn = (((1,), (0,)), ((), ()))

    def f(a):
        return jnp.sum(_dot(a, rhs, dn) ** 2)

    def f_ref(a):
        return jnp.sum(lax.dot_general(a, rhs, dn, precision="highest") ** 2)

    hvp = jax.grad(lambda a: jnp.vdot(jax.grad(f)(a), lhs))(lhs)
    hvp_ref = jax.grad(lambda a: jnp.vdot(jax.grad(f_ref)(a), lhs))(lhs)
    assert hvp.dtype == F32
    assert_trees_close(hvp, hvp_ref, dtype=BF16, grad=True)


# --- forward-mode AD ----------------------------------------------------------


def test_forward_mode_ad_jvp_and_jacfwd():
    lhs, rhs = _inputs((6, 8), (8, 5))
    dn = (((1,), (0,)), ((), ()))
    t_lhs, t_rhs = _inputs((6, 8), (8, 5), seed=3)

    def f(a, b):
        return _dot(a, b, dn, forward_mode_ad=True)

    out, tangent = jax.jvp(f, (lhs, rhs), (t_lhs, t_rhs))
    ref_out, ref_tangent = jax.jvp(
        lambda a, b: lax.dot_general(a, b, dn), (lhs, rhs), (t_lhs, t_rhs)
    )
    assert out.dtype == tangent.dtype == F32
    assert_trees_close((out, tangent), (ref_out, ref_tangent), dtype=BF16)
    jac = jax.jacfwd(f)(lhs, rhs)
    jac_ref = jax.jacfwd(lambda a, b: lax.dot_general(a, b, dn))(lhs, rhs)
    assert jac.shape == (6, 5, 6, 8)
    assert_trees_close(jac, jac_ref, dtype=BF16)
    # Reverse mode still works without the custom_vjp.
    grads = jax.grad(lambda a, b: f(a, b).sum(), (0, 1))(lhs, rhs)
    assert_tree_dtypes(grads, (F32, F32))


@pytest.mark.skipif(not ON_CPU, reason="the custom_vjp formulation is CPU-only")
def test_custom_vjp_formulation_rejects_jvp():
    # Shows that the flag matters: the default CPU formulation is a custom_vjp.
    lhs, rhs = _inputs((6, 8), (8, 5))
    dn = (((1,), (0,)), ((), ()))
    with pytest.raises(TypeError, match="custom_vjp"):
        jax.jvp(lambda a: _dot(a, rhs, dn), (lhs,), (lhs,))


# --- transformations ---------------------------------------------------------


@pytest.mark.parametrize(
    ("case", "in_axes"),
    [
        ("matmul", (0, None)),
        ("xT_g", (None, 1)),
        ("bmm", (1, 0)),
        ("attn_bthd", (0, None)),
        ("lhs_contract_mid", (2, 0)),
    ],
)
def test_dot_vmap_value_and_grad(case, in_axes):
    lhs_shape, rhs_shape, dn = DOT_CASES[case]
    lhs, rhs = _inputs(lhs_shape, rhs_shape)
    batch = 3

    def expand(x, axis):
        if axis is None:
            return x
        return jnp.stack([x * (i + 1) for i in range(batch)], axis=axis)

    args = (expand(lhs, in_axes[0]), expand(rhs, in_axes[1]))
    out_shape = jax.eval_shape(lambda a, b: lax.dot_general(a, b, dn), lhs, rhs).shape
    w = jax.random.normal(jax.random.key(9), out_shape)

    def f(a, b):
        out = _dot(a, b, dn)
        return out, jax.grad(lambda a, b: jnp.sum(_dot(a, b, dn) * w), (0, 1))(a, b)

    def f_ref(a, b):
        def dot(a, b):
            return lax.dot_general(a, b, dn, precision="highest")

        return dot(a, b), jax.grad(lambda a, b: jnp.sum(dot(a, b) * w), (0, 1))(a, b)

    got = jax.jit(jax.vmap(f, in_axes))(*args)
    ref = jax.vmap(f_ref, in_axes)(*args)
    assert_tree_dtypes(got, ref)
    assert_trees_close(got[0], ref[0], dtype=BF16)
    assert_trees_close(got[1], ref[1], dtype=BF16, grad=True)


def _mlp_step(x, w1, w2):
    dn = (((1,), (0,)), ((), ()))
    h = jax.nn.relu(_dot(x, w1, dn))
    return jnp.sum(_dot(h, w2, dn) ** 2)


@pytest.mark.skipif(not ON_CPU, reason="XLA:CPU formulation")
def test_compiled_fwd_bwd_runs_every_dot_in_bf16():
    x, w1 = _inputs((64, 128), (128, 96))
    _, w2 = _inputs((64, 96), (96, 80), seed=4)
    compiled = jax.jit(jax.grad(_mlp_step, (1, 2))).lower(x, w1, w2).compile()
    found = dot_dtypes(compiled.as_text())
    # 2 forward dots, 2 weight-gradient dots, 1 input-gradient dot (x needs none).
    assert len(found) == 5, found
    assert all(d == ("bf16", "bf16", "f32") for d in found), found


@pytest.mark.skipif(not ON_CPU, reason="XLA:CPU formulation")
def test_plain_bf16_weight_gradient_dot_is_upcast_by_xla():
    # The reason for the custom formulation: XLA:CPU runs x^T g in float32.
    x, g = _inputs((64, 128), (64, 96), dtype=BF16)
    compiled = (
        jax.jit(
            lambda a, b: lax.dot_general(
                a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32
            )
        )
        .lower(x, g)
        .compile()
    )
    assert dot_dtypes(compiled.as_text()) == [("f32", "f32", "f32")]


@pytest.mark.skipif(not ON_CPU, reason="XLA:CPU formulation")
def test_autocast_mlp_step_runs_every_dot_in_bf16():
    import mixprec

    x, w1 = _inputs((64, 128), (128, 96))
    _, w2 = _inputs((64, 96), (96, 80), seed=4)

    def loss(params, x):
        w1, w2 = params
        return jnp.mean((jax.nn.relu(x @ w1) @ w2) ** 2)

    step = jax.jit(jax.grad(mixprec.autocast(loss, "mixed_bfloat16")))
    found = dot_dtypes(step.lower((w1, w2), x).compile().as_text())
    assert len(found) == 5, found
    assert all(d == ("bf16", "bf16", "f32") for d in found), found
    grads = step((w1, w2), x)
    ref = jax.grad(loss)((w1, w2), x)
    assert_tree_dtypes(grads, (F32, F32))
    assert_trees_close(grads, ref, dtype=BF16, grad=True)


def test_autocast_transposed_dot_result_values():
    # `(x @ w).T` crashes plain bf16 x bf16 -> f32 dots (see below); under
    # autocast the result is cast to bf16 first, and values and grads hold.
    import mixprec

    x, w = _inputs((16, 24), (24, 32))

    def f(x, w):
        return jnp.sum(jnp.sin((x @ w).T) * jnp.arange(16.0)[None, :])

    got = jax.jit(jax.value_and_grad(mixprec.autocast(f, "mixed_bfloat16"), (0, 1)))(
        x, w
    )
    ref = jax.value_and_grad(f, (0, 1))(x, w)
    assert_tree_dtypes(got, ref)
    assert_trees_close(got[1], ref[1], dtype=BF16, grad=True)


# Layouts that crash plain bf16 x bf16 -> f32 dots in jaxlib 0.10.2 with
# "Unsupported element type for DotThunk::Execute: BF16 x BF16 = F32".
_BUG_CASES = {
    "result_transposed": lambda dot, a, b: dot(a, b, (((1,), (0,)), ((), ()))).T,
    "operand_reshaped_from_transpose": lambda dot, a, b: dot(
        a.T.reshape(24, 2, 8), b.reshape(2, 8, 32), (((1, 2), (0, 1)), ((), ()))
    ),
    "grad_of_transposed_input": lambda dot, a, b: dot(
        (a.T * 2).T, b.T, (((1,), (1,)), ((), ()))
    ),
}


def _plain_f32_out(a, b, dn):
    return lax.dot_general(
        a.astype(BF16), b.astype(BF16), dn, preferred_element_type=jnp.float32
    )


def _ours(a, b, dn):
    return _dot(a, b, dn)


@pytest.mark.skipif(not ON_CPU, reason="XLA:CPU bug")
@pytest.mark.parametrize("case", sorted(_BUG_CASES))
@pytest.mark.parametrize("transform", ["jit", "grad", "vmap"])
def test_dotthunk_bug_workaround(case, transform):
    build = _BUG_CASES[case]
    a, _ = _inputs((24, 16), (1,))
    b = jax.random.normal(jax.random.key(7), (16, 32))

    def run(dot):
        if transform == "jit":
            return jax.jit(lambda a, b: build(dot, a, b))(a, b)
        f = jax.grad(lambda a, b: jnp.sum(jnp.sin(build(dot, a, b))), (0, 1))
        if transform == "vmap":
            return jax.jit(jax.vmap(f, (0, None)))(jnp.stack([a, -a]), b)
        return jax.jit(f)(a, b)

    ref = run(lambda a, b, dn: lax.dot_general(a, b, dn, precision="highest"))
    got = run(_ours)
    assert_tree_dtypes(got, ref)
    assert_trees_close(got, ref, dtype=BF16, grad=transform != "jit")


@pytest.mark.skipif(not ON_CPU, reason="XLA:CPU bug")
def test_dotthunk_bug_still_reproduces_with_plain_jax():
    # A canary: if a jaxlib fixes the bug, this test tells us the workaround's
    # barriers could go. It is not a failure of ours, so it skips.
    a, b = _inputs((16, 24), (24, 32))
    f = jax.jit(lambda a, b: _plain_f32_out(a, b, (((1,), (0,)), ((), ()))).T)
    try:
        jax.block_until_ready(f(a, b))
    except Exception as e:  # noqa: BLE001
        assert "DotThunk" in str(e)
    else:
        pytest.skip("this jaxlib runs transposed bf16 x bf16 -> f32 dots")


def test_explicit_sharding_keeps_jax_formulation():
    devices = jax.devices()
    if len(devices) < 2:
        pytest.skip("needs several devices")
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    mesh = jax.make_mesh((2,), ("data",), axis_types=(AxisType.Explicit,))
    dn = (((2,), (0,)), ((), ()))
    x, w = _inputs((4, 8, 16), (16, 12))
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, PartitionSpec("data")))
        grads = jax.jit(jax.grad(lambda a, b: jnp.sum(_dot(a, b, dn) ** 2), (0, 1)))(
            xs, w
        )
    ref = jax.grad(
        lambda a, b: jnp.sum(lax.dot_general(a, b, dn, precision="highest") ** 2),
        (0, 1),
    )(x, w)
    assert_tree_dtypes(grads, (F32, F32))
    assert_trees_close(grads, ref, dtype=BF16, grad=True)


# --- other backends' formulation (checked structurally on any backend) -------


@pytest.mark.parametrize("out", [BF16, F32])
def test_gpu_formulation_runs_16_bit_gemms(out):
    # The GPU/TPU formulation (pinned here; exported for cuda in the export
    # tests): bf16 operands in every product. A 16-bit result stays 16-bit;
    # a float32 result, and the gradient of a float32 operand (a master
    # weight), leave the GEMM in float32 (accumulated, never rounded).
    lhs, rhs = _inputs((8, 16), (16, 12))
    lhs16 = lhs.astype(BF16)  # an activation that arrives in 16 bits
    dn = (((1,), (0,)), ((), ()))

    def f(a, b):
        return _dot(a, b, dn, out=out, platform="gpu").astype(F32).sum()

    jaxpr = jax.make_jaxpr(jax.grad(f, (0, 1)))(lhs16, rhs)
    dot_eqns = [e for e in iter_eqns(jaxpr, None) if e.primitive.name == "dot_general"]
    assert len(dot_eqns) == 3
    fwd, *bwd = dot_eqns
    assert all(v.aval.dtype == BF16 for e in dot_eqns for v in e.invars)
    assert fwd.outvars[0].aval.dtype == out
    # d(lhs16) in bf16, d(rhs: float32) in float32
    assert sorted(str(e.outvars[0].aval.dtype) for e in bwd) == ["bfloat16", "float32"]
    grads = jax.grad(f, (0, 1))(lhs16, rhs)
    assert [g.dtype for g in grads] == [BF16, F32]
    y = _dot(lhs, rhs, dn, out=out, platform="gpu")
    assert y.dtype == out
    assert_trees_close(y, lhs @ rhs, dtype=BF16)
    # Forward mode works on this formulation with the flag off.
    jax.jvp(
        lambda a: _dot(a, rhs, dn, platform="gpu", forward_mode_ad=True), (lhs,), (lhs,)
    )


# --- convolutions --------------------------------------------------------------

CONV_CASES = {
    "nchw": dict(lhs=(2, 4, 9, 9), rhs=(6, 4, 3, 3), dn=("NCHW", "OIHW", "NCHW")),
    "nhwc": dict(lhs=(2, 9, 9, 4), rhs=(3, 3, 4, 6), dn=("NHWC", "HWIO", "NHWC")),
    "nhwc_strided_dilated": dict(
        lhs=(2, 11, 11, 4),
        rhs=(3, 3, 4, 6),
        dn=("NHWC", "HWIO", "NHWC"),
        strides=(2, 1),
        rhs_dilation=(1, 2),
    ),
    "grouped": dict(
        lhs=(2, 9, 9, 4), rhs=(3, 3, 2, 6), dn=("NHWC", "HWIO", "NHWC"), groups=2
    ),
    "depthwise": dict(
        lhs=(2, 9, 9, 4), rhs=(3, 3, 1, 4), dn=("NHWC", "HWIO", "NHWC"), groups=4
    ),
    "conv1d": dict(lhs=(2, 16, 4), rhs=(5, 4, 6), dn=("NWC", "WIO", "NWC")),
}


def _conv_ref(x, k, c):
    return lax.conv_general_dilated(
        x,
        k,
        window_strides=c.get("strides", (1,) * (x.ndim - 2)),
        padding="SAME",
        rhs_dilation=c.get("rhs_dilation"),
        dimension_numbers=c["dn"],
        feature_group_count=c.get("groups", 1),
        precision=lax.Precision.HIGHEST,
    )


def _conv_params(x, k, c):
    eqn = jax.make_jaxpr(lambda a, b: _conv_ref(a, b, c))(x, k).jaxpr.eqns[0]
    assert eqn.primitive is lax.conv_general_dilated_p
    return dict(eqn.params)


@pytest.mark.parametrize("case", sorted(CONV_CASES))
def test_conv_values_dtypes_and_gradients(case):
    c = CONV_CASES[case]
    x, k = _inputs(c["lhs"], c["rhs"])
    params = _conv_params(x, k, c)

    def f(a, b):
        return dots.conv_general_dilated(a, b, low_dtype=BF16, out_dtype=F32, **params)

    out = jax.jit(f)(x, k)
    assert out.dtype == F32
    oracle = _conv_ref(_rounded(x, BF16), _rounded(k, BF16), c)
    np.testing.assert_allclose(out, oracle, rtol=2e-5, atol=2e-5)
    assert_trees_close(out, _conv_ref(x, k, c), dtype=BF16)

    w = jax.random.normal(jax.random.key(5), out.shape)
    grads = jax.jit(jax.grad(lambda a, b: jnp.sum(f(a, b) * w), (0, 1)))(x, k)
    ref = jax.grad(lambda a, b: jnp.sum(_conv_ref(a, b, c) * w), (0, 1))(x, k)
    assert_tree_dtypes(grads, (F32, F32))
    assert_trees_close(grads, ref, dtype=BF16, grad=True)


def test_conv_output_dtype_jvp_and_vmap():
    c = CONV_CASES["nhwc"]
    x, k = _inputs(c["lhs"], c["rhs"])
    params = _conv_params(x, k, c)

    def f(a, b, out=BF16):
        return dots.conv_general_dilated(
            a, b, low_dtype=BF16, out_dtype=out, forward_mode_ad=True, **params
        )

    assert f(x, k).dtype == BF16
    _, t = jax.jvp(lambda a: f(a, k, F32), (x,), (x,))
    assert_trees_close(t, _conv_ref(x, k, c), dtype=BF16)
    per_example = jax.vmap(lambda a: f(a[None], k, F32)[0])(x)
    assert_trees_close(per_example, _conv_ref(x, k, c), dtype=BF16)


def test_conv_rejects_integer_operands():
    x = jnp.ones((1, 3, 3, 1), jnp.int32)
    with pytest.raises(TypeError, match="`conv_general_dilated"):
        dots.conv_general_dilated(x, x, low_dtype=BF16, out_dtype=F32)


# --- the benchmark script runs (not timed) ------------------------------------


# A subprocess that compiles every variant: minutes on two cores. The default
# run reads the formulations in this module's other tests.
@pytest.mark.long
def test_benchmark_quick_mode_writes_json(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "bench.json"
    env = dict(os.environ, PYTHONPATH=root, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(root, "benchmarks", "bench_autocast.py"),
            "--quick",
            "--no-torch",
            "--no-compile",
            "--variants",
            "float32,dots_bf16,autocast",
            "--repeats",
            "1",
            "--warmup",
            "1",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["config"]["quick"] is True
    rows = data["results"]
    assert {(r["workload"], r["variant"]) for r in rows} >= {
        ("mlp", "float32"),
        ("mlp", "dots_bf16"),
        ("lm", "float32"),
        ("lm", "dots_bf16"),
    }
    for row in rows:
        assert row["median_s"] > 0
        assert row["speedup_vs_float32"] > 0
    memory = {r["variant"]: r for r in data["memory"]}
    assert memory["float32"]["residual_ratio"] == 1.0
    # bf16 residuals: the dots save bf16 copies of their operands.
    assert memory["dots_bf16"]["residual_bytes"] < memory["float32"]["residual_bytes"]
    assert out.with_suffix(".md").read_text().count("|") > 10


# --- a third product: grouped (MoE) matmuls ------------------------------------


def test_ragged_dot_runs_as_a_product():
    # `ragged_dot_general` is in the op table with a Product like dot_general:
    # 16-bit operands with float32 accumulation on CPU, its FLOPs in explain.
    import mixprec

    lhs = jax.random.normal(jax.random.key(0), (64, 32))
    rhs = jax.random.normal(jax.random.key(1), (4, 32, 16))
    groups = jnp.array([10, 20, 30, 4], jnp.int32)

    def loss(a, b, g):
        return jnp.sum(lax.ragged_dot(a, b, g) ** 2)

    mixed = mixprec.autocast(loss, "mixed_bfloat16")
    assert_trees_close(mixed(lhs, rhs, groups), loss(lhs, rhs, groups), dtype=BF16)
    grads = jax.jit(jax.grad(mixed, (0, 1)))(lhs, rhs, groups)
    assert_tree_dtypes(grads, (F32, F32))
    ref = jax.grad(loss, (0, 1))(lhs, rhs, groups)
    assert_trees_close(grads, ref, dtype=BF16, grad=True)
    ragged = [
        e
        for e in iter_eqns(jax.make_jaxpr(mixed)(lhs, rhs, groups))
        if e.primitive.name == "ragged_dot_general"
    ]
    assert [str(v.aval.dtype) for v in ragged[0].invars] == [
        "bfloat16",
        "bfloat16",
        "int32",
    ]
    assert ragged[0].outvars[0].aval.dtype == F32
    report = mixprec.explain(loss, lhs, rhs, groups, policy="mixed_bfloat16")
    (op,) = report.find("ragged_dot_general")
    assert op.decision == "low" and op.flops == 2 * 64 * 16 * 32


def test_every_formulation_takes_one_request():
    # A product's formulations are called like rules,
    # `formulation(request, lhs, rhs, *extra, **params)`: what decide.py
    # decided arrives as one ProductRequest, so a cross-cutting feature is a
    # field of the request, never one more keyword argument of each
    # formulation (which the product rule would then have to decide).
    import inspect

    from mixprec._src.autocast import ops

    products = [s.product for s in ops.all_specs() if s.product is not None]
    assert {s.name for s in ops.all_specs() if s.product is not None} >= {
        "dot_general",
        "conv_general_dilated",
        "ragged_dot_general",
    }
    for product in products:
        for fn in (product.low, product.float8):
            if fn is None:
                continue
            params = list(inspect.signature(fn).parameters.values())
            assert params[0].name == "request", fn
            kinds = {p.kind for p in params[1:]}
            assert inspect.Parameter.KEYWORD_ONLY not in kinds, fn
            assert params[-1].kind is inspect.Parameter.VAR_KEYWORD, fn
