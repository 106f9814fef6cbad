"""Float8 matmuls and convolutions, formulated per backend.

The autocast rules run a ``dot_general`` or ``conv_general_dilated`` decided
``float8`` (:mod:`~mixprec._src.autocast.decide`) through :func:`dot_general`
and :func:`conv_general_dilated`. Each operand is scaled into its float8 format
with saturation (:func:`mixprec._src.float8.quantize`: e4m3 forward, e5m2 for
a gradient), and the product of the float8 values is accumulated in float32 and
multiplied by the two scales. How that product is written depends on the
backend, as for the 16-bit dots of :mod:`~mixprec._src.autocast.dots`; both
give the same numbers:

* **GPU, tensorwise**: the quantize-dequantize pattern of the JAX FP8 guide and
  Flax's ``fp8_ops``: each float8 operand is converted back to the low dtype
  and multiplied by its scale, and the dot takes the dequantized operands.
  XLA's GPU compiler rewrites convert-multiply-dot into a cuBLASLt float8 GEMM
  that applies both scales in float32 (Hopper and newer; elsewhere the dot
  runs in the low dtype on the dequantized values).
* **CPU, and rowwise**: the float8 values are converted to bfloat16 (exact:
  every e4m3 and e5m2 value is a bfloat16 value) and multiplied with float32
  accumulation (on CPU in the canonical ``bf16 x bf16 -> f32`` layout of
  ``dots``), and the float32 product is multiplied by the scales: a scalar
  (tensorwise), or the outer product of the lhs row scales and the rhs column
  scales (rowwise: they factor out of the contraction). This is what a float8
  GEMM computes, so CPU runs are a faithful emulation. A rowwise dot on a GPU
  is written the same way (float8 operands with unit scale into the dot, the
  scales after it); the row scales are not a pattern XLA folds into the GEMM.

Gradients. Under reverse-mode AD (``custom_vjp=True``) the product is a
``jax.custom_vjp``: the cotangent is quantized to e5m2 and the two backward
products run the same way; the residuals are the float8 operands and their
scales (tensorwise: a quarter of float32's bytes) or the operands in the low
dtype (rowwise re-quantizes them along the backward contraction, as torchao
does). Otherwise (a whole train step under autocast, whose backward dots are
equations of their own; ``jax.jvp``) it is a ``jax.custom_jvp`` whose
derivative treats quantization as the identity (straight-through), with the
tangent products in the low dtype. Explicitly sharded operands take the second
form too (JAX's own transposes keep the shardings): their backward products are
16-bit under ``jax.grad``.

Convolutions are scaled tensorwise under every recipe; their backward products
are the transposes JAX derives for the convolution, applied to the float8
values.
"""

from __future__ import annotations

import functools as ft
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike, DTypeLike

from mixprec._src import float8 as f8
from mixprec._src.autocast import dots


__all__ = ["conv_general_dilated", "dot_general", "product_dims"]

_F32 = np.dtype(np.float32)
_BF16 = np.dtype(jnp.bfloat16)


# ------------------------------------------------------------------ dimensions


def _size(shape: Sequence[Any]) -> int:
    """The product of ``shape``, or 0 if a dimension is symbolic."""
    n = 1
    for d in shape:
        if not isinstance(d, int | np.integer):
            return 0
        n *= int(d)
    return n


def product_dims(
    name: str, in_shapes: Sequence[Sequence[Any]], out_shape: Sequence[Any], params: Any
) -> tuple[tuple[tuple[str, int], ...], tuple[tuple[str, int], ...]] | None:
    """The dimensions a float8 recipe's skip rules look at: ``(size, align)``.

    For ``dot_general``: ``M``, ``N``, ``K`` per batch element (both). For
    ``conv_general_dilated``: output positions ``M``, ``C_out`` and ``K`` =
    ``C_in x window`` for the size rule, ``C_in`` and ``C_out`` (per group) for
    alignment. A symbolic dimension has size 0. ``None`` for other ops.

    Examples:
        >>> product_dims("dot_general", [(8, 784), (784, 10)], (8, 10),
        ...              {"dimension_numbers": (((1,), (0,)), ((), ()))})[0]
        (('M', 8), ('N', 10), ('K', 784))
    """
    if name == "dot_general":
        (lc, rc), (lb, rb) = params["dimension_numbers"]
        lhs, rhs = in_shapes
        k = _size([lhs[i] for i in lc])
        m = _size([d for i, d in enumerate(lhs) if i not in set(lc) | set(lb)])
        n = _size([d for i, d in enumerate(rhs) if i not in set(rc) | set(rb)])
        dims = (("M", m), ("N", n), ("K", k))
        return dims, dims
    if name == "conv_general_dilated":
        dn = params["dimension_numbers"]
        rhs = in_shapes[1]
        rhs_spec, out_spec = tuple(dn.rhs_spec), tuple(dn.out_spec)
        c_out, c_in = _size([rhs[rhs_spec[0]]]), _size([rhs[rhs_spec[1]]])
        window = _size([rhs[i] for i in rhs_spec[2:]])
        m = _size([out_shape[out_spec[0]], *(out_shape[i] for i in out_spec[2:])])
        return (
            (("M", m), ("C_out", c_out), ("K", c_in * window)),
            (("C_in", c_in), ("C_out", c_out)),
        )
    return None


# ------------------------------------------------------------------ the product


class _Plan(NamedTuple):
    """How one float8 product is computed (static: a custom derivative's
    non-differentiable argument)."""

    formats: tuple[np.dtype, np.dtype]
    rowwise: bool
    low: np.dtype  # the low dtype: dequantization (GPU), residuals, tangents
    out: np.dtype
    qdq: bool  # quantize-dequantize pattern (GPU tensorwise)
    canonical: bool  # CPU canonical layout (dots._contract)
    precision: Any
    platform: str


def _plan(
    recipe: f8.Float8Recipe,
    formats: Sequence[Any],
    low_dtype: DTypeLike,
    out_dtype: DTypeLike,
    platform: str | None,
    precision: Any,
    *,
    explicit: bool = False,
    conv: bool = False,
) -> _Plan:
    fmts = tuple(np.dtype(f) for f in formats)
    for f in fmts:
        if f not in f8.FORMATS:
            raise ValueError(
                "`float8_dots(..., formats=...)` must hold float8_e4m3fn or "
                f"float8_e5m2, got {f}."
            )
    plat = platform or jax.default_backend()
    rowwise = recipe.scaling == "rowwise" and not conv
    cpu = plat == "cpu"
    return _Plan(
        formats=(fmts[0], fmts[1]),
        rowwise=rowwise,
        low=np.dtype(low_dtype),
        out=np.dtype(out_dtype),
        qdq=not cpu and not rowwise,
        canonical=cpu and not explicit,
        precision=precision,
        platform=plat,
    )


def _contracted(a_labels: Sequence[int], b_labels: Sequence[int], out: Sequence[int]):
    return {lab for lab in a_labels if lab in b_labels and lab not in out}


def _quantize(
    x: jax.Array, labels: Sequence[int], contracted: set[int], fmt: Any, rowwise: bool
) -> tuple[jax.Array, jax.Array]:
    axes = [i for i, lab in enumerate(labels) if lab in contracted] if rowwise else None
    return f8.quantize(x, fmt, axes)


def _scale_into(
    s: jax.Array,
    labels: Sequence[int],
    contracted: set[int],
    out_labels: Sequence[int],
    out_shape: Sequence[int],
) -> jax.Array:
    """A scale (with size-1 contracted dimensions) laid out to broadcast into the
    product: a scalar, or an array of the product's shape."""
    if all(d == 1 for d in s.shape):
        return s.reshape(())
    keep = [i for i, lab in enumerate(labels) if lab not in contracted]
    kept = [labels[i] for i in keep]
    s = s.reshape([s.shape[i] for i in keep])
    order = sorted(range(len(kept)), key=lambda j: list(out_labels).index(kept[j]))
    if order != list(range(len(kept))):
        s = lax.transpose(s, order)
    dims = tuple(list(out_labels).index(kept[j]) for j in order)
    return lax.broadcast_in_dim(s, tuple(out_shape), dims)


def _labeled_dot(
    a: jax.Array,
    a_labels: Sequence[int],
    b: jax.Array,
    b_labels: Sequence[int],
    out_labels: Sequence[int],
    precision: Any,
    preferred: Any,
    out_sharding: Any = None,
) -> jax.Array:
    """``lax.dot_general`` of two labelled operands, result in ``out_labels`` order."""
    a_labels, b_labels, out_labels = list(a_labels), list(b_labels), list(out_labels)
    batch = [lab for lab in out_labels if lab in a_labels and lab in b_labels]
    contract = [lab for lab in a_labels if lab in b_labels and lab not in out_labels]
    dn = (
        (
            tuple(a_labels.index(lab) for lab in contract),
            tuple(b_labels.index(lab) for lab in contract),
        ),
        (
            tuple(a_labels.index(lab) for lab in batch),
            tuple(b_labels.index(lab) for lab in batch),
        ),
    )
    kw = {} if out_sharding is None else {"out_sharding": out_sharding}
    out = lax.dot_general(
        a, b, dn, precision=precision, preferred_element_type=preferred, **kw
    )
    res = [
        *batch,
        *(lab for lab in a_labels if lab not in batch and lab not in contract),
        *(lab for lab in b_labels if lab not in batch and lab not in contract),
    ]
    perm = tuple(res.index(lab) for lab in out_labels)
    return out if perm == tuple(range(out.ndim)) else lax.transpose(out, perm)


def _contract(
    a: tuple[jax.Array, jax.Array],
    a_labels: Sequence[int],
    b: tuple[jax.Array, jax.Array],
    b_labels: Sequence[int],
    out_labels: Sequence[int],
    plan: _Plan,
    out_sharding: Any = None,
) -> jax.Array:
    """The product of two quantized operands ``(q, scale)``: float32 (scales
    applied after) or, for the quantize-dequantize pattern, the low dtype."""
    (qa, sa), (qb, sb) = a, b
    if plan.qdq:
        da, db = f8.dequantize(qa, sa, plan.low), f8.dequantize(qb, sb, plan.low)
        return _labeled_dot(
            da, a_labels, db, b_labels, out_labels, plan.precision, None, out_sharding
        )
    a16, b16 = qa.astype(_BF16), qb.astype(_BF16)
    if plan.canonical:
        p = dots._contract(
            a16, a_labels, b16, b_labels, out_labels, plan.precision, _F32, True
        )
    else:
        p = _labeled_dot(
            a16, a_labels, b16, b_labels, out_labels, plan.precision, _F32, out_sharding
        )
    contracted = _contracted(a_labels, b_labels, out_labels)
    scale = _scale_into(sa, a_labels, contracted, out_labels, p.shape) * _scale_into(
        sb, b_labels, contracted, out_labels, p.shape
    )
    return p * scale


def _quantized(
    x: jax.Array,
    labels: Sequence[int],
    other: Sequence[int],
    out_labels: Sequence[int],
    fmt: Any,
    plan: _Plan,
) -> tuple[jax.Array, jax.Array]:
    return _quantize(
        x, labels, _contracted(labels, other, out_labels), fmt, plan.rowwise
    )


# ------------------------------------------------------------------ dot_general

_DimNums = Any


def _dot_forward(
    lhs: jax.Array, rhs: jax.Array, dn: _DimNums, plan: _Plan, out_sharding: Any = None
) -> tuple[jax.Array, tuple[Any, Any]]:
    a_l, b_l, o_l = dots._dot_labels(lhs.ndim, rhs.ndim, dn)
    qa = _quantized(lhs, a_l, b_l, o_l, plan.formats[0], plan)
    qb = _quantized(rhs, b_l, a_l, o_l, plan.formats[1], plan)
    out = _contract(qa, a_l, qb, b_l, o_l, plan, out_sharding)
    return out.astype(plan.out), (qa, qb)


@ft.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _dot_vjp(
    lhs: jax.Array,
    rhs: jax.Array,
    dn: _DimNums,
    plan: _Plan,
    lhs_dtype: np.dtype,
    rhs_dtype: np.dtype,
) -> jax.Array:
    del lhs_dtype, rhs_dtype
    return _dot_forward(lhs, rhs, dn, plan)[0]


def _dot_vjp_fwd(lhs, rhs, dn, plan, lhs_dtype, rhs_dtype):
    del lhs_dtype, rhs_dtype
    out, (qa, qb) = _dot_forward(lhs, rhs, dn, plan)
    if plan.rowwise:
        # The backward products contract other dimensions: re-quantized there.
        return out, (lhs.astype(plan.low), rhs.astype(plan.low))
    return out, (qa, qb)


def _dot_vjp_bwd(dn, plan, lhs_dtype, rhs_dtype, res, g):
    a, b = res
    lhs_nd = a.ndim if plan.rowwise else a[0].ndim
    rhs_nd = b.ndim if plan.rowwise else b[0].ndim
    a_l, b_l, o_l = dots._dot_labels(lhs_nd, rhs_nd, dn)
    fa, fb = plan.formats
    if plan.rowwise:
        g_lhs = _quantized(g, o_l, b_l, a_l, f8.E5M2, plan)
        g_rhs = _quantized(g, o_l, a_l, b_l, f8.E5M2, plan)
        qb = _quantized(b, b_l, o_l, a_l, fb, plan)
        qa = _quantized(a, a_l, o_l, b_l, fa, plan)
    else:
        g_lhs = g_rhs = f8.quantize(g, f8.E5M2)
        qa, qb = a, b
    d_lhs = _contract(g_lhs, o_l, qb, b_l, a_l, plan)
    d_rhs = _contract(g_rhs, o_l, qa, a_l, b_l, plan)
    return d_lhs.astype(lhs_dtype), d_rhs.astype(rhs_dtype)


_dot_vjp.defvjp(_dot_vjp_fwd, _dot_vjp_bwd)


@ft.partial(jax.custom_jvp, nondiff_argnums=(2, 3, 4))
def _dot_ste(
    lhs: jax.Array, rhs: jax.Array, dn: _DimNums, plan: _Plan, out_sharding: Any
) -> jax.Array:
    return _dot_forward(lhs, rhs, dn, plan, out_sharding)[0]


@_dot_ste.defjvp
def _dot_ste_jvp(dn, plan, out_sharding, primals, tangents):
    lhs, rhs = primals
    t_lhs, t_rhs = tangents
    out = _dot_ste(lhs, rhs, dn, plan, out_sharding)
    dot = ft.partial(
        dots.dot_general,
        dimension_numbers=dn,
        precision=plan.precision,
        low_dtype=plan.low,
        out_dtype=out.dtype,
        forward_mode_ad=True,
        platform=plan.platform,
    )
    return out, dot(t_lhs, rhs) + dot(lhs, t_rhs)


def dot_general(
    lhs: ArrayLike,
    rhs: ArrayLike,
    *,
    dimension_numbers: Any,
    precision: Any = None,
    recipe: f8.Float8Recipe,
    formats: Sequence[DTypeLike] = (f8.E4M3, f8.E4M3),
    low_dtype: DTypeLike,
    out_dtype: DTypeLike,
    custom_vjp: bool = True,
    out_sharding: Any = None,
    platform: str | None = None,
) -> jax.Array:
    """A ``lax.dot_general`` of float8-scaled operands, in ``out_dtype``.

    Args:
        lhs: left operand (any floating dtype).
        rhs: right operand (any floating dtype).
        dimension_numbers: as for ``jax.lax.dot_general``.
        precision: as for ``jax.lax.dot_general``.
        recipe: the :class:`~mixprec.Float8Recipe` (its scaling).
        formats: the float8 format of each operand.
        low_dtype: the 16-bit dtype of dequantized operands (GPU), residuals
            (rowwise) and tangents.
        out_dtype: the dtype of the result.
        custom_vjp: a ``jax.custom_vjp`` with e5m2 cotangents (for reverse-mode
            AD) rather than a straight-through ``jax.custom_jvp``.
        out_sharding: passed to the dot when not None (the product is then not
            written in the CPU canonical layout).
        platform: the backend to formulate for (default: JAX's default).

    Returns:
        The product, with dtype ``out_dtype``.

    Examples:
        >>> import jax.numpy as jnp
        >>> from mixprec._src.float8 import Float8Recipe
        >>> x = jnp.full((16, 32), 0.5); w = jnp.full((32, 16), 3.0)
        >>> y = dot_general(x, w, dimension_numbers=(((1,), (0,)), ((), ())),
        ...                 recipe=Float8Recipe(), low_dtype=jnp.bfloat16,
        ...                 out_dtype=jnp.float32)
        >>> y.dtype, float(y[0, 0])
        (dtype('float32'), 48.0)
    """
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    dn = dots._canon_dn(dimension_numbers)
    explicit = out_sharding is not None or dots._explicitly_sharded(lhs, rhs)
    plan = _plan(
        recipe, formats, low_dtype, out_dtype, platform, precision, explicit=explicit
    )
    if custom_vjp and not explicit:
        return _dot_vjp(lhs, rhs, dn, plan, lhs.dtype, rhs.dtype)
    return _dot_ste(lhs, rhs, dn, plan, out_sharding)


# ------------------------------------------------------------------ convolutions


def _conv(a: jax.Array, b: jax.Array, params: tuple, preferred: Any) -> jax.Array:
    kw = dict(params)
    kw["preferred_element_type"] = preferred
    kw.setdefault("out_sharding", None)
    return lax.conv_general_dilated_p.bind(a, b, **kw)


def _conv_operands(
    qa: tuple[jax.Array, jax.Array], qb: tuple[jax.Array, jax.Array], plan: _Plan
) -> tuple[jax.Array, jax.Array, Any, jax.Array | None]:
    """The operands the convolution takes, its accumulation dtype, and the scale
    to apply after it (``None`` for the quantize-dequantize pattern)."""
    (a, sa), (b, sb) = qa, qb
    if plan.qdq:
        return (
            f8.dequantize(a, sa, plan.low),
            f8.dequantize(b, sb, plan.low),
            None,
            None,
        )
    scale = sa.reshape(()) * sb.reshape(())
    return a.astype(_BF16), b.astype(_BF16), _F32, scale


def _conv_forward(lhs, rhs, params, plan):
    qa = f8.quantize(lhs, plan.formats[0])
    qb = f8.quantize(rhs, plan.formats[1])
    a, b, acc, scale = _conv_operands(qa, qb, plan)
    out = _conv(a, b, params, acc)
    if scale is not None:
        out = out * scale
    return out.astype(plan.out), (qa, qb)


@ft.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _conv_vjp(lhs, rhs, params, plan, lhs_dtype, rhs_dtype):
    del lhs_dtype, rhs_dtype
    return _conv_forward(lhs, rhs, params, plan)[0]


def _conv_vjp_fwd(lhs, rhs, params, plan, lhs_dtype, rhs_dtype):
    del lhs_dtype, rhs_dtype
    out, res = _conv_forward(lhs, rhs, params, plan)
    return out, res


def _conv_vjp_bwd(params, plan, lhs_dtype, rhs_dtype, res, g):
    qa, qb = res
    qg, sg = f8.quantize(g, f8.E5M2)
    a, b, acc, _ = _conv_operands(qa, qb, plan)
    out, vjp = jax.vjp(lambda x, y: _conv(x, y, params, acc), a, b)
    if plan.qdq:
        d_lhs, d_rhs = vjp(f8.dequantize(qg, sg, out.dtype))
    else:
        d_lhs, d_rhs = vjp(qg.astype(out.dtype))
        d_lhs = d_lhs.astype(_F32) * (sg.reshape(()) * qb[1].reshape(()))
        d_rhs = d_rhs.astype(_F32) * (sg.reshape(()) * qa[1].reshape(()))
    return d_lhs.astype(lhs_dtype), d_rhs.astype(rhs_dtype)


_conv_vjp.defvjp(_conv_vjp_fwd, _conv_vjp_bwd)


@ft.partial(jax.custom_jvp, nondiff_argnums=(2, 3))
def _conv_ste(lhs, rhs, params, plan):
    return _conv_forward(lhs, rhs, params, plan)[0]


@_conv_ste.defjvp
def _conv_ste_jvp(params, plan, primals, tangents):
    lhs, rhs = primals
    t_lhs, t_rhs = tangents
    out = _conv_ste(lhs, rhs, params, plan)
    kw = dict(params)
    kw.pop("preferred_element_type", None)
    conv = ft.partial(
        dots.conv_general_dilated,
        low_dtype=plan.low,
        out_dtype=out.dtype,
        platform=plan.platform,
        **kw,
    )
    return out, conv(t_lhs, rhs) + conv(lhs, t_rhs)


def conv_general_dilated(
    lhs: ArrayLike,
    rhs: ArrayLike,
    *,
    recipe: f8.Float8Recipe,
    formats: Sequence[DTypeLike] = (f8.E4M3, f8.E4M3),
    low_dtype: DTypeLike,
    out_dtype: DTypeLike,
    custom_vjp: bool = True,
    platform: str | None = None,
    **conv_params: Any,
) -> jax.Array:
    """A ``lax.conv_general_dilated`` of float8-scaled operands (tensorwise).

    ``conv_params`` are the parameters of ``jax.lax.conv_general_dilated_p`` as
    in a jaxpr equation; ``preferred_element_type`` is replaced (float32
    accumulation). The other arguments are those of :func:`dot_general`.

    Examples:
        >>> import jax.numpy as jnp
        >>> from jax import lax
        >>> from mixprec._src.float8 import Float8Recipe
        >>> y = conv_general_dilated(
        ...     jnp.ones((1, 16, 4, 4)), jnp.full((16, 16, 3, 3), 0.5),
        ...     recipe=Float8Recipe(), low_dtype=jnp.bfloat16,
        ...     out_dtype=jnp.float32, window_strides=(1, 1),
        ...     padding=((1, 1), (1, 1)), lhs_dilation=(1, 1), rhs_dilation=(1, 1),
        ...     dimension_numbers=lax.ConvDimensionNumbers(
        ...         (0, 1, 2, 3), (0, 1, 2, 3), (0, 1, 2, 3)),
        ...     feature_group_count=1, batch_group_count=1, precision=None,
        ...     preferred_element_type=None)
        >>> y.dtype, float(y[0, 0, 1, 1])
        (dtype('float32'), 72.0)
    """
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    plan = _plan(
        recipe,
        formats,
        low_dtype,
        out_dtype,
        platform,
        conv_params.get("precision"),
        conv=True,
    )
    params = tuple(sorted(conv_params.items()))
    if custom_vjp:
        return _conv_vjp(lhs, rhs, params, plan, lhs.dtype, rhs.dtype)
    return _conv_ste(lhs, rhs, params, plan)
