"""Tests for `mixprec.optax.compact_state`: compact weights and optimizer state."""

import collections
import re
import warnings
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_tree_dtypes
from jax.sharding import NamedSharding, PartitionSpec as P

import mixprec
import mixprec.optax as mpo
import mixprec.orbax as mpk
from mixprec._src.compact import bits, codes, state as compact_state_lib
from mixprec._src.compact.optimizer import state_bytes_per_param


BF16 = "p=bf16,c=bf16,o=f32"
# optax's Adam raises a float to an int32 count: it needs standard promotion.
adam_promotion = pytest.mark.standard_promotion
TIERS = [
    (w, m)
    for w in ("float32", "bfloat16-exact", "bfloat16-sr")
    for m in ("float32", "bfloat16-sr", "int8", "float8")
]


def _policy(weights):
    return "p=f32" if weights == "float32" else BF16


def _opt(weights="bfloat16-sr", moments="int8", inner=None, **kw):
    inner = inner or optax.adamw(1e-2, b2=0.95, weight_decay=0.1)
    return mpo.compact_state(
        inner, weights=weights, moments=moments, policy=_policy(weights), **kw
    )


def _params32(key=0):
    k1, k2 = jax.random.split(jax.random.key(key))
    return {
        "w": jax.random.normal(k1, (16, 256)) * 0.05,
        "b": jax.random.normal(k2, (256,)) * 0.05,
    }


def _grads(i, like):
    keys = jax.random.split(jax.random.key(1000 + i), len(like))
    return {
        k: (jax.random.normal(kk, v.shape) * 0.1).astype(jnp.bfloat16)
        for kk, (k, v) in zip(keys, sorted(like.items()), strict=True)
    }


# ------------------------------------------------------------------ rounding


def test_stochastic_rounding_is_unbiased():
    n = 1_000_000
    x = jax.random.uniform(jax.random.key(0), (n,), minval=1.0, maxval=2.0)
    r = bits.round_bfloat16_stochastic(
        x, bits.random_bits(bits.global_index((n,)), jnp.int32(3), 7)
    )
    assert r.dtype == jnp.bfloat16
    ulp = 2.0**-7  # bfloat16's spacing in [1, 2)
    err = (np.asarray(r, np.float64) - np.asarray(x, np.float64)) / ulp
    assert abs(err.mean()) < 0.01
    assert np.all(np.abs(err) < 1)  # one of the two neighbours
    # A fixed value a quarter ulp above a bfloat16 value: rounding to nearest
    # is 0.25 ulp off on every draw; stochastic rounding is not, on average.
    q = jnp.full((n,), 1 + 2**-9, jnp.float32)
    rq = bits.round_bfloat16_stochastic(
        q, bits.random_bits(bits.global_index((n,)), jnp.int32(0), 1)
    )
    mean_q = float(np.mean(np.asarray(rq, np.float64)) - (1 + 2**-9)) / ulp
    assert abs(mean_q) < 0.01
    assert float(q[0].astype(jnp.bfloat16)) == 1.0  # nearest loses it


@pytest.mark.parametrize("tier", ["int8", "float8", "bfloat16-sr"])
def test_moment_codes_are_unbiased_and_close(tier):
    n = 256 * 512
    x = jax.random.normal(jax.random.key(1), (512, 256)) * 1e-3
    sq = jnp.square(x)  # a second moment: non-negative blocks
    for v in (x, sq):
        draws = []
        for step in range(8):
            rnd = bits.random_bits(bits.global_index(v.shape), jnp.int32(step), 5)
            c = codes.encode(v, tier, rnd, block=256)
            draws.append(codes.decode(c))
            assert codes.decode(c).dtype == jnp.float32
        mean = np.mean(np.asarray(jnp.stack(draws), np.float64), axis=0)
        ref = np.asarray(v, np.float64)
        # Unbiased: the mean error over all elements and draws is tiny next to
        # the typical size of an element.
        rel_bias = abs((mean - ref).sum()) / np.abs(ref).sum()
        assert rel_bias < 2e-3, rel_bias
        single = np.asarray(draws[0], np.float64)
        assert np.sum(np.abs(single - ref)) / np.abs(ref).sum() < 0.1
    assert n == x.size


def _grid(tier, unsigned):
    """(smallest normal, spacing below it, mantissa bits, square root?) of a
    code, in its own units: int8 is a 3-bit-mantissa float of ``x / absmax``
    (exponents down to 2**-14, or 2**-30 for a non-negative block), with only 0
    below; float8 is e4m3 of ``x / absmax * 448``, of its square root for a
    non-negative block, with subnormals 2**-9 apart."""
    if tier == "int8":
        normal = 2.0**-30 if unsigned else 2.0**-14
        return normal, normal, 3, False
    return 2.0**-6, 2.0**-9, 3, unsigned


def _grid_spacing(t, tier, unsigned):
    """The spacing of a code's grid at ``t`` (in the code's own units)."""
    normal, below, bits_m, _ = _grid(tier, unsigned)
    t = np.asarray(t, np.float64)
    e = np.floor(np.log2(np.maximum(t, normal)))
    return np.where(t >= normal, 2.0 ** (e - bits_m), below)


@pytest.mark.parametrize("tier", ["int8", "float8"])
def test_each_code_stores_a_grid_neighbour_without_bias(tier):
    # Three blocks per row: signed (a first moment), non-negative (a second
    # moment) and all zeros; every row holds the same values and draws its own
    # random bits, so the mean over rows is each element's expected value.
    draws, block = 1024, 128
    rng = np.random.default_rng(0)
    y_signed = 2.0 ** rng.uniform(-16, 0, block) * rng.choice([-1.0, 1.0], block)
    y_signed[:3] = [1.0, 0.0, -(2.0**-15)]
    y_nonneg = 2.0 ** rng.uniform(-32, 0, block)
    y_nonneg[:2] = [1.0, 0.0]
    absmax = np.float32([0.3, 1e-6, 0.0])
    row = np.concatenate(
        [y_signed * absmax[0], y_nonneg * absmax[1], np.zeros(block)]
    ).astype(np.float32)
    x = jnp.asarray(np.broadcast_to(row, (draws, 3 * block)))
    rnd = bits.random_bits(bits.global_index(x.shape), jnp.int32(7), 11)
    c = codes.encode(x, tier, rnd, block=block)
    dec = codes.decode(c)
    assert c.scale is not None and dec.dtype == jnp.float32
    scale = np.asarray(c.scale)
    np.testing.assert_array_equal(np.abs(scale), np.broadcast_to(absmax, (draws, 3)))
    # The sign of the scale says which code a block uses: the unsigned (int8)
    # or square-root (float8) one for the non-negative block only.
    assert np.all(scale[:, 1] < 0) and np.all(scale[:, 0] > 0)
    assert not np.any(scale[:, 2] < 0)
    dec = np.asarray(dec, np.float64)
    assert np.all(dec[:, 2 * block :] == 0)

    k = np.float32(448.0 if tier == "float8" else 1.0)
    for j, unsigned in ((0, False), (1, True)):
        normal, below, _, rooted = _grid(tier, unsigned)
        xs = row[j * block : (j + 1) * block]
        d = dec[:, j * block : (j + 1) * block]
        a = np.float32(absmax[j])
        y = np.abs(xs) / a  # float32, as the code computes it
        t = (np.sqrt(y) if rooted else y) * k
        s = _grid_spacing(t, tier, unsigned)
        t_dec = np.abs(d) / np.float64(a)
        t_dec = (np.sqrt(t_dec) if rooted else t_dec) * np.float64(k)
        # One of the two grid points around the value, with its sign.
        assert np.all(np.abs(t_dec - t) <= s * (1 + 1e-5)), tier
        assert np.all((np.sign(d) == np.sign(xs)) | (d == 0))
        if unsigned:
            assert np.all(d[:, xs > 0] > 0)  # a second moment never becomes 0
        # Unbiased per element: the mean of the draws is within 6 standard
        # errors of the value, a draw's spread being at most half the gap;
        # except a positive value of the non-negative block below the lowest
        # grid point, which always rounds up to it.
        t64 = np.asarray(t, np.float64)
        gap = ((t64 + s) ** 2 - t64**2) / k**2 if rooted else s / k
        tol = 6 * gap * float(a) / (2 * np.sqrt(draws)) + 1e-6 * np.abs(xs)
        err = np.abs(d.mean(axis=0) - np.asarray(xs, np.float64))
        exempt = unsigned & (t64 > 0) & (t64 < below)
        if unsigned and tier == "int8":
            assert exempt.sum() >= 3  # the row reaches below 2**-30
            np.testing.assert_array_equal(
                d[:, exempt], np.float64(np.float32(normal) * a)
            )
        assert np.all((err <= tol) | exempt), (tier, unsigned, float(np.max(err / tol)))


def test_second_moment_never_rounds_to_zero():
    v = jnp.concatenate([jnp.ones(1), jnp.full(255, 1e-12)])
    for tier in ("int8", "float8"):
        rnd = bits.random_bits(bits.global_index(v.shape), jnp.int32(0), 0)
        assert bool(jnp.all(codes.decode(codes.encode(v, tier, rnd, block=256)) > 0))


@pytest.mark.parametrize("tier", ["int8", "float8"])
def test_block_statistics_follow_sign_and_magnitude(tier):
    """Each block's code is chosen by its values: -0.0 is not negative (the
    block keeps the unsigned code), one negative value makes it signed, and a
    NaN or an infinity decodes as a block of NaN, never as finite values."""
    base = np.linspace(1e-3, 1.0, 32, dtype=np.float32)
    with_neg_zero = base.copy()
    with_neg_zero[5] = -0.0
    with_negative = base.copy()
    with_negative[7] = -0.5
    blocks = {"neg_zero": with_neg_zero, "negative": with_negative}
    for bad in (np.nan, np.inf, -np.inf):
        b = base.copy()
        b[3] = bad
        blocks[str(bad)] = b
    x = jnp.asarray(np.concatenate(list(blocks.values())))
    rnd = bits.random_bits(bits.global_index(x.shape), jnp.int32(1), 2)
    c = codes.encode(x, tier, rnd, block=32)
    scale = np.asarray(c.scale)
    assert scale[0] == -1.0  # unsigned code (negative scale), largest 1.0
    assert scale[1] == 1.0  # signed code
    d = np.asarray(codes.decode(c)).reshape(len(blocks), 32)
    assert d[0, 5] == 0 and np.all(d[0, np.arange(32) != 5] > 0)
    assert d[1, 7] < 0
    assert not np.any(np.isfinite(scale[2:])) and np.all(np.isnan(d[2:]))


@pytest.mark.parametrize("tier", ["int8", "float8"])
@pytest.mark.parametrize("scale", [1e-30, 1e-20, 1.0, 1e20, 1e30, 3e38])
def test_codes_hold_blocks_of_any_magnitude(tier, scale):
    """Blocks whose largest magnitude is tiny or huge (where the reciprocal of
    the block's scale would leave float32's normal range) are stored as well
    as blocks near 1: finite, each element within the code's step of the
    block's scale, positive values of a non-negative block kept positive."""
    rng = np.random.default_rng(0)
    x = np.abs(rng.normal(size=256)).astype(np.float32)
    x = (x / x.max() * np.float32(scale)).astype(np.float32)
    signed = x.copy()
    signed[::2] *= -1
    rnd = bits.random_bits(bits.global_index((256,)), jnp.int32(3), 7)
    for block, tol in ((x, 0.125), (signed, 0.07)):
        d = np.asarray(
            codes.decode(codes.encode(jnp.asarray(block), tier, rnd, block=256))
        )
        assert np.all(np.isfinite(d)), (tier, scale)
        err = np.max(np.abs(d.astype(np.float64) - block)) / np.abs(block).max()
        assert err <= tol, (tier, scale, err)
        if block is x:
            assert np.all(d > 0)


def test_random_bits_do_not_depend_on_sharding(mesh8):
    shape = (16, 256)
    ref = bits.random_bits(bits.global_index(shape), jnp.int32(4), 9)
    f = jax.jit(
        lambda: bits.random_bits(bits.global_index(shape), jnp.int32(4), 9),
        out_shardings=NamedSharding(mesh8, P("data")),
    )
    np.testing.assert_array_equal(np.asarray(f()), np.asarray(ref))


# ------------------------------------------------------------------ weights


@adam_promotion
def test_exact_tier_reassembles_float32_adamw_bit_for_bit():
    # Weights well away from zero: every step lands (see the next test).
    key = jax.random.key(3)
    p32 = {"w": jax.random.uniform(key, (16, 256), minval=0.5, maxval=1.5)}
    ref_opt = optax.adamw(1e-3, b2=0.95, weight_decay=0.1)
    opt = mpo.compact_state(
        ref_opt, weights="bfloat16-exact", moments="float32", policy=BF16
    )
    params, state = mpo.compact_params(p32, "bfloat16-exact"), opt.init(p32)
    ref_p, ref_s = p32, ref_opt.init(p32)

    def step(p, s, g):
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s

    def ref_step(p, s, g):
        u, s = ref_opt.update(g, s, p)
        return optax.apply_updates(p, u), s

    # Op by op, as float32 training dispatches them: under `jit` XLA may fuse
    # the float32 update into `p + u` differently in the two programs (a fused
    # multiply-add), which changes the last bit of float32 training itself.
    for i in range(200):
        g = _grads(i, p32)
        params, state = step(params, state, g)
        ref_p, ref_s = ref_step(ref_p, ref_s, jax.tree.map(jnp.float32, g))
    assert_tree_dtypes(params, jnp.bfloat16)
    assert int(state.num_missed) == 0
    master = mpo.master_params(params, state)
    np.testing.assert_array_equal(
        np.asarray(master["w"]).view(np.uint32), np.asarray(ref_p["w"]).view(np.uint32)
    )
    # The moments too, and the weights moved.
    np.testing.assert_array_equal(
        np.asarray(state.inner_state[0].mu["w"]), np.asarray(ref_s[0].mu["w"])
    )
    assert not np.array_equal(np.asarray(ref_p["w"]), np.asarray(p32["w"]))


@adam_promotion
def test_exact_tier_under_jit_reassembles_jitted_float32_adamw_bit_for_bit():
    """Compiled, fed the same gradients, the exact tier reaches what compiled
    float32 AdamW reaches, bit for bit: XLA contracts the update's
    multiply-adds into fused ones alike in both programs (which is why both
    differ from AdamW run op by op in the last bit of a few % of weights).

    With XLA's default compilation, as users run it: the suite's own setting
    (LLVM's optimizer off, with the classic fusion emitters) contracts
    differently in the two programs (2-3% of weights off by 1-2 ulp)."""
    previous = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", False)
    try:
        _exact_tier_under_jit()
    finally:
        jax.config.update("jax_disable_most_optimizations", previous)


def _exact_tier_under_jit():
    key = jax.random.key(5)
    p32 = {
        "w": jax.random.uniform(key, (16, 256), minval=0.5, maxval=1.5),
        "b": jax.random.uniform(key, (256,), minval=-1.5, maxval=-0.5),
    }
    ref_opt = optax.adamw(1e-3, b2=0.95, weight_decay=0.1)
    opt = mpo.compact_state(
        ref_opt, weights="bfloat16-exact", moments="float32", policy=BF16
    )

    def stepper(o):
        @jax.jit
        def step(p, s, g):
            u, s = o.update(g, s, p)
            return optax.apply_updates(p, u), s

        return step

    step, ref_step = stepper(opt), stepper(ref_opt)
    params, state = mpo.compact_params(p32, "bfloat16-exact"), opt.init(p32)
    ref_p, ref_s = p32, ref_opt.init(p32)
    for i in range(200):
        g = jax.tree.map(jnp.float32, _grads(i, p32))
        params, state = step(params, state, g)
        ref_p, ref_s = ref_step(ref_p, ref_s, g)
    assert int(state.num_missed) == 0
    master = mpo.master_params(params, state)
    for k in p32:
        np.testing.assert_array_equal(
            np.asarray(master[k]).view(np.uint32), np.asarray(ref_p[k]).view(np.uint32)
        )
    assert not np.array_equal(np.asarray(ref_p["w"]), np.asarray(p32["w"]))


@pytest.mark.parametrize("promotion", ["standard", "strict"])
def test_a_weight_near_zero_lands_with_float32_updates(promotion):
    # 9.42e-4 - 1.0e-3 = -5.8e-5: no bfloat16 update from 9.42e-4 reaches the
    # top bits of -5.8e-5 (bfloat16 near 1e-3 is 8e-6 apart), a float32 one
    # does. Strict promotion refuses bfloat16 + float32, so there the update is
    # bfloat16, and the miss is counted.
    old = jnp.array([9.4223e-4, 0.5], jnp.float32)
    opt = mpo.compact_state(
        optax.sgd(1.0), weights="bfloat16-exact", moments="float32", policy=BF16
    )
    params, state = (
        mpo.compact_params({"w": old}, "bfloat16-exact"),
        opt.init({"w": old}),
    )
    g = {"w": jnp.array([1.0004e-3, 2**-8], jnp.float32)}
    with jax.numpy_dtype_promotion(promotion):
        u, state = opt.update(g, state, params)
        new = optax.apply_updates(params, u)
    want = old - g["w"]
    master = mpo.master_params(new, state)
    assert new["w"].dtype == jnp.bfloat16
    assert float(master["w"][1]) == float(want[1])  # this one lands either way
    if promotion == "standard":
        assert u["w"].dtype == jnp.float32
        assert int(state.num_missed) == 0
        np.testing.assert_array_equal(
            np.asarray(master["w"]).view(np.uint32), np.asarray(want).view(np.uint32)
        )
    else:
        assert u["w"].dtype == jnp.bfloat16
        assert int(state.num_missed) == 1
        assert float(master["w"][0]) != float(want[0])
        assert abs(float(master["w"][0]) - float(want[0])) < 8e-6  # within u's grid


def test_landing_update_lands_whenever_a_nearby_update_can():
    # Targets near their old weights, near zero (where landing may be
    # impossible) and far from them (where the rounded difference may tie and
    # miss, and a neighbour land); bfloat16 `old + u` must equal the target
    # where `landed`, and where not, no update within one ulp of the rounded
    # difference lands.
    rng = np.random.default_rng(3)
    n = 1 << 16
    pick = rng.integers(0, 4, n)
    pow2 = rng.choice([-1.0, 1.0], n) * 2.0 ** rng.integers(-10, 10, n)
    old = rng.standard_normal(n) * 10.0 ** rng.integers(-4, 1, n)
    old = np.where(pick == 3, pow2, old).astype(jnp.bfloat16)
    o64 = old.astype(np.float64)
    near = o64 * (1 + rng.standard_normal(n) * 10.0 ** rng.integers(-4, 0, n))
    to_zero = o64 * rng.uniform(-1e-3, 1e-3, n)
    far = o64 * rng.choice([-1.0, 1.0], n) * 2.0 ** rng.uniform(6, 10, n)
    # -256 times a power of two: the difference, 257 of its ulps, ties and
    # rounds to even, which misses; one bfloat16 ulp further lands.
    target = np.choose(pick, [near, to_zero, far, -256.0 * o64])
    target = target.astype(jnp.bfloat16)
    u, landed = jax.jit(bits.landing_update)(jnp.asarray(old), jnp.asarray(target))
    assert u.dtype == jnp.bfloat16 and landed.dtype == jnp.bool_
    u, landed = np.asarray(u), np.asarray(landed)

    def lands(z):  # optax.apply_updates: one addition, rounded to bfloat16
        s = old.astype(np.float32) + z.astype(np.float32)
        return s.astype(jnp.bfloat16).astype(np.float32) == target.astype(np.float32)

    np.testing.assert_array_equal(lands(u), landed)
    # A float32 update lands wherever the target is at most 2**16 times
    # smaller than the old weight (the float32 difference is then exact), and
    # `landed` says where it did.
    u32, landed32 = jax.jit(bits.landing_update, static_argnums=2)(
        jnp.asarray(old), jnp.asarray(target), jnp.float32
    )
    assert u32.dtype == jnp.float32
    landed32 = np.asarray(landed32)
    np.testing.assert_array_equal(lands(np.asarray(u32)), landed32)
    t64 = np.abs(target.astype(np.float64))
    assert np.all(landed32[t64 >= np.abs(o64) * 2.0**-16])
    assert np.sum(~landed32) < np.sum(~landed) / 10
    d = (target.astype(np.float32) - old.astype(np.float32)).astype(jnp.bfloat16)
    bits16 = d.view(np.uint16).astype(np.int64)
    for step in (-1, 0, 1):
        z = np.clip(bits16 + step, 0, 0xFFFF).astype(np.uint16).view(jnp.bfloat16)
        assert not np.any(lands(z) & ~landed)
    assert np.any(landed) and np.any(~landed)  # both cases occur


def test_stochastic_weights_move_where_round_to_nearest_stalls():
    # A step of 1e-4 on a weight of 1.0 is an eighth of bfloat16's half ulp.
    lr, steps = 1e-4, 1000
    p = {"w": jnp.ones((4096,), jnp.bfloat16)}
    opt = mpo.compact_state(
        optax.sgd(lr), weights="bfloat16-sr", moments="float32", policy=BF16
    )
    state = opt.init(p)
    g = {"w": jnp.ones((4096,), jnp.bfloat16)}

    @jax.jit
    def run(p, state):
        def body(_, c):
            p, s = c
            u, s = opt.update(g, s, p)
            return optax.apply_updates(p, u), s

        return jax.lax.fori_loop(0, steps, body, (p, state))

    p_sr, _ = run(p, state)
    mean = float(jnp.mean(p_sr["w"].astype(jnp.float32)))
    assert abs(mean - (1 - lr * steps)) < 2e-3, mean
    naive = optax.apply_updates(p, jax.tree.map(lambda x: -lr * x, g))
    assert bool(jnp.all(naive["w"] == 1))  # round to nearest: stuck


# ------------------------------------------------------------------ bytes


@adam_promotion
def test_bytes_per_parameter_from_live_pytrees():
    p32 = {"w": jnp.zeros((512, 1024)), "b": jnp.zeros((1024,))}
    want = {
        ("float32", "float32"): (16.0, 16.01),
        ("bfloat16-exact", "float32"): (14.0, 14.01),
        ("bfloat16-sr", "bfloat16-sr"): (8.0, 8.0),
        ("bfloat16-sr", "int8"): (6.0, 6.1),
        ("bfloat16-sr", "float8"): (6.0, 6.1),
    }
    for (w, m), (lo, hi) in want.items():
        opt = _opt(w, m)
        params = mpo.compact_params(p32, w)
        state = opt.init(p32)
        grads = params  # gradients have the params' dtype
        b = state_bytes_per_param(params, grads, state)
        assert lo <= b <= hi + 1e-4, (w, m, b)
    state = _opt("bfloat16-sr", "int8").init(p32)
    mu = state.inner_state[0].mu["w"]
    assert mu.codes.dtype == jnp.uint8 and mu.scale.shape == (512, 4)
    assert state.inner_state[0].count.dtype == jnp.int32  # counts stay exact


# ------------------------------------------------------------------ training


@adam_promotion
@pytest.mark.parametrize(("weights", "moments"), TIERS)
def test_every_tier_trains_close_to_float32(weights, moments):
    p32 = _params32()
    opt, ref = _opt(weights, moments), optax.adamw(1e-2, b2=0.95, weight_decay=0.1)
    params, state = mpo.compact_params(p32, weights), opt.init(p32)
    ref_p, ref_s = p32, ref.init(p32)
    target = jax.tree.map(lambda x: x + 0.3, p32)

    def loss(p):
        return sum(
            jnp.mean(jnp.square(p[k].astype(jnp.float32) - target[k])) for k in p
        )

    @jax.jit
    def step(p, s):
        g = jax.grad(loss)(p)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s

    @jax.jit
    def ref_step(p, s):
        u, s = ref.update(jax.grad(loss)(p), s, p)
        return optax.apply_updates(p, u), s

    for _ in range(60):
        params, state = step(params, state)
        ref_p, ref_s = ref_step(ref_p, ref_s)
    assert_tree_dtypes(params, "float32" if weights == "float32" else "bfloat16")
    l0, l_ref, l_c = float(loss(p32)), float(loss(ref_p)), float(loss(params))
    assert l_c < 0.1 * l0
    assert abs(l_c - l_ref) < 0.05 * l0, (l_c, l_ref, l0)


@adam_promotion
def test_composes_with_loss_scaled_in_float16():
    p32 = _params32()
    opt = mpo.loss_scaled(_opt(), mixprec.DynamicLossScale(2.0**10))
    params, state = mpo.compact_params(p32, "bfloat16-sr"), opt.init(p32)

    def loss(p, scale_inf):
        p16 = jax.tree.map(lambda a: a.astype(jnp.float16), p)
        out = jnp.mean(jnp.square(p16["w"] - 0.3)) * scale_inf
        return out.astype(jnp.float32)

    vg = mixprec.value_and_grad(loss)

    @jax.jit
    def step(p, s, scale_inf):
        _, g, _ = vg(p, scale_inf, loss_scale=s)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s

    p1, s1 = step(params, state, jnp.float16(1))
    assert not np.array_equal(np.asarray(p1["w"]), np.asarray(params["w"]))
    p2, s2 = step(p1, s1, jnp.float16(jnp.inf))  # non-finite: skipped
    np.testing.assert_array_equal(np.asarray(p2["w"]), np.asarray(p1["w"]))
    inner1, inner2 = s1.inner_state, s2.inner_state
    assert int(inner2.step) == int(inner1.step) == 1
    np.testing.assert_array_equal(
        np.asarray(inner2.inner_state[0].nu["w"].codes),
        np.asarray(inner1.inner_state[0].nu["w"].codes),
    )
    assert int(s2.num_skipped) == 1


@adam_promotion
def test_composes_with_multisteps():
    p32 = _params32()
    one = _opt()
    acc = optax.MultiSteps(_opt(), every_k_schedule=2)
    p, s = mpo.compact_params(p32, "bfloat16-sr"), one.init(p32)
    pa, sa = p, acc.init(p32)
    for i in range(3):
        g = _grads(i, p32)
        u, s = jax.jit(one.update)(g, s, p)
        p = optax.apply_updates(p, u)
        for _ in range(2):  # the same micro-batch twice: its mean is exact
            ua, sa = jax.jit(acc.update)(g, sa, pa)
            pa = optax.apply_updates(pa, ua)
    for k in p:
        np.testing.assert_array_equal(np.asarray(pa[k]), np.asarray(p[k]))
    assert int(sa.inner_opt_state.step) == 3


@adam_promotion
def test_jit_with_donation_matches_without():
    p32 = _params32()
    opt = _opt("bfloat16-exact", "int8")

    def step(p, s, g):
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s

    plain = jax.jit(step)
    donated = jax.jit(step, donate_argnums=(0, 1))
    pa = pb = mpo.compact_params(p32, "bfloat16-exact")
    sa = sb = opt.init(p32)
    pb, sb = jax.tree.map(jnp.copy, (pb, sb))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "donated buffers were not usable"
        for i in range(3):
            g = _grads(i, p32)
            pa, sa = plain(pa, sa, g)
            pb, sb = donated(pb, sb, g)
    for a, b in zip(jax.tree.leaves((pa, sa)), jax.tree.leaves((pb, sb)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.fixture(scope="module")
def mesh8():
    return jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


@adam_promotion
@pytest.mark.parametrize("moments", ["int8", "float8"])
def test_eight_devices_match_one(mesh8, moments):
    p32 = _params32()
    opt = _opt("bfloat16-sr", moments)

    def step(p, s, g):
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s

    def run(put):
        p, s = put(mpo.compact_params(p32, "bfloat16-sr")), put(opt.init(p32))
        f = jax.jit(step)
        for i in range(4):
            p, s = f(p, s, put(_grads(i, p32)))
        return p, s

    def shard(tree):
        def put(a):
            spec = P("data") if a.ndim >= 1 and a.shape[0] % 8 == 0 else P()
            return jax.device_put(a, NamedSharding(mesh8, spec))

        return jax.tree.map(put, tree)

    one = run(lambda t: t)
    eight = run(shard)
    assert len(jax.tree.leaves(eight[0])[0].sharding.device_set) == 8
    for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(eight), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@adam_promotion
def test_shard_map_matches_one_device(mesh8):
    p32 = {"w": _params32()["w"]}
    specs = {"w": P("data")}
    local = _opt(shard_specs=specs)
    glob = _opt()

    def step(opt, p, s, g):
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s

    p = mpo.compact_params(p32, "bfloat16-sr")
    s = glob.init(p32)
    state_specs = jax.tree.map(
        lambda a: P("data") if a.ndim >= 1 and a.shape[0] == 16 else P(), s
    )
    sm = jax.jit(
        jax.shard_map(
            lambda p, s, g: step(local, p, s, g),
            mesh=mesh8,
            in_specs=(specs, state_specs, specs),
            out_specs=(specs, state_specs),
        )
    )
    g = {"w": _grads(0, p32)["w"]}
    p_sm, s_sm = sm(p, s, g)
    p_1, s_1 = jax.jit(lambda p, s, g: step(glob, p, s, g))(p, s, g)
    for a, b in zip(
        jax.tree.leaves((p_sm, s_sm)), jax.tree.leaves((p_1, s_1)), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ------------------------------------------------------------------ checkpoints


def _train(opt, p, s, start, n, *, jit=True):
    def step(p, s, g):
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s

    step = jax.jit(step) if jit else step
    for i in range(start, start + n):
        g = _grads(i, {"w": p["w"], "b": p["b"]})
        if p["w"].dtype == jnp.float32:  # the same values, in float32
            g = jax.tree.map(lambda x: x.astype(jnp.float32), g)
        p, s = step(p, s, g)
    return p, s


@adam_promotion
def test_orbax_round_trip_continues_bit_identically(tmp_path):
    p32 = _params32()
    opt = mpo.loss_scaled(_opt("bfloat16-sr", "int8"))
    p, s = _train(opt, mpo.compact_params(p32, "bfloat16-sr"), opt.init(p32), 0, 3)
    mpk.save(tmp_path / "c", (p, s))
    straight = _train(opt, p, s, 3, 3)
    target = jax.tree.map(jnp.zeros_like, (p, s))
    resumed = _train(opt, *mpk.restore(tmp_path / "c", target), 3, 3)
    for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(resumed), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@adam_promotion
@pytest.mark.parametrize("moments", ["int8", "float8", "bfloat16-sr", "float32"])
def test_casts_and_restores_in_a_dtype_leave_the_compact_state_as_it_is(
    tmp_path, moments
):
    # A float16 block scale of a small second moment flushes to zero (Adam then
    # divides by eps); float8 codes cast up take 2-4x the bytes. The state's
    # dtypes are its format: only the params follow the cast.
    p32 = _params32()
    opt = _opt("bfloat16-exact", moments)
    p, s = _train(opt, mpo.compact_params(p32, "bfloat16-exact"), opt.init(p32), 0, 2)
    cast = mixprec.cast_tree((p, s), jnp.float16)
    mpk.save(tmp_path / "c", (p, s))
    restored = mpk.restore(tmp_path / "c", (p, s), dtype=jnp.float16)
    for p_out, s_out in (cast, restored):
        assert_tree_dtypes(p_out, jnp.float16)
        assert jax.tree.structure(s_out) == jax.tree.structure(s)
        for a, b in zip(jax.tree.leaves(s), jax.tree.leaves(s_out), strict=True):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Restored as saved, training continues bit-identically.
    again = mpk.restore(tmp_path / "c", (p, s))
    straight = _train(opt, p, s, 2, 2)
    resumed = _train(opt, *again, 2, 2)
    for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(resumed), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@adam_promotion
def test_a_checkpoint_in_another_code_layout_is_refused(tmp_path):
    # Codes stored in a layout this version does not decode would come back
    # as wrong moments with no error; the state records its layout.
    p32 = _params32()
    opt = mpo.loss_scaled(_opt("bfloat16-sr", "int8"))
    p, s = _train(opt, mpo.compact_params(p32, "bfloat16-sr"), opt.init(p32), 0, 1)
    (compact,) = compact_state_lib.find_states(s)
    assert int(compact.codes_format) == codes.CODES_FORMAT
    # The layout survives updates and a round trip.
    mpk.save(tmp_path / "ok", (p, s))
    restored = mpk.restore(tmp_path / "ok", (p, s))
    (back,) = compact_state_lib.find_states(restored[1])
    assert int(back.codes_format) == codes.CODES_FORMAT
    other = jax.tree.map(
        lambda node: (
            node._replace(codes_format=jnp.int32(codes.CODES_FORMAT + 1))
            if isinstance(node, compact_state_lib.CompactState)
            else node
        ),
        s,
        is_leaf=lambda x: isinstance(x, compact_state_lib.CompactState),
    )
    mpk.save(tmp_path / "other", (p, other))
    now = codes.CODES_FORMAT
    with pytest.raises(ValueError, match=rf"layout {now + 1}\).*decodes layout {now}"):
        mpk.restore(tmp_path / "other", (p, s))
    with pytest.raises(ValueError, match="layout"):
        mpk.restore_compact(tmp_path / "other", (p, s), saved=(p, s))
    # A checkpoint from before the layout was recorded (the state had four
    # fields): the structure error names the one missing leaf and says why.
    before = collections.namedtuple(
        "CompactState", ["step", "remainder", "inner_state", "num_missed"]
    )
    old = jax.tree.map(
        lambda node: (
            before(*tuple(node)[:4])
            if isinstance(node, compact_state_lib.CompactState)
            else node
        ),
        s,
        is_leaf=lambda x: isinstance(x, compact_state_lib.CompactState),
    )
    mpk.save(tmp_path / "old", (p, old))
    with pytest.raises(ValueError, match="no `codes_format`") as err:
        mpk.restore(tmp_path / "old", (p, s))
    (missing,) = re.findall(r"not in the checkpoint: (\[.*?\])", str(err.value))
    assert missing.count("'") == 2 and missing.endswith("codes_format']"), missing


@adam_promotion
def test_restore_from_float32_and_into_another_tier(tmp_path):
    # Weights away from zero, so that every bfloat16 step lands; op by op, so
    # that XLA's fusion does not change float32 training's last bits.
    p32 = jax.tree.map(lambda x: x + 1.0, _params32())
    adamw = optax.adamw(1e-2, b2=0.95, weight_decay=0.1)
    p, s = _train(adamw, p32, adamw.init(p32), 0, 3)  # plain float32 training
    mpk.save(tmp_path / "f32", (p, s))
    exact = _opt("bfloat16-exact", "float32")
    target = (mpo.compact_params(p32, "bfloat16-exact"), exact.init(p32))
    pe, se = mpk.restore_compact(tmp_path / "f32", target, saved=(p, s))
    # float32 -> exact loses nothing: training continues bit-identically.
    cont_ref = _train(adamw, p, s, 3, 3, jit=False)[0]
    cont = mpo.master_params(*_train(exact, pe, se, 3, 3, jit=False))
    np.testing.assert_array_equal(np.asarray(cont["w"]), np.asarray(cont_ref["w"]))
    # exact -> bfloat16-sr / int8: weights rounded to nearest, moments close.
    mpk.save(tmp_path / "exact", (pe, se))
    sr = _opt("bfloat16-sr", "int8")
    target = (mpo.compact_params(p32, "bfloat16-sr"), sr.init(p32))
    ps, ss = mpk.restore_compact(tmp_path / "exact", target, saved=(pe, se))
    assert_tree_dtypes(ps, jnp.bfloat16)
    np.testing.assert_array_equal(
        np.asarray(ps["w"]), np.asarray(p["w"].astype(jnp.bfloat16))
    )
    nu = codes.decode(ss.inner_state[0].nu["w"])
    np.testing.assert_allclose(nu, s[0].nu["w"], rtol=0.2, atol=1e-6)
    assert int(ss.inner_state[0].count) == int(s[0].count) == 3


# ------------------------------------------------------------------ which leaves
# A state leaf is compressed as a moment only where it is known to be one (a
# field of an optax state type listed in `_src/compact/fields.py`); parameter
# copies are stored as the weights are; anything else is kept as it is.


def _tiers(tree):
    """Path -> tier (a compressed leaf) or dtype name, of every leaf with a
    dimension."""
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=mpo_is_compressed)[0]
    return {
        jax.tree_util.keystr(path): (
            x.tier if mpo_is_compressed(x) else np.dtype(x.dtype).name
        )
        for path, x in flat
        if np.ndim(x.codes if mpo_is_compressed(x) else x) >= 1
    }


def mpo_is_compressed(x):
    return isinstance(x, codes.Compressed)


def _copy_tier(weights):
    return "bfloat16-sr" if weights == "bfloat16-sr" else "float32"


def _square_params32():
    k1, k2 = jax.random.split(jax.random.key(3))
    return {
        "w": jax.random.normal(k1, (128, 128)) * 0.05,
        "b": jax.random.normal(k2, (128,)) * 0.05,
    }


_SAM_ADV = optax.chain(optax.contrib.normalize(), optax.sgd(0.05))
# inner optimizer -> {path of the leaf in the inner state: what it is}; "m" a
# moment (stored in the moment tier), "p" a parameter copy (stored as the
# weights are), "k" kept as it is (float32).
WHICH_LEAVES = {
    "mechanize": (
        lambda: optax.contrib.mechanize(optax.adam(1e-2)),
        {
            ".base_optimizer_state[0].mu['w']": "m",
            ".base_optimizer_state[0].nu['b']": "m",
            ".x0['w']": "p",
            ".x0['b']": "p",
            ".s": "k",
            ".r": "k",
        },
    ),
    "prodigy": (
        optax.contrib.prodigy,
        {
            ".exp_avg['w']": "m",
            ".exp_avg_sq['w']": "m",
            ".params0['w']": "p",
            ".params0['b']": "p",
            ".grad_sum['w']": "k",
        },
    ),
    "schedule_free_adamw": (
        lambda: optax.contrib.schedule_free_adamw(1e-2),
        {".base_optimizer_state[0].nu['w']": "m", ".z['w']": "p", ".z['b']": "p"},
    ),
    "sam": (
        lambda: optax.contrib.sam(optax.adam(1e-2), _SAM_ADV),
        {
            ".opt_state[0].mu['w']": "m",
            ".opt_state[0].nu['b']": "m",
            ".cache['w']": "p",
            ".cache['b']": "p",
        },
    ),
    "multisteps": (
        lambda: optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2),
        {
            ".inner_opt_state[0].mu['w']": "m",
            ".acc_grads['w']": "k",
            ".acc_grads['b']": "k",
        },
    ),
    "adafactor": (
        # `w` is factored: its row and column statistics have `b`'s shape.
        lambda: optax.adafactor(1e-2),
        {
            "[0].v_row['w']": "k",
            "[0].v_col['w']": "k",
            "[0].v['w']": "k",  # a placeholder of shape (1,)
            "[0].v['b']": "m",  # `b` is too small to factor
        },
    ),
    "adamw": (
        lambda: optax.adamw(1e-2),
        {"[0].mu['w']": "m", "[0].nu['w']": "m", "[0].mu['b']": "m"},
    ),
    "sgd_momentum": (lambda: optax.sgd(1e-2, momentum=0.9), {"[0].trace['w']": "m"}),
}


@adam_promotion
@pytest.mark.parametrize("weights", ["float32", "bfloat16-exact", "bfloat16-sr"])
@pytest.mark.parametrize("name", WHICH_LEAVES)
def test_only_known_moments_are_compressed(name, weights):
    make, want = WHICH_LEAVES[name]
    opt = _opt(weights, "int8", inner=make())
    p32 = _square_params32()
    params = mpo.compact_params(p32, weights)
    state = opt.init(p32)

    @jax.jit
    def step(p, s, g):
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s

    grads = jax.tree.map(lambda x: (0.01 * x).astype(x.dtype), params)
    for s in (state, step(params, state, grads)[1]):
        tiers = _tiers(s.inner_state)
        expected = {
            path: {"m": "int8", "p": _copy_tier(weights), "k": "float32"}[kind]
            for path, kind in want.items()
        }
        assert {path: tiers[path] for path in want} == expected
        # Nothing else is compressed but what the table lists.
        described = mpo.describe_compact_state(s, params)
        for record in described.leaves:
            if record.kind == "kept":
                assert record.stored == record.dtype, record


@adam_promotion
@pytest.mark.parametrize("name", ["mechanize", "prodigy"])
def test_a_copy_of_the_initial_weights_is_the_weights(name):
    # Initialised from float32 params, the copy is rounded as `compact_params`
    # rounds the weights (to nearest), and later steps leave it exact.
    make, _ = WHICH_LEAVES[name]
    opt = _opt("bfloat16-sr", "int8", inner=make())
    p32 = _square_params32()
    params = mpo.compact_params(p32, "bfloat16-sr")
    state = opt.init(p32)

    @jax.jit
    def step(p, s, g):
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s

    for i in range(3):
        params, state = step(params, state, _grads(i, p32))
    inner = mpo.decode_compact_state(state)
    copy = inner.x0 if name == "mechanize" else inner.params0
    want = mpo.compact_params(p32, "bfloat16-sr")
    for k in p32:
        assert copy[k].dtype == jnp.float32
        np.testing.assert_array_equal(
            np.asarray(copy[k]), np.asarray(want[k].astype(jnp.float32))
        )


@adam_promotion
def test_adam_moments_keep_their_codes():
    # Adam's mu (signed) and nu (non-negative) still take the signed and the
    # unsigned int8 code, encoded together per parameter.
    p32 = _params32()
    opt = _opt("bfloat16-sr", "int8")
    params, state = mpo.compact_params(p32, "bfloat16-sr"), opt.init(p32)
    _, state = jax.jit(opt.update)(_grads(0, p32), state, params)
    mu, nu = state.inner_state[0].mu["w"], state.inner_state[0].nu["w"]
    assert mu.tier == nu.tier == "int8"
    assert bool(jnp.all(nu.scale < 0))  # negative scale: the unsigned code
    assert bool(jnp.any(mu.scale > 0))
    decoded = mpo.decode_compact_state(state)[0].mu["w"]
    want = 0.1 * _grads(0, p32)["w"].astype(jnp.float32)
    assert decoded.dtype == jnp.float32
    err = float(jnp.mean(jnp.abs(decoded - want)))
    assert err < 0.05 * float(jnp.mean(jnp.abs(want)))


def test_an_unknown_state_is_kept_as_it_is():
    class MyState(collections.namedtuple("MyState", ["stats"])):
        pass

    def init(params):
        return MyState(jax.tree.map(jnp.zeros_like, params))

    def update(updates, state, params=None):
        del params
        stats = jax.tree.map(lambda s, g: 0.9 * s + g, state.stats, updates)
        return updates, MyState(stats)

    opt = mpo.compact_state(
        optax.GradientTransformation(init, update),
        weights="float32",
        moments="int8",
        policy="float32",
    )
    p = {"w": jnp.ones((4, 64))}
    state = opt.init(p)
    _, state = opt.update(p, state, p)
    assert _tiers(state.inner_state) == {".stats['w']": "float32"}
    np.testing.assert_array_equal(np.asarray(state.inner_state.stats["w"]), 1.0)
    (record,) = [r for r in mpo.describe_compact_state(state, p).leaves if r.shape]
    assert (record.stored, record.kind, record.reason) == (
        "float32",
        "kept",
        "unknown: kept as is",
    )


@adam_promotion
def test_schedule_free_eval_params_through_the_decoded_state():
    # Schedule-free models are evaluated at weights optax computes from the
    # state (`schedule_free_eval_params`); it reads plain arrays.
    p32 = _square_params32()
    make = lambda: optax.contrib.schedule_free_adamw(1e-2, warmup_steps=5)  # noqa: E731
    ref = make()
    for weights in ("float32", "bfloat16-sr"):
        opt = _opt(weights, "int8", inner=make())
        p, s = mpo.compact_params(p32, weights), opt.init(p32)
        rp, rs = p32, ref.init(p32)
        for i in range(5):
            g = _grads(i, p32)
            u, s = jax.jit(opt.update)(
                jax.tree.map(lambda x, q: x.astype(q.dtype), g, p), s, p
            )
            p = optax.apply_updates(p, u)
            ru, rs = jax.jit(ref.update)(
                jax.tree.map(lambda x: x.astype(jnp.float32), g), rs, rp
            )
            rp = optax.apply_updates(rp, ru)
        master = mpo.master_params(p, s)
        if weights == "bfloat16-sr":
            with pytest.raises(TypeError):  # z is stored as the weights are
                optax.contrib.schedule_free_eval_params(s.inner_state, master)
        inner = mpo.decode_compact_state(s)
        assert inner.z["w"].dtype == jnp.float32
        got = jax.jit(optax.contrib.schedule_free_eval_params)(inner, master)
        want = optax.contrib.schedule_free_eval_params(rs, rp)
        assert_tree_dtypes(got, "float32")
        atol = 2e-3 if weights == "float32" else 2e-2
        for k in p32:
            np.testing.assert_allclose(
                np.asarray(got[k]), np.asarray(want[k]), rtol=0, atol=atol
            )
    # Inside other states (here `loss_scaled`'s), the one compact state's.
    nested = mpo.loss_scaled(_opt("float32", "int8", inner=make())).init(p32)
    assert mpo.decode_compact_state(nested).z["w"].dtype == jnp.float32


def test_decode_compact_state_needs_exactly_one():
    with pytest.raises(ValueError, match="decode_compact_state.*found 0"):
        mpo.decode_compact_state(optax.adam(1e-3).init(jnp.zeros(3)))
    with pytest.raises(ValueError, match="describe_compact_state.*no `CompactState`"):
        mpo.describe_compact_state(optax.adam(1e-3), jnp.zeros(3))


@adam_promotion
def test_describe_lists_every_leaf_with_its_tier_reason_and_bytes():
    p32 = {"w": jnp.zeros((512, 1024)), "b": jnp.zeros((1024,))}
    inner = optax.contrib.prodigy()
    opt = _opt("bfloat16-sr", "int8", inner=inner)
    params = mpo.compact_params(p32, "bfloat16-sr")
    report = mpo.describe_compact_state(opt, params)
    state = opt.init(p32)
    assert mpo.describe_compact_state(state, params) == report  # abstract = live
    n = sum(x.size for x in jax.tree.leaves(p32))
    flat = jax.tree.leaves(state, is_leaf=mpo_is_compressed)
    assert len(report.leaves) == len(flat)
    assert report.state_bytes == sum(x.nbytes for x in jax.tree.leaves(state))
    assert report.bytes_per_param == pytest.approx(
        state_bytes_per_param(params, params, state)
    )
    by_path = {r.path: r for r in report.leaves}
    mu = by_path[".inner_state.exp_avg['w']"]
    assert (mu.stored, mu.kind, mu.source) == ("int8", "moment", "ProdigyState.exp_avg")
    assert mu.bytes == 512 * 1024 + 512 * 4 * 4
    copy = by_path[".inner_state.params0['w']"]
    assert (copy.stored, copy.kind, copy.bytes) == (
        "bfloat16-sr",
        "parameter copy",
        512 * 1024 * 2,
    )
    kept = by_path[".inner_state.grad_sum['w']"]
    assert (kept.stored, kept.kind) == ("float32", "kept")
    assert "step-size estimate" in kept.reason
    # 2 (weights) + 2 (grads) + 1 + 1 (moments) + 2 (params0) + 4 (grad_sum)
    assert 12.0 < report.bytes_per_param < 12.1
    text = str(report)
    assert "parameter copy (ProdigyState.params0)" in text
    assert text.splitlines()[-1] == report.summary()
    d = report.to_dict()
    assert d["leaves"][0]["path"] == ".step" and d["num_params"] == n
    import json

    json.dumps(d)  # JSON-serialisable


# ------------------------------------------------------------------ errors


def test_unknown_tier_names_the_argument_and_choices():
    with pytest.raises(ValueError, match=r"weights=.*'bfloat16-exact'.*Did you mean"):
        mpo.compact_state(optax.sgd(1.0), weights="bfloat16-rs", policy=BF16)
    with pytest.raises(ValueError, match=r"moments=.*'float8'.*'int8'.*got 'int4'"):
        mpo.compact_state(optax.sgd(1.0), moments="int4", policy=BF16)


@adam_promotion
def test_non_float_weights_are_refused():
    opt = _opt()
    with pytest.raises(TypeError, match=r"floating-point.*\['n'\].*int32"):
        opt.init({"w": jnp.zeros((2, 32)), "n": jnp.zeros(3, jnp.int32)})


def test_tier_contradicting_the_policy_is_refused():
    # The global policy keeps float32 params unless the user changed it.
    with pytest.raises(ValueError, match=r"global policy.*float32.*p=bf16"):
        mpo.compact_state(optax.sgd(1.0), weights="bfloat16-sr")
    with pytest.raises(ValueError, match=r"`policy`.*bfloat16.*weights="):
        mpo.compact_state(optax.sgd(1.0), weights="float32", policy=BF16)
    with mixprec.policy_scope(BF16):
        mpo.compact_state(optax.sgd(1.0), weights="bfloat16-sr")


@adam_promotion
def test_params_in_the_wrong_dtype_are_refused():
    opt = _opt()
    state = opt.init(_params32())
    with pytest.raises(TypeError, match=r"compact_params"):
        opt.update(_grads(0, _params32()), state, _params32())
    with pytest.raises(ValueError, match=r"needs `params`"):
        opt.update(_grads(0, _params32()), state)


@adam_promotion
def test_weights_made_float32_by_a_whole_step_autocast_get_a_hint():
    # autocast returns floating outputs in the policy's output dtype, so a
    # whole step under o=f32 hands bfloat16 weights back as float32; the next
    # update says why and what to wrap instead.
    opt = _opt()
    w = mpo.compact_params(_params32(), "bfloat16-sr")
    state = opt.init(_params32())

    def loss(p):
        return jnp.mean(jnp.square(p["w"].astype(jnp.float32) - 0.3))

    def step(w, state, loss):
        updates, state = opt.update(jax.grad(loss)(w), state, w)
        return optax.apply_updates(w, updates), state

    whole = jax.jit(mixprec.autocast(partial(step, loss=loss), BF16))
    w1, state1 = whole(w, state)
    assert w1["w"].dtype == jnp.float32  # the output dtype of BF16
    with pytest.raises(TypeError, match=r"compact_params.*wrap the loss function"):
        opt.update(jax.tree.map(jnp.zeros_like, w1), state1, w1)
    # Wrapping the loss keeps them bfloat16, step after step.
    loss_only = jax.jit(partial(step, loss=mixprec.autocast(loss, BF16)))
    w2, state2 = loss_only(*loss_only(w, state))
    assert w2["w"].dtype == jnp.bfloat16 and int(state2.step) == 2


@pytest.mark.standard_promotion  # optax's bias correction promotes implicitly
def test_update_traces_each_leaf_shape_once(monkeypatch):
    # A model's leaves repeat a few shapes; the per-leaf work (about 300 JAX
    # operations) is traced once per shape, not once per leaf and moment.
    encoded, landed = [], []
    encode, landing = codes.encode_many, bits.landing_update
    monkeypatch.setattr(
        codes, "encode_many", lambda *a, **k: encoded.append(1) or encode(*a, **k)
    )
    monkeypatch.setattr(
        bits, "landing_update", lambda *a, **k: landed.append(1) or landing(*a, **k)
    )
    # A shape no other test uses, so that nothing is cached already.
    params32 = {f"w{i}": jnp.full((3, 224), 0.01 * (i + 1)) for i in range(12)}
    opt = mpo.compact_state(
        optax.adamw(1e-3), weights="bfloat16-sr", moments="int8", policy="p=bf16,c=bf16"
    )
    state = opt.init(params32)  # eager: encodes each leaf (the first one traces)
    params = mpo.compact_params(params32, "bfloat16-sr")
    grads = jax.tree.map(lambda p: p * 0.1, params)
    encoded.clear()

    @jax.jit
    def step(p, s, g):
        updates, s = opt.update(g, s, p)
        return optax.apply_updates(p, updates), s

    new_params, new_state = step(params, state, grads)
    # The moments' encoding was traced by `init` already (same shape, tier and
    # block; the random stream is an argument), the weights' once for 12 leaves.
    assert len(encoded) == 0
    assert len(landed) == 1
    assert_tree_dtypes(new_params, jax.tree.map(lambda p: p.dtype, params))
    assert not any(
        bool(jnp.all(a == b))
        for a, b in zip(
            jax.tree.leaves(new_params), jax.tree.leaves(params), strict=True
        )
    )


def test_encoding_in_an_unknown_moment_tier_names_the_choices():
    x = jnp.ones((2, 64), jnp.float32)
    rnd = bits.random_bits(bits.global_index(x.shape), jnp.int32(0), 0)
    with pytest.raises(ValueError, match="'int4'.*int8, float8"):
        codes.encode(x, "int4", rnd, block=32)
