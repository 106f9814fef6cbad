"""A left-padded GPT batch with a Hugging Face-style additive mask bias.

Hugging Face's Flax GPT-2 / OPT / BART turn the padding mask into a bias,
``lax.select(mask > 0, 0.0, finfo(float32).min)``, and add it to the scores.
In a left-padded batch every padding query sees no key at all: float32 gives
it finite, uniform weights that the loss masks out. The bias is the only
source of its large values, so autocast must keep it finite in 16 bits too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from . import Instance, data, program
from .attention import _layer_norm, masked_mean
from .steps import _optax_step


def hf_bias(valid):
    """``[b, 1, t, t]`` additive bias: 0 where a query sees a key (causal and
    not padding), ``finfo(float32).min`` elsewhere (Flax GPT-2's form)."""
    t = valid.shape[1]
    causal = jnp.tril(jnp.ones((t, t), bool))[None, None]
    mask = causal & valid[:, None, None, :]
    return lax.select(
        mask,
        jnp.full(mask.shape, 0.0, jnp.float32),
        jnp.full(mask.shape, jnp.finfo(jnp.float32).min, jnp.float32),
    )


def _init(seed, d, layers, vocab):
    ks = data.seeds(seed, 4 * layers + 2)
    blocks = []
    for i in range(layers):
        k = ks[4 * i : 4 * i + 4]
        blocks.append(
            {
                "ln": {"g": data.ones(d), "b": data.zeros(d)},
                "qkv": data.normal(k[0], (d, 3 * d), 1 / np.sqrt(d)),
                "proj": data.normal(k[1], (d, d), 0.5 / np.sqrt(d)),
                "fc": data.normal(k[2], (d, 2 * d), 1 / np.sqrt(d)),
                "fc_out": data.normal(k[3], (2 * d, d), 0.5 / np.sqrt(2 * d)),
            }
        )
    return {
        "embed": data.normal(ks[-2], (vocab, d), 1.0),
        "blocks": blocks,
        "head": data.normal(ks[-1], (d, vocab), 1 / np.sqrt(d)),
    }


def _block(p, x, bias, heads):
    b, t, d = x.shape
    h = _layer_norm(x, p["ln"]["g"], p["ln"]["b"])
    q, k, v = jnp.split(h @ p["qkv"], 3, axis=-1)
    q, k, v = (
        a.reshape(b, t, heads, d // heads).transpose(0, 2, 1, 3) for a in (q, k, v)
    )
    scores = (q @ k.transpose(0, 1, 3, 2)) / np.sqrt(d // heads).astype(np.float32)
    weights = jax.nn.softmax(scores + bias, axis=-1)
    y = (weights @ v).transpose(0, 2, 1, 3).reshape(b, t, d)
    x = x + y @ p["proj"]
    return x + jax.nn.gelu(x @ p["fc"], approximate=True) @ p["fc_out"]


@program("step", "standard_promotion")  # optax.adam mixes int and float
def gpt_left_padded_hf_bias():
    """2-layer GPT, left-padded batch, HF bias select(m, 0, finfo.min), Adam."""
    b, t, d, heads, vocab = 3, 8, 16, 2, 11
    params = _init(150, d, 2, vocab)
    rng = np.random.default_rng(151)
    tokens = jnp.asarray(rng.integers(0, vocab, (b, t)), jnp.int32)
    # Left padding: the first rows of the shorter sequences are padding.
    lengths = np.array([8, 5, 2])
    valid = jnp.asarray(np.arange(t)[None, :] >= (t - lengths)[:, None])
    labels = jnp.roll(tokens, -1, axis=1)

    def loss(params, tokens, labels, valid):
        x = params["embed"][tokens]
        bias = hf_bias(valid)
        for p in params["blocks"]:
            x = _block(p, x, bias, heads)
        logits = x @ params["head"]
        xent = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        return masked_mean(xent, valid)

    optimizer = optax.adam(1e-2)
    step, update = _optax_step(loss, optimizer)
    return Instance(
        params,
        (tokens, labels, valid),
        loss,
        train_state=(params, jax.jit(optimizer.init)(params)),
        step=step,
        update=update,
    )


def _block_bias_argument(p, x, bias, heads, fused):
    b, t, d = x.shape
    h = _layer_norm(x, p["ln"]["g"], p["ln"]["b"])
    q, k, v = jnp.split(h @ p["qkv"], 3, axis=-1)
    q, k, v = (a.reshape(b, t, heads, d // heads) for a in (q, k, v))
    if fused:  # the bias as `jax.nn.dot_product_attention` takes it
        y = jax.nn.dot_product_attention(q, k, v, bias=bias)
    else:
        scale = np.float32(1 / np.sqrt(d // heads))
        scores = jnp.einsum("bthd,bshd->bhts", q, k) * scale + bias
        y = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(scores, axis=-1), v)
    x = x + y.reshape(b, t, d) @ p["proj"]
    return x + jax.nn.gelu(x @ p["fc"], approximate=True) @ p["fc_out"]


def _bias_argument_program(seed, fused):
    b, t, d, heads, vocab = 3, 8, 16, 2, 11
    params = _init(seed, d, 2, vocab)
    rng = np.random.default_rng(seed + 1)
    tokens = jnp.asarray(rng.integers(0, vocab, (b, t)), jnp.int32)
    # Right padding, one example all padding (an empty slot of the batch).
    lengths = np.array([8, 3, 0])
    valid = np.arange(t)[None, :] < lengths[:, None]
    # The data pipeline builds the additive bias outside the model, as Hugging
    # Face's Flax models and `dot_product_attention(bias=...)` callers do.
    causal = np.tril(np.ones((t, t), bool))[None, None]
    keep = causal & valid[:, None, None, :]
    bias = jnp.asarray((1.0 - keep) * np.finfo(np.float32).min, jnp.float32)
    labels = jnp.roll(tokens, -1, axis=1)
    valid = jnp.asarray(valid)

    def loss(params, tokens, labels, valid, bias):
        x = params["embed"][tokens]
        for p in params["blocks"]:
            x = _block_bias_argument(p, x, bias, heads, fused)
        logits = x @ params["head"]
        xent = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        return masked_mean(xent, valid)

    # SGD with momentum: its update is linear in the gradient, so the state
    # after a step is as close to float32's as the gradient is (Adam's first
    # step is lr * sign(g): a float32 gradient of 7e-6 against a largest of
    # 0.3, whose sign float16 rounding may flip, moves its weight by 2 lr).
    optimizer = optax.sgd(0.1, momentum=0.9)
    step, update = _optax_step(loss, optimizer)
    return Instance(
        params,
        (tokens, labels, valid, bias),
        loss,
        train_state=(params, jax.jit(optimizer.init)(params)),
        step=step,
        update=update,
    )


@program("step")
def gpt_padded_bias_argument():
    """2-layer GPT, an all-padding example, (1 - mask) * finfo.min bias argument."""
    return _bias_argument_program(160, fused=False)


@program("step")
def dpa_padded_bias_argument():
    """2-layer GPT, dot_product_attention(bias=...) with a finfo.min bias argument."""
    return _bias_argument_program(170, fused=True)
