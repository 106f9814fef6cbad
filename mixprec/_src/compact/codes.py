"""Block-wise 8-bit codes for optimizer moments.

A moment leaf shaped like a parameter is cut into blocks of consecutive elements
along its last axis (so a block never straddles a shard of an array sharded on
any other axis, nor one sharded on the last axis in multiples of the block),
and each block is stored as one float32 scale (its largest magnitude) plus one
byte per element.

Two byte formats, both non-linear (logarithmic) as bitsandbytes found Adam's
second moment needs; a linear int8 code flushes most of it to zero:

* ``"int8"``: a small float of ``x / absmax``, 3 mantissa bits. A block with a
  negative value (a first moment) stores sign and a 4-bit exponent, so 2**-14 of
  range below the block's maximum; a block with none (a second moment) has no
  sign to store and spends the bit on the exponent: 5 bits, 2**-30 of range.
  The sign of the stored scale says which (negative: the unsigned code).
* ``"float8"``: ``float8_e4m3fn`` of ``x / absmax * 448`` (first moment) or of
  ``sqrt(x / absmax) * 448`` (non-negative blocks: the square root doubles its
  range).

Values are rounded stochastically, with the probability taken in the value
domain, so the stored moment is unbiased (a second moment that decays by 5% a
step then decays on average, where round-to-nearest with a 3-bit mantissa
would leave it stuck). The int8 code's grid is uniform within a binade, so it
rounds as the bfloat16 weights do: random bits added under the kept mantissa,
then truncated. A positive value of a non-negative block never rounds to zero
(it would divide an Adam step by ``eps``): below the smallest code it rounds up
to it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import bits as bits_lib


MOMENT_TIERS = ("float32", "bfloat16-sr", "int8", "float8")
# The layout of the stored codes, kept in every compact state so that a
# checkpoint is never decoded by a different layout: raise it with any change
# that would decode existing codes or scales differently.
CODES_FORMAT = 1
MIN_BLOCK = 32

# int8 code: 3 mantissa bits; exponents 1..15 cover [2**-14, 1] for signed
# blocks, 1..31 cover [2**-30, 1] for non-negative ones; code 0 is 0.
_MANT = 3
_DROP = 23 - _MANT  # float32 mantissa bits the code drops
_EMAX_SIGNED, _EMAX_UNSIGNED = 15, 31
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

    # Never cast by `cast_tree` or a checkpoint restore: the dtypes are the
    # format.
    _mixprec_keep_dtypes: ClassVar[bool] = True


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


def stored_block(c: Compressed) -> int:
    """The block length a `Compressed` leaf was encoded with (1 for
    ``"bfloat16-sr"``, which has no blocks, and for a leaf with no elements
    along its last axis, whose zero blocks have any length).

    Examples:
        >>> import jax.numpy as jnp
        >>> zeros = jnp.zeros((64, 0))
        >>> c = encode(zeros, "int8", zeros.astype(jnp.uint32), block=256)
        >>> c.scale.shape, stored_block(c), decode(c).shape
        ((64, 0), 1, (64, 0))
    """
    if c.scale is None or c.scale.shape[-1] == 0:
        return 1
    return c.codes.shape[-1] // c.scale.shape[-1]


def _blocks(x: jax.Array, block: int) -> jax.Array:
    n = x.shape[-1]
    b = block_size(n, block)
    return x.reshape(*x.shape[:-1], n // b, b)


def _bits(x: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(x, jnp.uint32)


def _float(u: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(u, jnp.float32)


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


def _int8_bias(unsigned: jax.Array) -> jax.Array:
    """Per block: what a float32's bits ``>> _DROP`` (8 exponent and 3
    mantissa bits) exceed the int8 code by."""
    return jnp.where(
        unsigned,
        jnp.uint32((127 - _EMAX_UNSIGNED) << _MANT),
        jnp.uint32((127 - _EMAX_SIGNED) << _MANT),
    )


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
    return encode_many([x], tier, [random], block=block)[0]


def encode_many(
    xs: Sequence[jax.Array], tier: str, randoms: Sequence[jax.Array], *, block: int
) -> list[Any]:
    """`encode` of several leaves of one shape (a parameter's moments), the
    same codes as one by one; the block statistics of all of them come from
    one reduction, one pass over the blocks instead of one per leaf.

    Examples:
        >>> import jax.numpy as jnp
        >>> m = jnp.linspace(-1.0, 1.0, 64)
        >>> r = bits_lib.global_index((64,))
        >>> cm, cv = encode_many([m, m * m], "int8", [r, r], block=32)
        >>> bool(jnp.all(cv.codes == encode(m * m, "int8", r, block=32).codes))
        True
    """
    if not xs:
        return []
    if tier == "float32":
        return list(xs)
    if tier == "bfloat16-sr":
        return [
            Compressed(
                bits_lib.round_bfloat16_stochastic(x.astype(jnp.float32), r),
                None,
                tier,
                np.dtype(x.dtype),
            )
            for x, r in zip(xs, randoms, strict=True)
        ]
    if tier not in ("int8", "float8"):
        raise ValueError(
            f"unknown moment tier {tier!r}; choose from {', '.join(MOMENT_TIERS)}"
        )
    if len({tuple(x.shape) for x in xs}) != 1:
        raise ValueError(
            "`encode_many` takes leaves of one shape, got "
            f"{sorted({tuple(x.shape) for x in xs})}."
        )
    xbs = [_blocks(x.astype(jnp.float32), block) for x in xs]
    # Each block's largest magnitude and whether it holds a negative value, of
    # every leaf, in one variadic reduction of integer maxima over the bits: a
    # float32's magnitude orders as its bits without the sign do (NaN above
    # inf), and a value below zero is a bit pattern above 0x80000000 (-0.0 is
    # not below zero).
    n = len(xbs)
    ubs = [_bits(xb) for xb in xbs]
    zero = jnp.uint32(0)
    stats = lax.reduce(
        (*(u & jnp.uint32(0x7FFFFFFF) for u in ubs), *ubs),
        (zero,) * (2 * n),
        lambda a, b: tuple(lax.max(a[i], b[i]) for i in range(2 * n)),
        (xbs[0].ndim - 1,),
    )
    return [
        _encode_blocks(
            xb,
            _blocks(r, block),
            _float(stats[i])[..., None],
            (stats[n + i] <= jnp.uint32(0x80000000))[..., None],
            tier,
            np.dtype(x.dtype),
        )
        for i, (x, xb, r) in enumerate(zip(xs, xbs, randoms, strict=True))
    ]


def _encode_blocks(
    xb: jax.Array,
    rb: jax.Array,
    absmax: jax.Array,
    nonneg: jax.Array,
    tier: str,
    dtype: Any,
) -> Compressed:
    """One leaf's codes from its blocks (float32), their random bits, each
    block's largest magnitude and whether it has no negative value.

    A block with no negative value (a second moment) takes the unsigned (int8)
    or square-root (float8) code; every other block the signed code. One code
    per element, with the block's parameters.
    """
    u = bits_lib.uniform(rb)
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
    # Never flush a positive value of a non-negative block to 0.
    keep = nonneg & (y > 0)
    if tier == "int8":
        smallest_normal = jnp.where(
            nonneg,
            jnp.float32(2.0 ** (1 - _EMAX_UNSIGNED)),
            jnp.float32(2.0 ** (1 - _EMAX_SIGNED)),
        )
        # Above the smallest normal: random bits under the kept mantissa, then
        # truncation, round up with probability (y - below) / gap.
        code = ((_bits(y) + (rb >> (32 - _DROP))) >> _DROP) - _int8_bias(nonneg)
        # Below it the code has 0 and the smallest normal only.
        up = (u * smallest_normal < y) | keep
        code = jnp.where(
            y >= smallest_normal,
            code,
            jnp.where(up, jnp.uint32(1 << _MANT), jnp.uint32(0)),
        )
        codes = jnp.where(xb < 0, code | 0x80, code).astype(jnp.uint8)
    else:  # "float8" (`encode_many` checked the tier)
        t = jnp.where(nonneg, jnp.sqrt(y), y) * jnp.float32(_E4M3_MAX)
        lo, hi = _e4m3_grid(t)
        lo = jnp.where(keep & (lo == 0), hi, lo)
        target = jnp.where(nonneg, y * jnp.float32(_E4M3_MAX**2), t)
        v = _choose(target, lo, hi, u, nonneg)
        codes = jnp.where(xb < 0, -v, v).astype(jnp.float8_e4m3fn)
    scale = jnp.where(nonneg, -absmax, absmax)[..., 0]
    shape = (*xb.shape[:-2], xb.shape[-2] * xb.shape[-1])
    return Compressed(codes.reshape(shape), scale, tier, dtype)


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
    codes = _blocks(c.codes, block=stored_block(c))
    scale = c.scale[..., None]
    absmax = jnp.abs(scale)
    unsigned = scale < 0
    if c.tier == "int8":
        # The signed code keeps its sign in the top bit, moved to float32's
        # with integer ops (cheaper on XLA:CPU than choosing -x or x).
        cb = codes.astype(jnp.uint32)
        mask = jnp.where(unsigned, jnp.uint32(0xFF), jnp.uint32(0x7F))
        m = cb & mask
        mag = jnp.where(m > 0, (m + _int8_bias(unsigned)) << _DROP, jnp.uint32(0))
        val = _float(mag | ((cb & ~mask) << 24))
    else:
        # 1/448 passes an optimization barrier, so that XLA sees no constant
        # to fold: where a shard is small (an (8,) leaf on 8 devices), XLA
        # turns the broadcast 1/448 into a literal and rewrites (c * k)**2
        # into c**2 * k**2, rounded elsewhere, and the shards decode other
        # bits than one device does.
        k = lax.optimization_barrier(jnp.float32(1 / _E4M3_MAX))
        f = codes.astype(jnp.float32) * k
        val = jnp.where(unsigned, f * f, f)
    return (val * absmax).reshape(shape).astype(c.dtype)
