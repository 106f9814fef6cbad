"""A transformer whose layers are stacked and scanned over (the MaxText /
Levanter / ``nn.scan`` layout), trained by a whole step with AdamW.

Each layer's parameters are one slice of arrays with a leading layer axis, and
``lax.scan`` (or Flax's ``nn.scan``) runs the same block over them. Causal
attention is written out. Differentiating the scan splits it in two: JAX puts
the forward in one scan body and the backward in another, so autocast cannot
fuse the attention of a whole step (``mixprec.diagnose`` and ``explain`` say
so); its numbers must still be float32's.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from . import Instance, data, program
from .attention import _layer_norm
from .steps import _optax_step


B, T, D, HEADS, VOCAB, LAYERS = 2, 8, 16, 2, 11, 2


def init_stacked(seed, layers=LAYERS, d=D, vocab=VOCAB):
    """Parameters with every layer's arrays stacked on a leading axis."""
    ks = data.seeds(seed, 6)
    return {
        "embed": data.normal(ks[0], (vocab, d), 1.0),
        "layers": {
            "ln": {"g": data.ones(layers, d), "b": data.zeros(layers, d)},
            "qkv": data.normal(ks[1], (layers, d, 3 * d), 1 / np.sqrt(d)),
            "proj": data.normal(ks[2], (layers, d, d), 0.5 / np.sqrt(d)),
            "fc": data.normal(ks[3], (layers, d, 2 * d), 1 / np.sqrt(d)),
            "fc_out": data.normal(ks[4], (layers, 2 * d, d), 0.5 / np.sqrt(2 * d)),
        },
        "head": data.normal(ks[5], (d, vocab), 1 / np.sqrt(d)),
    }


def causal_attention(q, k, v):
    """``[b, t, heads, h]`` queries, keys and values; a causal mask filled
    with ``finfo(float32).min``."""
    t = q.shape[1]
    s = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(q.shape[-1]).astype(np.float32)
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, jnp.finfo(jnp.float32).min)
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, axis=-1), v)


def block(x, p):
    """One pre-LN block on one layer's slice ``p``; a ``lax.scan`` body."""
    b, t, d = x.shape
    h = _layer_norm(x, p["ln"]["g"], p["ln"]["b"])
    q, k, v = (
        a.reshape(b, t, HEADS, d // HEADS) for a in jnp.split(h @ p["qkv"], 3, -1)
    )
    x = x + causal_attention(q, k, v).reshape(b, t, d) @ p["proj"]
    return x + jax.nn.gelu(x @ p["fc"], approximate=True) @ p["fc_out"], None


def scan_loss(params, tokens, labels):
    x = params["embed"][tokens]
    x, _ = lax.scan(block, x, params["layers"])
    logits = x @ params["head"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def tokens_and_labels(seed):
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(0, VOCAB, (B, T)), jnp.int32)
    return tokens, jnp.roll(tokens, -1, axis=1)


@program("step", "standard_promotion")  # optax.adamw mixes int and float
def gpt_scan_over_layers():
    """2-layer GPT, layers stacked and lax.scan-ned, causal attention, AdamW."""
    params = init_stacked(160)
    optimizer = optax.adamw(1e-2, weight_decay=1e-2)
    step, update = _optax_step(scan_loss, optimizer)
    return Instance(
        params,
        tokens_and_labels(161),
        scan_loss,
        train_state=(params, jax.jit(optimizer.init)(params)),
        step=step,
        update=update,
    )


# ---------------------------------------------------------------- Flax nn.scan


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        b, t, d = x.shape
        h = nn.LayerNorm()(x)
        q, k, v = (
            a.reshape(b, t, HEADS, d // HEADS)
            for a in jnp.split(nn.Dense(3 * d, use_bias=False)(h), 3, -1)
        )
        x = x + nn.Dense(d, use_bias=False)(causal_attention(q, k, v).reshape(b, t, d))
        h = nn.gelu(nn.Dense(2 * d)(nn.LayerNorm()(x)), approximate=True)
        return x + nn.Dense(d)(h), None


class ScannedGPT(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, D)(tokens)
        stack = nn.scan(
            _Block,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=LAYERS,
        )
        x, _ = stack(name="layers")(x, None)
        return nn.Dense(VOCAB)(x)


@program("step", "standard_promotion")  # optax.adamw mixes int and float
def flax_nn_scan_gpt():
    """Flax GPT with nn.scan over 2 stacked blocks, causal attention, AdamW."""
    model = ScannedGPT()
    tokens, labels = tokens_and_labels(162)
    params = data.init(model.init, 163, tokens)["params"]

    def loss(params, tokens, labels):
        logits = model.apply({"params": params}, tokens)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    optimizer = optax.adamw(1e-2, weight_decay=1e-2)
    step, update = _optax_step(loss, optimizer)
    return Instance(
        params,
        (tokens, labels),
        loss,
        train_state=(params, jax.jit(optimizer.init)(params)),
        step=step,
        update=update,
    )
