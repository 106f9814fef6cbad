"""Autocast on whole models, against float32 references: CNN with batch norm,
a transformer block, per-example gradients, Flax linen / nnx, Equinox, Haiku."""

import equinox as eqx
import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import BF16, F16, F32, assert_tree_dtypes, assert_trees_close, iter_eqns
from jax import lax

import mixprec


def _low_ops(fn, *args, name):
    return [
        e
        for e in iter_eqns(jax.make_jaxpr(fn)(*args))
        if e.primitive.name == name
        and all(v.aval.dtype in (BF16, F16) for v in e.invars)
    ]


def _check_loss_and_grads(loss, params, *args, dtype=BF16, policy="mixed_bfloat16"):
    f = mixprec.autocast(loss, policy)
    v, g = jax.jit(jax.value_and_grad(f))(params, *args)
    rv, rg = jax.jit(jax.value_and_grad(loss))(params, *args)
    assert v.dtype == F32
    assert_tree_dtypes(g, params)
    assert_trees_close(v, rv, dtype=dtype)
    assert_trees_close(g, rg, dtype=dtype, grad=True)
    return f


# ------------------------------------------------------------------ CNN + batch norm


def _cnn_init(key):
    k1, k2, k3 = jax.random.split(key, 3)
    return {
        "conv1": jax.random.normal(k1, (8, 3, 3, 3)) / np.sqrt(27),
        "gamma": jnp.ones((8,)),
        "beta": jnp.zeros((8,)),
        "conv2": jax.random.normal(k2, (8, 8, 3, 3)) / np.sqrt(72),
        "dense": jax.random.normal(k3, (8, 10)) / np.sqrt(8),
    }


def _batch_norm(x, gamma, beta):
    mean = jnp.mean(x, axis=(0, 2, 3), keepdims=True)
    var = jnp.var(x, axis=(0, 2, 3), keepdims=True)
    x = (x - mean) * lax.rsqrt(var + 1e-5)
    return x * gamma[None, :, None, None] + beta[None, :, None, None]


def _cnn_loss(p, x, labels):
    dn = ("NCHW", "OIHW", "NCHW")
    h = lax.conv_general_dilated(x, p["conv1"], (1, 1), "SAME", dimension_numbers=dn)
    h = jax.nn.relu(_batch_norm(h, p["gamma"], p["beta"]))
    h = lax.conv_general_dilated(h, p["conv2"], (2, 2), "SAME", dimension_numbers=dn)
    h = jax.nn.relu(h).mean(axis=(2, 3))
    logits = h @ p["dense"]
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=1))


def test_cnn_with_batch_norm():
    key = jax.random.key(0)
    params = _cnn_init(key)
    x = jax.random.normal(jax.random.key(1), (4, 3, 8, 8))
    labels = jnp.array([0, 3, 5, 9])
    f = _check_loss_and_grads(_cnn_loss, params, x, labels)
    assert len(_low_ops(f, params, x, labels, name="conv_general_dilated")) == 2
    # batch-norm statistics run in float32
    rsqrt = [
        e
        for e in iter_eqns(jax.make_jaxpr(f)(params, x, labels))
        if e.primitive.name == "rsqrt"
    ]
    assert rsqrt and all(e.outvars[0].aval.dtype == F32 for e in rsqrt)


# ------------------------------------------------------------------ transformer


def _layer_norm(x, g, b):
    mu = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean((x - mu) ** 2, axis=-1, keepdims=True)
    return (x - mu) * lax.rsqrt(var + 1e-5) * g[None, None, :] + b[None, None, :]


def _dropout(key, x, rate):
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x))


def _block(p, x, key, *, heads=2, rate=0.1):
    b, t, d = x.shape
    h = _layer_norm(x, p["ln1_g"], p["ln1_b"])
    qkv = h @ p["wqkv"]
    q, k, v = jnp.split(qkv, 3, axis=-1)
    q = q.reshape(b, t, heads, d // heads)
    k = k.reshape(b, t, heads, d // heads)
    v = v.reshape(b, t, heads, d // heads)
    att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // heads)
    mask = jnp.tril(jnp.ones((t, t), bool))
    att = jnp.where(mask[None, None], att, jnp.full_like(att, -1e9))
    att = jax.nn.softmax(att, axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, t, d)
    x = x + _dropout(key, out @ p["wo"], rate)
    h = _layer_norm(x, p["ln2_g"], p["ln2_b"])
    h = jax.nn.gelu(h @ p["w1"]) @ p["w2"]
    return x + h


def _block_params(key, d=16):
    ks = jax.random.split(key, 4)
    return {
        "ln1_g": jnp.ones((d,)),
        "ln1_b": jnp.zeros((d,)),
        "wqkv": jax.random.normal(ks[0], (d, 3 * d)) / np.sqrt(d),
        "wo": jax.random.normal(ks[1], (d, d)) / np.sqrt(d),
        "ln2_g": jnp.ones((d,)),
        "ln2_b": jnp.zeros((d,)),
        "w1": jax.random.normal(ks[2], (d, 4 * d)) / np.sqrt(d),
        "w2": jax.random.normal(ks[3], (4 * d, d)) / np.sqrt(4 * d),
    }


def test_transformer_block():
    params = _block_params(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (2, 6, 16))
    key = jax.random.key(2)

    def loss(p, x, key):
        return jnp.mean(_block(p, x, key) ** 2)

    f = _check_loss_and_grads(loss, params, x, key)
    # attention einsums and projections are bf16; softmax's exp is float32
    assert len(_low_ops(f, params, x, key, name="dot_general")) >= 6
    jx = jax.make_jaxpr(f)(params, x, key)
    exps = [e for e in iter_eqns(jx) if e.primitive.name == "exp"]
    assert exps and all(e.invars[0].aval.dtype == F32 for e in exps)


@pytest.mark.parametrize("policy,dtype", [("mixed_float16", F16)])
def test_transformer_block_float16(policy, dtype):
    params = _block_params(jax.random.key(3))
    x = jax.random.normal(jax.random.key(4), (2, 6, 16))
    y = mixprec.autocast(_block, policy)(params, x, jax.random.key(5))
    assert y.dtype == F32
    assert_trees_close(y, jax.jit(_block)(params, x, jax.random.key(5)), dtype=BF16)
    assert dtype == F16


# ------------------------------------------------------------------ per-example grads


def test_vmap_per_example_gradients():
    k1, k2 = jax.random.split(jax.random.key(0))
    params = {
        "w1": jax.random.normal(k1, (8, 16)) / np.sqrt(8),
        "w2": jax.random.normal(k2, (16, 1)) / 4.0,
    }
    x = jax.random.normal(jax.random.key(1), (6, 8))
    y = jax.random.normal(jax.random.key(2), (6,))

    def loss(p, x, y):  # one example
        h = jax.nn.gelu(x @ p["w1"])
        return (h @ p["w2"])[0] - y

    f = mixprec.autocast(lambda p, x, y: loss(p, x, y) ** 2, "mixed_bfloat16")
    per_ex = jax.jit(jax.vmap(jax.grad(f), (None, 0, 0)))
    g = per_ex(params, x, y)
    ref = jax.jit(jax.vmap(jax.grad(lambda p, x, y: loss(p, x, y) ** 2), (None, 0, 0)))(
        params, x, y
    )
    assert jax.tree.map(lambda a: a.shape, g) == {"w1": (6, 8, 16), "w2": (6, 16, 1)}
    assert_tree_dtypes(g, ref)
    assert_trees_close(g, ref, dtype=BF16, grad=True)


# ------------------------------------------------------------------ Flax linen


class _LinenNet(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Conv(8, (3, 3), use_bias=False)(x)
        x = nn.BatchNorm(use_running_average=not train)(x)
        x = nn.relu(x).mean(axis=(1, 2))
        x = nn.LayerNorm()(x)
        return nn.Dense(4)(x)


@pytest.mark.standard_promotion
def test_flax_linen_model():
    model = _LinenNet()
    x = jax.random.normal(jax.random.key(0), (2, 6, 6, 3))
    variables = model.init(jax.random.key(1), x)
    params, stats = variables["params"], variables["batch_stats"]

    def loss(params, stats, x):
        y, upd = model.apply(
            {"params": params, "batch_stats": stats}, x, mutable=["batch_stats"]
        )
        return jnp.mean(y**2), upd

    f = mixprec.autocast(loss, "mixed_bfloat16")
    (v, upd), g = jax.jit(jax.value_and_grad(f, has_aux=True))(params, stats, x)
    (rv, rupd), rg = jax.jit(jax.value_and_grad(loss, has_aux=True))(params, stats, x)
    assert_tree_dtypes(g, params)
    assert_tree_dtypes(upd, rupd)
    assert_trees_close(v, rv, dtype=BF16)
    assert_trees_close(upd, rupd, dtype=BF16)
    assert_trees_close(g, rg, dtype=BF16, grad=True)
    assert _low_ops(f, params, stats, x, name="conv_general_dilated")
    assert _low_ops(f, params, stats, x, name="dot_general")


# ------------------------------------------------------------------ Flax nnx


class _NnxNet(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(8, 16, rngs=rngs)
        self.norm = nnx.LayerNorm(16, rngs=rngs)
        self.l2 = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return self.l2(jax.nn.gelu(self.norm(self.l1(x))))


@pytest.mark.standard_promotion
def test_flax_nnx_model():
    model = _NnxNet(nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    x = jax.random.normal(jax.random.key(1), (5, 8))

    def loss(state, x):
        return jnp.mean(nnx.merge(graphdef, state)(x) ** 2)

    f = _check_loss_and_grads(loss, state, x)
    assert len(_low_ops(f, state, x, name="dot_general")) == 2


# ------------------------------------------------------------------ Equinox


def test_equinox_model():
    model = eqx.nn.MLP(
        8, 4, width_size=16, depth=2, activation=jax.nn.silu, key=jax.random.key(0)
    )
    x = jax.random.normal(jax.random.key(1), (5, 8))
    params, static = eqx.partition(model, eqx.is_array)

    def loss(params, x):
        m = eqx.combine(params, static)
        return jnp.mean(jax.vmap(m)(x) ** 2)

    f = _check_loss_and_grads(loss, params, x)
    assert len(_low_ops(f, params, x, name="dot_general")) == 3
    # the module itself (with static fields) can be an argument too
    y = mixprec.autocast(lambda m, x: jax.vmap(m)(x), "mixed_bfloat16")(model, x)
    assert y.dtype == F32
    ref = eqx.filter_jit(lambda m, x: jax.vmap(m)(x))(model, x)
    assert_trees_close(y, ref, dtype=BF16)


# ------------------------------------------------------------------ Haiku


@pytest.mark.standard_promotion
def test_haiku_model():
    def forward(x):
        h = hk.Linear(16)(x)
        h = hk.LayerNorm(axis=-1, create_scale=True, create_offset=True)(h)
        return hk.Linear(4)(jax.nn.relu(h))

    net = hk.without_apply_rng(hk.transform(forward))
    x = jax.random.normal(jax.random.key(1), (5, 8))
    params = net.init(jax.random.key(0), x)

    def loss(params, x):
        return jnp.mean(net.apply(params, x) ** 2)

    f = _check_loss_and_grads(loss, params, x)
    assert len(_low_ops(f, params, x, name="dot_general")) == 2
