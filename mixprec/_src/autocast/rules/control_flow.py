"""Rules for ``scan``, ``while`` and ``cond``.

Each rule interprets the bodies and rebinds the same primitive with the new
jaxprs and consistently updated params (constants the interpretation creates
become leading operands, as ``lax.scan`` passes them), so whatever JAX put in
the equation (a batched ``while`` predicate under ``vmap``, unrolling) is kept.

The types at the boundary are decided in :mod:`~mixprec._src.autocast.decide`:
``scan``/``while`` carries keep one dtype across iterations
(:func:`~mixprec._src.autocast.decide.carry_dtypes`: a float32 RNN state stays
float32), and ``cond`` results take the widest dtype any branch gives
(:func:`~mixprec._src.autocast.decide.branch_dtypes`). The marks a body starts
with (:func:`scan_body_marks`, :func:`while_body_marks`) are shared with
``diagnose``, which steps the same loops on concrete values.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import ClosedJaxpr, jaxpr_as_fun, mapped_aval, primitives as P

from mixprec._src import _compat
from mixprec._src.autocast import interpreter as itp, ops
from mixprec._src.autocast.avals import float_dtype
from mixprec._src.autocast.decide import (
    CONST,
    GRAD,
    STAT,
    branch_dtypes,
    carry_dtypes,
)
from mixprec._src.autocast.interpreter import CastContext, Walk
from mixprec._src.autocast.rules.default import aval_of, cast_all, hoist_consts


__all__ = [
    "branch_out_dtypes",
    "scan_body_marks",
    "split",
    "strong",
    "while_body_marks",
]


def strong(x: Any) -> Any:
    """``x`` without a weak type (a carry's type must not change)."""
    if float_dtype(x) is None:
        return x
    if isinstance(x, np.ndarray | np.generic | float):
        return jnp.asarray(x, float_dtype(x))
    if _compat.get_aval(x).weak_type:
        return lax.convert_element_type(x, x.dtype)
    return x


def _trace(fun: Any, avals: Sequence[Any], name: str) -> tuple[ClosedJaxpr, list[Any]]:
    return hoist_consts(_compat.trace_to_closed_jaxpr(fun, list(avals), name=name))


def split(vals: Sequence[Any], *sizes: int) -> list[list[Any]]:
    """``vals`` cut into consecutive groups of ``sizes`` and the rest."""
    out, i = [], 0
    for n in sizes:
        out.append(list(vals[i : i + n]))
        i += n
    out.append(list(vals[i:]))
    return out


# ------------------------------------------------------------------ scan


def scan_body_marks(marks: Sequence[int], num_consts: int, num_carry: int) -> list[int]:
    """The marks a scan body starts with: constants keep theirs; a carry or a
    slice that enters as a gradient stays one (float8's e5m2); a slice of a
    constant is a constant, and a slice of a statistic a statistic (a mean or a
    variance passed as ``xs`` anchors the body's norm in float32, as it does
    outside the loop). A carry keeps no role but a gradient's: the body may
    make it anything.

    Examples:
        >>> from mixprec._src.autocast.decide import STAT
        >>> scan_body_marks([0, 0, STAT], num_consts=0, num_carry=1) == [0, 0, STAT]
        True
    """
    nc, ncar = num_consts, num_carry
    return [
        *marks[:nc],
        *(m & GRAD for m in marks[nc : nc + ncar]),
        *(m & (CONST | GRAD | STAT) for m in marks[nc + ncar :]),
    ]


def _scan_rule(ctx: CastContext, *invals: Any, jaxpr: ClosedJaxpr, **params: Any):
    walk = ctx.walk
    nc, ncar = _compat.scan_layout(params)
    length = params["length"]
    consts, init, xs = split(invals, nc, ncar)
    dts = carry_dtypes(init, jaxpr.in_avals[nc : nc + ncar])
    init = [strong(x) for x in cast_all(init, dts)]
    marks = scan_body_marks(ctx.marks, nc, ncar)
    sub = walk.body("scan/body", trip=length)

    def body(*args: Any) -> list[Any]:
        outs, _ = itp.eval_jaxpr(sub, jaxpr, (), args, marks)
        carry = [strong(x) for x in cast_all(outs[:ncar], dts)]
        return [*carry, *outs[ncar:]]

    avals = [
        *(aval_of(c) for c in consts),
        *(aval_of(c) for c in init),
        *(mapped_aval(length, 0, aval_of(x)) for x in xs),
    ]
    new, hoisted = _trace(body, avals, "scan_body")
    return P.scan_p.bind(
        *hoisted,
        *consts,
        *init,
        *xs,
        jaxpr=new,
        **_compat.scan_params(params, extra_consts=len(hoisted)),
    )


# ------------------------------------------------------------------ while


def while_body_marks(
    marks: Sequence[int], cond_nconsts: int, body_nconsts: int
) -> tuple[list[int], list[int]]:
    """The marks the ``cond`` and ``body`` of a while loop start with."""
    cn, bn = cond_nconsts, body_nconsts
    carried = [m & GRAD for m in marks[cn + bn :]]
    return [*marks[:cn], *carried], [*marks[cn : cn + bn], *carried]


def _while_rule(
    ctx: CastContext,
    *invals: Any,
    cond_jaxpr: ClosedJaxpr,
    body_jaxpr: ClosedJaxpr,
    cond_nconsts: int,
    body_nconsts: int,
    **params: Any,
):
    walk = ctx.walk
    cn, bn = cond_nconsts, body_nconsts
    cconsts, bconsts, init = split(invals, cn, bn)
    dts = carry_dtypes(init, body_jaxpr.in_avals[bn:])
    init = [strong(x) for x in cast_all(init, dts)]
    cmarks, bmarks = while_body_marks(ctx.marks, cn, bn)
    csub = walk.body("while/cond")
    bsub = walk.body("while/body")
    carry_avals = [aval_of(x) for x in init]

    def cond_fun(*args: Any) -> list[Any]:
        return itp.eval_jaxpr(csub, cond_jaxpr, (), args, cmarks)[0]

    def body_fun(*args: Any) -> list[Any]:
        outs, _ = itp.eval_jaxpr(bsub, body_jaxpr, (), args, bmarks)
        return [strong(x) for x in cast_all(outs, dts)]

    new_cond, ch = _trace(
        cond_fun, [*(aval_of(c) for c in cconsts), *carry_avals], "while_cond"
    )
    new_body, bh = _trace(
        body_fun, [*(aval_of(c) for c in bconsts), *carry_avals], "while_body"
    )
    return P.while_p.bind(
        *ch,
        *cconsts,
        *bh,
        *bconsts,
        *init,
        cond_jaxpr=new_cond,
        body_jaxpr=new_body,
        cond_nconsts=len(ch) + cn,
        body_nconsts=len(bh) + bn,
        **params,
    )


# ------------------------------------------------------------------ cond


def branch_out_dtypes(
    walk: Walk, branches: Sequence[ClosedJaxpr], avals: Sequence[Any], marks: list[int]
) -> list[Any]:
    """The dtypes a ``cond``'s results take (traced, not run, under autocast)."""
    probe = walk.probe()
    per_branch = []
    for i, br in enumerate(branches):
        sub = probe.body(f"cond/branch{i}")
        closed = _compat.trace_to_closed_jaxpr(
            lambda *a, br=br, sub=sub: itp.eval_jaxpr(sub, br, (), a, marks)[0],
            list(avals),
            name="probe",
        )
        per_branch.append([float_dtype(a) for a in closed.out_avals])
    return branch_dtypes(per_branch)


def _cond_rule(ctx: CastContext, index: Any, *operands: Any, branches: Any, **params):
    walk = ctx.walk
    marks = list(ctx.marks[1:])
    avals = [aval_of(x) for x in operands]
    target = branch_out_dtypes(walk, branches, avals, marks)
    if len(branches) == 1:
        sub = walk.body("cond/branch0")
        outs, _ = itp.eval_jaxpr(sub, branches[0], (), operands, marks)
        return cast_all(outs, target)
    traced = []
    for i, br in enumerate(branches):
        sub = walk.body(f"cond/branch{i}")

        def fun(*a: Any, br: Any = br, sub: Walk = sub) -> list[Any]:
            outs, _ = itp.eval_jaxpr(sub, br, (), a, marks)
            return [strong(x) for x in cast_all(outs, target)]

        traced.append(_trace(fun, avals, f"branch{i}"))
    all_consts = [c for _, hoisted in traced for c in hoisted]
    const_avals = [_compat.get_aval(c) for c in all_consts]
    joined = []
    offset = 0
    for new, hoisted in traced:
        lo, hi, total = offset, offset + len(hoisted), len(all_consts)

        def call(*a: Any, new: Any = new, lo: int = lo, hi: int = hi, n: int = total):
            return jaxpr_as_fun(new)(*a[lo:hi], *a[n:])

        joined.append(
            _compat.trace_to_closed_jaxpr(call, [*const_avals, *avals], name="branch")
        )
        offset = hi
    return P.cond_p.bind(
        index, *all_consts, *operands, branches=tuple(joined), **params
    )


ops.set_rule("scan", _scan_rule)
ops.set_rule("while", _while_rule)
ops.set_rule("cond", _cond_rule)
