"""Float8: the recipe a policy carries, and the arithmetic of scaled float8 values.

Float8 has too little range to hold a tensor as it is: ``float8_e4m3fn``
reaches 448 and its smallest subnormal is ``2**-9``; ``float8_e5m2`` reaches
57344 with two mantissa bits. So a tensor is *scaled* into the format and the
scale is kept beside it:

* ``amax``: the largest magnitude, over the whole tensor (``tensorwise``) or
  over the contracted dimensions of a matmul, one value per row of the lhs and
  column of the rhs (``rowwise``);
* ``scale = amax * (1 / max(format))``: the dequantization scale, so that
  ``x / scale`` maps the largest magnitude onto the format's largest finite
  value (an all-zero tensor gets scale 1);
* quantize: ``clip(x / scale, -max, max)`` cast to the format. The clip is
  the *saturation*: a plain cast turns out-of-range values into NaN
  (``e4m3fn`` has no infinity) or ``inf`` (``e5m2``);
* dequantize: ``q.astype(dtype) * scale``.

Forward operands use e4m3 (more precision), gradients e5m2 (more range), as
in NVIDIA Transformer Engine, torchao and Flax. The scale is computed from the
tensor itself just before the cast ("current" scaling, torchao's default), so
it cannot saturate; values smaller than ``amax * 2**-17.8`` (e4m3) flush to
zero.

:class:`Float8Recipe` is the static configuration (hashable, part of a
:class:`mixprec.Policy`); the functions below are the arithmetic, shared by the
autocast formulation (:mod:`mixprec._src.autocast.float8_dots`), ``diagnose``
and the tests.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, Final

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike, DTypeLike

from ._errors import format_choices, suggest


__all__ = [
    "E4M3",
    "E5M2",
    "SCALINGS",
    "Float8Recipe",
    "dequantize",
    "format_max",
    "quantize",
    "quantization_counts",
    "scale_from_amax",
    "skip_reason",
]

#: The forward format: 4 exponent bits, 3 mantissa bits, finite only (max 448).
E4M3: Final = np.dtype(jnp.float8_e4m3fn)
#: The gradient format: 5 exponent bits, 2 mantissa bits, with inf (max 57344).
E5M2: Final = np.dtype(jnp.float8_e5m2)
FORMATS: Final = (E4M3, E5M2)

#: How amax (hence the scale) is taken: one per tensor, or one per row of the
#: lhs and column of the rhs of a matmul (reduced over the contraction).
SCALINGS: Final[dict[str, str]] = {
    "tensorwise": "one scale per tensor, from its amax just before the cast",
    "rowwise": "one scale per row of the lhs and per column of the rhs "
    "(reduced over the contracted dimensions)",
}

# Tensor cores take float8 GEMMs only with dimensions that are multiples of 16
# (cuBLASLt; torchao skips layers that are not).
ALIGNMENT: Final = 16
_F32: Final = np.dtype(np.float32)


@dataclasses.dataclass(frozen=True)
class Float8Recipe:
    """How autocast runs matmuls and convolutions in float8.

    A recipe is static configuration: frozen, hashable, part of a
    :class:`mixprec.Policy` (``Policy(..., float8=recipe)``) and so of every
    cache key. ``get_policy("mixed_float8")`` uses the default recipe.

    Forward operands are quantized to ``float8_e4m3fn`` and the gradient
    operand of backward matmuls to ``float8_e5m2``, each with a scale computed
    from its own amax just before the cast (current scaling), products
    accumulated in float32.

    Attributes:
        scaling: ``"tensorwise"`` (one scale per tensor; the default, and the
            layout XLA's GPU compiler rewrites into a float8 cuBLASLt GEMM) or
            ``"rowwise"`` (one scale per row of the lhs and column of the rhs,
            reduced over the contraction: an outlier costs precision only in
            its own row; convolutions stay tensorwise).
        min_dim: a product whose smallest dimension (``M``, ``N`` or ``K`` of
            a matmul, per batch element; for a convolution its output
            positions, output channels and ``C_in x window``) is below this
            stays in the 16-bit dtype: converting costs more than float8
            saves, and attention's per-head products (``K`` = head size) stay
            16-bit as in Transformer Engine and torchao.

    Examples:
        >>> r = Float8Recipe("rowwise")
        >>> str(r), Float8Recipe.parse("rowwise") == r
        ('rowwise', True)
        >>> str(Float8Recipe(min_dim=16))
        'tensorwise:min_dim=16'
    """

    scaling: str = "tensorwise"
    min_dim: int = 128

    def __post_init__(self) -> None:
        if not isinstance(self.scaling, str) or self.scaling not in SCALINGS:
            raise ValueError(
                f"`Float8Recipe(scaling=...)` must be one of "
                f"{format_choices(SCALINGS)}, got {self.scaling!r}."
                + (
                    suggest(self.scaling, SCALINGS)
                    if isinstance(self.scaling, str)
                    else ""
                )
                + " (Delayed scaling with an amax history is not supported: see"
                " docs/float8.md.)"
            )
        if (
            isinstance(self.min_dim, bool)
            or not isinstance(self.min_dim, int | np.integer)
            or self.min_dim < 1
        ):
            raise ValueError(
                "`Float8Recipe(min_dim=...)` must be a positive int, got "
                f"{self.min_dim!r}."
            )
        object.__setattr__(self, "min_dim", int(self.min_dim))

    def __str__(self) -> str:
        default = type(self)()
        if self.min_dim == default.min_dim:
            return self.scaling
        return f"{self.scaling}:min_dim={self.min_dim}"

    def scale_axes(self, contracting: Sequence[int]) -> tuple[int, ...] | None:
        """The axes of an operand that one scale covers: ``None`` for a scale
        per tensor (tensorwise, or a product without contracted axes such as a
        convolution), the contracted axes for rowwise.

        Examples:
            >>> rowwise, tensorwise = Float8Recipe("rowwise"), Float8Recipe()
            >>> rowwise.scale_axes((1,)), tensorwise.scale_axes((1,))
            ((1,), None)
        """
        if self.scaling == "rowwise" and contracting:
            return tuple(int(a) for a in contracting)
        return None

    @classmethod
    def parse(cls, text: str) -> Float8Recipe:
        """The recipe ``str(recipe)`` wrote: ``"rowwise"``, ``"tensorwise:min_dim=16"``.

        Raises:
            ValueError: an unknown scaling or option.

        Examples:
            >>> Float8Recipe.parse("tensorwise:min_dim=64").min_dim
            64
        """
        name, *options = text.strip().split(":")
        kwargs: dict[str, Any] = {}
        for opt in options:
            key, sep, value = opt.partition("=")
            key = key.strip()
            if not sep or key != "min_dim":
                raise ValueError(
                    f"`Float8Recipe.parse({text!r})`: unknown option {opt!r}; the "
                    "form is '<scaling>[:min_dim=<int>]', e.g. 'rowwise:min_dim=64'."
                )
            try:
                kwargs[key] = int(value)
            except ValueError:
                raise ValueError(
                    f"`Float8Recipe.parse({text!r})`: min_dim must be an int, got "
                    f"{value!r}."
                ) from None
        return cls(name.strip().lower(), **kwargs)


def format_max(fmt: DTypeLike) -> float:
    """The largest finite value of a float8 format.

    Examples:
        >>> format_max(E4M3), format_max(E5M2)
        (448.0, 57344.0)
    """
    return float(jnp.finfo(np.dtype(fmt)).max)


def _rounding_limit(fmt: np.dtype) -> float:
    """The magnitude from which a plain cast to ``fmt`` stops rounding to its
    largest finite value (and gives NaN or inf): max + half a spacing."""
    info = jnp.finfo(fmt)
    top = math.floor(math.log2(float(info.max)))
    return float(info.max) + 2.0 ** (top - int(info.nmant) - 1)


def scale_from_amax(amax: ArrayLike, fmt: DTypeLike) -> jax.Array:
    """``amax * (1 / max(fmt))`` in float32; 1 where ``amax`` is 0.

    A non-finite ``amax`` gives a non-finite scale, so a NaN or inf in a tensor
    reaches the product (and a loss scale's finiteness check) instead of being
    clipped away.

    Examples:
        >>> scale_from_amax(jnp.array([448.0, 0.0, 1.0]), E4M3)
        Array([1.       , 1.       , 0.0022321], dtype=float32)
    """
    a = jnp.asarray(amax, _F32)
    # Multiplied by the reciprocal, as XLA rewrites a division by a constant:
    # written so, the scale is the same on every backend and in NumPy.
    inv = np.float32(1.0 / format_max(fmt))
    s = lax.max(a * inv, np.float32(np.finfo(np.float32).tiny))
    return jnp.where(a == 0, np.float32(1), s)


def _scaled(
    x: ArrayLike, fmt: np.dtype, axes: Sequence[int] | None
) -> tuple[jax.Array, jax.Array]:
    """``(x / scale, scale)`` in float32 (before saturation and the cast)."""
    xf = jnp.asarray(x).astype(_F32)
    red = tuple(range(xf.ndim)) if axes is None else tuple(axes)
    amax = jnp.max(jnp.abs(xf), axis=red, keepdims=True) if xf.ndim else abs(xf)
    scale = scale_from_amax(amax, fmt)
    return xf / scale, scale


def quantize(
    x: ArrayLike,
    fmt: DTypeLike,
    axes: Sequence[int] | None = None,
    *,
    scale: ArrayLike | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Scales ``x`` into ``fmt`` with saturation: ``(q, scale)``.

    Args:
        x: any floating array.
        fmt: ``float8_e4m3fn`` or ``float8_e5m2``.
        axes: the axes amax is reduced over (``None``: all, one scale for the
            tensor). ``scale`` keeps the reduced axes with size 1, so
            ``q.astype(f32) * scale`` broadcasts back.
        scale: a given dequantization scale instead of one from ``x``'s amax
            (then values beyond ``max(fmt) * scale`` saturate).

    Returns:
        ``q`` in ``fmt`` and the float32 dequantization ``scale``.

    Examples:
        >>> q, s = quantize(jnp.array([1.0, -3.0, 1e-6]), E4M3)
        >>> q.dtype, s.shape, bool(s[0] == np.float32(3.0) * np.float32(1 / 448))
        (dtype(float8_e4m3fn), (1,), True)
        >>> dequantize(q, s, jnp.float32)  # 1/s = 149.3 rounds to 144; 1e-6 to 0
        Array([ 0.9642858, -3.0000002,  0.       ], dtype=float32)
        >>> quantize(jnp.array([1e6, -1e6, 2.0]), E4M3, scale=1.0)[0]  # saturates
        Array([448, -448, 2], dtype=float8_e4m3fn)
    """
    fmt = np.dtype(fmt)
    if fmt not in FORMATS:
        raise ValueError(
            f"`quantize(..., fmt=...)` must be float8_e4m3fn or float8_e5m2, got {fmt}."
        )
    if scale is not None:
        scale = jnp.asarray(scale, _F32)
        y = jnp.asarray(x).astype(_F32) / scale
    else:
        y, scale = _scaled(x, fmt, axes)
    big = np.float32(format_max(fmt))
    return lax.clamp(-big, y, big).astype(fmt), scale


def dequantize(q: ArrayLike, scale: ArrayLike, dtype: DTypeLike) -> jax.Array:
    """``q.astype(dtype) * scale`` (the scale cast to ``dtype``).

    Examples:
        >>> q, s = quantize(jnp.array([0.5, 2.0]), E5M2)
        >>> dequantize(q, s, jnp.float32)
        Array([0.5, 2. ], dtype=float32)
    """
    dtype = np.dtype(dtype)
    return jnp.asarray(q).astype(dtype) * jnp.asarray(scale).astype(dtype)


def quantization_counts(
    x: ArrayLike, fmt: DTypeLike, axes: Sequence[int] | None = None
) -> tuple[int, int, int]:
    """``(saturated, flushed, elements)`` of quantizing a concrete ``x``.

    ``saturated``: finite values beyond the format's rounding range after
    scaling, which a plain cast would have made NaN or inf and the saturating
    cast clips to the format's max. ``flushed``: non-zero values that became
    zero. Used by ``mixprec.diagnose``.

    Examples:
        >>> quantization_counts(jnp.array([448.0, 1.0, 1e-4, 0.0]), E4M3)
        (0, 1, 4)
    """
    fmt = np.dtype(fmt)
    y, _ = _scaled(x, fmt, axes)
    big = np.float32(format_max(fmt))
    q = np.asarray(lax.clamp(-big, y, big).astype(fmt), np.float64)
    y64 = np.asarray(y, np.float64)
    x64 = np.asarray(jnp.asarray(x).astype(_F32), np.float64)
    finite = np.isfinite(x64)
    saturated = int(np.count_nonzero(finite & (np.abs(y64) >= _rounding_limit(fmt))))
    flushed = int(np.count_nonzero(finite & (x64 != 0) & (q == 0)))
    return saturated, flushed, int(x64.size)


# ------------------------------------------------------------------ skip rules


def skip_reason(
    recipe: Float8Recipe,
    dims: Sequence[tuple[str, int]] | None,
    align: Sequence[tuple[str, int]],
) -> tuple[str, str] | None:
    """Why a product stays 16-bit under ``recipe``, or ``None`` to run it in float8.

    Args:
        recipe: the float8 recipe.
        dims: ``(name, size)`` of the product's dimensions (``None`` or a size
            of 0 when a dimension is symbolic).
        align: ``(name, size)`` of the dimensions that must be multiples of 16.

    Returns:
        ``(kind, text)`` with ``kind`` ``"alignment"``, ``"size"`` or
        ``"symbolic"``, or ``None``.

    Examples:
        >>> dims = (("M", 256), ("N", 10), ("K", 784))
        >>> skip_reason(Float8Recipe(), dims, dims)
        ('alignment', 'N=10 not a multiple of 16')
        >>> skip_reason(Float8Recipe(), (("M", 256), ("N", 64), ("K", 32)), ())
        ('size', 'K=32 below the recipe min_dim=128')
    """
    if not dims or any(not size for _, size in (*dims, *align)):
        return ("symbolic", "dimensions not known at trace time")
    bad = [(n, size) for n, size in align if size % ALIGNMENT]
    if bad:
        listed = ", ".join(f"{n}={size}" for n, size in bad)
        verb = "not a multiple" if len(bad) == 1 else "not multiples"
        return ("alignment", f"{listed} {verb} of {ALIGNMENT}")
    name, size = min(dims, key=lambda d: d[1])
    if size < recipe.min_dim:
        return ("size", f"{name}={size} below the recipe min_dim={recipe.min_dim}")
    return None
