"""The cast-rule table of the autocast interpreter.

One private table, :data:`_cast_rules`, maps a JAX primitive to the rule that
runs it under autocast (STYLE §2, after checkify's ``error_checks`` and
``mlir.register_lowering``). A rule has the signature of :class:`CastRule`::

    rule(ctx: CastContext, *invals, **params) -> Array | list[Array]

``ctx`` carries the configuration (policy, mode, op lists, low dtype) and, for
the equation being run, ``ctx.eqn``, ``ctx.decision`` (what
:func:`mixprec._src.autocast.modes.decide` chose) and ``ctx.from_param``.

Primitives without an entry run through :func:`default_rule`: floating inputs
are cast to ``ctx.decision.dtype`` and the primitive is bound again. Higher-order
primitives get their rules in :mod:`mixprec._src.autocast.hop_rules`.
"""

from __future__ import annotations

import dataclasses
import functools as ft
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import ClosedJaxpr, Jaxpr, Primitive, primitives as P

from mixprec._src.autocast import dots
from mixprec._src.autocast.modes import Decision
from mixprec._src.autocast.op_lists import OpLists
from mixprec._src.policy import Policy


__all__ = [
    "CastContext",
    "CastRule",
    "cast_floating",
    "default_rule",
    "is_floating",
    "register_rule",
]

_F32 = np.dtype(np.float32)


@dataclasses.dataclass(frozen=True)
class CastContext:
    """Everything a cast rule needs to know (immutable, hashable).

    The first fields are the configuration of one :func:`mixprec.autocast` call;
    the interpreter derives a per-equation copy (``dataclasses.replace``) that
    also carries the equation, its decision and its ``from_param`` flags.

    Attributes:
        policy: the :class:`mixprec.Policy` in effect.
        mode: the precision mode (see ``mixprec._src.autocast.modes.MODES``).
        lists: the :class:`OpLists` (allow / deny / infer / clear).
        low_dtype: the dtype allow-list ops run in (the policy's compute dtype or
            the mode's own).
        strict: raise ``NotImplementedError`` for a primitive in no list.
        platform: the backend dots and convolutions are formulated for.
        recorder: a list that receives an ``EqnRecord`` per equation, or None.
        forward_mode_ad: formulate dots so that ``jax.jvp`` works (no
            ``custom_vjp``).
        region: ``"float32"`` inside :func:`mixprec.float32_scope`, else ``""``.
        composite: the composite op (``"layer_norm"``, ...) whose body is being
            run, or ``""``.
        path: where the equation sits (``"jit(f)/scan/body"``), for records.
        trip_count: how many times the enclosing body runs (FLOP counts).
        eqn: the equation being run (per-equation copies only).
        decision: its :class:`Decision` (per-equation copies only).
        from_param: per input, whether it comes straight from a parameter,
            constant or literal (per-equation copies only).
        epilogues: ``id(result) -> (result, wide)`` for the low-precision
            results of CPU dots in the jaxpr being run, where ``wide`` is the
            float32 product before rounding. A bias add that follows such a
            dot runs on ``wide`` (see ``interpreter._dot_epilogue``). ``None``
            where there is no float32 product (GPU/TPU).

    Examples:
        >>> from mixprec._src.autocast.interpreter import make_context
        >>> ctx = make_context("mixed_bfloat16")
        >>> ctx.low_dtype, ctx.mode
        (dtype(bfloat16), 'allow_mix_precision')
    """

    policy: Policy
    mode: str
    lists: OpLists
    low_dtype: np.dtype
    strict: bool = False
    platform: str = "cpu"
    recorder: list | None = dataclasses.field(default=None, compare=False)
    forward_mode_ad: bool = False
    region: str = ""
    composite: str = ""
    path: str = ""
    trip_count: int = dataclasses.field(default=1, compare=False)
    eqn: Any = dataclasses.field(default=None, compare=False)
    decision: Decision | None = dataclasses.field(default=None, compare=False)
    from_param: tuple[bool, ...] = dataclasses.field(default=(), compare=False)
    epilogues: dict[int, tuple[Any, Any]] | None = dataclasses.field(
        default=None, compare=False
    )

    def __hash__(self) -> int:
        return hash(
            (
                self.policy,
                self.mode,
                self.lists,
                self.low_dtype,
                self.strict,
                self.platform,
                self.forward_mode_ad,
                self.region,
                self.composite,
                self.path,
            )
        )


class CastRule(Protocol):
    """The signature of a cast rule (see the module docstring)."""

    def __call__(self, ctx: CastContext, *invals: Any, **params: Any) -> Any: ...


#: Primitive -> rule. Populated below and in ``hop_rules``; extended by users
#: through :func:`register_rule`.
_cast_rules: dict[Primitive, CastRule] = {}
#: Primitives whose rule recurses into a sub-jaxpr (no decision, no record).
_hop_primitives: set[Primitive] = set()


def register_rule(
    primitive: Primitive,
    rule: CastRule | None = None,
    *,
    override: bool = False,
) -> Any:
    """Registers how autocast runs ``primitive``; usable as a decorator.

    The rule is called as ``rule(ctx, *invals, **params)`` with the values the
    equation receives (possibly already in a low dtype) and the equation's
    params; it returns the output (a list for primitives with multiple
    results). ``ctx.decision.dtype`` is the dtype the op lists and the mode
    chose for the op's floating inputs (``None``: keep the received dtypes), and
    :func:`cast_floating` applies it.

    Args:
        primitive: a ``jax.extend.core.Primitive``.
        rule: the rule. If omitted, returns a decorator.
        override: replace an existing rule instead of raising.

    Returns:
        ``rule`` (or a decorator that registers and returns its argument).

    Raises:
        TypeError: ``primitive`` is not a Primitive or ``rule`` not callable.
        ValueError: ``primitive`` already has a rule and ``override`` is False.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> import mixprec
        >>> from jax.extend.core import Primitive
        >>> double_p = Primitive("double")
        >>> double_p.def_impl(lambda x: 2 * x)
        <function <lambda> ...>
        >>> double_p.def_abstract_eval(lambda x: x)
        <function <lambda> ...>
        >>> @mixprec.register_rule(double_p)
        ... def _double_rule(ctx, x):
        ...     return double_p.bind(x.astype(ctx.low_dtype))
        >>> f = mixprec.autocast(lambda x: double_p.bind(x), "p=f32,c=bf16,o=bf16")
        >>> jaxpr = jax.make_jaxpr(f)(jnp.ones(2))
        >>> [(e.primitive.name, str(e.outvars[0].aval.dtype)) for e in jaxpr.eqns]
        [('convert_element_type', 'bfloat16'), ('double', 'bfloat16')]
        >>> mixprec.register_rule(double_p, _double_rule)
        Traceback (most recent call last):
        ...
        ValueError: ...already has a cast rule...
    """
    if not isinstance(primitive, Primitive):
        raise TypeError(
            "`register_rule(primitive, ...)` expects a jax.extend.core.Primitive, "
            f"got {type(primitive).__name__} instead."
        )

    def register(r: CastRule) -> CastRule:
        if not callable(r):
            raise TypeError(
                f"`register_rule(..., rule=...)` must be callable, got "
                f"{type(r).__name__} instead."
            )
        if primitive in _cast_rules and not override:
            raise ValueError(
                f"Primitive '{primitive.name}' already has a cast rule. Pass "
                "`override=True` to `mixprec.register_rule` to replace it."
            )
        _cast_rules[primitive] = r
        _hop_primitives.discard(primitive)
        return r

    if rule is None:
        return register
    return register(rule)


# ----------------------------------------------------------------- helpers


def is_floating(x: Any) -> bool:
    """Whether ``x`` is a (real) floating array or scalar.

    Examples:
        >>> import jax.numpy as jnp
        >>> is_floating(jnp.ones(2)), is_floating(jnp.ones(2, jnp.int32))
        (True, False)
    """
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return isinstance(x, float)
    try:
        return bool(jnp.issubdtype(dtype, jnp.floating))
    except TypeError:  # extended dtypes (PRNG keys)
        return False


def dtype_of(x: Any) -> np.dtype:
    """The dtype of an array, tracer or scalar."""
    dtype = getattr(x, "dtype", None)
    if dtype is not None:
        return dtype
    return np.dtype(jnp.result_type(x))


def cast(x: Any, dtype: np.dtype) -> Any:
    """Casts one floating value to ``dtype`` (no-op if it already has it).

    NumPy constants (the values of jaxpr ``Literal``\\ s) stay NumPy, so that they
    are staged out as literals rather than as a ``convert_element_type``.
    """
    if not is_floating(x) or dtype_of(x) == dtype:
        return x
    if isinstance(x, np.ndarray | np.generic):
        return np.asarray(x, dtype=dtype)
    return lax.convert_element_type(x, dtype)


def cast_floating(vals: Sequence[Any], dtype: Any) -> list[Any]:
    """Casts every floating value in ``vals`` to ``dtype``; others untouched.

    Examples:
        >>> import jax.numpy as jnp
        >>> a, b = cast_floating([jnp.ones(2), jnp.ones(2, jnp.int32)], jnp.bfloat16)
        >>> a.dtype, b.dtype
        (dtype(bfloat16), dtype('int32'))
    """
    dt = jnp.dtype(dtype)
    return [cast(x, dt) for x in vals]


def cast_to_avals(vals: Sequence[Any], avals: Sequence[Any]) -> list[Any]:
    """Casts floating values to the dtypes of ``avals`` (the original types)."""
    return [
        cast(x, a.dtype) if is_floating(x) and is_floating(a) else x
        for x, a in zip(vals, avals, strict=True)
    ]


def original_avals(ctx: CastContext) -> list[Any]:
    """The abstract values the current equation's inputs had when traced."""
    return [v.aval for v in ctx.eqn.invars]


def canonical_params(params: dict[str, Any]) -> dict[str, Any]:
    """Canonicalises dtype-valued params (``jnp.bfloat16`` -> ``np.dtype``)."""
    out = {}
    for k, v in params.items():
        if k in ("new_dtype", "preferred_element_type", "dtype") and v is not None:
            try:
                v = jnp.dtype(v)
            except TypeError:
                pass
        out[k] = v
    return out


def _has_jaxpr_params(params: dict[str, Any]) -> bool:
    for v in params.values():
        if isinstance(v, Jaxpr | ClosedJaxpr):
            return True
        if isinstance(v, tuple | list) and any(
            isinstance(x, Jaxpr | ClosedJaxpr) for x in v
        ):
            return True
    return False


#: Primitives whose semantics depend on the exact input dtypes (bit patterns,
#: host callbacks): they always run at the dtypes they were traced with.
ORIGINAL_ONLY: frozenset[str] = frozenset(
    {
        "bitcast_convert_type",
        "nextafter",
        "pure_callback",
        "io_callback",
        "debug_callback",
        "debug_print",
        "reduce_precision",
    }
)


def bind(prim: Primitive, invals: Sequence[Any], params: dict[str, Any]) -> Any:
    """``prim.bind(*invals, **params)`` with the params canonicalised."""
    return prim.bind(*invals, **canonical_params(params))


def default_rule(prim: Primitive, ctx: CastContext, *invals: Any, **params: Any) -> Any:
    """The rule for primitives without their own: cast, then bind.

    Floating inputs are cast to ``ctx.decision.dtype``. If the decision is
    ``None`` the op runs at the dtypes it received, except inside
    :func:`mixprec.float32_scope` and for primitives whose semantics or params
    are tied to their traced dtypes (sub-jaxprs, bitcasts, host callbacks),
    which run at their original dtypes.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from mixprec._src.autocast.rules import default_rule
        >>> default_rule  # doctest: +ELLIPSIS
        <function default_rule at ...>
    """
    decision = ctx.decision
    eqn = ctx.eqn
    if (
        ctx.region == "float32"
        or runs_original(decision)
        or prim.name in ORIGINAL_ONLY
        or _has_jaxpr_params(params)
        or (decision is not None and decision.dtype is None and _mixed(invals))
    ):
        invals = tuple(cast_to_avals(invals, original_avals(ctx)))
    elif decision is not None and decision.dtype is not None:
        invals = tuple(cast_floating(invals, decision.dtype))
    del eqn
    return bind(prim, invals, params)


_ORIGINAL_REASON = "in no op list and no rule: runs at its original dtypes"


def runs_original(decision: Decision | None) -> bool:
    """Whether ``decision`` is the one for a primitive autocast does not know."""
    return decision is not None and decision.reason == _ORIGINAL_REASON


def _mixed(invals: Sequence[Any]) -> bool:
    dts = {dtype_of(x) for x in invals if is_floating(x)}
    return len(dts) > 1


def _convert_element_type_rule(ctx: CastContext, x: Any, **params: Any) -> Any:
    # The cast the user wrote: keep its target dtype. (An `astype` to the dtype a
    # value already has leaves no equation, see regions.py.)
    del ctx
    return bind(P.convert_element_type_p, [x], params)


def _out_dtype_for(ctx: CastContext, low: np.dtype) -> np.dtype:
    del ctx
    return low


def _matmul_low_dtype(ctx: CastContext, lhs: Any, rhs: Any) -> np.dtype | None:
    """The 16-bit dtype a dot/conv runs in through ``dots.py``, or ``None`` to
    run it as the default rule does (float32 regions and decisions, integer
    operands, or a decision to keep the received dtypes)."""
    low = None if ctx.decision is None else ctx.decision.dtype
    if (
        ctx.region == "float32"
        or low is None
        or not (is_floating(lhs) and is_floating(rhs))
        or low == _F32
        or low.itemsize > 2
    ):
        return None
    return low


def _dot_general_rule(
    ctx: CastContext,
    lhs: Any,
    rhs: Any,
    *,
    dimension_numbers: Any,
    precision: Any = None,
    preferred_element_type: Any = None,
    out_sharding: Any = None,
    **params: Any,
) -> Any:
    low = _matmul_low_dtype(ctx, lhs, rhs)
    all_params = dict(
        dimension_numbers=dimension_numbers,
        precision=precision,
        preferred_element_type=preferred_element_type,
        out_sharding=out_sharding,
        **params,
    )
    if low is None:
        return default_rule(P.dot_general_p, ctx, lhs, rhs, **all_params)
    out_dtype = _out_dtype_for(ctx, low)
    # On CPU the product is float32 before it is rounded to `out_dtype`; keep
    # it, so that a bias add right after the dot can use it (one rounding, and
    # one XLA kernel fewer per layer: see `interpreter._dot_epilogue`).
    keep_wide = ctx.epilogues is not None and out_dtype != _F32
    res = dots.dot_general(
        lhs,
        rhs,
        dimension_numbers=dimension_numbers,
        precision=precision,
        preferred_element_type=preferred_element_type,
        low_dtype=low,
        out_dtype=_F32 if keep_wide else out_dtype,
        forward_mode_ad=ctx.forward_mode_ad,
        out_sharding=out_sharding,
        platform=ctx.platform,
    )
    if not keep_wide:
        return res
    out = lax.convert_element_type(res, out_dtype)
    assert ctx.epilogues is not None
    ctx.epilogues[id(out)] = (out, res)
    return out


def _conv_general_dilated_rule(ctx: CastContext, lhs: Any, rhs: Any, **params: Any):
    low = _matmul_low_dtype(ctx, lhs, rhs)
    if low is None:
        return default_rule(P.conv_general_dilated_p, ctx, lhs, rhs, **params)
    return dots.conv_general_dilated(
        lhs,
        rhs,
        low_dtype=low,
        out_dtype=_out_dtype_for(ctx, low),
        forward_mode_ad=ctx.forward_mode_ad,
        platform=ctx.platform,
        **params,
    )


_cast_rules[P.convert_element_type_p] = _convert_element_type_rule
_cast_rules[P.dot_general_p] = _dot_general_rule
_cast_rules[P.conv_general_dilated_p] = _conv_general_dilated_rule


def get_rule(prim: Primitive) -> Callable[..., Any]:
    """The registered rule for ``prim``, or the default rule bound to it."""
    rule = _cast_rules.get(prim)
    if rule is None:
        return ft.partial(default_rule, prim)
    return rule
