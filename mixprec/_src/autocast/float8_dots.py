"""Float8 matmuls and convolutions, formulated per platform.

The autocast rules run a ``dot_general`` or ``conv_general_dilated`` decided
``float8`` (:mod:`~mixprec._src.autocast.decide`) through :func:`dot_general`
and :func:`conv_general_dilated`. Each operand is scaled into its float8 format
with saturation (:func:`mixprec._src.float8.quantize`: e4m3 forward, e5m2 for
a gradient), the float8 values are multiplied with float32 accumulation, and
the float32 product is multiplied by the scales: a scalar per operand
(tensorwise), or the lhs row scales and the rhs column scales (rowwise: they
factor out of the contraction). The two scales are applied one after the
other, so a product whose scales multiply below float32's range (tiny
tensors) is not flushed to zero.

How the float8 values are multiplied is chosen per platform when the
computation is lowered (:mod:`~mixprec._src.autocast.platforms`):

* **GPU (and any platform but the CPU)**: the float8 arrays go straight into
  ``lax.dot_general`` (``preferred_element_type=float32``). XLA's GPU
  compiler hands that to cuBLASLt's float8 GEMM (``__cublas$lt$matmul$f8`` in
  the optimized HLO; Hopper, Ada and newer, e4m3 x e4m3, e4m3 x e5m2 and
  e5m2 x e4m3). The float8 values reach the GEMM as float8 arrays, so no
  compiler pass can fold their rounding away: the quantize-dequantize pattern
  (convert to float8, convert back, multiply) is simplified to a single
  convert by XLA's GPU pipeline and then runs as a bfloat16 GEMM, which is why
  it is not used. Where a platform has no float8 GEMM, XLA widens the float8
  operands itself: the numbers stay exact, only the speed differs.
* **CPU**: XLA:CPU has no float8 GEMM. The float8 values are converted to
  bfloat16 (exact: every e4m3 and e5m2 value is a bfloat16 value) and
  multiplied with float32 accumulation, in the canonical ``bf16 x bf16 ->
  f32`` layout of :mod:`~mixprec._src.autocast.dots`: the numbers of a float8
  GEMM, so CPU runs are a faithful emulation.

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

Convolutions are scaled tensorwise under every recipe and run in float8 on
CPU only (emulated as above). XLA's GPU compiler has no float8 convolution
that mixprec relies on, so on every other platform a convolution of a float8
policy runs in the low dtype (``explain`` says so); its residuals are the
operands in the low dtype on every platform.
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
from mixprec._src.autocast.platforms import canonical_platform, per_platform
from mixprec._src.autocast.request import ProductRequest


__all__ = [
    "conv_float8_note",
    "conv_general_dilated",
    "conv_product",
    "dot_float8_note",
    "dot_general",
    "dot_general_product",
]

_F32 = np.dtype(np.float32)
_BF16 = np.dtype(jnp.bfloat16)


# ------------------------------------------------------------------ the product


class _Plan(NamedTuple):
    """How one float8 product is computed (static: a custom derivative's
    non-differentiable argument)."""

    recipe: f8.Float8Recipe  # formats and scales per role, read from here
    formats: tuple[np.dtype, np.dtype]  # the forward operands' formats
    gradients: tuple[bool, bool]  # forward operands that are gradients
    low: np.dtype  # the low dtype: residuals (rowwise, convs) and tangents
    precision: Any
    platform: str | None  # a pinned platform, or None: chosen at lowering
    explicit: bool  # explicitly sharded operands: no CPU canonical layout


def _plan(
    recipe: f8.Float8Recipe,
    formats: Sequence[Any] | None,
    gradients: Sequence[bool],
    low_dtype: DTypeLike,
    platform: str | None,
    precision: Any,
    *,
    explicit: bool = False,
) -> _Plan:
    if not isinstance(recipe, f8.Float8Recipe):
        raise TypeError(
            "`float8_dots(..., recipe=...)` must be a mixprec.Float8Recipe, got "
            f"{recipe!r}."
        )
    grads = tuple(bool(g) for g in gradients)
    if len(grads) != 2:
        raise ValueError(
            "`float8_dots(..., gradients=...)` must say for each of the two "
            f"operands whether it is a gradient, got {gradients!r}."
        )
    if formats is None:
        formats = tuple(recipe.format(gradient=g) for g in grads)
    fmts = tuple(np.dtype(f) for f in formats)
    for f in fmts:
        if f not in f8.FORMATS:
            raise ValueError(
                "`float8_dots(..., formats=...)` must hold float8_e4m3fn or "
                f"float8_e5m2, got {f}."
            )
    return _Plan(
        recipe=recipe,
        formats=(fmts[0], fmts[1]),
        gradients=(grads[0], grads[1]),
        low=np.dtype(low_dtype),
        precision=precision,
        platform=canonical_platform(platform),
        explicit=explicit,
    )


def _contracted(a_labels: Sequence[int], b_labels: Sequence[int], out: Sequence[int]):
    return {lab for lab in a_labels if lab in b_labels and lab not in out}


def _scale_axes(
    plan: _Plan, labels: Sequence[int], contracted: set[int], gradient: bool
) -> tuple[int, ...] | None:
    """The axes one scale of an operand covers: the recipe's answer for the
    operand's role and its contracted axes in this product."""
    contracting = tuple(i for i, lab in enumerate(labels) if lab in contracted)
    return plan.recipe.scale_axes(contracting, gradient=gradient)


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


def _contract(
    a: tuple[jax.Array, jax.Array],
    a_labels: Sequence[int],
    b: tuple[jax.Array, jax.Array],
    b_labels: Sequence[int],
    out_labels: Sequence[int],
    plan: _Plan,
    out_sharding: Any = None,
) -> jax.Array:
    """The float32 product of two quantized operands ``(q, scale)``, scales
    applied."""
    (qa, sa), (qb, sb) = a, b
    sharding = out_sharding if dots.explicitly_sharded(out_sharding) else None

    def cpu(qa: jax.Array, qb: jax.Array) -> jax.Array:
        a16, b16 = qa.astype(_BF16), qb.astype(_BF16)
        if not plan.explicit:
            return dots._contract(
                a16, a_labels, b16, b_labels, out_labels, plan.precision, _F32, True
            )
        return dots.labeled_dot(
            a16, a_labels, b16, b_labels, out_labels, plan.precision, _F32, sharding
        )

    def float8_gemm(qa: jax.Array, qb: jax.Array) -> jax.Array:
        return dots.labeled_dot(
            qa, a_labels, qb, b_labels, out_labels, plan.precision, _F32, sharding
        )

    p = per_platform((qa, qb), platform=plan.platform, cpu=cpu, default=float8_gemm)
    contracted = _contracted(a_labels, b_labels, out_labels)
    # One scale at a time: their product can leave float32's range (tiny
    # tensors) where the scaled result does not.
    p = p * _scale_into(sa, a_labels, contracted, out_labels, p.shape)
    return p * _scale_into(sb, b_labels, contracted, out_labels, p.shape)


def _quantized(
    x: jax.Array,
    labels: Sequence[int],
    other: Sequence[int],
    out_labels: Sequence[int],
    plan: _Plan,
    *,
    gradient: bool,
    fmt: Any = None,
) -> tuple[jax.Array, jax.Array]:
    """``x`` scaled into its format (``fmt``, or the recipe's for its role) with
    the recipe's scales for its role, in a product with ``other``."""
    axes = _scale_axes(plan, labels, _contracted(labels, other, out_labels), gradient)
    if fmt is None:
        fmt = plan.recipe.format(gradient=gradient)
    return f8.quantize(x, fmt, axes)


# ------------------------------------------------------------------ dot_general

_DimNums = Any


def _dot_forward(
    lhs: jax.Array, rhs: jax.Array, dn: _DimNums, plan: _Plan, out_sharding: Any = None
) -> tuple[jax.Array, tuple[Any, Any]]:
    """The float32 product, and the quantized operands."""
    a_l, b_l, o_l = dots._dot_labels(lhs.ndim, rhs.ndim, dn)
    ga, gb = plan.gradients
    qa = _quantized(lhs, a_l, b_l, o_l, plan, gradient=ga, fmt=plan.formats[0])
    qb = _quantized(rhs, b_l, a_l, o_l, plan, gradient=gb, fmt=plan.formats[1])
    return _contract(qa, a_l, qb, b_l, o_l, plan, out_sharding), (qa, qb)


def _reused(
    plan: _Plan, dn: _DimNums, lhs_ndim: int, rhs_ndim: int
) -> tuple[bool, bool]:
    """Per operand, whether the backward products read its forward float8
    value as it is: where the recipe gives it the same format and one scale
    per tensor in both passes (a tensor scale does not depend on the
    contraction). Otherwise it is kept in the low dtype and quantized again
    for the backward products (rowwise: along their contraction, as torchao
    does)."""
    a_l, b_l, o_l = dots._dot_labels(lhs_ndim, rhs_ndim, dn)
    residual = plan.recipe.format()

    def same(labels, fwd_other, bwd_other, fmt, gradient):
        return (
            fmt == residual
            and _scale_axes(plan, labels, _contracted(labels, fwd_other, o_l), gradient)
            is None
            and _scale_axes(plan, labels, _contracted(labels, o_l, bwd_other), False)
            is None
        )

    ga, gb = plan.gradients
    fa, fb = plan.formats
    return same(a_l, b_l, b_l, fa, ga), same(b_l, a_l, a_l, fb, gb)


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
    reuse_a, reuse_b = _reused(plan, dn, lhs.ndim, rhs.ndim)
    return out, (
        qa if reuse_a else lhs.astype(plan.low),
        qb if reuse_b else rhs.astype(plan.low),
    )


def _dot_vjp_bwd(dn, plan, lhs_dtype, rhs_dtype, res, g):
    # A residual is a (q, scale) pair where the forward value is reused, an
    # array in the low dtype where it is quantized again (static structure).
    a, b = res
    lhs_nd = a[0].ndim if isinstance(a, tuple) else a.ndim
    rhs_nd = b[0].ndim if isinstance(b, tuple) else b.ndim
    a_l, b_l, o_l = dots._dot_labels(lhs_nd, rhs_nd, dn)
    # The cotangent in the recipe's gradient format, with its gradient scales
    # along each backward contraction (one quantization where they agree).
    axes_lhs = _scale_axes(plan, o_l, _contracted(o_l, b_l, a_l), True)
    axes_rhs = _scale_axes(plan, o_l, _contracted(o_l, a_l, b_l), True)
    g_fmt = plan.recipe.format(gradient=True)
    g_lhs = f8.quantize(g, g_fmt, axes_lhs)
    g_rhs = g_lhs if axes_rhs == axes_lhs else f8.quantize(g, g_fmt, axes_rhs)
    qa = (
        a
        if isinstance(a, tuple)
        else _quantized(a, a_l, o_l, b_l, plan, gradient=False)
    )
    qb = (
        b
        if isinstance(b, tuple)
        else _quantized(b, b_l, o_l, a_l, plan, gradient=False)
    )
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


def _product(
    lhs: jax.Array,
    rhs: jax.Array,
    dn: _DimNums,
    plan: _Plan,
    custom_vjp: bool,
    out_sharding: Any,
) -> jax.Array:
    """The float32 product, differentiable as ``custom_vjp`` asks."""
    if custom_vjp and not plan.explicit:
        return _dot_vjp(lhs, rhs, dn, plan, lhs.dtype, rhs.dtype)
    return _dot_ste(lhs, rhs, dn, plan, out_sharding)


def dot_general(
    lhs: ArrayLike,
    rhs: ArrayLike,
    *,
    dimension_numbers: Any,
    precision: Any = None,
    recipe: f8.Float8Recipe,
    formats: Sequence[DTypeLike] | None = None,
    gradients: Sequence[bool] = (False, False),
    low_dtype: DTypeLike,
    out_dtype: DTypeLike,
    custom_vjp: bool = True,
    out_sharding: Any = None,
    platform: str | None = None,
    wide: bool = False,
) -> jax.Array:
    """A ``lax.dot_general`` of float8-scaled operands, in ``out_dtype``.

    Args:
        lhs: left operand (any floating dtype).
        rhs: right operand (any floating dtype).
        dimension_numbers: as for ``jax.lax.dot_general``.
        precision: as for ``jax.lax.dot_general``.
        recipe: the :class:`~mixprec.Float8Recipe`: each operand's format and
            what its scales cover, per role (gradient or not), in this
            product and in the backward products.
        formats: the float8 format of each operand; ``None`` (default): the
            recipe's for its role.
        gradients: per operand, whether it is a gradient (it takes the
            recipe's gradient format and scales).
        low_dtype: the 16-bit dtype of re-quantized residuals and tangents.
        out_dtype: the dtype of the result.
        custom_vjp: a ``jax.custom_vjp`` whose cotangent takes the recipe's
            gradient format (for reverse-mode AD) rather than a
            straight-through ``jax.custom_jvp``.
        out_sharding: passed to the dot when it constrains the result's
            sharding (the product is then not written in the CPU canonical
            layout).
        platform: pin one platform's formulation; ``None`` (default): each
            platform's, chosen when the computation is lowered.
        wide: return the float32 product (scales applied) instead of
            rounding it to ``out_dtype`` (for a bias add that follows).

    Returns:
        The product, with dtype ``out_dtype`` (float32 with ``wide``).

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
    explicit = dots.explicitly_sharded(out_sharding, lhs, rhs)
    plan = _plan(
        recipe, formats, gradients, low_dtype, platform, precision, explicit=explicit
    )
    res: jax.Array = _product(lhs, rhs, dn, plan, custom_vjp, out_sharding)
    return res if wide else res.astype(out_dtype)


# ------------------------------------------------------------------ convolutions


def _conv(a: jax.Array, b: jax.Array, params: tuple, preferred: Any) -> jax.Array:
    kw = dict(params)
    kw["preferred_element_type"] = preferred
    kw.setdefault("out_sharding", None)
    return lax.conv_general_dilated_p.bind(a, b, **kw)


def _conv_quantize(
    x: jax.Array, fmt: Any, plan: _Plan, gradient: bool
) -> tuple[jax.Array, jax.Array]:
    """A convolution's operand scaled into ``fmt``: its operands have no
    contracted axes of their own, so the recipe's scales cover the tensor."""
    return f8.quantize(x, fmt, plan.recipe.scale_axes((), gradient=gradient))


def _cpu_conv_forward(lhs, rhs, params, plan):
    """float8 on CPU: the float8 values as bfloat16, float32 accumulation, the
    scales applied one at a time."""
    ga, gb = plan.gradients
    (qa, sa), (qb, sb) = (
        _conv_quantize(lhs, plan.formats[0], plan, ga),
        _conv_quantize(rhs, plan.formats[1], plan, gb),
    )
    out = _conv(qa.astype(_BF16), qb.astype(_BF16), params, _F32)
    return out * sa.reshape(()) * sb.reshape(())


def _low_conv_forward(lhs, rhs, params, plan):
    """Elsewhere: the convolution in the low dtype, widened to float32."""
    return _conv(lhs.astype(plan.low), rhs.astype(plan.low), params, None).astype(_F32)


def _conv_forward(lhs, rhs, params, plan):
    return per_platform(
        (lhs, rhs),
        platform=plan.platform,
        cpu=ft.partial(_cpu_conv_forward, params=params, plan=plan),
        default=ft.partial(_low_conv_forward, params=params, plan=plan),
    )


@ft.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _conv_vjp(lhs, rhs, params, plan, lhs_dtype, rhs_dtype):
    del lhs_dtype, rhs_dtype
    return _conv_forward(lhs, rhs, params, plan)


def _conv_vjp_fwd(lhs, rhs, params, plan, lhs_dtype, rhs_dtype):
    del lhs_dtype, rhs_dtype
    out = _conv_forward(lhs, rhs, params, plan)
    return out, (lhs.astype(plan.low), rhs.astype(plan.low))


def _cpu_conv_backward(params, plan, g, a, b):
    # The operands quantized again (the same float8 values as the forward
    # pass), the cotangent to the recipe's gradient format; JAX's transposes
    # of the convolution.
    ga, gb = plan.gradients
    (qa, sa), (qb, sb) = (
        _conv_quantize(a, plan.formats[0], plan, ga),
        _conv_quantize(b, plan.formats[1], plan, gb),
    )
    qg, sg = _conv_quantize(g, plan.recipe.format(gradient=True), plan, True)
    x, y = qa.astype(_BF16), qb.astype(_BF16)
    out, vjp = jax.vjp(lambda x, y: _conv(x, y, params, _F32), x, y)
    d_lhs, d_rhs = vjp(qg.astype(out.dtype))
    d_lhs = d_lhs.astype(_F32) * sg.reshape(()) * sb.reshape(())
    d_rhs = d_rhs.astype(_F32) * sg.reshape(()) * sa.reshape(())
    return d_lhs, d_rhs


def _low_conv_backward(params, plan, g, a, b):
    out, vjp = jax.vjp(lambda x, y: _conv(x, y, params, None), a, b)
    d_lhs, d_rhs = vjp(g.astype(out.dtype))
    return d_lhs.astype(_F32), d_rhs.astype(_F32)


def _conv_vjp_bwd(params, plan, lhs_dtype, rhs_dtype, res, g):
    a, b = res
    d_lhs, d_rhs = per_platform(
        (g, a, b),
        platform=plan.platform,
        cpu=ft.partial(_cpu_conv_backward, params, plan),
        default=ft.partial(_low_conv_backward, params, plan),
    )
    return d_lhs.astype(lhs_dtype), d_rhs.astype(rhs_dtype)


_conv_vjp.defvjp(_conv_vjp_fwd, _conv_vjp_bwd)


@ft.partial(jax.custom_jvp, nondiff_argnums=(2, 3))
def _conv_ste(lhs, rhs, params, plan):
    return _conv_forward(lhs, rhs, params, plan)


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
    formats: Sequence[DTypeLike] | None = None,
    gradients: Sequence[bool] = (False, False),
    low_dtype: DTypeLike,
    out_dtype: DTypeLike,
    custom_vjp: bool = True,
    platform: str | None = None,
    **conv_params: Any,
) -> jax.Array:
    """A ``lax.conv_general_dilated`` of float8-scaled operands (tensorwise).

    ``conv_params`` are the parameters of ``jax.lax.conv_general_dilated_p`` as
    in a jaxpr equation; ``preferred_element_type`` is replaced (float32
    accumulation). The other arguments are those of :func:`dot_general`. The
    convolution runs in float8 on CPU and in ``low_dtype`` on other platforms
    (see the module docstring).

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
        recipe, formats, gradients, low_dtype, platform, conv_params.get("precision")
    )
    params = tuple(sorted(conv_params.items()))
    res: jax.Array
    if custom_vjp:
        res = _conv_vjp(lhs, rhs, params, plan, lhs.dtype, rhs.dtype)  # type: ignore[assignment]
    else:
        res = _conv_ste(lhs, rhs, params, plan)  # type: ignore[assignment]
    return res.astype(out_dtype)


# ------------------------------------------------------------------ the op table's view


def dot_general_product(
    request: ProductRequest, lhs: Any, rhs: Any, **params: Any
) -> jax.Array:
    """A ``dot_general`` equation (``params``) run in float8 as ``request``
    says (its recipe, each operand's format and role): its float32 product
    (:func:`dot_general` with ``wide=True``).

    Examples:
        >>> import jax.numpy as jnp
        >>> from mixprec._src.float8 import E4M3, Float8Recipe
        >>> req = ProductRequest(low_dtype=np.dtype(jnp.bfloat16),
        ...     out_dtype=np.dtype(jnp.bfloat16), recipe=Float8Recipe("rowwise"),
        ...     formats=(E4M3, E4M3))
        >>> dot_general_product(req, jnp.ones((16, 32)), jnp.ones((32, 16)),
        ...                     dimension_numbers=(((1,), (0,)), ((), ()))).dtype
        dtype('float32')
    """
    return dot_general(
        lhs,
        rhs,
        dimension_numbers=params["dimension_numbers"],
        precision=params.get("precision"),
        **_float8_args(request),
        out_sharding=params.get("out_sharding"),
        wide=True,
    )


def conv_product(
    request: ProductRequest, lhs: Any, rhs: Any, **params: Any
) -> jax.Array:
    """A ``conv_general_dilated`` equation (``params``) run in float8 as
    ``request`` says (on CPU; see the module docstring), in float32."""
    return conv_general_dilated(lhs, rhs, **_float8_args(request), **params)


def _float8_args(request: ProductRequest) -> dict[str, Any]:
    """What :func:`dot_general` and :func:`conv_general_dilated` read of a
    request (the result in float32: the product rule rounds it)."""
    if request.recipe is None:
        raise ValueError(
            "`float8_dots.dot_general_product(request, ...)` needs a request with "
            f"a float8 recipe, got {request!r}."
        )
    return dict(
        recipe=request.recipe,
        formats=request.formats,
        gradients=request.gradients,
        low_dtype=request.low_dtype,
        out_dtype=np.float32,
        custom_vjp=request.custom_vjp,
        platform=request.platform,
    )


# ----------------------------------------------------------------------- reports


def dot_float8_note(low_dtype: DTypeLike, *, platform: str | None = None) -> str:
    """One sentence for reports on how a float8 matmul runs on ``platform``
    (``None``: on each platform, chosen at lowering).

    Examples:
      >>> import jax.numpy as jnp
      >>> print(dot_float8_note(jnp.bfloat16, platform="cuda"))
      Float8 dots: on cuda the float8 operands go straight into the GEMM ...
    """
    del low_dtype  # float8 dots accumulate in float32 on every platform
    accel = (
        "the float8 operands go straight into the GEMM (dot_general of float8 "
        "arrays, float32 accumulation; cuBLASLt's float8 GEMM on Hopper, Ada and "
        "newer GPUs), the scales applied to its product."
    )
    cpu = (
        "XLA:CPU has no float8 GEMM: the float8 values are widened to bfloat16 "
        "(exactly) and multiplied with float32 accumulation, the numbers of a "
        "float8 GEMM at bfloat16's speed."
    )
    plat = canonical_platform(platform)
    if plat is None:
        return f"Float8 dots, per platform: on CPU, {cpu} Elsewhere, {accel}"
    return "Float8 dots: " + (cpu if plat == "cpu" else f"on {plat} {accel}")


def conv_float8_note(low_dtype: DTypeLike, *, platform: str | None = None) -> str:
    """One sentence for reports on how a convolution decided float8 runs on
    ``platform`` (``None``: on each platform, chosen at lowering).

    Examples:
      >>> import jax.numpy as jnp
      >>> print(conv_float8_note(jnp.bfloat16, platform="cuda"))
      Float8 convolutions: not on cuda: ... they run in bfloat16 instead ...
    """
    name = np.dtype(low_dtype).name
    elsewhere = (
        "XLA's GPU compiler has no float8 convolution that mixprec relies on, so "
        f"they run in {name} instead (operands rounded to {name}, no float8 "
        "scaling)."
    )
    cpu = (
        "emulated on CPU (tensorwise-scaled float8 values widened to bfloat16, "
        "float32 accumulation)."
    )
    plat = canonical_platform(platform)
    if plat is None:
        return f"Float8 convolutions, per platform: {cpu} Elsewhere {elsewhere}"
    if plat == "cpu":
        return "Float8 convolutions: " + cpu
    return f"Float8 convolutions: not on {plat}: {elsewhere}"
