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

Which format and which scales each operand takes is the recipe's data
(:class:`Float8Recipe`, the named ones in :data:`RECIPES`): by default forward
operands use e4m3 (more precision) and gradients e5m2 (more range), as in
NVIDIA Transformer Engine, torchao and Flax; DeepSeek-V3 uses e4m3 for
gradients too, with finer scales (``"rowwise_e4m3"``). The scale is computed from the
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
    "FORMAT_NAMES",
    "RECIPES",
    "SCALES",
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

#: What one scale of an operand covers (a recipe's ``scales``, per role).
SCALES: Final[dict[str, str]] = {
    "tensorwise": "one scale per tensor, from its amax just before the cast",
    "rowwise": "one scale per row of the lhs and per column of the rhs "
    "(amax over the contracted dimensions; an operand without contracted "
    "dimensions, a convolution's, takes one scale)",
}

#: The short names of the float8 formats in recipe strings.
FORMAT_NAMES: Final[dict[str, np.dtype]] = {"e4m3": E4M3, "e5m2": E5M2}


@dataclasses.dataclass(frozen=True)
class _Preset:
    """The data of a named recipe."""

    formats: tuple[np.dtype, np.dtype]  # (operands, gradients)
    scales: tuple[str, str]  # (operands, gradients), keys of SCALES
    text: str  # for the docs and error messages


#: The named recipes: ``Float8Recipe(<name>)`` takes its formats and scales
#: from here. A new recipe that differs only in data is one entry.
RECIPES: Final[dict[str, _Preset]] = {
    "tensorwise": _Preset(
        (E4M3, E5M2),
        ("tensorwise", "tensorwise"),
        "e4m3 operands, e5m2 gradients, one scale per tensor (torchao's default)",
    ),
    "rowwise": _Preset(
        (E4M3, E5M2),
        ("rowwise", "rowwise"),
        "e4m3 operands, e5m2 gradients, one scale per row of the lhs and column "
        "of the rhs",
    ),
    "rowwise_e4m3": _Preset(
        (E4M3, E4M3),
        ("rowwise", "rowwise"),
        "e4m3 for gradients too, rowwise scales (DeepSeek-V3's choice of one "
        "format, with fine-grained scales to give e4m3 the range)",
    ),
}

# Tensor cores take float8 GEMMs only with dimensions that are multiples of 16
# (cuBLASLt; torchao skips layers that are not).
ALIGNMENT: Final = 16
_F32: Final = np.dtype(np.float32)
_SHORT: Final = {v: k for k, v in FORMAT_NAMES.items()}


def _format(value: Any, what: str) -> np.dtype:
    """A float8 format from a dtype or a short name (``"e4m3"``)."""
    if isinstance(value, str) and value.strip().lower() in FORMAT_NAMES:
        return FORMAT_NAMES[value.strip().lower()]
    try:
        fmt = np.dtype(value)
    except TypeError:
        fmt = None
    if fmt is None or fmt not in FORMATS:
        raise ValueError(
            f"`Float8Recipe({what}=...)` must hold float8 formats "
            f"({format_choices(FORMAT_NAMES)}, or their dtypes), got {value!r}."
        )
    return fmt


def _pair(value: Any, what: str) -> tuple[Any, Any]:
    if isinstance(value, str) or not isinstance(value, Sequence) or len(value) != 2:
        raise ValueError(
            f"`Float8Recipe({what}=...)` must be a pair (operands, gradients), "
            f"got {value!r}."
        )
    return value[0], value[1]


@dataclasses.dataclass(frozen=True)
class Float8Recipe:
    """How autocast runs matmuls and convolutions in float8: a recipe is data.

    A recipe is static configuration: frozen, hashable, part of a
    :class:`mixprec.Policy` (``Policy(..., float8=recipe)``) and so of every
    cache key. ``get_policy("mixed_float8")`` uses the default recipe.

    Each operand of a product is scaled into a float8 format with a scale
    computed from its own amax just before the cast (current scaling), and
    the product is accumulated in float32. What a recipe says is, per role of
    an operand (an ordinary operand, forward or kept for the backward pass;
    or a gradient, the cotangent of a backward product), its format and what
    one scale covers. The formulations
    (:mod:`mixprec._src.autocast.float8_dots`), the decision and ``diagnose``
    read these fields and nothing else.

    Attributes:
        scaling: the recipe's name, a key of :data:`RECIPES`
            (``"tensorwise"``, the default: torchao's default and the layout
            XLA's GPU compiler hands to a float8 cuBLASLt GEMM; ``"rowwise"``:
            an outlier costs precision only in its own row;
            ``"rowwise_e4m3"``: e4m3 for gradients too). ``formats`` and
            ``scales`` not given are the named recipe's.
        min_dim: a product whose smallest dimension (``M``, ``N`` or ``K`` of
            a matmul, per batch element; for a convolution its output
            positions, output channels and ``C_in x window``) is below this
            stays in the 16-bit dtype: converting costs more than float8
            saves, and attention's per-head products (``K`` = head size) stay
            16-bit as in Transformer Engine and torchao.
        formats: ``(operands, gradients)``: the float8 format of an ordinary
            operand and of a gradient (``float8_e4m3fn`` or ``float8_e5m2``,
            or ``"e4m3"`` / ``"e5m2"``).
        scales: ``(operands, gradients)``: what one scale covers, a key of
            :data:`SCALES` (``"tensorwise"`` or ``"rowwise"``). A convolution's
            operands have no contracted axes that a row scale could cover:
            they are scaled per tensor under every recipe.

    Examples:
        >>> r = Float8Recipe("rowwise")
        >>> str(r), Float8Recipe.parse("rowwise") == r, r.scales
        ('rowwise', True, ('rowwise', 'rowwise'))
        >>> str(Float8Recipe(min_dim=16))
        'tensorwise:min_dim=16'
        >>> [f.name for f in Float8Recipe("rowwise_e4m3").formats]
        ['float8_e4m3fn', 'float8_e4m3fn']
        >>> custom = Float8Recipe(scales=("rowwise", "tensorwise"))
        >>> str(custom), Float8Recipe.parse(str(custom)) == custom
        ('tensorwise:scales=rowwise/tensorwise', True)
    """

    scaling: str = "tensorwise"
    min_dim: int = 128
    # None: the named recipe's (filled in by __post_init__).
    formats: tuple[DTypeLike, DTypeLike] | None = None
    scales: tuple[str, str] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.scaling, str) or self.scaling not in RECIPES:
            raise ValueError(
                f"`Float8Recipe(scaling=...)` must be one of "
                f"{format_choices(RECIPES)}, got {self.scaling!r}."
                + (
                    suggest(self.scaling, RECIPES)
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
        preset = RECIPES[self.scaling]
        formats = preset.formats if self.formats is None else self.formats
        fa, fg = _pair(formats, "formats")
        object.__setattr__(
            self, "formats", (_format(fa, "formats"), _format(fg, "formats"))
        )
        scales = preset.scales if self.scales is None else self.scales
        pair = _pair(scales, "scales")
        for s in pair:
            if not isinstance(s, str) or s not in SCALES:
                raise ValueError(
                    f"`Float8Recipe(scales=...)` must hold {format_choices(SCALES)}"
                    f", got {s!r}." + (suggest(s, SCALES) if isinstance(s, str) else "")
                )
        object.__setattr__(self, "scales", (str(pair[0]), str(pair[1])))

    def _data(self) -> tuple[tuple[np.dtype, np.dtype], tuple[str, str]]:
        """The formats and scales (``__post_init__`` filled them in)."""
        assert self.formats is not None and self.scales is not None
        fa, fg = self.formats
        return (np.dtype(fa), np.dtype(fg)), self.scales

    def __str__(self) -> str:
        text = self.scaling
        preset = RECIPES[self.scaling]
        formats, scales = self._data()
        if self.min_dim != type(self)().min_dim:
            text += f":min_dim={self.min_dim}"
        if formats != preset.formats:
            text += ":formats=" + "/".join(_SHORT[f] for f in formats)
        if scales != preset.scales:
            text += ":scales=" + "/".join(scales)
        return text

    def format(self, *, gradient: bool = False) -> np.dtype:
        """The float8 format of an operand: of a gradient, or an ordinary one.

        Examples:
            >>> Float8Recipe().format(gradient=True)
            dtype(float8_e5m2)
            >>> Float8Recipe("rowwise_e4m3").format(gradient=True)
            dtype(float8_e4m3fn)
        """
        return self._data()[0][1 if gradient else 0]

    def scale_axes(
        self, contracting: Sequence[int], *, gradient: bool = False
    ) -> tuple[int, ...] | None:
        """The axes of an operand that one scale covers: ``None`` for a scale
        per tensor (a ``"tensorwise"`` role, or a product without contracted
        axes such as a convolution), the contracted axes for ``"rowwise"``.

        Args:
            contracting: the operand's contracted axes in its product.
            gradient: the operand is a gradient (the recipe's second role).

        Examples:
            >>> rowwise, tensorwise = Float8Recipe("rowwise"), Float8Recipe()
            >>> rowwise.scale_axes((1,)), tensorwise.scale_axes((1,))
            ((1,), None)
            >>> mixed = Float8Recipe(scales=("tensorwise", "rowwise"))
            >>> mixed.scale_axes((0,)), mixed.scale_axes((0,), gradient=True)
            (None, (0,))
        """
        if self._data()[1][1 if gradient else 0] == "rowwise" and contracting:
            return tuple(int(a) for a in contracting)
        return None

    @classmethod
    def parse(cls, text: str) -> Float8Recipe:
        """The recipe ``str(recipe)`` wrote: ``"rowwise"``,
        ``"tensorwise:min_dim=16"``, ``"rowwise:formats=e4m3/e4m3"``.

        Raises:
            ValueError: an unknown recipe or option.

        Examples:
            >>> Float8Recipe.parse("tensorwise:min_dim=64").min_dim
            64
            >>> Float8Recipe.parse("rowwise:formats=e4m3/e4m3").formats[1].name
            'float8_e4m3fn'
        """
        name, *options = text.strip().split(":")
        kwargs: dict[str, Any] = {}
        form = (
            "the form is '<recipe>[:min_dim=<int>][:formats=<f>/<f>]"
            "[:scales=<s>/<s>]', e.g. 'rowwise:min_dim=64'"
        )
        for opt in options:
            key, sep, value = opt.partition("=")
            key = key.strip()
            if not sep or key not in ("min_dim", "formats", "scales"):
                raise ValueError(
                    f"`Float8Recipe.parse({text!r})`: unknown option {opt!r}; {form}."
                )
            if key == "min_dim":
                try:
                    kwargs[key] = int(value)
                except ValueError:
                    raise ValueError(
                        f"`Float8Recipe.parse({text!r})`: min_dim must be an int, "
                        f"got {value!r}."
                    ) from None
            else:
                kwargs[key] = tuple(v.strip().lower() for v in value.split("/"))
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


@jax.jit(static_argnums=(1, 2))
def _scaled_and_cast(x: Any, fmt: str, axes: tuple[int, ...] | None) -> tuple[Any, Any]:
    # One compiled program per shape and format: diagnose and mixprec.plan
    # count every product's operands, and op by op each shape compiled the
    # scaling's several ops one by one.
    y, _ = _scaled(x, np.dtype(fmt), axes)
    big = np.float32(format_max(fmt))
    return y, lax.clamp(-big, y, big).astype(fmt)


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
    y, q = _scaled_and_cast(x, fmt.name, None if axes is None else tuple(axes))
    q = np.asarray(q, np.float64)
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
