"""Convolutional networks: Flax with BatchNorm, lax convs (group and batch norm by
hand), Equinox, conv1d."""

from __future__ import annotations

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from . import Instance, data, program


# ---------------------------------------------------------------- Flax + BatchNorm


class FlaxCNN(nn.Module):
    classes: int = 4

    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Conv(8, (3, 3), use_bias=False)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        x = nn.relu(x)
        x = nn.max_pool(x, (2, 2), strides=(2, 2))
        x = nn.Conv(16, (3, 3), use_bias=False)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9, name="norm")(x)
        x = nn.relu(x)
        x = x.mean(axis=(1, 2))
        return nn.Dense(self.classes)(x)


def flax_cnn_loss(model):
    def loss(params, batch_stats, x, y):
        logits, updates = model.apply(
            {"params": params, "batch_stats": batch_stats},
            x,
            train=True,
            mutable=["batch_stats"],
        )
        xent = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return xent, updates["batch_stats"]

    return loss


@program()
def cnn_flax_batchnorm():
    """Flax Conv + BatchNorm (batch stats mutable, returned as aux) + max_pool."""
    model = FlaxCNN()
    x, y = data.images(20, 8, 8, 1, 4)
    variables = data.init(model.init, 21, x, train=False)
    return Instance(
        variables["params"],
        (variables["batch_stats"], x, y),
        flax_cnn_loss(model),
        has_aux=True,
    )


# ---------------------------------------------------------------- lax convs


def _group_norm(x, scale, bias, groups, eps=1e-5):
    n, h, w, c = x.shape
    g = x.reshape(n, h, w, groups, c // groups)
    mean = g.mean(axis=(1, 2, 4), keepdims=True)
    var = ((g - mean) ** 2).mean(axis=(1, 2, 4), keepdims=True)
    g = (g - mean) / jnp.sqrt(var + eps)
    return g.reshape(n, h, w, c) * scale + bias


@program()
def cnn_lax_groupnorm():
    """lax.conv_general_dilated NHWC + hand-written group norm + avg pool."""
    k1, k2, k3 = data.seeds(22, 3)
    params = {
        "conv1": data.normal(k1, (3, 3, 3, 8), 1 / np.sqrt(27.0)),
        "scale": data.ones(8),
        "bias": data.zeros(8),
        "conv2": data.normal(k2, (3, 3, 8, 8), 1 / np.sqrt(72.0)),
        "dense": data.normal(k3, (8, 6), 1 / np.sqrt(8.0)),
    }
    x, y = data.images(23, 6, 8, 3, 6)
    dn = ("NHWC", "HWIO", "NHWC")

    def loss(p, x, y):
        h = lax.conv_general_dilated(
            x, p["conv1"], (1, 1), "SAME", dimension_numbers=dn
        )
        h = jax.nn.swish(_group_norm(h, p["scale"], p["bias"], groups=2))
        h = lax.conv_general_dilated(
            h, p["conv2"], (2, 2), "SAME", dimension_numbers=dn
        )
        h = (
            lax.reduce_window(h, 0.0, lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
            / 4.0
        )
        logits = jax.nn.relu(h).mean(axis=(1, 2)) @ p["dense"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    return Instance(params, (x, y), loss)


def _batch_norm_nchw(x, gamma, beta, eps=1e-5):
    mean = jnp.mean(x, axis=(0, 2, 3), keepdims=True)
    var = jnp.var(x, axis=(0, 2, 3), keepdims=True)
    x = (x - mean) * lax.rsqrt(var + eps)
    return x * gamma[None, :, None, None] + beta[None, :, None, None]


@program()
def cnn_lax_batchnorm_nchw():
    """lax convs NCHW/OIHW + hand-written batch norm (jnp.var, rsqrt) +
    log_softmax NLL by take_along_axis."""
    k1, k2, k3 = data.seeds(901, 3)
    params = {
        "conv1": data.normal(k1, (8, 3, 3, 3), 1 / np.sqrt(27.0)),
        "gamma": data.ones(8),
        "beta": data.zeros(8),
        "conv2": data.normal(k2, (8, 8, 3, 3), 1 / np.sqrt(72.0)),
        "dense": data.normal(k3, (8, 10), 1 / np.sqrt(8.0)),
    }
    x = data.normal(902, (4, 3, 8, 8))
    labels = jnp.array([0, 3, 5, 9], jnp.int32)
    dn = ("NCHW", "OIHW", "NCHW")

    def loss(p, x, labels):
        h = lax.conv_general_dilated(
            x, p["conv1"], (1, 1), "SAME", dimension_numbers=dn
        )
        h = jax.nn.relu(_batch_norm_nchw(h, p["gamma"], p["beta"]))
        h = lax.conv_general_dilated(
            h, p["conv2"], (2, 2), "SAME", dimension_numbers=dn
        )
        logp = jax.nn.log_softmax(jax.nn.relu(h).mean(axis=(2, 3)) @ p["dense"])
        return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=1))

    return Instance(params, (x, labels), loss)


# ---------------------------------------------------------------- Equinox


class EqxCNN(eqx.Module):
    conv1: eqx.nn.Conv2d
    norm: eqx.nn.GroupNorm
    conv2: eqx.nn.Conv2d
    pool: eqx.nn.MaxPool2d
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.conv1 = eqx.nn.Conv2d(1, 8, 3, padding=1, key=k1)
        self.norm = eqx.nn.GroupNorm(4, 8)
        self.conv2 = eqx.nn.Conv2d(8, 8, 3, padding=1, key=k2)
        self.pool = eqx.nn.MaxPool2d(2, 2)
        self.head = eqx.nn.Linear(8, 4, key=k3)

    def __call__(self, x):  # one CHW image
        x = jax.nn.relu(self.norm(self.conv1(x)))
        x = self.pool(jax.nn.relu(self.conv2(x)))
        return self.head(jnp.mean(x, axis=(1, 2)))


@program()
def cnn_equinox():
    """Equinox Conv2d + GroupNorm + MaxPool2d, vmapped over the batch."""
    model = data.eqx_init(EqxCNN, 24)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    x, y = data.images(25, 6, 8, 1, 4)
    x = jnp.asarray(np.transpose(np.asarray(x), (0, 3, 1, 2)))

    def loss(params, x, y):
        logits = jax.vmap(eqx.combine(params, static))(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    return Instance(params, (x, y), loss)


# ---------------------------------------------------------------- residual CNN


class ResBlock(nn.Module):
    features: int

    @nn.compact
    def __call__(self, x):
        h = nn.GroupNorm(num_groups=4)(x)
        h = nn.Conv(self.features, (3, 3))(nn.gelu(h))
        h = nn.GroupNorm(num_groups=4)(h)
        h = nn.Conv(self.features, (3, 3))(nn.gelu(h))
        return x + h


class ResNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Conv(8, (3, 3), name="stem")(x)
        x = ResBlock(8)(x)
        x = nn.avg_pool(x, (2, 2), strides=(2, 2))
        return nn.Dense(3)(x.mean(axis=(1, 2)))


@program("standard_promotion")
def resnet_flax():
    """Flax residual CNN (GroupNorm, conv, skip connections, avg_pool).

    Flax's avg_pool divides by an int: it needs standard promotion.
    """
    model = ResNet()
    x, y = data.images(26, 4, 8, 2, 3)
    params = data.init(model.init, 27, x)["params"]

    def loss(params, x, y):
        logits = model.apply({"params": params}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    return Instance(params, (x, y), loss)


# ---------------------------------------------------------------- conv1d


@program()
def conv1d_sequence():
    """Causal conv1d over token embeddings (lax NWC conv, dilation 2) + pooling."""
    vocab, d = 20, 16
    k1, k2, k3, k4 = data.seeds(28, 4)
    params = {
        "embed": data.normal(k1, (vocab, d), 0.5),
        "conv1": data.normal(k2, (3, d, d), 1 / np.sqrt(3 * d)),
        "conv2": data.normal(k3, (3, d, d), 1 / np.sqrt(3 * d)),
        "out": data.normal(k4, (d, 2), 1 / np.sqrt(d)),
    }
    tokens, _ = data.tokens(29, 6, 12, vocab)
    labels = (tokens[:, 0] % 2).astype(jnp.int32)
    dn = ("NWC", "WIO", "NWC")

    def loss(p, tokens, labels):
        h = p["embed"][tokens]
        h = lax.conv_general_dilated(
            h, p["conv1"], (1,), [(2, 0)], dimension_numbers=dn
        )
        h = jax.nn.gelu(h)
        h = h + lax.conv_general_dilated(
            h, p["conv2"], (1,), [(4, 0)], rhs_dilation=(2,), dimension_numbers=dn
        )
        logits = jnp.max(h, axis=1) @ p["out"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    return Instance(params, (tokens, labels), loss)


# ---------------------------------------------------------------- pooling


LOSS_SCALE = 1024.0


def raw_pixels(seed: int, n: int, hw: int, c: int, classes: int):
    """Un-normalised 8-bit pixel values (0..255), as images are often fed."""
    x, y = data.images(seed, n, hw, c, classes)
    return jnp.clip(x * 60.0 + 128.0, 0.0, 255.0), y


class PoolCNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(8, (3, 3))(x))
        x = nn.max_pool(x, (2, 2), strides=(2, 2))
        x = nn.relu(nn.Conv(8, (3, 3))(x))
        x = nn.avg_pool(x, (16, 16))  # global average pool of a 16x16 map
        return nn.Dense(4)(x.reshape(x.shape[0], -1))


@program("standard_promotion")
def cnn_global_avg_pool_raw_pixels():
    """Flax CNN on raw 0..255 pixels: max_pool, then a 16x16 global avg_pool.

    The pooled activations are in the hundreds: a 256-term windowed sum of
    them overflows float16 unless it accumulates in float32. The loss carries
    a static loss scale, as float16 training does: the cotangents of
    activations in the hundreds, averaged over 256 positions, are float16
    subnormals without one. Flax's avg_pool divides by an int: it needs
    standard promotion.
    """
    model = PoolCNN()
    x, y = raw_pixels(30, 6, 32, 1, 4)
    params = data.init(model.init, 31, x)["params"]
    # He-style gain: the pooled map averages about 300, so its 256-term sum
    # is beyond float16's largest value.
    params = {**params, "Conv_1": {**params["Conv_1"]}}
    params["Conv_1"]["kernel"] = params["Conv_1"]["kernel"] * 6.0

    def loss(params, x, y):
        logits = model.apply({"params": params}, x) / 1000.0
        xent = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return xent * LOSS_SCALE

    return Instance(params, (x, y), loss)


@program()
def cnn_lax_pools_raw_pixels():
    """lax convs on raw pixels, a max pool and a global pool by reduce_window.

    The global pool is a 16x16 windowed sum of values in the hundreds; the
    loss is scaled as in :func:`cnn_global_avg_pool_raw_pixels`.
    """
    k1, k2, k3 = data.seeds(32, 3)
    params = {
        "conv1": data.normal(k1, (3, 3, 3, 8), 1 / np.sqrt(27.0)),
        "conv2": data.normal(k2, (3, 3, 8, 8), 6 / np.sqrt(72.0)),
        "dense": data.normal(k3, (8, 4), 1 / np.sqrt(8.0)),
    }
    x, y = raw_pixels(33, 4, 32, 3, 4)
    dn = ("NHWC", "HWIO", "NHWC")

    def loss(p, x, y):
        h = lax.conv_general_dilated(
            x, p["conv1"], (1, 1), "SAME", dimension_numbers=dn
        )
        h = jax.nn.relu(h)
        h = lax.reduce_window(h, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
        h = lax.conv_general_dilated(
            h, p["conv2"], (1, 1), "SAME", dimension_numbers=dn
        )
        h = jax.nn.relu(h)
        win = (1, 16, 16, 1)
        pooled = lax.reduce_window(h, 0.0, lax.add, win, win, "VALID") / 256.0
        logits = pooled.reshape(pooled.shape[0], -1) @ p["dense"] / 1000.0
        xent = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return xent * LOSS_SCALE

    return Instance(params, (x, y), loss)
