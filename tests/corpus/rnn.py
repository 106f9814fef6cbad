"""Recurrent networks under lax.scan / fori_loop, and Flax's nn.RNN."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax import lax

from . import Instance, data, program


_dense = data.dense


@program()
def elman_scan():
    """Elman RNN (tanh) under lax.scan over time-major inputs, xent on last state."""
    d_in, d_h, classes, t, b = 6, 16, 3, 10, 4
    ks = data.seeds(60, 3)
    params = {
        "wx": _dense(ks[0], d_in, d_h),
        "wh": _dense(ks[1], d_h, d_h, 0.9),
        "b": data.zeros(d_h),
        "out": _dense(ks[2], d_h, classes),
    }
    xs = data.normal(61, (t, b, d_in))
    y = jnp.array([0, 1, 2, 1], jnp.int32)

    def loss(params, xs, y):
        def cell(h, x):
            h = jnp.tanh(x @ params["wx"] + h @ params["wh"] + params["b"])
            return h, h

        h, _ = lax.scan(cell, jnp.zeros((b, d_h)), xs)
        logits = h @ params["out"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    return Instance(params, (xs, y), loss)


def gru_cell(p, h, x):
    z = jax.nn.sigmoid(x @ p["wz"] + h @ p["uz"] + p["bz"])
    r = jax.nn.sigmoid(x @ p["wr"] + h @ p["ur"] + p["br"])
    n = jnp.tanh(x @ p["wn"] + (r * h) @ p["un"] + p["bn"])
    return (1.0 - z) * n + z * h


@program()
def gru_scan():
    """Hand-written GRU under lax.scan, per-step regression outputs (MSE)."""
    d_in, d_h, t, b = 5, 12, 8, 3
    ks = data.seeds(62, 7)
    p = {}
    for i, g in enumerate("zrn"):
        p["w" + g] = _dense(ks[2 * i], d_in, d_h)
        p["u" + g] = _dense(ks[2 * i + 1], d_h, d_h)
        p["b" + g] = data.zeros(d_h)
    p["out"] = _dense(ks[6], d_h, 1)
    xs = data.normal(63, (b, t, d_in))
    target = jnp.cumsum(xs[..., :1], axis=1) * 0.3

    def loss(p, xs, target):
        def step(h, x):
            h = gru_cell(p, h, x)
            return h, h @ p["out"]

        _, ys = lax.scan(step, jnp.zeros((b, d_h)), jnp.swapaxes(xs, 0, 1))
        return jnp.mean((jnp.swapaxes(ys, 0, 1) - target) ** 2)

    return Instance(p, (xs, target), loss)


class LSTMClassifier(nn.Module):
    @nn.compact
    def __call__(self, x, lengths):
        h = nn.RNN(nn.OptimizedLSTMCell(16))(x, seq_lengths=lengths)
        last = jnp.take_along_axis(h, (lengths - 1)[:, None, None], axis=1)[:, 0]
        return nn.Dense(3)(last)


@program()
def lstm_flax_rnn():
    """Flax nn.RNN(OptimizedLSTMCell) with sequence lengths, last valid state."""
    model = LSTMClassifier()
    x = data.normal(64, (4, 7, 5))
    lengths = jnp.array([7, 5, 2, 6], jnp.int32)
    y = jnp.array([0, 2, 1, 1], jnp.int32)
    params = data.init(model.init, 65, x, lengths)["params"]

    def loss(params, x, lengths, y):
        logits = model.apply({"params": params}, x, lengths)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    return Instance(params, (x, lengths, y), loss)


@program()
def neural_ode_fori():
    """Euler-integrated neural ODE: x += dt * mlp(x) in lax.fori_loop."""
    d = 8
    k1, k2 = data.seeds(66, 2)
    params = {
        "w1": _dense(k1, d, 32),
        "b1": data.zeros(32),
        "w2": _dense(k2, 32, d, 0.5),
    }
    x0 = data.normal(67, (6, d), scale=4.0)
    target = data.normal(68, (6, d), scale=4.0)

    def loss(params, x0, target):
        def body(i, x):
            del i
            dx = jnp.tanh(x @ params["w1"] + params["b1"]) @ params["w2"]
            return x + 0.05 * dx

        x = lax.fori_loop(0, 20, body, x0)
        return jnp.mean((x - target) ** 2)

    return Instance(params, (x0, target), loss)
