"""The autocast interpreter: one walk over a jaxpr for autocast, explain and diagnose.

:func:`eval_jaxpr` walks a jaxpr like ``jax.core.eval_jaxpr`` (literals read
directly, ``zip(strict=True)``, each equation under its user source context and
``eqn.ctx.manager``). For each equation it:

1. finds the op's entry in the op table (:mod:`~mixprec._src.autocast.ops`);
2. for a higher-order primitive, hands the equation to its rule, which walks the
   body with this same interpreter;
3. otherwise decides the precision once (:func:`~mixprec._src.autocast.decide.decide`,
   adjusted for the region the equation is in) and runs the op's rule with the
   :class:`Decision`;
4. tells the observer, if there is one, what ran.

Three clients share the walk. :func:`mixprec.autocast` stages the result out.
``mixprec.explain`` adds an observer that records each decision while the same
transformed jaxpr is traced. ``mixprec.diagnose`` runs the walk on concrete
``Dual`` values (a float32 reference and the autocast value side by side): each
equation also runs as written on the reference, loops are stepped and branches
taken concretely, and the observer compares the two.

Per variable the walk keeps four marks: ``FOLLOWS`` (broadcast into its
consumers: a bias, a scale, a scalar), ``STAT`` (a statistic: computed from a
reduction, like a mean or a variance; it is never a follower, even broadcast),
``CONST`` (computed from constants only) and ``GRAD`` (a gradient: computed in a
backward pass from the loss's cotangent). The first two decide which operands
anchor a gray op; ``CONST`` makes casts of constants saturate; ``GRAD`` sends a
float8 matmul's gradient operand to ``float8_e5m2``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools as ft
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple, Protocol

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import source_info_util as siu
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal

from mixprec._src import _compat
from mixprec._src.autocast import float8_dots, ops, regions
from mixprec._src.autocast.config import CastConfig
from mixprec._src.autocast.decide import Decision, Precision, decide, has_float32_range


__all__ = [
    "CONST",
    "FOLLOWS",
    "GRAD",
    "STAT",
    "CastContext",
    "Dual",
    "Observer",
    "Walk",
    "eval_jaxpr",
]

# Equations created by mixprec point at the user code that caused them.
siu.register_exclusion(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))

_F32 = np.dtype(np.float32)

#: The value is broadcast into its consumers (bias, scale, scalar): it follows.
FOLLOWS = 1
#: The value is computed from literals and constants only.
CONST = 2
#: The value is a statistic: a reduction, or computed from reductions and
#: constants only (a mean, a variance, 1/sqrt(var + eps), a max).
STAT = 4
#: The value is a gradient: computed in a backward pass from the cotangent
#: that starts it (a constant such as the ``1.0`` of ``jax.grad``).
GRAD = 8

# Reductions whose results are statistics of their operand.
_REDUCTIONS = frozenset(
    {
        "reduce_sum",
        "reduce_max",
        "reduce_min",
        "reduce_prod",
        "psum",
        "psum_invariant",
        "pmax",
        "pmin",
    }
)


class Dual(NamedTuple):
    """A float32 reference value and the autocast value of one variable."""

    ref: Any
    mix: Any


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
        rerun: Callable[[Sequence[Any]], list[Any]] | None = None,
    ) -> None:
        """Called after a (first-order) equation ran. In a dual walk ``invals``
        and ``outs`` hold :class:`Dual` values, and ``rerun(values)`` runs the
        equation again with the same decision on other (plain) operands."""

    def on_note(self, walk: Walk, eqn: JaxprEqn, text: str) -> None:
        """Called when a dual walk cannot compare part of a function."""


# ------------------------------------------------------------------ the walk


class Walk:
    """Where the interpreter is: configuration, region, path, observer.

    A new ``Walk`` is made for each body the interpreter enters (cheap: plain
    slots, no copying of the configuration).
    """

    __slots__ = (
        "backward",
        "composite",
        "config",
        "current",
        "dual",
        "float32",
        "observer",
        "parent_source",
        "path",
        "probing",
        "scalars",
        "trip",
        "wide",
    )

    def __init__(
        self,
        config: CastConfig,
        *,
        observer: Observer | None = None,
        dual: bool = False,
        path: str = "",
        trip: int = 1,
        float32: bool = False,
        composite: str = "",
        backward: bool = False,
        probing: bool = False,
        parent_source: str = "",
    ) -> None:
        self.config = config
        self.observer = observer
        self.dual = dual
        self.path = path
        self.trip = trip
        self.float32 = float32
        self.composite = composite
        self.backward = backward
        self.probing = probing
        # The user source line of the higher-order equation around this body
        # (for equations without one of their own), and the equation being run.
        self.parent_source = parent_source
        self.current: JaxprEqn | None = None
        # Float32 products of this jaxpr's CPU dots, by the dot's outvar, for
        # a bias add that follows (see `_epilogue`).
        self.wide: dict[Any, Any] = {}
        # The value of constants that are a scalar broadcast, reshaped or
        # converted (`jnp.full(shape, finfo.min)`), by outvar: a cast of one
        # saturates that scalar instead of emitting a clamp.
        self.scalars: dict[Any, Any] = {}

    def _copy(self, **changes: Any) -> Walk:
        kw = {
            "observer": self.observer,
            "dual": self.dual,
            "path": self.path,
            "trip": self.trip,
            "float32": self.float32,
            "composite": self.composite,
            "backward": self.backward,
            "probing": self.probing,
            "parent_source": self.parent_source,
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
        if composite is not None and not self.float32:
            changes["composite"] = composite
        return self._copy(**changes)

    def probe(self) -> Walk:
        """A walk that observes nothing (a body traced only for its types)."""
        return self._copy(observer=None, probing=True, dual=False)

    def staged(self) -> Walk:
        """The same walk on plain (not dual) values."""
        return self._copy(dual=False, observer=None)

    @property
    def key(self) -> tuple[Any, ...]:
        """What decides how a body is transformed (for caches)."""
        return (self.config, self.float32, self.composite, self.backward)

    def for_eqn(self, eqn: JaxprEqn) -> Walk:
        """This walk, adjusted for the region and pass ``eqn`` is in."""
        region, backward = _stack_info(eqn.source_info.name_stack)
        if region is None and (not backward or self.backward):
            return self
        walk = self
        if backward and not self.backward:
            walk = walk._copy(backward=True)
        if region is None:
            return walk
        kind, value = region
        if kind == "float32":
            return walk._copy(float32=True, composite="")
        if kind == "policy":
            return walk._copy(
                config=walk.config.with_policy(value), float32=False, composite=""
            )
        return walk._copy(config=value, float32=False, composite="")

    # -- deciding ----------------------------------------------------------
    def decide(
        self,
        eqn: JaxprEqn,
        spec: ops.OpSpec | None,
        invals: Sequence[Any],
        marks: Sequence[int],
    ) -> Decision:
        """The precision of ``eqn`` with these operands, in this walk."""
        name = eqn.primitive.name
        cfg = self.config
        if self.float32:
            return Decision(
                Precision.ORIGINAL,
                None,
                cfg.lists.classify(name),
                "inside mixprec.float32_scope(): as written",
            )
        if spec is None and name not in cfg.lists.names():
            if cfg.strict:
                _raise_unclassified(cfg, eqn)
            return Decision(
                Precision.ORIGINAL,
                None,
                "infer",
                "in no op list and no rule: runs as written",
            )
        if spec is not None and ops.OPAQUE in spec.flags:
            return Decision(Precision.ORIGINAL, None, "clear", spec.reason)
        if name == "mul" and _is_square(eqn):
            name = "square"
            spec = ops.spec_for("square")
        lookup = self.composite or name
        op_class = cfg.lists.classify(lookup)
        flags = spec.flags if spec is not None and not self.composite else frozenset()
        out_aval: Any = eqn.outvars[0].aval if eqn.outvars else None
        out_shape = getattr(out_aval, "shape", ())
        # In a backward pass under float16, a broadcast cotangent (the
        # gradient of a sum or a mean) is the gradient signal, often below
        # float16's normal range: it anchors instead of following.
        broadcast_follows = not (self.backward and not has_float32_range(cfg.low_dtype))
        operands = tuple(
            (_float_dtype(x), _follows(v, x, m, out_shape, broadcast_follows))
            for v, x, m in zip(eqn.invars, invals, marks, strict=True)
        )
        float8 = _float8_args(cfg, eqn, spec, op_class, marks, out_shape)
        d = decide(
            lookup,
            operands,
            op_class=op_class,
            mode=cfg.mode,
            low=cfg.low_dtype,
            flags=flags,
            backward=self.backward,
            high_precision=_asks_high_precision(eqn),
            traced_out=_float_dtype(out_aval) if op_class == "allow" else None,
            **float8,
        )
        if self.composite:
            return dataclasses.replace(
                d, reason=f"inside {self.composite} (a JAX composite): {d.reason}"
            )
        if name == "square" and eqn.primitive.name == "mul":
            return dataclasses.replace(
                d, reason=f"mul of a value by itself: {d.reason}"
            )
        return d


def _float8_args(
    cfg: CastConfig,
    eqn: JaxprEqn,
    spec: ops.OpSpec | None,
    op_class: str,
    marks: Sequence[int],
    out_shape: Sequence[Any],
) -> dict[str, Any]:
    """The float8 arguments of :func:`decide` for ``eqn`` (none without a recipe,
    or for an op without a float8 formulation)."""
    recipe = cfg.policy.float8
    name = eqn.primitive.name
    if (
        recipe is None
        or op_class != "allow"
        or spec is None
        or ops.FLOAT8 not in spec.flags
    ):
        return {}
    dims = float8_dots.product_dims(
        name, [aval_shape(v) for v in eqn.invars], out_shape, eqn.params
    )
    size, align = dims if dims is not None else (None, ())
    return {
        "float8": recipe,
        "float8_dims": size,
        "float8_align": align,
        "gradients": tuple(bool(m & GRAD) for m in marks),
    }


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


def _is_square(eqn: JaxprEqn) -> bool:
    a, b = eqn.invars
    return a is b and not isinstance(a, Literal)


def _float_dtype(x: Any) -> np.dtype | None:
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        if isinstance(x, float):
            return _F32
        return None
    try:
        if not jnp.issubdtype(dtype, jnp.floating):
            return None
    except TypeError:  # extended dtypes (PRNG keys)
        return None
    return np.dtype(dtype)


def aval_shape(var: Any) -> tuple[Any, ...]:
    """The shape of a jaxpr variable (``()`` for tokens and other non-arrays)."""
    return tuple(getattr(var.aval, "shape", ()))


def aval_dtype(var: Any) -> Any:
    """The dtype of a jaxpr variable (``None`` for tokens and other non-arrays)."""
    return getattr(var.aval, "dtype", None)


def _same_shape(a: Sequence[Any], b: Sequence[Any]) -> bool:
    try:
        return tuple(a) == tuple(b)
    except Exception:  # noqa: BLE001  (undecidable symbolic dimensions)
        return False


def _follows(
    var: Any,
    x: Any,
    mark: int,
    out_shape: Sequence[Any],
    broadcast_follows: bool = True,
) -> bool:
    """Whether an operand follows the others in a gray op (does not anchor it):
    a weak-typed scalar always; an operand broadcast into the result (a bias, a
    scale) unless it is a statistic or ``broadcast_follows`` is False."""
    aval = var.aval
    if getattr(aval, "weak_type", False):
        return True
    if mark & STAT or not broadcast_follows:
        return False
    if mark & FOLLOWS:
        return True
    return not _same_shape(getattr(aval, "shape", ()), out_shape)


def _asks_high_precision(eqn: JaxprEqn) -> bool:
    precision = eqn.params.get("precision")
    if precision is None:
        return False
    items = precision if isinstance(precision, tuple | list) else (precision,)
    high = (lax.Precision.HIGH, lax.Precision.HIGHEST)
    return any(p in high for p in items)


def _raise_unclassified(cfg: CastConfig, eqn: JaxprEqn) -> None:
    name = eqn.primitive.name
    try:
        cfg.lists.classify(name, strict=True)
    except NotImplementedError:
        where = _compat.eqn_source_summary(eqn.source_info) or "unknown location"
        raise NotImplementedError(
            f"No cast rule for primitive '{name}' (at {where}) and it is in no op "
            "list, so `autocast(..., strict=True)` cannot decide its precision. "
            "Register a rule with `mixprec.register_rule(primitive, rule)` or add "
            "it to a list with `mixlist={'gray-list': {'to-add': "
            f"['{name}']}}}}`."
        ) from None


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

    @property
    def policy(self) -> Any:
        """The policy in effect."""
        return self.config.policy

    @property
    def low_dtype(self) -> np.dtype:
        """The dtype allow-list ops run in."""
        return self.config.low_dtype

    @property
    def platform(self) -> str:
        """The backend dots are formulated for."""
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
    dt = _float_dtype(x)
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
    decision dtype casts them to it. Casting down, a constant saturates, and an
    operand of an elementwise op that is broadcast into the result is broadcast
    first, so that the transpose (its gradient) sums in the wider dtype.
    """
    d = ctx.decision
    eqn = ctx.eqn
    if d.precision is Precision.ORIGINAL:
        return [
            cast(x, aval_dtype(v)) if _float_dtype(x) is not None else x
            for x, v in zip(invals, eqn.invars, strict=True)
        ]
    if d.dtype is None:
        return list(invals)
    # A rule that does not know float8 runs a float8 decision in the low dtype.
    target = ctx.config.low_dtype if d.precision is Precision.FLOAT8 else d.dtype
    out_shape = aval_shape(eqn.outvars[0]) if eqn.outvars else ()
    spec = ops.spec_for(eqn.primitive.name)
    elementwise = spec is not None and ops.BROADCASTS in spec.flags
    out = []
    for x, v, m in zip(invals, eqn.invars, ctx.marks, strict=True):
        dt = _float_dtype(x)
        if dt is None or dt == target:
            out.append(x)
            continue
        narrowing = target.itemsize < dt.itemsize
        if narrowing and m & CONST:
            # A constant has no gradient: saturate it, cast it where it is.
            x = _saturate_constant(ctx.walk, v, x, target)
        elif narrowing and elementwise and not _same_shape(aval_shape(v), out_shape):
            # Broadcast first: the transpose then sums the gradient in `dt`.
            x = _broadcast_to(x, out_shape)
        out.append(cast(x, target))
    return out


def _saturate_constant(walk: Walk, var: Any, x: Any, dtype: np.dtype) -> Any:
    """A constant about to be cast to ``dtype`` with its finite values clipped
    to ``dtype``'s range (``finfo(float32).min`` must not become ``-inf``)."""
    if isinstance(var, Literal) or not _compat.is_tracer(x):
        return clip_to_range(x, dtype)
    big = float(jnp.finfo(dtype).max)
    known = walk.scalars.get(var)
    if known is not None:
        value = float(known)
        if not np.isfinite(value) or abs(value) <= big:
            return x
        return lax.full(np.shape(x), np.copysign(big, value), x.dtype)
    x_dtype = np.dtype(x.dtype)
    clipped = lax.clamp(np.asarray(-big, x_dtype), x, np.asarray(big, x_dtype))
    return lax.select(lax.is_finite(x), clipped, x)


#: Ops whose result is a known scalar constant when their operand is one.
_SCALAR_VIEWS = frozenset(
    {"broadcast_in_dim", "reshape", "convert_element_type", "squeeze", "expand_dims"}
)


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
        dt = _float_dtype(x)
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
    """Runs ``eqn`` exactly as traced (the float32 reference of a dual walk)."""
    params = eqn.primitive.get_bind_params(eqn.params)
    subfuns: Sequence[Any] = ()
    if isinstance(params, tuple):  # older JAX: (subfuns, params)
        subfuns, params = params
    out = eqn.primitive.bind(*subfuns, *invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _hop_decision() -> Decision:
    return Decision(
        Precision.RECEIVED,
        None,
        None,
        "higher-order primitive: its body is decided equation by equation",
    )


_HOP_DECISION = _hop_decision()


def _has_jaxpr_params(params: dict[str, Any]) -> bool:
    for v in params.values():
        if isinstance(v, Jaxpr | ClosedJaxpr):
            return True
        if isinstance(v, tuple | list) and any(
            isinstance(x, Jaxpr | ClosedJaxpr) for x in v
        ):
            return True
    return False


def _out_marks(
    spec: ops.OpSpec | None,
    eqn: JaxprEqn,
    marks: Sequence[int],
    n: int,
    backward: bool = False,
) -> list[int]:
    const = CONST if all(m & CONST for m in marks) else 0
    grad = 0
    if backward and (any(m & GRAD for m in marks) or (marks and const)):
        # A backward pass starts from a constant cotangent (`jax.grad`'s 1.0);
        # what it computes from that is a gradient, residuals are not.
        grad = GRAD
    name = eqn.primitive.name
    if name in _REDUCTIONS or (
        marks
        and any(m & STAT for m in marks)
        and all(m & (STAT | CONST) for m in marks)
    ):
        # A statistic, broadcast or not: never a follower.
        return [STAT | const | grad] * n
    follows = 0
    if spec is not None and eqn.invars:
        if name == "broadcast_in_dim":
            src = aval_shape(eqn.invars[0])
            if _size(src) != _size(aval_shape(eqn.outvars[0])):
                follows = FOLLOWS
            else:  # only size-1 dimensions added: a reshape
                follows = marks[0] & FOLLOWS
        elif ops.VIEW in spec.flags:
            follows = marks[0] & FOLLOWS
    if not eqn.invars and spec is not None and spec.op_class == "clear":
        const = CONST  # iota and friends
    return [const | follows | grad] * n


def _size(shape: Sequence[Any]) -> Any:
    try:
        return int(np.prod([int(d) for d in shape]))
    except Exception:  # noqa: BLE001  (symbolic dimensions)
        return tuple(shape)


_EPILOGUE_OPS = frozenset({"add", "sub"})


def _epilogue(
    walk: Walk,
    eqn: JaxprEqn,
    invals: list[Any],
    marks: Sequence[int],
    decision: Decision,
) -> Decision | None:
    """Runs a bias add on the float32 product of the CPU dot that feeds it.

    ``dot(x, w) + b`` would otherwise round the dot's float32 product to the low
    dtype, round ``b`` too, add, and round again. Adding in float32 and rounding
    once is what a GEMM epilogue does (cuBLAS, oneDNN): the same dtype, at least
    as accurate, and XLA:CPU fuses the add into the rounding. Replaces the dot's
    operand in ``invals`` by its product and returns the fused decision, or
    returns None when ``eqn`` is not such an add.
    """
    if (
        not walk.wide
        or eqn.primitive.name not in _EPILOGUE_OPS
        or decision.precision is not Precision.LOW
        or len(invals) != 2
    ):
        return None
    dot_side = [not isinstance(v, Literal) and v in walk.wide for v in eqn.invars]
    if sum(dot_side) != 1:
        return None
    i = dot_side.index(True)
    other = 1 - i
    out_shape = aval_shape(eqn.outvars[0])
    if not (
        _float_dtype(invals[other]) is not None
        and _follows(eqn.invars[other], invals[other], marks[other], out_shape)
    ):
        return None
    invals[i] = walk.wide[eqn.invars[i]]
    return Decision(
        Precision.FLOAT32,
        _F32,
        decision.op_class,
        f"{decision.reason}; fused into the dot before it: added in float32 to "
        f"its float32 product, rounded once to {decision.dtype}",
        out_dtype=decision.dtype,
    )


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


def run_eqn(
    walk: Walk, eqn: JaxprEqn, invals: list[Any], marks: Sequence[int]
) -> tuple[list[Any], list[int]]:
    """Runs one equation in ``walk``. Returns the outputs and their marks."""
    prim = eqn.primitive
    spec = ops.spec_for(prim.name)
    n_out = len(eqn.outvars)
    if (spec is not None and spec.is_higher_order) or _has_jaxpr_params(eqn.params):
        rule = ops.higher_order_rule(prim.name)
        walk.current = eqn
        out_marks = [0] * n_out
        ctx = CastContext(walk.config, eqn, _HOP_DECISION, walk, marks, out_marks)
        outs = rule(ctx, *invals, **eqn.params)
        outs = list(outs) if prim.multiple_results else [outs]
        return outs, out_marks
    if walk.dual:
        return _run_dual(walk, eqn, spec, invals, marks)
    decision = walk.decide(eqn, spec, invals, marks)
    fused = _epilogue(walk, eqn, invals, marks, decision)
    if fused is not None:
        decision = fused
    ctx = CastContext(walk.config, eqn, decision, walk, marks, [])
    if spec is not None and spec.rule is not None and fused is None:
        outs = spec.rule(ctx, *invals, **eqn.params)
    else:
        outs = default_rule(prim, ctx, *invals, **eqn.params)
    outs = list(outs) if prim.multiple_results else [outs]
    if walk.observer is not None and not walk.probing:
        walk.observer.on_eqn(
            walk, eqn, decision, ran_with(decision, eqn, invals), invals, outs
        )
    return outs, _out_marks(spec, eqn, marks, n_out, walk.backward)


def _run_dual(
    walk: Walk,
    eqn: JaxprEqn,
    spec: ops.OpSpec | None,
    invals: list[Any],
    marks: Sequence[int],
) -> tuple[list[Any], list[int]]:
    ref_in = [x.ref if isinstance(x, Dual) else x for x in invals]
    mix_in = [x.mix if isinstance(x, Dual) else x for x in invals]
    decision = walk.decide(eqn, spec, mix_in, marks)
    fused = _epilogue(walk, eqn, mix_in, marks, decision)
    if fused is not None:
        decision = fused
    ctx = CastContext(walk.config, eqn, decision, walk, marks, [])
    prim = eqn.primitive
    if spec is not None and spec.rule is not None and fused is None:
        mix_out = spec.rule(ctx, *mix_in, **eqn.params)
    else:
        mix_out = default_rule(prim, ctx, *mix_in, **eqn.params)
    mix_out = list(mix_out) if prim.multiple_results else [mix_out]
    ref_out = bind_as_written(eqn, ref_in)
    outs = [Dual(r, m) for r, m in zip(ref_out, mix_out, strict=True)]
    if walk.observer is not None:
        duals = [Dual(r, m) for r, m in zip(ref_in, mix_in, strict=True)]
        fused_rule = fused is not None

        def rerun(values: Sequence[Any]) -> list[Any]:
            staged = walk.staged()
            c = CastContext(walk.config, eqn, decision, staged, marks, [])
            with _eqn_context(eqn):
                if spec is not None and spec.rule is not None and not fused_rule:
                    o = spec.rule(c, *values, **eqn.params)
                else:
                    o = default_rule(prim, c, *values, **eqn.params)
            return list(o) if prim.multiple_results else [o]

        walk.observer.on_eqn(
            walk, eqn, decision, ran_with(decision, eqn, mix_in), duals, outs, rerun
        )
    return outs, _out_marks(spec, eqn, marks, len(outs), walk.backward)


@contextlib.contextmanager
def _eqn_context(eqn: JaxprEqn) -> Iterator[None]:
    name_stack = siu.current_name_stack() + eqn.source_info.name_stack
    with siu.user_context(eqn.source_info.traceback, name_stack=name_stack):
        with eqn.ctx.manager:
            yield


def literal_mark(v: Literal) -> int:
    """The marks of a literal: a constant that follows."""
    del v
    return CONST | FOLLOWS


def eval_jaxpr(
    walk: Walk,
    jaxpr: Jaxpr | ClosedJaxpr,
    consts: Sequence[Any],
    args: Sequence[Any],
    marks: Sequence[int] | None = None,
) -> tuple[list[Any], list[int]]:
    """Evaluates ``jaxpr`` on ``args`` with autocast's decisions and rules.

    Args:
        walk: where and how to walk.
        jaxpr: an open ``Jaxpr`` (then ``consts`` are its constvars' values) or
            a ``ClosedJaxpr`` (then ``consts`` must be empty).
        consts: values of the constvars.
        args: values of the invars.
        marks: per invar, the marks of its value (default: none).

    Returns:
        The output values and their marks.
    """
    if isinstance(jaxpr, ClosedJaxpr):
        if consts:
            raise ValueError("`eval_jaxpr`: pass no `consts` with a ClosedJaxpr.")
        consts = jaxpr.consts
        jaxpr = jaxpr.jaxpr
    walk = walk._copy()  # its own `wide` and `scalars`: never the caller's
    env: dict[Any, Any] = {}
    mk: dict[Any, int] = {}
    for v, x in zip(jaxpr.constvars, consts, strict=True):
        env[v] = x
        mk[v] = CONST
    if marks is None:
        marks = [0] * len(args)
    for v, x, m in zip(jaxpr.invars, args, marks, strict=True):
        env[v] = x
        mk[v] = m
    for eqn in jaxpr.eqns:
        invals = [v.val if type(v) is Literal else env[v] for v in eqn.invars]
        inmarks = [literal_mark(v) if type(v) is Literal else mk[v] for v in eqn.invars]
        w = walk.for_eqn(eqn)
        if w is not walk:
            w.wide, w.scalars = walk.wide, walk.scalars
        with _eqn_context(eqn):
            outs, out_marks = run_eqn(w, eqn, invals, inmarks)
        for v, x, m in zip(eqn.outvars, outs, out_marks, strict=True):
            env[v] = x
            mk[v] = m
        if inmarks and inmarks[0] & CONST and eqn.primitive.name in _SCALAR_VIEWS:
            src = eqn.invars[0]
            known = src.val if type(src) is Literal else walk.scalars.get(src)
            if known is not None and np.ndim(known) == 0:
                walk.scalars[eqn.outvars[0]] = known
    outs = [v.val if type(v) is Literal else env[v] for v in jaxpr.outvars]
    out_marks = [
        literal_mark(v) if type(v) is Literal else mk[v] for v in jaxpr.outvars
    ]
    return outs, out_marks


def jaxpr_fun(
    walk: Walk,
    jaxpr: Jaxpr | ClosedJaxpr,
    consts: Sequence[Any] = (),
    marks: Sequence[int] | None = None,
) -> Callable[..., list[Any]]:
    """``lambda *args: eval_jaxpr(walk, jaxpr, consts, args, marks)[0]``."""

    def fun(*args: Any) -> list[Any]:
        return eval_jaxpr(walk, jaxpr, consts, args, marks)[0]

    return fun
