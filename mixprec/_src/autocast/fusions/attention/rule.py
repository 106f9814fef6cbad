"""The op of a recognised attention: its table entry, its rule, and its
formulation per platform.

The rewrite pass (:func:`.pattern.rewrite`) puts one equation of
:data:`.pattern.ATTENTION_P` in place of a written-out attention
(``part="forward"``) and, in a differentiated program, another in place of
its proven backward pass (``part="backward"``).
:func:`~mixprec._src.autocast.decide.decide_fusion` decides each like any op;
this rule runs it:

* **not fused** (the decision is ``HIGHER_ORDER``): the equations it replaced
  run in its place, walked as if they had never been taken out (the same
  facts, each decided and reported on its own);
* **fused**: per platform (:func:`~mixprec._src.autocast.platforms.per_platform`),
  on **cuda** ``jax.nn.dot_product_attention(..., implementation="cudnn")`` on
  16-bit queries, keys and values (cuDNN's flash attention keeps its softmax
  statistics in float32 and has its own derivative; a constant causal
  ``tril`` becomes ``is_causal=True``, other masks and biases are passed as
  they are); on **every other platform** its equations one by one (the same
  bits as without the rewrite). JAX asks cuDNN for its version when it traces
  the call; where that fails (no cuDNN on the host that traces, or shapes
  cuDNN refuses, such as a head dimension that is not a multiple of 8) the
  cuda branch keeps the other platforms' formulation.

In a whole train step the forward's cuda formulation keeps the fused
kernel's residuals for its derivative, and the other formulation the values
its backward equations read; the backward pass finds them in the jaxpr's
facts (``facts.fused``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mixprec._src import _compat
from mixprec._src.autocast import interpreter as itp, jaxprs
from mixprec._src.autocast.avals import aval_shape
from mixprec._src.autocast.decide import HIGHER_ORDER
from mixprec._src.autocast.fusions.attention.pattern import (
    Match,
    canonical_layout,
    step_out_labels,
)
from mixprec._src.autocast.operands import CastContext, saturate_mask
from mixprec._src.autocast.platforms import per_platform


__all__ = ["attention_rule", "fused", "residual_shapes"]

# What the cuda formulation asks `jax.nn.dot_product_attention` for (tests
# run the fused formulation on a CPU with "xla").
_IMPLEMENTATION: Any = "cudnn"


def _qkv(
    x: Any, spec: tuple[int, tuple[int, ...], int, int], batch: Sequence[int], low: Any
) -> Any:
    """Queries, keys or values as ``[B, T, N, H]`` in ``low``."""
    _, bdims, seq, head = spec
    units = [d for d in range(x.ndim) if d not in (*bdims, seq, head)]
    perm = [*bdims[:-1], seq, bdims[-1], head, *units]
    y = jnp.transpose(x, perm).astype(low)
    b = math.prod(batch[:-1])
    return y.reshape((b, x.shape[seq], batch[-1], x.shape[head]))


def fused(m: Match, values: Sequence[Any], low: Any, out_shape: Sequence[int]) -> Any:
    """The attention of ``m`` by ``jax.nn.dot_product_attention(...,
    implementation="cudnn")`` on 16-bit operands, in the layout of the
    region's result (in ``low``).

    Raises:
        Exception: whatever JAX raises when cuDNN is missing or refuses the
            shapes (the caller keeps the unfused formulation).
    """
    q = _qkv(values[m.q[0]], m.q, m.batch, low)
    k = _qkv(values[m.k[0]], m.k, m.batch, low)
    v = _qkv(values[m.v[0]], m.v, m.batch, low)
    mask = bias = None
    env = dict(zip(m.inputs, values, strict=True))
    for s in m.steps:
        args = [
            jnp.zeros(aval_shape(u), jnp.float32)
            if j == s.operand
            else jaxprs.read(env, u)
            for j, u in enumerate(s.eqn.invars)
        ]
        res = jaxprs.bind_as_written(s.eqn, args)[0]
        labels = step_out_labels(s)
        if s.kind == "mask":
            one = canonical_layout(res == 0, labels, m.batch, m.query)
            mask = one if mask is None else mask & one
        else:
            one = canonical_layout(res * s.factor, labels, m.batch, m.query)
            bias = one if bias is None else bias + one
    out = jax.nn.dot_product_attention(
        q,
        k,
        v,
        bias=None if bias is None else itp.cast(saturate_mask(bias, low), low),
        mask=mask,
        scale=m.scale,
        is_causal=m.causal,
        implementation=_IMPLEMENTATION,
    )
    # [B, T, N, H] back to the result's layout.
    nb = len(m.batch)
    out = out.reshape((*m.batch[:-1], out.shape[1], m.batch[-1], out.shape[3]))
    here = [("b", i) for i in range(nb - 1)] + ["T", ("b", nb - 1), "H"]
    want = [lab for lab in m.out_labels if lab is not None]
    out = jnp.transpose(out, [here.index(lab) for lab in want])
    return out.reshape(tuple(out_shape))


def attention_rule(ctx: CastContext, *invals: Any, **params: Any) -> list[Any]:
    """The rule of :data:`.pattern.ATTENTION_P` (its entry: :mod:`.entry`)."""
    part: str = params["part"]
    m: Match = params["fusion"]
    bwd = m.backward
    if ctx.decision is HIGHER_ORDER:
        # Not fused: the equations it replaced, in its place.
        eqns, outvars = (
            (m.eqns, m.outvars)
            if part == "forward"
            else ((bwd.eqns, bwd.outvars) if bwd is not None else ((), ()))
        )
        outs, marks = itp.run_inline(
            ctx.walk, eqns, ctx.eqn.invars, invals, ctx.marks, outvars
        )
        if part == "forward" and m.residuals is not None:
            # (The fused kernel's residual slots of a scan pair: never read.)
            outs = [*outs, *_zeros(m.residuals)]
            marks = [*marks, *[0] * len(m.residuals)]
        ctx.out_marks[:] = marks
        return outs
    if part == "forward":
        return _forward(ctx, m, list(invals))
    return _backward(ctx, m, list(invals))


def _shapes(fn: Any, values: Sequence[Any]) -> Any:
    """What ``fn`` returns on ``values`` as shapes, or ``None`` where JAX
    refuses the fused call when it traces it: ``RuntimeError`` when no cuDNN
    is detected, ``ValueError`` / ``NotImplementedError`` for shapes, dtypes
    or layouts cuDNN does not take. Any other error is a bug and raises."""
    if _IMPLEMENTATION == "cudnn" and not _compat.cudnn_detected():
        return None
    try:
        return jax.eval_shape(fn, *values)
    except (RuntimeError, ValueError, NotImplementedError):
        return None


def _zeros(shapes: Any) -> list[Any]:
    return [jnp.zeros(x.shape, x.dtype) for x in shapes]


def _formulation_walk(ctx: CastContext) -> itp.Walk:
    """The walk of a formulation's equations: no observer (the fused op is
    reported once), facts of its own (what a platform branch learns stays in
    it) that know the constants the walk knows (each equation decided as it
    is in place: the same bits as without the rewrite)."""
    return ctx.walk.probe().over(ctx.walk.facts.of_constants())


def _with_vjp(
    m: Match, vals: Sequence[Any], low: Any, out_shape: Sequence[int]
) -> tuple[Any, Any]:
    """The fused attention of ``m`` on ``vals`` and its ``vjp`` in the
    queries, keys and values."""
    slots = [spec[0] for spec in (m.q, m.k, m.v)]

    def of(qkv: Any) -> Any:
        full = list(vals)
        for pos, x in zip(slots, qkv, strict=True):
            full[pos] = x
        return fused(m, full, low, out_shape)

    # (Its operands are cast here; what JAX's implementation mixes inside is
    # not the user's code.)
    with jax.numpy_dtype_promotion("standard"):
        return jax.vjp(of, tuple(itp.cast(vals[pos], low) for pos in slots))


def residual_shapes(m: Match, low: Any) -> list[Any] | None:
    """The shapes of the fused kernel's residuals (what its derivative reads)
    for ``m`` in ``low``, or ``None`` where the fused call is refused when
    traced (see :func:`_shapes`)."""
    out_shape = aval_shape(m.eqn.outvars[0])
    avals = [jax.ShapeDtypeStruct(aval_shape(v), v.aval.dtype) for v in m.inputs]
    return _shapes(
        lambda *vals: jax.tree.leaves(_with_vjp(m, vals, low, out_shape)[1]), avals
    )


def _forward(ctx: CastContext, m: Match, values: list[Any]) -> list[Any]:
    decision = ctx.decision
    low = np.dtype(decision.dtype)
    plain = _formulation_walk(ctx)
    out_var = m.outvars[0]
    out_shape = aval_shape(out_var)
    marks = list(ctx.marks)
    platform = ctx.config.platform

    def unfused_values(*vals: Any) -> tuple[list[Any], list[int]]:
        return itp.run_inline(plain, m.eqns, m.inputs, vals, marks, m.outvars)

    if m.backward is None:

        def unfused(*vals: Any) -> Any:
            return itp.cast(unfused_values(*vals)[0][0], low)

        def cudnn(*vals: Any) -> Any:
            return fused(m, vals, low, out_shape)

        if _shapes(cudnn, values) is not None:
            out = per_platform(
                tuple(values), platform=platform, default=unfused, cuda=cudnn
            )
        else:  # every platform runs the equations
            out = unfused(*values)
        ctx.out_marks[:] = [0]
        return [out]
    # The cuda formulation keeps the fused kernel's residuals for its
    # derivative, the other the values its backward equations read; each
    # returns zeros in place of the other's (never read: a lowering keeps one
    # platform's formulation of both passes).

    def with_vjp(*vals: Any) -> tuple[Any, Any]:
        return _with_vjp(m, vals, low, out_shape)

    found: dict[str, Any] = {}

    def residuals_of(*vals: Any) -> Any:
        leaves, found["tree"] = jax.tree.flatten(with_vjp(*vals)[1])
        return leaves

    def kept_of(*vals: Any) -> Any:
        kept, found["marks"] = unfused_values(*vals)
        return kept

    res_shapes = _shapes(residuals_of, values)
    # Across a scan pair the residuals are results of this equation, in the
    # slots its rewrite made for them (:mod:`.scan_pair`).
    res_slots = m.residuals
    if res_shapes is not None and res_slots is not None:
        if [x.shape for x in res_shapes] != [x.shape for x in res_slots]:
            res_shapes = None
    if res_shapes is None:  # every platform runs the equations
        kept, kept_marks = unfused_values(*values)
        ctx.walk.facts.fused[m] = (None, [], low)
        ctx.out_marks[:] = [0, *kept_marks[1:], *[0] * len(res_slots or ())]
        return [itp.cast(kept[0], low), *kept[1:], *_zeros(res_slots or ())]
    kept_shapes = jax.eval_shape(kept_of, *values)
    res_tree, kept_marks = found.get("tree"), found["marks"]
    zeros = _zeros

    def unfused_fwd(*vals: Any) -> Any:
        kept = unfused_values(*vals)[0]
        return (itp.cast(kept[0], low), *kept[1:], *zeros(res_shapes))

    def cudnn_fwd(*vals: Any) -> Any:
        out, vjp = with_vjp(*vals)
        return (out, *zeros(kept_shapes[1:]), *jax.tree.leaves(vjp))

    outs = per_platform(
        tuple(values), platform=platform, default=unfused_fwd, cuda=cudnn_fwd
    )
    n = len(m.outvars)
    if res_slots is not None:
        ctx.walk.facts.fused[m] = (res_tree, [], low)
        ctx.out_marks[:] = [0, *kept_marks[1:], *[0] * len(res_slots)]
        return list(outs)
    ctx.walk.facts.fused[m] = (res_tree, list(outs[n:]), low)
    ctx.out_marks[:] = [0, *kept_marks[1:]]
    return list(outs[:n])


def _backward(ctx: CastContext, m: Match, reads: list[Any]) -> list[Any]:
    """The backward pass of a fused attention: on cuda the fused kernel's
    derivative, elsewhere its equations one by one."""
    bwd = m.backward
    assert bwd is not None
    res_tree, residuals, _ = ctx.walk.facts.fused[m]
    if m.residuals is not None:  # a scan pair's: its last operands
        reads, residuals = reads[: len(bwd.reads)], reads[len(bwd.reads) :]
    low = np.dtype(ctx.decision.dtype)
    plain = _formulation_walk(ctx)
    read_marks = list(ctx.marks)[: len(bwd.reads)]
    found: dict[str, Any] = {}

    def unfused(*vals: Any) -> list[Any]:
        outs, found["marks"] = itp.run_inline(
            plain, bwd.eqns, bwd.reads, vals[: len(reads)], read_marks, bwd.outvars
        )
        return outs

    if res_tree is None:  # its forward ran the equations on every platform
        outs = unfused(*reads)
        ctx.out_marks[:] = found["marks"]
        return list(outs)
    shapes = jax.eval_shape(unfused, *reads, *residuals)

    def cudnn(*vals: Any) -> list[Any]:
        vjp = jax.tree.unflatten(res_tree, vals[len(reads) :])
        with jax.numpy_dtype_promotion("standard"):
            (cts,) = vjp(itp.cast(vals[0], low))
        computed = [c for c, g in zip(cts, bwd.grads, strict=True) if g is not None]
        return [itp.cast(c, s.dtype) for c, s in zip(computed, shapes, strict=True)]

    outs = per_platform(
        (*reads, *residuals),
        platform=ctx.config.platform,
        default=unfused,
        cuda=cudnn,
    )
    ctx.out_marks[:] = found["marks"]
    return list(outs)
