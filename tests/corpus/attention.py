"""Attention with padding: key padding masks and fully masked query rows.

Each batch has one sequence that is padding only, so some query rows see no key
at all; float32 code survives that because its mask fill (``finfo.min``,
``-0.7 * finfo.max``) is finite. Under autocast every output must stay finite.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from . import Instance, data, program


def _lengths():
    # The last sequence is empty: its query rows are fully masked.
    return jnp.array([6, 3, 0], jnp.int32)


def _valid(lengths, t):
    return jnp.arange(t)[None, :] < lengths[:, None]  # [b, t] bool


def masked_mean(values, valid):
    """Mean of ``values`` [b, t] over the valid positions (all-padding rows: 0)."""
    w = valid.astype(values.dtype)
    return jnp.sum(values * w) / jnp.maximum(jnp.sum(w), 1.0)


# ---------------------------------------------------------------- Flax MHA


class FlaxEncoderLayer(nn.Module):
    d: int = 16
    heads: int = 2

    @nn.compact
    def __call__(self, x, mask):
        h = nn.LayerNorm()(x)
        h = nn.MultiHeadDotProductAttention(num_heads=self.heads, name="attention")(
            h, h, mask=mask
        )
        x = x + h
        h = nn.LayerNorm()(x)
        h = nn.Dense(2 * self.d)(h)
        return x + nn.Dense(self.d)(nn.gelu(h))


@program("masked")
def attn_flax_padded():
    """Flax MultiHeadDotProductAttention with a key padding mask (empty sequence)."""
    model = FlaxEncoderLayer()
    b, t, d = 3, 6, 16
    x = data.normal(40, (b, t, d))
    t_target = data.normal(41, (b, t, d))
    lengths = _lengths()
    valid = _valid(lengths, t)
    mask = nn.make_attention_mask(valid, valid)
    params = data.init(model.init, 42, x, mask)["params"]

    def loss(params, x, target, valid):
        mask = nn.make_attention_mask(valid, valid)
        y = model.apply({"params": params}, x, mask)
        return masked_mean(jnp.mean((y - target) ** 2, axis=-1), valid)

    return Instance(params, (x, t_target, valid), loss)


@program("masked")
def attn_flax_dot_product_causal():
    """nn.dot_product_attention with causal + padding masks via nn.combine_masks."""
    b, t, d, heads = 3, 6, 16, 4
    ks = data.seeds(43, 3)
    params = {
        "qkv": data.normal(ks[0], (d, 3, heads, d // heads), 1 / np.sqrt(d)),
        "out": data.normal(ks[1], (heads, d // heads, d), 1 / np.sqrt(d)),
    }
    x = data.normal(44, (b, t, d))
    valid = _valid(_lengths(), t)

    def loss(params, x, valid):
        qkv = jnp.einsum("btd,dkhe->kbthe", x, params["qkv"])
        mask = nn.combine_masks(
            nn.make_attention_mask(valid, valid), nn.make_causal_mask(valid)
        )
        att = nn.dot_product_attention(qkv[0], qkv[1], qkv[2], mask=mask)
        y = jnp.einsum("bthe,hed->btd", att, params["out"])
        return masked_mean(jnp.sum(y**2, axis=-1), valid)

    return Instance(params, (x, valid), loss)


# ---------------------------------------------------------------- jax.nn


@program("masked")
def attn_jax_nn_padded():
    """jax.nn.dot_product_attention with key lengths (one 0) and a boolean mask."""
    b, t, d, heads = 3, 6, 16, 2
    ks = data.seeds(45, 4)
    params = {
        "wq": data.normal(ks[0], (d, d), 1 / np.sqrt(d)),
        "wk": data.normal(ks[1], (d, d), 1 / np.sqrt(d)),
        "wv": data.normal(ks[2], (d, d), 1 / np.sqrt(d)),
        "wo": data.normal(ks[3], (d, d), 1 / np.sqrt(d)),
    }
    x = data.normal(46, (b, t, d))
    lengths = _lengths()

    def loss(params, x, lengths):
        def heads_of(w):
            return (x @ w).reshape(b, t, heads, d // heads)

        q, k, v = heads_of(params["wq"]), heads_of(params["wk"]), heads_of(params["wv"])
        valid = _valid(lengths, t)
        mask = valid[:, None, None, :]  # keys only: padded queries still attend
        out = jax.nn.dot_product_attention(
            q, k, v, mask=mask, key_value_seq_lengths=lengths, implementation="xla"
        )
        y = out.reshape(b, t, d) @ params["wo"]
        return masked_mean(jnp.mean(jnp.tanh(y), axis=-1), valid) + 1e-3 * jnp.mean(y)

    return Instance(params, (x, lengths), loss)


# ---------------------------------------------------------------- by hand


def masked_softmax_attention(q, k, v, mask):
    scores = jnp.einsum("bqd,bkd->bqk", q, k) / np.sqrt(q.shape[-1]).astype(np.float32)
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    return jax.nn.softmax(scores, axis=-1) @ v


@program("masked")
def attn_hand_finfo_min():
    """Hand-written attention: mask filled with finfo(float32).min, jax.nn.softmax."""
    b, t, d = 3, 6, 8
    ks = data.seeds(47, 3)
    params = {
        n: data.normal(k, (d, d), 1 / np.sqrt(d))
        for n, k in zip("qkv", ks, strict=True)
    }
    x = data.normal(48, (b, t, d), scale=3.0)
    valid = _valid(_lengths(), t)

    def loss(params, x, valid):
        q, k, v = (x @ params[n] for n in "qkv")
        mask = valid[:, None, :] & valid[:, :, None]
        y = masked_softmax_attention(q, k, v, mask)
        return jnp.mean(y**2)

    return Instance(params, (x, valid), loss)


def _layer_norm(x, g, b, eps=1e-5):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * lax.rsqrt(var + eps) * g + b


def init_block(seed, d, heads):
    ks = data.seeds(seed, 4)
    return {
        "ln1": {"g": data.ones(d), "b": data.zeros(d)},
        "qkv": data.normal(ks[0], (d, 3 * d), 1 / np.sqrt(d)),
        "proj": data.normal(ks[1], (d, d), 0.5 / np.sqrt(d)),
        "ln2": {"g": data.ones(d), "b": data.zeros(d)},
        "fc": data.normal(ks[2], (d, 4 * d), 1 / np.sqrt(d)),
        "fc_out": data.normal(ks[3], (4 * d, d), 0.5 / np.sqrt(4 * d)),
    }


def block(p, x, mask, heads):
    """Pre-LN transformer block; ``mask`` [b, 1, t, t] bool."""
    b, t, d = x.shape
    h = _layer_norm(x, p["ln1"]["g"], p["ln1"]["b"])
    q, k, v = jnp.split(h @ p["qkv"], 3, axis=-1)
    q, k, v = (
        a.reshape(b, t, heads, d // heads).transpose(0, 2, 1, 3) for a in (q, k, v)
    )
    att = (q @ k.transpose(0, 1, 3, 2)) * (1.0 / np.sqrt(d // heads))
    att = jnp.where(mask, att, jnp.finfo(att.dtype).min)
    att = jax.nn.softmax(att, axis=-1)
    y = (att @ v).transpose(0, 2, 1, 3).reshape(b, t, d)
    x = x + y @ p["proj"]
    h = _layer_norm(x, p["ln2"]["g"], p["ln2"]["b"])
    return x + jax.nn.gelu(h @ p["fc"], approximate=True) @ p["fc_out"]


@program("masked")
def transformer_causal_padded():
    """Two pre-LN blocks by hand, causal & padding mask, masked token xent."""
    return transformer(blocks=2)


def transformer(blocks):
    b, t, d, heads, classes = 3, 6, 16, 2, 5
    ks = data.seeds(49, 3)
    params = {
        "blocks": [init_block(k, d, heads) for k in data.seeds(48, blocks)],
        "head": data.normal(ks[2], (d, classes), 1 / np.sqrt(d)),
    }
    x = data.normal(50, (b, t, d))
    labels = jnp.asarray(
        np.random.default_rng(51).integers(0, classes, (b, t)), jnp.int32
    )
    valid = _valid(_lengths(), t)

    def loss(params, x, labels, valid):
        causal = jnp.tril(jnp.ones((t, t), bool))
        mask = causal[None, None] & valid[:, None, None, :]
        for p in params["blocks"]:
            x = block(p, x, mask, heads)
        logits = x @ params["head"]
        xent = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        return masked_mean(xent, valid)

    return Instance(params, (x, labels, valid), loss)
