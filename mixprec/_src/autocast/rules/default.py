"""Shared machinery of the higher-order rules, and the default one.

:func:`transform_jaxpr` interprets a body with a walk and traces the result to a
new jaxpr; the higher-order rules rebind their primitive around it.
:func:`default_higher_order_rule` runs every higher-order primitive without a
rule of its own (``custom_linear_solve``, ``linear_call``, ``reduce``, ...): it
keeps the equation's types at its boundary (operands cast back to the dtypes
they were traced with, results cast back to theirs) and transforms every jaxpr
parameter, so the body's matmuls still run in the low dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from jax.extend.core import ClosedJaxpr, Jaxpr

from mixprec._src import _compat
from mixprec._src.autocast import interpreter as itp, ops
from mixprec._src.autocast.avals import aval_dtype, float_dtype
from mixprec._src.autocast.operands import CastContext
from mixprec._src.autocast.walk import Walk


__all__ = [
    "bind_eqn",
    "cast_all",
    "default_higher_order_rule",
    "hoist_consts",
    "transform_jaxpr",
]


def aval_of(x: Any) -> Any:
    """The abstract value of a value."""
    return _compat.get_aval(x)


def cast_all(vals: Sequence[Any], dtypes: Sequence[Any]) -> list[Any]:
    """Casts each floating value to its dtype (``None``: left alone)."""
    return [
        x if d is None else itp.cast(x, d) for x, d in zip(vals, dtypes, strict=True)
    ]


def transform_jaxpr(
    walk: Walk,
    jaxpr: Jaxpr | ClosedJaxpr,
    in_avals: Sequence[Any],
    in_marks: Sequence[int] | None = None,
    *,
    out_dtypes: Sequence[Any] | None = None,
    name: str = "body",
    known: Sequence[Any] = (),
) -> tuple[ClosedJaxpr, list[int]]:
    """Interprets ``jaxpr`` with ``walk`` at ``in_avals`` and traces it.

    Floating results are cast to ``out_dtypes`` (``None`` entries: left as they
    come); ``known`` are the values of constant inputs known while walking
    (see :func:`~mixprec._src.autocast.interpreter.eval_jaxpr`). Returns the
    new closed jaxpr and the marks of its results.
    """
    box: dict[str, list[int]] = {}

    def fun(*args: Any) -> list[Any]:
        outs, marks = itp.eval_jaxpr(walk, jaxpr, (), args, in_marks, known)
        box["marks"] = marks
        if out_dtypes is not None:
            outs = cast_all(outs, out_dtypes)
        return outs

    new = _compat.trace_to_closed_jaxpr(fun, list(in_avals), name=name)
    return new, box["marks"]


def hoist_consts(closed: ClosedJaxpr) -> tuple[ClosedJaxpr, list[Any]]:
    """``closed`` with its constants turned into leading inputs (as
    ``lax.scan`` and ``lax.while_loop`` pass them)."""
    if not closed.consts:
        return closed, []
    jaxpr = _compat.convert_constvars_jaxpr(closed.jaxpr)
    return ClosedJaxpr(jaxpr, ()), list(closed.consts)


def out_avals_of(jaxpr: Jaxpr | ClosedJaxpr) -> list[Any]:
    if isinstance(jaxpr, ClosedJaxpr):
        return list(jaxpr.out_avals)
    return [v.aval for v in jaxpr.outvars]


def in_avals_of(jaxpr: Jaxpr | ClosedJaxpr) -> list[Any]:
    if isinstance(jaxpr, ClosedJaxpr):
        return list(jaxpr.in_avals)
    return [v.aval for v in jaxpr.invars]


def _map_jaxprs(value: Any, fn: Callable[[Any], Any]) -> Any:
    if isinstance(value, Jaxpr | ClosedJaxpr):
        return fn(value)
    if isinstance(value, tuple) and any(
        isinstance(v, Jaxpr | ClosedJaxpr | tuple) for v in value
    ):
        items = [_map_jaxprs(v, fn) for v in value]
        if hasattr(value, "_fields"):  # a NamedTuple (custom_linear_solve)
            return type(value)(*items)
        return tuple(items)
    return value


class _KeepAsWritten(Exception):
    """An open jaxpr parameter would need constants it cannot hold."""


def _type_preserving(walk: Walk, label: str) -> Callable[[Any], Any]:
    def fn(jaxpr: Any) -> Any:
        closed, _ = transform_jaxpr(
            walk.body(label),
            jaxpr,
            in_avals_of(jaxpr),
            out_dtypes=[float_dtype(a) for a in out_avals_of(jaxpr)],
            name=label,
        )
        if isinstance(jaxpr, ClosedJaxpr):
            return closed
        if closed.consts:
            raise _KeepAsWritten
        return closed.jaxpr

    return fn


def bind_eqn(eqn: Any, invals: Sequence[Any], params: dict[str, Any]) -> list[Any]:
    """Binds ``eqn``'s primitive again on ``invals`` with ``params``."""
    bind_params = eqn.primitive.get_bind_params(params)
    subfuns: Sequence[Any] = ()
    if isinstance(bind_params, tuple):  # older JAX: (subfuns, params)
        subfuns, bind_params = bind_params
    out = eqn.primitive.bind(*subfuns, *invals, **bind_params)
    return list(out) if eqn.primitive.multiple_results else [out]


def default_higher_order_rule(ctx: CastContext, *invals: Any, **params: Any) -> Any:
    """Runs a higher-order primitive that has no rule of its own.

    The equation keeps its traced types at its boundary; every jaxpr parameter
    is interpreted and traced again with those types, so ops inside are still
    decided one by one. If a parameter is an open jaxpr whose transformed body
    would need constants, the equation runs as written.
    """
    eqn = ctx.eqn
    args = [
        itp.cast(x, aval_dtype(v)) if float_dtype(x) is not None else x
        for x, v in zip(invals, eqn.invars, strict=True)
    ]
    fn = _type_preserving(ctx.walk, eqn.primitive.name)
    try:
        new_params = {k: _map_jaxprs(v, fn) for k, v in params.items()}
    except _KeepAsWritten:
        new_params = dict(params)
    outs = bind_eqn(eqn, args, new_params)
    return outs if eqn.primitive.multiple_results else outs[0]


ops.set_default_higher_order_rule(default_higher_order_rule)
