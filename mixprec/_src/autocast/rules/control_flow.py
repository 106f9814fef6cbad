"""Rules for ``scan``, ``while`` and ``cond``.

Each rule interprets the bodies and rebinds the same primitive with the new
jaxprs and consistently updated params (constants the interpretation creates
become leading operands, as ``lax.scan`` passes them), so whatever JAX put in
the equation (a batched ``while`` predicate under ``vmap``, unrolling) is kept.

The types at the boundary are decided in :mod:`~mixprec._src.autocast.decide`:
``scan``/``while`` carries keep one dtype across iterations
(:func:`~mixprec._src.autocast.decide.carry_dtypes`: a float32 RNN state stays
float32), and ``cond`` results take the widest dtype any branch gives
(:func:`~mixprec._src.autocast.decide.branch_dtypes`).

The stepping path (:func:`step_rule`) runs the higher-order equations of a walk
whose observer ``steps`` (``diagnose``) on concrete values: a loop's body is
walked once per iteration and a ``cond``'s taken branch once, with the same
boundary dtypes, marks and body walks as the rules above, so the decisions it
reports inside bodies are the ones autocast makes; call bodies are walked in
place; any other higher-order equation runs its rule unobserved and is reported
as one op. Such an observer keeps a value of its own per variable beside the
walk's (``diagnose``'s float32 reference, :class:`Stepping`): the stepping path
carries it through the same iterations and branches, and says so in a note
where the two disagree (a loop that stops earlier, another branch).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol, cast

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import ClosedJaxpr, jaxpr_as_fun, mapped_aval, primitives as P

from mixprec._src import _compat
from mixprec._src.autocast import interpreter as itp, ops
from mixprec._src.autocast.avals import float_dtype
from mixprec._src.autocast.decide import (
    BIG,
    CONST,
    GRAD,
    STAT,
    branch_dtypes,
    carry_dtypes,
)
from mixprec._src.autocast.operands import CastContext
from mixprec._src.autocast.rules import calls
from mixprec._src.autocast.rules.default import aval_of, cast_all, hoist_consts
from mixprec._src.autocast.walk import Observer, Walk


__all__ = [
    "Stepping",
    "branch_out_dtypes",
    "scan_body_marks",
    "split",
    "step_rule",
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


def _carried(vals: Sequence[Any], dtypes: Sequence[Any]) -> list[Any]:
    """A loop carry in its one dtype per iteration (``None``: as it comes)."""
    return [strong(x) for x in cast_all(vals, dtypes)]


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
    constant is a constant, a slice of a statistic a statistic (a mean or a
    variance passed as ``xs`` anchors the body's norm in float32, as it does
    outside the loop), and a slice of a mask bias a mask bias (``BIG``). A
    carry keeps no role but a gradient's: the body may make it anything.

    Examples:
        >>> from mixprec._src.autocast.decide import STAT
        >>> scan_body_marks([0, 0, STAT], num_consts=0, num_carry=1) == [0, 0, STAT]
        True
    """
    nc, ncar = num_consts, num_carry
    return [
        *marks[:nc],
        *(m & GRAD for m in marks[nc : nc + ncar]),
        *(m & (CONST | GRAD | STAT | BIG) for m in marks[nc + ncar :]),
    ]


def _scan_rule(ctx: CastContext, *invals: Any, jaxpr: ClosedJaxpr, **params: Any):
    walk = ctx.walk
    nc, ncar = _compat.scan_layout(params)
    length = params["length"]
    consts, init, xs = split(invals, nc, ncar)
    dts = carry_dtypes(init, jaxpr.in_avals[nc : nc + ncar])
    init = _carried(init, dts)
    marks = scan_body_marks(ctx.marks, nc, ncar)
    sub = walk.body("scan/body", trip=length)

    def body(*args: Any) -> list[Any]:
        outs, _ = itp.eval_jaxpr(sub, jaxpr, (), args, marks)
        return [*_carried(outs[:ncar], dts), *outs[ncar:]]

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
    init = _carried(init, dts)
    cmarks, bmarks = while_body_marks(ctx.marks, cn, bn)
    csub = walk.body("while/cond")
    bsub = walk.body("while/body")
    carry_avals = [aval_of(x) for x in init]

    def cond_fun(*args: Any) -> list[Any]:
        return itp.eval_jaxpr(csub, cond_jaxpr, (), args, cmarks)[0]

    def body_fun(*args: Any) -> list[Any]:
        outs, _ = itp.eval_jaxpr(bsub, body_jaxpr, (), args, bmarks)
        return _carried(outs, dts)

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


# ------------------------------------------------------------------ stepping


class Stepping(Observer, Protocol):
    """An observer whose walk takes the stepping path (``steps = True``).

    It keeps a value of its own for each variable of the jaxprs walked (its
    *reference*; ``diagnose``'s float32 stream, each equation run as written):
    :meth:`seed` sets them for the inputs of a body about to be walked,
    :meth:`read` gives them for a body's results. The stepping path carries
    them through the same iterations and branches as the walk's values.
    """

    #: A ``while_loop`` is stepped this many iterations at most; the rest runs
    #: as a whole.
    max_loop_steps: int

    def seed(self, variables: Sequence[Any], values: Sequence[Any]) -> None:
        """Sets the reference values of ``variables``."""
        ...

    def read(self, variables: Sequence[Any]) -> list[Any]:
        """The reference values of ``variables`` (a literal: its value)."""
        ...


def step_rule(ctx: CastContext, *invals: Any, **params: Any) -> Any:
    """Runs a higher-order equation of a stepping walk on concrete values.

    ``scan`` is stepped iteration by iteration, ``while`` until its predicate
    is false (at most ``max_loop_steps`` iterations), ``cond`` takes the branch
    its index picks; each body walk is the one the rule makes (same label,
    trip count, marks and carry dtypes). A call (nested ``jit``,
    ``checkpoint``, custom derivatives) walks its body in place. Anything else
    (``shard_map``, whose collectives need the mesh) runs its rule unobserved
    and is reported to the observer as one op (``rerun=None``).

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> import mixprec
        >>> def f(x):
        ...     return jax.lax.scan(lambda c, r: (c, r @ x), 0.0, x)[1]
        >>> # diagnose's walk steps the scan: its dot is compared 4 times.
        >>> [(op.primitive, op.path, op.calls) for op in
        ...  mixprec.diagnose(f, jnp.ones((4, 4)), policy="mixed_bfloat16").ops]
        [('dot_general', 'scan/body', 4)]
    """
    del params
    eqn = ctx.eqn
    obs = _stepping(ctx.walk)
    ref_in = obs.read(eqn.invars)
    name = eqn.primitive.name
    if name == "scan":
        outs, ref_out = _step_scan(ctx, obs, invals, ref_in)
    elif name == "while":
        outs, ref_out = _step_while(ctx, obs, invals, ref_in)
    elif name == "cond":
        outs, ref_out = _step_cond(ctx, obs, invals, ref_in)
    elif (body := calls.call_body(ctx)) is not None:
        sub, jaxpr = body
        known = calls.known_operands(ctx)
        outs, ref_out, marks = _step_body(
            obs, sub, jaxpr, invals, ref_in, ctx.marks, known
        )
        ctx.out_marks[:] = marks
    else:
        # Run as a whole: the observer computes its reference of the outputs.
        rule = ops.higher_order_rule(name)
        out = rule(_unobserved(ctx), *invals, **eqn.params)
        outs = list(out) if eqn.primitive.multiple_results else [out]
        decided = itp.ran_with(ctx.decision, eqn, invals)
        obs.on_eqn(ctx.walk, eqn, ctx.decision, decided, invals, outs, None)
        return out
    obs.seed(eqn.outvars, ref_out)
    return outs if eqn.primitive.multiple_results else outs[0]


def _stepping(walk: Walk) -> Stepping:
    if walk.observer is None or not walk.observer.steps:
        raise ValueError(
            "`step_rule` runs the higher-order equations of a walk whose "
            "observer steps (`steps = True`), got observer "
            f"{type(walk.observer).__name__}."
        )
    return cast(Stepping, walk.observer)


def _unobserved(ctx: CastContext) -> CastContext:
    """``ctx`` with a walk that observes nothing (its rule traces its body)."""
    return dataclasses.replace(ctx, walk=ctx.walk.probe())


def _step_body(
    obs: Stepping,
    walk: Walk,
    jaxpr: Any,
    args: Sequence[Any],
    ref_args: Sequence[Any],
    marks: Sequence[int],
    known: Sequence[Any] = (),
) -> tuple[list[Any], list[Any], list[int]]:
    """Walks a body once on concrete values. Returns its results, their
    references and their marks."""
    if isinstance(jaxpr, ClosedJaxpr):
        obs.seed(jaxpr.jaxpr.constvars, jaxpr.consts)
        inner = jaxpr.jaxpr
    else:
        inner = jaxpr
    obs.seed(inner.invars, ref_args)
    outs, out_marks = itp.eval_jaxpr(walk, jaxpr, (), list(args), list(marks), known)
    return outs, obs.read(inner.outvars), out_marks


def _truth(pred: Any) -> bool:
    # A batched predicate (a while under vmap) continues while any lane does.
    return bool(np.any(np.asarray(pred)))


def _stack(rows: Sequence[Sequence[Any]], avals: Sequence[Any]) -> list[Any]:
    """Per-iteration results of a stepped scan, stacked (zero rows of
    ``avals`` when it ran no iteration)."""
    if rows:
        return [jnp.stack(list(col)) for col in zip(*rows, strict=True)]
    return [jnp.zeros((0, *a.shape), a.dtype) for a in avals]


def _step_scan(
    ctx: CastContext, obs: Stepping, invals: Sequence[Any], ref_in: Sequence[Any]
) -> tuple[list[Any], list[Any]]:
    params = ctx.eqn.params
    jaxpr = params["jaxpr"]
    nc, ncar = _compat.scan_layout(params)
    length, reverse = params["length"], params["reverse"]
    consts, carry, xs = split(invals, nc, ncar)
    rconsts, rcarry, rxs = split(ref_in, nc, ncar)
    dts = carry_dtypes(carry, jaxpr.in_avals[nc : nc + ncar])
    carry = _carried(carry, dts)
    marks = scan_body_marks(ctx.marks, nc, ncar)
    sub = ctx.walk.body("scan/body", trip=length)
    rows: list[list[Any]] = []
    ref_rows: list[list[Any]] = []
    for i in range(length - 1, -1, -1) if reverse else range(length):
        outs, routs, _ = _step_body(
            obs,
            sub,
            jaxpr,
            [*consts, *carry, *(x[i] for x in xs)],
            [*rconsts, *rcarry, *(x[i] for x in rxs)],
            marks,
        )
        carry, rcarry = _carried(outs[:ncar], dts), routs[:ncar]
        rows.append(outs[ncar:])
        ref_rows.append(routs[ncar:])
    if reverse:
        rows.reverse()
        ref_rows.reverse()
    ys_avals = jaxpr.out_avals[ncar:]
    return [*carry, *_stack(rows, ys_avals)], [*rcarry, *_stack(ref_rows, ys_avals)]


def _step_while(
    ctx: CastContext, obs: Stepping, invals: Sequence[Any], ref_in: Sequence[Any]
) -> tuple[list[Any], list[Any]]:
    eqn = ctx.eqn
    p = eqn.params
    cond_jaxpr, body_jaxpr = p["cond_jaxpr"], p["body_jaxpr"]
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cconsts, bconsts, carry = split(invals, cn, bn)
    rcconsts, rbconsts, rcarry = split(ref_in, cn, bn)
    dts = carry_dtypes(carry, body_jaxpr.in_avals[bn:])
    carry = _carried(carry, dts)
    cmarks, bmarks = while_body_marks(ctx.marks, cn, bn)
    csub = ctx.walk.body("while/cond")
    bsub = ctx.walk.body("while/body")
    steps = 0
    while True:
        (pred,), (rpred,), _ = _step_body(
            obs, csub, cond_jaxpr, [*cconsts, *carry], [*rcconsts, *rcarry], cmarks
        )
        go_ref, go_mix = _truth(rpred), _truth(pred)
        if go_ref == go_mix and not (go_ref and steps >= obs.max_loop_steps):
            if not go_ref:
                return carry, rcarry
            outs, routs, _ = _step_body(
                obs, bsub, body_jaxpr, [*bconsts, *carry], [*rbconsts, *rcarry], bmarks
            )
            carry, rcarry = _carried(outs, dts), routs
            steps += 1
            continue
        where = _compat.eqn_source_summary(eqn.source_info) or "<unknown>"
        if go_ref != go_mix:
            text = (
                f"while_loop at {where}: the autocast run "
                f"{'stops' if go_ref else 'continues'} after {steps} "
                "iterations where float32 does not; later iterations are "
                "not compared."
            )
        else:
            text = (
                f"while_loop at {where}: compared the first {steps} "
                "iterations only (max_loop_steps)."
            )
        obs.on_note(ctx.walk, eqn, text)
        # The rest of the loop as a whole, on each stream that goes on.
        if go_ref:
            rcarry = itp.bind_as_written(eqn, [*rcconsts, *rbconsts, *rcarry])
        if go_mix:
            carry = list(_while_rule(_unobserved(ctx), *cconsts, *bconsts, *carry, **p))
        return carry, rcarry


def _step_cond(
    ctx: CastContext, obs: Stepping, invals: Sequence[Any], ref_in: Sequence[Any]
) -> tuple[list[Any], list[Any]]:
    eqn = ctx.eqn
    branches = eqn.params["branches"]
    index, operands = invals[0], list(invals[1:])
    rindex, roperands = ref_in[0], list(ref_in[1:])
    marks = list(ctx.marks[1:])
    avals = [aval_of(x) for x in operands]
    target = branch_out_dtypes(ctx.walk, branches, avals, marks)
    n = len(branches)
    i_ref = min(max(int(rindex), 0), n - 1)
    i_mix = min(max(int(index), 0), n - 1)
    if i_ref == i_mix:
        sub = ctx.walk.body(f"cond/branch{i_ref}")
        outs, routs, _ = _step_body(
            obs, sub, branches[i_ref], operands, roperands, marks
        )
        return cast_all(outs, target), routs
    where = _compat.eqn_source_summary(eqn.source_info) or "<unknown>"
    obs.on_note(
        ctx.walk,
        eqn,
        f"cond at {where}: the autocast run takes branch {i_mix}, float32 "
        f"takes branch {i_ref}; not compared.",
    )
    outs = _cond_rule(_unobserved(ctx), index, *operands, **eqn.params)
    return list(outs), itp.bind_as_written(eqn, ref_in)


itp.set_stepping_rule(step_rule)
ops.set_rule("scan", _scan_rule)
ops.set_rule("while", _while_rule)
ops.set_rule("cond", _cond_rule)
