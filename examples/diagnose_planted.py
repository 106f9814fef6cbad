"""Planted float16 problems for ``mixprec diagnose`` / ``mixprec inspect``.

Each function has a ``<name>_example_args()`` hook, so the CLI can call it::

    mixprec diagnose examples/diagnose_planted.py:product_overflow
    mixprec diagnose examples/diagnose_planted.py:layer_norm --json
    mixprec diagnose examples/diagnose_planted.py:naive_softmax \
        --mixlist '{"black-list": {"to-remove": ["exp"]}}'
    mixprec diagnose examples/diagnose_planted.py:mlp_loss --loss-scale 1
    mixprec inspect  examples/diagnose_planted.py:mlp_loss

or run this file to print every report: ``python examples/diagnose_planted.py``.
"""

import math

import jax
import jax.numpy as jnp

import mixprec


def product_overflow(w, x):
    """``256.0 * 256.0`` overflows float16 (above 65504): a product of two
    activations is gray, so it runs in float16. (A square, ``h * h`` or
    ``jnp.square(h)``, runs in float32 under float16.)"""
    h, g = x @ w, x @ w.T
    return h * g


def product_overflow_example_args():
    return jnp.eye(8), jnp.full((8, 8), 256.0)


def product_underflow(w, x):
    """``1e-5 * 1e-5`` flushes to zero in float16 (below 6e-8)."""
    h, g = x @ w, x @ w.T
    return h * g


def product_underflow_example_args():
    return jnp.eye(8), jnp.full((8, 8), 1e-5)


def naive_softmax(q, k):
    """Softmax without max-subtraction: overflows once ``exp`` runs in float16."""
    s = q @ k.T
    e = jnp.exp(s)
    return e / jnp.sum(e, axis=-1, keepdims=True)


def naive_softmax_example_args():
    return jnp.full((8, 8), 1.5), jnp.ones((8, 8))


def layer_norm(w, mu, x):
    """A layer norm centred with a stored mean, with a weighted variance that
    underflows in float16: ``d * (d * 0.5)`` multiplies two different float16
    values. (The plain ``d * d`` is a square and runs in float32.)"""
    h = x @ w
    d = h - mu
    var = jnp.mean(d * (d * 0.5), axis=-1, keepdims=True)
    return d * jax.lax.rsqrt(var + 1e-12)


def layer_norm_example_args():
    x = jax.random.normal(jax.random.key(0), (8, 16)) * 1e-4
    return jnp.eye(16), jnp.zeros((1, 16)), x


def mlp_loss(params, x):
    """A deep tanh MLP with a small loss: its float16 gradients underflow."""
    h = x
    for w in params:
        h = jnp.tanh(h @ w)
    return jnp.mean(h * h) * 1e-3


def mlp_loss_example_args():
    keys = jax.random.split(jax.random.key(0), 6)
    params = [jax.random.normal(k, (32, 32)) * (0.5 / math.sqrt(32)) for k in keys]
    return params, jax.random.normal(jax.random.key(1), (32, 32))


def main() -> None:
    f16 = "mixed_float16"
    for fn, kwargs in [
        (product_overflow, {}),
        (product_underflow, {}),
        (naive_softmax, {"mixlist": {"black-list": {"to-remove": ["exp"]}}}),
        (layer_norm, {}),
    ]:
        args = globals()[f"{fn.__name__}_example_args"]()
        print(f"== {fn.__name__}")
        print(mixprec.diagnose(fn, *args, policy=f16, **kwargs))
    params, x = mlp_loss_example_args()
    print("== jax.grad(mlp_loss)")
    report = mixprec.diagnose(jax.grad(mlp_loss), params, x, policy=f16)
    print(report)
    print(f"== mlp_loss at loss scale {report.suggested_loss_scale:g}")
    print(
        mixprec.diagnose(
            mlp_loss, params, x, policy=f16, loss_scale=report.suggested_loss_scale
        ).summary()
    )
    print("== mixprec.explain(mlp_loss)")
    print(mixprec.explain(mlp_loss, params, x, policy=f16).summary())


if __name__ == "__main__":
    main()
