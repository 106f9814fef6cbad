"""Every import of JAX internals and every JAX-version shim lives here.

A JAX release that renames something breaks this one file. Everything else in
mixprec imports only from ``jax``, ``jax.extend.core``,
``jax.extend.core.primitives`` and ``jax.extend.source_info_util``.

Functions here are grouped by what they reach into: the trace stack, tracing
to jaxprs, custom derivatives, source information.
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax._src import (
    api_util as _api_util,
    config as _config_lib,
    core as _core,
    dtypes as _dtypes,
    source_info_util as _siu_internal,
)
from jax._src.interpreters import ad as _ad, partial_eval as _pe
from jax.extend import linear_util as _lu, source_info_util as _siu
from jax.extend.core import ClosedJaxpr, Jaxpr, jaxpr_as_fun as _jaxpr_as_fun


__all__ = [
    "ClosedJaxpr",
    "Jaxpr",
    "Zero",
    "convert_constvars_jaxpr",
    "get_aval",
    "instantiate_zeros",
    "shard_map_p",
    "trace_to_closed_jaxpr",
]


def _version_tuple(text: str) -> tuple[int, ...]:
    """``(major, minor, patch)`` from a version string (``"0.10.2rc1"``: the
    leading digits of each part)."""
    import re

    parts = []
    for piece in text.split(".")[:3]:
        digits = re.match(r"\d*", piece)
        parts.append(int(digits.group()) if digits and digits.group() else 0)
    return tuple(parts)


#: The installed JAX release as ``(major, minor, patch)``.
JAX_VERSION: tuple[int, ...] = _version_tuple(jax.__version__)

#: The oldest JAX release mixprec supports (``pyproject.toml`` asks for it).
OLDEST_SUPPORTED_JAX: tuple[int, ...] = (0, 10, 2)
#: The newest JAX release line the whole test suite has been run on.
NEWEST_TESTED_JAX: tuple[int, ...] = (0, 12)


class UntestedJaxWarning(UserWarning):
    """The installed JAX is newer than any release mixprec was tested on."""


_warned_untested: list[bool] = []


def warn_if_untested_jax(version: tuple[int, ...] | None = None) -> bool:
    """Warns once per process when JAX is newer than the newest tested release.

    A newer JAX may rename the internals this module reaches into. Returns
    whether the installed (or given) version is untested.

    Examples:
        >>> warn_if_untested_jax((0, 10, 2))
        False
    """
    v = JAX_VERSION if version is None else version
    untested = tuple(v[:2]) > NEWEST_TESTED_JAX
    if untested and not _warned_untested:
        import warnings

        _warned_untested.append(True)
        newest = ".".join(map(str, NEWEST_TESTED_JAX))
        warnings.warn(
            f"mixprec was tested on JAX {'.'.join(map(str, OLDEST_SUPPORTED_JAX))} "
            f"through {newest}.x; JAX {jax.__version__} is newer. If autocast "
            "fails inside a JAX internal, install `jax<"
            f"{NEWEST_TESTED_JAX[0]}.{NEWEST_TESTED_JAX[1] + 1}` and report it.",
            UntestedJaxWarning,
            stacklevel=3,
        )
    return untested


# -- primitives that jax.extend.core.primitives does not export -------------------
try:  # JAX >= 0.6: shard_map lives in jax._src.shard_map
    _shard_map_mod = importlib.import_module("jax._src.shard_map")
except ImportError:  # pragma: no cover - older JAX
    _shard_map_mod = importlib.import_module("jax.experimental.shard_map")
shard_map_p: Any = getattr(_shard_map_mod, "shard_map_p")  # noqa: B009

Zero: Any = getattr(_ad, "Zero")  # noqa: B009
SymbolicZero: Any = jax.custom_derivatives.SymbolicZero


def get_aval(x: Any) -> Any:
    """The abstract value of ``x`` (shape, dtype, weak type, sharding, vma)."""
    return _core.typeof(x)


def is_tracer(x: Any) -> bool:
    """Whether ``x`` is a tracer of some JAX trace."""
    return isinstance(x, _core.Tracer)


def is_staging() -> bool:
    """Whether the current trace stack stages out to a jaxpr (``jit`` and co).

    Under ``jit(grad(f))`` the stack is LinearizeTrace -> DynamicJaxprTrace; under
    an eager ``grad(f)`` it is LinearizeTrace -> EvalTrace. Unknown trace types
    without ``parent_trace`` end the walk (then False: the caller's safe choice).
    """
    t = _core.trace_ctx.trace
    for _ in range(256):
        if t is None:
            return False
        if isinstance(t, _pe.DynamicJaxprTrace):
            return True
        t = getattr(t, "parent_trace", None)
    return False


def ad_mode() -> str | None:
    """Which automatic differentiation the current trace stack is under.

    ``"forward"`` when a ``JVPTrace`` (``jax.jvp``, ``jax.jacfwd``) is on the
    stack, else ``"reverse"`` when a ``LinearizeTrace`` (``jax.grad``,
    ``jax.vjp``, ``jax.linearize``) is, else ``None``. A ``jit`` traced under
    ``grad`` keeps the outer traces as parents, so ``grad(jit(f))`` is reverse.
    """
    t = _core.trace_ctx.trace
    mode = None
    for _ in range(256):
        if t is None:
            break
        name = type(t).__name__
        if name == "JVPTrace":
            return "forward"
        if name == "LinearizeTrace":
            mode = "reverse"
        t = getattr(t, "parent_trace", None)
    return mode


def jaxpr_function(jaxpr: Any) -> tuple[str, str] | None:
    """``(function name, defining file)`` of a traced function, from the debug
    info JAX keeps on its jaxpr (``None`` when it has none)."""
    inner = getattr(jaxpr, "jaxpr", jaxpr)
    dbg = getattr(inner, "debug_info", None)
    src = getattr(dbg, "func_src_info", None)
    if not src or " at " not in src:
        return None
    name, _, where = src.partition(" at ")
    path = where.rsplit(":", 1)[0]
    return name.strip(), path


def _debug_info(fn: Callable, name: str, n_args: int) -> Any:
    return _core.DebugInfo(
        "autocast", name, tuple(f"args[{i}]" for i in range(n_args)), None
    )


def trace_to_closed_jaxpr(
    fn: Callable[..., Sequence[Any]], in_avals: Sequence[Any], *, name: str = "fn"
) -> ClosedJaxpr:
    """Traces ``fn(*args) -> list`` at the exact abstract values ``in_avals``.

    Unlike ``jax.make_jaxpr`` with ``ShapeDtypeStruct``\\ s, this keeps every
    part of the aval (weak type, sharding, varying manual axes under
    ``shard_map``), and it does not reset the axis environment.
    """
    wrapped = _lu.wrap_init(
        lambda *a: list(fn(*a)), debug_info=_debug_info(fn, name, len(in_avals))
    )
    jaxpr, _, consts = _pe.trace_to_jaxpr_dynamic(wrapped, list(in_avals))
    return ClosedJaxpr(jaxpr, consts)


def keep_branch_debug_info(fn: Callable[..., Any], args: Sequence[Any]) -> None:
    """Stores on ``fn`` the debug info ``lax.switch`` (and
    ``lax.platform_dependent``) builds for a branch called on operands shaped
    like ``args``, so that JAX reads it instead of rebuilding it (from the
    function's signature) on every call."""
    _api_util.save_wrapped_fun_debug_info(
        fn, _api_util.debug_info("switch", fn, args, {})
    )


def eval_closed_jaxpr(closed: ClosedJaxpr, *args: Any) -> list[Any]:
    """Evaluates ``closed`` on ``args`` in the current trace.

    When that trace stages out to a jaxpr (directly inside ``jit``), the
    equations are copied into it as they are, as ``jax.jit(..., inline=True)``
    does, instead of being bound one by one; under any other trace (``grad``,
    ``vmap``, eager) they are bound one by one, as ``jax.core.eval_jaxpr`` does.
    """
    from jax.extend import source_info_util as siu

    trace = _core.trace_ctx.trace
    if type(trace) is _pe.DynamicJaxprTrace:
        src = siu.current()
        # (A NumPy argument becomes a constant as `bind` would make it: JAX
        # refuses one that is not canonical.)
        tracers = [
            trace.to_jaxpr_tracer(
                a if isinstance(a, _core.Tracer) else _dtypes.canonicalize_value(a),
                src,
            )
            for a in args
        ]
        out = _pe.inline_jaxpr_into_trace(
            trace, src, closed.jaxpr, closed.consts, *tracers
        )
        return [trace.to_jaxpr_tracer(x, src) for x in out]
    return _core.eval_jaxpr(closed.jaxpr, closed.consts, *args)


def jaxpr_as_fun(closed: ClosedJaxpr) -> Callable[..., list[Any]]:
    """``closed`` as a function of its inputs returning its outputs (a list),
    named after the jaxpr's function."""
    fn = _jaxpr_as_fun(closed)
    name = getattr(closed.jaxpr.debug_info, "func_name", None) or "fn"

    def call(*args: Any) -> list[Any]:
        return list(fn(*args))

    call.__name__ = call.__qualname__ = name
    return call


# One `jit(inline=True)` per operation (a primitive and its parameters, a
# cast to a dtype): under a transformation that does not stage out (`grad`'s
# linearization, `jvp`, `vmap`) JAX handles a nested `jit` from its cached
# jaxpr (linearized once per operand types), where a primitive bound on its
# own is linearized from scratch (its JVP traced and partially evaluated,
# about twice the cost); `jax.numpy`'s functions reach JAX that way too.
# Staged, an inline `jit` leaves the primitive itself.
_CALLS: dict[Any, Callable[..., Any]] = {}
_CALL_LIMIT = 8192


@functools.cache
def _inline_calls_vanish() -> bool:
    """Whether this JAX stages a differentiated inline ``jit`` as the
    primitives it holds (JAX 0.10); JAX 0.11 keeps it a nested call, and then
    the walk binds primitives directly, leaving the program as it was."""
    mul = jax.jit(jax.lax.mul, inline=True)
    staged = jax.make_jaxpr(jax.grad(lambda x: mul(x, x)))(1.0)
    return all(e.primitive.name not in ("jit", "pjit") for e in staged.eqns)


def _transforming(operands: Sequence[Any]) -> bool:
    trace = _core.trace_ctx.trace
    return (
        type(trace) is not _pe.DynamicJaxprTrace
        and not isinstance(trace, _core.EvalTrace)
        and bool(operands)
        and all(isinstance(x, _core.Tracer) and x._trace is trace for x in operands)
        and _inline_calls_vanish()
    )


def call_transformed(key: Any, fn: Callable[..., Any], operands: Sequence[Any]) -> Any:
    """``fn(*operands)``; under a transformation that does not stage out (every
    operand a tracer of it), through an inline ``jit`` of ``fn`` cached under
    ``key`` (hashable; it must name what ``fn`` computes) and the abstract mesh
    in context, which the transformation then handles once per operand types.

    The mesh is part of the key because ``fn`` is made in its context: a
    value ``fn`` holds (a literal operand) is typed on that mesh, and JAX
    refuses it under another one (inside a ``shard_map`` on another mesh)."""
    if not _transforming(operands):
        return fn(*operands)
    key = (key, jax.sharding.get_abstract_mesh())
    try:
        call = _CALLS.get(key)
    except TypeError:  # a part of the key that cannot be hashed
        return fn(*operands)
    if call is None:
        call = jax.jit(fn, inline=True)
        if len(_CALLS) >= _CALL_LIMIT:
            _CALLS.clear()
        _CALLS[key] = call
    return call(*operands)


def match_vma(operands: Sequence[Any]) -> list[Any]:
    """``operands`` made varying over every manual axis one of them varies over
    (inside a ``shard_map`` under its default ``check_vma``; unchanged
    elsewhere), as JAX's ``lax`` functions make the operands of an elementwise
    op. A primitive bound directly (an equation of a jaxpr traced outside the
    ``shard_map``, bound as written) is refused when they differ."""
    return list(_core.auto_insert_reshard(*operands)) if operands else []


def varying_axes(aval: Any) -> frozenset[Any]:
    """The manual mesh axes ``aval`` varies over (inside ``shard_map``; empty
    elsewhere, and where JAX does not check replication)."""
    mat = getattr(aval, "mat", None)
    return frozenset() if mat is None else frozenset(mat.varying)


def bind_transformed(prim: Any, operands: Sequence[Any], params: dict[str, Any]) -> Any:
    """``prim.bind(*operands, **params)``, through :func:`call_transformed`; a
    scalar operand (a jaxpr's literal) is part of the operation, as it would
    be a literal of its jaxpr."""
    if prim.name == "device_put" or "callback" in prim.name:
        # (A transfer or a host call means something else inside a `jit`.)
        return prim.bind(*operands, **params)
    fixed: dict[int, Any] = {}
    traced = []
    for i, x in enumerate(operands):
        if isinstance(x, _core.Tracer):
            traced.append(x)
        elif isinstance(x, bool | int | float | np.generic) or (
            isinstance(x, np.ndarray) and x.ndim == 0
        ):
            fixed[i] = x
        else:
            return prim.bind(*operands, **params)
    n = len(operands)

    def bound(*xs: Any) -> Any:
        rest = iter(xs)
        return prim.bind(
            *(fixed[i] if i in fixed else next(rest) for i in range(n)), **params
        )

    bound.__name__ = bound.__qualname__ = prim.name
    # A scalar by its type, dtype and bits (0.0 and -0.0 differ, NaN equals),
    # and its JAX type where it has one (a jaxpr's literal: weak or not, and
    # the mesh it was typed on, which `bound` binds it with).
    scalars = tuple(
        (
            i,
            type(v),
            np.asarray(v).dtype.str,
            np.asarray(v).tobytes(),
            getattr(v, "aval", None),
        )
        for i, v in fixed.items()
    )
    key = (prim, tuple(sorted(params.items())), n, scalars)
    return call_transformed(key, bound, traced)


def tracing_context() -> Any:
    """What JAX's own tracing caches key on besides a function and its
    operands (the configuration that changes a trace: matmul precision, dtype
    promotion, x64...), and the context it records with an equation staged
    here (compute type, mesh, XLA metadata), interned so equal ones are one
    object. Hashable."""
    return (_config_lib.trace_context(), _core.current_jaxpr_eqn_context())


def trace_without_name_stack(
    fn: Callable[..., Sequence[Any]], in_avals: Sequence[Any], *, name: str = "fn"
) -> ClosedJaxpr:
    """:func:`trace_to_closed_jaxpr` with an empty name stack, for a jaxpr
    replayed at other places (its equations then carry the name stack of
    each place, as ``jit`` traces a body)."""
    with _siu.reset_name_stack():
        return trace_to_closed_jaxpr(fn, in_avals, name=name)


def as_staged(values: Sequence[Any]) -> list[Any]:
    """``values`` as tracers of the trace that stages out to a jaxpr beneath
    the current one (``jit``'s, under ``grad`` or ``vmap`` in ``jit``): what
    they would be as arguments of a jaxpr traced there. Tracers are kept."""
    trace = _core.trace_ctx.trace
    for _ in range(256):
        if trace is None or isinstance(trace, _pe.DynamicJaxprTrace):
            break
        trace = getattr(trace, "parent_trace", None)
    if not isinstance(trace, _pe.DynamicJaxprTrace):
        raise ValueError("`as_staged` needs a trace that stages out (inside `jit`).")
    src = _siu.current()
    return [x if is_tracer(x) else trace.to_jaxpr_tracer(x, src) for x in values]


# Primitives whose staging does more than record the equation (constant
# folding, forwarding an input, their own staging rule): always bound. Except
# two that are everywhere in a program: JAX's staging rules of `reshape` and
# `broadcast_in_dim` with one operand (static shapes) only record it, and a
# `broadcast_in_dim` is forwarded only where it keeps its operand's shape.
_STAGED_SPECIALLY = frozenset(
    [*_pe.const_fold_rules, *_pe.forwarding_rules, *_pe.custom_staging_rules]
)
_RECORDED_WHEN_RESHAPING = frozenset(
    p for p in _STAGED_SPECIALLY if p.name in ("reshape", "broadcast_in_dim")
)


def _staged_specially(eqn: Any) -> bool:
    prim = eqn.primitive
    if prim not in _STAGED_SPECIALLY:
        return False
    if prim not in _RECORDED_WHEN_RESHAPING or len(eqn.invars) != 1:
        return True
    return eqn.invars[0].aval.shape == eqn.outvars[0].aval.shape


def _own_source(eqn: Any) -> tuple[Any, Any] | None:
    """The source info and equation context ``eqn`` is staged with inside its
    own source context (the current name stack extended by its own, its
    traceback; its context), or ``None`` where that needs the context entered:
    no traceback of its own, or XLA metadata around (which the equation's
    merges into)."""
    tb = eqn.source_info.traceback
    if tb is None or _config_lib.xla_metadata_context_manager.value is not None:
        return None
    name_stack = _siu.current_name_stack() + eqn.source_info.name_stack
    return _siu.SourceInfo(tb, name_stack), eqn.ctx


def emit_as_written(
    eqn: Any, invals: Sequence[Any], *, own_context: bool = False
) -> list[Any] | None:
    """Records ``eqn`` as it is in the jaxpr being traced, or returns ``None``.

    When the current trace stages out to a jaxpr and ``invals`` are exactly
    what ``eqn`` was traced with (the literals it holds, tracers of this trace
    with its operands' abstract values), binding it would compute its results'
    abstract values again only to find the ones ``eqn`` records: the equation
    is recorded with those, as ``jax.jit(..., inline=True)`` copies a jaxpr.
    ``None`` (nothing recorded) wherever that does not hold, or staging the
    primitive does more than record it; the caller then binds it. With
    ``own_context``, it is recorded as inside the equation's own source
    context (its name stack and traceback, its equation context) without the
    caller entering it (``None`` where that cannot be done).
    """
    trace = _core.trace_ctx.trace
    if type(trace) is not _pe.DynamicJaxprTrace:
        return None
    prim = eqn.primitive
    if eqn.effects or _staged_specially(eqn):
        return None
    src = ctx = None
    if own_context:
        found = _own_source(eqn)
        if found is None:
            return None
        src, ctx = found
    in_tracers = []
    traced = False
    for v, x in zip(eqn.invars, invals, strict=True):
        if type(v) is _core.Literal:
            if x is not v.val:
                return None
            if src is None:
                src = _siu.current()
            in_tracers.append(_pe.DynamicJaxprTracer(trace, v.aval, v, src))
        elif (
            type(x) is _pe.DynamicJaxprTracer and x._trace is trace and x.aval == v.aval
        ):
            in_tracers.append(x)
            traced = True
        else:
            return None
    if not traced:  # all literals: JAX may fold it eagerly
        return None
    out_avals = [v.aval for v in eqn.outvars]
    if src is None:
        src = _siu.current()
    return trace.emit_eqn(
        in_tracers, out_avals, prim, eqn.params, eqn.effects, src, ctx
    )


def convert_constvars_jaxpr(jaxpr: Jaxpr) -> Jaxpr:
    """Turns the constvars of ``jaxpr`` into leading invars."""
    return _pe.convert_constvars_jaxpr(jaxpr)


def instantiate_zeros(x: Any) -> Any:
    """Turns an AD symbolic zero (``Zero``/``SymbolicZero``) into an array."""
    if isinstance(x, Zero | SymbolicZero):
        aval: Any = x.aval
        return jax.numpy.zeros(aval.shape, aval.dtype)
    return x


def is_symbolic_zero(x: Any) -> bool:
    return isinstance(x, Zero | SymbolicZero)


def custom_jvp_jaxpr(
    jvp_jaxpr_fun: Any, num_primals: int
) -> tuple[Jaxpr, Sequence[Any], Sequence[bool]]:
    """The JVP jaxpr of a ``custom_jvp_call`` with every tangent non-zero.

    Returns ``(jaxpr, consts, out_zeros)``: the jaxpr takes the primals then the
    tangents and returns the primal outputs then the non-zero output tangents.
    """
    jaxpr, consts, out_zeros = jvp_jaxpr_fun.call_wrapped(*([False] * num_primals))
    return jaxpr, consts, out_zeros


def custom_vjp_fwd_jaxpr(
    fwd_jaxpr_thunk: Any, num_primals: int
) -> tuple[Jaxpr, Sequence[Any]]:
    """The forward jaxpr of a ``custom_vjp_call`` with every input non-zero.

    The jaxpr takes the primals and returns the residuals then the primal outputs.
    """
    jaxpr, consts = fwd_jaxpr_thunk.call_wrapped(*([True] * num_primals))
    return jaxpr, consts


def call_custom_vjp_bwd(bwd: Any, *args: Any) -> list[Any]:
    """Calls the flattened user ``bwd`` of a ``custom_vjp_call`` eqn and returns
    the input cotangents.

    JAX 0.11 returns ``(cotangents, logs)`` from it (``logs``: values a
    ``jax.experimental`` log reference collected in the backward pass, empty
    for ordinary code); JAX 0.10 returns the cotangents.
    """
    out = bwd.call_wrapped(*args)
    if JAX_VERSION >= (0, 11):
        cts, _ = out
        return list(cts)
    return list(out)


def eqn_source_summary(source_info: Any) -> str:
    """``"file.py:LINE (function)"`` of the user frame of an eqn, or ``""``."""
    from jax._src import source_info_util as siu

    if source_info is None or source_info.traceback is None:
        return ""
    frame = siu.user_frame(source_info.traceback)  # type: ignore[attr-defined]
    if frame is None:
        return ""
    return f"{frame.file_name}:{frame.start_line} ({frame.function_name})"


def _installed(file_name: str) -> bool:
    """Whether ``file_name`` belongs to an installed package (a library the
    user calls, such as ``flax/linen/linear.py``), not to the user's code."""
    return any(part in file_name for part in _INSTALLED_PARTS)


_INSTALLED_PARTS = (
    f"{os.sep}site-packages{os.sep}",
    f"{os.sep}dist-packages{os.sep}",
)


def eqn_call_site(source_info: Any) -> str:
    """``"file.py:LINE (function)"`` of the innermost frame of the user's own
    code behind an eqn: the first frame outside JAX, mixprec and installed
    packages (for an op inside ``flax/linen/linear.py``: the line that called
    the layer), or ``""``."""
    from jax._src import source_info_util as siu

    if source_info is None or source_info.traceback is None:
        return ""
    for frame in siu.user_frames(source_info.traceback):  # type: ignore[attr-defined]
        if not _installed(frame.file_name):
            return f"{frame.file_name}:{frame.start_line} ({frame.function_name})"
    return ""


def eqn_frame_lines(source_info: Any) -> tuple[tuple[str, int], ...]:
    """``(file, line)`` of every user frame behind an eqn, innermost first: the
    lines whose execution traced it."""
    from jax._src import source_info_util as siu

    if source_info is None or source_info.traceback is None:
        return ()
    return tuple(
        (frame.file_name, frame.start_line)
        for frame in siu.user_frames(source_info.traceback)  # type: ignore[attr-defined]
    )


def eqn_name_stack(source_info: Any) -> str:
    """An eqn's name stack as text (``"transpose(jvp(Net))/Dense_0"``)."""
    if source_info is None:
        return ""
    return str(source_info.name_stack)


def common_source_info(infos: Sequence[Any]) -> Any:
    """The first of ``infos`` with the name stack they all share (the longest
    common prefix of their stacks): the source of one equation that stands for
    several, in the scopes (and transformations) all of them are in, none that
    only some are in. ``infos`` must not be empty."""
    first = infos[0]
    found = [getattr(si.name_stack, "stack", None) for si in infos]
    stacks: list[tuple[Any, ...]] = [st for st in found if st is not None]
    if len(stacks) != len(found):
        return first
    n = 0
    while all(len(st) > n and st[n] == stacks[0][n] for st in stacks):
        n += 1
    if all(len(st) == n for st in stacks):
        return first
    return first.replace(name_stack=first.name_stack[:n])


def eqn_transformed_by(source_info: Any, transform: str) -> bool:
    """Whether an eqn was traced under the named transformation
    (``"transpose"``: JAX's transposition emitted it); see
    `name_stack_transformed_by`."""
    if source_info is None:
        return False
    return name_stack_transformed_by(source_info.name_stack, transform)


def name_stack_transformed_by(name_stack: Any, transform: str) -> bool:
    """Whether a name stack holds the named transformation, read from its
    elements where they are JAX's ``Transform`` records (so a user's scope
    spelled ``"transpose(...)"`` is none), else from its text
    (``"transpose(jvp(Net))/Dense_0"``)."""
    stack = getattr(name_stack, "stack", None)
    transform_type = getattr(_siu_internal, "Transform", None)
    if stack is None or transform_type is None:
        return f"{transform}(" in str(name_stack)
    return any(
        type(elem) is transform_type and elem.name == transform for elem in stack
    )


#: The scope JAX's transposition of a ``jax.checkpoint`` recomputes the
#: checkpointed forward in (inside the transposed body, before its backward).
_REMATERIALIZED = "rematted_computation"


def eqn_rematerialized(source_info: Any) -> bool:
    """Whether an eqn is part of the forward that the transposition of a
    ``jax.checkpoint`` recomputes in its body (the rest of that body is the
    backward pass, its name stack without the ``transpose`` it is under)."""
    if source_info is None:
        return False
    stack = getattr(source_info.name_stack, "stack", None)
    scope_type = getattr(_siu_internal, "Scope", None)
    if stack is None or scope_type is None:
        return _REMATERIALIZED in str(source_info.name_stack).split("/")
    return scope_type(_REMATERIALIZED) in stack


def without_rematerialized(path: str) -> str:
    """``path`` (a layer path) without the scope a checkpoint's recomputed
    forward is in (see :func:`eqn_rematerialized`)."""
    if _REMATERIALIZED not in path:
        return path
    return "/".join(p for p in path.split("/") if p != _REMATERIALIZED)


def as_rematerialized(source_info: Any) -> Any:
    """``source_info`` as that of an equation of a checkpoint's recomputed
    forward (see :func:`eqn_rematerialized`)."""
    stack = _siu_internal.NameStack((_siu_internal.Scope(_REMATERIALIZED),))
    return source_info.replace(name_stack=stack + source_info.name_stack)


# -- equation parameters that JAX versions spell differently -------------------------


def scan_layout(params: dict[str, Any]) -> tuple[int, int]:
    """``(num_consts, num_carry)`` of a ``scan`` equation's operands.

    JAX <= 0.10 has them as ``num_consts``/``num_carry`` params; JAX 0.11 holds
    the operand layout in a ``FlatTree`` (``ft_in``: consts, carry, xs).
    """
    if "num_consts" in params:
        return int(params["num_consts"]), int(params["num_carry"])
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)


def while_layout(params: dict[str, Any]) -> tuple[int, int]:
    """``(cond_nconsts, body_nconsts)`` of a ``while`` equation's operands
    (then the carry; the same params in JAX 0.10 to 0.12)."""
    return int(params["cond_nconsts"]), int(params["body_nconsts"])


def scan_params(params: dict[str, Any], *, extra_consts: int) -> dict[str, Any]:
    """The params of a ``scan`` equation rebound with ``extra_consts`` more
    leading constants (and nothing else changed but the body jaxpr).

    ``params`` are the original equation's params without ``jaxpr``.
    """
    out = dict(params)
    if "num_consts" in out:
        out["num_consts"] = int(out["num_consts"]) + extra_consts
        if "linear" in out:
            out["linear"] = (False,) * extra_consts + tuple(out["linear"])
        return out
    if extra_consts:
        ft = importlib.import_module("jax._src.flattree")
        consts, carry, xs = out["ft_in"].unpack()
        out["ft_in"] = ft.pack((ft.nones(len(consts) + extra_consts), carry, xs))
    return out


def jaxpr_replace(jaxpr: Jaxpr, **changes: Any) -> Jaxpr:
    """``jaxpr`` with ``changes`` (its variables, equations), its debug info
    kept where it still fits and told the argument and result names are
    unknown where the counts changed."""
    dbg = jaxpr.debug_info
    if dbg is not None and (
        len(changes.get("invars", jaxpr.invars)) != len(jaxpr.invars)
        or len(changes.get("outvars", jaxpr.outvars)) != len(jaxpr.outvars)
    ):
        dbg = dbg.with_unknown_names()
    return jaxpr.replace(debug_info=dbg, **changes)


def as_transposed(source_info: Any) -> Any:
    """``source_info`` as that of an equation JAX's transposition emitted
    (see :func:`eqn_transformed_by`): the equations of a transposed
    ``scan``'s body, whose name stacks do not say so (the ``scan`` does)."""
    return source_info.replace(name_stack=source_info.name_stack.transform("transpose"))


def scan_params_more(
    params: dict[str, Any], *, extra_xs: int, extra_ys: int
) -> dict[str, Any]:
    """The params of a ``scan`` equation with ``extra_xs`` more scanned
    operands after its others and ``extra_ys`` more stacked results after its
    others (the body jaxpr is the caller's to replace)."""
    out = dict(params)
    if "num_consts" in out:
        if extra_xs and "linear" in out:
            out["linear"] = tuple(out["linear"]) + (False,) * extra_xs
        return out
    ft = importlib.import_module("jax._src.flattree")
    if extra_xs:
        consts, carry, xs = out["ft_in"].unpack()
        out["ft_in"] = ft.pack((consts, carry, (xs, ft.nones(extra_xs))))
    if extra_ys:
        carry, ys = out["ft_out"].unpack()
        out["ft_out"] = ft.pack((carry, (ys, ft.nones(extra_ys))))
    return out


def registered_primitives(
    modules: Sequence[str] = (),
) -> dict[str, str]:
    """Every primitive defined by the loaded JAX modules: ``{name: module}``.

    Imports ``modules`` first (those that fail to import are skipped), then
    collects the module-level ``Primitive`` objects of every loaded ``jax``
    module, so the answer is what this JAX installation registers, not a
    list written for one release.
    """
    import sys

    from jax.extend.core import Primitive

    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001  (optional parts of JAX: GPU/TPU-only)
            continue
    found: dict[str, str] = {}
    for mod_name, module in list(sys.modules.items()):
        if module is None or not (mod_name == "jax" or mod_name.startswith("jax.")):
            continue
        for value in list(vars(module).values()):
            if isinstance(value, Primitive):
                found.setdefault(value.name, mod_name)
    return found


def shaped_array(shape: Sequence[int], dtype: Any, *, weak_type: bool = False) -> Any:
    """An abstract array value (``ShapedArray``)."""
    return _core.ShapedArray(tuple(shape), dtype, weak_type=weak_type)


# -- the CPU ------------------------------------------------------------------------


def cpu_features() -> dict[str, bool] | None:
    """The CPU features this process can use, as NumPy detected them at run time.

    NumPy's dispatcher asks the CPU itself (``cpuid`` on x86), so this is what
    the process really gets, which ``/proc/cpuinfo`` is not always (a
    hypervisor, or a CPUID mask, may hide features from user space). Keys are
    NumPy's names (``"AVX2"``, ``"AVX512F"``, ``"AVX512BF16"``, ``"ASIMD"``...).
    ``None`` when this NumPy does not expose the table (it is private to NumPy).
    """
    for name in ("numpy._core._multiarray_umath", "numpy.core._multiarray_umath"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        features = getattr(module, "__cpu_features__", None)
        if isinstance(features, dict):
            return {str(k): bool(v) for k, v in features.items()}
    return None


def cudnn_attention_module() -> Any:
    """JAX's cuDNN attention module (tests pretend cuDNN is present with it, to
    export the fused formulation for ``cuda`` from a CPU host)."""
    return importlib.import_module("jax._src.cudnn.fused_attention_stablehlo")


def cudnn_detected() -> bool:
    """Whether JAX finds cuDNN on this host (its own check, asked directly:
    on a host without it, a fused call fails only after JAX has traced it
    and filtered the error's traceback). ``True`` where the check is
    missing: the fused call then decides."""
    check = getattr(cudnn_attention_module(), "check_cudnn_version", None)
    if check is None:
        return True
    try:
        check()
    except RuntimeError:
        return False
    return True


# -- XLA:CPU workarounds ------------------------------------------------------------


def cpu_miscompile_workaround_options(backend: str) -> dict[str, Any]:
    """Compile options that keep XLA:CPU clear of a known miscompilation.

    From jaxlib 0.11, XLA:CPU fuses chains of bfloat16 matmuls and elementwise
    ops into YNNPACK kernels (``"__ynn_fusion"`` in the optimized HLO). On an
    AVX2 host (no AVX-512), jaxlib 0.11.2 and 0.12.0.1 return NaN for part of
    the output of such a fusion, differently from run to run: a hand-written
    bfloat16 MLP (784-128-10, ``log_softmax``) on 1000 rows gave 4276 and 9280
    non-finite values in two runs, none with the fusion off. jaxlib 0.10.2
    makes the same fusions and computes them right (0 non-finite values), so
    the option is only passed from 0.11 on; other backends do not know it.

    Pass the result as ``compiler_options`` to ``.compile()`` (or to
    ``jax.jit``) for code that runs bfloat16 matmuls written by hand. Autocast's
    emulated CPU formulation (the default on CPUs without AVX512-BF16) computes
    its products in float32 and is not affected.

    Examples:
      >>> cpu_miscompile_workaround_options("gpu")
      {}
    """
    if backend != "cpu" or JAX_VERSION < (0, 11):
        return {}
    return {"xla_cpu_experimental_ynn_fusion_type": ""}
