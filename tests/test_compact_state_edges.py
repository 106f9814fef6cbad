"""Edge cases of `mixprec.optax.compact_state`: Flax NNX's `nnx.Optimizer`,
zero-size leaves, and float8 moments sharded one element per device."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import mixprec.optax as mpo
from mixprec._src.compact import codes


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
