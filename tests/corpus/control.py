"""Control flow and transformations inside models: checkpoint, cond, switch,
while_loop, custom_jvp / custom_vjp activations, vmap per-example gradients."""

from __future__ import annotations

import functools as ft

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from . import Instance, data, program


_dense = data.dense


@program()
def checkpoint_blocks():
    """Residual MLP blocks under jax.checkpoint (save only matmul outputs)."""
    d = 16
    ks = data.seeds(100, 5)
    params = {
        "blocks": [
            {"w1": _dense(a, d, 2 * d), "w2": _dense(b, 2 * d, d, 0.5)}
            for a, b in zip(ks[:2], ks[2:4], strict=True)
        ],
        "head": _dense(ks[4], d, 4),
    }
    x, y = data.classification(101, 10, d, 4)

    @ft.partial(
        jax.checkpoint, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    )
    def res_block(p, x):
        return x + jax.nn.gelu(x @ p["w1"]) @ p["w2"]

    def loss(params, x, y):
        for p in params["blocks"]:
            x = res_block(p, x)
        logits = x @ params["head"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    return Instance(params, (x, y), loss)


@program()
def cond_and_switch():
    """lax.cond on a traced flag (two heads) and lax.switch on a task id."""
    d = 12
    ks = data.seeds(102, 5)
    params = {
        "body": _dense(ks[0], d, d),
        "head_a": _dense(ks[1], d, 3),
        "head_b": _dense(ks[2], d, 3),
        "task": [_dense(k, d, d) for k in data.seeds(ks[3], 3)],
    }
    x, y = data.classification(103, 8, d, 3)

    def loss(p, x, y, use_b, task):
        h = jax.nn.relu(x @ p["body"])
        h = lax.switch(task, [lambda h, w=w: jnp.tanh(h @ w) for w in p["task"]], h)
        logits = lax.cond(
            use_b, lambda h: h @ p["head_b"], lambda h: h @ p["head_a"], h
        )
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    return Instance(params, (x, y, jnp.array(True), jnp.array(1, jnp.int32)), loss)


def spectral_normalize(w, u0, tol=1e-4, max_iter=50):
    """w / sigma_max(w); sigma from power iteration in a while_loop (no gradient)."""
    ws = lax.stop_gradient(w)

    def cond(state):
        i, _, _, delta = state
        return (i < max_iter) & (delta > tol)

    def body(state):
        i, u, _, _ = state
        v = ws.T @ u
        v = v / jnp.linalg.norm(v)
        u_new = ws @ v
        u_new = u_new / jnp.linalg.norm(u_new)
        return i + 1, u_new, v, jnp.max(jnp.abs(u_new - u))

    _, u, v, _ = lax.while_loop(cond, body, (0, u0, jnp.zeros(w.shape[1]), jnp.inf))
    sigma = u @ w @ v
    return w / sigma


@program()
def spectral_norm_while():
    """Spectral normalisation: power iteration in lax.while_loop, then dense layers."""
    ks = data.seeds(104, 3)
    params = {"w1": _dense(ks[0], 10, 24, 3.0), "w2": _dense(ks[1], 24, 2)}
    u0 = data.normal(ks[2], (10,))
    u0 = u0 / np.linalg.norm(np.asarray(u0))
    x = data.normal(105, (8, 10))
    t = data.normal(106, (8, 2))

    def loss(p, x, t, u0):
        w1 = spectral_normalize(p["w1"], u0)
        return jnp.mean((jnp.tanh(x @ w1) @ p["w2"] - t) ** 2)

    return Instance(params, (x, t, u0), loss)


@jax.custom_jvp
def mish(x):
    return x * jnp.tanh(jax.nn.softplus(x))


@mish.defjvp
def _mish_jvp(primals, tangents):
    (x,), (dx,) = primals, tangents
    sp = jax.nn.softplus(x)
    tsp = jnp.tanh(sp)
    grad = tsp + x * jax.nn.sigmoid(x) * (1 - tsp**2)
    return mish(x), grad * dx


@jax.custom_jvp
def safe_norm(x):
    return jnp.sqrt(jnp.sum(x**2, axis=-1))


@safe_norm.defjvp
def _safe_norm_jvp(primals, tangents):
    (x,), (dx,) = primals, tangents
    y = safe_norm(x)
    denom = jnp.where(y == 0, 1.0, y)
    return y, jnp.sum(x * dx, axis=-1) / denom


@program()
def custom_jvp_activations():
    """Mish with a hand-written custom_jvp, and a safe norm (zero rows: no NaN)."""
    ks = data.seeds(107, 2)
    params = {"w1": _dense(ks[0], 8, 16), "w2": _dense(ks[1], 16, 4)}
    x = data.normal(108, (6, 8))
    x = jnp.asarray(np.concatenate([np.zeros((1, 8), np.float32), np.asarray(x)[1:]]))
    # row 0 is zero: its features have norm zero

    def loss(p, x):
        h = mish(x @ p["w1"])
        emb = h @ p["w2"]
        return jnp.mean(safe_norm(emb))  # row 0 of emb is zero: mish(0) = 0

    return Instance(params, (x,), loss)


@jax.custom_vjp
def clip_gradient(x):
    return x


def _clip_fwd(x):
    return x, None


def _clip_bwd(_, g):
    return (jnp.clip(g, -0.01, 0.01),)


clip_gradient.defvjp(_clip_fwd, _clip_bwd)


@jax.custom_vjp
def straight_through_round(x):
    return jnp.round(x * 4.0) / 4.0


straight_through_round.defvjp(
    lambda x: (straight_through_round(x), None), lambda _, g: (g,)
)


@program()
def custom_vjp_activations():
    """custom_vjp gradient clipping and a straight-through quantiser in an MLP."""
    ks = data.seeds(109, 3)
    params = {
        "w1": _dense(ks[0], 10, 16),
        "w2": _dense(ks[1], 16, 16),
        "w3": _dense(ks[2], 16, 3),
    }
    x, y = data.classification(110, 12, 10, 3)

    def loss(p, x, y):
        h = jax.nn.gelu(clip_gradient(x @ p["w1"]))
        h = jnp.tanh(straight_through_round(h @ p["w2"]))
        logits = h @ p["w3"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    return Instance(params, (x, y), loss)


def dp_sgd_grads(loss_one, clip_norm):
    """DP-SGD's gradient: per-example gradients (vmap of grad), each clipped."""

    def grads(params, x, y):
        per_ex = jax.vmap(jax.grad(loss_one), in_axes=(None, 0, 0))(params, x, y)
        norms = jnp.sqrt(
            sum(
                jnp.sum(g.reshape(x.shape[0], -1) ** 2, axis=1)
                for g in jax.tree.leaves(per_ex)
            )
        )
        factor = jnp.minimum(1.0, clip_norm / (norms + 1e-6))
        clipped = jax.tree.map(
            lambda g: g * factor.reshape((-1,) + (1,) * (g.ndim - 1)), per_ex
        )
        return jax.tree.map(lambda g: jnp.mean(g, axis=0), clipped), norms

    return grads


@program("fn")
def per_example_grads():
    """vmap(grad(loss)) per-example gradients, clipped and averaged (DP-SGD)."""
    ks = data.seeds(111, 2)
    params = {
        "w1": _dense(ks[0], 8, 16),
        "b1": data.zeros(16),
        "w2": _dense(ks[1], 16, 3),
    }
    x, y = data.classification(112, 10, 8, 3)

    def loss_one(p, x, y):
        logits = jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, y)

    return Instance(params, (x, y), dp_sgd_grads(loss_one, 1.0), kind="fn")
