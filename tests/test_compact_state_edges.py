"""Edge cases of `mixprec.optax.compact_state`: Flax NNX's `nnx.Optimizer`,
zero-size leaves, and float8 moments sharded one element per device."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import mixprec.optax as mpo
from mixprec._src.compact import codes, state as compact_state_lib


MOMENTS = ("float32", "bfloat16-sr", "int8", "float8")
# optax's Adam raises a float to an int32 count: it needs standard promotion.
adam_promotion = pytest.mark.standard_promotion


def _is_compressed(x):
    return isinstance(x, codes.Compressed)


def _leaves(tree):
    """The arrays of ``tree``, moments decoded and NNX Variables unwrapped."""
    tree = jax.tree.map(
        lambda x: x.get_value() if isinstance(x, nnx.Variable) else x,
        tree,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )
    tree = jax.tree.map(codes.decode, tree, is_leaf=_is_compressed)
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


# ------------------------------------------------------------------ Flax NNX


class _Mlp(nnx.Module):
    def __init__(self, rngs, dtype):
        self.a = nnx.Linear(8, 64, param_dtype=dtype, dtype=dtype, rngs=rngs)
        self.b = nnx.Linear(64, 32, param_dtype=dtype, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        return self.b(jax.nn.relu(self.a(x)))


def _nnx_loss(model, x):
    return jnp.mean(jnp.square(model(x).astype(jnp.float32)))


@adam_promotion
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "nnx.jit"])
@pytest.mark.parametrize("weights", ["float32", "bfloat16-exact", "bfloat16-sr"])
@pytest.mark.parametrize("moments", MOMENTS)
def test_nnx_optimizer_matches_plain_optax(moments, weights, jit):
    dtype = jnp.float32 if weights == "float32" else jnp.bfloat16
    policy = "p=f32" if weights == "float32" else "p=bf16,c=bf16,o=f32"

    def tx():
        return mpo.compact_state(
            optax.adamw(1e-2), weights=weights, moments=moments, policy=policy
        )

    x = jax.random.normal(jax.random.key(1), (4, 8), dtype)
    model = _Mlp(nnx.Rngs(0), dtype)
    params = nnx.as_pure(nnx.state(model, nnx.Param))
    plain = tx()
    state = plain.init(params)

    def plain_step(params, state):
        m = nnx.merge(nnx.graphdef(model), params)
        grads = nnx.as_pure(nnx.state(nnx.grad(_nnx_loss)(m, x), nnx.Param))
        updates, state = plain.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    optimizer = nnx.Optimizer(model, tx(), wrt=nnx.Param)

    def nnx_step(model, optimizer):
        optimizer.update(model, nnx.grad(_nnx_loss)(model, x))

    # Each side eager, or each compiled whole: the same operations.
    if jit:
        plain_step, nnx_step = jax.jit(plain_step), nnx.jit(nnx_step)
    for _ in range(3):  # the second update decoded an `nnx.State`
        params, state = plain_step(params, state)
        nnx_step(model, optimizer)

    got = _leaves((nnx.state(model, nnx.Param), optimizer.opt_state))
    want = _leaves((params, state))
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
    compressed = [
        x
        for x in jax.tree.leaves(optimizer.opt_state, is_leaf=_is_compressed)
        if _is_compressed(x)
    ]
    assert len(compressed) == (0 if moments == "float32" else 8)
    assert all(c.tier == moments for c in compressed)


# ------------------------------------------------------------------ zero-size leaves

ZERO_SHAPES = [(64, 0), (0,), (0, 8), (0, 0)]
WEIGHTS = ("float32", "bfloat16-exact", "bfloat16-sr")


@pytest.mark.parametrize("tier", ["bfloat16-sr", "int8", "float8"])
@pytest.mark.parametrize("shape", ZERO_SHAPES)
def test_zero_size_leaf_encodes_and_decodes(tier, shape):
    x = jnp.zeros(shape)
    c = jax.jit(lambda x: codes.encode(x, tier, x.astype(jnp.uint32), block=256))(x)
    out = jax.jit(codes.decode)(c)
    assert out.shape == shape
    assert out.dtype == jnp.float32


@adam_promotion
@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("moments", MOMENTS)
def test_zero_size_leaves_train_in_every_tier(weights, moments):
    policy = "p=f32" if weights == "float32" else "p=bf16,c=bf16,o=f32"
    opt = mpo.compact_state(
        optax.adamw(1e-2), weights=weights, moments=moments, policy=policy
    )
    p32 = {f"z{i}": jnp.zeros(s) for i, s in enumerate(ZERO_SHAPES)}
    p32["w"] = jax.random.normal(jax.random.key(0), (4, 64))
    params = mpo.compact_params(p32, weights)
    state = opt.init(p32)

    @jax.jit
    def step(params, state):
        grads = jax.tree.map(lambda p: jnp.ones_like(p), params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    for _ in range(3):
        params, state = step(params, state)
    for name, shape in zip(p32, [*ZERO_SHAPES, (4, 64)], strict=True):
        assert params[name].shape == shape
        assert params[name].dtype == mpo.compact_params(p32, weights)[name].dtype
        for moment in (state.inner_state[0].mu, state.inner_state[0].nu):
            decoded = codes.decode(moment[name])
            assert decoded.shape == shape
            assert decoded.dtype == jnp.float32
    assert not np.array_equal(np.asarray(params["w"]), np.asarray(p32["w"]))
    assert int(state.num_missed) == 0
    # Into another tier and back: the conversion reads each leaf's blocks.
    other = "float8" if moments == "int8" else "int8"
    target = mpo.compact_state(
        optax.adamw(1e-2), weights=weights, moments=other, policy=policy
    ).init(p32)
    _, converted = compact_state_lib.convert((params, state), (params, target))
    for name, shape in zip(p32, [*ZERO_SHAPES, (4, 64)], strict=True):
        assert codes.decode(converted.inner_state[0].nu[name]).shape == shape


# ------------------------------------------------------------------ many devices


@pytest.fixture(scope="module")
def mesh8():
    return jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


@pytest.fixture
def llvm_optimizer_on():
    """Compiled as JAX compiles by default (the suite turns LLVM's optimizer
    off, conftest.py). With it off, XLA:CPU contracts optax's
    ``0.9 * mu + 0.1 * g`` into one fused multiply-add in the one-device
    program and not in the sharded one (measured: 1 ulp in a first moment of
    the (8,) leaf after 2 steps, any moment tier's arithmetic, not the codes');
    with it on, both compile alike."""
    before = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", False)
    yield
    jax.config.update("jax_disable_most_optimizations", before)


@pytest.mark.parametrize("tier", ["bfloat16-sr", "int8", "float8"])
def test_decoding_a_leaf_sharded_one_element_per_device_matches_one_device(mesh8, tier):
    # One element per shard: XLA folds a broadcast constant into a literal
    # there and rewrote float8's (code / 448)**2 * absmax as code**2 * (1 /
    # 448**2) * absmax, rounded elsewhere.
    one_device, eight = [], []
    for seed in range(8):
        k1, k2 = jax.random.split(jax.random.key(seed))
        nonneg = jax.random.uniform(k1, (8,)) ** 4  # the square code
        sign = jnp.where(jax.random.bernoulli(k2, 0.5, (8,)), -1.0, 1.0)
        for x in (nonneg, nonneg * sign):
            c = codes.encode(x, tier, jnp.zeros((8,), jnp.uint32) + seed, block=256)
            one_device.append(np.asarray(jax.jit(codes.decode)(c)))
            sharded = jax.tree.map(
                lambda a: jax.device_put(
                    a, NamedSharding(mesh8, P("data") if a.shape[0] == 8 else P())
                ),
                c,
            )
            assert sharded.codes.sharding.shard_shape((8,)) == (1,)
            eight.append(np.asarray(jax.jit(codes.decode)(sharded)))
    for a, b in zip(one_device, eight, strict=True):
        np.testing.assert_array_equal(a, b)


@adam_promotion
@pytest.mark.usefixtures("llvm_optimizer_on")
@pytest.mark.parametrize("moments", MOMENTS)
def test_a_leaf_sharded_one_element_per_device_matches_one_device(mesh8, moments):
    # An (8,) bias sharded on 8 devices holds one element per device (the
    # shape test_compact_state.py's 1-vs-8 test does not have).
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    p32 = {
        "w": jax.random.normal(k1, (16, 256)) * 0.05,
        "b": jax.random.normal(k2, (8,)) * 0.05,
        "c": jax.random.normal(k3, (8, 8)) * 0.05,
    }
    opt = mpo.compact_state(
        optax.adamw(1e-2, b2=0.95, weight_decay=0.1),
        weights="bfloat16-sr",
        moments=moments,
        policy="p=bf16,c=bf16,o=f32",
    )

    def grads(i):
        keys = jax.random.split(jax.random.key(1000 + i), len(p32))
        return {
            k: (jax.random.normal(kk, v.shape) * 0.1).astype(jnp.bfloat16)
            for kk, (k, v) in zip(keys, sorted(p32.items()), strict=True)
        }

    def step(p, s, g):
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s

    def run(put):
        p, s = put(mpo.compact_params(p32, "bfloat16-sr")), put(opt.init(p32))
        f = jax.jit(step)
        for i in range(4):
            p, s = f(p, s, put(grads(i)))
        return p, s

    def shard(tree):  # axis 0 wherever 8 divides it
        def put(a):
            spec = P("data") if a.ndim >= 1 and a.shape[0] % 8 == 0 else P()
            return jax.device_put(a, NamedSharding(mesh8, spec))

        return jax.tree.map(put, tree)

    one = run(lambda t: t)
    eight = run(shard)
    assert eight[0]["b"].sharding.shard_shape((8,)) == (1,)
    for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(eight), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
