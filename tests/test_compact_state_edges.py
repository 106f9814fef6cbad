"""Edge cases of `mixprec.optax.compact_state`: Flax NNX's `nnx.Optimizer`,
zero-size leaves, and float8 moments sharded one element per device."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

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
@pytest.mark.parametrize("weights", ["float32", "bfloat16-sr"])
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
