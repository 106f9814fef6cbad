"""Rules for calls: nested ``jit``, ``checkpoint``, custom derivatives, ``shard_map``.

* A nested ``jit`` is rebound with its body transformed (the user's shardings and
  donation are kept), and the transformed body is cached per (body, operand
  types, walk), so a layer called in a Python loop is interpreted once. A body
  that JAX emits for a composite (``jnp.var``, ``jax.nn.log_softmax``) runs
  with the composite's class (float32).
* ``checkpoint`` is rebuilt with ``jax.checkpoint`` and the same policy. In
  the body of a transposed checkpoint (a whole step's recomputed forward and
  its backward) an attention's ``·v`` is put back where nothing recomputes it
  (:mod:`~mixprec._src.autocast.fusions.attention.remat`), so that the
  attention and its backward there are fused.
* ``custom_jvp``/``custom_vjp`` are rebuilt, not inlined, so the user's
  derivative rules still apply (inlining ``jax.nn.relu``'s primal loses its
  rule). Their tangents and cotangents take the primal's dtype; the JVP rule and
  the backward rule are interpreted too.
* ``shard_map`` is rebuilt with ``jax.shard_map`` on the same mesh and specs.

Every body is walked knowing which of its operands are constants and what the
walk knows of them (:func:`known_operands`), as if it were inlined: a
closed-over constant the low dtype cannot hold keeps its op in float32 inside
a ``checkpoint``, a custom derivative or a ``shard_map`` as it does outside,
and a fill of a known scalar saturates without a clamp. The bodies give back
the marks of their results.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, primitives as P

from mixprec._src import _compat
from mixprec._src.autocast import interpreter as itp, ops
from mixprec._src.autocast.avals import float_dtype
from mixprec._src.autocast.decide import CONST
from mixprec._src.autocast.fusions.attention import remat as remat_attention
from mixprec._src.autocast.operands import CastContext
from mixprec._src.autocast.rules.default import aval_of, cast_all, transform_jaxpr
from mixprec._src.autocast.walk import Walk


__all__ = ["call_body"]

#: Per call primitive: the param holding its body, and its kind.
_CALL_BODIES = {
    "jit": ("jaxpr", "jit"),
    "pjit": ("jaxpr", "jit"),
    "closed_call": ("call_jaxpr", "call"),
    "core_call": ("call_jaxpr", "call"),
    "remat2": ("jaxpr", "checkpoint"),
    "checkpoint": ("jaxpr", "checkpoint"),
    "custom_jvp_call": ("call_jaxpr", "custom_jvp"),
    "custom_vjp_call": ("call_jaxpr", "custom_vjp"),
}


def call_body(ctx: CastContext) -> tuple[Walk, Any] | None:
    """The walk and the jaxpr of the body of a call equation (a nested
    ``jit``, ``checkpoint``, ``custom_jvp``/``custom_vjp``, ``closed_call``),
    or ``None`` for other equations. A body JAX emits for a composite
    (``jnp.var``, ``jax.nn.log_softmax``) is walked with the composite's class.
    """
    found = _CALL_BODIES.get(ctx.eqn.primitive.name)
    if found is None:
        return None
    param, kind = found
    jaxpr = ctx.eqn.params[param]
    walk = ctx.walk
    composite = None
    if kind in ("jit", "custom_jvp", "custom_vjp") and not walk.float32:
        composite = ops.composite_for_function(jaxpr)
    if kind == "jit":
        label = f"jit({ctx.eqn.params.get('name', 'jit')})"
    elif kind in ("custom_jvp", "custom_vjp"):
        label = f"{kind}({_callable_name(jaxpr)})"
    else:
        label = kind
    return walk.body(label, composite=composite), jaxpr


def known_operands(
    ctx: CastContext, body_avals: Sequence[Any] | None = None
) -> list[Any]:
    """Per operand of a call equation, what the walk knows of it if it is a
    constant: its value (a literal such as ``jnp.where``'s fill, a closed-over
    array of up to :data:`~mixprec._src.autocast.interpreter.FOLD_LIMIT`
    elements, a constant folded from those), else its range
    (:class:`~mixprec._src.autocast.interpreter.KnownRange`: a larger
    closed-over array), else ``None``. The body is walked knowing them (the
    ``known`` of :func:`~mixprec._src.autocast.interpreter.eval_jaxpr`), as if
    inlined: a constant it cannot cast keeps its op in float32, and a fill
    saturates without a clamp.

    ``body_avals`` are the body's input types where they are not the
    operands' (a ``shard_map`` body sees blocks): a value of another shape is
    passed as its range.
    """
    walk = ctx.walk
    out: list[Any] = []
    for i, (v, m) in enumerate(zip(ctx.eqn.invars, ctx.marks, strict=True)):
        if not m & CONST:
            out.append(None)
            continue
        value = itp.known_value(walk.facts, v)
        if value is not None and body_avals is not None:
            if tuple(np.shape(value)) != tuple(getattr(body_avals[i], "shape", ())):
                value = None
        if value is not None:
            out.append(value)
            continue
        magnitudes = walk.constant_range(v)
        out.append(None if magnitudes is None else itp.KnownRange(magnitudes))
    return out


def _known_key(known: Sequence[Any]) -> tuple[Any, ...]:
    return tuple(
        None
        if x is None
        else ("range", *x)
        if isinstance(x, itp.KnownRange)
        else (x.dtype.str, x.shape, x.tobytes())
        for x in known
    )


# ------------------------------------------------------------------ jit

# Transformed bodies of nested jits, per (operand types and marks, walk), weak
# on the body jaxpr.
_jit_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _jit_rule(ctx: CastContext, *invals: Any, jaxpr: ClosedJaxpr, **params: Any):
    walk = ctx.walk
    name = str(params.get("name", "jit"))
    in_avals = [aval_of(x) for x in invals]
    known = known_operands(ctx)
    key = None
    if walk.observer is None:
        key = (tuple(in_avals), tuple(ctx.marks), walk.key, walk.path)
        key += _known_key(known)
        try:
            hit = _jit_cache.get(jaxpr, {}).get(key)
        except TypeError:  # unhashable avals
            key, hit = None, None
        if hit is not None:
            new_jaxpr, marks = hit
            ctx.out_marks[:] = marks
            return P.jit_p.bind(*invals, jaxpr=new_jaxpr, **params)
    sub, _ = call_body(ctx)  # type: ignore[misc]
    new_jaxpr, marks = transform_jaxpr(
        sub, jaxpr, in_avals, ctx.marks, name=name, known=known
    )
    if key is not None and not any(_compat.is_tracer(c) for c in new_jaxpr.consts):
        _jit_cache.setdefault(jaxpr, {})[key] = (new_jaxpr, marks)
    ctx.out_marks[:] = marks
    return P.jit_p.bind(*invals, jaxpr=new_jaxpr, **params)


def _closed_call_rule(ctx: CastContext, *invals: Any, call_jaxpr: Any, **params):
    del params
    sub, _ = call_body(ctx)  # type: ignore[misc]
    known = known_operands(ctx)
    outs, marks = itp.eval_jaxpr(sub, call_jaxpr, (), invals, ctx.marks, known)
    ctx.out_marks[:] = marks
    return outs


# ------------------------------------------------------------------ remat


def _remat_rule(
    ctx: CastContext,
    *invals: Any,
    jaxpr: Jaxpr,
    prevent_cse: bool,
    differentiated: bool,
    policy: Any,
    **params: Any,
):
    del differentiated, params
    sub, _ = call_body(ctx)  # type: ignore[misc]
    known = known_operands(ctx)
    box: dict[str, list[int]] = {}
    # In a whole step, the body of a transposed checkpoint recomputes its
    # forward: an attention there whose `·v` is not recomputed gets it back
    # (one more result, dropped), so that both passes are fused.
    added = 0
    if sub.rewrites:
        jaxpr, added = remat_attention.complete(jaxpr, known)
    n = len(jaxpr.outvars) - added

    def fun(*args: Any) -> list[Any]:
        outs, marks = itp.eval_jaxpr(sub, jaxpr, (), args, ctx.marks, known)
        box["marks"] = marks[:n]
        return outs[:n]

    outs = list(jax.checkpoint(fun, prevent_cse=prevent_cse, policy=policy)(*invals))
    ctx.out_marks[:] = box.get("marks", ctx.out_marks)
    return outs


# ------------------------------------------------------------------ custom_jvp


def _callable_name(closed: Any) -> str:
    found = _compat.jaxpr_function(closed)
    if found is not None:
        return found[0]
    try:
        dbg = closed.jaxpr.debug_info
        return str(dbg.func_name).split(" ")[0] if dbg is not None else "f"
    except AttributeError:
        return "f"


def _zeros_like(x: Any) -> Any:
    return jnp.zeros(jnp.shape(x), float_dtype(x) or jnp.result_type(x))


def _custom_jvp_rule(
    ctx: CastContext,
    *invals: Any,
    call_jaxpr: ClosedJaxpr,
    jvp_jaxpr_fun: Any,
    num_consts: int,
    symbolic_zeros: bool,
    **params: Any,
):
    del symbolic_zeros, params
    walk = ctx.walk
    name = _callable_name(call_jaxpr)
    composite = None if walk.float32 else ops.composite_for_function(call_jaxpr)
    label = f"custom_jvp({name})"
    consts = list(invals[:num_consts])
    args = list(invals[num_consts:])
    marks = list(ctx.marks)
    known = known_operands(ctx)
    sub = walk.body(label, composite=composite)
    box: dict[str, Any] = {}

    def primal(*xs: Any) -> list[Any]:
        outs, out_marks = itp.eval_jaxpr(
            sub, call_jaxpr, (), [*consts, *xs], marks, known
        )
        box["dtypes"] = [float_dtype(o) for o in outs]
        box["marks"] = out_marks
        return outs

    def out_dtypes(xs: Sequence[Any]) -> list[Any]:
        if "dtypes" not in box:
            probe = sub.probe()
            box["dtypes"] = [
                float_dtype(a)
                for a in _compat.trace_to_closed_jaxpr(
                    lambda *a: itp.eval_jaxpr(
                        probe, call_jaxpr, (), [*consts, *a], marks, known
                    )[0],
                    [aval_of(x) for x in xs],
                    name="probe",
                ).out_avals
            ]
        return box["dtypes"]

    primal.__name__ = name
    f = jax.custom_jvp(primal)

    @f.defjvp
    def f_jvp(primals: Sequence[Any], tangents: Sequence[Any]) -> Any:
        dts = out_dtypes(primals)
        jaxpr, jconsts, out_zeros = _compat.custom_jvp_jaxpr(
            jvp_jaxpr_fun, len(primals)
        )
        # JAX linearizes and transposes the JVP rule: its dots must not be
        # custom_vjp functions (which cannot be transposed).
        jsub = walk.body(f"{label}/jvp", composite=composite)
        jsub = jsub._copy(
            config=dataclasses.replace(walk.config, custom_vjp_dots=False)
        )
        tangents = [
            itp.cast(_compat.instantiate_zeros(t), float_dtype(p))
            if float_dtype(p) is not None
            else t
            for p, t in zip(primals, tangents, strict=True)
        ]
        jmarks = marks[num_consts:] + [0] * len(tangents)
        outs, _ = itp.eval_jaxpr(
            jsub, jaxpr, jconsts, [*primals, *tangents], jmarks, known[num_consts:]
        )
        n = len(out_zeros)
        out_p = cast_all(outs[:n], dts)
        nz = iter(outs[n:])
        out_t = []
        for p, z in zip(out_p, out_zeros, strict=True):
            if z:
                out_t.append(
                    _zeros_like(p)
                    if float_dtype(p) is not None
                    else jnp.zeros(jnp.shape(p), jax.dtypes.float0)
                )
            else:
                t = next(nz)
                out_t.append(itp.cast(t, float_dtype(p)) if float_dtype(p) else t)
        return out_p, out_t

    outs = list(f(*args))
    ctx.out_marks[:] = box.get("marks", ctx.out_marks)
    return outs


# ------------------------------------------------------------------ custom_vjp


def _custom_vjp_rule(
    ctx: CastContext,
    *invals: Any,
    call_jaxpr: ClosedJaxpr,
    fwd_jaxpr_thunk: Any,
    num_consts: int,
    bwd: Any,
    out_trees: Any,
    symbolic_zeros: bool,
    **params: Any,
):
    del symbolic_zeros, params
    walk = ctx.walk
    name = _callable_name(call_jaxpr)
    composite = None if walk.float32 else ops.composite_for_function(call_jaxpr)
    label = f"custom_vjp({name})"
    consts = list(invals[:num_consts])
    args = list(invals[num_consts:])
    marks = list(ctx.marks)
    known = known_operands(ctx)
    sub = walk.body(label, composite=composite)
    orig_out_avals = call_jaxpr.out_avals
    arg_dtypes = [float_dtype(a) for a in args]
    box: dict[str, Any] = {}

    def primal_outs(w: Walk, xs: Sequence[Any]) -> list[Any]:
        outs, box["marks"] = itp.eval_jaxpr(
            w, call_jaxpr, (), [*consts, *xs], marks, known
        )
        return outs

    def primal(*xs: Any) -> list[Any]:
        outs = primal_outs(sub, xs)
        box["dtypes"] = [float_dtype(o) for o in outs]
        return outs

    primal.__name__ = name
    f = jax.custom_vjp(primal)

    def f_fwd(*xs: Any) -> Any:
        if "dtypes" not in box:
            probe = sub.probe()
            closed = _compat.trace_to_closed_jaxpr(
                lambda *a: primal_outs(probe, a),
                [aval_of(x) for x in xs],
                name="probe",
            )
            box["dtypes"] = [float_dtype(a) for a in closed.out_avals]
        fjaxpr, fconsts = _compat.custom_vjp_fwd_jaxpr(fwd_jaxpr_thunk, len(xs))
        fsub = walk.body(f"{label}/fwd", composite=composite)
        outs, _ = itp.eval_jaxpr(
            fsub, fjaxpr, fconsts, list(xs), marks[num_consts:], known[num_consts:]
        )
        _, res_tree, input_fwds = out_trees()
        num_res_out = res_tree.num_leaves - sum(i is not None for i in input_fwds)
        res_out, primals_out = outs[:num_res_out], outs[num_res_out:]
        all_in = [*consts, *xs]
        it = iter(res_out)
        res = [next(it) if i is None else all_in[i] for i in input_fwds]
        box["res_avals"] = _residual_avals(fjaxpr, call_jaxpr, input_fwds, num_res_out)
        return cast_all(primals_out, box["dtypes"]), res

    def f_bwd(res: Any, cts: Sequence[Any]) -> tuple[Any, ...]:
        res = _cast_to_avals(res, box["res_avals"])
        cts = [_compat.instantiate_zeros(c) for c in cts]
        cts = _cast_to_avals(cts, orig_out_avals)
        bsub = walk.body(f"{label}/bwd", composite=composite)
        in_avals = call_jaxpr.in_avals[num_consts:]

        def bwd_flat(*a: Any) -> list[Any]:
            outs = _compat.call_custom_vjp_bwd(bwd, *a)
            return [
                _instantiate_ct(o, av) for o, av in zip(outs, in_avals, strict=True)
            ]

        closed = _compat.trace_to_closed_jaxpr(
            bwd_flat, [aval_of(x) for x in [*res, *cts]], name="bwd"
        )
        outs, _ = itp.eval_jaxpr(bsub, closed, (), [*res, *cts])
        result = []
        for o, d, av in zip(outs, arg_dtypes, in_avals, strict=True):
            result.append(itp.cast(o, d) if float_dtype(av) is not None else None)
        return tuple(result)

    f.defvjp(f_fwd, f_bwd)
    outs = list(f(*args))
    ctx.out_marks[:] = box.get("marks", ctx.out_marks)
    return outs


def _cast_to_avals(vals: Sequence[Any], avals: Sequence[Any]) -> list[Any]:
    return [
        itp.cast(x, a.dtype) if float_dtype(x) is not None and float_dtype(a) else x
        for x, a in zip(vals, avals, strict=True)
    ]


def _instantiate_ct(ct: Any, aval: Any) -> Any:
    if _compat.is_symbolic_zero(ct) or ct is None:
        if float_dtype(aval) is not None:
            return jnp.zeros(aval.shape, aval.dtype)
        return jnp.zeros((), jnp.int32)
    if float_dtype(aval) is None:
        return jnp.zeros((), jnp.int32)
    return ct


def _residual_avals(
    fjaxpr: Jaxpr, call_jaxpr: ClosedJaxpr, input_fwds: Sequence[Any], n_res: int
) -> list[Any]:
    outs = [v.aval for v in fjaxpr.outvars[:n_res]]
    it = iter(outs)
    in_avals = call_jaxpr.in_avals
    return [next(it) if i is None else in_avals[i] for i in input_fwds]


# ------------------------------------------------------------------ shard_map


def _shard_map_rule(
    ctx: CastContext,
    *invals: Any,
    jaxpr: Jaxpr,
    mesh: Any,
    in_specs: Any,
    out_specs: Any,
    check_vma: bool,
    **params: Any,
):
    axis_names = params.get("newly_manual_axes", params.get("manual_axes"))
    sub = ctx.walk.body("shard_map")
    known = known_operands(ctx, [v.aval for v in jaxpr.invars])
    box: dict[str, list[int]] = {}

    def body(*xs: Any) -> tuple[Any, ...]:
        outs, box["marks"] = itp.eval_jaxpr(sub, jaxpr, (), xs, ctx.marks, known)
        return tuple(outs)

    kwargs: dict[str, Any] = {}
    if axis_names is not None:
        kwargs["axis_names"] = set(axis_names)
    sm = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=tuple(in_specs),
        out_specs=tuple(out_specs),
        check_vma=check_vma,
        **kwargs,
    )
    outs = list(sm(*invals))
    ctx.out_marks[:] = box.get("marks", ctx.out_marks)
    return outs


for _name in ("jit", "pjit"):
    ops.set_rule(_name, _jit_rule)
for _name in ("closed_call", "core_call"):
    ops.set_rule(_name, _closed_call_rule)
for _name in ("remat2", "checkpoint"):
    ops.set_rule(_name, _remat_rule)
ops.set_rule("custom_jvp_call", _custom_jvp_rule)
ops.set_rule("custom_vjp_call", _custom_vjp_rule)
ops.set_rule("shard_map", _shard_map_rule)
