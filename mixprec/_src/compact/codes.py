"""Block-wise 8-bit codes for optimizer moments.

A moment leaf shaped like a parameter is cut into blocks of consecutive elements
along its last axis (so a block never straddles a shard of an array sharded on
any other axis, nor one sharded on the last axis in multiples of the block),
and each block is stored as one float32 scale (its largest magnitude) plus one
byte per element.

Two byte formats, both non-linear (logarithmic) as bitsandbytes found Adam's
second moment needs; a linear int8 code flushes most of it to zero:

* ``"int8"``: a block with a negative value (a first moment) stores sign, a
  4-bit exponent and a 3-bit mantissa of ``x / absmax``; a block with none (a
  second moment) stores a 4-bit exponent and a 4-bit mantissa of
  ``sqrt(x / absmax)``: 2**-28 of range below the block's maximum where a direct
  code has 2**-14. The sign of the stored scale says which (negative: the
  square-root code).
* ``"float8"``: ``float8_e4m3fn`` of ``x / absmax * 448`` (first moment) or of
  ``sqrt(x / absmax) * 448`` (non-negative blocks).

Values are rounded stochastically, with the probability taken in the value
domain, so the stored moment is unbiased (a second moment that decays by 5% a
step then decays on average, where round-to-nearest with a 4-bit mantissa
would leave it stuck). A positive value of a non-negative block never rounds
to zero (it would divide an Adam step by ``eps``): below the smallest code it
rounds up to it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import bits as bits_lib


MOMENT_TIERS = ("float32", "bfloat16-sr", "int8", "float8")
MIN_BLOCK = 32

_EMAX = 15  # int8 code: exponents 1..15 cover [2**-14, 1]
_SIGNED_M, _SQRT_M = 3, 4
_E4M3_MAX = 448.0
_E4M3_MIN_NORMAL = 2.0**-6
_E4M3_SUB = 2.0**-9


@dataclasses.dataclass(frozen=True)
class Compressed:
    """One optimizer-state leaf stored in fewer bits.

    Attributes:
      codes: the stored elements, shaped like the leaf: ``bfloat16``
        (``"bfloat16-sr"``), ``uint8`` (``"int8"``) or ``float8_e4m3fn``
        (``"float8"``).
      scale: float32 per block (shape ``leaf.shape[:-1] + (blocks,)``), its
        sign the block's code (negative: square-root code); ``None`` for
        ``"bfloat16-sr"``.
      tier: the moment tier (static).
      dtype: the leaf's own dtype, restored on decoding (static).
    """

    codes: jax.Array
    scale: jax.Array | None
    tier: str = dataclasses.field(metadata=dict(static=True))
    dtype: Any = dataclasses.field(metadata=dict(static=True))


jax.tree_util.register_dataclass(Compressed)


def block_size(n: int, block: int) -> int:
    """The block length along a last axis of ``n`` elements.

    ``block`` if it divides ``n``, else their greatest common divisor if that is
    at least 32, else the whole row.

    Examples:
        >>> block_size(1024, 256), block_size(384, 256), block_size(65, 256)
        (256, 128, 65)
    """
    if n % block == 0:
        return block
    g = math.gcd(n, block)
    return g if g >= min(MIN_BLOCK, n) else n


def _blocks(x: jax.Array, block: int) -> jax.Array:
    n = x.shape[-1]
    b = block_size(n, block)
    return x.reshape(*x.shape[:-1], n // b, b)


def _bits(x: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(x, jnp.uint32)


def _float(u: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(u, jnp.float32)


def _minifloat_grid(
    t: jax.Array, mask: jax.Array, one: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """The int8 code's grid points below and above ``t`` in [0, 1] (float32).

    ``mask`` keeps the sign, the exponent and the code's mantissa bits of a
    float32; ``one`` is the last bit it keeps (both per block).
    """
    tb = _bits(t) & mask
    normal = t >= jnp.float32(2.0 ** (1 - _EMAX))
    lo = jnp.where(normal, _float(tb), 0.0)
    hi = jnp.where(normal, _float(tb + one), jnp.float32(2.0 ** (1 - _EMAX)))
    return lo, hi


def _e4m3_grid(t: jax.Array) -> tuple[jax.Array, jax.Array]:
    """float8_e4m3fn's grid points below and above ``t`` in [0, 448]."""
    tb = _bits(t) & jnp.uint32(0xFFF00000)
    normal = t >= jnp.float32(_E4M3_MIN_NORMAL)
    sub_lo = jnp.floor(t * jnp.float32(1 / _E4M3_SUB)) * jnp.float32(_E4M3_SUB)
    lo = jnp.where(normal, _float(tb), sub_lo)
    hi = jnp.where(
        normal, _float(tb + jnp.uint32(1 << 20)), sub_lo + jnp.float32(_E4M3_SUB)
    )
    return lo, jnp.minimum(hi, jnp.float32(_E4M3_MAX))


def _choose(
    y: jax.Array, lo: jax.Array, hi: jax.Array, u: jax.Array, square: jax.Array
) -> jax.Array:
    """``hi`` with probability (y - lo) / (hi - lo) in the value domain.

    ``square`` (per block): the grid is of square roots, so the values are
    ``lo**2`` and ``hi**2``.
    """
    vlo = jnp.where(square, lo * lo, lo)
    vhi = jnp.where(square, hi * hi, hi)
    # u < (y - lo) / gap, without the division (where hi == lo either is it).
    return jnp.where(u * (vhi - vlo) < y - vlo, hi, lo)


def _int8_layout(rooted: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per block: (mantissa bits, the float32 mask keeping them, their last
    bit) of the square-root code where ``rooted``, else of the signed code."""
    m = jnp.where(rooted, jnp.uint32(_SQRT_M), jnp.uint32(_SIGNED_M))
    drop = jnp.uint32(23) - m
    mask = (jnp.uint32(0xFFFFFFFF) >> drop) << drop
    return m, mask, jnp.uint32(1) << drop


def encode(x: jax.Array, tier: str, random: jax.Array, *, block: int) -> Any:
    """Stores a float leaf in ``tier``, rounding stochastically.

    Args:
      x: the leaf (any float dtype, at least one dimension).
      tier: one of ``MOMENT_TIERS``; ``"float32"`` returns ``x`` unchanged.
      random: uint32 random bits shaped like ``x``.
      block: the preferred block length (see `block_size`).

    Returns:
      ``x`` itself (``"float32"``) or a `Compressed`.

    Examples:
        >>> import jax.numpy as jnp
        >>> x = jnp.linspace(-1.0, 1.0, 64)
        >>> c = encode(x, "int8", bits_lib.global_index((64,)) * 0, block=32)
        >>> c.codes.dtype, c.scale.shape, float(jnp.max(jnp.abs(decode(c) - x))) < 0.07
        (dtype('uint8'), (2,), True)
    """
    if tier == "float32":
        return x
    dtype = np.dtype(x.dtype)
    x32 = x.astype(jnp.float32)
    if tier == "bfloat16-sr":
        return Compressed(
            bits_lib.round_bfloat16_stochastic(x32, random), None, tier, dtype
        )
    xb = _blocks(x32, block)
    u = bits_lib.uniform(_blocks(random, block))
    # Both block statistics from the largest and the smallest value, in one
    # reduction (one pass over the block; no |x| in memory).
    largest, smallest = lax.reduce(
        (xb, xb),
        (jnp.float32(-jnp.inf), jnp.float32(jnp.inf)),
        lambda a, b: (lax.max(a[0], b[0]), lax.min(a[1], b[1])),
        (xb.ndim - 1,),
    )
    largest, smallest = largest[..., None], smallest[..., None]
    absmax = jnp.abs(jnp.maximum(largest, -smallest))  # (|-0.0| is 0.0)
    # A block with no negative value (a second moment) takes the square-root
    # code; every other block the signed direct code. One code per element,
    # with the block's parameters.
    nonneg = smallest >= 0
    # In [0, 1]: multiplies by the block's reciprocal, not a division per
    # element (the product can exceed 1 by an ulp). A block of tiny or huge
    # values is first scaled by 2**64 or 2**-64 (exactly), so that the
    # reciprocal is a normal float32 (CPUs flush subnormals to zero).
    lift = jnp.where(
        absmax < jnp.float32(2.0**-64),
        jnp.float32(2.0**64),
        jnp.where(absmax > jnp.float32(2.0**64), jnp.float32(2.0**-64), 1.0),
    )
    inverse = 1.0 / jnp.where(absmax > 0, absmax * lift, 1.0)
    y = jnp.minimum(jnp.abs(xb) * lift * inverse, 1.0)
    t = jnp.where(nonneg, jnp.sqrt(y), y)
    # Never flush a positive value of a non-negative block to 0.
    keep = nonneg & (y > 0)
    if tier == "int8":
        m, mask, one = _int8_layout(nonneg)
        lo, hi = _minifloat_grid(t, mask, one)
        lo = jnp.where(keep & (lo == 0), hi, lo)
        v = _choose(y, lo, hi, u, nonneg)
        vb = _bits(v)
        e = (vb >> 23) - jnp.uint32(127 - _EMAX)
        mant = (vb >> (jnp.uint32(23) - m)) & ((jnp.uint32(1) << m) - 1)
        code = jnp.where(v > 0, (e << m) | mant, 0)
        codes = jnp.where(xb < 0, code | 0x80, code).astype(jnp.uint8)
    elif tier == "float8":
        t = t * jnp.float32(_E4M3_MAX)
        lo, hi = _e4m3_grid(t)
        lo = jnp.where(keep & (lo == 0), hi, lo)
        target = jnp.where(nonneg, y * jnp.float32(_E4M3_MAX**2), t)
        v = _choose(target, lo, hi, u, nonneg)
        codes = jnp.where(xb < 0, -v, v).astype(jnp.float8_e4m3fn)
    else:
        raise ValueError(f"unknown moment tier {tier!r}")
    scale = jnp.where(nonneg, -absmax, absmax)[..., 0]
    return Compressed(codes.reshape(x.shape), scale, tier, dtype)


def decode(c: Any) -> jax.Array:
    """The leaf a `Compressed` stores (or ``c`` itself if it is not one), in
    the leaf's own dtype.

    Examples:
        >>> import jax.numpy as jnp
        >>> x = jnp.array([0.0, 1e-3, 0.5, 1.0] * 8)
        >>> c = encode(x, "float8", bits_lib.global_index((32,)), block=32)
        >>> bool(jnp.all(decode(c) > 0) == False), decode(c).dtype
        (True, dtype('float32'))
    """
    if not isinstance(c, Compressed):
        return c
    if c.tier == "bfloat16-sr":
        return c.codes.astype(c.dtype)
    assert c.scale is not None
    shape = c.codes.shape
    codes = _blocks(c.codes, block=c.codes.shape[-1] // c.scale.shape[-1])
    scale = c.scale[..., None]
    absmax = jnp.abs(scale)
    rooted = scale < 0
    if c.tier == "int8":
        m, _, _ = _int8_layout(rooted)
        # The signed code keeps its sign in the top bit.
        cb = codes.astype(jnp.uint32) & jnp.where(
            rooted, jnp.uint32(0xFF), jnp.uint32(0x7F)
        )
        e = cb >> m
        mant = cb & ((jnp.uint32(1) << m) - 1)
        v = _float(((e + jnp.uint32(127 - _EMAX)) << 23) | (mant << (23 - m)))
        v = jnp.where(cb > 0, v, 0.0)
        mag = jnp.where(rooted, v * v, v)
        neg = (~rooted) & ((codes & 0x80) != 0)
        val = jnp.where(neg, -mag, mag)
    else:
        f = codes.astype(jnp.float32) * jnp.float32(1 / _E4M3_MAX)
        val = jnp.where(rooted, f * f, f)
    return (val * absmax).reshape(shape).astype(c.dtype)
