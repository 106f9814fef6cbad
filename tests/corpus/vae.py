"""Variational autoencoders whose heads are named like composites ("mean", "norm")."""

from __future__ import annotations

import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax

from . import Instance, data, program


def _binary_images(seed, n, d):
    rng = np.random.default_rng(seed)
    return jnp.asarray((rng.random((n, d)) < 0.3).astype(np.float32))


class Encoder(nn.Module):
    latents: int

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(32, name="fc1")(x))
        mean = nn.Dense(self.latents, name="mean")(x)
        logvar = nn.Dense(self.latents, name="logvar")(x)
        return mean, logvar


class Decoder(nn.Module):
    features: int

    @nn.compact
    def __call__(self, z):
        z = nn.relu(nn.Dense(32, name="fc1")(z))
        return nn.Dense(self.features, name="fc2")(z)


class VAE(nn.Module):
    latents: int = 4
    features: int = 24

    def setup(self):
        self.encoder = Encoder(self.latents)
        self.decoder = Decoder(self.features)

    def __call__(self, x, key):
        mean, logvar = self.encoder(x)
        std = jnp.exp(0.5 * logvar)
        z = mean + std * jax.random.normal(key, mean.shape)
        return self.decoder(z), mean, logvar


def kl_divergence(mean, logvar):
    return -0.5 * jnp.sum(1 + logvar - jnp.square(mean) - jnp.exp(logvar), axis=-1)


@program()
def vae_flax():
    """Flax VAE (Dense heads "mean"/"logvar"), reparameterised with a PRNG key."""
    model = VAE()
    x = _binary_images(30, 16, 24)
    params = data.init(model.init, 31, x, data.key(32))["params"]

    def loss(params, x, key):
        logits, mean, logvar = model.apply({"params": params}, x, key)
        bce = optax.sigmoid_binary_cross_entropy(logits, x).sum(axis=-1)
        return jnp.mean(bce + kl_divergence(mean, logvar))

    return Instance(params, (x, data.key(33)), loss)


@program()
def vae_jnp():
    """Hand-written Gaussian VAE: dict heads "mean"/"logvar", Gaussian NLL."""
    d, h, z = 20, 32, 3
    ks = data.seeds(34, 5)

    def dense(k, m, n):
        return {"w": data.normal(k, (m, n), 1 / np.sqrt(m)), "b": data.zeros(n)}

    params = {
        "enc": dense(ks[0], d, h),
        "mean": dense(ks[1], h, z),
        "logvar": dense(ks[2], h, z),
        "dec": dense(ks[3], z, h),
        "out": dense(ks[4], h, 2 * d),
    }
    x = data.normal(35, (12, d))

    def apply(p, x):
        return x @ p["w"] + p["b"]

    def loss(params, x, key):
        hid = jnp.tanh(apply(params["enc"], x))
        mean, logvar = apply(params["mean"], hid), apply(params["logvar"], hid)
        eps = jax.random.normal(key, mean.shape)
        zs = mean + jnp.exp(0.5 * logvar) * eps
        out = apply(params["out"], jnp.tanh(apply(params["dec"], zs)))
        mu, log_sigma = jnp.split(out, 2, axis=-1)
        nll = 0.5 * ((x - mu) / jnp.exp(log_sigma)) ** 2 + log_sigma
        return jnp.mean(nll.sum(-1) + kl_divergence(mean, logvar))

    return Instance(params, (x, data.key(36)), loss)


def _haiku_vae(x, key):
    h = jax.nn.gelu(hk.Linear(32, name="norm")(x))  # a Dense named "norm"
    mean = hk.Linear(4, name="mean")(h)
    logvar = hk.Linear(4, name="logvar")(h)
    z = mean + jnp.exp(0.5 * logvar) * jax.random.normal(key, mean.shape)
    logits = hk.Linear(x.shape[-1], name="softmax")(jax.nn.gelu(hk.Linear(32)(z)))
    return logits, mean, logvar


@program()
def vae_haiku():
    """Haiku VAE whose Linear layers are named "norm", "mean", "logvar", "softmax"."""
    net = hk.without_apply_rng(hk.transform(_haiku_vae))
    x = _binary_images(37, 12, 16)
    params = data.init(net.init, 38, x, data.key(39))

    def loss(params, x, key):
        logits, mean, logvar = net.apply(params, x, key)
        bce = optax.sigmoid_binary_cross_entropy(logits, x).sum(-1)
        return jnp.mean(bce + kl_divergence(mean, logvar))

    return Instance(params, (x, data.key(40)), loss)
