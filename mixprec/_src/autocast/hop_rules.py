"""Cast rules for higher-order primitives: the interpreter recurses into bodies.

Each rule interprets the sub-jaxpr(s) with the same context (plus a ``path`` for
records) and rebuilds the higher-order primitive around the result, through the
public JAX API where it exists (``lax.scan``, ``lax.while_loop``, ``lax.switch``,
``jax.checkpoint``, ``jax.custom_jvp``, ``jax.custom_vjp``, ``jax.shard_map``) so
that closed-over values, weak types and varying-axis types are handled as JAX
does, and by re-binding the primitive with a new jaxpr for ``jit`` (which keeps
the user's shardings and donation).

Type invariants:

* ``scan``/``while`` carries keep one dtype across iterations: the wider of the
  dtype they arrive in and the dtype they were written in; the body's outputs
  are cast back to it.
* ``cond``/``switch`` branches agree: each output takes the widest dtype any
  branch produces.
* ``custom_jvp``/``custom_vjp`` are rebuilt, not inlined, so the user's
  derivative rules still apply. Their tangents/cotangents take the primal's
  dtype; the JVP rule and the backward rule are interpreted too (traced at the
  original types, then run with autocast's decisions).
* A nested ``jit`` whose name is a composite (``_var``, ``log_softmax``, ...) runs
  with the composite's decision (float32 by default) for every op inside.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import ClosedJaxpr, Jaxpr, primitives as P

from mixprec._src import _compat
from mixprec._src.autocast import interpreter as itp, rules
from mixprec._src.autocast.op_lists import composite_for
from mixprec._src.autocast.rules import CastContext, dtype_of, is_floating


def _widest(a: np.dtype, b: np.dtype) -> np.dtype:
    """The wider of two floating dtypes (float16 vs bfloat16: float32)."""
    a, b = np.dtype(a), np.dtype(b)
    if a == b:
        return a
    if a.itemsize != b.itemsize:
        return a if a.itemsize > b.itemsize else b
    return np.dtype(np.float32) if a.itemsize < 4 else a


def _carry_dtypes(received: Sequence[Any], avals: Sequence[Any]) -> list[Any]:
    """Per carry: the wider of the received and the original floating dtype."""
    out = []
    for x, a in zip(received, avals, strict=True):
        if is_floating(x) and is_floating(a):
            out.append(_widest(dtype_of(x), np.dtype(a.dtype)))
        else:
            out.append(None)
    return out


def _cast_all(vals: Sequence[Any], dtypes: Sequence[Any]) -> list[Any]:
    return [
        x if d is None else rules.cast(x, d) for x, d in zip(vals, dtypes, strict=True)
    ]


def _probe_out_dtypes(fun: Any, args: Sequence[Any]) -> list[np.dtype]:
    """The output dtypes of ``fun(*args)``, traced abstractly (no records)."""
    with itp.probing():
        closed = _compat.trace_to_closed_jaxpr(
            fun, [_compat.get_aval(a) for a in args], name="probe"
        )
    return [np.dtype(a.dtype) for a in closed.out_avals]


def _register_hop(prim: Any, rule: Any) -> None:
    rules._cast_rules[prim] = rule
    rules._hop_primitives.add(prim)


def _from_param(ctx: CastContext, n: int) -> list[bool]:
    fp = list(ctx.from_param)
    return (fp + [False] * n)[:n]


# ------------------------------------------------------------------ jit

# Transformed bodies of nested jits, per (body, input types, context): a block
# called many times (a layer in a Python loop) is interpreted once. Weak on the
# body jaxpr, as in jet's ``weakref_lru_cache``.
_jit_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _jit_rule(ctx: CastContext, *invals: Any, jaxpr: ClosedJaxpr, **params: Any):
    name = str(params.get("name", "jit"))
    eqn = ctx.eqn
    in_avals = [_compat.get_aval(x) for x in invals]
    key = None
    if ctx.recorder is None:
        key = (tuple(in_avals), tuple(_from_param(ctx, len(invals))), ctx)
        try:
            new_jaxpr = _jit_cache.get(jaxpr, {}).get(key)
        except TypeError:  # unhashable avals
            key, new_jaxpr = None, None
        if new_jaxpr is not None:
            return P.jit_p.bind(*invals, jaxpr=new_jaxpr, **params)
    comp = composite_for(name) if ctx.region != "float32" else None
    sub = itp.sub_context(ctx, f"jit({name})")
    decision = None
    if comp is not None:
        decision = itp._decide(
            dataclasses.replace(ctx, composite=comp),
            eqn,
            [dtype_of(x) for x in invals],
            _from_param(ctx, len(invals)),
        )
        sub = dataclasses.replace(sub, composite=comp)
    fun = itp.jaxpr_fun(sub, jaxpr, from_param=_from_param(ctx, len(invals)))
    new_jaxpr = _compat.trace_to_closed_jaxpr(fun, in_avals, name=name)
    if key is not None and not any(_compat.is_tracer(c) for c in new_jaxpr.consts):
        _jit_cache.setdefault(jaxpr, {})[key] = new_jaxpr
    outs = P.jit_p.bind(*invals, jaxpr=new_jaxpr, **params)
    if comp is not None and decision is not None:
        itp.record_composite(ctx, eqn, comp, invals, outs, decision)
    return outs


def _closed_call_rule(ctx: CastContext, *invals: Any, call_jaxpr: Any, **params):
    del params
    sub = itp.sub_context(ctx, "call")
    return itp.eval_jaxpr(sub, call_jaxpr, [], invals)


# ------------------------------------------------------------------ loops


def _scan_rule(
    ctx: CastContext,
    *invals: Any,
    jaxpr: ClosedJaxpr,
    num_consts: int,
    num_carry: int,
    length: int,
    reverse: bool,
    unroll: Any,
    **params: Any,
):
    consts = list(invals[:num_consts])
    init = list(invals[num_consts : num_consts + num_carry])
    xs = list(invals[num_consts + num_carry :])
    carry_avals = jaxpr.in_avals[num_consts : num_consts + num_carry]
    dts = _carry_dtypes(init, carry_avals)
    sub = itp.sub_context(ctx, "scan/body", trip_count=length)
    fp = _from_param(ctx, num_consts) + [False] * (num_carry + len(xs))

    def body(carry: list[Any], x: list[Any]) -> tuple[list[Any], list[Any]]:
        outs = itp.eval_jaxpr(sub, jaxpr, [], [*consts, *carry, *x], from_param=fp)
        return _cast_all(outs[:num_carry], dts), outs[num_carry:]

    kwargs = {}
    if "_split_transpose" in params:
        kwargs["_split_transpose"] = params["_split_transpose"]
    carry, ys = lax.scan(
        body,
        _cast_all(init, dts),
        xs,
        length=length,
        reverse=reverse,
        unroll=unroll,
        **kwargs,
    )
    return [*carry, *ys]


def _while_rule(
    ctx: CastContext,
    *invals: Any,
    cond_jaxpr: ClosedJaxpr,
    body_jaxpr: ClosedJaxpr,
    cond_nconsts: int,
    body_nconsts: int,
    **params: Any,
):
    del params
    cconsts = list(invals[:cond_nconsts])
    bconsts = list(invals[cond_nconsts : cond_nconsts + body_nconsts])
    init = list(invals[cond_nconsts + body_nconsts :])
    dts = _carry_dtypes(init, body_jaxpr.in_avals[body_nconsts:])
    csub = itp.sub_context(ctx, "while/cond")
    bsub = itp.sub_context(ctx, "while/body")
    flags = _from_param(ctx, len(invals))
    fp_c = flags[:cond_nconsts] + [False] * len(init)
    fp_b = flags[cond_nconsts : cond_nconsts + body_nconsts] + [False] * len(init)

    def cond_fun(carry: list[Any]) -> Any:
        return itp.eval_jaxpr(
            csub, cond_jaxpr, [], [*cconsts, *carry], from_param=fp_c
        )[0]

    def body_fun(carry: list[Any]) -> list[Any]:
        outs = itp.eval_jaxpr(bsub, body_jaxpr, [], [*bconsts, *carry], from_param=fp_b)
        return _cast_all(outs, dts)

    return list(lax.while_loop(cond_fun, body_fun, _cast_all(init, dts)))


def _cond_rule(ctx: CastContext, index: Any, *ops: Any, branches: Any, **params):
    del params
    fp = _from_param(ctx, 1 + len(ops))[1:]
    funs = []
    for i, br in enumerate(branches):
        sub = itp.sub_context(ctx, f"cond/branch{i}")
        funs.append(itp.jaxpr_fun(sub, br, from_param=fp))
    outs_dtypes = [_probe_out_dtypes(f, ops) for f in funs]
    target: list[Any] = []
    for j, aval in enumerate(branches[0].out_avals):
        if not is_floating(aval):
            target.append(None)
            continue
        d = outs_dtypes[0][j]
        for dts in outs_dtypes[1:]:
            d = _widest(d, dts[j])
        target.append(d)

    def make(f: Any) -> Any:
        return lambda *a: _cast_all(f(*a), target)

    if len(funs) == 1:
        return make(funs[0])(*ops)
    return list(lax.switch(index, [make(f) for f in funs], *ops))


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
    sub = itp.sub_context(ctx, "checkpoint")
    fun = itp.jaxpr_fun(sub, jaxpr, [], from_param=_from_param(ctx, len(invals)))
    return list(jax.checkpoint(fun, prevent_cse=prevent_cse, policy=policy)(*invals))


# ------------------------------------------------------------------ custom_jvp


def _zeros_like(x: Any) -> Any:
    return jnp.zeros(jnp.shape(x), dtype_of(x))


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
    consts = list(invals[:num_consts])
    args = list(invals[num_consts:])
    name = _callable_name(call_jaxpr)
    sub = itp.sub_context(ctx, f"custom_jvp({name})")
    fp = _from_param(ctx, len(invals))
    primal_fun = itp.jaxpr_fun(sub, call_jaxpr, from_param=fp)
    box: dict[str, list[Any]] = {}

    def f_primal(*xs: Any) -> list[Any]:
        outs = primal_fun(*consts, *xs)
        box["dtypes"] = [dtype_of(o) for o in outs]
        return outs

    f_primal.__name__ = name
    f = jax.custom_jvp(f_primal)

    def out_dtypes(xs: Sequence[Any]) -> list[Any]:
        if "dtypes" not in box:
            box["dtypes"] = _probe_out_dtypes(lambda *a: primal_fun(*consts, *a), xs)
        return box["dtypes"]

    @f.defjvp
    def f_jvp(primals: Sequence[Any], tangents: Sequence[Any]) -> Any:
        dts = out_dtypes(primals)
        jaxpr, jconsts, out_zeros = _compat.custom_jvp_jaxpr(
            jvp_jaxpr_fun, len(primals)
        )
        # The JVP rule is linearised and transposed by JAX: its dots must not be
        # custom_vjp functions (which cannot be transposed).
        jsub = dataclasses.replace(
            itp.sub_context(ctx, f"custom_jvp({name})/jvp"), forward_mode_ad=True
        )
        tangents = [
            rules.cast(_compat.instantiate_zeros(t), dtype_of(p))
            if is_floating(p)
            else t
            for p, t in zip(primals, tangents, strict=True)
        ]
        outs = itp.eval_jaxpr(
            jsub,
            jaxpr,
            jconsts,
            [*primals, *tangents],
            from_param=fp[num_consts:] + [False] * len(tangents),
        )
        n = len(out_zeros)
        out_p = _cast_all(outs[:n], dts)
        nz = iter(outs[n:])
        out_t = []
        for p, z in zip(out_p, out_zeros, strict=True):
            if z:
                out_t.append(_zeros_like(p) if is_floating(p) else None)
            else:
                t = next(nz)
                out_t.append(rules.cast(t, dtype_of(p)) if is_floating(p) else t)
        return out_p, [
            t if t is not None else jnp.zeros(jnp.shape(p), jax.dtypes.float0)
            for p, t in zip(out_p, out_t, strict=True)
        ]

    return list(f(*args))


def _callable_name(closed: Any) -> str:
    try:
        dbg = closed.jaxpr.debug_info
        return str(dbg.func_name).split(" ")[0] if dbg is not None else "f"
    except AttributeError:
        return "f"


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
    consts = list(invals[:num_consts])
    args = list(invals[num_consts:])
    name = _callable_name(call_jaxpr)
    sub = itp.sub_context(ctx, f"custom_vjp({name})")
    fp = _from_param(ctx, len(invals))
    primal_fun = itp.jaxpr_fun(sub, call_jaxpr, from_param=fp)
    orig_out_avals = call_jaxpr.out_avals
    arg_dtypes = [dtype_of(a) for a in args]
    box: dict[str, Any] = {}

    def f_primal(*xs: Any) -> list[Any]:
        outs = primal_fun(*consts, *xs)
        box["dtypes"] = [dtype_of(o) for o in outs]
        return outs

    f_primal.__name__ = name
    f = jax.custom_vjp(f_primal)

    def f_fwd(*xs: Any) -> Any:
        if "dtypes" not in box:
            box["dtypes"] = _probe_out_dtypes(lambda *a: primal_fun(*consts, *a), xs)
        fjaxpr, fconsts = _compat.custom_vjp_fwd_jaxpr(fwd_jaxpr_thunk, len(xs))
        fsub = itp.sub_context(ctx, f"custom_vjp({name})/fwd")
        outs = itp.eval_jaxpr(
            fsub,
            fjaxpr,
            fconsts,
            [*consts, *xs][num_consts:],
            from_param=fp[num_consts:],
        )
        _, res_tree, input_fwds = out_trees()
        num_res_out = res_tree.num_leaves - sum(i is not None for i in input_fwds)
        res_out, primals_out = outs[:num_res_out], outs[num_res_out:]
        all_in = [*consts, *xs]
        it = iter(res_out)
        res = [next(it) if i is None else all_in[i] for i in input_fwds]
        box["res_avals"] = _residual_avals(fjaxpr, call_jaxpr, input_fwds, num_res_out)
        return _cast_all(primals_out, box["dtypes"]), res

    def f_bwd(res: Any, cts: Sequence[Any]) -> tuple[Any, ...]:
        res = rules.cast_to_avals(res, box["res_avals"])
        cts = [_compat.instantiate_zeros(c) for c in cts]
        cts = rules.cast_to_avals(cts, orig_out_avals)
        bsub = itp.sub_context(ctx, f"custom_vjp({name})/bwd")
        in_avals = call_jaxpr.in_avals[num_consts:]

        def bwd_flat(*a: Any) -> list[Any]:
            outs = _compat.call_custom_vjp_bwd(bwd, *a)
            return [
                _instantiate_ct(o, av) for o, av in zip(outs, in_avals, strict=True)
            ]

        closed = _compat.trace_to_closed_jaxpr(
            bwd_flat, [_compat.get_aval(x) for x in [*res, *cts]], name="bwd"
        )
        outs = itp.eval_jaxpr(bsub, closed, [], [*res, *cts])
        result = []
        for o, d, av in zip(outs, arg_dtypes, in_avals, strict=True):
            result.append(rules.cast(o, d) if is_floating(av) else None)
        return tuple(result)

    f.defvjp(f_fwd, f_bwd)
    return list(f(*args))


def _instantiate_ct(ct: Any, aval: Any) -> Any:
    if _compat.is_symbolic_zero(ct) or ct is None:
        if is_floating(aval):
            return jnp.zeros(aval.shape, aval.dtype)
        return jnp.zeros((), jnp.int32)
    if not is_floating(aval):
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
    sub = itp.sub_context(ctx, "shard_map")
    fun = itp.jaxpr_fun(sub, jaxpr, [], from_param=_from_param(ctx, len(invals)))

    def body(*xs: Any) -> tuple[Any, ...]:
        return tuple(fun(*xs))

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
    return list(sm(*invals))


_register_hop(P.jit_p, _jit_rule)
_register_hop(P.closed_call_p, _closed_call_rule)
_register_hop(P.scan_p, _scan_rule)
_register_hop(P.while_p, _while_rule)
_register_hop(P.cond_p, _cond_rule)
_register_hop(P.remat_p, _remat_rule)
_register_hop(P.custom_jvp_call_p, _custom_jvp_rule)
_register_hop(P.custom_vjp_call_p, _custom_vjp_rule)
_register_hop(_compat.shard_map_p, _shard_map_rule)
