"""Multi-layer perceptrons in plain jnp, Flax linen and NNX, Equinox and Haiku."""

from __future__ import annotations

import equinox as eqx
import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax import lax

from . import Instance, data, program


# ---------------------------------------------------------------- plain jnp


def init_mlp(seed, sizes):
    """[(w, b), ...] with He initialisation, as in JAX's own examples."""
    params = []
    shapes = zip(sizes[:-1], sizes[1:], strict=False)
    for k, (m, n) in zip(data.seeds(seed, len(sizes) - 1), shapes, strict=True):
        params.append(
            {"w": data.normal(k, (m, n), np.sqrt(2.0 / m)), "b": data.zeros(n)}
        )
    return params


def mlp_apply(params, x):
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def mlp_loss(params, x, y):
    logits = mlp_apply(params, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


@program()
def mlp_jnp():
    """jnp MLP 64-64-32-10, relu, optax integer-label cross-entropy."""
    x, y = data.classification(0, 32, 64, 10)
    params = init_mlp(1, [64, 64, 32, 10])
    return Instance(params, (x, y), mlp_loss)


@program()
def mlp_dropout():
    """jnp MLP with inverted dropout from a PRNG key argument, squared error."""
    x = data.normal(2, (16, 24))
    t = data.normal(3, (16, 4))
    params = init_mlp(4, [24, 48, 48, 4])

    def loss(params, x, t, key):
        for layer in params[:-1]:
            x = jax.nn.silu(x @ layer["w"] + layer["b"])
            key, sub = jax.random.split(key)
            keep = jax.random.bernoulli(sub, 0.9, x.shape)
            x = jnp.where(keep, x / 0.9, 0.0)
        out = x @ params[-1]["w"] + params[-1]["b"]
        return jnp.mean((out - t) ** 2)

    return Instance(params, (x, t, data.key(5)), loss)


@program()
def mlp_highest():
    """MLP whose output projection asks for precision=HIGHEST (stays float32)."""
    x, y = data.classification(6, 16, 32, 8)
    params = init_mlp(7, [32, 32, 8])

    def loss(params, x, y):
        h = jnp.tanh(x @ params[0]["w"] + params[0]["b"])
        logits = jnp.dot(h, params[1]["w"], precision=lax.Precision.HIGHEST)
        logits = logits + params[1]["b"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    return Instance(params, (x, y), loss, highest_dots=1)


# ---------------------------------------------------------------- Flax linen


class FlaxMLP(nn.Module):
    features: tuple[int, ...] = (64, 32)
    classes: int = 10

    @nn.compact
    def __call__(self, x):
        for f in self.features:
            x = nn.gelu(nn.Dense(f)(x))
        return nn.Dense(self.classes, name="head")(x)


@program()
def mlp_flax():
    """Flax linen MLP (Dense + gelu), optax cross-entropy on one-hot labels."""
    model = FlaxMLP()
    x, y = data.classification(8, 16, 20, 10)
    params = data.init(model.init, 9, x)["params"]

    def loss(params, x, y):
        logits = model.apply({"params": params}, x)
        return optax.softmax_cross_entropy(logits, jax.nn.one_hot(y, 10)).mean()

    return Instance(params, (x, y), loss)


# ---------------------------------------------------------------- Equinox


@program()
def mlp_equinox():
    """eqx.nn.MLP applied with vmap, partitioned into arrays and static parts."""
    model = data.eqx_init(
        lambda key: eqx.nn.MLP(
            16, 3, width_size=32, depth=2, activation=jax.nn.softplus, key=key
        ),
        10,
    )
    params, static = eqx.partition(model, eqx.is_inexact_array)
    x = data.normal(11, (12, 16))
    t = data.normal(12, (12, 3))

    def loss(params, x, t):
        model = eqx.combine(params, static)
        pred = jax.vmap(model)(x)
        return jnp.mean(optax.huber_loss(pred, t))

    return Instance(params, (x, t), loss)


@program("fn")
def mlp_equinox_module():
    """The whole eqx.nn.MLP as an argument (its activation a leaf that is a
    function: filter_jit), applied with vmap; its log-probabilities are
    compared."""
    model = data.eqx_init(
        lambda key: eqx.nn.MLP(
            8, 4, width_size=16, depth=2, activation=jax.nn.silu, key=key
        ),
        903,
    )
    x = data.normal(904, (5, 8))

    def forward(model, x):
        return jax.nn.log_softmax(jax.vmap(model)(x))

    return Instance(model, (x,), forward, kind="fn", jit=eqx.filter_jit)


# ---------------------------------------------------------------- Flax NNX


class NnxMLP(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(8, 16, rngs=rngs)
        self.norm = nnx.LayerNorm(16, rngs=rngs)
        self.l2 = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return self.l2(jax.nn.gelu(self.norm(self.l1(x))))


@program("standard_promotion")
def mlp_nnx_split_merge():
    """Flax NNX Linear + LayerNorm, its state split off and merged back inside
    the loss (the functional NNX API)."""
    graphdef, state = nnx.split(NnxMLP(nnx.Rngs(905)))
    x, y = data.classification(906, 5, 8, 4)

    def loss(state, x, y):
        logits = nnx.merge(graphdef, state)(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    return Instance(state, (x, y), loss)


# ---------------------------------------------------------------- Haiku


def _haiku_forward(x):
    return hk.nets.MLP([32, 32, 5], activation=jax.nn.elu)(x)


@program()
def mlp_haiku():
    """hk.nets.MLP under hk.without_apply_rng(hk.transform), log-softmax NLL."""
    net = hk.without_apply_rng(hk.transform(_haiku_forward))
    x, y = data.classification(13, 16, 12, 5)
    params = data.init(net.init, 14, x)

    def loss(params, x, y):
        logp = jax.nn.log_softmax(net.apply(params, x))
        return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=-1))

    return Instance(params, (x, y), loss)


def _haiku_layernorm_forward(x):
    h = hk.Linear(16)(x)
    h = hk.LayerNorm(axis=-1, create_scale=True, create_offset=True)(h)
    return hk.Linear(4)(jax.nn.relu(h))


@program("standard_promotion")
def mlp_haiku_layernorm():
    """hk.Linear + hk.LayerNorm (which mixes its float32 parameters with its
    input's dtype) + hk.Linear."""
    net = hk.without_apply_rng(hk.transform(_haiku_layernorm_forward))
    x = data.normal(907, (5, 8))
    params = data.init(net.init, 908, x)

    def loss(params, x):
        return jnp.mean(net.apply(params, x) ** 2)

    return Instance(params, (x,), loss)
