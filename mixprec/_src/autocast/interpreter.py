"""The autocast interpreter: re-runs a jaxpr equation by equation with cast rules.

:func:`eval_jaxpr` walks a jaxpr like ``jax.core.eval_jaxpr`` (literals read
through ``read``, ``zip(strict=True)``, each equation under its user source
context and ``eqn.ctx.manager``), decides each equation's precision with
:func:`decide_eqn` and runs it with the rule from ``rules._cast_rules``.

It also tracks, per variable, whether the value comes straight from a parameter,
constant or literal (``from_param``): such float32 values follow the half
operand of gray ops (``bf16 activation + f32 bias`` stays bf16). On CPU, where a
dot's product is float32 before rounding, such a bias add right after a dot runs
on the float32 product instead and is rounded once (:func:`_dot_epilogue`).

The numerics tools build on :func:`make_context`, :func:`apply_eqn`,
:func:`decide_eqn` and :func:`trace_records`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import source_info_util as siu
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal

from mixprec._src import _compat
from mixprec._src.autocast import regions, rules
from mixprec._src.autocast.modes import (
    Decision,
    decide,
    effective_low_dtype,
    validate_mode,
)
from mixprec._src.autocast.op_lists import HIGHER_ORDER, OpLists, default_op_lists
from mixprec._src.autocast.rules import CastContext, dtype_of, is_floating
from mixprec._src.policy import Policy, get_global_policy, get_policy


__all__ = [
    "CastContext",
    "EqnRecord",
    "apply_eqn",
    "decide_eqn",
    "eval_jaxpr",
    "make_context",
    "trace_records",
]

# Equations created by mixprec point at the user code that caused them.
siu.register_exclusion(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))

_F32 = np.dtype(np.float32)

# True while a higher-order rule traces a body only to learn its output dtypes.
_probing: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "mixprec_probing", default=False
)


@contextlib.contextmanager
def probing() -> Iterator[None]:
    """Suppresses records while a body is traced only for its output types."""
    token = _probing.set(True)
    try:
        yield
    finally:
        _probing.reset(token)


@dataclasses.dataclass(frozen=True)
class EqnRecord:
    """What autocast did with one equation (for ``mixprec.explain``).

    Attributes:
        primitive: the primitive name (``"dot_general"``), or the composite name
            for a recognised nested function run as a whole.
        source: ``"file.py:LINE (function)"`` of the user code, or ``""``.
        path: the nesting, e.g. ``"jit(f)/scan/body"`` (``""`` at top level).
        in_dtypes: the dtypes the op ran with (after casts), as strings.
        out_dtypes: the dtypes of its results, as strings.
        in_shapes: the input shapes.
        out_shapes: the output shapes.
        op_class: ``"allow"``, ``"deny"``, ``"infer"`` or ``"clear"``.
        decision: ``"low"``, ``"float32"`` or ``"original"``.
        dtype: the dtype floating inputs were cast to, or None.
        reason: why (list, mode, region, rule).
        flops: an estimate of the floating-point operations (times the trip
            count of an enclosing ``scan``).

    Examples:
        >>> import jax.numpy as jnp
        >>> from mixprec._src.autocast.interpreter import trace_records
        >>> recs = trace_records(lambda x: jnp.exp(x @ x), jnp.ones((2, 2)),
        ...                      policy="mixed_bfloat16")
        >>> [(r.primitive, r.decision) for r in recs]
        [('dot_general', 'low'), ('exp', 'float32')]
    """

    primitive: str
    source: str
    path: str
    in_dtypes: tuple[str, ...]
    out_dtypes: tuple[str, ...]
    in_shapes: tuple[tuple[int, ...], ...]
    out_shapes: tuple[tuple[int, ...], ...]
    op_class: str
    decision: str
    dtype: str | None
    reason: str
    flops: int


# ------------------------------------------------------------------ contexts


def _platform() -> str:
    return jax.default_backend()


def make_context(
    policy: Policy | str | None = None,
    *,
    mode: str = "allow_mix_precision",
    mixlist: Any = None,
    strict: bool = False,
    forward_mode_ad: bool = False,
    lists: OpLists | None = None,
    recorder: list | None = None,
) -> CastContext:
    """Builds the :class:`CastContext` that :func:`mixprec.autocast` would use.

    Args:
        policy: a policy or policy string; None means the global policy.
        mode: the precision mode.
        mixlist: a ``modify_mixlist`` spec (dict, JSON string or path) applied
            to the default lists, or None.
        strict: raise for primitives in no list.
        forward_mode_ad: formulate dots so that forward-mode AD works.
        lists: start from these lists instead of the defaults.
        recorder: a list to receive :class:`EqnRecord` objects.

    Returns:
        The context.

    Examples:
        >>> ctx = make_context("mixed_float16", mode="allow_mix_precision_bf16")
        >>> ctx.low_dtype
        dtype(bfloat16)
    """
    pol = get_global_policy() if policy is None else get_policy(policy)
    validate_mode(mode)
    base = default_op_lists() if lists is None else lists
    if mixlist is not None:
        from mixprec._src.autocast.mixlist import modify_mixlist

        base = modify_mixlist(base, mixlist)
    return CastContext(
        policy=pol,
        mode=mode,
        lists=base,
        low_dtype=effective_low_dtype(mode, pol.compute_dtype),
        strict=bool(strict),
        platform=_platform(),
        recorder=recorder,
        forward_mode_ad=bool(forward_mode_ad),
    )


def with_policy(ctx: CastContext, policy: Policy) -> CastContext:
    """``ctx`` with another policy (and the low dtype that follows from it)."""
    return dataclasses.replace(
        ctx,
        policy=policy,
        low_dtype=effective_low_dtype(ctx.mode, policy.compute_dtype),
    )


def sub_context(ctx: CastContext, path: str, *, trip_count: int = 1) -> CastContext:
    """The context for the body of a higher-order equation at ``path``."""
    full = f"{ctx.path}/{path}" if ctx.path else path
    return dataclasses.replace(
        ctx,
        path=full,
        trip_count=ctx.trip_count * max(int(trip_count), 1),
        eqn=None,
        decision=None,
        from_param=(),
    )


def region_context(ctx: CastContext, eqn: JaxprEqn) -> CastContext:
    """``ctx`` adjusted for the region (if any) named in ``eqn``'s name stack."""
    stack = eqn.source_info.name_stack
    if not stack:
        return ctx
    found = regions.parse_name_stack(str(stack))
    if found is None:
        return ctx
    kind, value = found
    if kind == "float32":
        if ctx.region == "float32":
            return ctx
        return dataclasses.replace(ctx, region="float32", composite="")
    if kind == "policy":
        return dataclasses.replace(with_policy(ctx, value), region="", composite="")
    if kind == "ctx":
        return dataclasses.replace(
            value,
            recorder=ctx.recorder,
            path=ctx.path,
            trip_count=ctx.trip_count,
        )
    # a composite named by a module scope / named_scope
    if ctx.composite == value or ctx.region == "float32":
        return ctx
    return dataclasses.replace(ctx, composite=value)


# ------------------------------------------------------------------ decisions


def decide_eqn(
    ctx: CastContext,
    eqn: JaxprEqn,
    in_dtypes: Sequence[Any],
    from_param: Sequence[bool] = (),
) -> Decision:
    """Decides how ``eqn`` runs, given the dtypes its inputs arrive in.

    Wraps :func:`mixprec._src.autocast.modes.decide` with the regions
    (:func:`mixprec.float32_scope`, :func:`mixprec.precision_scope`, composite
    module scopes) and the op-list overrides of ``ctx``.

    Args:
        ctx: the context (as from :func:`make_context`).
        eqn: the jaxpr equation.
        in_dtypes: the dtypes of its inputs, in order.
        from_param: per input, whether it comes straight from a parameter,
            constant or literal.

    Returns:
        The :class:`Decision`.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> jaxpr = jax.make_jaxpr(lambda x: jnp.exp(x))(jnp.ones(2))
        >>> ctx = make_context("mixed_bfloat16")
        >>> decide_eqn(ctx, jaxpr.eqns[0], [jnp.dtype(jnp.bfloat16)]).dtype
        dtype('float32')
    """
    ctx = region_context(ctx, eqn)
    return _decide(ctx, eqn, in_dtypes, from_param)


_OPAQUE = np.dtype(np.uint32)


def _plain_dtype(dtype: Any) -> np.dtype:
    """NumPy dtype for ``decide``: extended dtypes (PRNG keys) become opaque."""
    if isinstance(dtype, np.dtype):
        return dtype
    try:
        if jnp.issubdtype(dtype, jax.dtypes.extended):
            return _OPAQUE
        return np.dtype(dtype)
    except TypeError:
        return _OPAQUE


def _decide(
    ctx: CastContext,
    eqn: JaxprEqn,
    in_dtypes: Sequence[Any],
    from_param: Sequence[bool],
) -> Decision:
    name = eqn.primitive.name
    in_dtypes = [_plain_dtype(d) for d in in_dtypes]
    if ctx.region == "float32":
        return Decision(
            ctx.lists.classify(name),
            None,
            "inside mixprec.float32_scope(): original precision",
        )
    if eqn.primitive not in rules._cast_rules and not _known(ctx, name):
        if ctx.strict:
            _check_classified(ctx, eqn)
        return Decision("infer", None, rules._ORIGINAL_REASON)
    if ctx.composite:
        d = decide(
            ctx.composite,
            in_dtypes,
            mode=ctx.mode,
            lists=ctx.lists,
            low_dtype=ctx.low_dtype,
            from_param=from_param,
        )
        if d.dtype is None and ctx.lists.classify(name) == "clear":
            return d
        return Decision(d.op_class, d.dtype, f"inside {ctx.composite}: {d.reason}")
    return decide(
        name,
        in_dtypes,
        mode=ctx.mode,
        lists=ctx.lists,
        low_dtype=ctx.low_dtype,
        from_param=from_param,
    )


def _known(ctx: CastContext, name: str) -> bool:
    return name in HIGHER_ORDER or name in ctx.lists.names()


def _check_classified(ctx: CastContext, eqn: JaxprEqn) -> None:
    name = eqn.primitive.name
    try:
        ctx.lists.classify(name, strict=True)
    except NotImplementedError:
        where = _compat.eqn_source_summary(eqn.source_info) or "unknown location"
        raise NotImplementedError(
            f"No cast rule for primitive '{name}' (at {where}) and it is in no op "
            "list, so `autocast(..., strict=True)` cannot decide its precision. "
            "Register a rule with `mixprec.register_rule(primitive, rule)` or add "
            "it to a list with `mixlist={'gray-list': {'to-add': "
            f"['{name}']}}}}`."
        ) from None


# ------------------------------------------------------------------ running


def _label(ctx: CastContext, decision: Decision | None) -> str:
    if decision is None or decision.dtype is None:
        return "original"
    if decision.dtype == ctx.low_dtype and ctx.low_dtype != _F32:
        return "low"
    if decision.dtype == _F32:
        return "float32"
    return "original"


def _aval(v: Any) -> Any:
    return v.aval


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in np.shape(x))


def _flops(eqn: JaxprEqn, outs: Sequence[Any]) -> int:
    name = eqn.primitive.name
    try:
        if name == "dot_general":
            (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
            lhs: Any
            rhs: Any
            lhs, rhs = (v.aval for v in eqn.invars)
            rfree = [d for i, d in enumerate(rhs.shape) if i not in rc and i not in rb]
            return 2 * math.prod(lhs.shape) * math.prod(rfree)
        if name == "conv_general_dilated":
            rhs = eqn.invars[1].aval
            out: Any = eqn.outvars[0].aval
            dn = eqn.params["dimension_numbers"]
            o = rhs.shape[dn.rhs_spec[0]] if dn is not None else rhs.shape[0]
            return 2 * math.prod(out.shape) * (math.prod(rhs.shape) // max(o, 1))
    except (AttributeError, KeyError, TypeError, ValueError):
        pass
    return int(sum(math.prod(_shape(o)) for o in outs if is_floating(o)))


def _record(
    ctx: CastContext,
    eqn: JaxprEqn,
    ran_with: Sequence[Any],
    outs: Sequence[Any],
    decision: Decision | None,
    *,
    primitive: str | None = None,
) -> None:
    if ctx.recorder is None or _probing.get():
        return
    ctx.recorder.append(
        EqnRecord(
            primitive=primitive or eqn.primitive.name,
            source=_compat.eqn_source_summary(eqn.source_info),
            path=ctx.path,
            in_dtypes=tuple(str(d) for d in ran_with),
            out_dtypes=tuple(str(dtype_of(o)) for o in outs),
            in_shapes=tuple(_shape(_aval(v)) for v in eqn.invars),
            out_shapes=tuple(_shape(o) for o in outs),
            op_class=decision.op_class if decision is not None else "clear",
            decision=_label(ctx, decision),
            dtype=None
            if decision is None or decision.dtype is None
            else str(decision.dtype),
            reason=decision.reason if decision is not None else "",
            flops=_flops(eqn, outs) * ctx.trip_count,
        )
    )


def record_composite(
    ctx: CastContext,
    eqn: JaxprEqn,
    name: str,
    invals: Sequence[Any],
    outs: Sequence[Any],
    decision: Decision,
) -> None:
    """Records a nested function recognised as composite ``name``."""
    ran = [
        decision.dtype
        if (decision.dtype is not None and is_floating(x))
        else dtype_of(x)
        for x in invals
    ]
    _record(ctx, eqn, ran, outs, decision, primitive=name)


def _ran_with(ctx: CastContext, eqn: JaxprEqn, invals: Sequence[Any], d: Decision):
    out = []
    for x, v in zip(invals, eqn.invars, strict=True):
        if not is_floating(x):
            out.append(dtype_of(x))
        elif (
            ctx.region == "float32"
            or rules.runs_original(d)
            or (d.dtype is None and _mixed_dtypes(invals))
        ):
            out.append(_aval(v).dtype)
        elif d.dtype is not None:
            out.append(d.dtype)
        else:
            out.append(dtype_of(x))
    return out


def _mixed_dtypes(invals: Sequence[Any]) -> bool:
    return len({dtype_of(x) for x in invals if is_floating(x)}) > 1


_EPILOGUE_OPS = frozenset({"add", "sub"})


def _dot_epilogue(
    ctx: CastContext,
    eqn: JaxprEqn,
    invals: Sequence[Any],
    in_from_param: Sequence[bool],
    decision: Decision,
) -> tuple[Any, Decision] | None:
    """Runs a bias add on the float32 product of the dot that feeds it.

    ``dot(x, w) + b`` with ``b`` a float32 parameter would otherwise round the
    CPU dot's float32 product to the low dtype, round ``b`` too, add, and round
    again. Adding in float32 and rounding once is what a GEMM epilogue does
    (cuBLAS, oneDNN): the result has the same dtype, is at least as accurate,
    and XLA:CPU fuses the add into the rounding instead of emitting separate
    kernels for ``convert(b)``, the add and, in the backward pass, a low
    precision reduction for the bias gradient. Returns ``(out, decision)``, or
    None when ``eqn`` is not such an add.
    """
    if (
        not ctx.epilogues
        or eqn.primitive.name not in _EPILOGUE_OPS
        or ctx.region == "float32"
        or decision.dtype is None
        or decision.dtype != ctx.low_dtype
        or len(invals) != 2
    ):
        return None
    wide = [ctx.epilogues.get(id(x)) for x in invals]
    dot_side = [w is not None and w[0] is x for w, x in zip(wide, invals, strict=True)]
    if sum(dot_side) != 1:
        return None
    other = 1 - dot_side.index(True)
    if not (in_from_param[other] and is_floating(invals[other])):
        return None
    product = wide[1 - other]
    assert product is not None
    args = list(invals)
    args[1 - other] = product[1]
    args[other] = rules.cast(invals[other], _F32)
    out = rules.cast(rules.bind(eqn.primitive, args, eqn.params), decision.dtype)
    why = (
        f"{decision.reason}; fused into the dot before it: added in float32 "
        f"to its float32 product, rounded once to {decision.dtype}"
    )
    return out, Decision(decision.op_class, _F32, why)


def run_eqn(
    ctx: CastContext,
    eqn: JaxprEqn,
    invals: Sequence[Any],
    in_from_param: Sequence[bool],
) -> tuple[list[Any], bool]:
    """Runs one equation under ``ctx``. Returns ``(outs, out_from_param)``."""
    ctx = region_context(ctx, eqn)
    prim = eqn.primitive
    if prim in rules._hop_primitives:
        rule = rules._cast_rules[prim]
        ectx = dataclasses.replace(ctx, eqn=eqn, from_param=tuple(in_from_param))
        outs = rule(ectx, *invals, **eqn.params)
        outs = list(outs) if prim.multiple_results else [outs]
        return outs, False
    in_dtypes = [dtype_of(x) for x in invals]
    decision = _decide(ctx, eqn, in_dtypes, in_from_param)
    fused = _dot_epilogue(ctx, eqn, invals, in_from_param, decision)
    if fused is not None:
        out, decision = fused
        if ctx.recorder is not None:
            _record(ctx, eqn, [_F32] * len(invals), [out], decision)
        return [out], False
    ectx = dataclasses.replace(
        ctx, eqn=eqn, decision=decision, from_param=tuple(in_from_param)
    )
    rule = rules.get_rule(prim)
    outs = rule(ectx, *invals, **eqn.params)
    outs = list(outs) if prim.multiple_results else [outs]
    if ctx.recorder is not None:
        _record(ctx, eqn, _ran_with(ctx, eqn, invals, decision), outs, decision)
    out_fp = decision.op_class in ("clear", "infer") and all(in_from_param)
    return outs, out_fp


def apply_eqn(
    ctx: CastContext,
    eqn: JaxprEqn,
    invals: list,
    *,
    from_param: Sequence[bool] | None = None,
) -> list:
    """Runs ONE jaxpr equation the way autocast would: decision, casts, rule.

    Works on concrete or traced values. For higher-order primitives the
    higher-order rule runs (the body is interpreted too).

    Args:
        ctx: the context (as from :func:`make_context`).
        eqn: the equation.
        invals: its input values, in order (Literals' values included).
        from_param: per input, whether it comes straight from a parameter or
            literal; defaults to True for literals, False otherwise.

    Returns:
        The list of output values.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> jaxpr = jax.make_jaxpr(lambda x, w: x @ w)(jnp.ones((2, 2)),
        ...                                             jnp.ones((2, 2)))
        >>> ctx = make_context("mixed_bfloat16")
        >>> [y] = apply_eqn(ctx, jaxpr.eqns[0], [jnp.ones((2, 2))] * 2)
        >>> y.dtype
        dtype(bfloat16)
    """
    if from_param is None:
        from_param = [isinstance(v, Literal) for v in eqn.invars]
    with _eqn_context(eqn):
        outs, _ = run_eqn(ctx, eqn, list(invals), list(from_param))
    return outs


@contextlib.contextmanager
def _eqn_context(eqn: JaxprEqn) -> Iterator[None]:
    name_stack = siu.current_name_stack() + eqn.source_info.name_stack
    with siu.user_context(eqn.source_info.traceback, name_stack=name_stack):
        with eqn.ctx.manager:
            yield


def eval_jaxpr(
    ctx: CastContext,
    jaxpr: Jaxpr | ClosedJaxpr,
    consts: Sequence[Any],
    args: Sequence[Any],
    *,
    from_param: Sequence[bool] | None = None,
) -> list[Any]:
    """Evaluates ``jaxpr`` on ``args`` with autocast's decisions and rules.

    Args:
        ctx: the context.
        jaxpr: an open ``Jaxpr`` (then ``consts`` are its constvars' values) or
            a ``ClosedJaxpr`` (then ``consts`` must be empty).
        consts: values of the constvars.
        args: values of the invars.
        from_param: per invar, whether the value comes straight from a
            parameter or literal (constvars always do). Defaults to all False.

    Returns:
        The output values.
    """
    if isinstance(jaxpr, ClosedJaxpr):
        if consts:
            raise ValueError("`eval_jaxpr`: pass no `consts` with a ClosedJaxpr.")
        consts = jaxpr.consts
        jaxpr = jaxpr.jaxpr
    if ctx.platform == "cpu":
        # Float32 products of this jaxpr's dots, for bias adds that follow them.
        ctx = dataclasses.replace(ctx, epilogues={})
    env: dict[Any, Any] = {}
    fp: dict[Any, bool] = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, Literal) else env[v]

    def read_fp(v: Any) -> bool:
        return True if isinstance(v, Literal) else fp.get(v, False)

    if from_param is None:
        from_param = [False] * len(args)
    for v, x in zip(jaxpr.constvars, consts, strict=True):
        env[v] = x
        fp[v] = True
    for v, x, p in zip(jaxpr.invars, args, from_param, strict=True):
        env[v] = x
        fp[v] = bool(p)
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        in_fp = [read_fp(v) for v in eqn.invars]
        with _eqn_context(eqn):
            outs, out_fp = run_eqn(ctx, eqn, invals, in_fp)
        for v, x in zip(eqn.outvars, outs, strict=True):
            env[v] = x
            fp[v] = out_fp
    return [read(v) for v in jaxpr.outvars]


def jaxpr_fun(
    ctx: CastContext,
    jaxpr: Jaxpr | ClosedJaxpr,
    consts: Sequence[Any] = (),
    *,
    from_param: Sequence[bool] | None = None,
) -> Callable[..., list[Any]]:
    """``lambda *args: eval_jaxpr(ctx, jaxpr, consts, args)``."""

    def fun(*args: Any) -> list[Any]:
        return eval_jaxpr(ctx, jaxpr, consts, args, from_param=from_param)

    return fun


# ------------------------------------------------------------------ records


def trace_records(
    fn: Callable[..., Any],
    *args: Any,
    policy: Policy | str | None = None,
    mode: str = "allow_mix_precision",
    mixlist: Mapping | str | os.PathLike | None = None,
    strict: bool = False,
    **kwargs: Any,
) -> list[EqnRecord]:
    """Traces ``autocast(fn)(*args, **kwargs)`` and returns one record per op.

    Nothing is executed: the function is traced and re-interpreted with a
    recorder. Composites run as a whole (a nested ``jit`` such as ``_var``)
    appear as one record named after the composite, followed by their body.

    Args:
        fn: the function.
        *args: example arguments (arrays or ``jax.ShapeDtypeStruct``).
        policy: the policy (None: the global policy).
        mode: the precision mode.
        mixlist: a ``modify_mixlist`` spec, or None.
        strict: as for :func:`mixprec.autocast`.
        **kwargs: keyword arguments for ``fn``.

    Returns:
        The records, in execution order (bodies of higher-order primitives
        inline, with their ``path``).

    Examples:
        >>> import jax.numpy as jnp
        >>> recs = trace_records(lambda x: (x @ x).sum(), jnp.ones((2, 2)),
        ...                      policy="mixed_bfloat16")
        >>> [(r.primitive, r.out_dtypes[0]) for r in recs]
        [('dot_general', 'bfloat16'), ('reduce_sum', 'float32')]
    """
    from mixprec._src.autocast import api

    recorder: list[EqnRecord] = []
    ctx = make_context(
        policy, mode=mode, mixlist=mixlist, strict=strict, recorder=recorder
    )
    api.trace_transformed(fn, ctx, args, kwargs)
    return recorder
