"""Random bits from a counter hash, and the roundings built on them.

Every element gets 32 random bits from a hash of (seed, step, leaf, stream,
global element index): a multiply by the golden ratio and murmur3's finalizer.
It costs a few integer ops per element, where ``jax.random.bits`` (threefry)
costs more than a whole float32 Adam update, and it depends on where an element
sits in the *global* array only, so a sharded array gets the same bits as an
unsharded one.

Stochastic rounding to bfloat16 adds 16 random bits below the 16 that bfloat16
keeps and truncates: it rounds up with probability equal to the distance from
the value below, so it is unbiased.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


_GOLDEN = 0x9E3779B9
_M1, _M2 = 0x85EBCA6B, 0xC2B2AE35
_MASK32 = 0xFFFFFFFF
_HI16 = 0xFFFF0000


def _fmix32_int(h: int) -> int:
    """murmur3's finalizer on a Python int (for constants)."""
    h &= _MASK32
    h ^= h >> 16
    h = (h * _M1) & _MASK32
    h ^= h >> 13
    h = (h * _M2) & _MASK32
    return h ^ (h >> 16)


def fmix32(h: jax.Array) -> jax.Array:
    """murmur3's 32-bit finalizer (an invertible mix of all bits), on uint32.

    Examples:
        >>> import jax.numpy as jnp
        >>> int(fmix32(jnp.uint32(1))) == _fmix32_int(1)
        True
    """
    h = h ^ (h >> 16)
    h = h * jnp.uint32(_M1)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(_M2)
    return h ^ (h >> 16)


def stream_constant(seed: int, leaf: int, stream: int) -> int:
    """A uint32 constant naming one random stream (seed, leaf, stream).

    Examples:
        >>> stream_constant(0, 1, 2) != stream_constant(0, 2, 1)
        True
    """
    h = _fmix32_int(seed * _GOLDEN + 0x2545F491)
    h = _fmix32_int(h ^ (leaf * 0x27D4EB2F + 0x165667B1))
    return _fmix32_int(h ^ (stream * 0x61C88647 + 0x7F4A7C15))


def global_index(
    shape: Sequence[int],
    offsets: Sequence[jax.Array | int] | None = None,
    global_shape: Sequence[int] | None = None,
) -> jax.Array:
    """The row-major index of every element in the global array, as uint32.

    Under ``jit`` an array is global, so ``offsets`` is ``None``. Inside
    ``shard_map`` a local block starts at ``offsets`` of an array of
    ``global_shape``. Indices wrap modulo 2**32.

    Examples:
        >>> global_index((2, 3)).tolist()
        [[0, 1, 2], [3, 4, 5]]
        >>> global_index((1, 2), offsets=(1, 1), global_shape=(2, 3)).tolist()
        [[4, 5]]
    """
    shape = tuple(shape)
    gshape = tuple(global_shape) if global_shape is not None else shape
    idx = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for d in reversed(range(len(shape))):
        coord = lax.broadcasted_iota(jnp.uint32, shape, d)
        if offsets is not None:
            coord = coord + jnp.asarray(offsets[d]).astype(jnp.uint32)
        idx = idx + coord * jnp.uint32(stride & _MASK32)
        stride = stride * gshape[d]
    return idx


def random_bits(
    index: jax.Array, step: jax.Array, constant: int | jax.Array
) -> jax.Array:
    """32 random bits per element from (step, stream constant, global index).

    Examples:
        >>> import jax.numpy as jnp
        >>> b = random_bits(global_index((4,)), jnp.int32(0), stream_constant(0, 0, 0))
        >>> b.dtype, len(set(b.tolist()))
        (dtype('uint32'), 4)
    """
    key = fmix32(
        jnp.asarray(step).astype(jnp.uint32) * jnp.uint32(_GOLDEN)
        + jnp.uint32(constant)
    )
    return fmix32(index * jnp.uint32(_GOLDEN) + key)


def uniform(bits: jax.Array) -> jax.Array:
    """Floats in [0, 1) from the top 24 of 32 random bits (exact in float32).

    Examples:
        >>> import jax.numpy as jnp
        >>> float(uniform(jnp.uint32(0xFFFFFFFF))) < 1.0
        True
    """
    return (bits >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)


def _bits(x: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(x, jnp.uint32)


def _float(u: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(u, jnp.float32)


def round_bfloat16_stochastic(x: jax.Array, bits: jax.Array) -> jax.Array:
    """float32 -> bfloat16, rounding up with probability = distance from below.

    Adds 16 random bits under the 16 that bfloat16 keeps, then truncates. NaN
    stays NaN.

    Examples:
        >>> import jax.numpy as jnp
        >>> x = jnp.float32(1 + 2**-9)  # a quarter of the way to the next bfloat16
        >>> bits = random_bits(global_index((10_000,)), jnp.int32(0), 1)
        >>> r = round_bfloat16_stochastic(jnp.full(10_000, x), bits)
        >>> r.dtype, round(float(jnp.mean((r > 1).astype(jnp.float32))), 1)
        (dtype(bfloat16), 0.2)
    """
    x = x.astype(jnp.float32)
    y = _float((_bits(x) + (bits >> 16)) & jnp.uint32(_HI16))
    return jnp.where(jnp.isnan(x), x, y).astype(jnp.bfloat16)


def round_bfloat16_nearest(x: jax.Array) -> jax.Array:
    """float32 -> the nearest bfloat16 value (ties to even), kept as float32.

    Done on the bits, so XLA's excess-precision rewrites cannot skip it: this
    is the rounding a bfloat16 ``p + u`` performs.

    Examples:
        >>> import jax.numpy as jnp
        >>> float(round_bfloat16_nearest(jnp.float32(1 + 2**-8 + 2**-12)))
        1.0078125
    """
    u = _bits(x)
    return _float((u + jnp.uint32(0x7FFF) + ((u >> 16) & 1)) & jnp.uint32(_HI16))


def split_exact(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """float32 -> (its top 16 bits as bfloat16, its low 16 bits as uint16).

    Examples:
        >>> import jax.numpy as jnp
        >>> hi, lo = split_exact(jnp.float32(1 / 3))
        >>> float(join_exact(hi, lo)) == float(jnp.float32(1 / 3))
        True
    """
    u = _bits(x.astype(jnp.float32))
    hi = _float(u & jnp.uint32(_HI16)).astype(jnp.bfloat16)
    return hi, (u & jnp.uint32(0xFFFF)).astype(jnp.uint16)


def join_exact(hi: jax.Array, lo: jax.Array) -> jax.Array:
    """The float32 whose top 16 bits are ``hi`` (bfloat16) and low 16 ``lo``.

    Examples:
        >>> import jax.numpy as jnp
        >>> float(join_exact(jnp.bfloat16(1.0), jnp.uint16(1))) == 1 + 2**-23
        True
    """
    top = lax.bitcast_convert_type(hi.astype(jnp.bfloat16), jnp.uint16)
    return _float((top.astype(jnp.uint32) << 16) | lo.astype(jnp.uint32))


def landing_update(
    old: jax.Array, target: jax.Array, dtype: Any = jnp.bfloat16
) -> tuple[jax.Array, jax.Array]:
    """An update ``u`` with ``optax.apply_updates(old, u) == target``.

    ``optax.apply_updates`` computes ``(old + u).astype(old.dtype)``. With a
    ``float32`` update the sum is float32 and rounds to bfloat16 once: ``u =
    target - old`` is exact, so the weight lands, unless ``target`` is more than
    about 2**16 times smaller than ``old`` (the float32 difference then loses
    ``target``'s bits). With a ``bfloat16`` update (what strict dtype promotion
    allows) the sum is bfloat16: ``target - old`` rounded to bfloat16 lands
    wherever ``target`` is not much smaller than the step; where it does not,
    one of its two bfloat16 neighbours may. A target closer to zero than about
    the step's size usually cannot be reached then (bfloat16 numbers near the
    step are too far apart), and the update is the rounded difference: the
    weight lands within half an ulp of ``u`` from ``target``.

    Args:
        old: the bfloat16 weights.
        target: the bfloat16 weights to reach (bfloat16 or float32 holding
            bfloat16 values).
        dtype: the update's dtype, ``jnp.float32`` or ``jnp.bfloat16``.

    Returns:
        ``(u, landed)``: the update in ``dtype`` and a bool array, false where
        the weight does not land on ``target``.

    Examples:
        >>> import jax.numpy as jnp
        >>> old = jnp.array([9.4223e-4, 3.0], jnp.bfloat16)
        >>> new = jnp.array([-5.8e-5, -2.0], jnp.bfloat16)
        >>> u, landed = landing_update(old, new, jnp.float32)
        >>> bool(jnp.all((old + u).astype(jnp.bfloat16) == new)), landed.tolist()
        (True, [True, True])
        >>> u, landed = landing_update(old, new)  # bfloat16: -5.8e-5 is too fine
        >>> u.dtype, landed.tolist()
        (dtype(bfloat16), [False, True])
    """
    old32 = old.astype(jnp.float32)
    t = target.astype(jnp.float32)
    if np.dtype(dtype) == np.dtype(jnp.float32):
        u32 = t - old32
        return u32, round_bfloat16_nearest(old32 + u32) == t
    if np.dtype(dtype) != np.dtype(jnp.bfloat16):
        raise ValueError(
            f"`landing_update(..., dtype=...)` must be float32 or bfloat16, got "
            f"{np.dtype(dtype).name}."
        )
    d = round_bfloat16_nearest(t - old32)
    reached = round_bfloat16_nearest(old32 + d)
    ok = reached == t
    # Where `d` misses, try its neighbour on the bfloat16 grid (one ulp larger
    # or smaller in magnitude) on the side of `target`: `old + z` rounded does
    # not decrease as `z` grows, so the neighbour on the other side cannot land.
    # (Checked against trying both neighbours on every pair of bfloat16 values.)
    db = _bits(d)
    larger = db + jnp.uint32(0x10000)
    smaller = db - jnp.uint32(0x10000)
    # `larger` is above `d` for a positive `d`, below it for a negative one.
    use_larger = (reached < t) == (db < jnp.uint32(0x80000000))
    other = _float(jnp.where(use_larger, larger, smaller))
    ok_other = round_bfloat16_nearest(old32 + other) == t
    u = jnp.where(ok, d, jnp.where(ok_other, other, d))
    return u.astype(jnp.bfloat16), ok | ok_other


def num_elements(shape: Sequence[int]) -> int:
    """The number of elements of ``shape``.

    Examples:
        >>> num_elements((2, 3)), num_elements(())
        (6, 1)
    """
    return math.prod(shape)
