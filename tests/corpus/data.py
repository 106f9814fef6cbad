"""Small synthetic data sets and the scikit-learn digits, shared by the programs."""

from __future__ import annotations

import functools as ft

import jax
import jax.numpy as jnp
import numpy as np


def classification(seed: int, n: int, d: int, classes: int):
    """Gaussian clusters: ``(x float32 [n, d], y int32 [n])``, learnable."""
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(classes, d)).astype(np.float32) * 2.0
    y = rng.integers(0, classes, size=n).astype(np.int32)
    x = centers[y] + rng.normal(size=(n, d)).astype(np.float32)
    return jnp.asarray(x), jnp.asarray(y)


def images(seed: int, n: int, hw: int, c: int, classes: int):
    """NHWC images whose class is a bright quadrant pattern, plus labels."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, classes, size=n).astype(np.int32)
    x = rng.normal(size=(n, hw, hw, c)).astype(np.float32) * 0.5
    half = hw // 2
    for i, label in enumerate(y):
        r, col = divmod(int(label) % 4, 2)
        x[i, r * half : (r + 1) * half, col * half : (col + 1) * half, :] += 1.5
    return jnp.asarray(x), jnp.asarray(y)


def tokens(seed: int, batch: int, length: int, vocab: int):
    """Integer token sequences with a learnable pattern (next = prev + 1)."""
    rng = np.random.default_rng(seed)
    start = rng.integers(0, vocab, size=(batch, 1))
    seq = (start + np.arange(length + 1)[None, :]) % vocab
    return jnp.asarray(seq[:, :-1], jnp.int32), jnp.asarray(seq[:, 1:], jnp.int32)


def key(seed: int) -> jax.Array:
    return jax.random.key(seed)


# Weights are drawn with NumPy: eager jax.random compiles once per shape, which
# took most of the corpus's build time.


def seeds(seed: int, n: int) -> list[int]:
    """``n`` derived seeds (the corpus's stand-in for ``jax.random.split``)."""
    return [seed * 1000 + i for i in range(n)]


def normal(seed: int, shape, scale: float = 1.0) -> jax.Array:
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.normal(size=shape).astype(np.float32) * np.float32(scale))


def dense(seed: int, m: int, n: int, scale: float = 1.0) -> jax.Array:
    """An ``[m, n]`` weight with variance ``scale**2 / m``."""
    return normal(seed, (m, n), scale / np.sqrt(m))


def _key_name(path) -> str:
    last = path[-1] if path else None
    for attr in ("key", "name", "idx"):
        if hasattr(last, attr):
            return str(getattr(last, attr)).lower()
    return ""


def fill(shapes, seed: int, *, fan_in_first: bool = False):
    """Concrete float32 values for a pytree of shapes (``jax.eval_shape``'s).

    Scales and variances are ones, biases, offsets and means zeros, other
    vectors zeros, embeddings N(0, 1), and every other weight N(0, 1 / fan_in)
    with fan-in the product of all dimensions but the last (Flax, Haiku, stax)
    or, with ``fan_in_first``, all but the first (Equinox).
    """
    rng = np.random.default_rng(seed)

    def value(path, s):
        if not hasattr(s, "shape"):
            return s
        name = _key_name(path)
        shape = tuple(s.shape)
        if not jnp.issubdtype(s.dtype, jnp.floating):
            return jnp.zeros(shape, s.dtype)
        if name in ("scale", "gamma", "var"):
            return jnp.asarray(np.ones(shape, np.float32))
        if len(shape) <= 1 or name in ("bias", "b", "beta", "offset", "mean"):
            return jnp.asarray(np.zeros(shape, np.float32))
        if name == "embedding":
            return jnp.asarray(rng.normal(size=shape).astype(np.float32))
        fan_in = int(np.prod(shape[1:] if fan_in_first else shape[:-1]))
        w = rng.normal(size=shape) / np.sqrt(fan_in)
        return jnp.asarray(w.astype(np.float32))

    return jax.tree_util.tree_map_with_path(value, shapes)


def init(init_fn, seed: int, *args, **static):
    """Parameters shaped as ``init_fn(key, *args, **static)`` returns them.

    Traced with ``jax.eval_shape`` and filled by :func:`fill`: compiling a
    framework's random initialisers cost seconds per model on a loaded CPU,
    and what is tested is the model's computation, not its initialiser.
    """
    shapes = jax.eval_shape(ft.partial(init_fn, **static), jax.random.key(seed), *args)
    return fill(shapes, seed)


def eqx_init(make, seed: int):
    """An Equinox module ``make(key)``, shaped by eval_shape and :func:`fill`ed."""
    import equinox as eqx

    shapes = eqx.filter_eval_shape(make, jax.random.key(seed))
    return fill(shapes, seed, fan_in_first=True)


def zeros(*shape: int) -> jax.Array:
    return jnp.asarray(np.zeros(shape, np.float32))


def ones(*shape: int) -> jax.Array:
    return jnp.asarray(np.ones(shape, np.float32))


@ft.cache
def digits():
    """scikit-learn's 8x8 digits (1797 real images) scaled to [0, 1], or None.

    Returns ``(x_train, y_train, x_test, y_test)`` with ``x`` of shape
    ``[n, 64]`` float32 and ``y`` int32; None when scikit-learn is missing.
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        return None
    bunch = load_digits()
    x = np.asarray(bunch.data, np.float32) / 16.0
    y = np.asarray(bunch.target, np.int32)
    perm = np.random.default_rng(0).permutation(len(y))
    x, y = x[perm], y[perm]
    return (
        jnp.asarray(x[:1500]),
        jnp.asarray(y[:1500]),
        jnp.asarray(x[1500:]),
        jnp.asarray(y[1500:]),
    )


def digits_or_synthetic():
    """The digits, or (without scikit-learn) Gaussian clusters of the same shape."""
    found = digits()
    if found is not None:
        return found
    x, y = classification(7, 1797, 64, 10)
    x = jax.nn.sigmoid(x)
    return x[:1500], y[:1500], x[1500:], y[1500:]
