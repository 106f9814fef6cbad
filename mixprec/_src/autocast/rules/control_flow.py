"""Rules for ``scan``, ``while`` and ``cond``.

Each rule interprets the bodies and rebinds the same primitive with the new
jaxprs and consistently updated params (constants the interpretation creates
become leading operands, as ``lax.scan`` passes them), so whatever JAX put in
the equation (a batched ``while`` predicate under ``vmap``, unrolling) is kept.

Type invariants:

* ``scan``/``while`` carries keep one dtype across iterations: the wider of the
  dtype they arrive in and the dtype they were written in
  (:func:`carry_dtypes`); the body's outputs are cast back to it. A float32
  RNN state stays float32.
* ``cond`` branches agree: each output takes the widest dtype any branch gives.

In a dual walk (``diagnose``) the loops are stepped and the branch taken with
concrete values, through the same :func:`carry_dtypes` and branch unification;
where the two streams part (a loop that stops earlier, another branch), each
stream finishes on its own and the observer is told.
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
from mixprec._src.autocast.interpreter import CONST, GRAD, CastContext, Dual, Walk
from mixprec._src.autocast.rules.default import (
    aval_of,
    cast_all,
    float_dtype,
    hoist_consts,
)


__all__ = ["carry_dtypes", "unify_branch_dtypes"]


def _widest(a: np.dtype, b: np.dtype) -> np.dtype:
    """The wider of two floating dtypes (float16 vs bfloat16: float32)."""
    if a == b:
        return a
    if a.itemsize != b.itemsize:
        return a if a.itemsize > b.itemsize else b
    return np.dtype(np.float32) if a.itemsize < 4 else a


def carry_dtypes(received: Sequence[Any], traced: Sequence[Any]) -> list[Any]:
    """Per loop carry: the wider of the received and the traced floating dtype
    (``None`` for a carry that is not floating).

    Examples:
        >>> import jax.numpy as jnp
        >>> from jax.extend.core import ClosedJaxpr
        >>> carry_dtypes([jnp.ones(2, jnp.bfloat16)], [jnp.ones(2)])
        [dtype('float32')]
    """
    out = []
    for x, a in zip(received, traced, strict=True):
        dx, da = float_dtype(x), float_dtype(a)
        out.append(None if dx is None or da is None else _widest(dx, da))
    return out


def _strong(x: Any) -> Any:
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


def _split(vals: Sequence[Any], *sizes: int) -> list[list[Any]]:
    out, i = [], 0
    for n in sizes:
        out.append(list(vals[i : i + n]))
        i += n
    out.append(list(vals[i:]))
    return out


def _mix(x: Any) -> Any:
    return x.mix if isinstance(x, Dual) else x


def _ref(x: Any) -> Any:
    return x.ref if isinstance(x, Dual) else x


def _plain_ctx(ctx: CastContext) -> CastContext:
    return CastContext(
        ctx.config, ctx.eqn, ctx.decision, ctx.walk.staged(), ctx.marks, []
    )


# ------------------------------------------------------------------ scan


def _scan_rule(ctx: CastContext, *invals: Any, jaxpr: ClosedJaxpr, **params: Any):
    walk = ctx.walk
    nc, ncar = _compat.scan_layout(params)
    length = params["length"]
    consts, init, xs = _split(invals, nc, ncar)
    dts = carry_dtypes(init, jaxpr.in_avals[nc : nc + ncar])
    init = cast_all(init, dts)
    # A carry or slice that enters as a gradient stays one (float8's e5m2).
    marks = [
        *ctx.marks[:nc],
        *(m & GRAD for m in ctx.marks[nc : nc + ncar]),
        *(m & (CONST | GRAD) for m in ctx.marks[nc + ncar :]),
    ]
    sub = walk.body("scan/body", trip=length)
    if walk.dual:
        return _scan_stepped(
            sub, jaxpr, consts, init, xs, marks, dts, length, params["reverse"]
        )
    init = [_strong(x) for x in init]

    def body(*args: Any) -> list[Any]:
        outs, _ = itp.eval_jaxpr(sub, jaxpr, (), args, marks)
        carry = [_strong(x) for x in cast_all(outs[:ncar], dts)]
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


def _index(x: Any, i: int) -> Any:
    if isinstance(x, Dual):
        return Dual(x.ref[i], x.mix[i])
    return x[i]


def _stack(column: Sequence[Any]) -> Any:
    if any(isinstance(x, Dual) for x in column):
        return Dual(
            jnp.stack([_ref(x) for x in column]), jnp.stack([_mix(x) for x in column])
        )
    return jnp.stack(list(column))


def _scan_stepped(
    sub: Walk,
    jaxpr: ClosedJaxpr,
    consts: list[Any],
    carry: list[Any],
    xs: list[Any],
    marks: list[int],
    dts: list[Any],
    length: int,
    reverse: bool,
) -> list[Any]:
    ncar = len(carry)
    rows: list[list[Any]] = []
    steps = range(length - 1, -1, -1) if reverse else range(length)
    for i in steps:
        outs, _ = itp.eval_jaxpr(
            sub, jaxpr, (), [*consts, *carry, *(_index(x, i) for x in xs)], marks
        )
        carry = cast_all(outs[:ncar], dts)
        rows.append(outs[ncar:])
    if reverse:
        rows.reverse()
    if rows:
        ys = [_stack(col) for col in zip(*rows, strict=True)]
    else:
        ys = [jnp.zeros((0, *a.shape), a.dtype) for a in jaxpr.out_avals[ncar:]]
    return [*carry, *ys]


# ------------------------------------------------------------------ while


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
    cconsts, bconsts, init = _split(invals, cn, bn)
    dts = carry_dtypes(init, body_jaxpr.in_avals[bn:])
    init = cast_all(init, dts)
    carried = [m & GRAD for m in ctx.marks[cn + bn :]]
    cmarks = [*ctx.marks[:cn], *carried]
    bmarks = [*ctx.marks[cn : cn + bn], *carried]
    csub = walk.body("while/cond")
    bsub = walk.body("while/body")
    if walk.dual:
        return _while_stepped(
            ctx, csub, bsub, cond_jaxpr, body_jaxpr, cconsts, bconsts, init, dts,
            cmarks, bmarks, params,
        )  # fmt: skip
    init = [_strong(x) for x in init]
    carry_avals = [aval_of(x) for x in init]

    def cond_fun(*args: Any) -> list[Any]:
        return itp.eval_jaxpr(csub, cond_jaxpr, (), args, cmarks)[0]

    def body_fun(*args: Any) -> list[Any]:
        outs, _ = itp.eval_jaxpr(bsub, body_jaxpr, (), args, bmarks)
        return [_strong(x) for x in cast_all(outs, dts)]

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


def _truth(pred: Any) -> bool:
    # A batched predicate (a while under vmap) continues while any lane does.
    return bool(np.any(np.asarray(pred)))


def _while_stepped(
    ctx: CastContext,
    csub: Walk,
    bsub: Walk,
    cond_jaxpr: ClosedJaxpr,
    body_jaxpr: ClosedJaxpr,
    cconsts: list[Any],
    bconsts: list[Any],
    carry: list[Any],
    dts: list[Any],
    cmarks: list[int],
    bmarks: list[int],
    params: dict[str, Any],
) -> list[Any]:
    observer = ctx.walk.observer
    max_steps = int(getattr(observer, "max_loop_steps", 10**9))
    steps = 0
    while True:
        (pred,), _ = itp.eval_jaxpr(csub, cond_jaxpr, (), [*cconsts, *carry], cmarks)
        go_ref, go_mix = _truth(_ref(pred)), _truth(_mix(pred))
        if go_ref != go_mix or (go_ref and steps >= max_steps):
            where = _compat.eqn_source_summary(ctx.eqn.source_info) or "<unknown>"
            if go_ref != go_mix:
                text = (
                    f"while_loop at {where}: the autocast run "
                    f"{'stops' if go_ref else 'continues'} after {steps} "
                    "iterations where float32 does not; later iterations are not "
                    "compared."
                )
            else:
                text = (
                    f"while_loop at {where}: compared the first {steps} "
                    "iterations only (max_loop_steps)."
                )
            if observer is not None:
                observer.on_note(ctx.walk, ctx.eqn, text)
            ref_carry = [_ref(c) for c in carry]
            mix_carry = [_mix(c) for c in carry]
            if go_ref:
                ref_in = [_ref(x) for x in (*cconsts, *bconsts, *ref_carry)]
                ref_carry = itp.bind_as_written(ctx.eqn, ref_in)
            if go_mix:
                mix_in = [_mix(x) for x in (*cconsts, *bconsts, *mix_carry)]
                mix_carry = list(
                    _while_rule(
                        _plain_ctx(ctx),
                        *mix_in,
                        cond_jaxpr=cond_jaxpr,
                        body_jaxpr=body_jaxpr,
                        cond_nconsts=len(cconsts),
                        body_nconsts=len(bconsts),
                        **params,
                    )
                )
            return [Dual(r, m) for r, m in zip(ref_carry, mix_carry, strict=True)]
        if not go_ref:
            return carry
        outs, _ = itp.eval_jaxpr(bsub, body_jaxpr, (), [*bconsts, *carry], bmarks)
        carry = cast_all(outs, dts)
        steps += 1


# ------------------------------------------------------------------ cond


def unify_branch_dtypes(per_branch: Sequence[Sequence[Any]]) -> list[Any]:
    """Per output: the widest floating dtype any branch gives (``None`` for
    outputs that are not floating).

    Examples:
        >>> import numpy as np
        >>> unify_branch_dtypes([[np.dtype("bfloat16")], [np.dtype("float32")]])
        [dtype('float32')]
    """
    target: list[Any] = []
    for column in zip(*per_branch, strict=True):
        if column[0] is None:
            target.append(None)
            continue
        d = column[0]
        for other in column[1:]:
            d = _widest(d, other)
        target.append(d)
    return target


def _branch_out_dtypes(
    walk: Walk, branches: Sequence[ClosedJaxpr], avals: Sequence[Any], marks: list[int]
) -> list[Any]:
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
    return unify_branch_dtypes(per_branch)


def _cond_rule(ctx: CastContext, index: Any, *operands: Any, branches: Any, **params):
    walk = ctx.walk
    marks = list(ctx.marks[1:])
    avals = [aval_of(x) for x in operands]
    target = _branch_out_dtypes(walk, branches, avals, marks)
    if walk.dual:
        return _cond_stepped(ctx, index, operands, branches, marks, target, params)
    if len(branches) == 1:
        sub = walk.body("cond/branch0")
        outs, _ = itp.eval_jaxpr(sub, branches[0], (), operands, marks)
        return cast_all(outs, target)
    traced = []
    for i, br in enumerate(branches):
        sub = walk.body(f"cond/branch{i}")

        def fun(*a: Any, br: Any = br, sub: Walk = sub) -> list[Any]:
            outs, _ = itp.eval_jaxpr(sub, br, (), a, marks)
            return [_strong(x) for x in cast_all(outs, target)]

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


def _cond_stepped(
    ctx: CastContext,
    index: Any,
    operands: Sequence[Any],
    branches: Sequence[ClosedJaxpr],
    marks: list[int],
    target: list[Any],
    params: dict[str, Any],
) -> list[Any]:
    n = len(branches)
    i_ref = min(max(int(_ref(index)), 0), n - 1)
    i_mix = min(max(int(_mix(index)), 0), n - 1)
    if i_ref == i_mix:
        sub = ctx.walk.body(f"cond/branch{i_ref}")
        outs, _ = itp.eval_jaxpr(sub, branches[i_ref], (), list(operands), marks)
        return cast_all(outs, target)
    where = _compat.eqn_source_summary(ctx.eqn.source_info) or "<unknown>"
    if ctx.walk.observer is not None:
        ctx.walk.observer.on_note(
            ctx.walk,
            ctx.eqn,
            f"cond at {where}: the autocast run takes branch {i_mix}, float32 "
            f"takes branch {i_ref}; not compared.",
        )
    ref_out = itp.bind_as_written(ctx.eqn, [_ref(index), *(_ref(x) for x in operands)])
    mix_out = _cond_rule(
        _plain_ctx(ctx),
        _mix(index),
        *(_mix(x) for x in operands),
        branches=branches,
        **params,
    )
    return [Dual(r, m) for r, m in zip(ref_out, mix_out, strict=True)]


ops.set_rule("scan", _scan_rule)
ops.set_rule("while", _while_rule)
ops.set_rule("cond", _cond_rule)
