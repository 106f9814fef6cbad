"""The autocast interpreter: one walk over a jaxpr for autocast, explain and diagnose.

:func:`eval_jaxpr` walks a jaxpr like ``jax.core.eval_jaxpr`` (literals read
directly, ``zip(strict=True)``, each equation under its user source context and
``eqn.ctx.manager``). For each equation it:

1. finds the op's entry in the op table (:mod:`~mixprec._src.autocast.ops`);
2. for a higher-order primitive, hands the equation to its rule, which walks the
   body with this same interpreter (or, if the observer runs higher-order
   equations itself, to the observer);
3. otherwise asks :mod:`~mixprec._src.autocast.decide` for the precision, once,
   and runs the op's rule with that :class:`~mixprec._src.autocast.decide.Decision`;
4. tells the observer, if there is one, what ran.

Three clients share the walk, through the same front door
(:mod:`~mixprec._src.autocast.api`). :func:`mixprec.autocast` stages the result
out. ``mixprec.explain`` adds an observer that records each decision while the
transformed jaxpr is traced. ``mixprec.diagnose`` walks concrete values with an
observer that also runs each equation as written (the float32 reference) and
steps loops and branches itself (:mod:`mixprec._src.numerics.diagnose`).

The interpreter decides nothing: dtypes are chosen in
:mod:`~mixprec._src.autocast.decide`, which also says how the marks of each value
(``FOLLOWS``, ``STAT``, ``CONST``, ``GRAD``) propagate.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools as ft
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import source_info_util as siu
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal

from mixprec._src import _compat
from mixprec._src.autocast import attention, ops, regions
from mixprec._src.autocast.avals import aval_dtype, aval_shape, float_dtype, same_shape
from mixprec._src.autocast.config import CastConfig
from mixprec._src.autocast.decide import (
    BIG,
    CONST,
    FOLLOWS,
    GRAD,
    HIGHER_ORDER,
    INPUT,
    STAT,
    Decision,
    Precision,
    decide_attention,
    decide_epilogue,
    decide_eqn,
    literal_mark,
    out_marks,
)
from mixprec._src.autocast.platforms import per_platform


__all__ = [
    "CONST",
    "FOLLOWS",
    "GRAD",
    "INPUT",
    "STAT",
    "CastContext",
    "Observer",
    "Walk",
    "eval_jaxpr",
]

# Equations created by mixprec point at the user code that caused them.
siu.register_exclusion(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))

_F32 = np.dtype(np.float32)


class Observer(Protocol):
    """What ``explain`` and ``diagnose`` plug into the walk."""

    def on_eqn(
        self,
        walk: Walk,
        eqn: JaxprEqn,
        decision: Decision,
        ran_with: Sequence[Any],
        invals: Sequence[Any],
        outs: Sequence[Any],
        rerun: Callable[[Sequence[Any]], list[Any]],
    ) -> None:
        """Called after a first-order equation ran, with its operands and
        results; ``rerun(values)`` runs the equation again, with the same
        decision, on other operands."""

    def on_note(self, walk: Walk, eqn: JaxprEqn, text: str) -> None:
        """Called with something a report should say about ``eqn``."""

    def on_own(
        self,
        walk: Walk,
        eqn: JaxprEqn,
        decision: Decision,
        ran_with: Sequence[Any],
        invals: Sequence[Any],
        outs: Sequence[Any],
    ) -> None:
        """Called for an op autocast adds to the program by itself (not an
        equation of the walked jaxpr: its operands are not the walk's values),
        after it ran (see :func:`run_own`)."""

    def run_higher_order(self, ctx: CastContext, invals: Sequence[Any]) -> Any:
        """Runs a higher-order equation in place of its rule, or returns
        ``NotImplemented`` to let the rule run it (``diagnose`` steps loops
        and takes branches on concrete values here)."""


# ------------------------------------------------------------------ the walk


class Walk:
    """Where the interpreter is: configuration, region, path, observer.

    A new ``Walk`` is made for each body the interpreter enters (cheap: plain
    slots, no copying of the configuration).
    """

    __slots__ = (
        "backward",
        "casts",
        "composite",
        "config",
        "current",
        "float32",
        "float32_lines",
        "observer",
        "parent_source",
        "partners",
        "path",
        "producers",
        "values",
        "ranges",
        "scalars",
        "scope",
        "trip",
        "wide",
    )

    def __init__(
        self,
        config: CastConfig,
        *,
        observer: Observer | None = None,
        path: str = "",
        trip: int = 1,
        float32: bool = False,
        composite: str = "",
        backward: bool = False,
        parent_source: str = "",
        scope: str = "",
        float32_lines: frozenset[tuple[str, int]] = frozenset(),
    ) -> None:
        self.config = config
        self.observer = observer
        self.path = path
        self.trip = trip
        self.float32 = float32
        self.composite = composite
        self.backward = backward
        # The user source line of the higher-order equation around this body
        # (for equations without one of their own), and the equation being run.
        self.parent_source = parent_source
        # The name stack of the higher-order equations around this body (the
        # name stacks of a body's equations start afresh).
        self.scope = scope
        # User source lines treated as if wrapped in `float32_scope` (what
        # `diagnose` checks its advice with): an equation traced while one of
        # them ran is in a float32 region.
        self.float32_lines = float32_lines
        self.current: JaxprEqn | None = None
        # Float32 products of this jaxpr's CPU dots, by the dot's outvar, for
        # a bias add that follows (see `decide.decide_epilogue`).
        self.wide: dict[Any, Any] = {}
        # The value of constants that are a scalar broadcast, reshaped or
        # converted (`jnp.full(shape, finfo.min)`), by outvar: a cast of one
        # saturates that scalar instead of emitting a clamp.
        self.scalars: dict[Any, Any] = {}
        # Per operand of a forward product of this jaxpr, the dtype the other
        # operand ran in: a backward product whose residual is that operand
        # computes the other one's gradient (see `decide.decide_eqn`).
        self.partners: dict[Any, np.dtype] = {}
        # The equation that computed each variable of the jaxpr being walked
        # (for `decide.same_value`: a value computed twice is still one value).
        self.producers: dict[Any, JaxprEqn] = {}
        # Per constant whose value is known when the jaxpr is walked (a
        # closed-over array, or computed from literals and those), its
        # (largest finite, smallest non-zero) magnitude; and the values of the
        # small ones, to compute the constants made from them.
        self.ranges: dict[Any, tuple[float, float]] = {}
        self.values: dict[Any, Any] = {}
        # Inputs of the function rounded for a product, by (id, dtype): one
        # rounding per parameter, shared by its forward and backward products,
        # so a sharded parameter is gathered once per step. The input is kept
        # beside its rounding, so that its id stays its own.
        self.casts: dict[tuple[int, Any], tuple[Any, Any]] = {}

    def constant_range(self, var: Any) -> tuple[float, float] | None:
        """``(largest finite, smallest non-zero)`` magnitude of a constant
        whose value is known (a literal, a closed-over array, a constant
        computed from those), or ``None``."""
        if type(var) is Literal:
            return value_range(var.val)
        known = self.scalars.get(var)
        if known is not None:
            return value_range(known)
        return self.ranges.get(var)

    def producer(self, var: Any) -> JaxprEqn | None:
        """The equation that computed ``var`` in the jaxpr being walked."""
        return self.producers.get(var)

    def _copy(self, **changes: Any) -> Walk:
        kw = {
            "observer": self.observer,
            "path": self.path,
            "trip": self.trip,
            "float32": self.float32,
            "composite": self.composite,
            "backward": self.backward,
            "parent_source": self.parent_source,
            "scope": self.scope,
            "float32_lines": self.float32_lines,
        }
        config = changes.pop("config", self.config)
        kw.update(changes)
        return Walk(config, **kw)

    def body(self, label: str, *, trip: int = 1, composite: str | None = None) -> Walk:
        """The walk for the body ``label`` of a higher-order equation."""
        path = f"{self.path}/{label}" if self.path else label
        changes: dict[str, Any] = {"path": path, "trip": self.trip * _trip(trip)}
        if self.observer is not None and self.current is not None:
            here = _compat.eqn_source_summary(self.current.source_info)
            changes["parent_source"] = here or self.parent_source
            stack = _compat.eqn_name_stack(self.current.source_info)
            if stack:
                changes["scope"] = f"{self.scope}/{stack}" if self.scope else stack
        if composite is not None and not self.float32:
            changes["composite"] = composite
        return self._copy(**changes)

    def with_float32_lines(self, lines: frozenset[tuple[str, int]]) -> Walk:
        """This walk with the user source ``lines`` (``(file, line)``) treated
        as if wrapped in :func:`~mixprec._src.autocast.regions.float32_scope`."""
        return self._copy(float32_lines=frozenset(lines))

    def probe(self) -> Walk:
        """A walk that observes nothing (a body traced only for its types)."""
        return self._copy(observer=None)

    @property
    def key(self) -> tuple[Any, ...]:
        """What decides how a body is transformed (for caches)."""
        return (
            self.config,
            self.float32,
            self.composite,
            self.backward,
            self.float32_lines,
        )

    def in_region(self, region: tuple[str, Any] | None) -> Walk:
        """This walk inside a region (:mod:`~mixprec._src.autocast.regions`):
        ``float32_scope``, ``precision_scope`` or a nested autocast."""
        if region is None:
            return self
        kind, value = region
        if kind == "float32":
            return self._copy(float32=True, composite="")
        if kind == "policy":
            return self._copy(
                config=self.config.with_policy(value), float32=False, composite=""
            )
        return self._copy(config=value, float32=False, composite="")

    def for_eqn(self, eqn: JaxprEqn) -> Walk:
        """This walk, adjusted for the region and pass ``eqn`` is in."""
        region, backward = _stack_info(eqn.source_info.name_stack)
        if region is None and self.float32_lines and not self.float32:
            lines = _compat.eqn_frame_lines(eqn.source_info)
            if not self.float32_lines.isdisjoint(lines):
                region = ("float32", None)
        if region is None and (not backward or self.backward):
            return self
        walk = self
        if backward and not self.backward:
            walk = walk._copy(backward=True)
        return walk.in_region(region)


def _trip(n: Any) -> int:
    try:
        return max(int(n), 1)
    except Exception:  # noqa: BLE001  (a symbolic length)
        return 1


@ft.lru_cache(maxsize=8192)
def _stack_info(name_stack: Any) -> tuple[tuple[str, Any] | None, bool]:
    text = str(name_stack)
    if not text:
        return None, False
    return regions.parse_name_stack(text), "transpose(" in text


# ------------------------------------------------------------------ rules' view


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
        fused: the equation is a bias add fused into the matmul before it
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
    fused: bool = False

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
    return lax.convert_element_type(x, dtype)


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
    out = []
    for x, v, m in zip(invals, eqn.invars, ctx.marks, strict=True):
        dt = float_dtype(x)
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
    known = walk.scalars.get(var)
    if known is not None:
        value = float(known)
        if not np.isfinite(value) or abs(value) <= big:
            return x
        return lax.full(np.shape(x), np.copysign(big, value), x.dtype)
    fits = walk.ranges.get(var)
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
    line), so that the report lists every op the program runs."""
    env: dict[Any, Any] = {own.jaxpr.invars[0]: x}
    for eqn in own.jaxpr.eqns:
        invals = [v.val if type(v) is Literal else env[v] for v in eqn.invars]
        outs = bind_as_written(eqn, invals)
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
    [out] = [v.val if type(v) is Literal else env[v] for v in own.jaxpr.outvars]
    return out


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


# ------------------------------------------------------------------ running


def bind(prim: Any, invals: Sequence[Any], params: dict[str, Any]) -> Any:
    """``prim.bind(*invals, **params)`` with dtype-valued params canonicalised."""
    return prim.bind(*invals, **_canonical_params(params))


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


def bind_as_written(eqn: JaxprEqn, invals: Sequence[Any]) -> list[Any]:
    """Runs ``eqn`` exactly as traced (``diagnose``'s float32 reference)."""
    params = eqn.primitive.get_bind_params(eqn.params)
    subfuns: Sequence[Any] = ()
    if isinstance(params, tuple):  # older JAX: (subfuns, params)
        subfuns, params = params
    out = eqn.primitive.bind(*subfuns, *invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _has_jaxpr_params(params: dict[str, Any]) -> bool:
    for v in params.values():
        if isinstance(v, Jaxpr | ClosedJaxpr):
            return True
        if isinstance(v, tuple | list) and any(
            isinstance(x, Jaxpr | ClosedJaxpr) for x in v
        ):
            return True
    return False


def default_rule(prim: Any, ctx: CastContext, *invals: Any, **params: Any) -> Any:
    """The rule for ops without their own: cast the operands as decided, bind
    the primitive, and round the result if the decision says so."""
    out = bind(prim, cast_operands(ctx, invals), params)
    out_dtype = ctx.decision.out_dtype
    if out_dtype is None:
        return out
    if prim.multiple_results:
        return [cast(o, out_dtype) for o in out]
    return cast(out, out_dtype)


def _run_rule(
    spec: ops.OpSpec | None, prim: Any, ctx: CastContext, invals: Sequence[Any]
) -> list[Any]:
    rule = None if ctx.fused else ops.rule_for(spec)
    if rule is not None:
        outs = rule(ctx, *invals, **ctx.eqn.params)
    else:
        outs = default_rule(prim, ctx, *invals, **ctx.eqn.params)
    return list(outs) if prim.multiple_results else [outs]


def run_decided(
    walk: Walk,
    eqn: JaxprEqn,
    decision: Decision,
    invals: Sequence[Any],
    marks: Sequence[int],
    *,
    fused: bool = False,
) -> list[Any]:
    """Runs a first-order ``eqn`` with a decision already made (no observer)."""
    spec = ops.spec_for(eqn.primitive.name)
    ctx = CastContext(walk.config, eqn, decision, walk, marks, [], fused)
    return _run_rule(spec, eqn.primitive, ctx, invals)


def run_eqn(
    walk: Walk, eqn: JaxprEqn, invals: list[Any], marks: Sequence[int]
) -> tuple[list[Any], list[int]]:
    """Runs one equation in ``walk``. Returns the outputs and their marks."""
    prim = eqn.primitive
    spec = ops.spec_for(prim.name)
    n_out = len(eqn.outvars)
    if (spec is not None and spec.is_higher_order) or _has_jaxpr_params(eqn.params):
        walk.current = eqn
        hop_marks = [0] * n_out
        ctx = CastContext(walk.config, eqn, HIGHER_ORDER, walk, marks, hop_marks)
        outs: Any = NotImplemented
        if walk.observer is not None:
            outs = walk.observer.run_higher_order(ctx, invals)
        if outs is NotImplemented:
            outs = ops.higher_order_rule(prim.name)(ctx, *invals, **eqn.params)
        outs = list(outs) if prim.multiple_results else [outs]
        return outs, hop_marks
    decision = decide_eqn(walk, eqn, spec, invals, marks)
    fused = False
    if walk.wide:
        products = [not isinstance(v, Literal) and v in walk.wide for v in eqn.invars]
        epilogue = decide_epilogue(eqn, spec, decision, invals, marks, products)
        if epilogue is not None:
            decision, i = epilogue
            invals[i] = walk.wide[eqn.invars[i]]
            fused = True
    ctx = CastContext(walk.config, eqn, decision, walk, marks, [], fused)
    outs = _run_rule(spec, prim, ctx, invals)
    if spec is not None and spec.product is not None and not walk.backward:
        _note_partners(walk, eqn, decision, invals)
    if walk.observer is not None:
        plain = walk.probe()

        def rerun(values: Sequence[Any]) -> list[Any]:
            with _eqn_context(eqn):
                return run_decided(plain, eqn, decision, values, marks, fused=fused)

        walk.observer.on_eqn(
            walk, eqn, decision, ran_with(decision, eqn, invals), invals, outs, rerun
        )
    return outs, out_marks(spec, eqn, marks, n_out, walk.backward, walk)


@contextlib.contextmanager
def _eqn_context(eqn: JaxprEqn) -> Iterator[None]:
    name_stack = siu.current_name_stack() + eqn.source_info.name_stack
    with siu.user_context(eqn.source_info.traceback, name_stack=name_stack):
        with eqn.ctx.manager:
            yield


def eval_jaxpr(
    walk: Walk,
    jaxpr: Jaxpr | ClosedJaxpr,
    consts: Sequence[Any],
    args: Sequence[Any],
    marks: Sequence[int] | None = None,
    known: Sequence[Any] = (),
) -> tuple[list[Any], list[int]]:
    """Evaluates ``jaxpr`` on ``args`` with autocast's decisions and rules.

    Args:
        walk: where and how to walk.
        jaxpr: an open ``Jaxpr`` (then ``consts`` are its constvars' values) or
            a ``ClosedJaxpr`` (then ``consts`` must be empty).
        consts: values of the constvars.
        args: values of the invars.
        marks: per invar, the marks of its value (default: none).
        known: the values of the first invars when they are constants known
            before the walk (the closed-over constants the front door passes
            as arguments, the constant operands of a nested ``jit``; ``None``
            where unknown): their ranges decide whether they fit the low
            dtype, and a fill of a known scalar saturates without a clamp.

    Returns:
        The output values and their marks.
    """
    if isinstance(jaxpr, ClosedJaxpr):
        if consts:
            raise ValueError("`eval_jaxpr`: pass no `consts` with a ClosedJaxpr.")
        consts = jaxpr.consts
        jaxpr = jaxpr.jaxpr
    walk = walk._copy()  # its own `wide`, `scalars`, `producers`: never the caller's
    env: dict[Any, Any] = {}
    mk: dict[Any, int] = {}
    for v, x in zip(jaxpr.constvars, consts, strict=True):
        env[v] = x
        mk[v] = CONST | INPUT
        _note_constant(walk, v, x)
    if marks is None:
        marks = [0] * len(args)
    for v, x, m in zip(jaxpr.invars, args, marks, strict=True):
        env[v] = x
        mk[v] = m
    for v, x in zip(jaxpr.invars, known, strict=False):
        _note_constant(walk, v, x)
    # A recognised attention runs as one unit when its last equation is
    # reached (its inputs are all computed by then); its other equations wait.
    # In a differentiated program its backward pass runs as one unit where
    # its first gradient is read.
    open_jaxpr: Jaxpr = jaxpr  # type: ignore[assignment]
    fusable = _attentions(walk, open_jaxpr, consts)
    skip = {i for m in fusable.values() for i in m.region if i != m.anchor}
    for m in fusable.values():
        if m.backward is not None:
            skip |= m.backward.region | m.backward.dropped
    due: dict[int, list[Callable[[], None]]] = {}
    for index, eqn in enumerate(jaxpr.eqns):
        for run_backward in due.pop(index, ()):
            run_backward()
        if index in skip:
            continue
        match = fusable.get(index)
        if match is None:
            _step(walk, eqn, env, mk)
            continue
        ran = _run_attention(walk, open_jaxpr, match, env, mk)
        bwd = match.backward
        if ran is None:
            # Unfused: its equations one by one (the backward's forward
            # residuals with them), the rest of the backward in its place.
            early = set() if bwd is None else {i for i in bwd.region if i < index}
            for i in sorted(match.region | early):
                _step(walk, jaxpr.eqns[i], env, mk)
            if bwd is not None:
                skip -= bwd.region - early
        elif bwd is not None:
            due.setdefault(bwd.at, []).append(ran)
    for run_backward in due.pop(len(jaxpr.eqns), ()):
        run_backward()
    outs = [v.val if type(v) is Literal else env[v] for v in jaxpr.outvars]
    outmarks = [literal_mark() if type(v) is Literal else mk[v] for v in jaxpr.outvars]
    return outs, outmarks


def _step(walk: Walk, eqn: JaxprEqn, env: dict[Any, Any], mk: dict[Any, int]) -> None:
    """Runs one equation of a jaxpr being evaluated, in ``env``."""
    invals = [v.val if type(v) is Literal else env[v] for v in eqn.invars]
    inmarks = [literal_mark() if type(v) is Literal else mk[v] for v in eqn.invars]
    w = walk.for_eqn(eqn)
    if w is not walk:
        _share_tables(walk, w)
    with _eqn_context(eqn):
        outs, outmarks = run_eqn(w, eqn, invals, inmarks)
    for v, x, m in zip(eqn.outvars, outs, outmarks, strict=True):
        env[v] = x
        mk[v] = m
        walk.producers[v] = eqn
    _note_scalar(walk, eqn, inmarks)
    _fold_constant(walk, eqn, inmarks)


def _share_tables(walk: Walk, w: Walk) -> None:
    """Gives the walk of one equation the tables of the jaxpr's walk."""
    w.wide, w.scalars, w.partners = walk.wide, walk.scalars, walk.partners
    w.producers, w.casts = walk.producers, walk.casts
    w.ranges, w.values = walk.ranges, walk.values


def _attentions(
    walk: Walk, jaxpr: Jaxpr, consts: Sequence[Any]
) -> dict[int, attention.Match]:
    """The attentions of ``jaxpr`` the walk may fuse (none for an observer
    that compares op by op, such as ``diagnose``)."""
    if not getattr(walk.observer, "fuses_attention", True):
        return {}
    return attention.find(jaxpr, consts)


def _run_attention(
    walk: Walk,
    jaxpr: Jaxpr,
    match: attention.Match,
    env: dict[Any, Any],
    mk: dict[Any, int],
) -> Callable[[], None] | None:
    """Runs a recognised attention as one unit, if its decision says so:
    fused per platform, the other platforms' formulation being its
    equations run one by one. Returns ``None`` where it did not run, else
    what runs its backward pass (in a differentiated program; else nothing).
    """
    values = [env[v] for v in match.inputs]
    w = walk.for_eqn(jaxpr.eqns[match.first])
    if w is not walk:
        _share_tables(walk, w)
    dtypes = [float_dtype(values[i[0]]) or _F32 for i in (match.q, match.k, match.v)]
    decision = decide_attention(w, match.pattern, dtypes)
    if decision is None:
        return None
    marks = [mk[v] for v in match.inputs]
    out_var = jaxpr.eqns[match.anchor].outvars[0]
    low = np.dtype(decision.dtype)
    region = [jaxpr.eqns[i] for i in sorted(match.region)]
    plain = w.probe()
    bwd = match.backward
    saved = () if bwd is None else bwd.saved
    out_shape = aval_shape(out_var)
    run_backward: Callable[[], None] | None = None

    def unfused_values(*vals: Any) -> tuple[list[Any], list[int]]:
        local = dict(zip(match.inputs, vals, strict=True))
        lmk = dict(zip(match.inputs, marks, strict=True))
        _run_eqns(plain, region, local, lmk)
        keep = [out_var, *saved]
        return [local[v] for v in keep], [lmk[v] for v in keep]

    if bwd is None:

        def unfused(*vals: Any) -> Any:
            return cast(unfused_values(*vals)[0][0], low)

        def cudnn(*vals: Any) -> Any:
            try:
                return attention.fused(match, vals, low, out_shape)
            except Exception:  # noqa: BLE001  (no cuDNN here, or shapes it refuses)
                return unfused(*vals)

        with _eqn_context(jaxpr.eqns[match.first]):
            out = per_platform(
                tuple(values), platform=w.config.platform, default=unfused, cuda=cudnn
            )
    else:
        # The cuda formulation keeps the fused kernel's residuals for its
        # derivative, the other the values its backward equations read; each
        # returns zeros in place of the other's (never read: a lowering
        # keeps one platform's formulation of both passes).
        slots = [spec[0] for spec in (match.q, match.k, match.v)]

        def with_vjp(*vals: Any) -> tuple[Any, Any]:
            def of(qkv: Any) -> Any:
                full = list(vals)
                for pos, x in zip(slots, qkv, strict=True):
                    full[pos] = x
                return attention.fused(match, full, low, out_shape)

            # (Its operands are cast here; what JAX's implementation mixes
            # inside is not the user's code.)
            with jax.numpy_dtype_promotion("standard"):
                return jax.vjp(of, tuple(cast(vals[pos], low) for pos in slots))

        found: dict[str, Any] = {}

        def residuals_of(*vals: Any) -> Any:
            leaves, found["tree"] = jax.tree.flatten(with_vjp(*vals)[1])
            return leaves

        def kept_of(*vals: Any) -> Any:
            kept, found["marks"] = unfused_values(*vals)
            return kept

        try:
            res_shapes = jax.eval_shape(residuals_of, *values)
        except Exception:  # noqa: BLE001  (no cuDNN here, or shapes it refuses)
            res_shapes = None  # every platform runs the equations
        kept_shapes = jax.eval_shape(kept_of, *values)
        res_tree, kept_marks = found.get("tree"), found["marks"]

        def zeros(shapes: Any) -> list[Any]:
            return [jnp.zeros(x.shape, x.dtype) for x in shapes]

        def unfused_fwd(*vals: Any) -> Any:
            kept = unfused_values(*vals)[0]
            return (cast(kept[0], low), *kept[1:], *zeros(res_shapes or ()))

        def cudnn_fwd(*vals: Any) -> Any:
            out, vjp = with_vjp(*vals)
            return (out, *zeros(kept_shapes[1:]), *jax.tree.leaves(vjp))

        with _eqn_context(jaxpr.eqns[match.first]):
            outs = per_platform(
                tuple(values),
                platform=w.config.platform,
                default=unfused_fwd,
                cuda=unfused_fwd if res_shapes is None else cudnn_fwd,
            )
        out = outs[0]
        for v, x, m_ in zip(
            saved, outs[1 : 1 + len(saved)], kept_marks[1:], strict=True
        ):
            env[v], mk[v] = x, m_
        residuals = list(outs[1 + len(saved) :])

        def backward_pass() -> None:
            _run_attention_backward(
                walk, jaxpr, match, env, mk, decision, low, res_tree, residuals
            )

        run_backward = backward_pass

    env[out_var] = out
    mk[out_var] = 0
    if walk.observer is not None:
        rec = match.eqn

        def rerun(vals: Sequence[Any]) -> list[Any]:
            del vals
            raise NotImplementedError("a fused attention is not rerun op by op")

        walk.observer.on_eqn(
            w, rec, decision, [low] * len(rec.invars),
            [env[v] for v in rec.invars], [out], rerun,
        )  # fmt: skip
    return run_backward or (lambda: None)


def _run_eqns(
    walk: Walk, eqns: Sequence[JaxprEqn], local: dict[Any, Any], lmk: dict[Any, int]
) -> None:
    """Runs ``eqns`` in order in ``local`` (a formulation's own environment)."""
    for eqn in eqns:
        invals = [v.val if type(v) is Literal else local[v] for v in eqn.invars]
        inmarks = [literal_mark() if type(v) is Literal else lmk[v] for v in eqn.invars]
        with _eqn_context(eqn):
            outs, outmarks = run_eqn(walk.for_eqn(eqn), eqn, invals, inmarks)
        for v, x, m in zip(eqn.outvars, outs, outmarks, strict=True):
            local[v], lmk[v] = x, m


def _run_attention_backward(
    walk: Walk,
    jaxpr: Jaxpr,
    match: attention.Match,
    env: dict[Any, Any],
    mk: dict[Any, int],
    decision: Decision,
    low: np.dtype,
    res_tree: Any,
    residuals: list[Any],
) -> None:
    """Runs the backward pass of a fused attention: on cuda the fused
    kernel's derivative, elsewhere its equations one by one."""
    bwd = match.backward
    assert bwd is not None
    eqns = [jaxpr.eqns[i] for i in sorted(bwd.region)]
    w = walk.for_eqn(bwd.eqn)
    if w is not walk:
        _share_tables(walk, w)
    plain = w.probe()
    reads = [env[v] for v in bwd.reads]
    read_marks = [mk[v] for v in bwd.reads]
    grads = [g for g in bwd.grads if g is not None]
    found: dict[str, Any] = {}

    def unfused(*vals: Any) -> list[Any]:
        local = dict(zip(bwd.reads, vals[: len(reads)], strict=True))
        lmk = dict(zip(bwd.reads, read_marks, strict=True))
        _run_eqns(plain, eqns, local, lmk)
        found["marks"] = [lmk[g] for g in grads]
        return [local[g] for g in grads]

    shapes = jax.eval_shape(unfused, *reads, *residuals)

    def cudnn(*vals: Any) -> list[Any]:
        vjp = jax.tree.unflatten(res_tree, vals[len(reads) :])
        with jax.numpy_dtype_promotion("standard"):
            (cts,) = vjp(cast(vals[0], low))
        computed = [c for c, g in zip(cts, bwd.grads, strict=True) if g is not None]
        return [cast(c, s.dtype) for c, s in zip(computed, shapes, strict=True)]

    with _eqn_context(bwd.eqn):
        outs = per_platform(
            (*reads, *residuals),
            platform=w.config.platform,
            default=unfused,
            cuda=unfused if res_tree is None else cudnn,
        )
    for g, x, m in zip(grads, outs, found["marks"], strict=True):
        env[g], mk[g] = x, m
    if walk.observer is not None:
        rec = bwd.eqn
        back = dataclasses.replace(
            decision,
            reason=decision.reason.replace("attention (", "attention's gradient (", 1),
        )

        def rerun(vals: Sequence[Any]) -> list[Any]:
            del vals
            raise NotImplementedError("a fused attention is not rerun op by op")

        walk.observer.on_eqn(
            w, rec, back, [low] * len(rec.invars),
            [env[v] for v in rec.invars], outs, rerun,
        )  # fmt: skip


def _note_partners(
    walk: Walk, eqn: JaxprEqn, decision: Decision, invals: Sequence[Any]
) -> None:
    """Remembers, for each operand of a lowered forward product, the dtype the
    other operand ran in (a float32 master weight, a 16-bit activation).

    JAX's transpose of ``dot(x, w)`` is ``dot(g, w)`` (the gradient of ``x``)
    and ``dot(x, g)`` (that of ``w``): the forward operand that a backward
    product keeps as its residual names whose gradient it computes, the
    other one's. An operand seen with partners of different dtypes gets the
    widest.
    """
    if decision.precision not in (Precision.LOW, Precision.FLOAT8):
        return
    if len(eqn.invars) < 2:
        return
    a, b = eqn.invars[:2]
    da, db = float_dtype(invals[0]), float_dtype(invals[1])
    for var, partner in ((a, db), (b, da)):
        if isinstance(var, Literal) or partner is None:
            continue
        seen = walk.partners.get(var)
        if seen is not None and seen != partner:
            partner = _F32
        walk.partners[var] = partner


#: The largest constant (in elements) whose value is computed while walking,
#: to know its range (see :func:`_fold_constant`).
FOLD_LIMIT = 1 << 16


def value_range(x: Any) -> tuple[float, float]:
    """``(largest finite, smallest non-zero finite)`` magnitude of ``x``
    (``(0.0, inf)`` when it has none).

    Examples:
        >>> value_range(np.array([0.0, -3.0, 1e-3, np.inf]))
        (3.0, 0.001)
    """
    a = np.abs(np.asarray(x, dtype=np.float64))
    a = a[np.isfinite(a)]
    if a.size == 0:
        return 0.0, float("inf")
    nonzero = a[a > 0]
    return float(a.max()), float(nonzero.min()) if nonzero.size else float("inf")


class KnownRange(tuple):
    """``(largest finite, smallest non-zero)`` magnitude of a constant whose
    value is not kept (too large): what a body is told of such an operand."""

    __slots__ = ()


def _note_constant(walk: Walk, var: Any, x: Any) -> None:
    """Records the range (and, if small, the value) of a closed-over constant."""
    if isinstance(x, KnownRange):
        walk.ranges[var] = (float(x[0]), float(x[1]))
        return
    if _compat.is_tracer(x) or not hasattr(x, "dtype"):
        return
    if jnp.issubdtype(x.dtype, jax.dtypes.extended):
        return  # a PRNG key
    if float_dtype(x) is not None:
        walk.ranges[var] = value_range(x)
    if np.size(x) <= FOLD_LIMIT:
        walk.values[var] = np.asarray(x)
    if np.ndim(x) == 0:
        walk.scalars[var] = np.asarray(x)  # a fill of it saturates without a clamp


def known_value(walk: Walk, var: Any) -> Any:
    """The value of a constant operand known while walking (a literal, a small
    closed-over array, a constant folded from those), or ``None``."""
    if type(var) is Literal:
        return np.asarray(var.val)
    if var in walk.values:
        return walk.values[var]
    known = walk.scalars.get(var)
    if known is not None:
        return np.broadcast_to(np.asarray(known), aval_shape(var))
    return None


def _fold_constant(walk: Walk, eqn: JaxprEqn, inmarks: Sequence[int]) -> None:
    """Computes, as written, a small constant made from known constants (a
    ``1e5 * 3`` the program computes), to know its range: the same in
    ``autocast``, ``explain`` and ``diagnose``, whatever is traced."""
    if not all(m & CONST for m in inmarks) or eqn.effects:
        return
    if _has_jaxpr_params(eqn.params) or len(eqn.outvars) != 1:
        return
    out = eqn.outvars[0]
    if not hasattr(out.aval, "dtype") or int(np.prod(aval_shape(out))) > FOLD_LIMIT:
        return
    if out in walk.scalars:
        return  # a view of a known scalar: its range is known
    args = [known_value(walk, v) for v in eqn.invars]
    if any(a is None for a in args):
        return
    try:
        with jax.ensure_compile_time_eval():
            [value] = bind_as_written(eqn, args)
        value = np.asarray(value)
    except Exception:  # noqa: BLE001  (not computable here: range unknown)
        return
    walk.values[out] = value
    if float_dtype(value) is not None:
        walk.ranges[out] = value_range(value)


def _note_scalar(walk: Walk, eqn: JaxprEqn, inmarks: Sequence[int]) -> None:
    """Remembers the value of a constant that views a known scalar (a scalar
    broadcast, reshaped or converted), for :func:`_saturate_constant`."""
    if not (inmarks and inmarks[0] & CONST and len(eqn.outvars) == 1):
        return
    spec = ops.spec_for(eqn.primitive.name)
    if spec is None or ops.VIEW not in spec.flags:
        return
    src = eqn.invars[0]
    known = src.val if type(src) is Literal else walk.scalars.get(src)
    if known is not None and np.ndim(known) == 0:
        walk.scalars[eqn.outvars[0]] = known
