"""The rule of matmul-like ops: every op whose table entry has a ``Product``.

The rule decides nothing: the equation's decision carries its
:class:`~mixprec._src.autocast.request.ProductRequest` (low, out and reduce
dtypes, float8 recipe and formats, platform, CPU formulation, live operands),
made with the decision (:func:`~mixprec._src.autocast.decide.product_request`
inside :func:`~mixprec._src.autocast.decide.decide_eqn`), and the entry's
formulation receives it as its one argument,
``formulation(request, lhs, rhs, *extra, **params)``, as a rule receives its
context. A product decided low runs its entry's 16-bit formulation
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
from mixprec._src.autocast.operands import CastContext
from mixprec._src.autocast.request import ProductRequest


__all__: list[str] = []

_F32 = np.dtype(np.float32)


def _shared(ctx: CastContext, x: Any, request: ProductRequest) -> Any:
    """An input of the function (a parameter) rounded to the low dtype once
    per walk.

    The forward product and the backward products that read one parameter
    share its rounding (:class:`~mixprec._src.autocast.dots.Rounded`: one
    ``convert``, and what a platform's formulation needs of it made once,
    outside the platform branches), so that under a sharded parameter (FSDP)
    the partitioner gathers it once, in the low dtype, and the backward pass
    reuses the gathered copy (as hand-written 16-bit code does). Which
    operands are shared is the request's (``decide.py``'s) answer.
    """
    low = request.low_dtype
    key = (id(x), low)
    hit = ctx.walk.casts.get(key)
    if hit is None or hit[0] is not x:
        hit = (
            x,
            dots.rounded(x, low, platform=request.platform, cpu_bf16=request.cpu_bf16),
        )
        ctx.walk.casts[key] = hit
    return hit[1]


def _note_formulation(
    ctx: CastContext, product: ops.Product, request: ProductRequest
) -> None:
    """Tells an observer (``explain``) how each platform runs this product."""
    if ctx.walk.observer is None:
        return
    if request.is_float8:
        if product.float8_note is None:
            return
        note = product.float8_note(request.low_dtype, platform=request.platform)
    elif product.note is None:
        return
    else:
        note = product.note(
            request.low_dtype, platform=request.platform, cpu_bf16=request.cpu_bf16
        )
    ctx.walk.observer.on_note(ctx.walk, ctx.eqn, note)


def _product_rule(
    ctx: CastContext, lhs: Any, rhs: Any, *extra: Any, **params: Any
) -> Any:
    spec = ops.spec_for(ctx.eqn.primitive.name)
    assert spec is not None and spec.product is not None
    product = spec.product
    request = ctx.decision.request
    if request is None:
        return itp.default_rule(ctx.eqn.primitive, ctx, lhs, rhs, *extra, **params)
    if request.is_float8:
        assert product.float8 is not None
        wide = product.float8(request, lhs, rhs, *extra, **params)
    else:
        lhs, rhs = (
            _shared(ctx, x, request) if shared else x
            for x, shared in zip((lhs, rhs), request.shared, strict=True)
        )
        wide = product.low(request, lhs, rhs, *extra, **params)
    _note_formulation(ctx, product, request)
    return _rounded(ctx, product, wide, request.out_dtype)


def _rounded(ctx: CastContext, product: ops.Product, wide: Any, out: np.dtype) -> Any:
    """The float32 product rounded to ``out``; kept for a bias add that
    follows where the product allows one."""
    if np.dtype(out) == _F32:
        return wide
    if product.epilogue:
        ctx.walk.wide[ctx.eqn.outvars[0]] = wide
    return lax.convert_element_type(wide, out)


ops.set_product_rule(_product_rule)
