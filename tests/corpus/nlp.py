"""Token models: embeddings with tied output weights, mixture of experts."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from . import Instance, attention, data, program


def init_lm(seed, vocab, d, heads, layers):
    ks = data.seeds(seed, layers + 2)
    return {
        "embed": data.normal(ks[0], (vocab, d), 0.1),
        "pos": data.normal(ks[1], (16, d), 0.01),
        "blocks": [attention.init_block(k, d, heads) for k in ks[2:]],
        "ln_f": {"g": data.ones(d), "b": data.zeros(d)},
    }


def lm_loss(heads):
    def loss(params, tokens, targets):
        b, t = tokens.shape
        x = params["embed"][tokens] + params["pos"][:t]
        mask = jnp.tril(jnp.ones((t, t), bool))[None, None]
        for p in params["blocks"]:
            x = attention.block(p, x, mask, heads)
        x = attention._layer_norm(x, params["ln_f"]["g"], params["ln_f"]["b"])
        logits = x @ params["embed"].T  # tied output weights
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    return loss


@program()
def gpt_tied_embeddings():
    """Tiny GPT: embedding gather, learned positions, 2 blocks, tied output."""
    return gpt(layers=2)


def gpt(layers):
    vocab, d, heads = 24, 16, 2
    params = init_lm(120, vocab, d, heads, layers=layers)
    tokens, targets = data.tokens(121, 3, 8, vocab)
    return Instance(params, (tokens, targets), lm_loss(heads))


class BowLM(nn.Module):
    vocab: int = 30
    d: int = 16

    @nn.compact
    def __call__(self, context):
        embed = nn.Embed(self.vocab, self.d, name="embed")
        h = embed(context).mean(axis=1)  # bag of words over the context
        h = nn.gelu(nn.Dense(self.d, name="mean")(h))
        return embed.attend(h)  # logits with the embedding matrix


@program()
def flax_embed_attend():
    """Flax nn.Embed + Embed.attend (tied output) over a bag-of-words context."""
    model = BowLM()
    tokens, targets = data.tokens(122, 8, 4, 30)
    params = data.init(model.init, 123, tokens)["params"]

    def loss(params, context, target):
        logits = model.apply({"params": params}, context)
        return optax.softmax_cross_entropy_with_integer_labels(logits, target).mean()

    return Instance(params, (tokens, targets[:, -1]), loss)


def moe_layer(p, x, k=2):
    """Top-k gated mixture of experts with a load-balancing loss."""
    n_experts = p["router"].shape[-1]
    router_logits = x @ p["router"]
    probs = jax.nn.softmax(router_logits, axis=-1)
    top_p, top_i = jax.lax.top_k(probs, k)
    top_p = top_p / jnp.sum(top_p, axis=-1, keepdims=True)
    gates = jnp.sum(jax.nn.one_hot(top_i, n_experts) * top_p[..., None], axis=-2)
    h = jax.nn.relu(jnp.einsum("td,edf->tef", x, p["w_in"]))
    y = jnp.einsum("tef,efd->ted", h, p["w_out"])
    out = jnp.einsum("ted,te->td", y, gates)
    load = jnp.mean(jax.nn.one_hot(top_i[:, 0], n_experts), axis=0)
    importance = jnp.mean(probs, axis=0)
    aux = n_experts * jnp.sum(load * importance)
    return out, aux


@program()
def moe_top2():
    """Mixture of 4 experts, top-2 gating (lax.top_k), load-balancing aux loss."""
    d, e, f = 12, 4, 24
    ks = data.seeds(124, 4)
    params = {
        "router": data.normal(ks[0], (d, e), 1 / np.sqrt(d)),
        "w_in": data.normal(ks[1], (e, d, f), 1 / np.sqrt(d)),
        "w_out": data.normal(ks[2], (e, f, d), 1 / np.sqrt(f)),
        "head": data.normal(ks[3], (d, 3), 1 / np.sqrt(d)),
    }
    x, y = data.classification(125, 16, d, 3)

    def loss(p, x, y):
        h, aux = moe_layer(p, x)
        logits = (x + h) @ p["head"]
        xent = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return xent + 0.01 * aux

    return Instance(params, (x, y), loss)


# ---------------------------------------------------------------- large constants


def sinusoidal_positions(length: int, d: int):
    """Transformer positional encoding, as written in tutorials (jnp, traced)."""
    pos = jnp.arange(length, dtype=jnp.float32)[:, None]
    i = jnp.arange(0, d, 2, dtype=jnp.float32)
    angles = pos / (10000.0 ** (i / d))
    return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)


# A causal mask closed over as NumPy, with a large negative bias.
_CAUSAL_BIAS = np.triu(np.full((12, 12), -1e9, np.float32), k=1)


@program()
def constants_out_of_float16_range():
    """A token model full of constants float16 cannot hold.

    Sinusoidal positions (``10000.0 ** (i / d)``), scores masked with a
    closed-over NumPy bias of -1e9 and by ``where(..., finfo(float32).min)``,
    an attention output rescaled by ``* 7e4 / 1e5``, and a loss reported per
    1e5 samples (``* 1e4 / 1e5``).
    """
    vocab, d, t, b = 20, 16, 12, 4
    ks = data.seeds(90, 4)
    params = {
        "embed": data.normal(ks[0], (vocab, d), 0.5),
        "wq": data.dense(ks[1], d, d),
        "wk": data.dense(ks[2], d, d),
        "out": data.dense(ks[3], d, vocab),
    }
    tokens, targets = data.tokens(91, b, t, vocab)
    lengths = jnp.array([12, 9, 7, 12], jnp.int32)

    def loss(p, tokens, targets, lengths):
        h = p["embed"][tokens] + sinusoidal_positions(t, d)
        q, k = h @ p["wq"], h @ p["wk"]
        scores = q @ jnp.swapaxes(k, -1, -2) / np.sqrt(d) + _CAUSAL_BIAS
        valid = jnp.arange(t)[None, None, :] < lengths[:, None, None]
        scores = jnp.where(valid, scores, jnp.finfo(jnp.float32).min)
        # A unit conversion written as two constants, on the attention output.
        h = h + (jax.nn.softmax(scores, axis=-1) @ h) * 7e4 / 1e5
        logits = h @ p["out"]
        logp = jax.nn.log_softmax(logits)
        nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)
        return jnp.sum(nll) * 1e4 / 1e5 / b

    return Instance(params, (tokens, targets, lengths), loss)
