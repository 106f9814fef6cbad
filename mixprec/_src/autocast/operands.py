"""Casting an equation's operands and results as its decision says.

What every rule shares to carry out a
:class:`~mixprec._src.autocast.decide.Decision`: :func:`cast` (one value,
optionally saturating to the target's finite range), :func:`cast_operands`
(an equation's floating operands: constants of fill ops and values made from
a constant beyond the low range saturate, broadcast operands are broadcast
first so their gradient is summed wide), :func:`default_rule` (cast, bind,
round), :func:`run_own` (the float32 ops autocast adds to a program by
itself, reported to the observer) and :func:`ran_with` (the dtypes an
equation's operands ran in, for reports).

Examples:
    >>> import numpy as np
    >>> float(cast(np.float32(1e6), np.float16, saturate=True))  # not inf
    65504.0
"""

from __future__ import annotations

import dataclasses
import functools as ft
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import ClosedJaxpr, JaxprEqn, Literal

from mixprec._src import _compat
from mixprec._src.autocast import jaxprs, ops
from mixprec._src.autocast.avals import aval_dtype, aval_shape, float_dtype, same_shape
from mixprec._src.autocast.config import CastConfig
from mixprec._src.autocast.decide import BIG, CONST, Decision, Precision, follows
from mixprec._src.autocast.walk import Walk


__all__ = [
    "CastContext",
    "bind",
    "cast",
    "cast_operands",
    "clip_to_range",
    "default_rule",
    "ran_with",
    "run_own",
    "saturate_mask",
]

_F32 = np.dtype(np.float32)


def clip_to_range(x: Any, dtype: Any) -> Any:
    """``x`` (same dtype) with finite values clipped to ``dtype``'s finite range;
    infinities and NaNs are kept."""
    big = float(jnp.finfo(dtype).max)
    if isinstance(x, np.ndarray | np.generic | float):
        arr = np.asarray(x)
        return np.where(np.isfinite(arr), np.clip(arr, -big, big), arr).astype(
            arr.dtype
        )
    return jnp.where(jnp.isinf(x), x, jnp.clip(x, -big, big))


def saturate_mask(x: Any, dtype: Any) -> Any:
    """``x`` (same dtype) with values beyond ``dtype``'s range replaced by
    half ``dtype``'s largest value, with their sign: a mask bias
    (``finfo(float32).min``, ``-1e9``, ``-inf``) cast down to ``dtype`` stays
    finite, weighs 0 in a softmax, and a score within range added to it does
    not overflow. Values within range (NaN too) are kept as they are.

    Examples:
        >>> import numpy as np
        >>> saturate_mask(np.float32([-3e38, -7.0, np.inf]), np.float16).tolist()
        [-32752.0, -7.0, 32752.0]
    """
    big = float(jnp.finfo(dtype).max)
    half = big / 2
    if isinstance(x, np.ndarray | np.generic | float):
        arr = np.asarray(x)
        out = np.where(arr > big, half, np.where(arr < -big, -half, arr))
        return out.astype(arr.dtype)
    # Four ops with scalar bounds (lax, not jnp.where, whose nested jits
    # would be reported as one op).
    dt = np.dtype(x.dtype)
    beyond = lax.gt(lax.abs(x), np.asarray(big, dt))
    halved = lax.clamp(np.asarray(-half, dt), x, np.asarray(half, dt))
    return lax.select(beyond, halved, x)


def cast(x: Any, dtype: Any, *, saturate: bool = False) -> Any:
    """Casts one floating value to ``dtype`` (no-op if it already has it).

    NumPy values (the values of jaxpr ``Literal`` s) stay NumPy, so that they are
    staged out as literals rather than as a ``convert_element_type``. With
    ``saturate``, finite values beyond ``dtype``'s range become its largest
    finite value instead of ``inf``.
    """
    dtype = np.dtype(dtype)
    dt = float_dtype(x)
    if dt is None or dt == dtype:
        return x
    if saturate and dtype.itemsize < dt.itemsize:
        x = clip_to_range(x, dtype)
    if isinstance(x, np.ndarray | np.generic | float):
        return np.asarray(x, dtype=dtype)
    return _compat.call_transformed(("cast", dtype), _converter(dtype), [x])


@ft.lru_cache(maxsize=64)
def _converter(dtype: np.dtype) -> Any:
    return ft.partial(lax.convert_element_type, new_dtype=dtype)


@dataclasses.dataclass(frozen=True)
class CastContext:
    """What a cast rule receives about the equation it runs.

    A rule is called as ``rule(ctx, *invals, **params)`` with the values the
    equation receives (possibly already in a low dtype) and the equation's
    params, and returns the output (a list for primitives with several
    results). ``ctx.decision`` says what to cast the floating operands to;
    :meth:`cast_operands` applies it the way the built-in rules do.

    Attributes:
        config: the transform's :class:`~mixprec._src.autocast.config.CastConfig`.
        eqn: the equation being run.
        decision: its :class:`~mixprec._src.autocast.decide.Decision`.
        walk: where the interpreter is (higher-order rules recurse with it).
        marks: per operand, the interpreter's marks (``FOLLOWS``, ``CONST``).
        out_marks: higher-order rules may fill in the marks of their results.
        epilogue: the equation is a bias add run as the epilogue of the
            matmul before it
            (:func:`~mixprec._src.autocast.decide.decide_epilogue`): it runs
            through the default rule on that matmul's float32 product.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> import mixprec
        >>> from jax.extend.core import Primitive
        >>> triple_p = Primitive("triple")
        >>> triple_p.def_impl(lambda x: 3 * x)
        <function <lambda> ...>
        >>> triple_p.def_abstract_eval(lambda x: x)
        <function <lambda> ...>
        >>> @mixprec.register_rule(triple_p)
        ... def _triple_rule(ctx, x):
        ...     return triple_p.bind(*ctx.cast_operands([x]))
        >>> f = mixprec.autocast(lambda x: triple_p.bind(x @ x), "mixed_bfloat16")
        >>> jaxpr = jax.make_jaxpr(f)(jnp.ones((2, 2)))
        >>> [str(e.outvars[0].aval.dtype)
        ...  for e in jaxpr.eqns if e.primitive is triple_p]
        ['bfloat16']
    """

    config: CastConfig
    eqn: JaxprEqn
    decision: Decision
    walk: Walk
    marks: Sequence[int]
    out_marks: list[int]
    epilogue: bool = False

    @property
    def policy(self) -> Any:
        """The policy in effect."""
        return self.config.policy

    @property
    def low_dtype(self) -> np.dtype:
        """The dtype allow-list ops run in."""
        return self.config.low_dtype

    @property
    def platform(self) -> str | None:
        """The platform dots are formulated for, or ``None``: each platform's,
        chosen when the computation is lowered."""
        return self.config.platform

    def cast_operands(self, invals: Sequence[Any]) -> list[Any]:
        """The operands cast as the decision says (see :func:`cast_operands`)."""
        return cast_operands(self, invals)


def cast_operands(ctx: CastContext, invals: Sequence[Any]) -> list[Any]:
    """Casts the floating operands of ``ctx.eqn`` as ``ctx.decision`` says.

    ``ORIGINAL`` casts them back to the dtypes they were traced with; a
    decision dtype casts them to it. Casting down, a constant of a fill op
    (:data:`~mixprec._src.autocast.ops.FILL`: ``where``, ``max``...) and a
    value made from a constant beyond the low range
    (:data:`~mixprec._src.autocast.decide.BIG`: a mask bias) saturate, any
    other constant is cast as it is (beyond the low range: inf, visible), and
    an operand of an elementwise op that is broadcast into the result is
    broadcast first, so that the transpose (its gradient) sums in the wider
    dtype.
    """
    d = ctx.decision
    eqn = ctx.eqn
    if d.precision is Precision.ORIGINAL:
        return [
            cast(x, aval_dtype(v)) if float_dtype(x) is not None else x
            for x, v in zip(invals, eqn.invars, strict=True)
        ]
    if d.dtype is None:
        return list(invals)
    # A rule that does not know float8 runs a float8 decision in the low dtype.
    target = ctx.config.low_dtype if d.precision is Precision.FLOAT8 else d.dtype
    out_shape = aval_shape(eqn.outvars[0]) if eqn.outvars else ()
    spec = ops.spec_for(eqn.primitive.name)
    elementwise = spec is not None and ops.BROADCASTS in spec.flags
    fill = spec is not None and ops.FILL in spec.flags
    # The dtype the result is rounded to (a bias add run as a CPU dot's epilogue
    # float32 product adds in float32 and rounds once).
    result = np.dtype(d.out_dtype) if d.out_dtype is not None else np.dtype(target)
    masks = (
        spec is not None
        and ops.ADDITIVE in spec.flags
        and not ctx.walk.backward
        and result.itemsize < 4
    )
    out = []
    for x, v, m in zip(invals, eqn.invars, ctx.marks, strict=True):
        dt = float_dtype(x)
        if (
            masks
            and dt is not None
            and dt.itemsize > result.itemsize
            and follows(v, m, out_shape)
        ):
            # A bias beyond the low range is a mask bias, whatever its origin.
            x = _saturate_mask(ctx.walk, eqn, v, x, result)
        if dt is None or dt == target:
            out.append(x)
            continue
        narrowing = target.itemsize < dt.itemsize
        if narrowing and (m & CONST and fill or m & BIG):
            # A fill or a bound (`finfo(float32).min` in a `where`), or a mask
            # bias made from one: saturate it; cast it where it is (a mask
            # bias has no gradient).
            x = _saturate_constant(ctx.walk, eqn, v, x, target)
        elif narrowing and m & CONST:
            pass  # cast where it is: beyond the low range it becomes inf
        elif narrowing and elementwise and not same_shape(aval_shape(v), out_shape):
            # Broadcast first: the transpose then sums the gradient in `dt`.
            x = _broadcast_to(x, out_shape)
        out.append(cast(x, target))
    return out


def _saturate_constant(
    walk: Walk, eqn: JaxprEqn, var: Any, x: Any, dtype: np.dtype
) -> Any:
    """A constant (or a value made from one, ``BIG``) about to be cast to
    ``dtype`` with its finite values clipped to ``dtype``'s range
    (``finfo(float32).min`` must not become ``-inf``)."""
    if isinstance(var, Literal) or isinstance(x, np.ndarray | np.generic | float):
        return clip_to_range(x, dtype)  # clipped in NumPy: no op in the program
    big = float(jnp.finfo(dtype).max)
    known = walk.facts.scalars.get(var)
    if known is not None:
        value = float(known)
        if not np.isfinite(value) or abs(value) <= big:
            return x
        return lax.full(np.shape(x), np.copysign(big, value), x.dtype)
    fits = walk.facts.ranges.get(var)
    if fits is not None and fits[0] <= big:
        return x  # every finite value fits: the cast keeps it
    # A value unknown while walking (too large to fold, or made where it is
    # not known): clamp it in the program, and tell the report.
    reason = (
        f"autocast's own: saturates a constant (or a mask bias made from one) to "
        f"{dtype}'s finite range before casting it down (finfo(float32).min must "
        "not become -inf)"
    )
    own = _saturation(tuple(np.shape(x)), np.dtype(x.dtype), big)
    return run_own(walk, eqn, own, x, reason=reason)


def _saturate_mask(walk: Walk, eqn: JaxprEqn, var: Any, x: Any, dtype: np.dtype) -> Any:
    """A bias about to be added to a result in ``dtype``, through
    :func:`saturate_mask` (in the program, reported to the observer) unless
    its values are known to fit."""
    big = float(jnp.finfo(dtype).max)
    if isinstance(x, np.ndarray | np.generic | float):
        return saturate_mask(x, dtype)
    fits = walk.facts.ranges.get(var)
    if fits is not None and fits[0] <= big:
        return x
    reason = (
        f"autocast's own: a bias beyond {dtype}'s range is a mask bias; it becomes "
        f"±{big / 2:.4g} (half the largest {dtype}: a score added to it cannot "
        "overflow)"
    )
    own = _mask_saturation(tuple(np.shape(x)), np.dtype(x.dtype), np.dtype(dtype))
    return run_own(walk, eqn, own, x, reason=reason)


@ft.lru_cache(maxsize=256)
def _mask_saturation(
    shape: tuple[int, ...], dtype: np.dtype, low: np.dtype
) -> ClosedJaxpr:
    return jax.make_jaxpr(ft.partial(saturate_mask, dtype=low))(
        jax.ShapeDtypeStruct(shape, dtype)
    )


@ft.lru_cache(maxsize=256)
def _saturation(shape: tuple[int, ...], dtype: np.dtype, big: float) -> ClosedJaxpr:
    def saturate(x: Any) -> Any:
        clipped = lax.clamp(np.asarray(-big, dtype), x, np.asarray(big, dtype))
        return lax.select(lax.is_finite(x), clipped, x)

    return jax.make_jaxpr(saturate)(jax.ShapeDtypeStruct(shape, dtype))


# The equations `run_own` reports, at the line of the equation they serve, by
# (that equation, own equation): one report site per pair, however often a
# loop body is walked.
_shown: dict[tuple[int, int], tuple[JaxprEqn, JaxprEqn]] = {}


def _shown_eqn(user: JaxprEqn, eqn: JaxprEqn) -> JaxprEqn:
    key = (id(user), id(eqn))
    hit = _shown.get(key)
    if hit is None or hit[0] is not user:
        if len(_shown) > 4096:
            _shown.clear()
        hit = (user, eqn.replace(source_info=user.source_info))
        _shown[key] = hit
    return hit[1]


def run_own(
    walk: Walk, user: JaxprEqn, own: ClosedJaxpr, x: Any, *, reason: str
) -> Any:
    """Runs ``own`` (one input, one output) on ``x``: float32 ops autocast adds
    to the program by itself for the equation ``user``. Each is reported to
    the observer (``explain`` records it, with ``reason``, at ``user``'s
    line), so that the report lists every op the program runs. Unobserved,
    under ``grad`` or ``jvp`` it is one cached inline ``jit``
    (:func:`~mixprec._src._compat.call_transformed`): differentiated once per
    operand type, not op by op at every layer's mask."""
    if walk.observer is None:
        [out] = _compat.call_transformed(("own", own), _own_fn(own), [x])
        return out
    env: dict[Any, Any] = {own.jaxpr.invars[0]: x}
    for eqn in own.jaxpr.eqns:
        invals = _compat.match_vma([jaxprs.read(env, v) for v in eqn.invars])
        outs = _bind_own(eqn, invals)
        env.update(zip(eqn.outvars, outs, strict=True))
        if walk.observer is None:
            continue
        spec = ops.spec_for(eqn.primitive.name)
        op_class = spec.op_class if spec is not None else None
        decision = Decision(Precision.FLOAT32, _F32, op_class, reason)
        ran = [
            np.dtype(getattr(v, "dtype", None) or np.asarray(v).dtype) for v in invals
        ]
        walk.observer.on_own(walk, _shown_eqn(user, eqn), decision, ran, invals, outs)
    [out] = [jaxprs.read(env, v) for v in own.jaxpr.outvars]
    return out


@ft.lru_cache(maxsize=256)
def _own_fn(own: ClosedJaxpr) -> Callable[[Any], list[Any]]:
    """``own`` (one input, one output) bound equation by equation."""

    def run(x: Any) -> list[Any]:
        env: dict[Any, Any] = {own.jaxpr.invars[0]: x}
        for eqn in own.jaxpr.eqns:
            invals = _compat.match_vma([jaxprs.read(env, v) for v in eqn.invars])
            env.update(zip(eqn.outvars, _bind_own(eqn, invals), strict=True))
        return [jaxprs.read(env, v) for v in own.jaxpr.outvars]

    return run


def _bind_own(eqn: JaxprEqn, invals: Sequence[Any]) -> list[Any]:
    """One equation of an own jaxpr bound on ``invals``.

    Own jaxprs are traced outside any ``shard_map``: their constants are
    replicated where ``x`` may vary over manual axes, so the operands are made
    to vary alike (:func:`~mixprec._src._compat.match_vma`, as JAX's ``lax``
    functions do), and a nested ``jit`` (``jnp.where``'s) whose body was traced
    replicated runs inline where its operands vary: bound as it is, its
    results would be typed replicated, and its transpose refuses the varying
    cotangents it then receives.
    """
    closed = eqn.params.get("jaxpr") if eqn.primitive.name in ("jit", "pjit") else None
    if closed is None and not jaxprs.has_jaxpr_params(eqn.params):
        # (Under grad or jvp through a cached inline jit, as the walk binds
        # the program's own: differentiated once per operand types, not once
        # per mask of every layer.)
        out = bind(eqn.primitive, invals, eqn.params)
        return list(out) if eqn.primitive.multiple_results else [out]
    if closed is None or not any(
        _compat.varying_axes(_compat.get_aval(x)) - _compat.varying_axes(aval)
        for x, aval in zip(invals, closed.in_avals, strict=True)
    ):
        return jaxprs.bind_as_written(eqn, invals)
    body = closed.jaxpr
    env: dict[Any, Any] = dict(zip(body.constvars, closed.consts, strict=True))
    env.update(zip(body.invars, invals, strict=True))
    for e in body.eqns:
        ins = _compat.match_vma([jaxprs.read(env, v) for v in e.invars])
        env.update(zip(e.outvars, _bind_own(e, ins), strict=True))
    return [jaxprs.read(env, v) for v in body.outvars]


def _broadcast_to(x: Any, shape: Sequence[Any]) -> Any:
    """``x`` broadcast to ``shape`` as an elementwise op would (scalars and
    size-1 dimensions)."""
    xs = np.shape(x)
    if len(xs) == 0:
        return lax.broadcast_in_dim(x, tuple(shape), ())
    if len(xs) == len(shape):
        return lax.broadcast_in_dim(x, tuple(shape), tuple(range(len(shape))))
    return x


def ran_with(decision: Decision, eqn: JaxprEqn, invals: Sequence[Any]) -> list[Any]:
    """The dtypes the operands of ``eqn`` run in under ``decision``."""
    out = []
    formats = decision.operand_dtypes or ()
    for i, (x, v) in enumerate(zip(invals, eqn.invars, strict=True)):
        dt = float_dtype(x)
        if dt is None:
            out.append(getattr(x, "dtype", None) or np.asarray(x).dtype)
        elif i < len(formats):
            out.append(formats[i])
        elif decision.precision is Precision.ORIGINAL:
            out.append(np.dtype(aval_dtype(v)))
        elif decision.dtype is not None:
            out.append(decision.dtype)
        else:
            out.append(dt)
    return out


def bind(
    prim: Any, invals: Sequence[Any], params: dict[str, Any], *, effects: bool = False
) -> Any:
    """``prim.bind(*invals, **params)`` with dtype-valued params canonicalised;
    without ``effects``, under ``grad``, ``jvp`` or ``vmap`` through a cached
    inline ``jit`` (:func:`~mixprec._src._compat.bind_transformed`)."""
    params = _canonical_params(params)
    if effects:
        return prim.bind(*invals, **params)
    return _compat.bind_transformed(prim, invals, params)


def _canonical_params(params: dict[str, Any]) -> dict[str, Any]:
    out = dict(params)
    for k in ("new_dtype", "preferred_element_type", "dtype"):
        v = out.get(k)
        if v is not None:
            try:
                out[k] = jnp.dtype(v)
            except TypeError:
                pass
    return out


def run_default(ctx: CastContext, invals: Sequence[Any]) -> list[Any]:
    """:func:`default_rule` for ``ctx.eqn`` with its own parameters: an
    equation whose operands the decision leaves as traced, and whose result
    it does not round, is recorded as written, not bound again."""
    eqn = ctx.eqn
    operands = cast_operands(ctx, invals)
    if ctx.decision.out_dtype is None:
        outs = _compat.emit_as_written(eqn, operands)
        if outs is not None:
            return outs
    out = _bind_and_round(eqn.primitive, ctx, operands, eqn.params)
    return list(out) if eqn.primitive.multiple_results else [out]


def default_rule(prim: Any, ctx: CastContext, *invals: Any, **params: Any) -> Any:
    """The rule for ops without their own: cast the operands as decided, bind
    the primitive, and round the result if the decision says so."""
    return _bind_and_round(prim, ctx, cast_operands(ctx, invals), params)


def _bind_and_round(
    prim: Any, ctx: CastContext, operands: Sequence[Any], params: dict[str, Any]
) -> Any:
    out = bind(prim, operands, params, effects=bool(ctx.eqn.effects))
    out_dtype = ctx.decision.out_dtype
    if out_dtype is None:
        return out
    if prim.multiple_results:
        return [cast(o, out_dtype) for o in out]
    return cast(out, out_dtype)
