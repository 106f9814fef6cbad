"""The dtype rule on the programs that broke it, and one walk for three clients.

Each test here is a case where a plausible rule damaged a real program: a whole
train step wrapped in autocast, a float32 residual stream, padded attention, a
square under float16, a gradient summed over many rows, an explicit
``precision=HIGHEST``. The last part checks that ``mixprec.explain`` and
``mixprec.diagnose`` report exactly what ``mixprec.autocast`` runs.
"""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (
    BF16,
    F16,
    F32,
    FORMULATION_PRIMITIVES,
    assert_tree_dtypes,
    assert_trees_close,
    iter_eqns,
)
from jax import lax

import mixprec


POLICIES = ["mixed_bfloat16", "mixed_float16"]
LOW = {"mixed_bfloat16": BF16, "mixed_float16": F16}


def _mlp_params(key=0, sizes=(16, 32, 4)):
    keys = jax.random.split(jax.random.key(key), len(sizes) - 1)
    return {
        f"l{i}": {
            "w": jax.random.normal(k, (a, b)) / np.sqrt(a),
            "b": jnp.full((b,), 0.01),
        }
        for i, (k, a, b) in enumerate(zip(keys, sizes[:-1], sizes[1:], strict=True))
    }


def _mlp_loss(params, x, y):
    h = x
    for i in range(len(params)):
        p = params[f"l{i}"]
        h = h @ p["w"] + p["b"][None, :]
        if i < len(params) - 1:
            h = jax.nn.relu(h)
    return optax.softmax_cross_entropy_with_integer_labels(h, y).mean()


X = jax.random.normal(jax.random.key(1), (8, 16))
Y = jnp.arange(8) % 4

OPTIMIZERS = {
    "sgd": lambda: optax.sgd(0.1),
    "momentum": lambda: optax.sgd(0.1, momentum=0.9),
    "adam": lambda: optax.adam(1e-3),
    "adamw_clip": lambda: optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(1e-3, weight_decay=1e-2)
    ),
}


# ------------------------------------------------------ master weights


@pytest.mark.standard_promotion  # optax's bias correction mixes int and float
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_whole_step_updates_master_weights_in_float32(policy, opt_name):
    # Invariant: wrapping the whole step (grad + optimizer update) leaves the
    # update as precise as wrapping only the loss: given the gradients the
    # step computed, params and optimizer state are float32's update.
    opt = OPTIMIZERS[opt_name]()

    def update(params, state, grads):
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    def step(params, state, x, y):
        grads = jax.grad(_mlp_loss)(params, x, y)
        return (*update(params, state, grads), grads)

    params = _mlp_params()
    state = opt.init(params)
    # Every op of the update (after the backward pass) runs on float32 operands.
    ops = mixprec.explain(step, params, state, X, Y, policy=policy).ops
    last_backward = max(op.index for op in ops if op.backward)
    update_ops = [op for op in ops if op.index > last_backward]
    assert update_ops
    for op in update_ops:
        assert not {"bfloat16", "float16"} & set(op.in_dtypes + op.out_dtypes), op

    mixed_step = jax.jit(mixprec.autocast(step, policy))
    reference_update = jax.jit(update)
    for _ in range(3):
        new_params, new_state, grads = mixed_step(params, state, X, Y)
        assert_tree_dtypes(grads, jax.tree.map(lambda a: a.dtype, params))
        want_params, want_state = reference_update(params, state, grads)
        for got, want in zip(
            jax.tree.leaves((new_params, new_state)),
            jax.tree.leaves((want_params, want_state)),
            strict=True,
        ):
            assert got.dtype == want.dtype
            # Bit for bit up to XLA's code generation: the same float32 ops in
            # another fusion may contract a multiply-add differently (an ulp;
            # identical with --xla_backend_optimization_level=0). A rounded
            # update would be off by 2**-9 of the leaf's scale.
            assert_trees_close(got, want, dtype=F32)
        params, state = new_params, new_state
    # The gradients themselves agree with autocasting only the loss.
    loss_only = jax.grad(mixprec.autocast(_mlp_loss, policy))(params, X, Y)
    _, _, grads = mixed_step(params, state, X, Y)
    assert_trees_close(grads, loss_only, dtype=LOW[policy], grad=True)


@pytest.mark.parametrize("policy", POLICIES)
def test_sgd_from_scratch_keeps_small_updates(policy):
    # w - lr * g with lr * g far below bf16's resolution of w: a rounded update
    # would leave w unchanged.
    def step(w, x):
        g = jax.grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)
        return jax.tree.map(lambda p, d: p - 1e-4 * d, w, g)

    w = jnp.full((16, 4), 3.0)
    new = mixprec.autocast(step, policy)(w, X)
    assert new.dtype == F32
    assert bool(jnp.any(new != w))
    assert_trees_close(new - w, step(w, X) - w, dtype=LOW[policy], grad=True)


@pytest.mark.parametrize("policy", POLICIES)
def test_float32_residual_stream_argument_is_not_rounded(policy):
    def block(x, w):
        return x + 0.02 * jnp.tanh(x @ w)

    x = 20.0 + jax.random.normal(jax.random.key(0), (4, 16))
    w = jax.random.normal(jax.random.key(1), (16, 16))
    update = mixprec.autocast(block, policy)(x, w) - x
    # The branch runs in 16 bits (0.02 rounds to 0.0200195 in bfloat16); the
    # sum with the stream in float32.
    assert float(jnp.max(jnp.abs(update))) <= 0.02 * (1 + 2**-7)
    # The branch's dot rounds x (about 20) to 16 bits: bfloat16-sized error.
    assert_trees_close(update, block(x, w) - x, dtype=BF16, grad=True)
    add = mixprec.explain(block, x, w, policy=policy).find("add")
    assert add[-1].in_dtypes == ("float32", "float32")


# --------------------------------------------------------- constants


@pytest.mark.parametrize("policy", POLICIES)
def test_padded_attention_has_no_nans(policy):
    nn = pytest.importorskip("flax.linen")
    q = jax.random.normal(jax.random.key(0), (2, 6, 2, 8))
    # The last two query rows see no key: flax fills with finfo(float32).min.
    mask = jnp.ones((2, 1, 6, 6), bool).at[:, :, 4:, :].set(False)

    def flax_attention(q):
        return nn.dot_product_attention(q, q, q, mask=mask)

    def jax_attention(q):
        return jax.nn.dot_product_attention(q, q, q, mask=mask)

    for fn in (flax_attention, jax_attention):
        out = mixprec.autocast(fn, policy)(q)
        assert out.dtype == F32
        assert bool(jnp.all(jnp.isfinite(out))), fn.__name__
        assert_trees_close(out, fn(q), dtype=LOW[policy], grad=True)
        g = jax.grad(lambda q, fn=fn: mixprec.autocast(fn, policy)(q).sum())(q)
        assert bool(jnp.all(jnp.isfinite(g))), fn.__name__


@pytest.mark.parametrize("policy", POLICIES)
def test_constants_saturate_when_cast_down(policy):
    big = float(jnp.finfo(jnp.float32).min)

    def f(x, w):
        h = x @ w
        return jnp.where(h > 0, h, big) * 1.0

    out = mixprec.autocast(f, policy)(X, jnp.eye(16))
    low_min = float(jnp.finfo(LOW[policy]).min)
    assert bool(jnp.all(jnp.isfinite(out)))
    assert float(out.min()) == low_min


_BIG = np.full((16,), 2e5, np.float32)  # closed over, as NumPy


def _computed_big():
    return jnp.float32(300.0) * 400.0  # 1.2e5, computed while tracing


_OUT_OF_RANGE = {
    "div_literal": lambda x, w: (x @ w) / 1e5,
    "mul_literal": lambda x, w: (x @ w) * 7e4,
    "div_numpy_array": lambda x, w: (x @ w) / _BIG[None, :],
    "add_after_tanh": lambda x, w: jnp.tanh(x @ w) + 1e6,
    "div_jnp_float32": lambda x, w: (x @ w) / jnp.float32(1e5),
    "div_computed": lambda x, w: (x @ w) / _computed_big(),
    "dot_operand": lambda x, w: (x @ w) @ (jnp.eye(16) * 1e5),
    "mul_tiny": lambda x, w: (x @ w) * 1e-9 * 1e9,
}


@pytest.mark.parametrize("form", sorted(_OUT_OF_RANGE))
def test_a_constant_the_low_dtype_cannot_hold_keeps_its_op_in_float32(form):
    """A constant beyond float16's largest value, or so small it would become 0,
    keeps the op using it in float32 (outside a fill op such as ``where``,
    whose constant saturates): the result matches float32, and an overflow
    stays visible as inf, never a finite 65504."""
    f = _OUT_OF_RANGE[form]
    x = jax.random.normal(jax.random.key(9), (8, 16))
    w = jax.random.normal(jax.random.key(10), (16, 16)) / 4
    ref = f(x, w)
    got = mixprec.autocast(f, "mixed_float16")(x, w)
    assert got.dtype == F32
    assert bool(jnp.all(jnp.isfinite(got))), form
    assert_trees_close(got, ref, dtype=F16)
    # explain and diagnose say the same and flag no problem.
    report = mixprec.explain(f, x, w, policy="mixed_float16")
    assert any("does not fit" in op.reason for op in report.ops), form
    diag = mixprec.diagnose(f, x, w, policy="mixed_float16")
    assert not diag.problems, [str(p) for p in diag.problems]
    # An overflow of the op itself is inf, as in float32.
    huge = lambda x, w: (x @ w) * 1e38  # noqa: E731
    out = mixprec.autocast(huge, "mixed_float16")(x * 100.0, w)
    assert bool(jnp.any(jnp.isinf(out))) and bool(jnp.isinf(huge(x * 100.0, w)).any())
    assert not bool(jnp.any(jnp.abs(out) == float(jnp.finfo(F16).max)))


def test_constants_that_fit_stay_in_the_low_dtype():
    f = lambda x, w: (x @ w) / 1e3 + 60000.0  # noqa: E731
    report = mixprec.explain(f, X, jnp.eye(16), policy="mixed_float16")
    assert [op.out_dtypes for op in report.ops if op.primitive in ("div", "add")] == [
        ("float16",),
        ("float16",),
    ]


# ---------------------------------------------------------- float16 range


@pytest.mark.parametrize(
    "square",
    [jnp.square, lambda h: h * h, lambda h: h**2, lambda h: lax.integer_pow(h, 2)],
)
def test_squares_do_not_overflow_float16(square):
    def f(x, w):
        return jnp.sum(square(x @ w))

    x = jnp.full((4, 8), 300.0)
    got = mixprec.autocast(f, "mixed_float16")(x, jnp.eye(8))
    assert got == f(x, jnp.eye(8)) == 32 * 300.0**2

    def variance(x, w):
        h = x @ w
        d = h - jnp.mean(h, axis=0, keepdims=True)
        return jnp.mean(d * d)

    x = jnp.stack([jnp.full(8, 300.0), jnp.full(8, -300.0)])
    assert mixprec.autocast(variance, "mixed_float16")(x, jnp.eye(8)) == 300.0**2


_REPEATED = {
    "dot": lambda x, w: (x @ w) * (x @ w),
    "scaled_dot": lambda x, w: (x @ w * 2.0) * (x @ w * 2.0),
    "einsum": lambda x, w: (
        jnp.einsum("ij,jk->ik", x, w) * jnp.einsum("ij,jk->ik", x, w)
    ),
    "layer": lambda x, w: jnp.maximum(x @ w + 1.0, 0.0) * jnp.maximum(x @ w + 1.0, 0.0),
}


@pytest.mark.parametrize("form", sorted(_REPEATED))
def test_a_value_computed_twice_is_squared_in_float32(form):
    """``mul`` of two operands computed by structurally identical equations (the
    same primitive, params and operands: JAX does not merge them) is a value
    times itself: a square, in float32 under float16, like ``h * h``."""
    f = _REPEATED[form]
    x = jnp.full((4, 8), 150.0)
    w = jnp.eye(8)
    ref = f(x, w)
    got = mixprec.autocast(f, "mixed_float16")(x, w)
    assert got.dtype == F32
    assert bool(jnp.all(jnp.isfinite(got))), form
    assert_trees_close(got, ref, dtype=F16)
    [mul] = [
        op
        for op in mixprec.explain(f, x, w, policy="mixed_float16").ops
        if op.primitive == "mul" and op.decision == "float32"
    ][-1:]
    assert "by itself" in mul.reason
    # Two different products are not a square: the mul stays in float16.
    other = mixprec.explain(
        lambda x, w: (x @ w) * (x @ (w * 2.0)), x, w, policy="mixed_float16"
    )
    assert other.find("mul")[-1].out_dtypes == ("float16",)


def test_squares_under_bfloat16_stay_low():
    report = mixprec.explain(lambda x: jnp.square(x @ x.T), X, policy="mixed_bfloat16")
    assert report.find("square")[0].out_dtypes == ("bfloat16",)


# ------------------------------------------------ statistics into loop bodies


def _rows_with_zero_variance():
    # Half the rows constant (variance exactly 0), half spread.
    spread = jax.random.normal(jax.random.key(5), (4, 16)) * 3.0
    return jnp.concatenate([jnp.full((4, 16), 7.0), spread])


def _normalize(h, mean, var):
    # eps below float16's range: (h - mean) must be exactly 0 for the
    # constant rows, so that 0 * rsqrt(1e-12) = 0, not 0 * inf.
    return (h @ jnp.eye(16) - mean) * lax.rsqrt(var + 1e-12)


def _stats(h):
    return h.mean(-1, keepdims=True), h.var(-1, keepdims=True)


_normalize_jvp = jax.custom_jvp(_normalize)
_normalize_jvp.defjvps(None, None, None)  # the value is what is checked


_STAT_CARRIERS = {
    "scan_xs": lambda h: lax.scan(
        lambda c, xs: (c, _normalize(*xs)), 0.0, (h, *_stats(h))
    )[1],
    "map": lambda h: lax.map(lambda xs: _normalize(*xs), (h, *_stats(h))),
    "cond": lambda h: lax.cond(True, _normalize, lambda *a: a[0], h, *_stats(h)),
    "custom_jvp": lambda h: _normalize_jvp(h, *_stats(h)),
    "inline": lambda h: _normalize(h, *_stats(h)),
}


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("carrier", sorted(_STAT_CARRIERS))
def test_a_statistic_keeps_its_role_inside_loop_bodies(carrier, policy):
    """A mean or variance computed outside a body and passed in (scan ``xs``,
    ``lax.map``, a ``cond`` operand, a ``custom_jvp`` argument) anchors the
    body's norm in float32 as it does inline: zero-variance rows give 0 as in
    float32, not NaN."""
    fn = _STAT_CARRIERS[carrier]
    h = _rows_with_zero_variance()
    ref = fn(h)
    got = mixprec.autocast(fn, policy)(h)
    assert got.dtype == F32
    assert bool(jnp.all(jnp.isfinite(got))), carrier
    np.testing.assert_array_equal(got[:4], 0.0)
    assert_trees_close(got, ref, dtype=LOW[policy])
    # The subtraction and the rsqrt ran in float32 where they ran.
    for op in mixprec.explain(fn, h, policy=policy).ops:
        if op.primitive in ("sub", "rsqrt", "mul"):
            assert op.out_dtypes == ("float32",), (op.primitive, op.path, op.reason)


# ------------------------------------------------------------ windowed sums


def _avg_pool(x, window):
    win = (1, window, window, 1)
    return lax.reduce_window(x, 0.0, lax.add, win, win, "VALID") / window**2


def _flax_avg_pool(x, window):
    nn = pytest.importorskip("flax.linen")
    with jax.numpy_dtype_promotion("standard"):  # flax divides by an int
        return nn.avg_pool(x, (window, window))


def _windowed_sum(x, window):
    # A reduce_window with a non-zero init: JAX keeps the generic primitive.
    win = (1, window, window, 1)
    return lax.reduce_window(x, 1.0, lax.add, win, win, "VALID") - 1.0


_POOLS = {"lax": _avg_pool, "flax": _flax_avg_pool, "generic": _windowed_sum}


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("window", [2, 16, 32])
@pytest.mark.parametrize("pool", sorted(_POOLS))
def test_windowed_sums_accumulate_in_float32_whatever_the_window(pool, window, policy):
    """A windowed sum (average pooling) accumulates in float32 like every
    other reduction: a global pool matches float32 within the low dtype's
    tolerance, and a window of values near 400 does not overflow float16.

    The values tell only for long windows (16x16, 32x32): a 2x2 window's four
    terms sum within tolerance in 16 bits too, so there the sum's dtype is
    what shows it runs in float32. ``generic`` is a reduce_window JAX keeps as
    a higher-order primitive (its body an ``add``): no op-table rule of its
    own, it keeps its traced float32 types at its boundary, which every window
    checks."""
    pool_fn = _POOLS[pool]

    def f(x, w):
        return pool_fn(jnp.einsum("nhwc,cd->nhwd", x, w), window)

    w = jnp.eye(4)
    with jax.numpy_dtype_promotion("standard" if pool == "flax" else "strict"):
        ops = mixprec.explain(f, jnp.ones((1, 32, 32, 4)), w, policy=policy).ops
    sums = [
        op
        for op in ops
        if op.primitive == "reduce_window_sum" or "reduce_window" in op.path
    ]
    assert len(sums) == 1 and sums[0].out_dtypes == ("float32",), ops
    for x in (
        jax.random.uniform(jax.random.key(6), (2, 32, 32, 4)),
        400.0 + jax.random.uniform(jax.random.key(7), (1, 32, 32, 4)),
    ):
        ref = f(x, w)
        got = mixprec.autocast(f, policy)(x, w)
        assert got.dtype == F32
        assert bool(jnp.all(jnp.isfinite(got)))
        assert_trees_close(got, ref, dtype=LOW[policy])
    if pool == "generic":
        return  # JAX has no reverse mode for a generic reduce_window
    # The gradient (a pad and a windowed sum of the cotangent) too.
    x = 400.0 + jax.random.uniform(jax.random.key(8), (1, 32, 32, 4))
    grads = jax.grad(lambda x, w: jnp.sum(f(x, w) ** 2), argnums=(0, 1))
    got = mixprec.autocast(grads, policy)(x, w)
    assert_tree_dtypes(got, (F32, F32))
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in got)
    assert_trees_close(got, grads(x, w), dtype=LOW[policy], grad=True)


# ------------------------------------------------------ broadcast gradients


@pytest.mark.parametrize("policy", POLICIES)
def test_gradient_of_a_broadcast_parameter_sums_in_float32(policy):
    n = 65539
    x = jnp.full((n, 16), 0.5)

    def loss(b, x):
        return jnp.mean(jnp.tanh(x @ jnp.eye(16)) + b[None, :])

    g = jax.grad(mixprec.autocast(loss, policy))(jnp.zeros(16), x)
    assert g.dtype == F32
    np.testing.assert_allclose(g, np.full(16, 1 / 16), rtol=8e-3)
    # Wrapped with the gradient inside: the reduce_sum is in the jaxpr itself.
    g = mixprec.autocast(jax.grad(loss), policy)(jnp.zeros(16), x)
    np.testing.assert_allclose(g, np.full(16, 1 / 16), rtol=8e-3)


# ----------------------------------------------------------- no silent overrides


def test_precision_highest_keeps_a_dot_float32():
    w = jnp.full((16, 4), 1.001)

    def f(x, w):
        return jnp.dot(x, w, precision=lax.Precision.HIGHEST)

    report = mixprec.explain(f, X, w, policy="mixed_bfloat16")
    [dot] = report.find("dot_general")
    assert dot.decision == "float32" and "HIGHEST" in dot.reason
    np.testing.assert_array_equal(mixprec.autocast(f, "mixed_bfloat16")(X, w), f(X, w))
    with jax.default_matmul_precision("highest"):
        [dot] = mixprec.explain(lambda x, w: x @ w, X, w, policy="mixed_bfloat16").find(
            "dot_general"
        )
    assert dot.decision == "float32"


@pytest.mark.parametrize("bad", ["no", 1, None])
def test_strict_must_be_a_bool(bad):
    with pytest.raises(TypeError, match=r"`autocast\(\.\.\., strict=\.\.\.\)`"):
        mixprec.autocast(jnp.sin, "mixed_bfloat16", strict=bad)


def test_float64_runs_as_written_and_explain_says_so():
    with jax.enable_x64(True):
        x = jnp.ones((4, 4), jnp.float64)
        report = mixprec.explain(lambda x: x @ x, x, policy="mixed_bfloat16")
        [dot] = report.find("dot_general")
        assert dot.decision == "original" and dot.out_dtypes == ("float64",)
        assert "float64" in dot.reason
        jaxpr = jax.make_jaxpr(mixprec.autocast(lambda x: x @ x, "mixed_bfloat16"))(x)
        assert [str(v.aval.dtype) for v in jaxpr.eqns[0].invars] == ["float64"] * 2


# ---------------------------------------------------------------- crashes


def test_vmap_of_a_while_loop_with_a_batched_predicate():
    def f(x):
        def body(c):
            return c[0] + (c[1] @ jnp.eye(2)).sum(), c[1]

        return lax.while_loop(lambda c: c[0].sum() < 10, body, (x, jnp.ones((2, 2))))[0]

    xs = jnp.arange(6.0).reshape(3, 2)
    got = jax.vmap(mixprec.autocast(f, "mixed_bfloat16"))(xs)
    np.testing.assert_array_equal(got, jax.vmap(f)(xs))


def test_export_with_a_symbolic_batch_dimension():
    from jax import export

    f = mixprec.autocast(lambda x, w: jnp.tanh(x @ w), "mixed_bfloat16")
    (b,) = export.symbolic_shape("b")
    exported = export.export(jax.jit(f))(
        jax.ShapeDtypeStruct((b, 16), jnp.float32),
        jax.ShapeDtypeStruct((16, 4), jnp.float32),
    )
    w = jnp.ones((16, 4)) / 16
    for n in (3, 8):
        x = jnp.ones((n, 16))
        assert_trees_close(exported.call(x, w), jnp.tanh(x @ w), dtype=BF16)


def test_default_mode_jvp_and_jacfwd():
    f = mixprec.autocast(lambda x: jnp.tanh(x @ x.T).sum(), "mixed_bfloat16")
    y, t = jax.jvp(f, (X,), (jnp.ones_like(X),))
    assert t.dtype == F32
    assert_trees_close(jax.jacfwd(f)(X), jax.grad(f)(X), dtype=BF16, grad=True)


# --------------------------------------------- one walk: explain, diagnose, autocast


def _programs():
    k = jax.random.split(jax.random.key(3), 4)
    w = jax.random.normal(k[0], (16, 16)) / 4
    x = jax.random.normal(k[1], (4, 16))
    b = jnp.full((16,), 0.1)

    def mlp(w, b, x):
        return jax.nn.log_softmax(jax.nn.gelu(x @ w + b[None, :]) @ w.T)

    def residual(w, b, x):
        h = x * 10.0
        for _ in range(3):
            h = h + jnp.tanh(h @ w + b[None, :])
        return jnp.mean(h * h)

    def scan_rnn(w, b, x):
        def cell(h, xi):
            h = jnp.tanh(h @ w + xi + b)
            return h, h.sum()

        return lax.scan(cell, jnp.zeros(16), x)

    def while_sum(w, b, x):
        def body(c):
            i, acc = c
            return i + 1, acc + jnp.exp(x[i] @ w) + b

        return lax.while_loop(lambda c: c[0] < 3, body, (0, jnp.zeros(16)))[1]

    def branches(w, b, x):
        return lax.cond(
            x.sum() > 0, lambda v: v @ w + b[None, :], lambda v: jnp.sin(v), x
        )

    def nested(w, b, x):
        layer = jax.jit(lambda h: jax.nn.relu(h @ w + b[None, :]))
        return jax.checkpoint(lambda h: layer(layer(h)))(x)

    def train_step(w, b, x):
        def loss(w, b):
            return jnp.var(jnp.tanh(x @ w + b[None, :]))

        gw, gb = jax.grad(loss, argnums=(0, 1))(w, b)
        return w - 0.1 * gw, b - 0.1 * gb

    def avg_pool(w, b, x):
        h = jnp.tanh(x @ w + b[None, :]).reshape(1, 4, 16, 1) * 400.0
        return lax.reduce_window(h, 0.0, lax.add, (1, 4, 16, 1), (1, 1, 1, 1), "VALID")

    def scan_xs_stats(w, b, x):
        mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)

        def body(c, xs):
            h, m, v = xs
            return c, (h @ w - m) * lax.rsqrt(v + 1e-12)

        return lax.scan(body, 0.0, (x, mean, var))[1]

    def big_constants(w, b, x):
        h = x @ w
        return jnp.tanh(h) + 1e6, h / 1e5, h * 7e4

    def repeated_dots(w, b, x):
        return jnp.sum((x @ w * 100.0) * (x @ w * 100.0))

    def mask_fill(w, b, x):
        # jnp.where is a nested jit: its fill arrives as a literal operand.
        keep = jnp.arange(16)[None, :] < 12
        logits = jnp.where(keep, x @ w + b[None, :], jnp.finfo(jnp.float32).min)
        return jax.nn.softmax(logits)

    def constant_dot(w, b, x):
        return jnp.tanh(x @ w) @ _PROJECTION

    def big_fill(w, b, x):
        # A fill too large to fold while walking: saturated by a clamp.
        h = jnp.tile(x @ w + b[None, :], (1, _BIG_FILL.shape[1] // 16))
        return jnp.max(jnp.where(h > 0, h, _BIG_FILL), axis=-1)

    args = (w, b, x)
    return {
        f.__name__: (f, args)
        for f in (
            mlp,
            residual,
            scan_rnn,
            while_sum,
            branches,
            nested,
            train_step,
            avg_pool,
            scan_xs_stats,
            big_constants,
            repeated_dots,
            mask_fill,
            constant_dot,
            big_fill,
        )
    }


# Closed over as NumPy, as user code does: a fixed projection, and a fill too
# large for the walk to fold (FOLD_LIMIT elements), with a -1e9 mask value.
_PROJECTION = np.linspace(-1.0, 1.0, 16 * 16, dtype=np.float32).reshape(16, 16)
_BIG_FILL = np.full((1, 16 * 4200), -1e9, np.float32)


# Primitives the dot formulations and the casts add to the jaxpr by
# themselves, and the higher-order ones whose bodies are matched on their own;
# every other primitive's dtypes must match the records.
_FORMULATION = FORMULATION_PRIMITIVES | {
    "jit",
    "pjit",
    "checkpoint",
    "remat2",
    "scan",
    "while",
    "custom_jvp_call",
}


def _all_eqns(jaxpr):
    return [
        (
            e.primitive.name,
            tuple(str(v.aval.dtype) for v in e.invars),
            tuple(str(v.aval.dtype) for v in e.outvars),
        )
        for e in iter_eqns(jaxpr)
    ]


def _jaxpr_signatures(jaxpr):
    sig = collections.Counter()
    for e in iter_eqns(jaxpr):
        if e.primitive.name in _FORMULATION:
            continue
        sig[(e.primitive.name, tuple(str(v.aval.dtype) for v in e.invars))] += 1
    return sig


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", sorted(_programs()))
def test_explain_and_diagnose_report_what_autocast_runs(name, policy):
    fn, args = _programs()[name]
    report = mixprec.explain(fn, *args, policy=policy)
    # The report's jaxpr is the one autocast runs (equation for equation; a
    # nested jit body autocast caches is shared where explain's is not).
    staged = jax.make_jaxpr(mixprec.autocast(fn, policy))(*args)
    assert _all_eqns(report.jaxpr) == _all_eqns(staged)
    # Every recorded op, with the dtypes it ran in, is in that jaxpr.
    recorded = collections.Counter(
        (op.primitive, op.in_dtypes)
        for op in report.ops
        if op.primitive not in _FORMULATION
    )
    assert recorded == _jaxpr_signatures(staged), name
    # diagnose walks the same decisions on concrete values (loops stepped).
    diag = mixprec.diagnose(fn, *args, policy=policy)
    explained = {
        (op.primitive, op.path, op.backward, op.in_dtypes, op.out_dtypes, op.decision)
        for op in report.ops
    }
    diagnosed = {
        (op.primitive, op.path, op.backward, op.in_dtypes, op.out_dtypes, op.decision)
        for op in diag.ops
    }
    # A branch that does not run is walked only by explain.
    assert diagnosed <= explained, diagnosed - explained
    assert all("cond/" in op[1] for op in explained - diagnosed), explained - diagnosed
