"""The rule of matmul-like ops: every op whose table entry has a ``Product``.

A product decided low runs its entry's 16-bit formulation
(:mod:`mixprec._src.autocast.dots`, written per platform); one decided float8
runs its float8 formulation (:mod:`mixprec._src.autocast.float8_dots`); one
decided float32 (``precision=HIGHEST``, a float32 policy) or as written runs
through the default rule. Both formulations return the product in float32 (on
CPU the float32 accumulator, elsewhere the 16-bit result widened); it is kept,
where the entry says so, for a bias add right after the product (the epilogue
of :func:`~mixprec._src.autocast.decide.decide_epilogue`: one rounding, and
on CPU one XLA kernel fewer per layer).

A constant operand is cast like any other op's: one the low dtype cannot hold
was decided float32 (:func:`~mixprec._src.autocast.decide.misfit`), any other
is cast as it is, so the product adds no clamp to the program.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from jax import lax

from mixprec._src.autocast import dots, interpreter as itp, ops
from mixprec._src.autocast.avals import float_dtype
from mixprec._src.autocast.decide import CONST, GRAD, INPUT, Precision
from mixprec._src.autocast.interpreter import CastContext


__all__: list[str] = []

_F32 = np.dtype(np.float32)


def _low_dtype(ctx: CastContext, lhs: Any, rhs: Any) -> np.dtype | None:
    """The 16-bit (or narrower) dtype the product runs in, or ``None`` to run
    it through the default rule."""
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


def _reduce_dtype(
    ctx: CastContext, vals: tuple[Any, ...], out: np.dtype
) -> tuple[np.dtype | None, bool]:
    """The policy's gradient reduction dtype for this product, and whether the
    product computes a gradient (then its GEMM writes its result in it).

    Under a partitioner the all-reduce (or reduce-scatter) of a gradient
    lands on the GEMM that computes it, in the dtype that GEMM writes:

    * a product of the backward pass whose result is a float32 gradient (a
      train step under autocast: the weight gradient ``x^T g``);
    * the backward products of a product that reads a float32 input of the
      function (a parameter), when the loss under autocast is differentiated
      outside: they write the parameter's gradient in it.
    """
    reduce = ctx.config.policy.reduce_dtype
    marks = ctx.marks[: len(vals)]
    backward = ctx.walk.backward or any(m & GRAD for m in marks)
    if backward and np.dtype(out) == _F32:
        return reduce, True
    for x, m in zip(vals, marks, strict=True):
        if m & INPUT and not m & CONST and float_dtype(x) == _F32:
            return reduce, False
    return None, False


def _rounded_input(ctx: CastContext, x: Any, mark: int, low: np.dtype) -> Any:
    """An input of the function (a parameter) rounded to ``low`` once per walk.

    The forward product and the backward products that read one parameter
    share its rounding (:class:`~mixprec._src.autocast.dots.Rounded`: one
    ``convert``, and what a platform's formulation needs of it made once,
    outside the platform branches), so that under a sharded parameter (FSDP)
    the partitioner gathers it once, in ``low``, and the backward pass reuses
    the gathered copy (as hand-written 16-bit code does). A policy whose
    gather dtype is wider than ``low`` leaves the rounding to each product
    (after the gather).
    """
    dt = float_dtype(x)
    if not mark & INPUT or mark & CONST or dt is None or dt.itemsize < low.itemsize:
        return x
    if ctx.config.policy.gather_dtype is not None or ctx.config.custom_vjp_dots:
        # The custom_vjp formulation takes the float32 weight, to return its
        # gradient from the GEMM in float32; it shares its rounding between
        # its own forward and backward products.
        return x
    key = (id(x), low)
    hit = ctx.walk.casts.get(key)
    if hit is None or hit[0] is not x:
        hit = (
            x,
            dots.rounded(x, low, platform=ctx.platform, cpu_bf16=ctx.config.cpu_bf16),
        )
        ctx.walk.casts[key] = hit
    return hit[1]


def _note_formulation(
    ctx: CastContext, product: ops.Product, low: np.dtype, *, float8: bool = False
) -> None:
    """Tells an observer (``explain``) how each platform runs this product."""
    if ctx.walk.observer is None:
        return
    if float8:
        if product.float8_note is None:
            return
        note = product.float8_note(low, platform=ctx.platform)
    elif product.note is None:
        return
    else:
        note = product.note(low, platform=ctx.platform, cpu_bf16=ctx.config.cpu_bf16)
    ctx.walk.observer.on_note(ctx.walk, ctx.eqn, note)


def _product_rule(
    ctx: CastContext, lhs: Any, rhs: Any, *extra: Any, **params: Any
) -> Any:
    spec = ops.spec_for(ctx.eqn.primitive.name)
    assert spec is not None and spec.product is not None
    product = spec.product
    d = ctx.decision
    if d.precision is Precision.FLOAT8:
        assert product.float8 is not None and d.float8 is not None
        assert d.operand_dtypes is not None
        out_dtype = d.out_dtype or ctx.low_dtype
        wide = product.float8(
            lhs,
            rhs,
            params,
            extra=extra,
            recipe=d.float8,
            formats=d.operand_dtypes,
            low_dtype=ctx.low_dtype,
            custom_vjp=ctx.config.custom_vjp_dots,
            platform=ctx.platform,
        )
        _note_formulation(ctx, product, np.dtype(ctx.low_dtype), float8=True)
        return _rounded(ctx, product, wide, out_dtype)
    low = _low_dtype(ctx, lhs, rhs)
    if low is None:
        return itp.default_rule(ctx.eqn.primitive, ctx, lhs, rhs, *extra, **params)
    reduce, gradient = _reduce_dtype(ctx, (lhs, rhs), d.out_dtype or low)
    lhs, rhs = (
        _rounded_input(ctx, x, m, low)
        for x, m in zip((lhs, rhs), ctx.marks[:2], strict=True)
    )
    out_dtype = d.out_dtype or low
    wide = product.low(
        lhs,
        rhs,
        params,
        extra=extra,
        low_dtype=low,
        out_dtype=out_dtype,
        custom_vjp=ctx.config.custom_vjp_dots,
        platform=ctx.platform,
        cpu_bf16=ctx.config.cpu_bf16,
        alive=(bool(ctx.marks[0] & INPUT), bool(ctx.marks[1] & INPUT)),
        reduce_dtype=reduce,
        gradient=gradient,
    )
    _note_formulation(ctx, product, low)
    return _rounded(ctx, product, wide, out_dtype)


def _rounded(ctx: CastContext, product: ops.Product, wide: Any, out: np.dtype) -> Any:
    """The float32 product rounded to ``out``; kept for a bias add that
    follows where the product allows one."""
    if np.dtype(out) == _F32:
        return wide
    if product.epilogue:
        ctx.walk.wide[ctx.eqn.outvars[0]] = wide
    return lax.convert_element_type(wide, out)


ops.set_product_rule(_product_rule)
