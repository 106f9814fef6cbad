"""Rules for matmuls and convolutions: the allow list's own ops.

A dot decided low runs through :mod:`mixprec._src.autocast.dots`, which
formulates it for the backend; a dot decided float32 (``precision=HIGHEST``, a
float32 policy) or as written runs through the default rule. On CPU the dot's
float32 product is kept, so that a bias add right after it can run on it
(the interpreter's epilogue: one rounding, one XLA kernel fewer per layer).
A dot or convolution decided float8 runs through
:mod:`mixprec._src.autocast.float8_dots` (scaled float8 operands, float32
accumulation), its float32 product kept on CPU the same way.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from jax import lax
from jax.extend.core import primitives as P

from mixprec._src.autocast import dots, float8_dots, interpreter as itp, ops
from mixprec._src.autocast.avals import float_dtype
from mixprec._src.autocast.decide import CONST, Precision
from mixprec._src.autocast.interpreter import CastContext


__all__: list[str] = []

_F32 = np.dtype(np.float32)


def _low_dtype(ctx: CastContext, lhs: Any, rhs: Any) -> np.dtype | None:
    """The 16-bit (or narrower) dtype the product runs in through ``dots``, or
    ``None`` to run it through the default rule."""
    d = ctx.decision
    if (
        d.precision is not Precision.LOW
        or d.dtype is None
        or float_dtype(lhs) is None
        or float_dtype(rhs) is None
        or d.dtype.itemsize > 2
    ):
        return None
    return d.dtype


def _saturated(ctx: CastContext, vals: tuple[Any, ...], low: np.dtype) -> list[Any]:
    """Constant operands saturate instead of overflowing when rounded."""
    out = []
    for x, m in zip(vals, ctx.marks, strict=True):
        dt = float_dtype(x)
        if m & CONST and dt is not None and dt.itemsize > low.itemsize:
            x = itp.clip_to_range(x, low)
        out.append(x)
    return out


def _note_formulation(ctx: CastContext, low: np.dtype) -> None:
    """Tells an observer (``explain``) how the backend runs this dot."""
    if ctx.walk.observer is not None:
        note = dots.formulation_note(
            low, platform=ctx.platform, cpu_bf16=ctx.config.cpu_bf16
        )
        ctx.walk.observer.on_note(ctx.walk, ctx.eqn, note)


def _float8_dot_general(ctx: CastContext, lhs: Any, rhs: Any, **params: Any) -> Any:
    d = ctx.decision
    assert d.float8 is not None and d.operand_dtypes is not None
    out_dtype = d.out_dtype or ctx.low_dtype
    keep_wide = ctx.platform == "cpu" and out_dtype != _F32
    res = float8_dots.dot_general(
        lhs,
        rhs,
        dimension_numbers=params["dimension_numbers"],
        precision=params.get("precision"),
        recipe=d.float8,
        formats=d.operand_dtypes,
        low_dtype=ctx.low_dtype,
        out_dtype=_F32 if keep_wide else out_dtype,
        custom_vjp=ctx.config.custom_vjp_dots,
        out_sharding=params.get("out_sharding"),
        platform=ctx.platform,
    )
    if not keep_wide:
        return res
    out = lax.convert_element_type(res, out_dtype)
    ctx.walk.wide[ctx.eqn.outvars[0]] = res
    return out


def _float8_conv(ctx: CastContext, lhs: Any, rhs: Any, **params: Any) -> Any:
    d = ctx.decision
    assert d.float8 is not None and d.operand_dtypes is not None
    return float8_dots.conv_general_dilated(
        lhs,
        rhs,
        recipe=d.float8,
        formats=d.operand_dtypes,
        low_dtype=ctx.low_dtype,
        out_dtype=d.out_dtype or ctx.low_dtype,
        custom_vjp=ctx.config.custom_vjp_dots,
        platform=ctx.platform,
        **params,
    )


def _dot_general_rule(ctx: CastContext, lhs: Any, rhs: Any, **params: Any) -> Any:
    if ctx.decision.precision is Precision.FLOAT8:
        return _float8_dot_general(ctx, lhs, rhs, **params)
    low = _low_dtype(ctx, lhs, rhs)
    if low is None:
        return itp.default_rule(P.dot_general_p, ctx, lhs, rhs, **params)
    lhs, rhs = _saturated(ctx, (lhs, rhs), low)
    out_dtype = ctx.decision.out_dtype or low
    keep_wide = ctx.platform == "cpu" and out_dtype != _F32
    res = dots.dot_general(
        lhs,
        rhs,
        dimension_numbers=params["dimension_numbers"],
        precision=params.get("precision"),
        preferred_element_type=params.get("preferred_element_type"),
        low_dtype=low,
        out_dtype=_F32 if keep_wide else out_dtype,
        forward_mode_ad=not ctx.config.custom_vjp_dots,
        out_sharding=params.get("out_sharding"),
        platform=ctx.platform,
        cpu_bf16=ctx.config.cpu_bf16,
    )
    _note_formulation(ctx, low)
    if not keep_wide:
        return res
    out = lax.convert_element_type(res, out_dtype)
    ctx.walk.wide[ctx.eqn.outvars[0]] = res
    return out


def _conv_general_dilated_rule(
    ctx: CastContext, lhs: Any, rhs: Any, **params: Any
) -> Any:
    if ctx.decision.precision is Precision.FLOAT8:
        return _float8_conv(ctx, lhs, rhs, **params)
    low = _low_dtype(ctx, lhs, rhs)
    if low is None:
        return itp.default_rule(P.conv_general_dilated_p, ctx, lhs, rhs, **params)
    lhs, rhs = _saturated(ctx, (lhs, rhs), low)
    if ctx.walk.observer is not None:
        note = dots.conv_note(low, platform=ctx.platform)
        ctx.walk.observer.on_note(ctx.walk, ctx.eqn, note)
    return dots.conv_general_dilated(
        lhs,
        rhs,
        low_dtype=low,
        out_dtype=ctx.decision.out_dtype or low,
        forward_mode_ad=not ctx.config.custom_vjp_dots,
        platform=ctx.platform,
        **params,
    )


ops.set_rule("dot_general", _dot_general_rule)
ops.set_rule("conv_general_dilated", _conv_general_dilated_rule)
