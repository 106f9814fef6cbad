"""Residual streams, hand-written norms and variances, and cross-entropies."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax import lax

from . import Instance, data, program


_dense = data.dense


# ---------------------------------------------------------------- residual stream


def _check_residual_stream(policy, got, ref):
    """The float32 stream (|x| ~ 20) must never be rounded to the low dtype.

    Rounding it once to bfloat16 moves values in [16, 32) by up to 1/16
    (1/128 in float16); the branches add only 0.02 * tanh(...) per block, whose
    own low-precision error is a thousand times smaller.
    """
    low = {"mixed_bfloat16": jnp.bfloat16, "mixed_float16": jnp.float16}[policy]
    spacing = 16 * float(jnp.finfo(low).eps)  # grid step of `low` in [16, 32)
    (_, stream), _ = got
    (_, ref_stream), _ = ref
    assert stream.dtype == jnp.float32
    err = float(jnp.max(jnp.abs(stream - ref_stream)))
    assert err < spacing / 8, f"stream error {err:.3g}: rounded to {low.__name__}?"


@program()
def residual_stream():
    """x + 0.02 * tanh(x @ w) over 6 blocks; the stream (|x| ~ 20) is an argument."""
    d = 16
    # x @ w is O(1): the branches are not saturated, the gradients well posed.
    params = {"w": [_dense(k, d, d, 0.05) for k in data.seeds(70, 6)]}
    x = 20.0 + data.normal(71, (4, 8, d), scale=3.0)
    target = x + 0.05

    def loss(params, x, target):
        for w in params["w"]:
            x = x + 0.02 * jnp.tanh(x @ w)
        return jnp.mean((x - target) ** 2), x

    return Instance(
        params, (x, target), loss, has_aux=True, check=_check_residual_stream
    )


# ---------------------------------------------------------------- norms by hand


def layer_norm(x, gamma, beta, eps=1e-6):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return gamma * (x - mean) / jnp.sqrt(var + eps) + beta


@program()
def layernorm_hand():
    """Dense -> hand-written layer norm (mean of squared deviations) -> gelu."""
    ks = data.seeds(72, 2)
    params = {
        "w1": _dense(ks[0], 12, 32, 8.0),
        "gamma": data.ones(32),
        "beta": data.zeros(32),
        "w2": _dense(ks[1], 32, 4),
    }
    x = data.normal(73, (10, 12))
    t = data.normal(74, (10, 4))

    def loss(p, x, t):
        h = jax.nn.gelu(layer_norm(x @ p["w1"], p["gamma"], p["beta"]))
        return jnp.mean((h @ p["w2"] - t) ** 2)

    return Instance(params, (x, t), loss)


def rms_norm(x, scale, eps=1e-6):
    ms = jnp.mean(x**2, axis=-1, keepdims=True)
    return x * lax.rsqrt(ms + eps) * (1.0 + scale)


@program()
def rmsnorm_hand():
    """LLaMA-style RMS norm by hand (x**2) on activations of size ~300."""
    ks = data.seeds(75, 2)
    params = {
        "w1": _dense(ks[0], 16, 32, 300.0),
        "scale": data.zeros(32),
        "w2": _dense(ks[1], 32, 3),
    }
    x, y = data.classification(76, 12, 16, 3)

    def loss(p, x, y):
        h = jax.nn.silu(rms_norm(x @ p["w1"], p["scale"]))
        logits = h @ p["w2"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    return Instance(params, (x, y), loss)


@program()
def flax_norm_modules():
    """Flax nn.LayerNorm / nn.RMSNorm modules, and a Dense named "layernorm"."""

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(32, name="layernorm")(x)  # a Dense, whatever its name
            x = nn.RMSNorm(name="rms")(nn.gelu(x))
            x = nn.Dense(32, name="mean")(x)
            x = nn.LayerNorm(name="ln")(x)
            return nn.Dense(2, name="softmax")(nn.relu(x))

    model = Net()
    x = data.normal(77, (8, 10), scale=30.0)
    t = data.normal(78, (8, 2))
    params = data.init(model.init, 79, x)["params"]

    def loss(params, x, t):
        return optax.l2_loss(model.apply({"params": params}, x), t).mean()

    return Instance(params, (x, t), loss)


# ---------------------------------------------------------------- variance, square


@program()
def variance_hand():
    """Batch standardisation with a hand-written variance, plus a jnp.var penalty."""
    ks = data.seeds(80, 2)
    params = {"w1": _dense(ks[0], 8, 16, 10.0), "w2": _dense(ks[1], 16, 1)}
    x = 50.0 + data.normal(81, (32, 8), scale=5.0)
    t = data.normal(82, (32, 1))

    def loss(p, x, t):
        h = x @ p["w1"]
        mu = jnp.sum(h, axis=0) / h.shape[0]
        var = jnp.sum((h - mu) ** 2, axis=0) / (h.shape[0] - 1)
        h = (h - mu) / jnp.sqrt(var + 1e-5)
        pred = jnp.tanh(h) @ p["w2"]
        return jnp.mean((pred - t) ** 2) + 0.1 * jnp.var(pred)

    return Instance(params, (x, t), loss)


def _check_no_overflow(policy, got, ref):
    del policy, ref
    value, grads = got
    assert bool(jnp.isfinite(value)), value
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))


@program()
def square_large_values():
    """jnp.square of activations ~300 (90000 > float16's max) in an energy loss.

    The loss is divided by 100, not by the energy (~1e5): that would put the
    cotangents near float16's subnormals, which is what loss scaling is for.
    """
    params = {"w": _dense(83, 8, 16, 300.0), "v": _dense(84, 16, 1)}
    x = data.normal(85, (12, 8))

    def loss(p, x):
        h = x @ p["w"]
        energy = jnp.mean(jnp.square(h), axis=-1)
        return (jnp.mean(jnp.square(h @ p["v"])) + jnp.mean(energy)) / 100.0

    return Instance(params, (x,), loss, check=_check_no_overflow)


# ---------------------------------------------------------------- cross-entropies


def _classifier(seed, d=16, classes=7):
    ks = data.seeds(seed, 2)
    params = {
        "w1": _dense(ks[0], d, 32),
        "b1": data.zeros(32),
        "w2": _dense(ks[1], 32, classes, 3.0),
    }
    x, y = data.classification(seed + 1, 16, d, classes)
    return params, x, y


def _logits(p, x):
    return jax.nn.relu(x @ p["w1"] + p["b1"]) @ p["w2"]


@program()
def xent_logsumexp_hand():
    """Cross-entropy by hand: logits - logsumexp(logits), one-hot labels."""
    params, x, y = _classifier(86)

    def loss(p, x, y):
        logits = _logits(p, x)
        logp = logits - jax.scipy.special.logsumexp(logits, axis=-1, keepdims=True)
        return -jnp.mean(jnp.sum(jax.nn.one_hot(y, 7) * logp, axis=-1))

    return Instance(params, (x, y), loss)


@program()
def xent_log_of_softmax():
    """The naive form: -sum(onehot * log(softmax(logits) + 1e-9))."""
    params, x, y = _classifier(88)

    def loss(p, x, y):
        probs = jax.nn.softmax(_logits(p, x))
        return -jnp.mean(jnp.sum(jax.nn.one_hot(y, 7) * jnp.log(probs + 1e-9), axis=-1))

    return Instance(params, (x, y), loss)


@program()
def xent_optax_label_smoothing():
    """optax.smooth_labels + softmax_cross_entropy + L2 penalty on all weights."""
    params, x, y = _classifier(90)

    def loss(p, x, y):
        labels = optax.smooth_labels(jax.nn.one_hot(y, 7), 0.1)
        xent = optax.softmax_cross_entropy(_logits(p, x), labels).mean()
        l2 = sum(jnp.sum(w**2) for w in jax.tree.leaves(p))
        return xent + 1e-3 * l2

    return Instance(params, (x, y), loss)


# ------------------------------------------------------- statistics through scan


@program()
def layernorm_stats_as_scan_xs():
    """Per-step layer norm under lax.scan, its mean and variance computed for
    the whole sequence outside the loop and passed in as ``xs``.

    Padded steps are zero vectors: their rows have zero variance, and with
    BERT's eps of 1e-12 (0 in float16) only a float32 norm gives 0, not NaN.
    """
    d_in, d, t, b = 6, 16, 8, 4
    ks = data.seeds(80, 3)
    params = {
        "w": _dense(ks[0], d_in, d, 2.0),
        "gamma": data.ones(d),
        "beta": data.zeros(d),
        "out": _dense(ks[1], d, 3),
    }
    x = data.normal(81, (t, b, d_in)).at[6:].set(0.0)
    y = jnp.array([0, 1, 2, 1], jnp.int32)

    def loss(p, x, y):
        h = x @ p["w"]  # [t, b, d]; zero for the padded steps
        mean = h.mean(-1, keepdims=True)
        var = h.var(-1, keepdims=True)

        def step(acc, hs):
            h_t, m_t, v_t = hs
            z = (h_t - m_t) * lax.rsqrt(v_t + 1e-12) * p["gamma"] + p["beta"]
            return acc + jnp.tanh(z), None

        acc, _ = lax.scan(step, jnp.zeros((b, d)), (h, mean, var))
        logits = (acc / t) @ p["out"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    return Instance(params, (x, y), loss)


@program("fn")
def batchnorm_running_stats_scan():
    """BatchNorm over micro-batches under lax.scan: running mean and variance
    (an EMA, as BatchNorm keeps them) carried, each micro-batch normalised by
    its own statistics; returns the outputs and the final running statistics.

    Inputs in the hundreds; one feature is constant (zero variance).
    """
    d_in, d, steps, mb = 8, 16, 6, 12
    w = _dense(82, d_in, d, 4.0)
    x = 200.0 + data.normal(83, (steps, mb, d_in), scale=30.0)
    x = x.at[..., 0].set(250.0)
    w = w.at[1:, 0].set(0.0)  # feature 0 sees only the constant input: var 0

    def run(w, x):
        def step(stats, xb):
            mean_run, var_run = stats
            h = xb @ w
            mean = h.mean(0)
            var = jnp.mean(jnp.square(h - mean), axis=0)
            z = (h - mean) * lax.rsqrt(var + 1e-5)
            stats = (0.9 * mean_run + 0.1 * mean, 0.9 * var_run + 0.1 * var)
            return stats, jax.nn.relu(z)

        init = (jnp.zeros((d,)), jnp.ones((d,)))
        (mean_run, var_run), zs = lax.scan(step, init, x)
        return {"outputs": zs, "mean": mean_run, "var": var_run}

    return Instance(w, (x,), run, kind="fn")
